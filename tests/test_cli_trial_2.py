"""A new user's trial of custom ops in their published layouts (PointNet++'s
three_interpolate, FlowNet2's correlation, Mamba's causal_conv1d): what broke, pinned.

A C++ op registered without a shape function (as the README's own example is) has
outputs of unknown rank in a graph, and so have the gradients TensorFlow hands its
registered gradient; the generated gradient must still run, in chunks too.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from harness import Case, FakeOp, generate

# PointNet++ three_interpolate: points (b, c, m), idx (b, n, 3), weight (b, n, 3) -> (b, c, n)
THREE_INTERPOLATE = Case(
    "out[b,c,n] = sum(points[b, c, idx[b,n,k]] * weight[b,n,k], k)",
    {"points": (2, 4, 9), "weight": (2, 6, 3)},
    index_inputs={"idx": ((2, 6, 3), 0, 9)},
    inputs=("points", "idx", "weight"),
)


def _three_interpolate_inputs(rng):
    points = tf.constant(rng.standard_normal((2, 4, 9)))
    idx = tf.constant(rng.integers(0, 9, (2, 6, 3)), tf.int32)
    weight = tf.constant(rng.random((2, 6, 3)))
    return points, idx, weight


def _autodiff(points, idx, weight, grad_out):
    """TF float64 autodiff of the kernel's loop written with tf.gather."""
    with tf.GradientTape() as tape:
        tape.watch([points, weight])
        rows = tf.gather(points, tf.broadcast_to(idx[:, None], [2, 4, 6, 3]), axis=2, batch_dims=2)
        out = tf.reduce_sum(rows * weight[:, None], -1)
    return tape.gradient(out, [points, weight], output_gradients=grad_out)


@pytest.mark.parametrize("budget", [None, 64], ids=["whole", "in-chunks"])
def test_registered_gradient_of_an_op_without_a_shape_function(tmp_path, budget):
    """Under tf.function with unknown dims, the op's output and its gradient have unknown
    rank (no shape function); the gradient in chunks sliced them by rank and raised
    `TypeError: 'NoneType' object cannot be interpreted as an integer`."""
    module = generate(THREE_INTERPOLATE, tmp_path, prefix="ThreeInterpolate")
    if budget is not None:
        module.MAX_TEMP_BYTES = budget
    rng = np.random.default_rng(0)
    points, idx, weight = _three_interpolate_inputs(rng)
    out = module.forward(points, idx, weight)
    grad_out = tf.constant(rng.standard_normal(out.shape))
    unknown = tf.TensorSpec(None, tf.float64)

    @tf.function(
        input_signature=[
            tf.TensorSpec([None, None, None], tf.float64),
            tf.TensorSpec([None, None, 3], tf.int32),
            tf.TensorSpec([None, None, 3], tf.float64),
            unknown,
            unknown,
        ]
    )
    def registered(points, idx, weight, out, grad_out):
        return module.gradient(FakeOp([points, idx, weight], [out], {}, module), grad_out)

    grad_points, grad_idx, grad_weight = registered(points, idx, weight, out, grad_out)
    want_points, want_weight = _autodiff(points, idx, weight, grad_out)
    assert grad_idx is None
    np.testing.assert_allclose(grad_points.numpy(), want_points.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad_weight.numpy(), want_weight.numpy(), rtol=1e-12, atol=1e-12)


# FlowNet2's correlation (kernel_size 1) in its layout: (b, c, h, w) -> (b, (2R+1)^2, oh, ow)
FLOWNET2_SPEC = """\
[ops.Flownet2Correlation]
formula = "out[b,(u,v),i,j] = mean(input1[b, c, s1*i + md - pad, s1*j + md - pad] * input2[b, c, s1*i + md - pad + s2*(u - R), s1*j + md - pad + s2*(v - R)], c)"
inputs = ["input1", "input2"]
attrs = { pad = "int", md = "int", s1 = "int", s2 = "int" }
let = { R = "md // s2" }
ranges = { u = "2*R + 1", v = "2*R + 1", i = "(input1.shape[2] + 2*pad - 2*md + s1 - 1) // s1", j = "(input1.shape[3] + 2*pad - 2*md + s1 - 1) // s1" }
"""


@pytest.mark.parametrize("attr", ["s1", "s2"])
def test_check_names_a_zero_stride_attr_that_divides_a_range(tmp_path, attr):
    """`--attr s2=0` divides the let R = md // s2 by zero, `--attr s1=0` the ranges of i
    and j: check said `internal error in symgrad (TypeError: Cannot convert complex to
    int)`; it names the op and the attr, as the module does when called."""
    (tmp_path / "symgrad.toml").write_text(FLOWNET2_SPEC, encoding="utf-8")
    run = [sys.executable, "-m", "symgrad"]
    subprocess.run([*run, "generate"], cwd=tmp_path, check=True, capture_output=True)
    result = subprocess.run(
        [*run, "check", "--attr", f"{attr}=0"],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line == (
        f"error: symgrad.toml [ops.Flownet2Correlation]: attr {attr} is 0; it scales an "
        "index or divides a range, and must be positive"
    )


def test_registered_gradient_of_a_recurrence_without_a_shape_function():
    from generated import linear_recurrence as module

    rng = np.random.default_rng(0)
    a = tf.constant(rng.random((2, 5, 3)))
    x = tf.constant(rng.standard_normal((2, 5, 3)))
    h = module.forward(a, x)
    grad_h = tf.constant(rng.standard_normal((2, 5, 3)))
    unknown = tf.TensorSpec(None, tf.float64)

    @tf.function(input_signature=[unknown] * 4)
    def registered(a, x, h, grad_h):
        return module.gradient(FakeOp([a, x], [h], {}, module), grad_h)

    got = registered(a, x, h, grad_h)
    for g, w in zip(got, module.vjp(a, x, grad_h), strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["chamfer_distance", "chamfer_distance_both"])
def test_a_tiled_module_traces_without_node_name_warnings(name, monkeypatch):
    """The chunk loops are tf.functions whose arguments TF names graph nodes after; an
    argument named `_n` logged "`_n` is not a valid node name" on every trace. They are
    named tile_n, tile_c, ... (names the spec refuses for inputs); chamfer_distance_both
    is tiled in parts, whose backward also takes the earlier parts' gradients."""
    import importlib
    import logging

    module = importlib.import_module(f"generated.{name}")

    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 64)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((2, 7, 3)))
    z = tf.constant(rng.standard_normal((2, 5, 3)))
    assert module._tile_plan(x, z) is not None  # in chunks
    messages = []

    class Handler(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Handler()
    tf.get_logger().addHandler(handler)
    try:
        spec = tf.TensorSpec([None, None, None], tf.float64)

        @tf.function(input_signature=[spec, spec])
        def traced(x, z):
            outputs = module.forward(x, z)
            return outputs, module.vjp(x, z, *[tf.ones_like(o) for o in tf.nest.flatten(outputs)])

        (outputs, grads) = traced(x, z)
    finally:
        tf.get_logger().removeHandler(handler)
    assert not [m for m in messages if "not a valid node name" in m], messages
    eager = module.forward(x, z)
    ones = [tf.ones_like(o) for o in tf.nest.flatten(eager)]
    want = (*tf.nest.flatten(eager), *tf.nest.flatten(module.vjp(x, z, *ones)))
    got = (*tf.nest.flatten(outputs), *tf.nest.flatten(grads))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("count, summary", [(1, "(1 op)"), (2, "(2 ops)")])
def test_check_counts_its_ops_in_the_singular_and_plural(count, summary):
    """`symgrad check` on a spec of one op said "all checks passed (1 ops)"."""
    from symgrad.check import OpReport, Report, Result, render_table

    ops = tuple(
        OpReport(f"Op{k}", (Result("forward", True, 0.0, 1e-12),), {"i": 3}, {"x": (3,)}, ())
        for k in range(count)
    )
    report = Report("symgrad.toml", None, "float64", 0, ops)
    assert render_table(report).splitlines()[-1] == f"all checks passed {summary}"

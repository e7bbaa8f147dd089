"""Segment max, min and logsumexp written with a mask, `max(where(seg[n] == v, x[n,f],
-inf), n)`: segment kernels forward, reads at the ids backward (ties split equally), in
every target, never an N x V mask."""

from __future__ import annotations

import ast
import time

import numpy as np
import pytest
import tensorflow as tf
from harness import Case, check, generate, op_spec
from peaks import run_tensorflow, torch_peak

from symgrad.pipeline import module_text

CASES = {
    # tf.math.unsorted_segment_max over rows (symgrad.toml's RowsSegmentMax)
    "segment_max": Case(
        "y[v,f] = max(where(seg[n] == v, x[n,f], -inf), n)",
        {"x": (11, 3)},
        attrs={"V": 4},
        ranges={"v": "V"},
        sizes={"v": 4},
        index_inputs={"seg": ((11,), 0, 4)},
    ),
    # a min of a nonlinearity
    "segment_min_tanh": Case(
        "y[v,f] = min(where(seg[n] == v, tanh(x[n,f]) * w[f], inf), n)",
        {"x": (10, 2), "w": (2,)},
        attrs={"V": 3},
        ranges={"v": "V"},
        sizes={"v": 3},
        index_inputs={"seg": ((10,), 0, 3)},
    ),
    # torch_scatter's batched scatter_max over dim 1: segments are (b, v) pairs
    "batched_segment_max": Case(
        "y[b,v,f] = max(where(seg[b,n] == v, x[b,n,f], -inf), n)",
        {"x": (2, 13, 3)},
        attrs={"V": 4},
        ranges={"v": "V"},
        sizes={"v": 4},
        index_inputs={"seg": ((2, 13), 0, 4)},
    ),
    # torch_scatter's scatter_logsumexp (ids out of range add nothing)
    "segment_logsumexp": Case(
        "y[v,f] = log(sum(where(seg[n] == v, exp(x[n,f]), 0), n))",
        {"x": (12, 3)},
        attrs={"V": 3},
        ranges={"v": "V"},
        sizes={"v": 3},
        index_inputs={"seg": ((12,), -1, 4)},
    ),
    # mmcv's roiaware_pool3d max with the voxel id flattened: ids per roi r over points'
    # features without r (the gradient of f summed over r, read at row r*V + vox[r,n];
    # it was an [f,r,v,n] mask), an empty voxel 0
    "roiaware_max": Case(
        "y[r,v,c] = where(sum(where(vox[r,n] == v, 1, 0), n) > 0, "
        "max(where(vox[r,n] == v, f[n,c], -inf), n), 0)",
        {"f": (9, 3)},
        attrs={"V": 5},
        ranges={"v": "V"},
        sizes={"v": 5},
        index_inputs={"vox": ((2, 9), -1, 6)},
    ),
    # a segment logsumexp per (r, v) of rows shared by every r
    "batched_ids_shared_logsumexp": Case(
        "y[r,v,c] = log(sum(where(vox[r,n] == v, exp(f[n,c]), 0), n))",
        {"f": (12, 2)},
        attrs={"V": 3},
        ranges={"v": "V"},
        sizes={"v": 3},
        index_inputs={"vox": ((2, 12), 0, 3)},
    ),
}


def _bodies(text: str) -> list[str]:
    tree = ast.parse(text)
    return [
        ast.get_source_segment(text, node)
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in ("_compute", "_backward")
    ]


@pytest.mark.parametrize("name", sorted(CASES))
def test_segment_extrema_are_exact_and_never_a_dense_mask(name, tmp_path):
    case = CASES[name]
    text = module_text(op_spec(case, "SegmentExtrema"), "test.toml")
    compute, backward = _bodies(text)
    assert "unsorted_segment_m" in compute
    assert "gather(" in backward  # the gradient reads the results at the ids
    for body in (compute, backward):
        assert "tf.range(tf.cast(_n_v" not in body  # no iota over v: no N x V mask
    check(case, generate(case, tmp_path, prefix="SegmentExtrema"))


# The JAX target compiles every path (about 12 s a case): batched ids here, max, min and
# logsumexp against the loops below.
IN_EVERY_TARGET = [(name, "pytorch") for name in sorted(CASES)] + [("batched_segment_max", "jax")]


@pytest.mark.parametrize(("name", "target"), IN_EVERY_TARGET)
def test_segment_extrema_in_every_target(name, target, tmp_path):
    from target_harness import check_in_target

    check_in_target(CASES[name], target, tmp_path)


# ------------------------------------------------- against loops over the rows, in NumPy

FORMULAS = {
    "max": "y[v,f] = max(where(seg[n] == v, x[n,f], -inf), n)",
    "min": "y[v,f] = min(where(seg[n] == v, x[n,f], inf), n)",
    "logsumexp": "y[v,f] = log(sum(where(seg[n] == v, exp(x[n,f]), 0), n))",
}


def _loops(kind: str, seg, x, V: int, grad):
    """The op and its gradient row by row: ties split the gradient equally, an empty
    segment is -inf (+inf for min) and ids outside [0, V) take no part."""
    N, F = x.shape
    y = np.full((V, F), np.inf if kind == "min" else -np.inf)
    members = [[n for n in range(N) if seg[n] == v] for v in range(V)]
    for v in range(V):
        for f in range(F):
            values = [x[n, f] for n in members[v]]
            if not values:
                continue
            if kind == "max":
                y[v, f] = max(values)
            elif kind == "min":
                y[v, f] = min(values)
            else:
                peak = max(values)
                y[v, f] = peak + np.log(sum(np.exp(u - peak) for u in values))
    dx = np.zeros_like(x)
    for v in range(V):
        for f in range(F):
            if kind == "logsumexp":
                for n in members[v]:
                    dx[n, f] = grad[v, f] * np.exp(x[n, f] - y[v, f])
                continue
            ties = [n for n in members[v] if x[n, f] == y[v, f]]
            for n in ties:
                dx[n, f] = grad[v, f] / len(ties)
    return y, dx


def _data(seed: int = 0):
    """13 rows, 3 features, V = 5: values in {0, 1, 2} (ties everywhere), ids -2, -1, 5
    and 6 out of range, segments 2 and 4 empty."""
    rng = np.random.default_rng(seed)
    seg = rng.choice([-2, -1, 0, 1, 3, 5, 6], size=13).astype(np.int32)
    seg[:3] = [0, 1, 3]
    x = rng.integers(0, 3, size=(13, 3)).astype(np.float64)
    grad = rng.standard_normal((5, 3))
    return seg, x, 5, grad


def _spec_case(kind: str) -> Case:
    return Case(
        FORMULAS[kind],
        {"x": (13, 3)},
        attrs={"V": 5},
        ranges={"v": "V"},
        sizes={"v": 5},
        index_inputs={"seg": ((13,), -2, 7)},
    )


def _tf_step(module, seg, x, V, grad):
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = module.forward(tf.constant(seg), x, V=V)
    return y.numpy(), tape.gradient(y, x, output_gradients=tf.constant(grad)).numpy()


def _torch_step(module, seg, x, V, grad):
    import torch

    leaf = torch.tensor(x, requires_grad=True)
    y = module.forward(torch.tensor(seg), leaf, V=V)
    (dx,) = torch.autograd.grad(y, leaf, torch.tensor(grad))
    return y.detach().numpy(), dx.numpy()


def _jax_step(module, seg, x, V, grad):
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    y, pullback = jax.vjp(lambda u: module.forward(jnp.asarray(seg), u, V=V), jnp.asarray(x))
    (dx,) = pullback(jnp.asarray(grad))
    return np.asarray(y), np.asarray(dx)


STEPS = {"tensorflow": _tf_step, "pytorch": _torch_step, "jax": _jax_step}


@pytest.mark.parametrize("target", sorted(STEPS))
@pytest.mark.parametrize("kind", sorted(FORMULAS))
def test_segment_extrema_match_loops_with_ties_empty_segments_and_ids_out_of_range(
    kind, target, tmp_path
):
    pytest.importorskip({"pytorch": "torch", "jax": "jax"}.get(target, "tensorflow"))
    seg, x, V, grad = _data()
    want_y, want_dx = _loops(kind, seg, x, V, grad)
    assert np.isinf(want_y[[2, 4]]).all()  # the data has empty segments
    if kind != "logsumexp":  # and ties: some gradient is split
        assert 0 < np.abs(want_dx).min(initial=1, where=want_dx != 0) < np.abs(grad).max()
    module = generate(_spec_case(kind), tmp_path, prefix="SegmentLoops", target=target)
    y, dx = STEPS[target](module, seg, x, V, grad)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-12, atol=1e-12)
    assert np.isfinite(dx).all()


def test_segment_max_with_unknown_sizes_under_tf_function(tmp_path):
    seg, x, V, grad = _data(1)
    want_y, want_dx = _loops("max", seg, x, V, grad)
    module = generate(_spec_case("max"), tmp_path, prefix="SegmentUnknown")

    @tf.function(
        input_signature=[
            tf.TensorSpec([None], tf.int32),
            tf.TensorSpec([None, None], tf.float64),
            tf.TensorSpec([None, None], tf.float64),
        ]
    )
    def step(seg, x, grad):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = module.forward(seg, x, V=V)
        return y, tape.gradient(y, x, output_gradients=grad)

    y, dx = step(tf.constant(seg), tf.constant(x), tf.constant(grad))
    np.testing.assert_array_equal(y.numpy(), want_y)
    np.testing.assert_allclose(dx.numpy(), want_dx, rtol=1e-12, atol=1e-12)


def _unbounded(kind: str):
    """9 rows, 2 features, V = 6: segment 0 all -inf (as log 0 gives), 1 empty, 2 normal
    with a tie, 3 the lowest float next to -inf (feature 0) and all -inf (feature 1), 4
    the lowest float alone, 5 empty, and ids -1 and 6 out of range; for min, negated."""
    lowest = np.finfo(np.float64).min
    seg = np.array([0, 0, 2, 2, 3, 3, 4, -1, 6], np.int32)
    x = np.array(
        [
            [-np.inf, -np.inf],
            [-np.inf, -np.inf],
            [1.0, -2.0],
            [1.0, 0.5],
            [lowest, -np.inf],
            [-np.inf, -np.inf],
            [lowest, 3.0],
            [5.0, 5.0],
            [-np.inf, 7.0],
        ]
    )
    grad = np.random.default_rng(2).standard_normal((6, 2))
    return seg, x if kind == "max" else -x, 6, grad


@pytest.mark.parametrize("target", sorted(STEPS))
@pytest.mark.parametrize("kind", ["max", "min"])
def test_a_segment_of_rows_all_minus_inf_is_minus_inf_not_the_lowest_float(kind, target, tmp_path):
    """TF's unsorted_segment_max starts each segment from the lowest float, and
    max(lowest, -inf) is lowest: a segment whose rows were all -inf gave -1.797e308
    (+1.797e308 for min), where the max as written, PyTorch and JAX give -inf (and its
    rows, tied at -inf, split the gradient). A row that is the lowest float keeps it;
    whole and in chunks."""
    pytest.importorskip({"pytorch": "torch", "jax": "jax"}.get(target, "tensorflow"))
    seg, x, V, grad = _unbounded(kind)
    want_y, want_dx = _loops(kind, seg, x, V, grad)
    sign = 1.0 if kind == "max" else -1.0
    assert (want_y[[0, 1, 5]] == -sign * np.inf).all() and want_y[3, 1] == -sign * np.inf
    assert want_y[3, 0] == want_y[4, 0] == sign * np.finfo(np.float64).min
    case = Case(
        FORMULAS[kind],
        {"x": (9, 2)},
        attrs={"V": V},
        ranges={"v": "V"},
        sizes={"v": V},
        index_inputs={"seg": ((9,), -1, 7)},
    )
    module = generate(case, tmp_path, prefix="SegmentUnbounded", target=target)
    for budget in (2**40, 1):
        module.MAX_TEMP_BYTES = budget
        y, dx = STEPS[target](module, seg, x, V, grad)
        np.testing.assert_array_equal(y, want_y)
        np.testing.assert_allclose(dx, want_dx, rtol=1e-12, atol=1e-12)


# ------------------------------------ 200k points into 50k segments: O(N·F), no N x V


def _big(seed: int = 0):
    """N = 200,000 rows of F = 4 into V = 50,000 segments (a dense mask: 4e10 entries)."""
    rng = np.random.default_rng(seed)
    seg = rng.integers(-1, 50_001, size=200_000).astype(np.int32)
    x = rng.standard_normal((200_000, 4)).astype(np.float32)
    grad = rng.standard_normal((50_000, 4)).astype(np.float32)
    return seg, x, 50_000, grad


@pytest.mark.parametrize("target", sorted(STEPS))
def test_a_segment_max_of_200k_rows_into_50k_segments_is_linear(target, tmp_path):
    """A training step runs in seconds (the dense [F, V, N] mask would be 160 GB), and
    PyTorch's and JAX's peaks stay within 4x the inputs and outputs plus the budget."""
    pytest.importorskip({"pytorch": "torch", "jax": "jax"}.get(target, "tensorflow"))
    seg, x, V, grad = _big()
    module = generate(_spec_case("max"), tmp_path, prefix="SegmentBig", target=target)
    io = seg.nbytes + x.nbytes + grad.nbytes
    bound = 4 * io + module.MAX_TEMP_BYTES
    start = time.perf_counter()
    if target == "pytorch":
        import torch

        ts, tx, tg = torch.tensor(seg), torch.tensor(x, requires_grad=True), torch.tensor(grad)

        def step():
            return torch.autograd.grad(module.forward(ts, tx, V=V), tx, tg)

        y, dx = STEPS[target](module, seg, x, V, grad)
        assert torch_peak(step) <= bound
    elif target == "jax":
        import jax
        import jax.numpy as jnp

        def loss(u, seg, g):
            return jnp.sum(module.forward(seg, u, V=V) * g)

        compiled = jax.jit(jax.grad(loss)).lower(x, seg, grad).compile()
        stats = compiled.memory_analysis()
        assert stats.temp_size_in_bytes + stats.output_size_in_bytes <= bound
        dx = np.asarray(compiled(x, seg, grad))
        y = np.asarray(module.forward(seg, x, V=V))
    else:
        y, dx = STEPS[target](module, seg, x, V, grad)
    assert time.perf_counter() - start < 60
    # spot checks against the loops' rule at a few segments
    for v in (0, 17, 49_999):
        rows = np.flatnonzero(seg == v)
        np.testing.assert_array_equal(y[v], x[rows].max(axis=0))
        winners = x[rows] == y[v]
        np.testing.assert_allclose(dx[rows], np.where(winners, grad[v], 0), rtol=1e-6)
    assert not dx[(seg < 0) | (seg >= V)].any()


def _wide(seed: int = 1):
    """60,000 rows of 48 features into 700 segments: the rows dominate the inputs and
    outputs (11 MiB), so a budget of 256 KiB leaves no room for spare [N, F] tensors."""
    rng = np.random.default_rng(seed)
    seg = rng.integers(0, 700, size=60_000).astype(np.int32)
    x = rng.standard_normal((60_000, 48)).astype(np.float32)
    grad = rng.standard_normal((700, 48)).astype(np.float32)
    return seg, x, 700, grad


# What a step holds, at most, in multiples of its inputs and outputs (measured: TensorFlow
# eagerly 3.21x for max, 3.31x for min, PyTorch 2.30x, JAX 1.97x at this size; 4.13x,
# 4.18x, 3.27x and 1.97x before the row tables were written into their one use).
WIDE_LIMITS = {"tensorflow": 3.6, "pytorch": 2.6, "jax": 2.3}


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_wide_segment_extrema_hold_at_most_4x_their_inputs_and_outputs(
    target, kind, tmp_path, request
):
    """With many features per row the budget no longer hides spare [N, F] tensors: the
    backward reads the incoming gradient and the tie count at the rows as one table
    (`g / count`, one gather) and folds the winners' mask into the `where`, and the row
    tables are written into the expressions that read them (symgrad/lower/row_reads.py),
    so no Python name keeps one alive after its use: an eager TensorFlow step holds 3.3x
    the inputs and outputs (4.2x before), PyTorch 2.3x (3.3x), JAX 2.0x, each within
    `WIDE_LIMITS` (below 4x) plus 256 KiB."""
    pytest.importorskip({"pytorch": "torch", "jax": "jax"}.get(target, "tensorflow"))
    seg, x, V, grad = _wide()
    io = seg.nbytes + x.nbytes + grad.nbytes
    bound = WIDE_LIMITS[target] * io + 256 * 1024
    if target == "tensorflow":  # the eager step, measured in `tensorflow_peaks`' process
        held = request.getfixturevalue("tensorflow_peaks")[f"wide eager {kind}"]
    module = generate(_spec_case(kind), tmp_path, prefix="SegmentWide", target=target)
    module.MAX_TEMP_BYTES = 256 * 1024
    if target == "pytorch":
        import torch

        ts, tx, tg = torch.tensor(seg), torch.tensor(x, requires_grad=True), torch.tensor(grad)

        def step():
            return torch.autograd.grad(module.forward(ts, tx, V=V), tx, tg)

        step()
        held = torch_peak(step)
    elif target == "jax":
        import jax
        import jax.numpy as jnp

        def loss(u, seg, g):
            return jnp.sum(module.forward(seg, u, V=V) * g)

        stats = jax.jit(jax.grad(loss)).lower(x, seg, grad).compile().memory_analysis()
        held = stats.temp_size_in_bytes + stats.output_size_in_bytes
    print(f"{target} {kind}: {held / io:.2f}x the inputs and outputs")
    assert held <= bound
    y, dx = STEPS[target](module, seg[:5000], x[:5000], V, grad)  # and still right
    want_y, want_dx = _loops(kind, seg[:5000], x[:5000].astype(np.float64), V, grad)
    np.testing.assert_allclose(y, want_y, rtol=1e-6)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)


TF_PEAK = """
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, {tests!r})
import tensorflow as tf
import test_segment_extrema as T
from harness import generate
from peaks import peak as measure

found = {{}}
# First, in a heap no larger step has used (as in a fresh process): the eager step of the
# wide case for test_wide_segment_extrema_hold_at_most_4x_their_inputs_and_outputs, the
# inputs and the incoming gradient made beforehand.
seg, x, V, grad = (tf.constant(a) if hasattr(a, "shape") else a for a in T._wide())
for kind in ("max", "min"):
    module = generate(T._spec_case(kind), Path(tempfile.mkdtemp()), prefix="SegmentWideEager")
    module.MAX_TEMP_BYTES = 256 * 1024

    def eager_step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = module.forward(seg, x, V=V)
        return tape.gradient(y, x, output_gradients=grad)

    found[f"wide eager {{kind}}"] = measure(eager_step)

seg, x, V, grad = T._big()
for kind in sorted(T.FORMULAS):
    module = generate(T._spec_case(kind), Path(tempfile.mkdtemp()), prefix="SegmentBig")
    T._tf_step(module, seg, x, V, grad)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    T._tf_step(module, seg, x, V, grad)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    found[kind] = (peak, module.MAX_TEMP_BYTES)

# Wide rows under tf.function (a graph frees each tensor after its last use; the eager
# step is test_wide_segment_extrema_hold_at_most_4x_their_inputs_and_outputs)
seg, x, V, grad = (tf.constant(a) for a in T._wide())
module = generate(T._spec_case("max"), Path(tempfile.mkdtemp()), prefix="SegmentWide")
module.MAX_TEMP_BYTES = 256 * 1024


@tf.function
def step(seg, x, grad):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = module.forward(seg, x, V=V)
    return tape.gradient(y, x, output_gradients=grad)


step(seg, x, grad)
tf.config.experimental.reset_memory_stats("CPU:0")
before = tf.config.experimental.get_memory_info("CPU:0")["current"]
step(seg, x, grad)
peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
found["wide under tf.function"] = (peak, module.MAX_TEMP_BYTES)

print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def tensorflow_peaks():
    """`TF_PEAK`'s peaks, measured once in a fresh process (CPU statistics need
    `TF_CPU_ALLOCATOR_USE_BFC`) for the tests of this file that read TensorFlow's."""
    from pathlib import Path

    return run_tensorflow(TF_PEAK.format(tests=str(Path(__file__).parent)))


def test_tensorflow_segment_extrema_of_200k_rows_stay_within_the_bound(tensorflow_peaks):
    """TensorFlow's peak for a training step of the 200k-row segment max, min and
    logsumexp (the BFC allocator's statistics, in a fresh process as CPU statistics need
    `TF_CPU_ALLOCATOR_USE_BFC`), within 4x the inputs and outputs plus the budget."""
    found = {k: v for k, v in tensorflow_peaks.items() if not k.startswith("wide eager ")}
    seg, x, _, grad = _big()
    io = seg.nbytes + x.nbytes + grad.nbytes
    wide = found.pop("wide under tf.function")
    assert sorted(found) == sorted(FORMULAS)
    for kind, (peak, budget) in found.items():
        print(f"{kind}: peak {peak / 2**20:.1f} MiB, in + out {io / 2**20:.1f} MiB")
        assert peak <= 4 * io + budget, kind
    seg, x, _, grad = _wide()
    io = seg.nbytes + x.nbytes + grad.nbytes  # the graph's peak counts no input
    print(f"wide, tf.function: {wide[0] / 2**20:.1f} MiB beyond {io / 2**20:.1f} MiB in + out")
    assert wide[0] + io <= 4 * io + wide[1]

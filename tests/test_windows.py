"""Claims README's "Windows, shifts, gathers and extrema" makes that no TF op comparison
covers: the docstring excerpt, select semantics, robustness of the tie mask, int attrs
used both as numbers and in positions, dtypes and call-time checks of index tensors."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from harness import Case, FakeOp, generate

ROOT = Path(__file__).resolve().parent.parent
RNG = np.random.default_rng(11)


def rand(*shape, low=-1.0, high=1.0, dtype=tf.float64):
    return tf.constant(RNG.uniform(low, high, shape), dtype=dtype)


def test_readme_shows_the_docstring_of_the_strided_dilated_convolution():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Windows, shifts, gathers and extrema", 1)[1]
    excerpt = re.search(r"```\n(.*?)```", section, re.DOTALL).group(1)
    module = (ROOT / "generated" / "strided_conv1d.py").read_text(encoding="utf-8")
    assert excerpt.strip() and excerpt in module


def test_where_keeps_nan_and_inf_of_the_branch_not_taken_out_of_the_gradient(tmp_path):
    module = generate(Case("y[b,i] = where(x[b,i] > 0, log(x[b,i]), 0)", {}), tmp_path, "Log")
    x = tf.constant([[-1.0, 0.0, 2.0, 0.5]], tf.float64)
    y = module.forward(x)
    np.testing.assert_array_equal(y.numpy(), [[0.0, 0.0, np.log(2.0), np.log(0.5)]])
    (grad,) = module.vjp(x, tf.ones_like(x))
    np.testing.assert_array_equal(grad.numpy(), [[0.0, 0.0, 0.5, 2.0]])


def test_a_chained_band_condition_matches_a_band_mask(tmp_path):
    case = Case("y[b,i,j] = where(i - w <= j <= i + w, A[b,i,j], 0)", {}, attrs={"w": 1})
    module = generate(case, tmp_path, "Band")
    A = rand(2, 5, 6)
    want = A * tf.linalg.band_part(tf.ones((5, 6), tf.float64), 1, 1)
    np.testing.assert_array_equal(module.forward(A, w=1).numpy(), want.numpy())
    (grad,) = module.vjp(A, tf.ones_like(A), w=1)
    np.testing.assert_array_equal(
        grad.numpy(), tf.linalg.band_part(tf.ones((2, 5, 6), tf.float64), 1, 1)
    )


def test_an_int_attr_can_be_a_value_and_a_shift(tmp_path):
    module = generate(Case("y[b,i] = n * x[b, i + n]", {}, attrs={"n": 2}), tmp_path, "Shift")
    x = rand(2, 7)
    y = module.forward(x, n=2)
    np.testing.assert_allclose(y.numpy(), 2 * x.numpy()[:, 2:], rtol=0, atol=0)
    (grad,) = module.vjp(x, tf.ones_like(y), n=2)
    np.testing.assert_array_equal(grad.numpy(), [[0, 0, 2, 2, 2, 2, 2]] * 2)


def test_registered_gradient_of_a_max_does_not_trust_the_output_bits():
    """A compiled kernel may round the extremum differently from the generated forward;
    the tie mask compares with the recomputed extremum, so the gradient stays finite."""
    module = importlib.import_module("generated.chamfer_distance")
    x, z = rand(2, 5, 3), rand(2, 4, 3)
    y = module.forward(x, z)
    nudged = y * (1 + 1e-12)  # as a kernel summing in another order might
    exact = module.gradient(FakeOp([x, z], [y], {}, module), tf.ones_like(y))
    got = module.gradient(FakeOp([x, z], [nudged], {}, module), tf.ones_like(y))
    for g, e in zip(got, exact, strict=True):
        assert np.all(np.isfinite(g.numpy()))
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-12)


def test_max_over_indices_splits_ties_like_reduce_max(tmp_path):
    module = generate(Case("y[b,i] = max(A[b,i,k], k)", {}), tmp_path, "Ties")
    A = tf.constant([[[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]]], tf.float64)
    (grad,) = module.vjp(A, tf.ones((1, 2), tf.float64))
    with tf.GradientTape() as tape:
        tape.watch(A)
        out = tf.reduce_max(A, axis=2)
    np.testing.assert_array_equal(grad.numpy(), tape.gradient(out, A).numpy())
    np.testing.assert_array_equal(grad.numpy()[0, 0], [0, 0.5, 0.5, 0])


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64])
@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64])
def test_gathers_work_in_every_float_dtype_and_both_index_dtypes(dtype, index_dtype):
    module = importlib.import_module("generated.embedding_lookup")
    W = tf.cast(rand(6, 3), dtype)
    ids = tf.constant([[0, 5, 2], [2, 2, 9]], index_dtype)  # 9 is out of range: zeros
    y = module.forward(W, ids)
    assert y.dtype == dtype
    want = tf.gather(tf.concat([W, tf.zeros((4, 3), dtype)], 0), ids)
    np.testing.assert_array_equal(y.numpy(), want.numpy())
    grad_W, grad_ids = module.vjp(W, ids, tf.ones_like(y))
    assert grad_ids is None and grad_W.dtype == dtype
    np.testing.assert_array_equal(grad_W.numpy()[:, 0], [1, 0, 3, 0, 0, 1])


def test_a_float_index_tensor_is_refused_at_call_time():
    module = importlib.import_module("generated.embedding_lookup")
    with pytest.raises(TypeError, match="EmbeddingLookup: index tensor ids has dtype float64"):
        module.forward(rand(6, 3), tf.constant([[0.0, 1.0]], tf.float64))


def test_convolution_under_tf_function_with_unknown_dims_and_under_xla():
    module = importlib.import_module("generated.strided_conv1d")
    x, w = rand(2, 13, 3), rand(3, 3, 4)
    attrs = {"s": 2, "d": 2, "p": 1}
    eager = module.forward(x, w, **attrs)
    specs = [tf.TensorSpec([None, None, None], tf.float64)] * 2

    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            loss = tf.reduce_sum(module.forward(x, w, **attrs) ** 2)
        return module.forward(x, w, **attrs), tape.gradient(loss, [x, w])

    _, want = step(x, w)
    for compiled in (
        tf.function(step, input_signature=specs),
        tf.function(step, jit_compile=True),
    ):
        y, grads = compiled(x, w)
        np.testing.assert_allclose(y.numpy(), eager.numpy(), rtol=1e-12, atol=1e-12)
        for g, e in zip(grads, want, strict=True):
            np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-12, atol=1e-12)


def _functions(name: str) -> dict[str, str]:
    """The source of each function of a repo module, by name."""
    import ast

    text = (ROOT / "generated" / f"{name}.py").read_text(encoding="utf-8")
    tree = ast.parse(text)
    return {
        node.name: ast.get_source_segment(text, node)
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
    }


def test_convolutions_are_tensorflows_kernels():
    # Kernels are called through the module's helpers, which skip them on empty axes.
    conv = _functions("conv2d_same")
    assert "_convolution(" in conv["_compute"]
    assert "Conv2DBackpropInput" in conv["_backward"]
    assert "Conv2DBackpropFilter" in conv["_backward"]
    for body in (conv["_compute"], conv["_backward"]):
        assert "_gather(" not in body and "_segment_sum(" not in body
    dilated = _functions("strided_conv1d")  # d*k: TF's CPU backprop refuses dilations > 1
    assert "_gather(" in dilated["_compute"] and "_convolution(" not in dilated["_compute"]


def test_max_pool_is_a_reshape():
    pool = _functions("max_pool2x2")
    for body in (pool["_compute"], pool["_backward"]):
        assert "tf.reshape(" in body
        assert "_gather(" not in body and "_segment_sum(" not in body
        assert "tf.tile" not in body  # its rank-6 broadcasts merge into 5 groups


def test_prefix_sums_are_cumsum():
    prefix = _functions("prefix_sum")
    assert "tf.cumsum(x, axis=1)" in prefix["_compute"]
    assert "tf.cumsum(grad_y, axis=1, reverse=True)" in prefix["_backward"]
    assert "tf.range" not in prefix["_compute"] + prefix["_backward"]


def test_the_registered_gradient_of_a_lookup_is_sparse():
    module = importlib.import_module("generated.embedding_lookup")
    W, ids = rand(6, 3), tf.constant([[0, 5, 2]], tf.int32)
    y = module.forward(W, ids)
    grad_W, grad_ids = module.gradient(FakeOp([W, ids], [y], {}, module), tf.ones_like(y))
    assert isinstance(grad_W, tf.IndexedSlices) and grad_ids is None
    np.testing.assert_array_equal(tf.convert_to_tensor(grad_W).numpy()[:, 0], [1, 0, 1, 0, 0, 1])


def test_a_max_over_every_index_is_a_scalar_with_split_ties(tmp_path):
    module = generate(Case("y[i] = x[i] - max(x[k], k)", {}), tmp_path, "ScalarMax")
    x = tf.constant([1.0, 3.0, 3.0, -2.0], tf.float64)
    grad = tf.constant([1.0, 2.0, 3.0, 4.0], tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(x)
        want = x - tf.reduce_max(x)
    np.testing.assert_array_equal(module.forward(x).numpy(), want.numpy())
    (got,) = module.vjp(x, grad)
    np.testing.assert_array_equal(got.numpy(), tape.gradient(want, x, output_gradients=grad))


@pytest.mark.parametrize(
    ("extent", "message"),
    [
        ("__import__('pathlib').Path('pwned').touch()", "a function call is not allowed"),
        ("A.shape[99]", "reads A.shape[99], but 'A' has rank 2"),
        ("A.shape[-1]", "indexing (other than `X.shape[n]` with n >= 0)"),
        ("A.shape[1] // 0", "divides by zero"),
        ("B.shape[0]", "no formula uses a tensor 'B'"),
        ("1.5", "a range takes integers"),
        ("A.shape[1] ** 2", "operator '**' is not allowed in a range"),
        ("1+" * 120 + "1", "longer than 200 characters"),
        ("n * 2", "unknown name 'n'"),
    ],
)
def test_a_bad_range_is_one_line_exit_2_and_writes_nothing(
    tmp_path, capsys, monkeypatch, extent, message
):
    from symgrad.cli import main

    spec = tmp_path / "symgrad.toml"
    spec.write_text(
        'out = "gen"\n[ops.Probe]\nformula = "y[b,i] = sum(A[b, i+k], k)"\n'
        f'ranges = {{ k = "2", i = "{extent}" }}\n',
        encoding="utf-8",
    )
    monkeypatch.chdir(tmp_path)
    assert main(["generate", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "[ops.Probe]" in err and message in err, err
    assert "Traceback" not in err and len(err.splitlines()) <= 3, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["symgrad.toml"]  # nothing ran


def test_chamfer_never_builds_the_pairwise_difference_tensor():
    """min over j of Σ_c (x - z)²: the (b,i,j,c) broadcast is never built, forward or back."""
    module = importlib.import_module("generated.chamfer_distance")
    x, z = rand(2, 7, 3), rand(2, 5, 3)

    def step(x, z):
        with tf.GradientTape() as tape:
            tape.watch([x, z])
            y = module.forward(x, z)
        return tape.gradient(y, [x, z])

    graph = tf.function(step).get_concrete_function(x, z).graph
    ranks = {
        (op.type, tuple(t.shape))
        for op in graph.get_operations()
        for t in op.outputs
        if t.shape.rank is not None and t.shape.rank >= 4
    }
    assert not ranks, ranks


def _loops(x, w, position, count):
    """y[b,i] = Σ_k x[b, position(i, k)] · w[k], reads outside x being zero."""
    out = np.zeros((x.shape[0], count))
    for i in range(count):
        for k in range(w.shape[0]):
            at = position(i, k)
            if 0 <= at < x.shape[1]:
                out[:, i] += x[:, at] * w[k]
    return out


@pytest.mark.parametrize("compiled", [False, True])
def test_a_negative_coefficient_below_zero_is_masked(tmp_path, compiled):
    """A flipped filter `i - k + 1` reads x[-1] at i = 0: zero, never a gather crash or
    (under XLA, which clamps) x[0]."""
    module = generate(Case("y[b,i] = sum(x[b, i - k + 1] * w[k], k)", {}), tmp_path, "Flip")
    x, w = rand(2, 8), rand(3)
    run = tf.function(module.forward, jit_compile=True) if compiled else module.forward
    y = run(x, w).numpy()
    want = _loops(x.numpy(), w.numpy(), lambda i, k: i - k + 1, y.shape[1])
    assert y.shape == (2, 7)
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d", [1, 2])
def test_a_negated_int_attr_coefficient_is_negative(tmp_path, d):
    """Causal dilated convolution `t - d*k`: the range of t is the input's, and reads
    before the start are zero."""
    case = Case("y[b,t,o] = sum(x[b, t - d*k, c] * w[k,c,o], k, c)", {}, attrs={"d": d})
    module = generate(case, tmp_path, "Causal")
    x, w = rand(2, 10, 3), rand(3, 3, 4)
    y = module.forward(x, w, d=d).numpy()
    want = np.zeros((2, 10, 4))
    for t in range(10):
        for k in range(3):
            if t - d * k >= 0:
                want[:, t] += x.numpy()[:, t - d * k] @ w.numpy()[k]
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)


def test_a_fully_masked_logsumexp_row_is_minus_infinity(tmp_path):
    case = Case("y[b,i] = log(sum(where(j < i, exp(A[b,i,j]), 0), j))", {})
    module = generate(case, tmp_path, "MaskedLse")
    A = rand(1, 2, 3)
    y = module.forward(A).numpy()
    assert y[0, 0] == -np.inf
    np.testing.assert_allclose(y[0, 1], A.numpy()[0, 1, 0], rtol=1e-12)


def test_an_index_tensor_read_on_its_diagonal_is_refused():
    from harness import op_spec

    from symgrad.errors import SymgradError
    from symgrad.model import build

    with pytest.raises(SymgradError, match="index tensor 'ids' is read with a repeated index"):
        build(op_spec(Case("y[b,i] = W[ids[b,i,i], i]", {}), "DiagIds"))


def test_index_values_beyond_int32_read_zero_and_never_wrap(tmp_path):
    """int64 ids past 2**31 are outside any table: zero, not the row they wrap around to;
    positions are computed in int64 whenever index tensors take part."""
    module = importlib.import_module("generated.embedding_lookup")
    W = tf.reshape(tf.range(18, dtype=tf.float64), (6, 3))
    ids = tf.constant([[4294967297, 4294967299, -4294967294, 2]], tf.int64)
    y = module.forward(W, ids).numpy()
    np.testing.assert_array_equal(y[0], [[0, 0, 0], [0, 0, 0], [0, 0, 0], [6, 7, 8]])
    (grad_W, _) = module.vjp(W, ids, tf.ones((1, 4, 3), tf.float64))
    np.testing.assert_array_equal(grad_W.numpy()[:, 0], [0, 0, 1, 0, 0, 0])
    scaled = generate(Case("y[b,t,d] = W[4*ids[b,t], d]", {}), tmp_path, "Scaled")
    y = scaled.forward(W, tf.constant([[1073741825, 1]], tf.int32)).numpy()
    np.testing.assert_array_equal(y[0], [[0, 0, 0], [12, 13, 14]])


def test_vjp_checks_gradients_of_outputs_sized_by_a_range(tmp_path):
    module = generate(Case("y[b,i] = exp(x[b, i + 1])", {}), tmp_path, "Shifted")
    x = rand(2, 5)
    with pytest.raises(
        ValueError, match=r"Shifted\d*: grad_y has shape \(2, 1\); expected \(2, 4\)"
    ):
        module.vjp(x, tf.ones((2, 1), tf.float64))
    (grad,) = module.vjp(x, tf.ones((2, 4), tf.float64))
    np.testing.assert_allclose(grad.numpy()[:, 1:], np.exp(x.numpy()[:, 1:]), rtol=1e-12)
    assert not np.any(grad.numpy()[:, 0])

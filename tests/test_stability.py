"""Numerical stability where the exact formula and the naive evaluation part ways:
sums of exponentials (log space), expanded squared distances (float32 cancellation),
reduced precision. Each reference is the independent dense evaluator in float64
(tests/reference.py) on the very same input values, with TF autodiff for gradients."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from harness import Case, generate, op_spec

from symgrad.model import build
from symgrad.reference import evaluate


def truth(case: Case, values: dict[str, np.ndarray], grad: np.ndarray):
    """float64 outputs and input gradients of the reference evaluator."""
    program = build(op_spec(case, "Truth"))
    tensors = [tf.constant(values[name], tf.float64) for name in program.inputs]
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        (out,) = [
            evaluate(f, dict(zip(program.inputs, tensors, strict=True)), case.attrs)
            for f in case.equations
        ]
    grads = tape.gradient(out, tensors, output_gradients=tf.constant(grad, tf.float64))
    return out.numpy(), [g.numpy() for g in grads]


def generated(module, case: Case, values: dict[str, np.ndarray], grad: np.ndarray, dtype):
    program = build(op_spec(case, "Probe"))
    tensors = [tf.constant(values[name], dtype) for name in program.inputs]
    out = module.forward(*tensors, **case.attrs)
    grads = module.vjp(*tensors, tf.constant(grad, dtype), **case.attrs)
    return out.numpy().astype(np.float64), [g.numpy().astype(np.float64) for g in grads]


def close(got, want, rtol, what):
    """Finite, and within rtol of the truth relative to the truth's scale (a result
    below float32's smallest normal number may underflow to 0)."""
    assert np.isfinite(got).all(), f"{what}: not finite: {got}"
    atol = rtol * np.abs(want).max() + np.finfo(np.float32).tiny
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=what)


# -- sums of exponentials ---------------------------------------------------------------
# Logits in the hundreds: exp overflows float32 (and exp(800) float64), every result
# below is a moderate number (or an underflow to 0 that is right to within float32).

LOG_SPACE = {
    "reciprocal": "y[b] = 1 / sum(exp(A[b,k]), k)",
    "log_one_plus": "y[b] = log(sum(exp(A[b,k]), k) + 1)",
    "log_constants": "y[b] = log(2 + 3 * mean(exp(A[b,k]), k))",
    "softmax_with_one": "y[b,i] = exp(A[b,i]) / (1 + sum(exp(A[b,k]), k))",
    "one_over_one_plus": "y[b] = 1 / (1 + sum(exp(A[b,k]), k))",
    "squared_denominator": "y[b,i] = exp(2 * A[b,i]) / sum(exp(A[b,k]), k) ** 2",
    "sqrt_denominator": "y[b,i] = exp(A[b,i] / 2) / sqrt(sum(exp(A[b,k]), k))",
    "mean_denominator": "y[b,i] = exp(A[b,i]) / mean(exp(A[b,k]), k)",
    "log_of_square_plus_one": "y[b] = log(sum(exp(A[b,k]), k) ** 2 + 1)",
    "ratio_of_sums": "y[b] = sum(exp(A[b,k]), k) / sum(exp(C[b,j]), j)",
    "factor_times_inverse": "y[b,i] = exp(A[b,i]) * (1 / sum(exp(A[b,k]), k))",
    "log_softmax": "y[b,i] = A[b,i] - log(sum(exp(A[b,k]), k))",
    "softplus_written_out": "y[b] = log(1 + exp(A[b,k]))",
    "sigmoid_written_out": "y[b,i] = 1 / (1 + exp(A[b,i]))",
}


@pytest.mark.parametrize("name", sorted(LOG_SPACE))
@pytest.mark.parametrize("offset", [0.0, 300.0])
def test_sum_of_exp_stays_in_log_space(name, offset, tmp_path):
    shapes = {"A": (2, 5), "C": (2, 4)}
    case = Case(LOG_SPACE[name], shapes)
    module = generate(case, tmp_path, prefix="LogSpace")
    rng = np.random.default_rng(3)
    values = {n: rng.uniform(-2, 2, s).astype(np.float32) + offset for n, s in shapes.items()}
    grad = rng.standard_normal(want_shape(case, values)).astype(np.float32)
    want, want_grads = truth(case, values, grad)
    got, got_grads = generated(module, case, values, grad, tf.float32)
    close(got, want, 1e-4, "forward")
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        close(got_grad, want_grad, 1e-4, "gradient")


def want_shape(case: Case, values):
    program = build(op_spec(case, "Shape"))
    tensors = {n: tf.constant(values[n], tf.float64) for n in program.inputs}
    return evaluate(case.equations[0], tensors, case.attrs).shape


NOT_LOG_SPACE = {
    "weighted": "y[b] = log(sum(w[b,k] * exp(A[b,k]), k))",
    "plus_one_inside": "y[b] = log(sum(exp(A[b,k]) + 1, k))",
    "tensor_added": "y[b] = log(sum(exp(A[b,k]), k) + w[b,k])",
}


@pytest.mark.parametrize("name", sorted(NOT_LOG_SPACE))
def test_what_is_not_in_log_space_overflows(name, tmp_path):
    """The README's boundary, the other way: these are computed as written."""
    case = Case(NOT_LOG_SPACE[name], {"A": (2, 5), "w": (2, 5)})
    module = generate(case, tmp_path, prefix="NotLogSpace")
    program = build(op_spec(case, "Probe"))
    rng = np.random.default_rng(4)
    values = {"A": rng.uniform(298, 302, (2, 5)), "w": rng.uniform(0.5, 1.5, (2, 5))}
    tensors = [tf.constant(values[n], tf.float32) for n in program.inputs]
    assert not np.isfinite(module.forward(*tensors).numpy()).all()


# -- expanded squared distances in float32 -----------------------------------------------
# Expanded into x² + z² - 2x·z (no (b,i,j,k) tensor), points far from the origin cancel
# catastrophically unless they are centered first.

DISTANCES = {
    "pairwise": "y[b,i,j] = sum((x[b,i,k] - x[b,j,k])**2, k)",
    "cross": "y[b,i,j] = sum((x[b,i,k] - z[b,j,k])**2, k)",
    "cross_transposed": "y[b,j,i] = sum((z[b,k,j] - x[b,i,k])**2, k)",
    "rbf": "y[b,i,j] = exp(-sum((x[b,i,k] - z[b,j,k])**2, k) / 32)",
    "distance": "y[b,i,j] = sqrt(sum((x[b,i,k] - z[b,j,k])**2, k) + 1)",
    "mean_squared": "y[b,i,j] = mean((x[b,i,k] - x[b,j,k])**2, k)",
}


def distance_inputs(offset: float, seed: int = 5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 4, 16)) + offset
    z = rng.standard_normal((2, 5, 16)) + offset
    z[:, 0] = x[:, 0]  # a distance of exactly 0 between the two sets
    values = {"x": x, "z": z.transpose(0, 2, 1).copy()}
    return {n: v.astype(np.float32) for n, v in values.items()}


@pytest.mark.parametrize("name", sorted(DISTANCES))
@pytest.mark.parametrize("offset", [0.0, 100.0, 1000.0])
def test_expanded_distances_are_accurate_in_float32(name, offset, tmp_path):
    formula = DISTANCES[name]
    transposed = "z[b,k,j]" in formula
    case = Case(formula, {"x": (2, 4, 16), "z": (2, 16, 5) if transposed else (2, 5, 16)})
    module = generate(case, tmp_path, prefix="Dist")
    values = distance_inputs(offset)
    if not transposed:
        values["z"] = values["z"].transpose(0, 2, 1).copy()
    program = build(op_spec(case, "Probe"))
    tensors = [tf.constant(values[n], tf.float32) for n in program.inputs]
    got = module.forward(*tensors).numpy().astype(np.float64)
    named = {n: tf.constant(values[n], tf.float64) for n in program.inputs}
    want = evaluate(formula, named, {}).numpy()
    assert np.isfinite(got).all()
    assert (got >= 0).all(), got.min()
    if name == "rbf":
        assert (got <= 1).all(), got.max()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-3 * scale, (np.abs(got - want).max(), scale)


@pytest.mark.parametrize("name", ["pairwise", "cross", "rbf", "mean_squared"])
@pytest.mark.parametrize("offset", [0.0, 100.0, 1000.0])
def test_expanded_distance_gradients_in_float32(name, offset, tmp_path):
    formula = DISTANCES[name]
    case = Case(formula, {"x": (2, 4, 16), "z": (2, 5, 16)})
    module = generate(case, tmp_path, prefix="DistGrad")
    values = distance_inputs(offset)
    values["z"] = values["z"].transpose(0, 2, 1).copy()
    rng = np.random.default_rng(6)
    grad = rng.standard_normal(want_shape(case, values))
    _, want_grads = truth(case, values, grad)
    _, got_grads = generated(module, case, values, grad, tf.float32)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        close(got_grad, want_grad, 1e-3, "gradient")


@pytest.mark.parametrize("name", ["pairwise", "cross", "rbf"])
def test_gradient_where_a_distance_is_exactly_zero(name, tmp_path):
    """Coincident points (the diagonal of pairwise, a shared point across the sets): the
    clamp at 0 must not change the gradient there (float64, against TF autodiff)."""
    case = Case(DISTANCES[name], {"x": (2, 4, 16), "z": (2, 5, 16)})
    module = generate(case, tmp_path, prefix="DistZero")
    values = {n: v.astype(np.float64) for n, v in distance_inputs(3.0).items()}
    values["z"] = values["z"].transpose(0, 2, 1).copy()
    values["x"][:, 1] = values["x"][:, 2]  # two equal points within one set too
    grad = np.random.default_rng(7).standard_normal(want_shape(case, values))
    want, want_grads = truth(case, values, grad)
    got, got_grads = generated(module, case, values, grad, tf.float64)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got_grad, want_grad, rtol=1e-9, atol=1e-9)
    program = build(op_spec(case, "Probe"))
    tensors = [tf.constant(values[n]) for n in program.inputs]
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        loss = tf.reduce_sum(module.forward(*tensors) * grad)
    for taped, want_grad in zip(tape.gradient(loss, tensors), want_grads, strict=True):
        np.testing.assert_allclose(taped, want_grad, rtol=1e-9, atol=1e-9)


# -- float16: no worse than TensorFlow's own ops -----------------------------------------

HALF = {
    "product_of_softmaxes": (
        "y[b,i] = exp(B[b,i] + A[b,i] - log(sum(exp(A[b,k]), k)) - log(sum(exp(B[b,m]), m)))",
        lambda A, B: tf.nn.softmax(A) * tf.nn.softmax(B),
    ),
    "softmax_of_log_softmax": (
        (
            "y[b,i] = exp(A[b,i] - log(sum(exp(A[b,k]), k)))"
            " / sum(exp(A[b,m] - log(sum(exp(A[b,k]), k))), m)"
        ),
        lambda A, B: tf.nn.softmax(tf.nn.log_softmax(A)),
    ),
    "log_softmax": (
        "y[b,i] = A[b,i] - log(sum(exp(A[b,k]), k))",
        lambda A, B: tf.nn.log_softmax(A),
    ),
    "log_softmax_sum": (
        "y[b,i] = A[b,i] - log(sum(exp(A[b,k]), k)) + B[b,i] - log(sum(exp(B[b,m]), m))",
        lambda A, B: tf.nn.log_softmax(A) + tf.nn.log_softmax(B),
    ),
}


def relative_error(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("name", sorted(HALF))
@pytest.mark.parametrize("offset", [0.0, 10.0, 30.0])
def test_float16_is_as_accurate_as_tensorflow(name, offset, tmp_path):
    """Error against the float64 truth on the same float16 inputs: within 2x of what
    TF's own ops (and their autodiff) lose in float16, plus about two float16 roundings."""
    formula, reference = HALF[name]
    case = Case(formula, {"A": (64, 7), "B": (64, 7)})
    module = generate(case, tmp_path, prefix="Half")
    program = build(op_spec(case, "Probe"))
    rng = np.random.default_rng(8)
    values = {n: (rng.standard_normal((64, 7)) * 2 + offset).astype(np.float16) for n in "AB"}
    grad = rng.standard_normal((64, 7)).astype(np.float16)

    def tf_run(dtype):
        A, B = (tf.constant(values[n], dtype) for n in "AB")
        with tf.GradientTape() as tape:
            tape.watch([A, B])
            y = reference(A, B)
        grads = tape.gradient(y, [A, B], output_gradients=tf.constant(grad, dtype))
        grads = [tf.zeros_like(A) if g is None else g for g in grads]
        return y.numpy().astype(np.float64), {"A": grads[0].numpy(), "B": grads[1].numpy()}

    want, want_grads = tf_run(tf.float64)
    tf_y, tf_grads = tf_run(tf.float16)
    tensors = [tf.constant(values[n]) for n in program.inputs]
    got = module.forward(*tensors).numpy()
    got_grads = dict(zip(program.inputs, module.vjp(*tensors, tf.constant(grad)), strict=True))
    allowance = 2 * relative_error(tf_y, want) + 1e-3
    assert relative_error(got, want) <= allowance, (relative_error(got, want), allowance)
    for n in program.inputs:
        # Gradients also sum softmax weights in float16 (Σ y = 1 ± 1e-3, cancelling in
        # softmax_of_log_softmax): one more rounding allowed.
        allowance = 2 * relative_error(tf_grads[n], want_grads[n]) + 2e-3
        error = relative_error(got_grads[n].numpy(), want_grads[n])
        assert error <= allowance, (n, error, allowance)


def test_clamp_only_where_the_expansion_is_a_sum_of_squares(tmp_path):
    """A weighted sum of squares can be negative: it is centered but never clamped."""
    case = Case("y[b,i,j] = sum((x[b,i,k] - x[b,j,k])**2 * w[k], k)", {"x": (2, 4, 16), "w": (16,)})
    module = generate(case, tmp_path, prefix="Weighted")
    x = np.random.default_rng(9).standard_normal((2, 4, 16)) + 100
    w = -np.ones(16)
    got = module.forward(tf.constant(x, tf.float32), tf.constant(w, tf.float32)).numpy()
    want = evaluate(case.equations[0], {"x": tf.constant(x), "w": tf.constant(w)}, {}).numpy()
    assert (want < -1).sum() == 2 * 4 * 3  # every pair of distinct points
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()

"""The gradient through a `where` branch not taken is 0, also when the branch is an
intermediate (a sum inside the where): `y[r,c] = where(A[r] > 0, sum(x[c,a] * w[r,a],
a) / A[r], 0)` with A[1] = 0 had nan in all 12 gradients of x (the select's 0 times the
quotient's partial 1 / A = inf); the branch that is taken keeps its nan and inf.

float64, every target, untiled and at a 1-byte budget (as many chunks as the plan
allows), against a NumPy transcription of the gradient and finite differences.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from adversarial import TINY, as_numpy
from harness import Case, generate

jax.config.update("jax_enable_x64", True)

BIG = 2**40
SUM = "sum(x[c,a] * w[r,a], a) / A[r]"
SHAPES = {"x": (3, 4), "w": (2, 4), "A": (2,)}
GUARDED = Case(f"y[r,c] = where(A[r] > 0, {SUM}, 0)", SHAPES, inputs=("x", "w", "A"))
TAKEN = Case(f"y[r,c] = where(A[r] >= 0, {SUM}, 0)", SHAPES, inputs=("x", "w", "A"))
RUNS = [(t, b) for t in ("tensorflow", "pytorch", "jax") for b in (BIG, TINY)]


def _tensor(target, a):
    if target == "tensorflow":
        return tf.constant(a)
    if target == "jax":
        return jax.numpy.asarray(a)
    return torch.from_numpy(a.copy())


def _run(module, target, budget, x, w, A, cotangent):
    module.MAX_TEMP_BYTES = budget
    args = [_tensor(target, t) for t in (x, w, A)]
    y = module.forward(*args)
    grads = module.vjp(*args, _tensor(target, cotangent))
    return as_numpy(y), [as_numpy(g) for g in grads]


def _inputs():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4))
    w = rng.standard_normal((2, 4))
    A = np.array([0.7, 0.0])
    cotangent = rng.standard_normal((2, 3))
    return x, w, A, cotangent


def _numpy(x, w, A, cotangent, keep):
    """y and the gradients of `where(keep, (x @ w.T).T / A, 0)`: rows not kept give and
    take nothing."""
    with np.errstate(divide="ignore", invalid="ignore"):
        inverse = np.where(keep, 1 / A, 0.0)
        y = np.where(keep[:, None], (w @ x.T) * inverse[:, None], 0.0)
        g = cotangent * np.where(keep, 1.0, 0.0)[:, None]
        grad_x = (g * inverse[:, None]).T @ w
        grad_w = inverse[:, None] * (g.T.T @ x)
        grad_A = -(inverse**2) * np.einsum("rc,ra,ca->r", g, w, x)
    return y, [grad_x, grad_w, grad_A]


@pytest.mark.parametrize(("target", "budget"), RUNS)
def test_a_guarded_quotient_of_a_sum_takes_no_gradient_from_its_empty_rows(
    target, budget, tmp_path
):
    """Row 1 (A = 0) is not taken: it adds nothing to the gradients of x and w, and A[1]
    gets 0, where every gradient of x was nan; the kept row's gradients are the NumPy
    ones and central differences'."""
    module = generate(GUARDED, tmp_path, prefix="Guarded", target=target)
    x, w, A, cotangent = _inputs()
    y, grads = _run(module, target, budget, x, w, A, cotangent)
    want_y, want = _numpy(x, w, A, cotangent, A > 0)
    np.testing.assert_allclose(y, want_y, rtol=1e-12, atol=1e-14)
    for got, expected in zip(grads, want, strict=True):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)
    assert grads[2][1] == 0.0 and (grads[1][1] == 0.0).all()

    def loss(x, w, A):
        return float((_numpy(x, w, A, cotangent, A > 0)[0] * cotangent).sum())

    step = 1e-6
    for k, value in enumerate((x, w)):
        for position in np.ndindex(value.shape):
            moved = [x.copy(), w.copy(), A.copy()]
            moved[k][position] += step
            up = loss(*moved)
            moved[k][position] -= 2 * step
            down = loss(*moved)
            np.testing.assert_allclose(
                grads[k][position], (up - down) / (2 * step), rtol=1e-6, atol=1e-8
            )
    up, down = A.copy(), A.copy()
    up[0] += step
    down[0] -= step
    np.testing.assert_allclose(
        grads[2][0], (loss(x, w, up) - loss(x, w, down)) / (2 * step), rtol=1e-6
    )


@pytest.mark.parametrize(("target", "budget"), RUNS)
def test_a_non_finite_taken_branch_still_reaches_the_gradient(target, budget, tmp_path):
    """`A[r] >= 0` takes row 1 at A = 0: its quotient's partials are infinite there and
    every gradient of x is ±inf, A[1]'s nan or inf, as TF's autodiff of the same
    `tf.where` gives."""
    module = generate(TAKEN, tmp_path, prefix="Taken", target=target)
    x, w, A, cotangent = _inputs()
    _, grads = _run(module, target, budget, x, w, A, cotangent)
    _, want = _numpy(x, w, A, cotangent, A >= 0)
    assert np.isinf(want[0]).all()
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)
    xs, ws, As = (tf.constant(t) for t in (x, w, A))
    with tf.GradientTape() as tape:
        tape.watch([xs, ws, As])
        quotient = tf.einsum("ca,ra->rc", xs, ws) / As[:, None]
        y = tf.where(As[:, None] >= 0, quotient, tf.zeros_like(quotient))
    autodiff = tape.gradient(y, [xs, ws, As], output_gradients=tf.constant(cotangent))
    np.testing.assert_allclose(grads[0], autodiff[0].numpy(), rtol=1e-12, atol=1e-14)
    assert not np.isfinite(grads[2][1]) and not np.isfinite(autodiff[2].numpy()[1])


ROWS_MASKED_WHOLE = {
    # a masked norm whose second row keeps nothing: sqrt(0), its derivative inf
    "norm": ("y[b] = sqrt(sum(where(t < ln[b], x[b,t]**2, 0), t))", "sqrt"),
    "log": ("y[b] = log(sum(where(t < ln[b], x[b,t]**2, 0), t))", "log"),
}


@pytest.mark.parametrize("target,budget", RUNS)
@pytest.mark.parametrize("name", sorted(ROWS_MASKED_WHOLE))
def test_an_infinite_outer_derivative_over_a_row_masked_whole_gives_no_nan(
    name, target, budget, tmp_path
):
    """`sqrt(sum(where(t < ln[b], x**2, 0), t))` with ln = 0 in a row: its forward is 0
    (-inf for log), and the chain rule's outer factor 1 / (2·sqrt(0)) is inf; times the
    masked 0 it was nan in every entry of that row's gradient (found by an adversarial
    trial), where autodiff applies the `where` last and gives 0. The gradient's product
    with a select of 0 is the select of the product now (`pointwise._select_last`).
    Against TF autodiff of the formula as written, in float64."""
    formula, outer = ROWS_MASKED_WHOLE[name]
    case = Case(formula, {"x": (3, 5)}, inputs=("x", "ln"), index_inputs={"ln": ((3,), 0, 5)})
    module = generate(case, tmp_path, prefix="MaskedWhole" + name.title(), target=target)
    module.MAX_TEMP_BYTES = budget
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 5))
    ln = np.array([4, 0, 5])
    g = rng.standard_normal(3)
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        kept = tf.range(5, dtype=tf.int64)[None, :] < tf.constant(ln)[:, None]
        total = tf.reduce_sum(tf.where(kept, xt**2, tf.zeros_like(xt)), axis=1)
        y = tf.sqrt(total) if outer == "sqrt" else tf.math.log(total)
    want_grad = tape.gradient(y, xt, output_gradients=tf.constant(g)).numpy()
    array = {"tensorflow": tf.constant, "pytorch": torch.tensor, "jax": jax.numpy.asarray}[target]
    got = as_numpy(module.forward(array(x), array(ln)))
    np.testing.assert_allclose(got, y.numpy(), rtol=1e-12)
    grad_x = as_numpy(module.vjp(array(x), array(ln), array(g))[0])
    assert np.isfinite(grad_x).all(), grad_x
    np.testing.assert_allclose(grad_x, want_grad, rtol=1e-12, atol=1e-12)

"""The log of a finite sum of exponentials stays in log space (symgrad/logaddexp.py):
`log(exp(A) + exp(B))`, masked terms and constants, a two-class softmax, and soft-DTW's
cell, in float32 with logits in the hundreds, forward and gradient, in TensorFlow,
PyTorch and JAX. The truth is the dense reference evaluator in float64 with TF autodiff
(as in test_stability), and for soft-DTW a float64 NumPy loop and its backward recursion
(Cuturi & Blondel), itself checked against finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from frameworks import FRAMEWORKS
from harness import Case, generate, load_module, op_spec
from test_recurrences import op_spec as recurrence_spec
from test_stability import truth
from test_wavefront import SOFT_DTW

from symgrad.model import build
from symgrad.pipeline import module_text

TARGETS = ("tensorflow", "pytorch", "jax")

SUMS = {
    "two_terms": "y[b,i] = log(exp(A[b,i]) + exp(B[b,i]))",
    "two_class_log_softmax": "y[b,i] = A[b,i] - log(exp(A[b,i]) + exp(B[b,i]))",
    "two_class_softmax": "y[b,i] = exp(A[b,i]) / (exp(A[b,i]) + exp(B[b,i]))",
    "rnnt_alpha": "y[b,i] = log(exp(A[b,i] + B[b,i]) + exp(2 * B[b,i] - A[b,i]))",
    # a masked constant, a weighted masked term, a masked term; at i = 1 every term is
    # masked (log 0 = -inf, gradient 0)
    "masked_three_terms": (
        "y[b,i] = log(where(i == 0, 3, 0) + where(i < 2, 0, 2 * exp(A[b,i]))"
        " + where(i == 1, 0, exp(B[b,i] - A[b,i])))"
    ),
    "mask_factors": (
        "y[b,i] = log(where(i > 0, 1, 0) * exp(A[b,i]) + where(i < 3, 2, 0) * exp(B[b,i]))"
    ),
    "one_plus_two": "y[b,i] = log(1 + exp(A[b,i]) + 0.5 * exp(-B[b,i]))",
}
SHAPES = {"A": (3, 4), "B": (3, 4)}


def logits(kind: str, seed: int) -> dict[str, np.ndarray]:
    """Logits in the hundreds: both near +300, both near -300, or one dominating."""
    rng = np.random.default_rng(seed)
    centers = {"plus": (300, 300), "minus": (-300, -300), "mixed": (300, -300)}[kind]
    return {
        n: (rng.uniform(-3, 3, SHAPES[n]) + c).astype(np.float32)
        for n, c in zip("AB", centers, strict=True)
    }


def run(module, target: str, values: dict[str, np.ndarray], names, grad: np.ndarray, **attrs):
    """float32 forward and vjp of a generated module in `target`, as float64 NumPy (None
    for an input without a gradient)."""
    fw = FRAMEWORKS[target]
    tensors = [fw.tensor(values[n].astype(np.float32)) for n in names]
    out = module.forward(*tensors, **attrs)
    grads = module.vjp(*tensors, fw.tensor(grad.astype(np.float32)), **attrs)
    grads = [None if g is None else fw.numpy(g).astype(np.float64) for g in grads]
    return fw.numpy(out).astype(np.float64), grads


def assert_close(got, want, rtol, what):
    """Equal infinities where the truth is infinite; elsewhere finite and within rtol
    of the truth's scale, at least 1 (the incoming gradients' scale: a gradient of
    1 - softmax(600) is 1e-17 in the float64 truth and 0 in float32)."""
    infinite = np.isinf(want)
    np.testing.assert_array_equal(got[infinite], want[infinite], err_msg=what)
    got, want = got[~infinite], want[~infinite]
    assert np.isfinite(got).all(), f"{what}: not finite: {got}"
    atol = rtol * max(np.abs(want).max(), 1.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=what)


# Every formula in TensorFlow and in PyTorch or JAX, taking turns (each module costs a
# generation: the file stays fast); the first in all three.
PAIRS = [(name, "tensorflow") for name in sorted(SUMS)] + [
    (name, ("pytorch", "jax")[k % 2]) for k, name in enumerate(sorted(SUMS))
]
PAIRS.append((min(SUMS), "jax"))


@pytest.mark.parametrize(("name", "target"), PAIRS)
def test_log_of_a_sum_of_exponentials_stays_finite(name, target, tmp_path):
    case = Case(SUMS[name], SHAPES)
    module = generate(case, tmp_path, prefix="LogSum", target=target)
    names = build(op_spec(case, "Probe")).inputs
    for seed, kind in enumerate(("plus", "minus", "mixed")):
        values = logits(kind, seed)
        grad = np.random.default_rng(seed + 10).standard_normal((3, 4))
        want, want_grads = truth(case, values, grad)
        got, got_grads = run(module, target, values, names, grad)
        # u - L with u, L ~ 300 in float32 is off by up to an ulp of 300 (3e-5), and so
        # relatively is exp(u - L) (a softmax weight, a two-class softmax): as close as
        # float32 can be at logits of that size
        assert_close(got, want, 1e-4, f"{name} {kind} forward")
        for n, g, w in zip(names, got_grads, want_grads, strict=True):
            if name == "masked_three_terms":  # every term masked at i = 1: gradient 0
                np.testing.assert_array_equal(g[:, 1], 0)
                g, w = np.delete(g, 1, axis=1), np.delete(w, 1, axis=1)
            assert_close(g, w, 1e-4, f"{name} {kind} gradient of {n}")


@pytest.mark.parametrize("target", TARGETS)
def test_infinite_logits(target, tmp_path):
    """-inf terms add nothing and get gradient 0 (all of them -inf: log 0 = -inf, gradient
    0, not nan); a +inf term makes +inf and the finite terms get gradient 0."""
    case = Case("y[i] = log(exp(A[i]) + exp(B[i]))", {"A": (4,), "B": (4,)})
    module = generate(case, tmp_path, prefix="LogSumInf", target=target)
    inf = np.inf
    values = {"A": np.array([-inf, -inf, inf, 400.0]), "B": np.array([2.0, -inf, 5.0, -inf])}
    grad = np.array([1.5, 2.0, 3.0, 0.5])
    got, (grad_a, grad_b) = run(module, target, values, "AB", grad)
    np.testing.assert_array_equal(got, [2.0, -inf, inf, 400.0])
    np.testing.assert_array_equal(grad_a[[0, 1, 3]], [0.0, 0.0, 0.5])
    assert np.isnan(grad_a[2])  # exp(inf - inf): the infinite term's weight is undefined
    np.testing.assert_array_equal(grad_b, [1.5, 0.0, 0.0, 0.0])


# -- soft-DTW ----------------------------------------------------------------------------


def soft_dtw(D: np.ndarray, gamma: float):
    """float64 soft-DTW (max-shifted softmin, as the public kernels) and the backward
    recursion for an incoming gradient G over every cell: Rbar[p] = G[p] + Σ over the
    cells s reading p of Rbar[s]·exp((R[s] - D[s] - R[p]) / gamma); dL/dD = Rbar."""
    B, N, M = D.shape
    R = np.full((B, N + 1, M + 1), np.inf)
    R[:, 0, 0] = 0.0
    for i in range(1, N + 1):
        for j in range(1, M + 1):
            r = -np.stack([R[:, i - 1, j - 1], R[:, i - 1, j], R[:, i, j - 1]]) / gamma
            top = np.max(r, 0)
            R[:, i, j] = D[:, i - 1, j - 1] - gamma * (np.log(np.exp(r - top).sum(0)) + top)
    R = R[:, 1:, 1:]

    def backward(G):
        Rbar = np.array(G, dtype=np.float64)
        for i in reversed(range(N)):
            for j in reversed(range(M)):
                for di, dj in ((1, 1), (1, 0), (0, 1)):
                    si, sj = i + di, j + dj
                    if si < N and sj < M:
                        w = np.exp((R[:, si, sj] - D[:, si, sj] - R[:, i, j]) / gamma)
                        Rbar[:, i, j] += Rbar[:, si, sj] * w
        return Rbar

    return R, backward


def test_soft_dtw_reference_backward_is_its_derivative():
    """The NumPy backward recursion against central differences of the NumPy loop."""
    rng = np.random.default_rng(1)
    D, gamma = rng.uniform(50, 150, (2, 4, 3)), 0.5
    G, V = rng.standard_normal(D.shape), rng.standard_normal(D.shape)
    eps = 1e-5
    plus, _ = soft_dtw(D + eps * V, gamma)
    minus, _ = soft_dtw(D - eps * V, gamma)
    fd = np.sum(G * (plus - minus)) / (2 * eps)
    _, backward = soft_dtw(D, gamma)
    np.testing.assert_allclose(np.sum(backward(G) * V), fd, rtol=1e-6)


@pytest.mark.parametrize("target", TARGETS)
def test_soft_dtw_in_float32_with_costs_in_the_hundreds(target, tmp_path):
    """D/gamma from 100 to 300, so R/gamma reaches thousands: every exp(-R/gamma)
    underflows float32 (the cells were log(0) = -inf before the sum stayed in log space)."""
    spec = recurrence_spec("SoftDtw", SOFT_DTW, attrs=(("gamma", "float"),))
    module = load_module(module_text(spec, "test", target), tmp_path, f"sdtw32_{target}")
    rng = np.random.default_rng(2)
    gamma = 0.5
    D = rng.uniform(50, 150, (2, 5, 4))
    G = rng.standard_normal(D.shape)
    want, backward = soft_dtw(D.astype(np.float32).astype(np.float64), gamma)
    got, (grad_d,) = run(module, target, {"D": D}, ["D"], G, gamma=gamma)
    assert_close(got, want, 1e-5, "soft-DTW forward")
    assert_close(grad_d, backward(G), 1e-4, "soft-DTW gradient")


# -- one softmax over two sums ------------------------------------------------------------

# Longformer's attention reduced: query i's window of 3 keys (i - 1 .. i + 1, those inside
# the sequence) and the global keys j (g > 0), one softmax over both; x and z the logits
TWO_SUMS = Case(
    (
        "y[b,i,e] = (sum(where(i + k - 1 >= 0 and i + k - 1 < N, exp(x[b,i,k])"
        " * v[b,i + k - 1,e], 0), k) + sum(where(g[b,j] > 0, exp(z[b,i,j]) * u[b,j,e], 0), j))"
        " / (sum(where(i + k - 1 >= 0 and i + k - 1 < N, exp(x[b,i,k]), 0), k)"
        " + sum(where(g[b,j] > 0, exp(z[b,i,j]), 0), j))"
    ),
    {"x": (2, 5, 3), "v": (2, 5, 2), "z": (2, 5, 4), "u": (2, 4, 2), "g": (2, 4)},
    inputs=("x", "v", "z", "u", "g"),
    no_gradient=("g",),
    lets={"N": "v.shape[1]"},
    let_values={"N": 5},
)


def two_sums_truth(values, grad):
    """float64 forward and gradients of x, v, z, u: TF's softmax over the window's and the
    global keys' logits concatenated (masked ones -inf), by TF autodiff."""
    import tensorflow as tf

    _, length, width = values["x"].shape
    position = np.arange(length)[:, None] + np.arange(width)[None, :] - 1
    inside = tf.constant((position >= 0) & (position < length))
    x, v, z, u = (tf.constant(values[n], tf.float64) for n in ("x", "v", "z", "u"))
    with tf.GradientTape() as tape:
        tape.watch([x, v, z, u])
        window = tf.gather(v, np.clip(position, 0, length - 1), axis=1)  # [b,i,k,e]
        glob = tf.constant(values["g"] > 0)[:, None, :]
        minus_inf = tf.constant(-np.inf, tf.float64)
        p = tf.nn.softmax(
            tf.concat([tf.where(inside, x, minus_inf), tf.where(glob, z, minus_inf)], -1)
        )
        y = tf.einsum("bik,bike->bie", p[..., :width], window)
        y += tf.einsum("bij,bje->bie", p[..., width:], u)
    grads = tape.gradient(y, [x, v, z, u], output_gradients=tf.constant(grad, tf.float64))
    return y.numpy(), [g.numpy() for g in grads]


@pytest.mark.parametrize("target", TARGETS)
def test_one_softmax_over_a_window_sum_and_a_global_sum_in_float32(target, tmp_path):
    """Logits near +400 or -400 (the window's, the global keys' or both larger): forward
    and gradients finite and within 1e-4 of the float64 truth's scale. The numerator
    `sum(exp(x) * v, k) + sum(exp(z) * u, j)` was summed from raw exponentials and then
    multiplied by exp(-L): inf * 0 or 0 * inf, nan in float32 (all 20 outputs and every
    gradient, in each target); each sum now carries its own exp(x - L)."""
    module = generate(TWO_SUMS, tmp_path, prefix="TwoSums", target=target)
    rng = np.random.default_rng(5)
    # per row (b, i): the centres of its window's and its global keys' logits
    centres = np.array([(400, 400), (-400, -400), (400, -400), (-400, 400), (400, 397)])
    values = {
        "x": centres[:, 0][None, :, None] + rng.uniform(-3, 3, (2, 5, 3)),
        "z": centres[:, 1][None, :, None] + rng.uniform(-3, 3, (2, 5, 4)),
        "v": rng.standard_normal((2, 5, 2)),
        "u": rng.standard_normal((2, 4, 2)),
        "g": np.array([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]),
    }
    values = {n: a.astype(np.float32).astype(np.float64) for n, a in values.items()}
    grad = rng.standard_normal((2, 5, 2))
    want, want_grads = two_sums_truth(values, grad)
    got, got_grads = run(module, target, values, TWO_SUMS.inputs, grad)
    assert_close(got, want, 1e-4, "forward")
    assert got_grads[4] is None  # g: no gradient
    for n, g, w in zip(("x", "v", "z", "u"), got_grads[:4], want_grads, strict=True):
        assert_close(g, w, 1e-4, f"gradient of {n}")

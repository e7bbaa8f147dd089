"""Internal tensors before a recurrence that cannot scan them, written in place of their
reads (`symgrad/inline_internals.py`). Before, each was refused though one tensor
recurs: a recurrence along two indices after an internal tensor ("coupled recurrences
run along one index": the full RNN-T forward variables from logits, soft-DTW with its
distances in the op), and a pre-activation before a scan with an initial state
("initial states: not yet"; both found by adversarial trials). Checked against NumPy
loops in float64, forward and gradient (central differences of the loop), and a training
step through each framework's own machinery, in every target; a read before an internal
tensor's first position still reads zero."""

from __future__ import annotations

import numpy as np
import pytest
from frameworks import FRAMEWORKS
from harness import generated_once
from test_recurrences import _directional, _loss_and_grads, op_spec

from symgrad.errors import SymgradError
from symgrad.pipeline import module_text

TARGETS = ("tensorflow", "pytorch", "jax")

ALPHA = (
    "alpha[b,t,u] = log(where(t == 0 and u == 0, 1, 0)"
    " + where(t == 0, 0, exp(alpha[b,t-1,u] + bl[b,t-1,u]))"
    " + where(u == 0, 0, exp(alpha[b,t,u-1] + em[b,t,u-1])))"
)


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def rnnt_loop(x):
    """torchaudio's compute_alphas over log-probabilities from logits x [B, T, U+1, V]:
    blank is class 0 and the label at u is class 1 here."""
    lp = _log_softmax(x)
    blank, emit = lp[..., 0], lp[..., 1]
    B, T, U = blank.shape
    alpha = np.zeros((B, T, U))
    for t in range(T):
        for u in range(U):
            if t == 0 and u == 0:
                continue
            terms = []
            if t > 0:
                terms.append(alpha[:, t - 1, u] + blank[:, t - 1, u])
            if u > 0:
                terms.append(alpha[:, t, u - 1] + emit[:, t, u - 1])
            alpha[:, t, u] = np.log(sum(np.exp(v) for v in terms))
    return (alpha,)


def soft_dtw_loop(x, y):
    """Soft-DTW (gamma = 1) over squared distances D[b,i,j] = |x[b,i] - y[b,j]|^2."""
    D = ((x[:, :, None, :] - y[:, None, :, :]) ** 2).sum(-1)
    B, N, M = D.shape
    R = np.zeros((B, N, M))
    for i in range(N):
        for j in range(M):
            if i == 0 and j == 0:
                R[:, i, j] = D[:, i, j]
                continue
            terms = []
            if i > 0 and j > 0:
                terms.append(np.exp(-R[:, i - 1, j - 1]))
            if i > 0:
                terms.append(np.exp(-R[:, i - 1, j]))
            if j > 0:
                terms.append(np.exp(-R[:, i, j - 1]))
            R[:, i, j] = D[:, i, j] - np.log(sum(terms))
    return (R,)


def preact_loop(x, h0):
    u = np.tanh(x) + 1
    h = np.zeros_like(x)
    for t in range(x.shape[1]):
        h[:, t] = h0 if t == 0 else 0.5 * h[:, t - 1] + u[:, t]
    return (h,)


def exp_lag_loop(x, h0):
    """An internal tensor read one position back: zero before its first position, where
    its formula in place would read exp(0) = 1."""
    e = np.exp(x)
    h = np.zeros_like(x)
    for t in range(x.shape[1]):
        h[:, t] = h0 if t == 0 else 0.5 * h[:, t - 1] + (e[:, t - 1] if t > 0 else 0)
    return (h,)


def _silu(v):
    return v / (1 + np.exp(-v))


def mamba_block_loop(cw, x, cb, delta, A, B, C, D):
    """Mamba's block (state-spaces/mamba: causal_conv1d, then selective_scan) in its
    layout x [B, D, T]: a causal depthwise convolution and silu, then the scan."""
    K = cw.shape[1]
    padded = np.concatenate([np.zeros((*x.shape[:2], K - 1)), x], -1)
    u = _silu(
        sum(
            cw[None, :, k, None] * padded[..., K - 1 - k : K - 1 - k + x.shape[2]] for k in range(K)
        )
        + cb[None, :, None]
    )
    h = np.zeros((x.shape[0], x.shape[1], A.shape[1]))
    y = np.zeros_like(x)
    for t in range(x.shape[2]):
        h = (
            np.exp(delta[..., t, None] * A[None]) * h
            + (delta[..., t] * u[..., t])[..., None] * B[:, None, :, t]
        )
        y[..., t] = (C[:, None, :, t] * h).sum(-1) + D[None] * u[..., t]
    return (y,)


# name -> (formulas, outputs, input shapes, loop); every size differs
CASES = {
    "rnnt_from_logits": (
        (
            "bl[b,t,u] = x[b,t,u,0] - log(sum(exp(x[b,t,u,v]), v))",
            "em[b,t,u] = x[b,t,u,1] - log(sum(exp(x[b,t,u,v]), v))",
            ALPHA,
        ),
        ("alpha",),
        {"x": (2, 5, 4, 3)},
        rnnt_loop,
    ),
    "soft_dtw_with_distances": (
        (
            "D[b,i,j] = sum((x[b,i,d] - y[b,j,d])**2, d)",
            (
                "R[b,i,j] = D[b,i,j] + where(i == 0 and j == 0, 0, -log("
                "where(i > 0 and j > 0, exp(-R[b,i-1,j-1]), 0) + where(i > 0, exp(-R[b,i-1,j]), 0)"
                " + where(j > 0, exp(-R[b,i,j-1]), 0)))"
            ),
        ),
        ("R",),
        {"x": (2, 5, 3), "y": (2, 4, 3)},
        soft_dtw_loop,
    ),
    "preactivation_with_initial_state": (
        ("u[b,t] = tanh(x[b,t]) + 1", "h[b,t] = where(t == 0, h0[b], 0.5 * h[b,t-1] + u[b,t])"),
        ("h",),
        {"h0": (3,), "x": (3, 7)},
        preact_loop,
    ),
    # Mamba's block in one op: the convolution's output read by the scan and by y (it
    # was refused: "'x' is read at a position computed from the scan index")
    "mamba_block": (
        (
            "u[b,d,t] = silu(sum(cw[d,k] * x[b,d,t-k], k) + cb[d])",
            "h[b,d,n,t] = exp(delta[b,d,t]*A[d,n]) * h[b,d,n,t-1] + delta[b,d,t]*B[b,n,t]*u[b,d,t]",
            "y[b,d,t] = sum(C[b,n,t]*h[b,d,n,t], n) + D[d]*u[b,d,t]",
        ),
        ("y",),
        {
            "cw": (3, 4),
            "x": (2, 3, 6),
            "cb": (3,),
            "delta": (2, 3, 6),
            "A": (3, 5),
            "B": (2, 5, 6),
            "C": (2, 5, 6),
            "D": (3,),
        },
        mamba_block_loop,
    ),
    "internal_read_one_back": (
        ("g[b,t] = exp(x[b,t])", "h[b,t] = where(t == 0, h0[b], 0.5 * h[b,t-1] + g[b,t-1])"),
        ("h",),
        {"h0": (3,), "x": (3, 6)},
        exp_lag_loop,
    ),
}


def module_for(name, target, folder):
    formulas, outputs, _, _ = CASES[name]
    op = op_spec("Inlined", formulas, outputs=outputs)
    return generated_once(f"inlined_{name}_{target}", op, target, folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("inlined")


def _values(name, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s) for n, s in CASES[name][2].items()}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_inlined_internals_match_the_loop(name, target, folder):
    module = module_for(name, target, folder)
    fw, ref = FRAMEWORKS[target], CASES[name][3]
    values = _values(name)
    names = module.INPUTS
    assert set(names) == set(values)
    args = [fw.tensor(values[n]) for n in names]
    want = ref(*[values[n] for n in names])
    np.testing.assert_allclose(fw.numpy(module.forward(*args)), want[0], rtol=1e-10, atol=1e-12)
    rng = np.random.default_rng(5)
    grads_out = [rng.standard_normal(w.shape) for w in want]
    found = module.vjp(*args, *[fw.tensor(g) for g in grads_out])
    for k, input_name in enumerate(names):
        v, fd = _directional(ref, values, names, grads_out, k, rng)
        mine = np.sum(fw.numpy(found[k]) * v)
        np.testing.assert_allclose(mine, fd, rtol=1e-6, atol=1e-8, err_msg=input_name)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", ["rnnt_from_logits", "preactivation_with_initial_state"])
def test_inlined_internals_in_a_training_step(name, target, folder):
    """The framework's gradient of a loss through `forward` is the generated vjp of
    (y - target), and one SGD step lowers the loss."""
    module = module_for(name, target, folder)
    fw, ref = FRAMEWORKS[target], CASES[name][3]
    values = _values(name, seed=3)
    args = [fw.tensor(values[n]) for n in module.INPUTS]
    want = ref(*[values[n] for n in module.INPUTS])
    rng = np.random.default_rng(4)
    targets = [w + rng.standard_normal(w.shape) for w in want]
    loss, grads, after = _loss_and_grads(fw, module, args, [fw.tensor(t) for t in targets])
    expected = module.vjp(*args, *[fw.tensor(w - t) for w, t in zip(want, targets, strict=True)])
    for g, e in zip(grads, expected, strict=True):
        np.testing.assert_allclose(g, fw.numpy(e), rtol=1e-9, atol=1e-12)
    assert after < loss


def test_the_docstring_shows_the_formulas_as_written():
    formulas, outputs, _, _ = CASES["rnnt_from_logits"]
    text = module_text(op_spec("Inlined", formulas, outputs=outputs), "test", "tensorflow")
    assert "bl[b,t,u] = x[b,t,u,0] - log(sum(exp(x[b,t,u,v]), v))" in text


# Not written in place, so the refusal of the op as written stands, pointing into the
# user's formulas: an internal tensor read one position ahead (its end is a size the
# formula does not tell) and one with an implicit sum.
@pytest.mark.parametrize(
    ("formulas", "message"),
    [
        (
            ("bl[b,t,u] = 2 * blank[b,t,u]", ALPHA.replace("bl[b,t-1,u]", "bl[b,t+1,u]")),
            "coupled recurrences run along one index",
        ),
        (
            ("u[b,t] = x[b,t,k] * w[k]", "h[b,t] = where(t == 0, h0[b], 0.5 * h[b,t-1] + u[b,t])"),
            (
                "coupled recurrence ('h' reads 'u', which does not recur), which reads zero before "
                "the start (initial states there: not yet)"
            ),
        ),
        # no internal tensor: a later equation reads the state one position back
        (
            (
                "h[b,t] = where(t == 0, h0[b], a[b,t] * h[b,t-1] + x[b,t])",
                "y[b,t] = 2 * h[b,t] + h[b,t-1] * x[b,t]",
            ),
            "('y' reads 'h' at another position)",
        ),
        # a sum over the scan index after the scan: it said 'h' was read "at another
        # position than the scan position"
        (
            ("h[b,t] = a[b,t] * h[b,t-1] + x[b,t]", "y[b] = sum(h[b,t], t)"),
            "'y' sums or reduces 'h' over the scan index 't'",
        ),
    ],
)
def test_what_is_not_written_in_place_keeps_its_refusal(formulas, message):
    outputs = (formulas[-1].split("[")[0],)
    with pytest.raises(SymgradError) as found:
        module_text(op_spec("Kept", formulas, outputs=outputs), "test", "tensorflow")
    assert message in found.value.message, found.value.message
    assert found.value.formula in formulas


@pytest.mark.parametrize("name", ["rnnt_from_logits", "soft_dtw_with_distances"])
def test_tensorflow_unknown_sizes_and_xla(name, folder):
    import tensorflow as tf
    from target_harness import check_graphs_equal_eager

    module = module_for(name, "tensorflow", folder)
    values = _values(name, seed=7)
    check_graphs_equal_eager(module, [tf.constant(values[n]) for n in module.INPUTS])

"""Two-index (wavefront) recurrences (issue 18): soft-DTW, a recurrence reading its own
tensor at earlier positions along two indices, is a scan over rows whose step is a scan
along the row. Checked in every target against a NumPy loop (forward, and the gradient
against central finite differences), in float64, with a different size for every index."""

from __future__ import annotations

import numpy as np
import pytest
from frameworks import FRAMEWORKS, _enable_x64
from harness import load_module
from test_recurrences import TARGETS, _directional, op_spec

from symgrad.errors import SymgradError
from symgrad.pipeline import module_text

# soft-DTW as in mblondel/soft-dtw and Maghoumi/pytorch-softdtw-cuda: R[-1,-1] = 0 and
# every other read outside the grid is +inf; exp(-inf/gamma) = 0 is written as a zero term.
SOFT_DTW = (
    "R[b,i,j] = D[b,i,j] - gamma * log(where(i == 0 and j == 0, 1, 0)"
    " + where(i == 0 or j == 0, 0, exp(-R[b,i-1,j-1] / gamma))"
    " + where(i == 0, 0, exp(-R[b,i-1,j] / gamma))"
    " + where(j == 0, 0, exp(-R[b,i,j-1] / gamma)))"
)
GAMMA = 0.7


def soft_dtw_ref(D, gamma=GAMMA):
    """The soft-DTW loop of the public kernels (compute_softdtw), on a batch."""
    B, N, M = D.shape
    R = np.full((B, N + 1, M + 1), np.inf)
    R[:, 0, 0] = 0.0
    for i in range(1, N + 1):
        for j in range(1, M + 1):
            r = -np.stack([R[:, i - 1, j - 1], R[:, i - 1, j], R[:, i, j - 1]]) / gamma
            top = np.max(r, 0)
            softmin = -gamma * (np.log(np.sum(np.exp(r - top), 0)) + top)
            R[:, i, j] = D[:, i - 1, j - 1] + softmin
    return (R[:, 1:, 1:],)


def diagonal_ref(D):
    R = np.zeros_like(D)
    for i in range(D.shape[1]):
        for j in range(D.shape[2]):
            R[:, i, j] = D[:, i, j] + (0.5 * R[:, i - 1, j - 1] if i and j else 0)
    return (R,)


def grid_lag_ref(D):
    """An input read one row and one position back; zero outside the grid."""
    R = np.zeros_like(D)
    for i in range(D.shape[1]):
        for j in range(D.shape[2]):
            R[:, i, j] = (
                (D[:, i - 1, j - 1] if i and j else 0)
                + (0.5 * R[:, i - 1, j] if i else 0)
                + (0.25 * R[:, i, j - 1] if j else 0)
            )
    return (R,)


CASES = {
    "soft_dtw": (
        op_spec("SoftDtw", SOFT_DTW, attrs=(("gamma", "float"),)),
        soft_dtw_ref,
        {"gamma": GAMMA},
    ),
    # one earlier row read one position back: a scan over rows, its step not a recurrence
    "diagonal": (
        op_spec("DiagonalRec", "R[b,i,j] = D[b,i,j] + 0.5 * R[b,i-1,j-1]"),
        diagonal_ref,
        {},
    ),
    # an input read at a lag along both indices, the only read that sizes j
    "grid_lag": (
        op_spec("GridLag", "R[b,i,j] = D[b,i-1,j-1] + 0.5 * R[b,i-1,j] + 0.25 * R[b,i,j-1]"),
        grid_lag_ref,
        {},
    ),
}
SHAPE = (2, 5, 4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("wavefront")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_gradient_match_loop(case, target, folder):
    spec, ref, attrs = CASES[case]
    if target == "jax":
        _enable_x64()
    module = load_module(module_text(spec, "test", target), folder, f"wf_{case}_{target}")
    fw = FRAMEWORKS[target]
    values = {"D": np.abs(np.random.default_rng(0).standard_normal(SHAPE))}
    want = ref(values["D"])
    got = module.forward(fw.tensor(values["D"]), **attrs)
    np.testing.assert_allclose(fw.numpy(got), want[0], rtol=1e-10, atol=1e-12)
    rng = np.random.default_rng(5)
    grads_out = [rng.standard_normal(SHAPE)]
    found = module.vjp(fw.tensor(values["D"]), fw.tensor(grads_out[0]), **attrs)
    v, fd = _directional(ref, values, ["D"], grads_out, 0, rng)
    np.testing.assert_allclose(np.sum(fw.numpy(found[0]) * v), fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    ("formula", "caret"),
    [
        ("R[i,j] = D[i,j] + R[i-1,j+1] + R[i+1,j-1]", "R[i-1,j+1]"),
        ("R[i,j] = D[i,j] + R[i-1,j] + R[i,j-1] + R[i-1,j+1] + R[i+1,j-1]", "R[i-1,j]"),
        ("R[i,j] = D[i,j] + R[i-k,j-1] * a[k]", "R[i-k,j-1]"),
    ],
)
def test_two_index_reads_that_cannot_be_ordered_are_refused_with_a_caret(formula, caret):
    with pytest.raises(SymgradError) as info:
        module_text(op_spec("Bad", formula), "test", "jax")
    message = str(info.value)
    assert "cannot be ordered" in message
    line = message.splitlines()
    at = next(k for k, text in enumerate(line) if formula in text)
    assert line[at + 1].index("^") == line[at].index(formula) + formula.index(caret)


def test_explain_shows_the_rows_and_the_row_step(capsys):
    from symgrad.explain_recurrence import explain_recurrence

    text = explain_recurrence(CASES["soft_dtw"][0])
    assert "Recurrence along i" in text
    assert "R_lag1_back1 is R at i - 1, read 1 back along its axis 1" in text
    assert "Recurrence along j" in text
    assert text.index("Recurrence along i") < text.index("Recurrence along j")
    assert "Adjoint recurrence (the gradient; run from the last position)" in text


# RNN-T's forward variables (torchaudio's rnnt_loss, warp-transducer's compute_alphas):
# inputs read one position back along t (blank) and along u (emit).
RNNT_ALPHA = (
    "alpha[b,t,u] = log(where(t == 0 and u == 0, 1, 0)"
    " + where(t == 0, 0, exp(alpha[b,t-1,u] + blank[b,t-1,u]))"
    " + where(u == 0, 0, exp(alpha[b,t,u-1] + emit[b,t,u-1])))"
)


def rnnt_alpha_ref(blank, emit):
    """warp-transducer's compute_alphas on a batch: alpha[0,0] = 0, the first column
    along blanks, the first row along emissions, every other cell the log-sum-exp of the
    two paths into it (evaluated stably: the float32 test's paths underflow float64)."""
    B, T, U1 = blank.shape
    alpha = np.zeros((B, T, U1))
    for t in range(T):
        for u in range(U1):
            if t == 0 and u == 0:
                continue
            paths = []
            if t > 0:
                paths.append(alpha[:, t - 1, u] + blank[:, t - 1, u])
            if u > 0:
                paths.append(alpha[:, t, u - 1] + emit[:, t, u - 1])
            alpha[:, t, u] = np.logaddexp.reduce(paths, axis=0)
    return (alpha,)


def _log_probs(seed):
    """Moderate log-probabilities of blank and of the next label, [batch, T, U+1]."""
    rng = np.random.default_rng(seed)
    return {n: -0.5 - np.abs(rng.standard_normal((2, 5, 4))) for n in ("blank", "emit")}


@pytest.mark.parametrize("target", TARGETS)
def test_rnnt_alpha_matches_loop_and_trains(target, folder):
    """RNN-T's alphas (inputs read at a lag along both indices) match a NumPy loop of the
    kernel, forward and the gradient of both inputs (central differences, float64); and a
    training step through the framework's autodiff equals the generated vjp."""
    from test_recurrences import _loss_and_grads

    if target == "jax":
        _enable_x64()
    spec = op_spec("RnntAlpha", RNNT_ALPHA, inputs=("blank", "emit"))
    module = load_module(module_text(spec, "test", target), folder, f"wf_rnnt_{target}")
    fw = FRAMEWORKS[target]
    names = module.INPUTS
    values = _log_probs(0)
    args = [fw.tensor(values[n]) for n in names]
    want = rnnt_alpha_ref(*[values[n] for n in names])
    np.testing.assert_allclose(fw.numpy(module.forward(*args)), want[0], rtol=1e-12, atol=1e-13)
    rng = np.random.default_rng(5)
    grads_out = [rng.standard_normal(want[0].shape)]
    found = module.vjp(*args, fw.tensor(grads_out[0]))
    for k, name in enumerate(names):
        v, fd = _directional(rnnt_alpha_ref, values, names, grads_out, k, rng)
        np.testing.assert_allclose(np.sum(fw.numpy(found[k]) * v), fd, rtol=1e-7, err_msg=name)
    targets = [w + rng.standard_normal(w.shape) for w in want]
    loss, grads, after = _loss_and_grads(fw, module, args, [fw.tensor(t) for t in targets])
    expected = module.vjp(*args, *[fw.tensor(w - t) for w, t in zip(want, targets)])
    for g, e in zip(grads, expected, strict=True):
        np.testing.assert_allclose(g, fw.numpy(e), rtol=1e-9, atol=1e-12)
    assert after < loss


@pytest.mark.parametrize("target", TARGETS)
def test_rnnt_alpha_in_float32_with_log_probabilities_in_the_hundreds(target, folder):
    """Log-probabilities from -400 to -100: every exp of a path underflows float32, yet
    the alphas (log of a sum of exps, kept in log space) and their gradients match the
    float64 loop to float32's precision at that scale."""
    spec = op_spec("RnntAlpha", RNNT_ALPHA, inputs=("blank", "emit"))
    module = load_module(module_text(spec, "test", target), folder, f"wf_rnnt32_{target}")
    fw = FRAMEWORKS[target]
    names = module.INPUTS
    rng = np.random.default_rng(7)
    values = {n: rng.uniform(-400, -100, (2, 6, 5)).astype(np.float32) for n in names}
    exact = {n: v.astype(np.float64) for n, v in values.items()}
    (want,) = rnnt_alpha_ref(*[exact[n] for n in names])
    assert np.isfinite(want).all()
    args = [fw.tensor(values[n]) for n in names]
    got = fw.numpy(module.forward(*args)).astype(np.float64)
    assert np.isfinite(got).all(), got
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    grad_out = rng.standard_normal(want.shape)
    found = module.vjp(*args, fw.tensor(grad_out.astype(np.float32)))
    for k, name in enumerate(names):
        g = fw.numpy(found[k]).astype(np.float64)
        assert np.isfinite(g).all(), f"{name}: {g}"
        v, fd = _directional(rnnt_alpha_ref, exact, names, [grad_out], k, rng)
        assert abs(np.sum(g * v) - fd) <= 1e-3 * max(abs(fd), 1.0), (name, np.sum(g * v), fd)


@pytest.mark.parametrize("target", TARGETS)
def test_inner_scans_follow_the_module_budget(target, folder):
    """The scan along a row (the step of the scan over rows) plans its levels from the
    module's MAX_TEMP_BYTES at call time, not from a copy of its own: 29 positions take
    one level of 6 under the default budget and four (16, 8, 4, 2) at budget 0, and
    soft-DTW's forward and gradient over rows of 29 are the same under both."""
    spec, _, attrs = CASES["soft_dtw"]
    if target == "jax":
        _enable_x64()
    module = load_module(module_text(spec, "test", target), folder, f"wf_budget_{target}")
    assert not any(name.endswith("_MAX_TEMP_BYTES") for name in vars(module))
    fw = FRAMEWORKS[target]
    shape = (2, 3, 29)
    rng = np.random.default_rng(14)
    d = fw.tensor(np.abs(rng.standard_normal(shape)))
    cotangent = fw.tensor(rng.standard_normal(shape))
    assert module._step_chunk_lengths(29, 1000) == (6,)
    plain = [module.forward(d, **attrs), *module.vjp(d, cotangent, **attrs)]
    module.MAX_TEMP_BYTES = 0
    assert module._step_chunk_lengths(29, 1000) == (16, 8, 4, 2)
    levels = [module.forward(d, **attrs), *module.vjp(d, cotangent, **attrs)]
    for got, want in zip(levels, plain, strict=True):
        np.testing.assert_allclose(fw.numpy(got), fw.numpy(want), rtol=1e-12, atol=1e-13)

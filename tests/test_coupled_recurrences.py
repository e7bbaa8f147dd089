"""Coupled recurrences: several recurrent tensors scanned together as one carry, each
reading its own and the others' earlier positions, and equations after them reading
them at earlier positions (RWKV-4's WKV as its recurrence, `RwkvWkvScan` in this repo's
symgrad.toml). Checked in float64 against NumPy loops and the O(T^2) closed form
(`RwkvWkv`), forward and gradient (central finite differences), with a training step
in every target; a cycle at the same position is refused with a caret."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from frameworks import FRAMEWORKS, _enable_x64
from harness import load_module
from test_recurrences import _directional, _loss_and_grads, op_spec

from symgrad.errors import SymgradError
from symgrad.pipeline import module_text
from symgrad.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("tensorflow", "pytorch", "jax")


def spec_op(name):
    return next(o for o in load_spec(str(ROOT / "symgrad.toml")).ops if o.name == name)


def wkv_loop(w, u, k, v):
    """RWKV-4's WKV as the CUDA kernel runs it (wkv_cuda.cu, kernel_forward), without its
    max-shift: a running numerator and denominator per channel, decayed by exp(w)."""
    num = np.zeros((k.shape[0], k.shape[2]))
    den = np.zeros_like(num)
    y = np.zeros_like(k)
    for t in range(k.shape[1]):
        now = np.exp(u + k[:, t])
        y[:, t] = (num + now * v[:, t]) / (den + now)
        num = np.exp(w) * num + np.exp(k[:, t]) * v[:, t]
        den = np.exp(w) * den + np.exp(k[:, t])
    return (y,)


def wkv_closed_form(w, u, k, v):
    """RwkvWkv's formula in NumPy: the O(T^2) sums over earlier positions."""
    T = k.shape[1]
    t, i = np.arange(T)[:, None], np.arange(T)[None, :]
    decay = np.where(i < t, (t - 1 - i), 0)[None, :, :, None] * w  # [1, t, i, c]
    weight = np.where((i < t)[None, :, :, None], np.exp(decay + k[:, None]), 0)
    a = (weight * v[:, None]).sum(2)
    d = weight.sum(2)
    now = np.exp(u + k)
    return ((a + now * v) / (d + now),)


def wkv_inputs(shape=(2, 7, 3), seed=0):
    rng = np.random.default_rng(seed)
    b, t, c = shape
    return {
        "w": -np.abs(rng.standard_normal(c)) - 0.1,  # the kernel's -exp(time_decay)
        "u": rng.standard_normal(c),
        "k": rng.standard_normal((b, t, c)),
        "v": rng.standard_normal((b, t, c)),
    }


_MODULES = {}


def module_of(op, target, folder):
    if target == "jax":
        _enable_x64()
    key = (op.name, op.formulas, target)
    if key not in _MODULES:
        name = f"coupled_{len(_MODULES)}_{target}"
        _MODULES[key] = load_module(module_text(op, "test", target), folder, name)
    return _MODULES[key]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("coupled")


def _check_forward_and_gradient(module, target, values, ref, seed=5):
    fw = FRAMEWORKS[target]
    names = module.INPUTS
    args = [fw.tensor(values[n]) for n in names]
    want = ref(*[values[n] for n in names])
    got = module.forward(*args)
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(fw.numpy(g), w, rtol=1e-10, atol=1e-12)
    rng = np.random.default_rng(seed)
    grads_out = [rng.standard_normal(w.shape) for w in want]
    found = module.vjp(*args, *[fw.tensor(g) for g in grads_out])
    for k, name in enumerate(names):
        v, fd = _directional(ref, values, names, grads_out, k, rng)
        mine = np.sum(fw.numpy(found[k]) * v)
        np.testing.assert_allclose(mine, fd, rtol=1e-6, atol=1e-8, err_msg=name)


def test_the_loop_is_the_closed_form():
    """The kernel's recurrence and RwkvWkv's closed form are one function."""
    values = wkv_inputs((2, 9, 4), seed=1)
    np.testing.assert_allclose(
        wkv_loop(**values)[0], wkv_closed_form(**values)[0], rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("target", TARGETS)
def test_rwkv_scan_matches_the_loop_and_trains(target, folder):
    """RwkvWkvScan: forward and gradient against the loop (b, t, c = 2, 7, 3), and a
    training step through the framework's autodiff equal to the generated vjp."""
    module = module_of(spec_op("RwkvWkvScan"), target, folder)
    values = wkv_inputs()
    _check_forward_and_gradient(module, target, values, wkv_loop)
    fw = FRAMEWORKS[target]
    args = [fw.tensor(values[n]) for n in module.INPUTS]
    (want,) = wkv_loop(*[values[n] for n in module.INPUTS])
    target_y = want + np.random.default_rng(4).standard_normal(want.shape)
    loss, grads, after = _loss_and_grads(fw, module, args, [fw.tensor(target_y)])
    expected = module.vjp(*args, fw.tensor(want - target_y))
    for g, e in zip(grads, expected, strict=True):
        np.testing.assert_allclose(g, fw.numpy(e), rtol=1e-9, atol=1e-12)
    assert after < loss


def test_rwkv_scan_agrees_with_the_closed_form_op(folder):
    """The scan and the spec's O(T^2) RwkvWkv give the same values and gradients."""
    import torch

    scan = module_of(spec_op("RwkvWkvScan"), "pytorch", folder)
    closed = module_of(spec_op("RwkvWkv"), "pytorch", folder)
    assert scan.INPUTS == closed.INPUTS
    values = wkv_inputs((3, 8, 2), seed=2)
    args = [torch.tensor(values[n]) for n in scan.INPUTS]
    torch.testing.assert_close(scan.forward(*args), closed.forward(*args), rtol=1e-12, atol=0)
    g = torch.tensor(np.random.default_rng(3).standard_normal((3, 8, 2)))
    for a, b in zip(scan.vjp(*args, g), closed.vjp(*args, g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_max_shifted_scan_survives_float32(folder):
    """RwkvWkvScanStable (the kernel's max-shift, a third state p) equals the loop in
    float64, forward and gradient, and in float32 with k + 100 -- where exp(k) overflows
    and RwkvWkvScan gives no finite value -- it still gives y (unchanged by a shift of
    every k) and finite gradients."""
    target = "tensorflow"
    module = module_of(spec_op("RwkvWkvScanStable"), target, folder)
    values = wkv_inputs((2, 6, 5), seed=8)
    _check_forward_and_gradient(module, target, values, wkv_loop)
    fw = FRAMEWORKS[target]
    shifted = {**values, "k": values["k"] + 100.0}
    args = [fw.tensor(shifted[n].astype(np.float32)) for n in module.INPUTS]
    (want,) = wkv_loop(**values)
    got = fw.numpy(module.forward(*args))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    grads = module.vjp(*args, fw.tensor(np.ones(want.shape, np.float32)))
    assert all(np.isfinite(fw.numpy(g)).all() for g in grads)
    plain = module_of(spec_op("RwkvWkvScan"), target, folder)
    assert not np.isfinite(fw.numpy(plain.forward(*args))).all()


def rotation_loop(x, c, s):
    """Two states reading each other one position back; both are outputs."""
    p = np.zeros_like(x)
    q = np.zeros_like(x)
    for t in range(x.shape[1]):
        pp = p[:, t - 1] if t else 0
        qq = q[:, t - 1] if t else 0
        p[:, t] = c * pp - s * qq + x[:, t]
        q[:, t] = s * pp + c * qq
    return p, q


def reverse_loop(x, a):
    """A reverse state and an output reading it one position later (and at the same
    position through another equation)."""
    h = np.zeros_like(x)
    for t in reversed(range(x.shape[1])):
        h[:, t] = x[:, t] + a * (h[:, t + 1] if t + 1 < x.shape[1] else 0)
    later = np.concatenate([h[:, 1:], np.zeros_like(h[:, :1])], 1)
    g = np.tanh(h)
    return (g * later + x,)


COUPLED = {
    "rotation": (
        op_spec(
            "Rotation",
            [
                "p[b,t] = c[b] * p[b,t-1] - s[b] * q[b,t-1] + x[b,t]",
                "q[b,t] = s[b] * p[b,t-1] + c[b] * q[b,t-1]",
            ],
            inputs=("x", "c", "s"),
        ),
        {"x": (3, 6), "c": (3,), "s": (3,)},
        rotation_loop,
        "tensorflow",
    ),
    "reverse": (
        op_spec(
            "ReverseLater",
            [
                "h[b,t] = x[b,t] + a[b] * h[b,t+1]",
                "z[b,t] = g[b,t] * h[b,t+1] + x[b,t]",
                "g[b,t] = tanh(h[b,t])",
            ],
            inputs=("x", "a"),
            outputs=("z",),
        ),
        {"x": (2, 5), "a": (2,)},
        reverse_loop,
        "pytorch",
    ),
}


@pytest.mark.parametrize("case", sorted(COUPLED))
def test_coupled_spellings_match_loops(case, folder):
    """States read each other (both outputs), and a reverse scan whose later equation
    reads the state one position on and, ordered before it, another equation's tensor at
    the same position (written after it)."""
    op, shapes, ref, target = COUPLED[case]
    module = module_of(op, target, folder)
    rng = np.random.default_rng(9)
    values = {n: 0.5 * rng.standard_normal(s) for n, s in shapes.items()}
    _check_forward_and_gradient(module, target, values, ref)


@pytest.mark.parametrize(
    ("formulas", "message", "caret"),
    [
        (
            ["h[b,t] = g[b,t] + h[b,t-1]", "g[b,t] = h[b,t] * x[b,t]"],
            "cannot be ordered within a position",
            "h[b,t] *",
        ),
        (
            ["h[b,t] = x[b,t] + h[b,t-1]", "y[b,t] = h[b,t+1] * x[b,t]"],
            "both before and after",
            "h[b,t-1]",
        ),
        (
            ["h[b,t] = x[b,t] + h[b,t-1]", "g[b,t,d] = x[b,t] * w[d] + g[b,t-1,d]"],
            "have the same indices apart from 't'",
            "g[b,t,d] =",
        ),
    ],
)
def test_coupled_refusals_point_at_the_read(formulas, message, caret):
    with pytest.raises(SymgradError) as found:
        module_text(op_spec("Bad", formulas), "test", "tensorflow")
    error = found.value
    assert message in error.message, error.message
    text = next(f for f in formulas if caret in f)
    assert error.formula == text
    assert error.column == text.index(caret), error.render()


def test_rwkv_scan_training_step_memory_is_bounded(folder):
    """The carry is kept as one window per chunk of about sqrt(L) positions: a training
    step's peak allocation stays under 4x the inputs and outputs, and the forward keeps
    its inputs and the checkpoints, far less than num and den over the sequence."""
    import torch
    from test_tiling import _torch_memory

    module = module_of(spec_op("RwkvWkvScan"), "pytorch", folder)
    length = 196  # 14 chunks of 14 positions
    values = wkv_inputs((1, length, 64), seed=6)
    xs = [torch.tensor(values[n], dtype=torch.float32, requires_grad=True) for n in module.INPUTS]
    inputs = sum(x.numel() for x in xs) * 4
    outputs = length * 64 * 4
    states = 2 * 64 * 4  # num and den at one position
    kept, peak = _torch_memory(module, xs, {})
    assert kept <= inputs + 2 * 14 * states  # one window of states per chunk
    assert peak < 4 * (inputs + outputs)
    assert kept < inputs + length * states  # num and den over the sequence would not fit
    print(f"kept {kept} B, peak {peak} B, inputs + outputs {inputs + outputs} B")


def test_explain_and_check_cover_the_coupled_scan(tmp_path, capsys):
    from symgrad.check import run
    from symgrad.cli import main

    assert main(["explain", "--op", "RwkvWkvScan", "--spec", str(ROOT / "symgrad.toml")]) == 0
    text = capsys.readouterr().out
    assert "Coupled recurrence along t (from the first position on" in text
    assert "computed by one scan whose state is num, den" in text
    assert "num_lag1 is num at t - 1 (zero before the start)" in text
    assert "Adjoint recurrence" in text
    # the step's derived gradient of a past state: what the adjoint passes back
    assert "grad_num_lag1[b,c] = " in text

    spec_path = tmp_path / "symgrad.toml"
    toml = (ROOT / "symgrad.toml").read_text(encoding="utf-8")
    start = toml.index("[ops.RwkvWkvScan]\n")
    end = toml.find("\n[ops.", start)
    spec_path.write_text(toml[start : end if end > 0 else None], encoding="utf-8")
    assert main(["generate", str(spec_path)]) == 0
    report = run(load_spec(str(spec_path)), tmp_path / "generated")
    (op,) = report.ops
    assert [r.passed for r in op.results] == [True, True], op

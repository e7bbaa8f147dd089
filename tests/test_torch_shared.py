"""PyTorch bodies compute a sub-expression they write more than once once (torch_shared):
the printed body binds it once and the gradient is the unshared module's to the bit and TF
float64 autodiff's; what must not be shared is not (a `Cond` or `Whole` branch, a
`broadcast_tile`); an in-place op never writes into a shared value another step reads;
and a tiled PyTorch step's peak stays within its bound."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("tensorflow")

from harness import load_module, op_spec
from target_harness import check_target
from test_memory_sampled_reads import SIZES, _arrays, _check, _op
from test_numeric import CORPUS
from test_target_pytorch import TORCH
from test_tiling import _torch_memory

from symgrad import ir
from symgrad.pipeline import module_text
from symgrad.targets import torch_shared

LAYER_NORM = CORPUS["layer_norm"]
CENTRED = "x - _s1[..., None] / float(_n_l)"  # x minus its mean: the norm and y read it


def _text(case, name, shared=True, monkeypatch=None):
    if not shared:
        monkeypatch.setattr(torch_shared, "shared_once", lambda block, *a, **k: block)
    text = module_text(op_spec(case, name), "test.toml", "pytorch")
    if not shared:
        monkeypatch.undo()
    return text


def _body(text: str, function: str) -> str:
    return text.split(f"\ndef {function}(", 1)[1].split("\ndef ", 1)[0]


def test_a_sub_expression_written_twice_is_computed_once(tmp_path, monkeypatch):
    """layer_norm's forward writes x minus its mean twice (squared for the variance, and
    y's numerator): with sharing it is one step read by name, else written twice. The
    vjp is the unshared module's bit for bit, and TF float64 autodiff's."""
    shared = _text(LAYER_NORM, "SharedLn")
    unshared = _text(LAYER_NORM, "UnsharedLn", shared=False, monkeypatch=monkeypatch)
    assert _body(unshared, "_compute").count(CENTRED) == 2
    body = _body(shared, "_compute")
    assert body.count(CENTRED) == 1, body
    name = re.search(rf"(_c\d+) = {re.escape(CENTRED)}\n", body).group(1)
    assert len(re.findall(rf"\b{name}\b", body)) == 3, body  # bound, then read twice
    a = load_module(shared, tmp_path, "shared_ln")
    b = load_module(unshared, tmp_path, "unshared_ln")
    check_target(LAYER_NORM, a, TORCH)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((4, 7)))
    g = torch.from_numpy(rng.standard_normal((4, 7)))
    assert torch.equal(a.forward(x, eps=1e-3), b.forward(x, eps=1e-3))
    for got, want in zip(a.vjp(x, g, eps=1e-3), b.vjp(x, g, eps=1e-3), strict=True):
        assert torch.equal(got, want)


def test_an_in_place_op_never_writes_into_a_shared_value(tmp_path):
    """The shared x - mean of layer_norm has two readers: the first (its square) is not
    done in place, so y reads the centred x, not its square. A training step through
    `forward` (anomaly detection off: the version counter alone would not say) gives TF's
    numbers (check_target), and gradcheck and gradgradcheck pass in float64."""
    text = _text(LAYER_NORM, "InPlaceLn")
    body = _body(text, "_compute")
    name = re.search(rf"(_c\d+) = {re.escape(CENTRED)}\n", body).group(1)
    assert f'_overwrite({name}, "' not in body.split(f"{name} = ", 1)[1].split("\n    y", 1)[0]
    module = load_module(text, tmp_path, "in_place_ln")
    assert not torch.is_anomaly_enabled()
    check_target(LAYER_NORM, module, TORCH)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((3, 5))).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: module.forward(t, eps=1e-3), (x,))
    assert torch.autograd.gradgradcheck(lambda t: module.forward(t, eps=1e-3), (x,))


# -- what is not shared: IR-level, each rule on its own --------------------------------

X, Y, Z, P = (ir.Var(n) for n in "xyzp")
QUOTIENT = ir.Binary("/", X, Y)  # x / y: nan or inf where the branch guards y == 0


def _shared(steps, returns):
    block = ir.Block(tuple(ir.Assign(t, v) for t, v in steps), returns)
    return torch_shared.shared_once(block, returns, frozenset(), lambda e: False)


def _outside_branches(e: ir.Expr):
    """The sub-expressions of `e` that run whichever branch is taken."""
    yield e
    if isinstance(e, ir.Cond | ir.Whole):
        return
    for child in ir.children(e):
        yield from _outside_branches(child)


def test_a_value_of_one_branch_is_not_computed_before_the_branch():
    """x / y written in the taken branch of two Conds (and of two Wholes) stays in its
    branches: bound before them, it would run where the branch guards against it."""
    for branch in (
        lambda other: ir.Cond(P, QUOTIENT, other, kept=True),
        lambda other: ir.Whole("n", QUOTIENT, other),
    ):
        steps = [("a", branch(X)), ("b", ir.Binary("*", branch(Y), Z))]
        block = _shared(steps, ("a", "b"))
        assert [s.target for s in block.steps] == ["a", "b"], block
        for step in block.steps:
            assert QUOTIENT not in set(_outside_branches(step.value)), step


def test_a_branch_value_written_once_outside_is_not_shared_into_the_branch():
    """x / y once outside a Cond and once in its branch: one write outside, nothing to
    share, the branch keeps its own."""
    steps = [("a", ir.Binary("+", QUOTIENT, Z)), ("b", ir.Cond(P, QUOTIENT, X, kept=True))]
    block = _shared(steps, ("a", "b"))
    assert block.steps == tuple(ir.Assign(t, v) for t, v in steps)


def test_broadcast_tile_is_not_shared():
    """broadcast_tile prints as its operand where an elementwise op reads it: bound as a
    step of its own it would be a tiled copy."""
    tiled = ir.Call("broadcast_tile", (X, ir.Shape((("_n_b",), ("_n_i",)))))
    steps = [("a", ir.Binary("*", tiled, Y)), ("b", ir.Binary("+", tiled, Z))]
    block = _shared(steps, ("a", "b"))
    assert [s.target for s in block.steps] == ["a", "b"], block


def test_a_repeated_value_outside_the_branches_is_shared():
    """The control: the same steps with x / y outside any branch do share it, once."""
    steps = [("a", ir.Binary("+", QUOTIENT, Z)), ("b", ir.Binary("*", QUOTIENT, Z))]
    block = _shared(steps, ("a", "b"))
    assert block.steps[0] == ir.Assign("_c1", QUOTIENT)
    assert block.steps[1:] == (
        ir.Assign("a", ir.Binary("+", ir.Var("_c1"), Z)),
        ir.Assign("b", ir.Binary("*", ir.Var("_c1"), Z)),
    )


# -- the peak of a tiled step --------------------------------------------------------------


def test_a_tiled_grid_sample_step_stays_within_its_bound(tmp_path, monkeypatch):
    """grid_sample's bodies share their corner weights across the four corners; a shared
    value bound before its first reader and held to its last must not raise the step's
    peak. The tiled PyTorch training step stays within 4 x io + budget, and within 5% of
    the same module printed without sharing (measured: equal, 2654216 bytes both)."""
    op = "GridSample"
    _, _, attrs, budget = SIZES[op]
    peaks = {}
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(torch_shared, "shared_once", lambda block, *a, **k: block)
        text = module_text(_op(op), "symgrad.toml", "pytorch")
        module = load_module(text, tmp_path, f"grid_sample_shared_{shared}")
        args = [torch.tensor(a, requires_grad=True) for a in _arrays(op)]
        with torch.no_grad():
            io = sum(a.nbytes for a in args) + module.forward(*args, **attrs).nbytes
        module.MAX_TEMP_BYTES = 2**40
        untiled = _torch_memory(module, args, attrs)[1]
        module.MAX_TEMP_BYTES = budget
        assert module._tile_plan(*args, **attrs) is not None
        peaks[shared] = _torch_memory(module, args, attrs)[1]
        if shared:
            _check(op, "pytorch", io, untiled, peaks[shared])
    print(f"tiled peak: shared {peaks[True]}, unshared {peaks[False]}")
    assert peaks[True] <= 1.05 * peaks[False], peaks

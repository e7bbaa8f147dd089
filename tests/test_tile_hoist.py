"""A nested tiling's chunk-invariant work, once before its chunk loop (`tile_hoist`,
PyTorch): roi_align_rotated's per-roi geometry, the layout copy of its map and the sizes
are computed by `_compute_once` and `_backward_once` once per loop and passed to every
chunk, which computes the same values from them: bit for bit the chunks that compute
them themselves (the loop's fallback, where they would be too large to hold)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from harness import generate
from test_tiling_adversarial_4 import REAL

ATTRS = {"scale": 0.5, "PH": 3, "PW": 3, "S": 2}


def _arrays(k=3, channels=2):
    rng = np.random.default_rng(7)
    rois = np.stack(
        [
            rng.integers(0, 2, k),
            *rng.uniform(6, 10, (2, k)),
            *rng.uniform(4, 8, (2, k)),
            rng.uniform(-1, 1, k),
        ],
        1,
    )
    return rois, rng.standard_normal((2, channels, 10, 10))


def _step(module, rois, image, attrs=ATTRS):
    """forward, then the gradient of the sum of sin of the output (map and rois)."""
    xs = [torch.tensor(rois, requires_grad=True), torch.tensor(image, requires_grad=True)]
    out = module.forward(*xs, **attrs)
    return (out.detach(), *torch.autograd.grad(torch.sin(out).sum(), xs))


def _counting(monkeypatch, module, counts):
    """Count the calls of the program's functions and of the once functions."""
    for name in ("_compute_once", "_backward_once", "_compute", "_recompute", "_backward"):
        original = getattr(module, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hoist")
    return generate(REAL["roi_align_rotated"], folder, prefix="Hoist", target="pytorch")


def test_chunks_take_the_invariant_work_once_and_equal_their_fallback_bit_for_bit(
    module, monkeypatch
):
    """At a budget where the loop keeps them, the forward computes the invariant values
    once (not once a chunk) and the backward once for its recompute and once for its
    gradient; every output and gradient equals, bit for bit, the same chunks computing
    them each for itself, and, to rounding, the untiled step (float64)."""
    rois, image = _arrays()
    module.MAX_TEMP_BYTES = 2**40
    untiled = _step(module, rois, image)
    module.MAX_TEMP_BYTES = 2**12
    xs = (torch.tensor(rois), torch.tensor(image))
    plan = module._tile_plan(*xs, **ATTRS)
    n, c, n2, c2 = plan
    chunks = -(-n // c) * -(-n2 // c2)
    assert chunks >= 4, plan
    once = module._compute_once(*xs, **ATTRS)
    assert module._kept_once(once, xs) is not None

    counts: dict = {}
    _counting(monkeypatch, module, counts)
    hoisted = _step(module, rois, image)
    assert counts == {
        "_compute_once": 2,
        "_backward_once": 1,
        "_compute": chunks,
        "_recompute": chunks,
        "_backward": chunks,
    }, (counts, plan)
    counts.clear()
    with monkeypatch.context() as patch:  # every chunk computes them
        patch.setattr(module, "_kept_once", lambda values, inputs: None)
        alone = _step(module, rois, image)
    assert counts["_compute_once"] == 2 + 2 * chunks, counts
    assert counts["_backward_once"] == 1 + chunks, counts
    for got, fallback, whole in zip(hoisted, alone, untiled, strict=True):
        assert torch.equal(got, fallback)
        torch.testing.assert_close(got, whole, rtol=1e-12, atol=1e-12)


def test_invariant_values_too_large_to_hold_are_computed_by_every_chunk(module):
    """The loop holds the invariant values while their bytes are within the inputs' and an
    eighth of the budget: at a budget of one byte, the map's layout copy alone is the
    inputs' bytes less the rois', and the per-roi values pass that."""
    rois, image = _arrays()
    xs = (torch.tensor(rois), torch.tensor(image))
    module.MAX_TEMP_BYTES = 1
    once = module._compute_once(*xs, **ATTRS)
    held = sum(v.nbytes for v in once if isinstance(v, torch.Tensor))
    inputs = rois.nbytes + image.nbytes
    assert held > inputs
    assert module._kept_once(once, xs) is None
    module.MAX_TEMP_BYTES = 8 * (held - inputs)
    assert module._kept_once(once, xs) is once


def test_hoisted_chunks_compile_with_fullgraph(module):
    """torch.compile(fullgraph=True) unrolls the loop (two chunks of one row of 2 x 2 bins:
    tracing 2 x 2 chunks took 70 s on a busy machine) with the invariant values passed
    in: forward and gradients equal the eager ones."""
    rois, image = _arrays(k=2, channels=2)
    attrs = {**ATTRS, "PH": 2, "PW": 2}
    module.MAX_TEMP_BYTES = 2**12
    xs = [torch.tensor(rois, requires_grad=True), torch.tensor(image, requires_grad=True)]
    assert module._tile_plan(*xs, **attrs) == (2, 1, 2, 2)
    assert module._kept_once(module._compute_once(*xs, **attrs), xs) is not None
    want = _step(module, rois, image, attrs)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *a: module.forward(*a, **attrs), fullgraph=True, backend="aot_eager"
    )
    out = compiled(*xs)
    got = (out.detach(), *torch.autograd.grad(torch.sin(out).sum(), xs))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.fixture(scope="module")
def grid_sample(tmp_path_factory):
    """symgrad.toml's GridSample: tiled in one level, along the grid's rows."""
    from pathlib import Path

    from harness import load_module

    from symgrad.pipeline import module_text
    from symgrad.spec import parse_spec

    toml = Path(__file__).resolve().parent.parent / "symgrad.toml"
    spec = parse_spec(toml.read_text(encoding="utf-8"), "symgrad.toml")
    op = next(op for op in spec.ops if op.name == "GridSample")
    folder = tmp_path_factory.mktemp("hoist_one_level")
    return load_module(module_text(op, "symgrad.toml", "pytorch"), folder, "hoist_grid_sample")


def test_one_level_chunks_take_the_invariant_work_once_bit_for_bit(grid_sample, monkeypatch):
    """A tiling in one level hoists as a nested one: grid_sample's chunks of grid rows
    share the map's layout copy for their gathers and its sizes, computed once by the
    forward and once each by the backward's recompute and gradient; outputs and gradients
    equal, bit for bit, the chunks computing them each for itself, and, to rounding, the
    untiled step (float64)."""
    module = grid_sample
    rng = np.random.default_rng(3)
    x, g = rng.standard_normal((2, 3, 6, 7)), rng.uniform(-1.1, 1.1, (2, 9, 5, 2))

    def step():
        xs = [torch.tensor(x, requires_grad=True), torch.tensor(g, requires_grad=True)]
        out = module.forward(*xs)
        return (out.detach(), *torch.autograd.grad(torch.sin(out).sum(), xs))

    module.MAX_TEMP_BYTES = 2**40
    untiled = step()
    module.MAX_TEMP_BYTES = 2**11
    xs = (torch.tensor(x), torch.tensor(g))
    n, c = module._tile_plan(*xs)
    chunks = -(-n // c)
    assert chunks >= 3, (n, c)
    assert module._kept_once(module._compute_once(*xs), xs) is not None

    counts: dict = {}
    _counting(monkeypatch, module, counts)
    hoisted = step()
    assert counts == {
        "_compute_once": 2,
        "_backward_once": 1,
        "_compute": chunks,
        "_recompute": chunks,
        "_backward": chunks,
    }, counts
    counts.clear()
    with monkeypatch.context() as patch:  # every chunk computes them
        patch.setattr(module, "_kept_once", lambda values, inputs: None)
        alone = step()
    assert counts["_compute_once"] == 2 + 2 * chunks, counts
    assert counts["_backward_once"] == 1 + chunks, counts
    for got, fallback, whole in zip(hoisted, alone, untiled, strict=True):
        assert torch.equal(got, fallback)
        torch.testing.assert_close(got, whole, rtol=1e-12, atol=1e-12)


def test_one_level_hoisted_chunks_compile_with_fullgraph(grid_sample):
    """torch.compile(fullgraph=True) unrolls a one-level loop (two chunks of grid rows)
    with the invariant values passed in: forward and gradients equal the eager ones."""
    module = grid_sample
    rng = np.random.default_rng(5)
    x, g = rng.standard_normal((1, 2, 5, 6)), rng.uniform(-1.1, 1.1, (1, 2, 3, 2))
    xs = [torch.tensor(x, requires_grad=True), torch.tensor(g, requires_grad=True)]
    module.MAX_TEMP_BYTES = 2**8
    n, c = module._tile_plan(*xs)
    assert -(-n // c) == 2, (n, c)
    assert module._kept_once(module._compute_once(*xs), xs) is not None
    out = module.forward(*xs)
    want = (out.detach(), *torch.autograd.grad(torch.sin(out).sum(), xs))
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: module.forward(*a), fullgraph=True, backend="aot_eager")
    out = compiled(*xs)
    got = (out.detach(), *torch.autograd.grad(torch.sin(out).sum(), xs))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

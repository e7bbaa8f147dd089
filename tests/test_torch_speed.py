"""The PyTorch target's eager speed on pairwise ops (issue 16, section 5): where autograd
records nothing, elementwise steps write over temporaries nothing reads after
(`_overwrite`), a comparison cast to numbers is written straight into that dtype
(`_compare`), and a contraction with a short last output axis computes that axis first
(`_einsum`); gradients, and gradients of gradients, are unchanged."""

from __future__ import annotations

import itertools

import pytest
from harness import load_module

from symgrad.pipeline import module_text
from symgrad.spec import parse_spec

torch = pytest.importorskip("torch")

_counter = itertools.count()
FORMULAS = {
    "rbf": "y[b,i] = sum(exp(-sum((x[b,i,c] - z[b,j,c])**2, c)), j)",
    "chamfer": "y[b,i] = min(sum((x[b,i,c] - z[b,j,c])**2, c), j)",
}


def _module(tmp_path, formula: str):
    name = f"Speed{next(_counter)}"
    op = parse_spec(f'[ops.{name}]\nformula = "{formula}"\n', "test.toml").ops[0]
    text = module_text(op, "test.toml", "pytorch")
    return load_module(text, tmp_path, f"symgrad_pytorch_{name.lower()}")


def _points(seed: int, *shape):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def _full_size_allocations(step, size: int) -> int:
    """How many allocations of at least `size` bytes `step()` makes (torch.profiler's
    "[memory]" events)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profile:
        step()
    events = [e for e in profile.profiler.kineto_results.events() if e.name() == "[memory]"]
    return sum(1 for e in events if e.nbytes() >= size)


@pytest.mark.parametrize(("name", "most"), [("rbf", 2), ("chamfer", 3)])
def test_torch_pairwise_forward_writes_over_its_temporaries(tmp_path, name, most):
    """The forward of a pairwise op (untiled, x [2, 70, 3] against z [2, 50, 3]) makes at
    most `most` tensors of the [2, 70, 50] size (the contraction, the broadcast sum of the
    squared norms, and Chamfer's tie mask), where every step used to make its own: 7
    for the kernel sum, 6 for Chamfer."""
    module = _module(tmp_path, FORMULAS[name])
    x = _points(1, 2, 70, 3).requires_grad_()
    z = _points(2, 2, 50, 3).requires_grad_()
    assert module._tile_plan(x, z) is None
    count = _full_size_allocations(lambda: module.forward(x, z), 2 * 70 * 50 * 8)
    assert count <= most


@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_torch_pairwise_gradients_and_their_gradients_are_unchanged(tmp_path, name):
    """Gradients and gradients of gradients (x [1, 9, 3], z [1, 6, 3], float64) equal
    torch's own autodiff of the formula, untiled and in chunks."""
    module = _module(tmp_path, FORMULAS[name])
    x = _points(3, 1, 9, 3).requires_grad_()
    z = _points(4, 1, 6, 3).requires_grad_()

    def reference(x, z):
        d = ((x[:, :, None, :] - z[:, None, :, :]) ** 2).sum(-1)
        return torch.exp(-d).sum(2) if name == "rbf" else d.amin(2)

    for budget in (2**40, 64):
        module.MAX_TEMP_BYTES = budget
        assert (module._tile_plan(x, z) is None) == (budget == 2**40)
        got, want = (
            torch.autograd.grad((f(x, z) ** 2).sum(), (x, z), create_graph=True)
            for f in (module.forward, reference)
        )
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
        second = [torch.autograd.grad(g.sin().sum(), (x, z)) for g in (got[0], want[0])]
        for g, w in zip(*second, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_overwrite_writes_over_only_where_autograd_records_nothing(tmp_path):
    """`_overwrite` reuses its first operand's memory under no_grad when the result has
    its shape; with grad enabled, or a result of another shape, it leaves it alone."""
    module = _module(tmp_path, FORMULAS["rbf"])
    a, row = _points(5, 4, 3), _points(6, 1, 3)
    with torch.no_grad():
        kept = a.clone()
        assert module._overwrite(a, "add", row) is a
        torch.testing.assert_close(a, kept + row)
        small = row.clone()
        wider = module._overwrite(small, "add", a)
        assert wider.shape == (4, 3) and torch.equal(small, row)
    before = a.clone()
    result = module._overwrite(a, "exp")
    assert result is not a and torch.equal(a, before)


def test_einsum_with_a_short_last_axis_equals_torch_einsum(tmp_path):
    """`_einsum` computes a [b=2, i=40, c=3] result summed over j=30 as [b, c, i], viewed
    back: the same values, the shape asked for."""
    module = _module(tmp_path, FORMULAS["rbf"])
    s, z = _points(7, 2, 40, 30), _points(8, 2, 30, 3)
    got = module._einsum("bij,bjc->bic", s, z)
    assert got.shape == (2, 40, 3) and got.stride()[1] == 1
    torch.testing.assert_close(got, torch.einsum("bij,bjc->bic", s, z))
    wide = _points(9, 2, 30, 20)
    torch.testing.assert_close(
        module._einsum("bij,bjc->bic", s, wide), torch.einsum("bij,bjc->bic", s, wide)
    )


def test_torch_tiled_backward_computes_only_the_gradients_asked_for(tmp_path):
    """In chunks (x [1, 12, 3] against z [1, 5, 3], a tiny budget), a backward asked only
    for x's gradient (z without requires_grad: ctx.needs_input_grad) returns None for z
    and the same gradient of x."""
    module = _module(tmp_path, FORMULAS["rbf"])
    module.MAX_TEMP_BYTES = 64
    x, z = _points(10, 1, 12, 3), _points(11, 1, 5, 3)
    n, c = module._tile_plan(x, z)
    g = _points(12, 1, 12)
    both = module._tiled_backward(x, z, g, n, c)
    only_x = module._tiled_backward(x, z, g, n, c, _needs=(True, False))
    assert only_x[1] is None and both[1] is not None
    torch.testing.assert_close(only_x[0], both[0])
    x.requires_grad_()
    (grad,) = torch.autograd.grad((module.forward(x, z) * g).sum(), (x,))
    torch.testing.assert_close(grad, both[0])

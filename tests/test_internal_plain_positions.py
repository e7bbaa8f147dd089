"""An internal tensor read at a position that simplifies to a plain index (`h[i + 0, c]`,
`h[2*i - i, c]`, as templated formulas write them) is a plain read, as for an input; it
failed to generate with an internal IndexError (found by a random-formula trial). Exact
in every target, untiled and in chunks."""

from __future__ import annotations

import pytest
from harness import Case
from target_harness import check_in_every_target

CASES = {
    "plus_zero": Case(
        ("h[i,c] = x[i,c] * w[c]", "y[i,c] = h[i + 0, c] + h[i,c]"),
        {"x": (5, 3), "w": (3,)},
        outputs=("y",),
    ),
    "twice_less_once": Case(
        ("h[i,c] = exp(x[i,c]) * w[c]", "y[i] = sum(h[2*i - i, c] * x[i,c], c)"),
        {"x": (5, 3), "w": (3,)},
        outputs=("y",),
    ),
}


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_plain_position_of_an_internal_tensor(name, target, budget, tmp_path):
    check_in_every_target(CASES[name], target, tmp_path, "InternalPlain", budget)

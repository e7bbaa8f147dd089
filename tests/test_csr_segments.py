"""Segments given by CSR offsets, `indptr[s] <= n < indptr[s + 1]` (PyTorch Geometric's
and torch_scatter's `segment_csr`): the max's level took the chunk's start, an int attr
read inside indptr's brackets, for an index of its own, and the op failed to generate
with an internal KeyError `_int_tile_start` (so did any int attr there). Exact in every
target, untiled and in chunks, against the reference (TF autodiff, float64): offsets
drawn at random, so segments are empty (offsets decreasing) or overlap, and the rows
past src's end read zero."""

from __future__ import annotations

import pytest
from harness import Case
from target_harness import check_in_every_target


def _case(formula, **extra):
    return Case(
        formula,
        {"src": (9, 3)},
        index_inputs={"indptr": ((6,), 0, 11)},
        ranges={"s": "indptr.shape[0] - 1"},
        sizes={"s": 5},
        low=-2.0,
        high=2.0,
        **extra,
    )


CASES = {
    # an empty segment's max is -inf, where finite differences are nan: checked against
    # TF autodiff of the reference alone
    "max": _case(
        "y[s,f] = max(where(indptr[s] <= n < indptr[s+1], src[n,f], -inf), n)",
        finite_differences=False,
    ),
    "min": _case(
        "y[s,f] = min(where(indptr[s] <= n < indptr[s+1], src[n,f], inf), n)",
        finite_differences=False,
    ),
    "sum": _case("y[s,f] = sum(where(indptr[s] <= n < indptr[s+1], src[n,f], 0), n)"),
    # an int attr in the offsets' brackets, as the chunk's start is
    "max_shifted": Case(
        "y[s,f] = max(where(indptr[s + o] <= n < indptr[s + o + 1], src[n,f], -inf), n)",
        {"src": (9, 3)},
        attrs={"o": 1},
        attr_types={"o": "int"},
        index_inputs={"indptr": ((7,), 0, 11)},
        ranges={"s": "indptr.shape[0] - 2"},
        sizes={"s": 5},
        finite_differences=False,
    ),
}


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_target_is_exact(name, target, budget, tmp_path):
    check_in_every_target(CASES[name], target, tmp_path, "Csr", budget)

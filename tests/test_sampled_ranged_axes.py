"""A read at a float position whose other axes take an explicit range: mmcv's
border_align reads its four sides from channel blocks [side*C, side*C + C),
`x[n, c, ...]`, `x[n, C + c, ...]`, with `ranges = { c = "C" }`. The plain index beside
the float position was refused ("c is a plain index of x ... remove it from `ranges`"),
though the README says an explicit range wins over the size of an axis read plainly,
as it does without the float position (found by an adversarial trial). Now the range
wins there too: positions past the axis read zero. Exact in every target against the
reference, whole and in chunks."""

from __future__ import annotations

import pytest
from harness import Case
from target_harness import check_in_every_target

CASES = {
    # the first quarter of the channels, halfway along the last axis
    "first_block": Case(
        "y[n,c] = x[n, c, 0.5]",
        {"x": (3, 8, 2)},
        lets={"C": "x.shape[1] // 4"},
        let_values={"C": 2},
        ranges={"c": "C"},
        sizes={"c": 2},
    ),
    # the second block, read at a shift of C
    "second_block": Case(
        "y[n,c] = x[n, C + c, 0.25] + x[n, c, 1.5]",
        {"x": (3, 8, 3)},
        lets={"C": "x.shape[1] // 4"},
        let_values={"C": 2},
        ranges={"c": "C"},
        sizes={"c": 2},
    ),
    # a range past the axis: the last two positions read zero
    "past_the_axis": Case(
        "y[n,c] = x[n, c, 0.5]",
        {"x": (2, 5, 2)},
        ranges={"c": "x.shape[1] + 2"},
        sizes={"c": 7},
    ),
}


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_range_wins_beside_a_float_position(name, target, budget, tmp_path):
    check_in_every_target(CASES[name], target, tmp_path, "SampledRange", budget)

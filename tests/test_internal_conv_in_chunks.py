"""A convolution computing an internal tensor that a segment sum reads, in chunks of its
output positions: in JAX the chunk's start is traced under lax.scan, and the window the
kernel reads (x at start - 1 ...) was cut by Python slicing and `if offset == 0`, which
raised TracerBoolConversionError. The window is cut by lax.dynamic_slice from x padded by
its length (`_window_at`), and its gradient placed back by dynamic_update_slice. Exact in
every target, untiled and in chunks, against the reference (TF autodiff, float64)."""

from __future__ import annotations

import pytest
from harness import Case
from target_harness import check_in_every_target

CASES = {
    # the op of the report: a 3-tap convolution centred on n, then a sum over the n
    # whose (float) segment value equals n's
    "same_segment": Case(
        (
            "h[n] = g[n] * sum(x[n+k-1] * w[k], k)",
            "y[n] = sum(where(sg[m] == sg[n], h[m], 0), m)",
        ),
        {"g": (9,), "x": (11,), "w": (3,), "sg": (9,)},
        outputs=("y",),
        no_gradient=("sg",),
    ),
    # a segment sum by an index tensor, channels, a window reaching past both ends
    "segment_ids": Case(
        (
            "h[n,c] = g[n,c] * sum(x[n+k-2, c] * w[k, c], k)",
            "y[v,c] = sum(where(seg[n] == v, h[n,c], 0), n)",
        ),
        {"g": (9, 2), "x": (10, 2), "w": (4, 2)},
        index_inputs={"seg": ((9,), 0, 4)},
        ranges={"v": "4"},
        sizes={"v": 4},
        outputs=("y",),
    ),
}


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_target_is_exact(name, target, budget, tmp_path):
    check_in_every_target(CASES[name], target, tmp_path, "ConvSeg", budget)


# An internal tensor's output index without a plain read needs a range, and a later
# equation's sum over the same name (another index, primed) is sized by its own plain
# read: the range had been applied to both and refused for the second ("n is a plain
# index of seg ... remove it from `ranges`"), while leaving it out was refused for the
# first ("index 'n' has no range").
RANGED = Case(
    (
        "h[n,c] = sum(x[n+k-2, c] * w[k, c], k)",
        "y[v,c] = sum(where(seg[n] == v, h[n,c], 0), n)",
    ),
    {"x": (10, 2), "w": (4, 2)},
    index_inputs={"seg": ((8,), 0, 4)},
    ranges={"n": "x.shape[0] - w.shape[0] + 2", "v": "4"},
    sizes={"n": 8, "v": 4},
    outputs=("y",),
)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_a_range_sizes_the_internal_index_its_name_leaves_unsized(target, tmp_path):
    check_in_every_target(RANGED, target, tmp_path, "Ranged", budget=1)

"""The temporaries of a sampled read (sampling.py), counted for tiling (tile.py).

A bilinear read `x[n, c, P, Q]` materializes, over the indices of the read, its four
corners' gathers, their weights and, in the backward, the corners' scatters: about ten
tensors of the read's size where the call-time plan (`_HELD` in the templates' `_plan`)
assumes one per large temporary. So the read's index set is a large temporary even when it
is no larger than an output (grid_sample: the output's own size), and every large
temporary that holds a sampled read's indices counts `WEIGHT` times in the plan's
volumes, which keeps a chunk's step within the budget.

The plan counts bytes, not items: of the `WEIGHT` tensors, the corners' positions (floor
and floor + 1 of each floored coordinate, which every target holds as int64 and saves for
the backward) are `POSITION_BYTES` each, twice a float32 item, and the rest the values'
itemsize (`widths`). Counted as float32 items, DCNv2's row of 8 channels at 24 x 24 was
estimated at 304 KB, within the bound less the inputs and outputs (455 KB at 32 KiB), and
the step of whole rows held 1.28x the bound; counted by width, 507 KB, and the plan splits
the row (tests/test_tiling_adversarial_6.py).
"""

from __future__ import annotations

from . import functions as fn
from .model import Index, Program

# Times a sampled read's index set is counted in the plan's volumes (measured: JAX's
# training step of deformable convolution at x 1x16x64x20, w 24x16x3x3 and a budget of
# 1 MiB holds 3.16, 1.77, 0.96, 1.04, 0.60 times its bound at 1, 2, 3, 4, 6; TensorFlow
# and PyTorch 0.52 and 0.50 at 6; tests/test_memory_sampled_reads.py).
WEIGHT = 6

# The bytes of an integer position in any target: PyTorch and TensorFlow cast floors to
# int64, JAX to its default int (int64 under x64): the widest is counted.
POSITION_BYTES = 8


def sets(program: Program) -> list[tuple[Index, ...]]:
    """The index sets of the program's gathers at sampled (floor) positions."""
    found: list[tuple[Index, ...]] = []
    for level in program.intermediates:
        if level.gather is None or level.indices in found:
            continue
        if any(p.has(fn.floor_index) for p in level.gather.positions):
            found.append(level.indices)
    return found


def weight(indices: tuple[Index, ...], program: Program) -> int:
    """How many times a large temporary over `indices` counts in the plan: `WEIGHT` when
    it holds a sampled read's indices, else once."""
    return len(widths(indices, program))


def widths(indices: tuple[Index, ...], program: Program) -> tuple[int, ...]:
    """Per time a large temporary over `indices` counts in the plan, the bytes of its items:
    0 for the values' itemsize, `POSITION_BYTES` for a corner's integer positions (two per
    floored coordinate of the sampled reads it holds, at most `WEIGHT`)."""
    held = set(indices)
    floored = [
        sum(p.has(fn.floor_index) for p in level.gather.positions)
        for level in program.intermediates
        if level.gather is not None
        and set(level.indices) <= held
        and any(p.has(fn.floor_index) for p in level.gather.positions)
    ]
    if not floored:
        return (0,)
    positions = min(WEIGHT, 2 * max(floored))
    return (0,) * (WEIGHT - positions) + (POSITION_BYTES,) * positions


def counted(big, program: Program, size_of: dict) -> tuple[tuple, tuple[int, ...]]:
    """A plan's volumes and their widths, in step: per large temporary over indices `b` of
    `big`, its sizes (`size_of[i]` for each index) once per time it counts (`widths`), and
    the bytes of its items that time."""
    pairs = [(tuple(size_of[i] for i in b), w) for b in big for w in widths(b, program)]
    return tuple(v for v, _ in pairs), tuple(w for _, w in pairs)

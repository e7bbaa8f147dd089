"""Whether one position of a tiled index keeps a chunk within the bound at any size.

A training step may hold about 4x the bytes of the op's inputs and outputs (`io`) plus
MAX_TEMP_BYTES. A chunk of one position of the tiled index `t` holds its largest
temporaries, each over the temporary's indices but `t`, about `_HELD` (8) times at once.
Where that one-position temporary is a strict part of an input or output (it lacks at
least one of its axes: a Chamfer row `[b, j]` of `z[b, j, c]`, a GridSample row of its
output), it is at most half of that tensor, so 8 of them are at most 4x `io`: one position
is within the bound at every size, and one level of tiling serves.

Where it is as large as a whole input or output (a gathered NATTEN 1-D window's
`[b, h, i, d]` per offset, the size of `query`; Longformer's `[l, i, q, k]`, the size of
`X`; CCNet's scores' `[b, c, i, j]`), 8 of them exceed 4x `io` as soon as that tensor is
more than about half the inputs and outputs, and one position exceeds the budget once
that tensor exceeds an eighth of it: such an op gets a second level (`tile_nest`), which
its plan uses only where one position exceeds the budget.
"""

from __future__ import annotations

from . import sampled_temps
from .model import Program
from .tile import Choice, strict_part


def within_bound(choice: Choice, program: Program) -> bool:
    """Whether one position of `choice.index` leaves every large temporary a strict part
    of an input or output (the same sizes, perhaps under other names, and fewer axes)."""
    part = strict_part(program)
    return all(part({i for i in b if i.name.replace("'", "") != choice.index}) for b in choice.big)


def output_volumes(choice: Choice, program: Program, tiling) -> tuple[tuple[str, ...], ...]:
    """Per output, the size variables of its indices in the tiling's `sizes` (which name
    the sizes of the large temporaries' indices), for the plan's count of the inputs' and
    outputs' bytes; empty when an output has an index no temporary has (the plan then
    counts the inputs alone, fewer bytes: a smaller allowance, never a larger one)."""
    size_of = {}
    volumes = iter(tiling.volumes)
    for indices in choice.big:  # each set's volume, repeated by its weight in the plan
        volume = next(volumes)
        size_of.update(zip(indices, volume, strict=True))
        for _ in range(sampled_temps.weight(indices, program) - 1):
            next(volumes)
    found = []
    for output in program.outputs:
        if not all(i in size_of for i in output.level.indices):
            return ()
        found.append(tuple(size_of[i] for i in output.level.indices))
    return tuple(found)

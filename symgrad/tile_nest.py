"""A second level of tiling: when one position of the tiled index is still too large.

`tile.choose` cuts an op along one output index `t`, and a chunk holds at least one
position of it. For a window (a row of NATTEN's 2-D neighbourhoods, a row of a
correlation's displacement volume), one position holds a whole row of windows, times the
channels: 22 MB for NATTEN's 2-D AV at 56x56, 4 heads, 32 channels and K = 7 (a 16 MiB
budget), 1.8 GB for FlowNet's correlation at 48x64, 256 channels, 21x21 displacements.

Where one position of `t` can exceed the bound -- it leaves a large temporary larger than
every input and output, or as large as a whole one (`position_bound.within_bound`: a
strict part of one is within the bound at any size) -- the chunk of `t` is itself an op, and `tile.choose` picks its own
index `s` (another output index, never `t`). Its chunk -- the op's formulas with
`t -> t + start`, `s -> s + start2`, inputs cut along both where they read them plainly --
is the module's one program (`tile_once`, merged twice: at `start2 = 0` and no `length2`
it is the chunk of `t`, and at `start = 0` and no `length` the op), or, where the
lowerings differ, a second program beside the op's (`_chunk_compute`). At call time the plan
splits `t` as before while one position of it fits; otherwise it takes one position of
`t` per chunk and splits `s` so that one chunk fits (`_tile_plan`).

Only two levels: where one position of both indices still exceeds the budget, the bound
is exceeded by that much.
"""

from __future__ import annotations

from dataclasses import replace

from . import ir, tile, tile_once
from .derive import derive
from .lower import lower
from .model import Program, build
from .position_bound import output_volumes, within_bound


def nest(module: ir.Module, program: Program, choice: tile.Choice, tiling: ir.Tiling):
    """The module tiled along `choice` and, inside each chunk, along a second output index
    (one program for all where the lowerings agree); None when one position of
    `choice.index` is within the bound at any size or no second index serves."""
    if tiling.summed or tiling.parts or within_bound(choice, program):
        return None
    outputs = {i.name for i in program.outputs[0].level.indices}
    chunk_program = build(choice.chunk)
    inner = tile.choose(choice.chunk, chunk_program, exclude=frozenset({choice.index}))
    if inner is None or inner.index not in outputs:
        return None
    if not all(any(i.name == inner.index for i in b) for b in choice.big):
        return None  # a temporary it does not cut
    deepest_program = build(inner.chunk)
    deepest = lower(deepest_program, derive(deepest_program))
    level = ir.Tiling(
        index=inner.index,
        start=inner.start,
        length=inner.length,
        sliced=inner.sliced,
        output_axes=(),
        sizes=ir.Block((), ()),
        volumes=(),
        temporaries=(),
        count="",
        chunk=deepest,
        max_temp_bytes=tiling.max_temp_bytes,
    )
    once, why = tile_once.merge(replace(tiling.chunk, tiling=level))
    index = next(i for i in program.outputs[0].level.indices if i.name == inner.index)
    axes = tuple(tile.output_axis(index, o) for o in program.outputs)
    nested = replace(
        tiling,
        chunk=once.tiling.program or deepest,
        inner=ir.Inner(
            index=inner.index,
            start=inner.start,
            length=inner.length,
            sliced=inner.sliced,
            output_axes=axes,
            count=_count(choice, tiling, inner.index),
            output_volumes=output_volumes(choice, program, tiling),
        ),
    )
    if once.tiling.program is not None:
        merged, why = tile_once.merge(replace(module, tiling=nested))
        if merged.tiling.program is not None:
            return merged
        nested = replace(nested, chunk=deepest)
    else:
        why = f"the chunk of {choice.index} and {inner.index}, against the chunk of {choice.index}: {why}"
    # The module keeps the op's program and the chunk's (`_chunk_compute`), as one level does.
    return replace(module, tiling=replace(nested, separate=why))


def _count(choice: tile.Choice, tiling: ir.Tiling, name: str) -> str:
    """The size variable of index `name`: the first temporary's volume names its axes' sizes
    in its indices' order (every temporary has `name`, `nest` checked)."""
    return next(s for i, s in zip(choice.big[0], tiling.volumes[0], strict=True) if i.name == name)

"""A second level of tiling: when one position of the tiled index is still too large.

`tile.choose` cuts an op along one output index `t`, and a chunk holds at least one
position of it. For a window (a row of NATTEN's 2-D neighbourhoods, a row of a
correlation's displacement volume), one position holds a whole row of windows, times the
channels: 22 MB for NATTEN's 2-D AV at 56x56, 4 heads, 32 channels and K = 7 (a 16 MiB
budget), 1.8 GB for FlowNet's correlation at 48x64, 256 channels, 21x21 displacements.

Where one position of `t` can exceed the bound -- it leaves a large temporary larger than
every input and output, or as large as a whole one (`position_bound.within_bound`: a
strict part of one is within the bound at any size) -- the chunk of `t` is itself an op,
and `tile.choose` picks its own index `s` (another output index, never `t`). Its chunk -- the op's formulas with
`t -> t + start`, `s -> s + start2`, inputs cut along both where they read them plainly --
is the module's one program (`tile_once`, merged twice: at `start2 = 0` and no `length2`
it is the chunk of `t`, and at `start = 0` and no `length` the op), or, where the
lowerings differ, a second program beside the op's (`_chunk_compute`). At call time the plan
splits `t` as before while one position of it fits; otherwise it takes one position of
`t` per chunk and splits `s` so that one chunk fits (`_tile_plan`).

Below the second level, more: where one position of every level so far still leaves a
temporary larger than every input and output, and not a window about the levels' indices
(`_bounded`), the deepest chunk picks another output index along which a read moves
(`_displacement`). FlowNet's correlation, `y[b,u,v,i,j] = sum(x1[b,c,i,j] *
x2[b,c,i+u-r,j+v-r], c)`, is cut along `i`, then `j`, and one position of both still gathers
`[b,c,u,v]`, the window over every displacement times the channels (1.7x the default budget
at FlowNet's 21 x 21 displacements, 256 channels, batch 8): so a third level cuts `u`, and a
fourth `v`. A level below the second is a loop around the chunk of the level above
(`_level3_compute`, `_level3_backward`, ... in the templates `tile_deeper_*`): the chunk's
outputs are joined along the level's output axis, its inputs' gradients joined where it cuts
them and added where it does not; the plan gives each level (n, c), running it whole while
one position of the levels above fits (`_plan_deeper`), so the modules of ops that never
need it cost one call more. The summed channels are not cut instead: their chunks' partial
sums would need a second kind of level (`tile_sum`) inside the first kind, where a
displacement is one more output index, the same kind of level as the two above it.

Where one position of every level still exceeds the budget, the bound is exceeded by that
much.
"""

from __future__ import annotations

import ast
from dataclasses import replace

from . import ir, sampled_temps, tile, tile_once
from .derive import derive
from .lower import lower
from .model import Program, build
from .position_bound import output_volumes, within_bound


def nest(module: ir.Module, program: Program, choice: tile.Choice, tiling: ir.Tiling):
    """The module tiled along `choice` and, inside each chunk, along a second output index,
    and below it along more while one position of every level still leaves a temporary
    larger than the inputs and outputs (one program for all where the lowerings agree);
    None when one position of `choice.index` is within the bound at any size or no second
    index serves."""
    if tiling.summed or tiling.parts or within_bound(choice, program):
        return None
    levels = [choice]
    while len(levels) == 1 or not _bounded(choice, program, levels):
        below = _below(choice, program, levels)
        if below is None:
            break
        levels.append(below)
    if len(levels) == 1:
        return None
    chunks = [tiling.chunk]  # per level, its chunk lowered: the op's formulas moved by it and above
    for level in levels[1:]:
        level_program = build(level.chunk)
        chunks.append(lower(level_program, derive(level_program)))
    deepest = chunks[-1]
    inners = tuple(_inner(choice, program, tiling, level) for level in levels[1:])
    # the second level's plan counts the outputs' bytes (`position_bound.output_volumes`)
    inners = (
        replace(inners[0], output_volumes=output_volumes(choice, program, tiling)),
        *inners[1:],
    )
    nested = replace(tiling, inner=inners[0], deeper=inners[1:])
    # One program for every level, merged from the deepest up (`tile_once`): at start 0 and
    # no length of a level, the chunk of the level above it.
    merged_program, why = deepest, ""
    for k in range(len(levels) - 1, 0, -1):
        level = _level(levels[k], merged_program, tiling.max_temp_bytes)
        once, why = tile_once.merge(replace(chunks[k - 1], tiling=level))
        if once.tiling.program is None:
            inside = " and ".join(c.index for c in levels[: k + 1])
            above = " and ".join(c.index for c in levels[:k])
            why = f"the chunk of {inside}, against the chunk of {above}: {why}"
            break
        merged_program = once.tiling.program
    else:
        merged, why = tile_once.merge(replace(module, tiling=replace(nested, chunk=merged_program)))
        if merged.tiling.program is not None:
            return merged
    # The module keeps the op's program and the chunk's (`_chunk_compute`), as one level does.
    return replace(module, tiling=replace(nested, chunk=deepest, separate=why))


def _below(choice: tile.Choice, program: Program, levels: list[tile.Choice]):
    """The level below `levels`: the deepest chunk's own choice of another output index,
    one in every large temporary; None when none serves."""
    outputs = {i.name for i in program.outputs[0].level.indices}
    deepest = levels[-1].chunk
    taken = frozenset(c.index for c in levels)
    below = tile.choose(deepest, build(deepest), exclude=taken)
    if below is None or below.index not in outputs:
        return None
    hard = [b for b in choice.big if b not in choice.slices]
    large = tile.left_large(build(deepest), hard, taken)
    if not all(any(i.name == below.index for i in b) for b in large):
        return None  # a temporary it does not cut, large at one position of the levels above
    if len(levels) > 1 and not _displacement(below.index, deepest):
        return None  # below the second level, only a window's displacement
    return below


def _displacement(name: str, op) -> bool:
    """Whether a read moves by index `name` (`x2[b, c, i + u - r, j + v - r]`: FlowNet's
    displacements `u`, `v`). Below the second level only such an index is cut: the window a
    position gathers runs along it, so its chunks shrink what one position holds, where a
    batch or head index would only multiply tiny chunks of one that is small already."""
    trees = [ast.parse(text.strip(" "), mode="exec") for text in op.formulas]
    inputs = {n for tree in trees for n in tile._names(tree)}
    return any(name in _outside_reads(p) for p in _moved_positions(trees, inputs))


def _moved_positions(trees: list[ast.AST], inputs: set[str]) -> list[ast.AST]:
    """The positions of the reads of `inputs` in `trees` that are no plain index name
    (`i + u - r`, not `c`)."""
    return [
        p
        for positions_list in tile._reads(trees, inputs).values()
        for positions in positions_list
        for p in positions
        if not isinstance(p, ast.Name)
    ]


def _outside_reads(node: ast.AST) -> set[str]:
    """The names in a position outside the reads inside it (`offset[b, k]` in a deformable
    convolution's position moves by what it reads, not by `b`)."""
    if isinstance(node, ast.Subscript):
        return set()
    if isinstance(node, ast.Name):
        return {node.id}
    return set().union(*(_outside_reads(c) for c in ast.iter_child_nodes(node)))


def _bounded(choice: tile.Choice, program: Program, levels: list[tile.Choice]) -> bool:
    """Whether one position of every level leaves each large temporary no larger than an
    input or output, or a window: every index of it beyond the outputs' an offset that a
    read moves together with a level's index (NATTEN's `[u, v]` about `(i, j)`: one window
    per position is small at any real size). FlowNet's correlation after `i` and `j` still
    holds `[b, c, u, v]`: the channels `c` are no offset, and 441 displacements of 256 of
    them are 1.7x the default budget at batch 8."""
    small = tile._no_larger(program)
    names = {c.index for c in levels}
    outputs = {i for o in program.outputs for i in o.level.indices}
    trees = [ast.parse(text.strip(" "), mode="exec") for text in choice.chunk.formulas]
    together = [tile._names(p) for p in _moved_positions(trees, set(program.inputs))]

    def offset(index) -> bool:
        name = index.name.replace("'", "")
        return any(name in read and read & names for read in together)

    for b in choice.big:
        rest = {i for i in b if i.name.replace("'", "") not in names}
        extra = rest - outputs
        if not small(rest) and not (extra and all(offset(i) for i in extra)):
            return False
    return True


def _inner(choice: tile.Choice, program: Program, tiling: ir.Tiling, level: tile.Choice):
    index = next(i for i in program.outputs[0].level.indices if i.name == level.index)
    return ir.Inner(
        index=level.index,
        start=level.start,
        length=level.length,
        sliced=level.sliced,
        output_axes=tuple(tile.output_axis(index, o) for o in program.outputs),
        count=_count(choice, program, tiling, level.index),
    )


def _level(level: tile.Choice, chunk: ir.Module, max_temp_bytes: int) -> ir.Tiling:
    """A level as a tiling of the chunk above it, for `tile_once.merge`."""
    return ir.Tiling(
        index=level.index,
        start=level.start,
        length=level.length,
        sliced=level.sliced,
        output_axes=(),
        sizes=ir.Block((), ()),
        volumes=(),
        temporaries=(),
        count="",
        chunk=chunk,
        max_temp_bytes=max_temp_bytes,
    )


def _count(choice: tile.Choice, program: Program, tiling: ir.Tiling, name: str) -> str:
    """The size variable of index `name`: a temporary's volume names its axes' sizes in
    its indices' order (the first temporary with `name`; every one still large at one
    position of the levels above has it, `_below` checked). Each set's volume is repeated
    by its weight in the plan (`sampled_temps.weight`)."""
    volumes = iter(tiling.volumes)
    for indices in choice.big:
        volume = next(volumes)
        for i, size in zip(indices, volume, strict=True):
            if i.name == name:
                return size
        for _ in range(sampled_temps.weight(indices, program) - 1):
            next(volumes)
    raise AssertionError(f"no large temporary has {name}")

"""Tiling in parts: an op whose outputs, or whose terms, each need an index of their own.

`tile.choose` cuts an op along one index every output has, and `tile_sum` along the outer
summed index of a single `sum(...)`. Two real ops have neither:

- Chamfer distance in its published layout, `d1[b,n] = min(d, m)` and `d2[b,m] = min(d, n)`:
  the only index both outputs have is `b`, and one `b` holds the whole `[n,m]` matrix;
- a two-way Chamfer loss per cloud, `y[b] = sum(min(d, m), n) + sum(min(d, n), m)`: its
  terms sum different indices, and no index can be cut in both.

Such an op is split into *parts*, each an op of its own derived from the formula text:
one per equation (the part computes that output), or, for one equation whose right-hand
side adds terms, one per term (the part computes that term; the output is the sum of the
parts). Each part is then tiled like any op (`tile.choose`, `tile_sum.choose`), along its
own index: `d1` along `n`, `d2` along `m`. The module runs each part's loop and places or
adds the parts' outputs; the gradient runs each part's backward loop with the gradients
of that part's outputs and adds the input gradients across the parts (d(y)/d(term) = 1).

Only when the op as a whole has no good index: one position of today's choice (or no
choice at all) still holds a matrix over two or more indices that not every output has,
and every part has an index one position of which leaves its temporaries no larger than
its inputs and outputs. Every other op keeps its tiling. Not split: ops with internal
tensors (`outputs = [...]`: a part would need another part's internal values, which it
cannot recompute per chunk; `tile_stages` runs such ops one equation after another), an
equation reading another's output, composite outputs, index tensors and float positions.
A subtracted term is a part with its sign (`-b`), tiled like any (`tile_sum` takes a
negated or scaled sum); when it cannot be bounded the op is not split.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass, replace

from . import ir, tile, tile_sum
from .errors import SymgradError
from .model import Program, build
from .spec import OpSpec
from .tile import Choice


@dataclass(frozen=True)
class Part:
    """One part of an op: an op of its own, and where its outputs go."""

    op: OpSpec
    outputs: tuple[int, ...]  # per output of the part, the op's output it gives (or adds to)
    formula: str  # the part's equation, for the docstring


def split(op: OpSpec, program: Program, choice: Choice | None):
    """The parts of an op with each part's choice and program, or None (keep `choice`)."""
    if not _needs_parts(program, choice):
        return None
    parts = _parts(op, program)
    if parts is None:
        return None
    found = []
    for part in parts:
        try:
            part_program = build(part.op)
        except SymgradError:
            return None  # e.g. a range or let that only the whole op can size
        part_choice = tile_sum.choose(part.op, part_program, tile.choose(part.op, part_program))
        if not tile_sum.bounded(part_choice, part_program):
            return None
        found.append((part, part_choice, part_program))
    return found


def _needs_parts(program: Program, choice: Choice | None) -> bool:
    """Whether one position of the op's choice still holds a matrix over two or more
    indices that not every output has (or there is no choice while temporaries are large)."""
    big = tile.big_sets(program)
    if not big:
        return False
    if choice is None:
        return True
    if tile_sum.bounded(choice, program):
        return False
    every = set.intersection(*({i.name for i in o.level.indices} for o in program.outputs))
    return any(len({i.name.replace("'", "") for i in b} - every - {choice.index}) >= 2 for b in big)


def _parts(op: OpSpec, program: Program) -> list[Part] | None:
    if op.outputs is not None or program.index_inputs or op.float_positions:
        return None
    if any(len(group) > 1 for o in program.outputs for group in o.groups):
        return None
    assigns = [ast.parse(f.strip(" "), mode="exec").body[0] for f in op.formulas]
    if len(assigns) > 1:
        defined = {a.targets[0].value.id for a in assigns}
        for assign in assigns:
            if defined & {n.id for n in ast.walk(assign.value) if isinstance(n, ast.Name)}:
                return None  # an equation reads another's output
        texts = [ast.unparse(a) for a in assigns]
        return [Part(_part_op(op, program, t), (k,), t) for k, t in enumerate(texts)]
    (assign,) = assigns
    terms = _added(assign.value)
    if len(terms) < 2:
        return None
    left = ast.unparse(assign.targets[0])
    texts = [f"{left} = {ast.unparse(t)}" for t in terms]
    return [Part(_part_op(op, program, t), (0,), t) for t in texts]


def _added(expr: ast.AST) -> list[ast.AST]:
    """The terms of a sum `a + b - c ...`, a subtracted term negated (`-c`: the part
    computes it with its sign, and the parts' outputs are added)."""
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add | ast.Sub):
        right = _added(expr.right)
        if isinstance(expr.op, ast.Sub):
            right = [ast.UnaryOp(ast.USub(), term) for term in right]
        return [*_added(expr.left), *right]
    return [expr]


def _part_op(op: OpSpec, program: Program, formula: str) -> OpSpec:
    """The op of one part: its formula, and the inputs and attrs it reads (in the op's
    order), so that it builds like an op of its own."""
    names = {n.id for n in ast.walk(ast.parse(formula)) if isinstance(n, ast.Name)}
    texts = [v for _, v in (*op.ranges, *op.lets)]
    used = names | {n.id for t in texts for n in ast.walk(ast.parse(t)) if isinstance(n, ast.Name)}
    return replace(
        op,
        formulas=(formula,),
        inputs=tuple(n for n in program.inputs if n in names),
        attrs=tuple((a, kind) for a, kind in op.attrs if a in used),
        no_gradient=tuple(n for n in op.no_gradient if n in names),
        ranges=tuple((k, v) for k, v in op.ranges if k in names),
    )


def tiling(op: OpSpec, program: Program, found, compile_chunk) -> ir.Tiling:
    """The module's tiling in parts: the first part's tiling, with every part in `parts`.
    `compile_chunk(choice, part_program)` gives a part's `ir.Tiling` (as for any op)."""
    parts = tuple(
        ir.TilingPart(compile_chunk(choice, part_program), part.outputs, part.formula)
        for part, choice, part_program in found
    )
    return replace(parts[0].tiling, parts=parts, parts_doc=_doc(op, program, parts))


def _doc(op: OpSpec, program: Program, parts) -> tuple[str, ...]:
    """The docstring's lines on the parts: what each is tiled along and why."""
    every = set.intersection(*({i.name for i in o.level.indices} for o in program.outputs))
    names = [tuple(i.name.replace("'", "") for i in b) for b in tile.big_sets(program)]
    unique = {frozenset(n): n for n in reversed(names)}  # [b,m,n] is [b,n,m] again
    big = ", ".join("[" + ",".join(n) + "]" for n in reversed(unique.values()))
    common = ", ".join(sorted(every)) or "none"
    if len(op.formulas) > 1:
        why = (
            f"no index bounds them in every output (the outputs share only {common}, one "
            "position of which still holds them): the op runs in parts, one per output,"
        )
    else:
        why = (
            "its terms sum different indices, so no index can be cut in every term: the op "
            "runs in parts, one per term (the output is the sum of the parts),"
        )
    text = (
        f"Memory: temporaries over {big} outgrow the inputs and outputs, and {why} each in "
        "chunks of its own index when their bytes would exceed MAX_TEMP_BYTES (the "
        "gradients of the inputs added over the parts; `_tiled_compute`, `_tiled_backward`):"
    )
    lines = textwrap.wrap(text, 88)
    for k, part in enumerate(parts):
        t = part.tiling
        how = (
            "its outer sum's index, the chunks' partial sums added"
            if t.summed
            else "an output index"
        )
        lines.append(f"    part {k}: {part.formula}")
        lines += textwrap.wrap(
            f"in chunks of {t.index} ({how}: one {t.index} leaves temporaries no larger than "
            "an input or output).",
            80,
            initial_indent="        ",
            subsequent_indent="        ",
        )
    return tuple(lines)

"""Tiling in stages: an op whose equations depend on each other, one stage per equation.

Hausdorff's distance per cloud, `h[b] = max(min(sum((x[b,c,n] - z[b,c,m])**2, c), m), n)`,
has one output index, `b`, one position of which holds the whole `[n,m]` matrix, and its
outer reduction is a max (no partial sums to add, `tile_sum`). But its inner reduction,
`min(.., m)` per `(b, n)`, is no larger than the inputs: written as an internal tensor,

    inner[b,n] = min(sum((x[b,c,n] - z[b,c,m])**2, c), m)
    h[b] = max(inner[b,n], n)

the op is two *stages*: the first holds the matrix and is tiled along its own output index
`n` by the usual rules (the nearest-neighbour op), the second holds nothing large and runs
as one chunk (its max over the whole of `n`, ties split equally as in any max). The
gradient runs the stages in reverse: each stage's backward, in chunks of its own index,
from the gradients of its outputs; the gradient of an internal tensor is the sum of what
the later stages give it, and the inputs' gradients add up over the stages.

A stage is an op of its own (its equation, the op's inputs it reads, and the internal
tensors of earlier stages as inputs), tiled like any (`tile.choose`, `tile_sum.choose`); a
stage with no large temporary is chosen along an output index and run as one chunk. The
call-time plan sizes every stage from the op's own inputs (`lower_sizes` of the whole op).

Used only when the op as a whole has no good index (as `tile_parts`): one position of
today's choice still holds a matrix over two or more indices that not every output has.
An op written with internal tensors is split as written; an op of one equation has its
inner reductions hoisted into internal tensors first (`hoist`: every reduction inside the
body of another, where the result has at least one index). Refused (the op keeps its
tiling, exact but unbounded): an internal tensor larger than the inputs and outputs, a
stage no index bounds, an equation that reads an output, index tensors, float positions,
composite outputs.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import replace

from . import ir, sampled_temps, tile, tile_parts, tile_sum
from .derive import derive
from .errors import SymgradError
from .model import Program, build
from .spec import OpSpec
from .tile import Choice, _fresh, _names
from .tile_parts import Part
from .tile_sum import reduction

INTERNAL = "inner"  # the stem of a hoisted reduction's internal tensor


def split(op: OpSpec, program: Program, choice: Choice | None):
    """(the op with its internal tensors, its program and backward, and per stage its
    part, choice and program), or None (keep `choice`)."""
    if not tile_parts._needs_parts(program, choice):
        return None
    if program.index_inputs or op.float_positions:
        return None
    if any(len(group) > 1 for o in program.outputs for group in o.groups):
        return None
    staged = op if _internals(op) else hoist(op, program)
    if staged is None or not _internals(staged):
        return None
    try:
        whole = build(staged)
    except SymgradError:
        return None
    small = tile._no_larger(whole)
    internal = set(_internals(staged))
    levels = [level for level in whole.intermediates if level.name in internal]
    if not all(small(set(level.indices)) for level in levels):
        return None  # an internal tensor as large as the matrix: nothing gained
    outputs = tuple(o.level.name for o in whole.outputs)
    backward = derive(whole)
    found = []
    for formula in staged.formulas:
        part = _stage(staged, whole, formula, outputs)
        if part is None:
            return None
        try:
            stage_program = build(part.op)
        except SymgradError:
            return None
        if tile.big_sets(stage_program):
            stage_choice = tile_sum.choose(
                part.op, stage_program, tile.choose(part.op, stage_program)
            )
            if not tile_sum.bounded(stage_choice, stage_program):
                return None
        else:
            stage_choice = tile.choose(part.op, stage_program, plain=True)
            if stage_choice is None:
                return None
        try:  # the plan sizes the stage from the op's inputs
            _sizes(stage_choice, stage_program, whole, backward)
        except (AssertionError, KeyError, StopIteration, SymgradError):
            return None
        found.append((part, stage_choice, stage_program))
    return staged, whole, backward, found


def _internals(op: OpSpec) -> tuple[str, ...]:
    """The op's internal tensors, in the order their equations compute them."""
    if op.outputs is None:
        return ()
    return tuple(t for t in map(_target, op.formulas) if t not in op.outputs)


def _target(formula: str) -> str:
    (assign,) = ast.parse(formula.strip(" "), mode="exec").body
    return assign.targets[0].value.id


def _stage(op: OpSpec, whole: Program, formula: str, outputs: tuple[str, ...]) -> Part | None:
    """One equation as an op of its own: the op's inputs it reads, then the internal
    tensors it reads (inputs of the stage). None when it reads an output of the op."""
    names = _names(ast.parse(formula.strip(" ")))
    target = _target(formula)
    internals = _internals(op)
    if (names - {target}) & set(outputs):
        return None
    earlier = internals[: internals.index(target)] if target in internals else internals
    inputs = (
        *(n for n in whole.inputs if n in names),
        *(n for n in earlier if n in names),
    )
    texts = [v for _, v in (*op.ranges, *op.lets)]
    used = names | {n for t in texts for n in _names(ast.parse(t.strip(" ")))}
    stage = replace(
        op,
        formulas=(formula,),
        inputs=inputs,
        outputs=None,
        attrs=tuple((a, kind) for a, kind in op.attrs if a in used),
        no_gradient=tuple(n for n in op.no_gradient if n in names),
        ranges=tuple((k, v) for k, v in op.ranges if k in names),
    )
    given = (outputs.index(target),) if target in outputs else ()
    return Part(stage, given, formula.strip(" "))


def hoist(op: OpSpec, program: Program) -> OpSpec | None:
    """The op of one equation with every reduction inside another's body (`min(.., m)`
    inside `max(.., n)`) computed first as an internal tensor over the indices it keeps
    (`inner[b,n]`), read in its place; None when there is none to hoist."""
    if len(op.formulas) != 1 or op.outputs is not None:
        return None
    tree = ast.parse(op.formulas[0].strip(" "), mode="exec")
    (assign,) = tree.body
    left = assign.targets[0]
    output_indices = [n.id for n in ast.walk(left.slice) if isinstance(n, ast.Name)]
    constants = {a for a, _ in (*op.attrs, *op.lets)} | {"pi", "e"} | set(program.inputs)
    taken = _names(tree) | constants
    hoisted: list[str] = []
    unsized: list[ast.AST] = []
    ranged = {k for k, _ in op.ranges}

    class Hoist(ast.NodeTransformer):
        def __init__(self) -> None:
            self.depth = 0  # reductions around the node

        def visit_Call(self, node: ast.Call) -> ast.AST:
            if not reduction(node):
                node.args = [self.visit(a) for a in node.args]
                return node
            if self.depth >= 1:
                keeps = _free(node, constants)
                if not keeps:
                    return node  # a scalar: nothing to index it by
                if not all(i in ranged or _plain(node, i) for i in keeps):
                    unsized.append(node)  # its size would come from elsewhere
                    return node
                order = [i for i in output_indices if i in keeps]
                order += [i for i in _in_order(node) if i in keeps and i not in order]
                name = _fresh(INTERNAL, taken)
                taken.add(name)
                hoisted.append(f"{name}[{', '.join(order)}] = {ast.unparse(node)}")
                read = ast.Subscript(
                    ast.Name(name, ast.Load()),
                    ast.Tuple([ast.Name(i, ast.Load()) for i in order], ast.Load())
                    if len(order) > 1
                    else ast.Name(order[0], ast.Load()),
                    ast.Load(),
                )
                return read
            self.depth += 1
            node.args[0] = self.visit(node.args[0])
            self.depth -= 1
            return node

    assign.value = Hoist().visit(assign.value)
    if not hoisted or unsized:
        return None
    formulas = (*hoisted, ast.unparse(tree))
    return replace(op, formulas=formulas, outputs=(left.value.id,), inputs=program.inputs)


def _free(node: ast.Call, constants: set[str]) -> set[str]:
    """The indices a reduction's value depends on: the names it reads that are no tensor,
    function, attr or let, and that no reduction inside it (or itself) runs over."""
    used = set()
    bound = set()
    for sub in ast.walk(node):
        if reduction(sub):
            bound |= {a.id for a in sub.args[1:]}
        if isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name):
            used |= _names(sub.slice)
    functions = {
        sub.func.id
        for sub in ast.walk(node)
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name)
    }
    tensors = {
        sub.value.id
        for sub in ast.walk(node)
        if isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name)
    }
    used |= _names(node) - functions - tensors
    return used - bound - constants - functions - tensors


def _plain(node: ast.AST, index: str) -> bool:
    """Whether some read inside `node` has `index` plainly at an axis (which sizes it
    there as in the whole op: plain reads of one index agree, or the op is refused)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name):
            elts = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
            if any(isinstance(p, ast.Name) and p.id == index for p in elts):
                return True
    return False


def _in_order(node: ast.AST) -> list[str]:
    """Names in order of first appearance."""
    seen: dict[str, None] = {}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            seen.setdefault(sub.id, None)
    return list(seen)


def tiling(op: OpSpec, program: Program, staged, compile_chunk) -> ir.Tiling:
    """The module's tiling in stages: every stage's tiling (its plan sized from the op's
    inputs), the first one's fields on the whole."""
    staged_op, whole, backward, found = staged
    internals = _internals(staged_op)
    outputs = tuple(o.level.name for o in whole.outputs)
    parts = []
    for part, choice, stage_program in found:
        t = _sized(compile_chunk(choice, stage_program), choice, stage_program, whole, backward)
        target = _target(part.formula)
        earlier = internals[: internals.index(target)] if target in internals else internals
        read = _names(ast.parse(part.formula))
        env = (*program.inputs, *(n for n in earlier if n in read))
        parts.append(ir.TilingPart(t, part.outputs, part.formula, env=env, names=(target,)))
    doc = _doc(staged_op, program, parts, outputs)
    return replace(parts[0].tiling, parts=tuple(parts), parts_doc=doc, stages=internals)


def _sized(t: ir.Tiling, choice: Choice, stage: Program, whole: Program, backward) -> ir.Tiling:
    """A stage's tiling with its plan's sizes read from the op's inputs (the stage's own
    read the internal tensors, which the plan does not have)."""
    index, sizes, size_of = _sizes(choice, stage, whole, backward)
    volumes, widths = sampled_temps.counted(choice.big, stage, size_of)
    return replace(t, sizes=sizes, volumes=volumes, widths=widths, count=size_of[index])


def _sizes(choice: Choice, stage: Program, whole: Program, backward):
    """The stage's tiled index, and the block computing the sizes its plan reads (the tiled
    index's and its large temporaries' axes) from the op's inputs, with their variables."""
    from .lower import lower_sizes

    outputs = {i.name for i in stage.outputs[0].level.indices}
    if choice.index in outputs:
        index = next(i for i in stage.outputs[0].level.indices if i.name == choice.index)
    else:
        index = next(i for b in choice.big for i in b if i.name == choice.index)
    wanted = [index, *dict.fromkeys(i for b in choice.big for i in b)]
    sizes, names = lower_sizes(whole, backward, wanted)
    return index, sizes, dict(zip(wanted, names, strict=True))


def _doc(op: OpSpec, program: Program, parts, outputs) -> tuple[str, ...]:
    """The docstring's lines on the stages: what each computes, tiled along what."""
    names = [tuple(i.name.replace("'", "") for i in b) for b in tile.big_sets(program)]
    unique = {frozenset(n): n for n in reversed(names)}
    big = ", ".join("[" + ",".join(n) + "]" for n in reversed(unique.values()))
    internals = ", ".join(_internals(op))
    text = (
        f"Memory: temporaries over {big} outgrow the inputs and outputs, and one position "
        "of every index the outputs have still holds them: the op runs in stages, one per "
        f"equation, the internal tensors ({internals}) no larger than an input or output. "
        "The forward runs the stages in order, each in chunks of its own index when its "
        "bytes would exceed MAX_TEMP_BYTES; the gradient runs them in reverse, each stage's "
        "in chunks of its own index, an internal tensor's gradient the sum of what the later "
        "stages give it (`_tiled_compute`, `_tiled_backward`):"
    )
    lines = textwrap.wrap(text, 88)
    for k, part in enumerate(parts):
        t = part.tiling
        lines.append(f"    stage {k}: {part.formula}")
        if not t.volumes:
            how = "no temporary larger than an input or output: one chunk."
        elif t.summed:
            how = (
                f"in chunks of {t.index} (its outer sum's index, the chunks' partial sums "
                f"added: one {t.index} leaves temporaries no larger than an input or output)."
            )
        else:
            how = (
                f"in chunks of {t.index} (an output index: one {t.index} leaves "
                "temporaries no larger than an input or output)."
            )
        lines += textwrap.wrap(how, 80, initial_indent="        ", subsequent_indent="        ")
    return tuple(lines)

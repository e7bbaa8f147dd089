"""A tiled module's chunk-invariant work, computed once before its chunk loop.

A chunk of a tiled op runs the op's one program (`tile_once`) at its start and length;
much of that program does not depend on them: per-roi geometry read off an input (its
columns, their cosine and sine, bin sizes), a layout copy of an input that is read
whole, sizes. Every chunk computed it again: on a small op, a PyTorch chunk is bound by
the dispatch of its ops, and a step of roi_align_rotated in 28 chunks took 13x the
untiled step.

`split` finds, in one block of the program, the steps that read neither a chunk's start
or length nor an input cut to the chunk (nor, in the backward, the chunk's incoming
gradients, outputs or intermediates), and the largest such subexpressions of the other
steps (made steps of their own, so computed once too). The module then has a function
computing them (`_compute_once`, `_backward_once`), returning the ones the chunk reads
(`names`); the program takes them as `_once` (None: it computes them itself, as the
untiled op does). The values and the ops on them are the same, so the results are the
same bit for bit.

They are held for the whole loop: the loop keeps them only while their bytes are within
the inputs' (else every chunk computes them again, as before).

A tiling in two levels has a second tier (`WHOLE`): what the chunks compute alike while
the inner level is one chunk, the steps left that read neither the outer level's start
or length nor an input it cuts. Where the inner level cuts the rows of what the outer
level's chunks share, as GAT's segment log-sum-exp over the heads when the outer level
cuts its features, every outer chunk computed it again. At call time, where the plan
gives the inner level one chunk (static sizes), the loop computes them once
(`_compute_outer_once`, TensorFlow); otherwise each chunk does, from the values it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import ir

PREFIX = "_once"  # the names given to extracted subexpressions: _once1, _once2, ...
WHOLE = "_shared"  # the second tier's: _shared1, _shared2, ...

# Subexpressions worth a step of their own: an op (a leaf is a name or a number already).
_OPS = (ir.View, ir.Call, ir.Binary, ir.Negate, ir.Einsum)


@dataclass(frozen=True)
class Hoist:
    """A block split in two: `block` (every step, the extracted subexpressions as steps of
    their own before the step that reads them), of which the steps named in `once` are
    chunk-invariant and computed before the loop; `names` are the ones of those the other
    steps or the block's results read, in order."""

    block: ir.Block
    once: frozenset[str]
    names: tuple[str, ...]

    def rest_block(self) -> ir.Block:
        """The steps each chunk computes, reading `names` as given."""
        steps = tuple(s for s in self.block.steps if s.target not in self.once)
        return ir.Block(steps, self.block.returns)

    def once_block(self) -> ir.Block:
        """The invariant steps, returning `names`."""
        steps = tuple(s for s in self.block.steps if s.target in self.once)
        return ir.Block(steps, self.names)


def _scalar(e: ir.Expr) -> bool:
    """A scalar a printer may spell as a Python number where an op takes one (a zero of
    no shape, a literal cast to the values' dtype): nothing to compute once."""
    if not isinstance(e, ir.Call):
        return False
    if e.function == "zeros":
        return e.args[:1] == (ir.Lit("[]"),)
    return e.function == "cast" and isinstance(e.args[0], ir.Lit)


def split(
    block: ir.Block,
    variant: set[str],
    is_python: Callable[[ir.Expr, frozenset[str]], bool],
    results: tuple[str, ...] = (),
    prefix: str = PREFIX,
    cut_axes: dict[str, set[int]] | None = None,
) -> Hoist | None:
    """`block` with its chunk-invariant steps marked (see the module's docstring); None
    when no tensor op is invariant. `variant`: the names a chunk changes (its starts and
    lengths, as attrs and as `_int_` ints; inputs cut to it; in the backward the chunk's
    incoming gradients, outputs and intermediates); `results`: names the block gives
    besides its returns (the forward's intermediates for the gradient); `prefix`: the
    stem of the extracted subexpressions' names; `cut_axes` (input -> the axes a chunk
    cuts), where given: a cut input's dtype and its sizes along the other axes are the
    same in every chunk (the second tier's `x.shape[0]` of an `x` cut along axis 2)."""
    dependent = set(variant)
    numbers: set[str] = set()
    made: dict[ir.Expr, str] = {}
    steps: list[ir.Assign] = []
    once: set[str] = set()

    def changing(e: ir.Expr) -> set[str]:
        """The names `e` reads whose values a chunk may change."""
        if cut_axes is None:
            return ir.names_in(e)
        if isinstance(e, ir.AxisSize) and e.axis not in cut_axes.get(e.tensor, {e.axis}):
            return set()
        if isinstance(e, ir.DType) and e.tensor in cut_axes:
            return set()
        if isinstance(e, ir.Call) and e.function == "size_limit":
            # its value is its size; computed whole, it checks the whole op's output
            return changing(e.args[0])
        if isinstance(e, ir.Call) and e.function == "same_size":
            return changing(e.args[0]) | changing(e.args[1])
        if isinstance(e, ir.Var | ir.DType | ir.AxisSize | ir.FloatSize | ir.Shape):
            return ir.names_in(e)
        found = set().union(*(changing(c) for c in ir.children(e)))
        return found | {e.name} if isinstance(e, ir.Whole) else found

    def invariant(e: ir.Expr) -> bool:
        return not (changing(e) & dependent)

    def swap(e: ir.Expr) -> ir.Expr | None:
        if isinstance(e, ir.Cond | ir.Whole):  # a branch runs only where taken: kept
            return e
        if not isinstance(e, _OPS) or not invariant(e) or is_python(e, frozenset(numbers)):
            return None
        if not ir.names_in(e) or _scalar(e):  # numbers alone, or a zero of the dtype
            return None
        if e not in made:
            made[e] = f"{prefix}{len(made) + 1}"
            steps.append(ir.Assign(made[e], e))
            once.add(made[e])
        return ir.Var(made[e])

    for step in block.steps:
        if is_python(step.value, frozenset(numbers)):
            numbers.add(step.target)
        if invariant(step.value):
            steps.append(step)
            once.add(step.target)
            continue
        dependent.add(step.target)
        steps.append(ir.Assign(step.target, ir.rewrite(step.value, swap), step.comment))
    tensors = [s for s in steps if s.target in once and s.target not in numbers]
    if not tensors:
        return None
    read: set[str] = {r for r in (*block.returns, *results) if r}
    for s in steps:
        if s.target not in once:
            read |= ir.names_in(s.value)
    names = tuple(s.target for s in steps if s.target in once and s.target in read)
    return Hoist(ir.Block(tuple(steps), block.returns), frozenset(once), names)

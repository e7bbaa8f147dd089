"""Tiling along a summed index: when no output index bounds an op's temporaries.

`tile.choose` cuts the work along an index of the outputs. When the outputs keep only a
batch index (a Chamfer loss per cloud, an RBF energy `y[b] = sum(exp(-d[b,n,m]), n, m)`),
one position of that index still holds the whole pairwise matrix. If the formula is
`y[...] = sum(body, n, ...)` -- an outer sum whose body is computed per `n` -- the outputs
are the sum over chunks of `n` of the same formula over the chunk (Rabe & Staats' partial
sums, KeOps' tiled reductions), and each chunk's gradient gets the whole incoming
gradient (d(sum of parts)/d(part) = 1): inputs cut along `n` get their gradient per chunk,
the others add up over the chunks.

The chunk is the op's own formula with `n` -> `n + start` where a position reads it
plainly on no cut input, the inputs that read `n` plainly on one axis cut to the chunk,
and `n` ranging over the chunk (a `tile_length` range when no cut input gives its size).

Covered: one formula, one output, a right-hand side that is one `sum(...)` (over several
indices too: any of them may be chosen) or `mean(...)` (each chunk's mean scaled by its
length over the whole size), negated, or times or divided by a constant. A sum of such
terms over different indices (Chamfer's two directions) has no one index that can be cut
in every term: `tile_parts` tiles each term along its own (a subtracted one with its
sign); where it cannot (a term no index bounds), the module keeps the output-index
tiling, with the reason in its docstring (`why_not`).
"""

from __future__ import annotations

import ast
import copy
from dataclasses import replace

from . import splits
from .model import Program
from .spec import OpSpec
from .tile import (
    LENGTH,
    START,
    Choice,
    _fresh,
    _names,
    _no_larger,
    _Offset,
    _reads,
    _sliced,
    big_sets,
)

TOTAL = "tile_total"  # a mean's whole size along the tiled index, in its chunks
REDUCTIONS = {"sum", "min", "max", "logsumexp", "prod", "mean"}


def reduction(node: ast.AST, kinds=REDUCTIONS) -> bool:
    """Whether `node` is a reduction written as the parser reads one, of one of `kinds`:
    `sum(body, n, ...)` with one or more plain index names after the body (so `max(x, 0)`
    stays elementwise)."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in kinds
        and len(node.args) >= 2
        and not node.keywords
        and all(isinstance(a, ast.Name) for a in node.args[1:])
    )


def bounded(choice: Choice | None, program: Program) -> bool:
    """Whether one position of the choice's index leaves every large temporary no larger
    than an input or output (then its chunks can be made to fit any budget)."""
    if choice is None:
        return False
    small = _no_larger(program)
    return all(small({i for i in b if i.name.replace("'", "") != choice.index}) for b in choice.big)


def summed_terms(op: OpSpec) -> list[tuple[str, ...]] | None:
    """Per additive term of the op's one formula, the indices its outer `sum` runs over
    (None when the formula is not one equation)."""
    if len(op.formulas) != 1:
        return None
    (assign,) = ast.parse(op.formulas[0].strip(" "), mode="exec").body
    terms = []
    for term in _terms(assign.value):
        outer = _outer_sum(term, _constants(op))
        terms.append(() if outer is None else tuple(a.id for a in outer.args[1:]))
    return terms


def _terms(expr: ast.AST) -> list[ast.AST]:
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add | ast.Sub):
        return [*_terms(expr.left), *_terms(expr.right)]
    return [expr]


def _outer_sum(expr: ast.AST, constants: frozenset[str] = frozenset()) -> ast.Call | None:
    """`sum(body, n, ...)` or `mean(body, n, ...)` with plain index names, perhaps negated,
    times or divided by a constant (`-sum(..)`, `2 * mean(..)`, `sum(..) / T` with T an
    attr or let): a chunk's output is then its share of the whole. None otherwise."""
    expr = _scaled(expr, constants)
    return expr if reduction(expr, ("sum", "mean")) else None


def _scaled(expr: ast.AST, constants: frozenset[str]) -> ast.AST:
    """What a linear wrapper scales: `-e`, `+e`, `c * e`, `e * c`, `e / c` -> `e`, for a
    constant `c` (numbers, `pi`, `e`, and the names in `constants`; no tensor read)."""

    def constant(node: ast.AST) -> bool:
        return not any(isinstance(n, ast.Subscript | ast.Call) for n in ast.walk(node)) and (
            _names(node) <= constants | {"pi", "e"}
        )

    while True:
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub | ast.UAdd):
            expr = expr.operand
        elif isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult) and constant(expr.left):
            expr = expr.right
        elif (
            isinstance(expr, ast.BinOp)
            and isinstance(expr.op, ast.Mult | ast.Div)
            and constant(expr.right)
        ):
            expr = expr.left
        else:
            return expr


def _constants(op: OpSpec) -> frozenset[str]:
    return frozenset(a for a, _ in (*op.attrs, *op.lets))


def why_not(op: OpSpec, program: Program, choice: Choice) -> str | None:
    """A sentence for the docstring when one position of the chosen output index still
    holds a pairwise matrix and the op's terms sum different indices."""
    if bounded(choice, program) or not pairwise(choice, program):
        return None
    terms = summed_terms(op)
    if terms is None:
        return None
    if len(terms) == 1 and not terms[0] and _extremum_of_reductions(op):
        return (
            f"One position of {choice.index} still holds a pairwise matrix, and the "
            "right-hand side is an outer max or min of a reduction (not a sum or mean), so "
            "no summed index can be cut; nor can the inner reduction run as a stage of its "
            "own (`tile_stages`: its result would be larger than the inputs and outputs, or "
            "no index bounds a stage): the bound is exceeded by that matrix."
        )
    if len(terms) == 1 and not terms[0]:
        return _outside_a_sum(op, choice)
    if len(terms) < 2 or not all(terms):
        return None
    common = set(terms[0]).intersection(*terms[1:])
    if common:
        return None
    return (
        "Its terms sum different indices ("
        + "; ".join(", ".join(t) for t in terms)
        + "), so no summed index can be cut in every term: write each term as an op of "
        "its own to tile it along its summed index."
    )


def _outside_a_sum(op: OpSpec, choice: Choice) -> str | None:
    """The sentence for a right-hand side that applies a function to a sum over the
    pair (`log(sum(sqrt(d), n, m))`; of exponentials, `tile_logsumexp` tiles it): a
    chunk's share of a log is no log of its share."""
    (assign,) = ast.parse(op.formulas[0].strip(" "), mode="exec").body
    rhs = assign.value
    if not (isinstance(rhs, ast.Call) and isinstance(rhs.func, ast.Name)):
        return None
    if reduction(rhs) or not any(reduction(n) for n in ast.walk(rhs)):
        return None
    return (
        f"One position of {choice.index} still holds a pairwise matrix, and the "
        f"right-hand side is {rhs.func.id}(...) of a reduction, not a sum or mean (nor a "
        "log of a sum of exponentials, whose chunks logaddexp combines), so no summed "
        "index can be cut: the bound is exceeded by that matrix."
    )


def _extremum_of_reductions(op: OpSpec) -> bool:
    """Whether the right-hand side is a `max` or `min` over indices of a body that reduces
    again (Hausdorff's `max(min(d, m), n)`), not a window's extremum (`max(x[..], u, v)`)."""
    (assign,) = ast.parse(op.formulas[0].strip(" "), mode="exec").body
    rhs = assign.value
    return reduction(rhs, ("max", "min")) and any(reduction(node) for node in ast.walk(rhs.args[0]))


def pairwise(choice: Choice, program: Program) -> bool:
    """Whether one position of the choice's index still leaves a large temporary over two
    or more indices that no output has (a pairwise matrix per position: `[n,m]` of
    `y[b] = sum(..., n, m)`), where a window (`[b,c,k]` per `t` of a convolution) has one."""
    outputs = {i.name for o in program.outputs for i in o.level.indices}
    return any(
        len({i.name.replace("'", "") for i in b} - outputs - {choice.index}) >= 2
        for b in choice.big
    )


def choose(op: OpSpec, program: Program, outer: Choice | None) -> Choice | None:
    """`outer` (the output-index choice) when one of its positions is bounded or holds no
    pairwise matrix; else a summed index whose one position is bounded, with its chunk;
    else `outer`."""
    if outer is not None and (bounded(outer, program) or not pairwise(outer, program)):
        return outer
    summed = _choose_summed(op, program)
    return summed if summed is not None and bounded(summed, program) else outer


def _choose_summed(op: OpSpec, program: Program) -> Choice | None:
    if op.outputs is not None or len(program.outputs) != 1:
        return None
    if any(len(group) > 1 for o in program.outputs for group in o.groups):
        return None
    terms = summed_terms(op)
    if terms is None or len(terms) != 1 or not terms[0]:
        return None
    big = big_sets(program)
    if not big:
        return None
    tree = ast.parse(op.formulas[0].strip(" "), mode="exec")
    (assign,) = tree.body
    reads = _reads([tree], set(program.inputs))
    for name in terms[0]:
        if not all(name in {i.name for i in b} for b in big):
            continue  # cutting it would leave some temporary whole
        if _rebound(_outer_sum(assign.value, _constants(op)), name) or splits.in_group(name, reads):
            continue
        choice = _chunk(op, program, copy.deepcopy(tree), reads, name, tuple(big))
        if bounded(choice, program):
            return choice
    return None


def _rebound(rhs: ast.Call, name: str) -> bool:
    """Whether a reduction inside the outer sum's body runs over `name` again."""
    return any(
        reduction(node) and any(a.id == name for a in node.args[1:])
        for node in ast.walk(rhs.args[0])
    )


def _chunk(op, program, tree, reads, name, big, outer_of=None) -> Choice:
    """The chunk of `name`; `outer_of(rhs)` finds the sum whose body is moved (default:
    the outer sum, `_outer_sum`)."""
    (assign,) = tree.body
    outer = (outer_of or (lambda rhs: _outer_sum(rhs, _constants(op))))(assign.value)
    taken = _names(tree) | {a for a, _ in (*op.attrs, *op.lets)}
    lets = op.lets
    sliced = _sliced(name, reads, op)
    start = _fresh(START, taken)
    length = None if sliced else _fresh(LENGTH, taken)
    total = share = None
    if outer.func.id == "mean":
        # A chunk's mean divides by its own length: scale it by length / total to make it
        # its share of the whole. The total is an int attr the loop passes (its count), not
        # a let read from an input, which would keep that input whole in every chunk.
        total = _fresh(TOTAL, taken)
        share = length
        if share is None:  # the chunk's length is its cut input's axis, a let of the chunk
            share = _fresh(LENGTH, taken)
            lets += ((share, "{}.shape[{}]".format(*sliced[0])),)
    # Only the body is moved: the outer sum's own index arguments stay (`_rebound`: no
    # reduction inside runs over `name` again).
    offset = _Offset(name, start, {n for n, _ in sliced})
    outer.args[0] = offset.visit(outer.args[0])
    if total is not None:
        ratio = ast.BinOp(ast.Name(share, ast.Load()), ast.Div(), ast.Name(total, ast.Load()))
        assign.value = ast.BinOp(assign.value, ast.Mult(), ratio)
    formula = ast.unparse(tree)
    if not offset.count:
        start = None
    ranges = tuple((k, v) for k, v in op.ranges if k != name)
    if length is not None:
        ranges += ((name, length),)
    texts = (formula, *(v for _, v in ranges), *(v for _, v in op.lets))
    used = {n for text in texts for n in _names(ast.parse(text.strip(" ")))}
    attrs = (
        *((a, kind) for a, kind in op.attrs if a in used),
        *((a, "int") for a in (start, length, total) if a),
    )
    chunk = replace(
        op, formulas=(formula,), attrs=attrs, ranges=ranges, lets=lets, inputs=program.inputs
    )
    return Choice(name, sliced, big, chunk, start, length, total=total)

"""Tiling a log-sum-exp along an index it reduces: chunks combined by logaddexp.

`y[b] = log(sum(exp(-d[b,n,m]), n, m))` keeps only the batch index `b` among its
outputs, and one position of `b` holds the whole pairwise matrix. It is no sum of its
chunks (`tile_sum`), but the log of one: with S_k the sum over a chunk k of `n` and
L_k = log S_k the same formula over that chunk,

    L = log Σ_k S_k = logaddexp_k(L_k)    (a running max-shifted sum of the L_k)

and, since dL/dS_k = 1/S = exp(-L) and dL_k/dθ = (dS_k/dθ) / S_k, the gradient is

    dL/dθ = Σ_k exp(L_k - L) · dL_k/dθ

each chunk's own gradient with the incoming gradient scaled by its share exp(L_k - L)
of the whole (a weight in [0, 1]: the softmax weights exp(term - L) of the untiled
gradient, split as exp(term - L_k) · exp(L_k - L), each factor at most 1, so logits in
the hundreds stay finite). Nothing of the matrix's size outlives a chunk: the backward
computes L over the chunks first, then each chunk's forward and gradient again. Where
every term is -inf (L = -inf: no points) the weight is 0, and the forward gives -inf as
the untiled log-sum-exp does.

The chunk is the op's formula with the reduction's body moved along the cut index
(`tile_sum._chunk`). Covered: one formula, one output, a right-hand side that is
`log(sum(exp(e), n, ...))`, or with the exponential masked (`where(cond, exp(e), 0)`,
a chunk whose terms are all masked gives -inf and a share of 0); the index cut is one the
sum runs over that leaves one position's temporaries no larger than an input or
output. A one-cloud form with an output per point (`log(sum(exp(s[b,n,m]), m))` per
`n`) is tiled along its output index `n` already (`tile.choose`).
"""

from __future__ import annotations

import ast
import copy
from dataclasses import replace

from . import splits, tile_sum
from .model import Program
from .spec import OpSpec
from .tile import Choice, _reads, big_sets

LOGADDEXP = "logaddexp"


def choose(op: OpSpec, program: Program, outer: Choice | None) -> Choice | None:
    """`outer` when one of its positions is bounded or holds no pairwise matrix; else an
    index of an outer log-sum-exp whose one position is bounded, with its chunk (combined
    by logaddexp); else `outer`."""
    if outer is not None and (
        tile_sum.bounded(outer, program) or not tile_sum.pairwise(outer, program)
    ):
        return outer
    found = _choose(op, program)
    return found if found is not None else outer


def reduction(rhs: ast.AST) -> ast.Call | None:
    """The `sum(body, n, ...)` of a right-hand side `log(sum(body, n, ...))` whose body is
    an exponential, `exp(e)`, or a masked one, `where(cond, exp(e), 0)`; else None."""
    if not (
        isinstance(rhs, ast.Call)
        and isinstance(rhs.func, ast.Name)
        and rhs.func.id == "log"
        and len(rhs.args) == 1
        and not rhs.keywords
    ):
        return None
    (total,) = rhs.args
    if not tile_sum.reduction(total, ("sum",)):
        return None
    body = total.args[0]
    if _called(body, "where") and len(body.args) == 3:
        masked = body.args[2]
        if isinstance(masked, ast.Constant) and masked.value == 0:
            body = body.args[1]
    return total if _called(body, "exp") else None


def _summed_outside(op: OpSpec, assign: ast.Assign) -> bool:
    """Whether the right side reads an index that neither the left side nor a reduction
    in it binds: Einstein's implicit sum, outside the log (`y[i] = log(sum(exp(x[i,c] +
    z[j,c]), j))` is Σ_c log Σ_j ..). A sum of logs is no log of a sum: combined by
    logaddexp, its chunks gave (C - 1)·log(J) too little."""
    (target,) = assign.targets
    bound = {
        a.id for node in ast.walk(assign.value) if tile_sum.reduction(node) for a in node.args[1:]
    }
    named = {name for name, _ in (*op.attrs, *op.lets)}
    return bool(_indices(assign.value) - _indices(target) - bound - named)


def _indices(node: ast.AST) -> set[str]:
    """The names read inside the subscripts of `node`, but for the tensors read there:
    an index tensor (`z[ix[j], c]`) is no index."""
    tensors = {
        sub.value.id
        for sub in ast.walk(node)
        if isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name)
    }
    return {
        n.id
        for sub in ast.walk(node)
        if isinstance(sub, ast.Subscript)
        for n in ast.walk(sub.slice)
        if isinstance(n, ast.Name)
    } - tensors


def _called(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def _choose(op: OpSpec, program: Program) -> Choice | None:
    if op.outputs is not None or len(op.formulas) != 1 or len(program.outputs) != 1:
        return None
    if any(len(group) > 1 for o in program.outputs for group in o.groups):
        return None
    tree = ast.parse(op.formulas[0].strip(" "), mode="exec")
    (assign,) = tree.body
    found = reduction(assign.value)
    big = big_sets(program)
    if found is None or not big or _summed_outside(op, assign):
        return None
    reads = _reads([tree], set(program.inputs))
    for name in (a.id for a in found.args[1:]):
        if not all(name in {i.name for i in b} for b in big):
            continue  # cutting it would leave some temporary whole
        if tile_sum._rebound(found, name) or splits.in_group(name, reads):
            continue
        choice = tile_sum._chunk(
            op, program, copy.deepcopy(tree), reads, name, tuple(big), outer_of=reduction
        )
        if tile_sum.bounded(choice, program):
            return replace(choice, combine=LOGADDEXP)
    return None

"""`where(cond, a, b)` over more than eight axes.

TensorFlow's `tf.where` (SelectV2) runs only up to rank 8 and raises "Broadcast between
... is not supported yet" beyond, even between operands of one shape. Adjacent axes that
every operand either has or lacks (the groups broadcasting merges anyway) are merged by a
reshape before the select and split after it: the same elements in the same order, no
copy, and no operand grows to the full shape. active_rotated_filter's table compared
with `<=` over the weight's three entry axes is a nine-axis where of three groups ([i, j],
the entry [o2, h2, w2], the output position [k, o, h, w]); compared with `==` it is a
segment sum (segment_cells.composite), no where.
"""

from __future__ import annotations

import sympy as sp

from .. import ir
from ..model import Index
from .common import _Body, _index_set, align

# The highest rank at which TensorFlow's `tf.where` runs.
MAX_SELECT_RANK = 8


def _groups(parts, axes: tuple[Index, ...]) -> list[tuple[Index, ...]]:
    """`axes` split into runs that every part either has whole or lacks whole."""
    present = [_index_set(p) for p in parts]
    groups: list[list[Index]] = []
    last = None
    for i in axes:
        pattern = tuple(i in p for p in present if p)
        if groups and pattern == last:
            groups[-1].append(i)
        else:
            groups.append([i])
        last = pattern
    return [tuple(g) for g in groups]


def lower(lowerer, body: _Body, e: sp.Expr, target: tuple[Index, ...]) -> ir.Expr | None:
    """`e` (a `select`) over `target`, past MAX_SELECT_RANK axes: over its own axes when
    those are few enough, else over merged groups and reshaped back; None when even the
    merged groups are too many (the caller keeps the plain where)."""
    cond, then, otherwise = e.args
    own = tuple(i for i in target if i in _index_set(e))
    if len(own) == len(target) and len(own) <= MAX_SELECT_RANK:
        return None
    if len(own) <= MAX_SELECT_RANK:  # the select over its own axes, broadcast after
        value = ir.Var(body.bind(lowerer.pointwise(body, e, own)))
        return align(value, own, target)
    groups = _groups((cond, then, otherwise), own)
    if len(groups) > MAX_SELECT_RANK:
        return None

    def merged(code: ir.Expr, part: sp.Basic) -> ir.Expr:
        labels = _index_set(part)
        if not labels:  # a scalar broadcasts at any rank
            return code
        dims = tuple(
            tuple(lowerer.index_size(body, i) for i in g) if g[0] in labels else ("1",)
            for g in groups
        )
        return ir.Call("reshape", (ir.Var(body.bind(code)), ir.Shape(dims)))

    def over(part: sp.Basic) -> tuple[Index, ...]:
        return tuple(i for i in own if i in _index_set(part))

    selected = ir.Call(
        "where",
        (
            merged(lowerer.condition(body, cond, over(cond)), cond),
            merged(lowerer.value(body, then, over(then)), then),
            merged(lowerer.value(body, otherwise, over(otherwise)), otherwise),
        ),
    )
    full = ir.Shape(tuple((lowerer.index_size(body, i),) for i in own))
    value = ir.Var(body.bind(ir.Call("reshape", (ir.Var(body.bind(selected)), full))))
    return align(value, own, target)

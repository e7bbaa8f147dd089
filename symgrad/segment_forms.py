"""Which masked reductions are segment reductions (plain SymPy predicates, shared by the
lowering, `lower/segment_extrema.py`, and tiling, `tile.py`, which must not count their
masks as temporaries).

`where(seg[n..] == v, value, fill)`: an index tensor at distinct plain indices compared
with an index v. Over n, `max` of it with fill -inf (`min` with +inf, log Σ exp with -inf)
is a segment max (min, logsumexp) into rows v; the companion count of the max's ties,
Σ_n [where(seg[n] == v, value, -inf) == max[v]], is a segment sum of [value == max[seg[n]]].
"""

from __future__ import annotations

import sympy as sp

from . import functions as fn
from .indexing import is_iota

# The fill each extremum ignores: a masked entry can never be the max (min).
FILLS = {"max": fn.NEG_INF, "logsumexp": fn.NEG_INF, "min": -fn.NEG_INF}


def segment_condition(condition: sp.Expr, ids: object) -> tuple[sp.Indexed, sp.Symbol] | None:
    """`seg[n..] == v`: (the ids access, v), when seg is an index tensor (a name in `ids`)
    read at distinct plain indices and v is an index; None otherwise."""
    if not isinstance(condition, sp.Eq):
        return None
    left, right = condition.args
    if is_iota(left):
        left, right = right, left
    if not is_iota(right) or not isinstance(left, sp.Indexed):
        return None
    if left.base.label.name not in ids:
        return None
    positions = tuple(left.indices)
    if not all(isinstance(p, sp.Symbol) for p in positions) or len(set(positions)) != len(
        positions
    ):
        return None
    v = right.indices[0]
    if not isinstance(v, sp.Symbol) or v in positions:
        return None
    return left, v


def is_segment_mask(e: sp.Expr, ids: object) -> bool:
    """`where(seg[n..] == v, a, b)` (or `!=`): a mask that picks rows, no nonlinearity of
    its own. The builder keeps it inside the function it is written in
    (`model.share_nested`), so `exp(where(dst[n] == v, s[n,h], -inf))` reaches
    `_masked_exp` as one expression, not as a dense [n,h,v] intermediate of masked
    logits."""
    if not isinstance(e, fn.select) or not isinstance(e.args[0], (sp.Eq, sp.Ne)):
        return False
    return segment_condition(sp.Eq(*e.args[0].args), ids) is not None


def eq_form(e: sp.Expr, ids: object) -> sp.Expr:
    """`e` with every `where(seg[n..] != v, a, b)` written `where(seg[n..] == v, b, a)`."""

    def negated(s) -> bool:
        return (
            isinstance(s, fn.select)
            and isinstance(s.args[0], sp.Ne)
            and segment_condition(sp.Eq(*s.args[0].args), ids) is not None
        )

    e = e.replace(negated, lambda s: fn.select(sp.Eq(*s.args[0].args), s.args[2], s.args[1]))
    e = e.replace(lambda s: _masked_exp(s, ids) is not None, lambda s: _masked_exp(s, ids))
    return e.replace(lambda m: _merged_masks(m) is not None, _merged_masks)


def _merged_masks(e: sp.Expr) -> sp.Expr | None:
    """A product's factors `where(c, a, 0) * where(c, b, 0)` of one condition as one
    `where(c, a * b, 0)` (the derivative of a masked exponential by its masked logits
    is one more such factor), or None: a segment term has one mask."""
    if not isinstance(e, sp.Mul):
        return None
    factors = sp.Mul.make_args(e)
    masks = [f for f in factors if isinstance(f, fn.select) and f.args[2] == 0]
    conditions = [m.args[0] for m in masks]
    shared = next((c for c in conditions if conditions.count(c) > 1), None)
    if shared is None:
        return None
    kept = [m for m in masks if m.args[0] == shared]
    rest = [f for f in factors if not any(f is m for m in kept)]
    return sp.Mul(*rest) * fn.select(shared, sp.Mul(*(m.args[1] for m in kept)), 0)


def _masked_exp(e: sp.Expr, ids: object) -> sp.Expr | None:
    """`exp(where(seg[n..] == v, a, -inf) + b)` as `where(seg[n..] == v, exp(a + b), 0)`,
    or None. The stable form of a segment softmax (`masked_exp`, with L its segment
    log-sum-exp: `exp(where(dst[n] == v, s[n,h], -inf) - L[h,v])`, GAT's attention
    weights) is then a segment sum reading L at row dst[n], where the exponential over
    every (n, v) was a dense [h,n,v] tensor. Equal wherever b is finite, and 0, not
    exp(-inf + inf) = nan, at an empty segment's L = -inf."""
    if not isinstance(e, sp.exp):
        return None
    for term in sp.Add.make_args(e.args[0]):
        if (
            isinstance(term, fn.select)
            and term.args[2] == fn.NEG_INF
            and segment_condition(term.args[0], ids) is not None
        ):
            return fn.select(term.args[0], sp.exp(e.args[0] - term + term.args[1]), 0)
    return None


def segment_select(e: sp.Expr, fill: sp.Expr, ids: object):
    """`where(seg[n..] == v, value, fill)` (or `where(seg[n..] != v, fill, value)`):
    (ids access, v, value), or None."""
    e = eq_form(e, ids)
    if not isinstance(e, fn.select) or e.args[2] != fill:
        return None
    found = segment_condition(e.args[0], ids)
    if found is None:
        return None
    return (*found, e.args[1])


def segment_extremum(kind: str, indices, expr: sp.Expr, summed, ids: object):
    """An extremum level (`kind` max, min or logsumexp over `indices`, of `expr` over
    `summed`) that is a segment reduction: (ids access, v, value, batch), batch the ids
    indices that stay free (segments per (batch.., v)); None otherwise."""
    fill = FILLS.get(kind)
    found = None if fill is None else segment_select(expr, fill, ids)
    if found is None:
        return None
    ids_access, v, value = found
    n = tuple(ids_access.indices)
    if v not in indices:
        return None
    batch = tuple(i for i in n if i in indices)
    if set(summed) != set(n) - set(batch) or not summed:
        return None
    if v in value.free_symbols:
        return None
    return ids_access, v, value, batch


def sum_rows(select: fn.select) -> sp.Expr:
    """A segment sum's rows, `where(seg[r,n] == v, f[n,c], 0)`: the value at every index
    of the ids, [r,n,c] (lower/segments.py broadcasts it there: larger than f and than
    the output [r,v,c] when the ids have an index the value lacks)."""
    (read,) = [a for a in select.args[0].args if isinstance(a, sp.Indexed) and not is_iota(a)]
    (iota,) = [a for a in select.args[0].args if is_iota(a)]
    # a read at v is read at the ids' rows (`L[h, dst[n]]`, a segment softmax's weights)
    value = select.args[1].xreplace({iota.indices[0]: read})
    return sp.Mul(read, value, evaluate=False)


def extremum_rows(ids_access: sp.Indexed, value: sp.Expr, indices) -> tuple:
    """A segment extremum's rows (lower/segment_extrema.py): the value over the ids'
    indices and the level's other indices."""
    rows = set(ids_access.indices) | (value.free_symbols & set(indices))
    return tuple(sorted(rows, key=sp.default_sort_key))


def segment_ties(expr: sp.Expr, ids: object):
    """The ties count of a segment max/min, `[where(seg[n] == v, value, ±inf) == m[..v..]]`:
    the same bracket under the mask, `where(seg[n] == v, [value == m], 0)`; None for any
    other term."""
    if not isinstance(expr, fn.step_eq):
        return None
    inner, extremum = expr.args
    inner = eq_form(inner, ids)
    for fill in (fn.NEG_INF, -fn.NEG_INF):
        found = segment_select(inner, fill, ids)
        if found is not None and isinstance(extremum, sp.Indexed):
            _, v, value = found
            if v in extremum.indices:
                return fn.select(inner.args[0], fn.step_eq(value, extremum), 0)
    return None


def ties_at_rows(expr: sp.Expr, ids: object) -> sp.Expr | None:
    """What the segment sum of a ties count adds up: `[value == m[.., seg[n..], ..]]`."""
    masked = segment_ties(expr, ids)
    if masked is None:
        return None
    ids_access, v = segment_condition(masked.args[0], ids)
    return masked.args[1].xreplace({v: ids_access})

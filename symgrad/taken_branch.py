"""The gradient through a `where` branch not taken is 0, beyond an intermediate too.

`y[r,c] = where(A[r] > 0, sum(x[c,a] * w[r,a], a) / A[r], 0)` puts the quotient into an
intermediate `_s1[c,r]`; the select passes `_s1` its cotangent as `grad_y * where(A > 0,
1, 0)`, a 0/1 factor, and the chain then multiplies it by `∂_s1/∂x = w / A`: 0 · inf =
nan where A = 0, for every x the sum reads, even where that output's cotangent is 0
(mmcv's prroi_pool beside an empty roi). The formula's guard says the user asked for 0
there, as the kernels give and as TF's autodiff of `tf.where` does.

So an intermediate whose every incoming contribution has such a mask factor gets the
mask's condition (on its own indices) as a guard, and its partials carry it: the
factors that may be non-finite (anything but a polynomial in the reads, or a select of
such) become `where(cond, factors, 0)`, exactly 0 outside the taken branch and unchanged
inside it, so a nan or inf in the branch that IS taken still reaches the gradient. The
finite factors stay outside the select (a guarded `1 / A[r]` is a vector over r, not a
tensor over every index of the partial), and an op with no guarded intermediate derives
exactly as before.
"""

from __future__ import annotations

import sympy as sp

from . import functions as fn
from .indexing import index_symbols
from .model import Level, accesses


def guard(level: Level, contributions) -> sp.Expr | None:
    """The condition on `level`'s own indices outside which its incoming gradient is 0
    by a select (the union over its incoming contributions), or None when one of them
    has no mask factor on the level's indices (or lives on a diagonal)."""
    if level.kind != "sum" or not contributions:
        return None
    conditions = []
    for contribution in contributions:
        if contribution.diagonal:
            return None
        cond = _mask(contribution.partial, set(contribution.indices))
        if cond is None:
            return None
        mapping = dict(zip(contribution.indices, level.indices, strict=True))
        conditions.append(cond.xreplace(mapping))
    return sp.Or(*conditions)


def guarded(partial: sp.Expr, cond: sp.Expr | None) -> sp.Expr:
    """`partial` with its factors that may be non-finite 0 where `cond` does not hold."""
    if cond is None or cond is sp.true:
        return partial
    factors = sp.Mul.make_args(partial)
    finite = [f for f in factors if _finite(f)]
    rest = [f for f in factors if not _finite(f)]
    if not rest:
        return partial
    return sp.Mul(*finite) * fn.select(cond, sp.Mul(*rest), 0)


def _mask(partial: sp.Expr, own: set) -> sp.Expr | None:
    """The condition of a factor `where(cond, v, 0)` (`where(cond, 0, v)`: its negation)
    of `partial` that reads only the indices `own`, else None."""
    for factor in sp.Mul.make_args(partial):
        if not isinstance(factor, fn.select):
            continue
        cond, then, otherwise = factor.args
        if otherwise == 0 and then != 0:
            pass
        elif then == 0 and otherwise != 0:
            cond = sp.Not(cond)
        else:
            continue
        if set(index_symbols(cond)) <= own and not _loose_indices(cond, own):
            return cond
    return None


def _loose_indices(cond: sp.Expr, own: set) -> bool:
    """Whether `cond` has an index symbol outside any access that is not in `own`."""
    indices = {s for a in cond.atoms(sp.Indexed) for s in a.free_symbols}
    return any(
        s not in own and s not in indices and not s.is_real and not s.is_integer
        for s in cond.free_symbols
        if isinstance(s, sp.Symbol)
    )


def _finite(factor: sp.Expr) -> bool:
    """Whether `factor` is finite wherever the reads are: a polynomial in them, a 0/1
    step, or a select of such."""
    if factor.has(fn.NEG_INF):
        return False
    if isinstance(factor, fn._Step):
        return True
    if isinstance(factor, fn.select):
        return _finite(factor.args[1]) and _finite(factor.args[2])
    if isinstance(factor, sp.Pow) and factor.exp.is_Integer and factor.exp > 0:
        return _finite(factor.base)
    # reads and index values (RWKV's `t - 1 - i`) as plain variables: a polynomial in
    # them, the attrs and numbers is finite
    leaves = [*accesses(factor), *sorted(factor.atoms(fn.index_value), key=sp.default_sort_key)]
    plain = factor.xreplace({leaf: sp.Dummy() for leaf in leaves})
    return plain.is_polynomial()

"""The gradient through a `where` branch not taken is 0, beyond an intermediate too.

`y[r,c] = where(A[r] > 0, sum(x[c,a] * w[r,a], a) / A[r], 0)` puts the quotient into an
intermediate `_s1[c,r]`; the select passes `_s1` its cotangent as `grad_y * where(A > 0,
1, 0)`, a 0/1 factor, and the chain then multiplies it by `∂_s1/∂x = w / A`: 0 · inf =
nan where A = 0, for every x the sum reads, even where that output's cotangent is 0
(mmcv's prroi_pool beside an empty roi; TF's autodiff of the same `tf.where` too). The
formula's guard says the user asked for 0 there, as the kernels give.

So an intermediate whose every incoming contribution has such a mask factor gets the
mask's condition (on its own indices) as a guard, and its partials carry it: the
factors that may be non-finite (a division, a root, a log: `_finite`) become
`where(cond, factors, 0)`, exactly 0 outside the taken branch and unchanged inside it,
so a nan or inf in the branch that IS taken still reaches the gradient. The finite
factors stay outside the select (a guarded `1 / A[r]` is a vector over r, not a tensor
over every index of the partial), and an op with no guarded intermediate derives
exactly as before.
"""

from __future__ import annotations

import sympy as sp

from . import functions as fn
from .indexing import index_symbols
from .interpolation import lerp
from .logaddexp import logaddexp, nonempty
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
    """Whether `factor` is finite wherever the reads are finite: no division, root or
    log, only functions without a pole (an exponential that overflows is left as it
    is: a masked softmax's weights are already exact, `exp(where(c, u, -inf))`)."""
    factor = factor.xreplace({a: sp.Dummy() for a in accesses(factor)})  # reads are finite
    if factor.replace(sp.exp, lambda _: sp.S.One).has(fn.NEG_INF):
        return False  # -inf outside an exponential (inside one it is a masked 0)
    for power in factor.atoms(sp.Pow):
        if not (power.exp.is_Integer and power.exp >= 0):
            return False
    return all(isinstance(f, _ENTIRE) for f in factor.atoms(sp.Function))


_ENTIRE = (
    sp.exp,
    sp.sin,
    sp.cos,
    sp.sinh,
    sp.cosh,
    sp.tanh,
    sp.erf,
    sp.Abs,
    sp.sign,
    fn.sigmoid,
    fn.softplus,
    fn.silu,
    fn.gelu,
    fn.gelu_tanh,
    fn.elu,
    fn.relu,
    fn.floor,
    fn.floor_index,
    fn.index_value,
    fn.select,
    fn._Step,
    fn.maximum,
    fn.minimum,
    logaddexp,
    nonempty,
    lerp,
)

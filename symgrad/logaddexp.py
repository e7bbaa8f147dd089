"""The log of a finite sum of exponentials, kept in log space.

`log(c0 + Σ_i w_i·exp(u_i))`, where each w_i is a positive constant or a `where` mask
(`where(cond, exp(u), 0)` is already `exp(where(cond, u, -inf))`, see model.where) and c0
a nonnegative constant or a masked one, is

    logaddexp(a_0, a_1, ...)  with  a_i = u_i + log(w_i)  (-inf where masked)

and a constant c0 is the term `log(c0)` (`where(cond, c0, 0)`: `where(cond, log c0,
-inf)`). It is computed as `m + log(Σ exp(a_i - m))` with m the largest active term (a
masked term is -inf and never sets m; every term masked: m = -inf is replaced by 0, and
the result is log(0) = -inf; a +inf term: +inf). The expression does not depend on m, so
the derivative in a_k is the softmax weight `exp(a_k - L)`, finite for logits in the
hundreds, where `exp(u)/(exp(u) + exp(v))` would be inf/inf. Where every term is -inf
(L = -inf) the weight is 0, not exp(-inf + inf) = nan: the gradient of a cell whose
terms are all masked is 0.

A negative power of such a sum is `exp(-n·L)`, so `exp(u)/(exp(u) + exp(v))` is
`exp(u - L)` (a two-class softmax) and never inf/inf.

Soft-DTW's cell `log(where(i == 0 and j == 0, 1, 0) + where(.., 0, exp(-R[..]/gamma))
+ ...)` and RNN-T's `log(exp(a + x) + exp(b + y))` are of this form; so is every such
formula, including the step of a recurrence (an ordinary op built by the same model).
"""

from __future__ import annotations

import sympy as sp

from . import functions as fn
from . import ir


class logaddexp(sp.Function):
    """log Σ_i exp(a_i), evaluated shifted by the largest finite a_i (see module doc)."""

    is_real = True

    @classmethod
    def eval(cls, *args):
        if not args:
            return None
        active = [a for a in args if a != fn.NEG_INF]
        if len(active) < len(args):
            return cls(*active) if active else fn.NEG_INF
        if len(args) == 1:
            return args[0]
        if all(a.is_number for a in args):
            return sp.log(sp.Add(*[sp.exp(a) for a in args]))
        return None

    def fdiff(self, argindex=1):
        # exp(a_k - L): the softmax weight. Where L = -inf every a_k is -inf (masked, or
        # an input at -inf): weight 0 instead of exp(-inf + inf) = nan.
        return sp.exp(self.args[argindex - 1] - nonempty(self))


class nonempty(sp.Function):
    """L where L > -inf, else 0: a logaddexp whose terms are all -inf subtracted from
    them gives exp(-inf - 0) = 0. Shown as L itself (only that case differs)."""

    is_real = True

    def fdiff(self, argindex=1):
        return sp.Integer(1)

    def _sympystr(self, printer) -> str:
        return printer._print(self.args[0])

    _symgrad_str = _sympystr  # notation.IndexPrinter

    def _latex(self, printer) -> str:
        return printer._print(self.args[0])


def stable_log(total: sp.Expr) -> sp.Expr | None:
    """`log(total)` as a `logaddexp` when `total` is a sum of terms, each a (masked)
    exponential with a positive constant weight or a nonnegative (masked) constant, at
    least one an exponential of tensors; else None (the caller keeps it as written). A
    single term is its logit: `log(exp(u))` is u, never log(0) where exp(u) underflows."""
    logits = []
    for term in sp.Add.make_args(total):
        logit = _logit(term)
        if logit is None:
            return None
        logits.append(logit)
    if not any(a.atoms(sp.Indexed) for a in logits):
        return None
    return logaddexp(*logits)


def _logit(term: sp.Expr) -> sp.Expr | None:
    """a with `term = exp(a)` (a = -inf where a mask zeroes it), or None."""
    if term.is_number:
        if term.is_positive:
            return sp.log(term)
        return fn.NEG_INF if term == 0 else None
    if isinstance(term, fn.select):  # a mask: each branch a term of its own
        cond, then, otherwise = term.args
        branches = [_logit(then), _logit(otherwise)]
        return None if None in branches else fn.select(cond, *branches)
    constant, rest = term.as_independent(sp.exp, fn.select, as_Add=False)
    if constant.atoms(sp.Indexed) or not constant.is_positive:
        return None
    logit = sp.log(constant)
    for factor in sp.Mul.make_args(rest):
        if isinstance(factor, sp.exp):
            part = factor.args[0]
        elif isinstance(factor, sp.Pow) and isinstance(factor.base, sp.exp):
            if not factor.exp.is_number:
                return None
            part = factor.exp * factor.base.args[0]
        else:
            part = _logit(factor) if isinstance(factor, fn.select) else None
        if part is None:
            return None
        logit = _add(logit, part)
    return logit


def _add(a: sp.Expr, b: sp.Expr) -> sp.Expr:
    """a + b, where a masked (-inf) branch of either stays -inf (never -inf + inf)."""
    if fn.NEG_INF in (a, b):
        return fn.NEG_INF
    if isinstance(b, fn.select):
        a, b = b, a
    if isinstance(a, fn.select):
        cond, then, otherwise = a.args
        return fn.select(cond, _add(then, b), _add(otherwise, b))
    return a + b


def rewrite(node: sp.Expr) -> sp.Expr | None:
    """A log or a negative power of a sum of exponentials in log space, or None."""
    if isinstance(node, sp.log):
        return stable_log(node.args[0])
    if isinstance(node, sp.Pow) and node.exp.is_negative:
        stable = stable_log(node.base)
        return None if stable is None else sp.exp(node.exp * stable)
    return None


def lower(lowerer, body, e: sp.Expr, target) -> ir.Expr:
    """A `logaddexp` or the `nonempty` of one, as code over `target`'s axes."""
    if isinstance(e, nonempty):
        total = ir.Var(body.bind(lowerer.expr(body, e.args[0], target)))
        empty = ir.Binary("==", total, ir.Var(body.bind(lowerer.expr(body, fn.NEG_INF, ()))))
        return ir.Call("where", (empty, ir.Call("zeros_like", (total,)), total))
    return _lower_sum(lowerer, body, e, target)


def _lower_sum(lowerer, body, e: logaddexp, target) -> ir.Expr:
    """`m + log(Σ exp(a_i - m))`, m the largest term, 0 where that is not finite (every
    term -inf: log 0 = -inf; a term +inf: +inf), as tf.reduce_logsumexp does."""
    from .lower.common import _tensor_argument

    terms = []
    for a in e.args:
        value = _tensor_argument(body, lowerer.expr(body, a, target))
        terms.append(value if isinstance(value, ir.Var) else ir.Var(body.bind(value)))
    peak = terms[0]
    for term in terms[1:]:
        peak = ir.Call("maximum", (peak, term))
    peak = ir.Var(body.bind(peak))
    zero = ir.Call("zeros_like", (peak,))
    shift = ir.Var(body.bind(ir.Call("where", (ir.Call("is_finite", (peak,)), peak, zero))))
    total = ir.Call("exp", (ir.Binary("-", terms[0], shift),))
    for term in terms[1:]:
        total = ir.Binary("+", total, ir.Call("exp", (ir.Binary("-", term, shift),)))
    return ir.Var(body.bind(ir.Binary("+", ir.Call("log", (total,)), shift)))


def distributes(terms, factor) -> bool:
    """Whether `factor` (pointwise) is multiplied into each of `terms` rather than into
    their total: `factor` a constant times one exponential of tensors (`exp(-L)`, the
    reciprocal of a sum of exponentials in log space) and every term an exponential of
    tensors (times reads). Longformer's `(sum(exp(u)*v, k) + sum(exp(s)*v, j)) / (sum(
    exp(u), k) + sum(exp(s), j))` is then `sum(exp(u - L)*v, k) + sum(exp(s - L)*v, j)`,
    each weight at most 1, where the total of the raw exponentials is inf in float32 at
    logits near 89 (inf times exp(-L) = 0: nan). One such sum was already distributed."""
    if _exponential(factor) is None:
        return False
    return all(any(_exponential(f) is not None for f in sp.Mul.make_args(t.expr)) for t in terms)


def _exponential(expr: sp.Expr) -> sp.Expr | None:
    """The exponential of tensors of `c·exp(a)` (c a number; a negative power of a sum
    of exponentials is one, `rewrite`), or None."""
    constant, rest = expr.as_independent(sp.Indexed, as_Add=False)
    if isinstance(rest, sp.Pow) and rest.exp.is_negative:
        rest = rewrite(rest)
    if not isinstance(rest, sp.exp) or not constant.is_number or constant == 0:
        return None
    return rest

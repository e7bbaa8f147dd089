"""A masked exponential times reads, `where(c, exp(u) * v[..], 0)`, written as
`exp(where(c, u, -inf)) * v[..]` with each read masked where that makes no larger tensor
(`model._Builder` calls it for every `where` whose other branch is 0).

The exponential under the mask is what a softmax over the kept positions takes, so the
lowering finds the stable form (`exp(s - L)`); reads left unmasked meet the mask's zeros
in a contraction that `masked_values` makes exact for values that are not finite.
"""

from __future__ import annotations

import sympy as sp

from . import functions as fn


def _indices_of(expr: sp.Expr) -> frozenset:
    return frozenset(i for a in expr.atoms(sp.Indexed) for i in a.indices)


def masked_exp_times_reads(
    cond, then: sp.Expr, otherwise: sp.Expr, internal: set[str]
) -> sp.Expr | None:
    """`where(c, exp(u) * v[..], 0)` as `exp(where(c, u, -inf)) * v[..]` (and the mirror
    form), when the other factors are plain reads: a causal attention's numerator
    `sum(where(j <= i, exp(s) * v[b,j,e], 0), j)` over its denominator is then
    `exp(s - L) * v`, where `exp(s)` alone overflows float32 at logits near 89 (inf times
    exp(-L) = 0 gave nan). A masked position is exp(-inf) * v = 0, as before, for finite v."""
    if otherwise == 0:
        kept, sign = then, 1
    elif then == 0:
        kept, sign = otherwise, -1
    else:
        return None
    factors = sp.Mul.make_args(kept)
    exps = [f for f in factors if isinstance(f, sp.exp)]
    rest = [f for f in factors if not isinstance(f, sp.exp)]
    if len(exps) != 1 or not rest or not all(isinstance(f, sp.Indexed) for f in rest):
        return None
    u = exps[0].args[0]
    masked = fn.select(cond, u, fn.NEG_INF) if sign == 1 else fn.select(cond, fn.NEG_INF, u)
    return sp.exp(masked) * _masked_reads(cond, sp.Mul(*rest), sign, u, internal)


def _masked_reads(cond, reads: sp.Expr, sign: int, u: sp.Expr, internal: set[str]) -> sp.Expr:
    """The reads of `masked_exp_times_reads`, masked too when the mask varies only over
    their indices (a padding mask `m[b,j]` on `v[b,j,e]`: no larger tensor), or when the
    masked reads are no larger than the exponential (RWKV's `exp((t - 1 - i) * w[c] +
    k[b,i,c]) * v[b,i,c]` under `i < t`: the product is [b,t,i,c] anyway): exp(-inf)
    times an inf or nan read is nan, where the `where` gave 0. A mask over indices that
    neither has (causal attention's `j <= i` on `v[b,j,e]` with logits [b,i,j]) would make
    the reads as large as the product, and the sum no longer a contraction: that case is
    `masked_values`' branch on finite values."""
    mask, read = _indices_of(cond), _indices_of(reads)
    if not (mask <= read or mask | read <= _indices_of(u)):
        return reads
    if mask | read <= _indices_of(u):
        return _select(cond, reads, sign)
    # Several reads that cover the mask only together (Mamba-2's `C[b,t,g,n] *
    # B[b,s,g,n] * X[b,s,h,p]` under `s <= t`): each masked over its own indices and the
    # mask's, reads of the same such indices together, so that their product stays a
    # contraction (`where(s <= t, B * C, 0)` summed over g, n before X comes in); the
    # whole product masked at once was one tensor over every index ([b,s,g,n,t,h,p]).
    # Every factor is 0 under the mask, so a masked position is still 0 for inf or nan
    # reads. A read of one input that the mask would make larger (X[b,s,h,p] under s <=
    # t: [b,s,h,p,t], p times the decay's [b,s,h,t]) is left alone: the masked factors
    # are contracted with it (`einsum(W, X)`), which `masked_values` makes exact where
    # X is not finite (W of either sign), and its gradients mask after summing p.
    groups: dict[frozenset, list[sp.Expr]] = {}
    for factor in sp.Mul.make_args(reads):
        groups.setdefault(frozenset(_indices_of(factor) | mask), []).append(factor)
    return sp.Mul(
        *(
            group[0]
            if _larger_input_read(group, mask, internal)
            else _select(cond, sp.Mul(*group), sign)
            for group in groups.values()
        )
    )


def _larger_input_read(group: list[sp.Expr], mask: set, internal: set[str]) -> bool:
    """Whether `group` is one read of an input that does not have every index of the mask."""
    (read, *others) = group
    return (
        not others
        and isinstance(read, sp.Indexed)
        and str(read.base.label) not in internal
        and not mask <= _indices_of(read)
    )


def _select(cond, reads: sp.Expr, sign: int) -> sp.Expr:
    return fn.select(cond, reads, 0) if sign == 1 else fn.select(cond, 0, reads)

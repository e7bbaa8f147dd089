"""Sums under a mask of indices: the indices the mask does not read are summed first.

`sum(where(s <= l, q[n,h,l,e] * k[n,h,s,e] * v[n,h,s,m], 0), s, e)` (fast-transformers'
causal product) was a `where` over every index of its value, [n,h,l,s,e,m], summed over
s and e afterwards: L * E * M for one query, where the op's inputs hold E per query. The
mask reads l and s alone, so a summed index it does not read (e) moves inside it:

    Σ_s,e where(s <= l, P, 0) = Σ_s where(s <= l, Σ_e P, 0)

exactly, in IEEE arithmetic too: where the mask holds both sides are Σ_e P (in another
order), where it does not both are 0, whatever P is (inf or nan included). The inner sum
is an ordinary term (an einsum of the value's factors, [n,h,l,s,m]); the `where` and the
sum over s follow. The gradients have the same form: `Σ_m,s grad_y[n,h,l,m] * where(s
<= l, k[n,h,s,e] * v[n,h,s,m], 0)` sums m inside, [n,h,l,s,e]. So every temporary is one
tensor the op reads or writes widened by the mask's indices (`tile._masked_sets`), and
tiling bounds that.

An incoming gradient outside the mask moves inside it with the indices it reads: the
formula's masked branch has no gradient, so a masked position adds 0 (TensorFlow's
gradient of a `where`), where `grad_y * where(.., 0)` made an inf or nan incoming
gradient nan there. Any other factor outside the mask stays outside (`x[l] * where(..)`
with x inf is nan by the formula), and the indices it reads are summed after the mask.
A mask that a prefix sum takes (`Kernels.prefix_sum`) is a `cumsum` instead, checked
first.
"""

from __future__ import annotations

import sympy as sp

from .. import functions as fn
from .. import ir
from ..indexing import on_indices
from ..model import Index, tensor
from .common import _Body, _index_set, _is_gradient


def index_mask(e: sp.Expr):
    """(the mask factor, the incoming gradients beside it, the other factors) of a product
    with one factor `where(c, value, 0)` whose condition compares index values alone (`s
    <= l`, `i - w <= j and j <= i + w`); else None."""
    factors = sp.Mul.make_args(e)
    masks = [
        f
        for f in factors
        if isinstance(f, fn.select)
        and f.args[2] == 0
        and f.args[0].has(sp.Indexed)
        and on_indices(f.args[0])
    ]
    if len(masks) != 1:
        return None
    (mask,) = masks
    others = [f for f in factors if f is not mask]
    moved = [f for f in others if isinstance(f, sp.Indexed) and _is_gradient(f)]
    return mask, moved, [f for f in others if f not in moved]


def summed_inside(e: sp.Expr, summed) -> tuple[Index, ...]:
    """The summed indices of the product `e` that its index mask's sum takes inside the
    mask: read by neither the mask's condition nor a factor left outside it (an incoming
    gradient moves inside). Empty when `e` has no such mask."""
    found = index_mask(e)
    if found is None:
        return ()
    mask, moved, outside = found
    taken = _index_set(mask.args[0]).union(*(_index_set(f) for f in outside))
    value = _index_set(mask.args[1]).union(*(_index_set(f) for f in moved))
    inner = tuple(i for i in summed if i in value and i not in taken)
    pointwise = [
        f
        for f in sp.Mul.make_args(mask.args[1])
        if not isinstance(f, sp.Indexed) and f.has(sp.Indexed)
    ]
    condition = _index_set(mask.args[0])
    wider = len((value - set(inner)) | condition) > len(_index_set(mask.args[1]) | condition)
    if wider or any(set(inner) <= _index_set(f) for f in pointwise):
        # Only where the mask's tensor has no more indices than its value's own: an
        # incoming gradient moved inside brings its indices (filtered_lrelu's grad_bias,
        # `where(.., fu window, 0)` over [p,q,kn,km], would be over c too; the causal
        # product's grad_v trades e for m, as wide, and its masked keys get nothing from
        # an inf grad_y, as grad_q's and grad_k's, which it narrows). And not where the inner
        # sum reduces a pointwise factor over all it sums (`where(.., x + bias, 0) *
        # grad_T` over b and c): that is materialized at the where's size anyway, and the
        # gradient lost its share of the factor with the others (TensorFlow's step of
        # filtered_lrelu at 8 channels, 0.71x -> 1.04x its bound).
        return ()
    return inner


class MaskedSums:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

    def masked_sum(self, body: _Body, e: sp.Expr, summed, out, eyes):
        """`Σ where(c, P, 0)` with c on indices alone, the summed indices c does not read
        summed inside the mask first: one term whose mask is over the rest; None where no
        summed index moves."""
        if eyes:
            return None
        inner = summed_inside(e, summed)
        if not inner:
            return None
        mask, moved, outside = index_mask(e)
        value = mask.args[1] * sp.Mul(*moved)
        present = _index_set(value)
        labels = tuple(i for i in (*out, *summed) if i in present and i not in inner)
        total = None
        for piece, axes in self.term(body, value, inner, labels):
            full = self.full(body, piece, axes, labels)
            total = full if total is None else ir.Binary("+", total, full)
        name = body.bind(total)
        body.tensors[name] = name
        masked = fn.select(mask.args[0], tensor(name)[labels], 0)
        rest = tuple(i for i in summed if i not in inner)
        return self.term(body, sp.Mul(*outside) * masked, rest, out, eyes)

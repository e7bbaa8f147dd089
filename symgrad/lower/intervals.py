"""CSR segments: `where(indptr[s] <= n < indptr[s + 1], .., 0)` without an S x N mask.

Written densely, `y[s,f] = sum(where(indptr[s] <= n < indptr[s + 1], x[n,f], 0), n)` is
an S x N mask times x. When `indptr` is non-decreasing (CSR, as torch_scatter's
`segment_csr` requires), row n lies in exactly one segment, found by a binary search:
`r[n] = searchsorted(indptr, n, side="right") - 1` (minus the shift a of `indptr[s + a]`),
and the term is a segment sum by the row ids r (its gradient a read at them), as
`segments.py` lowers `where(seg[n] == s, ..)`. Rows outside every segment (r outside
[0, S)) add nothing and read zero.

The formula means the mask for any `indptr`, so the row-id form is the fast branch of an
`ir.Cond` on `indptr` being non-decreasing; the other branch is the dense term. Targets
without branches (PyTorch, JAX) keep the dense term: exact, at S x N memory, bounded by
tiling (README, "Memory").
"""

from __future__ import annotations

import sympy as sp

from .. import functions as fn
from .. import indexing, ir
from ..indexing import is_iota
from ..model import Index
from .common import _Body, in_range


class Intervals:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

    def interval_term(self, body: _Body, e: sp.Expr, summed, out, eyes):
        """A term with one CSR mask factor, as Cond(sorted, row-id form, dense form)."""
        if eyes:
            return None
        found = self._interval_mask(e)
        if found is None:
            return None
        mask, table, shift, s, n = found
        rest = mask.args[1] * sp.Mul(*[f for f in sp.Mul.make_args(e) if f is not mask])
        if s in out and n in summed:
            fast = self._by_row_ids(body, table, shift, s, n, "sum", rest, summed, out)
        elif s in summed and n in out:
            fast = self._by_row_ids(body, table, shift, s, n, "read", rest, summed, out)
        else:
            return None
        if fast is None:
            return None
        start = len(body.steps)
        dense, dense_axes = self.contract(body, e, summed, out, eyes)
        dense = _inline_steps_since(body, start, dense)  # computed only in its branch
        value, axes = fast
        common = tuple(i for i in out if i in set(axes) | set(dense_axes))
        fast_full = self.full(body, value, axes, common)
        dense_full = self.full(body, dense, dense_axes, common)
        return ir.Cond(self._non_decreasing(body, table), fast_full, dense_full), common

    def _interval_mask(self, e: sp.Expr):
        """(the mask factor, the index tensor t, a, s, n) for one factor
        `where(t[s + a] <= n < t[s + a + 1], value, 0)` of a product, t 1-D."""
        masks = [
            f
            for f in sp.Mul.make_args(e)
            if isinstance(f, fn.select) and f.args[2] == 0 and isinstance(f.args[0], sp.And)
        ]
        if len(masks) != 1 or len(masks[0].args[0].args) != 2:
            return None
        (mask,) = masks
        lower = upper = None
        for relation in mask.args[0].args:
            bound = _bound(relation)
            if bound is None:
                return None
            kind, limit, n = bound
            if kind == "lower":
                lower = (limit, n)
            else:
                upper = (limit, n)
        if lower is None or upper is None or lower[1] != upper[1]:
            return None
        (low, n), (high, _) = lower, upper
        if not all(isinstance(x, sp.Indexed) and len(x.indices) == 1 for x in (low, high)):
            return None
        name = low.base.label.name
        if name != high.base.label.name or name not in self.program.index_inputs:
            return None
        start = sp.expand(low.indices[0])
        if sp.expand(high.indices[0] - start) != 1:
            return None
        symbols = [x for x in start.free_symbols if indexing.is_plain(x)]
        if len(symbols) != 1 or start.atoms(sp.Indexed):
            return None
        (s,) = symbols
        shift = sp.expand(start - s)  # a number or int attrs (a chunk's tile_start)
        if shift.has(s) or s == n:
            return None
        return mask, name, shift, s, n

    def _row_ids(self, body: _Body, table: str, shift: sp.Expr, s: Index, n: Index):
        """r[n] (int64 over n) and whether it names a segment (0 <= r < |s|)."""
        sorted_ = ir.Call(
            "to_int64", (ir.Call("reshape", (ir.Var(table), ir.List((ir.Lit("-1"),)))),)
        )
        rows = ir.Call("range", (ir.Call("to_int64", (ir.Var(self.index_size(body, n)),)),))
        found = ir.Call("searchsorted", (sorted_, rows), (("side", ir.Lit('"right"')),))
        found = ir.Call("to_int64", (found,))  # TF's is int32
        row = ir.Var(body.bind(ir.Binary("-", found, ir.Lit("1"))))  # t[row] <= n < t[row + 1]
        flat = ir.Var(body.bind(ir.Binary("-", row, self.position(body, shift, ()))))
        size = ir.Call("to_int64", (ir.Var(self.index_size(body, s)),))
        length = ir.Call("to_int64", (ir.Var(self.axis_size(body, table, 0)),))
        inside = ir.Call(
            "logical_and",
            (
                ir.Binary(">=", row, ir.Lit("0")),
                ir.Binary("<", row, ir.Binary("-", length, ir.Lit("1"))),
            ),
        )
        return flat, ir.Var(body.bind(ir.Call("logical_and", (inside, in_range(flat, size)))))

    def _by_row_ids(self, body, table, shift, s, n, how, rest, summed, out):
        flat, valid = self._row_ids(body, table, shift, s, n)
        rows = ((n,), flat, valid)
        if how == "sum":
            return self._segment_sum(body, rest, None, s, summed, out, rows=rows)
        return self._read_at_ids(body, rest, None, s, summed, out, rows=rows)

    def _non_decreasing(self, body: _Body, table: str) -> ir.Expr:
        flat = ir.Var(body.bind(ir.Call("reshape", (ir.Var(table), ir.List((ir.Lit("-1"),))))))
        pairs = ir.List((ir.Binary("-", ir.Var(self.axis_size(body, table, 0)), ir.Lit("1")),))
        head = ir.Call("slice", (flat, ir.List((ir.Lit("0"),)), pairs))
        tail = ir.Call("slice", (flat, ir.List((ir.Lit("1"),)), pairs))
        return ir.Var(body.bind(ir.Call("reduce_all", (ir.Binary("<=", head, tail),))))


def _inline_steps_since(body: _Body, start: int, value: ir.Expr) -> ir.Expr:
    """`value` with the steps bound since `start` written into it: a `Cond` branch's
    steps run only when the branch is taken (a lambda holds one expression)."""
    steps = {step.target: step.value for step in body.steps[start:]}
    del body.steps[start:]
    for key in [k for k, name in body.memo.items() if name in steps]:
        del body.memo[key]
    for key in [k for k, name in body.tensors.items() if name in steps]:
        del body.tensors[key]

    def swap(e: ir.Expr) -> ir.Expr | None:
        if isinstance(e, ir.Var) and e.name in steps:
            return ir.rewrite(steps[e.name], swap)
        return None

    return ir.rewrite(value, swap)


def _bound(relation):
    """('lower', t, n) for `t <= n` / `n >= t`, ('upper', t, n) for `n < t` / `t > n`."""
    left, right = relation.args
    if not isinstance(relation, sp.Le | sp.Lt | sp.Ge | sp.Gt):
        return None
    if isinstance(relation, sp.Ge | sp.Gt):
        left, right = right, left
        strict = isinstance(relation, sp.Gt)
    else:
        strict = isinstance(relation, sp.Lt)
    if is_iota(right) and not strict:
        return "lower", left, right.indices[0]
    if is_iota(left) and strict:
        return "upper", right, left.indices[0]
    return None

"""Segments: a mask comparing an index tensor with an index, `where(seg[n] == v, .., 0)`.

Written densely, `y[v,f] = sum(where(seg[n] == v, x[n,f], 0), n)` is an N x V mask times
x: N·V·F work and an N x V x F tensor. It is a segment sum: each row n of the rest of the
term added at row seg[n] of the result (O(N·F)). Its gradient has the same mask with the
roles swapped, `Σ_v where(seg[n] == v, 1, 0) · grad_y[v,f]`: a read of grad_y at row
seg[n]. Ids outside [0, V) match no v: they add nothing and read zero.

Batched ids, `where(seg[b,n] == v, ..)` with `b` free (`y[b,v,f]`): the segments are the
(b, v) pairs, row `b·V + seg[b,n]` of a [B·V, ..] sum, reshaped to [B, V, ..]; the
gradient reads grad_y[b, v, f] at that row likewise.
"""

from __future__ import annotations

import sympy as sp

from .. import functions as fn
from .. import ir
from ..indexing import is_iota
from ..model import Index
from ..segment_forms import eq_form
from .common import _Body, _index_set, in_range


class Segments:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

    def segment_term(self, body: _Body, e: sp.Expr, summed, out, eyes):
        """A term with one `where(ids[n..] == v, value, 0)` factor as a segment sum (v free,
        n.. summed) or a read at the ids (v summed, n.. free); None for any other term."""
        if eyes:
            return None
        cell = self.cell_term(body, e, summed, out, eyes)  # several coordinates
        if cell is not None:
            return cell
        e = eq_form(e, self.segment_ids())  # `where(seg[n] != v, 0, ..)` as ==
        found = self._segment_mask(e)
        if found is None:
            return None
        mask, ids, v = found
        n = tuple(ids.indices)
        rest = mask.args[1] * sp.Mul(*[f for f in sp.Mul.make_args(e) if f is not mask])
        if v in n:
            return None
        found = None
        if v in summed:
            found = self._read_at_ids(body, rest, ids, v, summed, out)
        elif v in out and set(n) <= {*summed, *out}:
            found = self._segment_sum(body, rest, ids, v, summed, out)
        if found is None and (v in summed or v in out):
            # factors reading both v and the ids' indices (segment_extrema.py)
            found = self.mixed_segment_term(body, mask, rest, ids, v, summed, out)
        return found

    def _segment_mask(self, e: sp.Expr):
        """The one mask factor `where(ids[n..] == v, value, 0)` of a product: (the factor,
        the ids access, v), when the ids are an index tensor read at distinct plain
        indices."""
        masks = [
            f
            for f in sp.Mul.make_args(e)
            if isinstance(f, fn.select) and f.args[2] == 0 and isinstance(f.args[0], sp.Eq)
        ]
        if len(masks) != 1:
            return None
        (mask,) = masks
        left, right = mask.args[0].args
        if is_iota(left):
            left, right = right, left
        if not is_iota(right) or not isinstance(left, sp.Indexed):
            return None
        if left.base.label.name not in self.segment_ids():
            return None
        positions = tuple(left.indices)
        if not all(isinstance(p, sp.Symbol) for p in positions) or len(set(positions)) != len(
            positions
        ):
            return None
        return mask, left, right.indices[0]

    def _ids(
        self, body: _Body, ids: sp.Indexed, v: Index, batch: tuple[Index, ...] = ()
    ) -> tuple[ir.Expr, ir.Expr]:
        """The ids as a flat vector, and whether each lies in [0, |v|); with `batch`
        (indices of the ids that stay free), each id is `linear(batch)·|v| + id`: the
        row of its (batch.., v) segment."""
        raw = ir.Call("to_int64", (ir.Var(body.tensors[ids.base.label.name]),))
        size = self.position_int(ir.Var(self.index_size(body, v)))
        if batch:
            raw = ir.Var(body.bind(raw))
            n = tuple(ids.indices)
            offset: ir.Expr | None = None
            stride: ir.Expr = ir.Lit("1")
            for b in reversed(batch):
                count = ir.Call(
                    "to_int64", (ir.Call("range", (ir.Var(self.index_size(body, b)),)),)
                )
                term = self.align(body, ir.Binary("*", count, stride), (b,), n)
                offset = term if offset is None else ir.Binary("+", offset, term)
                stride = ir.Binary("*", stride, self.position_int(ir.Var(self.index_size(body, b))))
            valid = ir.Call("reshape", (in_range(raw, size), ir.List((ir.Lit("-1"),))))
            rows = ir.Binary("+", ir.Binary("*", offset, size), raw)
            flat = ir.Var(body.bind(ir.Call("reshape", (rows, ir.List((ir.Lit("-1"),))))))
            return flat, ir.Var(body.bind(valid))
        flat = ir.Var(body.bind(ir.Call("reshape", (raw, ir.List((ir.Lit("-1"),))))))
        return flat, ir.Var(body.bind(in_range(flat, size)))

    def _segment_sum(self, body, rest, ids, v, summed, out, rows=None):
        """Σ_n where(ids[n..] == v, 1, 0) · local(n, ..) · table(v, ..): the local factors
        added at row ids[n..], times the factors over v (which read no n). `rows`, when
        given, is (n.., flat ids, their validity) computed otherwise (intervals.py)."""
        n = tuple(ids.indices) if rows is None else rows[0]
        # ids axes that stay free: (b, v) segments (not with rows computed otherwise)
        batch = tuple(i for i in n if i in out) if rows is None else ()
        factors = sp.Mul.make_args(rest)
        table = sp.Mul(*[f for f in factors if v in _index_set(f)])
        local = sp.Mul(*[f for f in factors if v not in _index_set(f)])
        if not _index_set(table) <= {*out}:
            return None
        others = tuple(i for i in out if i != v and i not in n and i in _index_set(local))
        inner = tuple(i for i in summed if i not in n)
        value, axes = self.contract(body, local, inner, (*n, *others), ())
        data = self.full(body, value, axes, (*n, *others))
        # rows counted, not -1: PyTorch refuses -1 beside an empty axis (ambiguous)
        shape = ir.List(
            (self.size_product(body, n), *(ir.Var(self.index_size(body, i)) for i in others))
        )
        data = ir.Call("reshape", (data, shape))
        flat, valid = self._ids(body, ids, v, batch) if rows is None else rows[1:]
        dropped = ir.Var(body.bind(ir.Call("where", (valid, flat, ir.Lit("-1")))))
        total = ir.Call("segment_sum", (data, dropped, self.size_product(body, (*batch, v))))
        if batch:
            sizes = (*batch, v, *others)
            shape = ir.List(tuple(ir.Var(self.index_size(body, i)) for i in sizes))
            total = ir.Call("reshape", (total, shape))
        if table == 1:
            return total, (*batch, v, *others)
        name = body.bind(total)
        body.tensors[name] = name
        summed_at = sp.IndexedBase(name)[(*batch, v, *others)]
        return self.contract(body, table * summed_at, (), out, ())

    def _read_at_ids(self, body, rest, ids, v, summed, out, rows=None):
        """Σ_v where(ids[n..] == v, 1, 0) · table(v, ..) · local(n, ..): the table read at
        row ids[n..] (zero where the id is out of range), times the local factors."""
        n = tuple(ids.indices) if rows is None else rows[0]
        factors = sp.Mul.make_args(rest)
        table = [f for f in factors if v in _index_set(f)]
        local = [f for f in factors if v not in _index_set(f)]
        table_expr = sp.Mul(*table)
        batch = tuple(i for i in n if i in _index_set(table_expr))  # rows per (b, v)
        if batch and rows is not None:
            return None  # rows computed otherwise (intervals.py) are not per (b, v)
        if len(batch) == len(n):
            return None  # a table over every ids index: as large as the mask
        if any(set(summed) & _index_set(f) - {v, *batch} for f in table):
            return None  # the table would be summed over an index the local part has
        # A batch index summed (the gradient of values that lack it, `f[n,c]` under
        # `vox[r,n] == v`) is read at its rows like one kept, then summed with the rest.
        others = tuple(i for i in _index_set(table_expr) if i != v and i not in batch)
        others = tuple(sorted(dict.fromkeys(others), key=sp.default_sort_key))
        value, axes = self.contract(body, table_expr, (), (*batch, v, *others), ())
        table_rows = self.full(body, value, axes, (*batch, v, *others))
        if batch:
            rows_of = self.size_product(body, (*batch, v))
            sizes = ir.List((rows_of, *(ir.Var(self.index_size(body, i)) for i in others)))
            table_rows = ir.Call("reshape", (table_rows, sizes))
        # not bound: the rows (grad_y transposed, a copy in TF) are freed once read
        flat, valid = self._ids(body, ids, v, batch) if rows is None else rows[1:]
        at = ir.Var(body.bind(ir.Call("where", (valid, flat, ir.Lit("0")))))
        read = ir.Call("gather", (table_rows, at), (("axis", ir.Lit("0")),))
        body.uses_dtype = True
        zero = ir.Call("zeros", (ir.Lit("[]"),), (("dtype", ir.Var("dtype")),))
        row = Index("_segment_row")
        mask = self.align(body, valid, (row,), (row, *others))
        masked = ir.Var(body.bind(ir.Call("where", (mask, read, zero))))
        shape = ir.List(tuple(ir.Var(self.index_size(body, i)) for i in (*n, *others)))
        name = body.bind(ir.Call("reshape", (masked, shape)))
        body.tensors[name] = name
        read_at = sp.IndexedBase(name)[(*n, *others)]
        inner = tuple(i for i in summed if i != v)
        return self.contract(body, sp.Mul(*local) * read_at, inner, out, ())

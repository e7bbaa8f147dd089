"""Segment extrema: `y[v,f] = max(where(seg[n] == v, x[n,f], -inf), n)` without the mask.

Written densely, the max is over an [f, v, n] tensor: N·V·F work and memory. It is a
segment max (`unsorted_segment_max`: O(N·F)) of the rows x[n, :] at rows seg[n]; min with
+inf is a segment min; `log Σ_n exp(where(seg[n] == v, x[n,f], -inf))` is m + log of the
segment sum of exp(x - m[seg[n]]), m the segment max (taken as 0 where it is not finite).
An empty segment is -inf (+inf for min), as the dense form; ids outside [0, V) add nothing.

Their gradients read the results at the ids: the max's ties count is a segment sum of
[x[n,f] == y[seg[n],f]], and `Σ_v where(seg[n] == v, 1, 0) · g[f,v] · [x[n,f] == y[f,v]] /
count[f,v]` reads g, y and count at row seg[n] (three gathers, O(N·F)) — any product whose
factors mix v with the ids' indices, once the other selects on the same condition take
their `then` branch (the mask already zeroes the rest). Batched ids (`seg[b,n] == v`, b
free) use row `b·V + seg[b,n]`, as segment sums do (segments.py).
"""

from __future__ import annotations

from dataclasses import replace

import sympy as sp

from .. import functions as fn
from .. import ir
from ..model import Level
from ..segment_forms import segment_extremum, segment_ties
from .common import _Body, _index_set, align

_SEGMENT_TABLE = "_segment_table"  # a product of reads at segment level, gathered as one
_KERNELS = {"max": "segment_max", "min": "segment_min", "logsumexp": "segment_max"}


class SegmentExtrema:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

    def segment_level(self, body: _Body, level: Level) -> ir.Expr | None:
        """A segment max/min/logsumexp level, or the ties count of a segment max/min, by
        segment kernels; None for any other level."""
        cell = self.cell_level(body, level)  # a segment over several coordinates
        if cell is not None:
            return cell
        if level.kind == "sum":
            if len(level.terms) != 1:
                return None
            (term,) = level.terms
            masked = segment_ties(term.expr, self.segment_ids())
            if masked is None:
                return None
            return self.level(body, replace(level, terms=(replace(term, expr=masked),)))
        if len(level.terms) != 1:
            return None
        (term,) = level.terms
        found = segment_extremum(
            level.kind, level.indices, term.expr, term.summed, self.segment_ids()
        )
        if found is None:
            return None
        ids, v, value, batch = found
        n = tuple(ids.indices)
        others = tuple(i for i in level.indices if i != v and i not in batch)
        data, axes = self.contract(body, value, (), (*n, *others), ())
        data = self.full(body, data, axes, (*n, *others))
        rows = ir.List(
            (self.size_product(body, n), *(ir.Var(self.index_size(body, i)) for i in others))
        )
        data = ir.Var(body.bind(ir.Call("reshape", (data, rows))))
        flat, valid = self._ids(body, ids, v, batch)
        dropped = ir.Var(body.bind(ir.Call("where", (valid, flat, ir.Lit("-1")))))
        count: ir.Expr = ir.Var(self.index_size(body, v))
        for b in batch:
            count = ir.Binary("*", ir.Var(self.index_size(body, b)), count)
        result: ir.Expr = ir.Call(_KERNELS[level.kind], (data, dropped, count))
        if level.kind == "logsumexp":
            result = self._segment_logsumexp(body, result, data, flat, valid, dropped, count)
        if batch:
            sizes = (*batch, v, *others)
            shape = ir.List(tuple(ir.Var(self.index_size(body, i)) for i in sizes))
            result = ir.Call("reshape", (result, shape))
        return align(ir.Var(body.bind(result)), (*batch, v, *others), level.indices)

    def _segment_logsumexp(self, body, peak, data, flat, valid, dropped, count) -> ir.Expr:
        """m + log Σ exp(x - m[seg]), m the segment max (0 where not finite: an empty
        segment, or one of -inf only, is then log 0 = -inf)."""
        peak = ir.Var(body.bind(peak))
        finite = ir.Call("is_finite", (peak,))
        safe = ir.Var(body.bind(ir.Call("where", (finite, peak, ir.Call("zeros_like", (peak,))))))
        at = ir.Var(body.bind(ir.Call("where", (valid, flat, ir.Lit("0")))))
        read = ir.Call("gather", (safe, at), (("axis", ir.Lit("0")),))
        shifted = ir.Var(body.bind(ir.Call("exp", (ir.Binary("-", data, read),))))
        total = ir.Call("segment_sum", (shifted, dropped, count))
        return ir.Binary("+", ir.Call("log", (total,)), safe)

    def mixed_segment_term(self, body: _Body, mask, rest, ids, v, summed, out):
        """Σ over the ids' indices (v free) or over v (the ids' indices free) of a product
        with factors that read both v and the ids' indices (`[x[n,f] == m[f,v]]`): every
        tensor read at v is read at row ids[n..] instead; None if some read cannot be."""
        n = tuple(ids.indices)
        condition = mask.args[0]
        rest = rest.replace(
            lambda e: isinstance(e, fn.select) and e.args[0] == condition,
            lambda e: e.args[1],
        )
        reads = sorted(
            (a for a in rest.atoms(sp.Indexed) if v in a.free_symbols), key=sp.default_sort_key
        )
        if v in summed:
            batch = tuple(i for i in n if any(i in a.indices for a in reads))
        else:
            # rows per (b, v) for every ids index a read holds (`g[r,v,c]` under
            # `seg[r,n] == v` with r summed: the gradient of a weight read at v), added
            # over n by the segment sum's own ids (their free indices alone)
            batch = tuple(i for i in n if i in out or any(i in a.indices for a in reads))
        flat = valid = None
        mapping = {}
        rest, reads, tables = _segment_table(rest, reads, n, v, batch)
        for a in reads:
            labels = tuple(a.indices)
            if (
                not all(isinstance(i, sp.Symbol) for i in labels)
                or len(set(labels)) != len(labels)
                or set(labels) & set(n) != set(batch)
            ):
                return None
            if flat is None:
                flat, valid = self._ids(body, ids, v, batch)
            source = tables.get(a, a)
            mapping[a] = self._read_rows(body, a, source, ids, v, batch, flat, valid)
        if flat is None:
            return None
        rest = rest.xreplace(mapping)
        if v in _index_set(rest):
            return None  # v read otherwise (in a position, a comparison)
        if v not in summed:
            return self._segment_sum(body, rest, ids, v, summed, out)
        return self._masked_rows(body, rest, n, valid, summed, v, out)

    def _read_rows(self, body, a, source, ids, v, batch, flat, valid) -> sp.Indexed:
        """The read `a` (over v, batch.. and others) at row ids[n..] of its (batch.., v)
        rows: a tensor over (n.., others..); where an id is out of range, row 0 (the
        term is masked there)."""
        n = tuple(ids.indices)
        others = tuple(i for i in a.indices if i != v and i not in batch)
        value, axes = self.contract(body, source, (), (*batch, v, *others), ())
        table = self.full(body, value, axes, (*batch, v, *others))
        if batch:
            rows = self.size_product(body, (*batch, v))
            sizes = ir.List((rows, *(ir.Var(self.index_size(body, i)) for i in others)))
            table = ir.Call("reshape", (table, sizes))
        table = ir.Var(body.bind(table))
        at = ir.Var(body.bind(ir.Call("where", (valid, flat, ir.Lit("0")))))
        read = ir.Call("gather", (table, at), (("axis", ir.Lit("0")),))
        shape = ir.List(tuple(ir.Var(self.index_size(body, i)) for i in (*n, *others)))
        name = body.bind(ir.Call("reshape", (read, shape)))
        body.tensors[name] = name
        self.row_reads.add(name)  # written into its one use (row_reads.py)
        return sp.IndexedBase(name)[(*n, *others)]

    def _masked_rows(self, body, rest, n, valid, summed, v, out):
        """Σ_(summed but v) of `rest` (over n.. and others) where the id is in range,
        zero elsewhere."""
        keep = (*n, *sorted(_index_set(rest) - set(n), key=sp.default_sort_key))
        # A mask factor `[x[n,f] == y[seg[n],f]]` joins the range check in the `where`
        # rather than being cast and multiplied: one [n.., f] tensor less at once.
        masks = [f for f in sp.Mul.make_args(rest) if _mask_condition(f) is not None]
        rest = sp.Mul(*(f for f in sp.Mul.make_args(rest) if f not in masks))
        value, axes = self.contract(body, rest, (), keep, ())
        value = self.full(body, value, axes, keep)
        shape = ir.List(tuple(ir.Var(self.index_size(body, i)) for i in n))
        in_range = ir.Var(body.bind(ir.Call("reshape", (valid, shape))))
        condition = self.align(body, in_range, n, keep)
        for mask in masks:
            compared = self.condition(body, _mask_condition(mask), keep)
            condition = ir.Call("logical_and", (condition, compared))
        body.uses_dtype = True
        zero = ir.Call("zeros", (ir.Lit("[]"),), (("dtype", ir.Var("dtype")),))
        where = ir.Call("where", (condition, value, zero))
        name = body.bind(where)
        body.tensors[name] = name
        masked = sp.IndexedBase(name)[keep]
        inner = tuple(i for i in summed if i != v)
        return self.contract(body, masked, inner, out, ())


def _mask_condition(factor: sp.Expr) -> sp.Basic | None:
    """The condition of a 0/1 mask factor (`[x == m]`, `select(c, 1, 0)`), else None."""
    if isinstance(factor, fn.select) and factor.args[1] == 1 and factor.args[2] == 0:
        return factor.args[0]
    relation = {fn.step_ge: sp.Ge, fn.step_le: sp.Le, fn.step_eq: sp.Eq}.get(type(factor))
    return None if relation is None else relation(*factor.args, evaluate=False)


def _segment_table(rest, reads, n, v, batch):
    """`rest` with its factors that read only at segment level (over v, batch.. and
    indices no id has: `g[f,v] / count[f,v]`) multiplied into one table, so that one
    gather reads them at the rows (one [n.., f] tensor, not one per factor); the reads
    left to gather; and the table's read -> the product it stands for."""
    table_factors = [
        factor
        for factor in sp.Mul.make_args(rest)
        if factor.has(sp.Indexed)
        and v in factor.free_symbols
        and not (factor.free_symbols & set(n)) - set(batch)
        and all(v in a.indices for a in factor.atoms(sp.Indexed))
    ]
    if len(table_factors) < 2:
        return rest, reads, {}
    table = sp.Mul(*table_factors)
    indices = sorted(table.free_symbols & _index_set(table), key=sp.default_sort_key)
    read = sp.IndexedBase(_SEGMENT_TABLE)[tuple(indices)]
    rest = sp.Mul(*(f for f in sp.Mul.make_args(rest) if f not in table_factors)) * read
    reads = [a for a in reads if not any(a in f.atoms(sp.Indexed) for f in table_factors)]
    return rest, sorted([*reads, read], key=sp.default_sort_key), {read: table}

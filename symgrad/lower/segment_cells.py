"""Segments over several coordinates (`symgrad/segment_cells.py`): a term or level whose
mask is `vx[r,n] == i and vy[r,n] == j and vz[r,n] == k` lowered as a segment by one
id, the cell id (vx·J + vy)·K + vz, -1 wherever a coordinate lies outside [0, its
size). Tables read at (i, j, k) are read with those axes last and merged into one;
results over the composite index are reshaped back to (i, j, k)."""

from __future__ import annotations

from dataclasses import replace

from .. import ir
from ..model import Index, Level
from ..segment_cells import Cell, Flat, find, flat_term, flatten, merged, unflatten
from ..segment_forms import segment_ties
from .common import _Body, align, both, in_range


class SegmentCells:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

    def segment_ids(self) -> tuple[str, ...]:
        """The names segment lowerings take as ids: index inputs and cell ids."""
        return (*self.program.index_inputs, *self.cell_names)

    def cell_term(self, body: _Body, e, summed, out, eyes):
        """A term whose mask is a cell, as a segment term over the cell's key (its
        coordinates all free or all summed); None otherwise."""
        if eyes:
            return None
        flat, out2, summed2, _, cell = flat_term(e, out, summed, self.segment_ids(), self.size_of)
        if cell is None:
            return None
        self._bind_cell(body, cell, flatten(e, cell))
        found = self.segment_term(body, flat, summed2, out2, eyes)
        if found is None:
            return None
        value, axes = found
        if cell.key not in axes:
            return value, axes
        return self._unflatten(body, value, axes, cell)

    def cell_level(self, body: _Body, level: Level) -> ir.Expr | None:
        """A segment max/min/logsumexp (or a max's ties count) whose mask is a cell,
        over the level's indices; None for any other level."""
        if len(level.terms) != 1:
            return None
        (term,) = level.terms
        ids = self.segment_ids()
        cell = find(term.expr, ids, level.indices, self.size_of)
        if cell is None or not set(cell.at) <= set(level.indices):
            return None
        flat = flatten(term.expr, cell)
        if flat is None:
            return None
        if level.kind == "sum" and segment_ties(flat.expr, (*ids, cell.name)) is None:
            return None
        self._bind_cell(body, cell, flat)
        flat_level = replace(
            level, indices=merged(level.indices, cell), terms=(replace(term, expr=flat.expr),)
        )
        value = self.segment_level(body, flat_level)
        if value is None:
            return None
        value, axes = self._unflatten(body, value, flat_level.indices, cell)
        return align(ir.Var(body.bind(value)), axes, level.indices)

    def cell_size(self, body: _Body, key: Index) -> str:
        """The size of a cell's key: the product of its coordinates' sizes."""
        return body.bind(self.size_product(body, self.cell_keys[key]))

    def _bind_cell(self, body: _Body, cell: Cell, flat: Flat) -> None:
        """The cell ids (-1 where a coordinate is out of its range, or a composite
        equality's value out of the key's) and the reads at the cell's key, in
        `body.tensors`."""
        self.cell_keys[cell.key] = cell.at
        if cell.name not in self.cell_names:
            self.cell_names.append(cell.name)
        if cell.name not in body.tensors and cell.value is not None:
            # a composite equality's side with the ids (segment_cells.composite)
            n = tuple(cell.access.indices)
            raw = ir.Call("to_int64", (self.expr(body, cell.value, n),))
            raw = ir.Var(body.bind(raw))
            total = self.position_int(ir.Var(self.cell_size(body, cell.key)))
            ids = ir.Call("where", (in_range(raw, total), raw, ir.Lit("-1")))
            body.tensors[cell.name] = body.bind(ids)
        if cell.name not in body.tensors:
            valid = ids = None
            for access, index in zip(cell.ids, cell.at, strict=True):
                raw = ir.Call("to_int64", (ir.Var(body.tensors[access.base.label.name]),))
                raw = ir.Var(body.bind(raw))
                size = self.position_int(ir.Var(self.index_size(body, index)))
                valid = both(valid, in_range(raw, size))
                ids = raw if ids is None else ir.Binary("+", ir.Binary("*", ids, size), raw)
            name = body.bind(ir.Call("where", (valid, ids, ir.Lit("-1"))))
            body.tensors[cell.name] = name
        for name, base, labels in flat.reads:
            if name in body.tensors:
                continue
            key_at = merged(labels, cell)
            operand = align(ir.Var(body.tensors[base]), labels, unflatten(key_at, cell))
            shape = ir.List(tuple(ir.Var(self.index_size(body, i)) for i in key_at))
            body.tensors[name] = body.bind(ir.Call("reshape", (operand, shape)))

    def _unflatten(self, body: _Body, value: ir.Expr, axes, cell: Cell):
        """A value over `axes` (the cell's key among them) as one over the coordinates:
        the key split into (i, j, k) in its place (a reshape)."""
        axes = unflatten(axes, cell)
        sizes = tuple(ir.Var(self.index_size(body, i)) for i in axes)
        return ir.Call("reshape", (value, ir.List(sizes))), axes

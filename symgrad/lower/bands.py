"""Banded windows (`symgrad/bands.py`) lowered to the band kernels: `band_scores`,
`band_apply` and `band_scatter`, chunked matrix products over the rows of the window's
source (the targets' `_band_*` helpers). The window itself is never computed."""

from __future__ import annotations

import sympy as sp

from .. import bands as banded
from .. import ir
from ..model import Index
from .common import _Body, _is_simple, align, integer

# The label of the source's windowed axis, and of a unit axis standing for no column.
_ROWS = Index("_band_rows")
_ONE = Index("_band_one")


class Bands:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

    def band_term(self, body: _Body, e: sp.Expr, summed, out, eyes):
        """A product reading a banded window, as `band_scores` or `band_apply`; None for
        a term that reads none."""
        names = {a.base.label.name for a in e.atoms(sp.Indexed)} & set(self.bands)
        if not names:
            return None
        (name,) = names
        band, level = self.bands[name], self.levels[name]
        form = None if eyes else banded.read_form(e, summed, out, band, level, self.program)
        if form is None:  # `bands.bands` checked every read: lowering must agree
            raise AssertionError(f"{name}: a read of a banded window is no band form: {e}")
        offset = self.band_offset(body, band)
        columns = form.columns or (_ONE,)
        source = self.band_source(body, band, form.source_labels, form.centre, columns, form)
        if form.kind == "scores":
            rows = self.band_operand(body, form.other, (*form.batch, form.centre, *columns))
            count = self.band_count(body, band)
            operands = (rows, source, offset, count, *self.clamped(body, band))
            value = ir.Call("band_scores", operands, self.dilated(band))
            return self.scaled(body, value, form.coefficient), (
                *form.batch,
                form.centre,
                form.offset_index,
            )
        weights = self.band_operand(body, form.other, (*form.batch, form.centre, form.offset_index))
        clamped = self.clamped(body, band)
        value: ir.Expr = ir.Call(
            "band_apply", (weights, source, offset, *clamped), self.dilated(band)
        )
        if not form.columns:
            value = self.band_squeeze(body, value, len(form.batch) + 1)
        return self.scaled(body, value, form.coefficient), (*form.batch, form.centre, *form.columns)

    def band_offset(self, body: _Body, band) -> ir.Expr:
        value = integer(band.offset)
        return value if band.shift is None else self.band_size(body, band, "start", value)

    @staticmethod
    def band_size(body: _Body, band, what: str, value: ir.Expr) -> ir.Expr:
        """An integer of the band's plan, named as a size (`_n_g1_start`) unless it is a
        literal or a name: each body computes its own, a number where the sizes are (never
        a tensor another body saved)."""
        if _is_simple(value):
            return value
        name = f"_n_{band.level.strip('_')}_{what}"
        if not any(step.target == name for step in body.steps):
            body.bind(value, name=name)
        return ir.Var(name)

    def band_shift(self, body: _Body, band) -> ir.Expr:
        """Where each row's window starts in its band, shift(i) = s(i) - lo: an int vector
        over the rows (s over the formula's own symbols, lo the band's offset).

        lo is a size (a Python int, an int32 tensor where a size is known only when the
        graph runs, or in a chunk `2 * tile_start` of the loop's int32 start), and s(i) a
        position, int64 beside index tensors: lo is taken as a position too (TensorFlow
        adds no int32 to an int64)."""
        start = self.position(body, band.shift + band.offset, (band.centre,))
        offset = self.band_offset(body, band)
        if not isinstance(offset, ir.Lit):
            offset = self.position_int(offset)
        value = ir.Binary("-", ir.Var(body.bind(start)), offset)
        return ir.Var(body.bind(value))

    def band_count(self, body: _Body, band) -> ir.Expr:
        """The window's count of offsets; for a range with a max or min of sizes and attrs
        (NATTEN's `kernel_size`, at least 0), a size of the band's own."""
        extent = dict(self.program.extents).get(band.offset_index)
        if extent is None or not extent.has(sp.Max, sp.Min):
            return ir.Var(self.index_size(body, band.offset_index))
        return self.band_size(body, band, "count", integer(extent))

    def clamped(self, body: _Body, band) -> tuple[ir.Expr, ...]:
        """A clamped start's operands of the kernels: each row's shift, and their spread
        (none for a window that starts at i)."""
        if band.shift is None:
            return ()
        spread = self.band_size(body, band, "spread", integer(band.spread))
        return self.band_shift(body, band), spread

    @staticmethod
    def dilated(band) -> tuple[tuple[str, ir.Expr], ...]:
        """A dilated window's keyword of the kernels (none for a dilation of 1): an integer
        or int attrs, a Python int when the op is called."""
        if band.dilation == 1:
            return ()
        return (("dilation", integer(band.dilation)),)

    def band_source(self, body: _Body, band, labels, centre, columns, form) -> ir.Expr:
        """The window's source aligned to (batch, rows, columns)."""
        labels = tuple(_ROWS if n == band.axis else j for n, j in enumerate(labels))
        value = align(ir.Var(body.tensors[band.source]), labels, (*form.batch, _ROWS, *columns))
        return value if _is_simple(value) else ir.Var(body.bind(value))

    def band_operand(self, body: _Body, read: sp.Indexed, target) -> ir.Expr:
        value = align(self.access(body, read, tuple(read.indices)), tuple(read.indices), target)
        return value if _is_simple(value) else ir.Var(body.bind(value))

    @staticmethod
    def band_squeeze(body: _Body, value: ir.Expr, axis: int) -> ir.Expr:
        value = ir.Var(body.bind(value))
        return ir.Call("squeeze", (value,), (("axis", ir.Lit(str(axis))),))

    def band_gradient(self, body: _Body, name: str, indices: tuple[Index, ...]) -> ir.Expr:
        """The gradient of a banded window's source (axes `indices`): each contribution
        to the window's gradient, `Σ_H P · O`, added into the rows it read."""
        band, level = self.bands[name], self.levels[name]
        pieces = []
        for c in self.backward.contributions:
            if c.target != name:
                continue
            form = banded.scatter_form(c, band, level, self.program)
            if form is None:
                raise AssertionError(f"{name}: a gradient of a banded window is no band form")
            columns = form.columns or (_ONE,)
            rows = self.band_operand(body, form.rows, (*form.batch, form.centre, form.offset_index))
            values = self.band_operand(body, form.values, (*form.batch, form.centre, *columns))
            size = ir.Var(self.axis_size(body, band.source, band.axis))
            offset = self.band_offset(body, band)
            clamped = self.clamped(body, band)
            operands = (rows, values, offset, size, *clamped)
            value: ir.Expr = ir.Call("band_scatter", operands, self.dilated(band))
            kept = form.batch
            if c.summed:  # H: summed after the products
                value = ir.Var(body.bind(value))
                axes = ir.Lit(repr(list(range(len(c.summed)))))
                value = ir.Call("reduce_sum", (value,), (("axis", axes),))
                kept = form.batch[len(c.summed) :]
            if not form.columns:
                value = self.band_squeeze(body, value, len(kept) + 1)
            value = self.scaled(body, value, form.coefficient)
            # the window's labels -> the source gradient's, by the source's axes
            rename = {
                (_ROWS if n == band.axis else label): indices[n]
                for n, label in enumerate(form.source_labels)
            }
            axes = tuple(rename[j] for j in (*kept, _ROWS, *form.columns))
            pieces.append((value, axes))
        value, axes = self.sum_terms(body, pieces, indices)
        return self.full(body, value, axes, indices)

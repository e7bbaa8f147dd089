"""Reads at computed positions (`gather`, windows as slices) and their transposes
(`segment_sum`, sparse rows, pads), with zero outside the source.
"""

from __future__ import annotations

import sympy as sp

from .. import functions as fn
from .. import indexing, ir, splits
from ..derive import Scatter, grad_name
from ..model import Index, Level
from .common import (
    _Body,
    _is_simple,
    align,
    both,
    in_range,
)

# The highest rank at which TensorFlow's `tf.where` (SelectV2) runs: beside a rank-9
# gather (NATTEN's 3-D window) it raised "Broadcast ... is not supported yet", even
# between operands of one shape.
MAX_BROADCAST_RANK = 8


class Gathers:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

    def position(self, body: _Body, e: sp.Expr, axes: tuple[Index, ...]) -> ir.Expr:
        """An affine position (index values, index tensors, int attrs) over `axes`: int32,
        or int64 when index tensors take part."""
        return self.expr(body, indexing.index_values(e), axes)

    def gather_plan(self, body: _Body, level: Level, outside: str | None = None):
        """The positions of a gather: (flat position P over the inner indices, the mask of
        reads in bounds or None, the inner indices).

        `outside` (a literal): P already holds it where a read is out of bounds, and the
        mask keeps the shape its tests broadcast to when the gather's other axes follow
        the inner ones (a broadcast operand of `where` then reads it as it is): one
        `where` and one `broadcast_to` per read, not a `broadcast_to` of the positions, one
        of the mask and a `where` of both (a sampled read's 2^k corners each save one).
        `outside` may also be an expression: the row count of a sampled read's source
        (`outside_row`)."""
        gather = level.gather
        computed = gather.computed
        inner = gather.inner(level.indices)
        flat: ir.Expr | None = None
        valid: ir.Expr | None = None
        for axis, bounded in zip(computed, gather.bounded, strict=True):
            position, looked_up = self.collect_valid(
                body, lambda a=axis: self.position(body, gather.positions[a], inner), inner
            )
            if not _is_simple(position):
                position = ir.Var(body.bind(position))
            if looked_up is not None:  # a lookup outside its index tensor reads zero
                valid = both(valid, looked_up)
            # Each axis's test and each partial flat position is a step of its own: the
            # 2^k corners of a sampled read share them (a bilinear read's four corners
            # test two rows and two columns, not four of each), and so do its gradient's
            # scatters.
            if not bounded:
                size = self.position_int(ir.Var(self.axis_size(body, gather.source, axis)))
                inside = in_range(position, size)
                if valid is not None:
                    valid = ir.Var(body.bind(valid))
                inside = ir.Var(body.bind(inside))
                valid = both(valid, inside)
            if flat is None:
                flat = position
            else:
                size = self.position_int(ir.Var(self.axis_size(body, gather.source, axis)))
                if not _is_simple(flat):
                    flat = ir.Var(body.bind(flat))
                # The product is a step of its own, shared like the tests: a bilinear
                # read's two columns add to one row offset, not two.
                flat = ir.Binary("+", ir.Var(body.bind(ir.Binary("*", flat, size))), position)
        positions = [gather.positions[n] for n in computed]
        spans = (
            len(positions) == 1
            and isinstance(positions[0], sp.Indexed)
            and tuple(positions[0].indices) == inner
        )
        lean = (
            outside is not None
            and valid is not None
            and tuple(level.indices[: len(inner)]) == tuple(inner)
            and len(level.indices) <= MAX_BROADCAST_RANK
        )
        if lean:
            valid = ir.Var(body.bind(valid))
            flat = _filled(valid, flat, outside)
            if not spans:
                shape = ir.Shape(tuple((self.index_size(body, i),) for i in inner))
                flat = ir.Call("broadcast_to", (flat, shape))
            return flat, valid, inner  # unnamed: freed once read, like the gather's index
        if not spans:  # an index tensor read at exactly the inner indices has their shape
            shape = ir.Shape(tuple((self.index_size(body, i),) for i in inner))
            flat = ir.Var(body.bind(ir.Call("broadcast_to", (flat, shape))))
            if valid is not None:
                valid = ir.Var(body.bind(ir.Call("broadcast_to", (valid, shape))))
        elif valid is not None:
            valid = ir.Var(body.bind(valid))
        if outside is not None and valid is not None:
            flat = ir.Var(body.bind(_filled(valid, flat, outside)))
        return flat, valid, inner

    def rows(self, body: _Body, gather) -> tuple[str, ...]:
        """The sizes of the computed axes (their product is the number of rows read)."""
        return tuple(self.axis_size(body, gather.source, n) for n in gather.computed)

    def blocks(self, level: Level):
        """Non-overlapping windows: every computed axis read at `s*i + u` with u's range s
        (`x[b, 2*i+u, 2*j+v, c]` with u, v < 2), in bounds, and laid out as (.., i, u, ..).
        Such a gather is a slice and a reshape, its transpose a reshape and a pad: no index
        arithmetic, gather or scatter-add. Returns [(axis, i, u, s)] or None."""
        gather = level.gather
        found = []
        for axis, bounded in zip(gather.computed, gather.bounded, strict=True):
            position = sp.expand(gather.positions[axis])
            symbols = [x for x in position.free_symbols if indexing.is_plain(x)]
            if not bounded or len(symbols) != 2 or position.atoms(sp.Indexed):
                return None
            for i, u in (symbols, symbols[::-1]):
                stride = position.coeff(i)
                if (
                    stride.is_Integer
                    and stride > 1
                    and position.coeff(u) == 1
                    and position - stride * i - u == 0
                    and self.size_of.get(u) == stride
                ):
                    found.append((axis, i, u, int(stride)))
                    break
            else:
                return None
        inner = [x for _, i, u, _ in found for x in (i, u)]
        start = level.indices.index(inner[0]) if inner[0] in level.indices else -1
        if tuple(level.indices[start : start + len(inner)]) != tuple(inner):
            return None
        return found

    def gather(self, body: _Body, level: Level) -> ir.Expr:
        """`X` read at computed positions: one `tf.gather` (several computed axes are
        flattened into one first); reads out of bounds are zero."""
        blocks = self.blocks(level)
        if blocks is not None:
            return self.gather_blocks(body, level, blocks)
        if splits.reshape_grid(level):  # x[b, (h, r), t]: a reshape
            return splits.reshape_read(self, body, level)
        parts = self.separable(level)
        if parts is not None:  # one axis at a time (separable.py)
            return self.separable_gather(body, level, parts)
        gather = level.gather
        computed = gather.computed
        rank = self.program.rank(gather.source)
        plain = [n for n in range(rank) if n not in computed]
        looks_up = self.looks_up(gather)
        flat, valid, inner = self.gather_plan(body, level, None if looks_up else "0")
        source: ir.Expr = ir.Var(body.tensors[gather.source])
        if len(computed) == 1:
            axis = computed[0]
        elif computed == tuple(range(computed[0], computed[-1] + 1)):  # adjacent: merge
            axis = computed[0]
            dims = [(self.axis_size(body, gather.source, n),) for n in range(axis)]
            dims.append(self.rows(body, gather))
            dims += [
                (self.axis_size(body, gather.source, n),) for n in range(computed[-1] + 1, rank)
            ]
            source = ir.Call("reshape", (source, ir.Shape(tuple(dims))))
        else:
            order = (*computed, *plain)
            if order != tuple(range(rank)):
                source = ir.Call("transpose", (source, ir.Lit(repr(list(order)))))
            dims = [self.rows(body, gather)]
            dims += [(self.axis_size(body, gather.source, n),) for n in plain]
            source = ir.Call("reshape", (source, ir.Shape(tuple(dims))))
            axis = 0

        def read(index: ir.Expr) -> ir.Expr:
            return ir.Call("gather", (source, index), (("axis", ir.Lit(str(axis))),))

        if valid is None:
            return read(flat)
        if looks_up:
            if not _is_simple(source):  # read by both branches
                source = ir.Var(body.bind(source))
            # Positions from index tensors are nearly always in bounds: mask only when
            # some are not (the mask is a second pass over everything read).
            masked = self.zero_outside(
                body, read(self.clipped(flat, valid)), valid, inner, level.indices
            )
            return ir.Cond(self.all_in_bounds(body, valid), read(flat), masked)
        return self.zero_outside(body, read(flat), valid, inner, level.indices)

    @staticmethod
    def outside_row(level: Level) -> bool:
        """Whether a scatter sends the rows of reads outside the source to the id
        `dropped_id` and adds them with `segment_sum_in`: a sampled read's 2^k corners
        (bilinear, trilinear), whose positions fall outside at borders. PyTorch then adds
        every row into one row more than the result and cuts it off, with no bounds test of
        the ids (four ops a corner fewer); TensorFlow and JAX drop the id -1 as before."""
        gather = level.gather
        return any(gather.positions[n].has(fn.floor_index) for n in gather.computed)

    def past_the_end(self, body: _Body, level: Level) -> ir.Expr:
        """The id of a scatter's rows read outside the source (`outside_row`)."""
        return ir.Call("dropped_id", (self.row_count(body, level),))

    @staticmethod
    def looks_up(gather) -> bool:
        """Whether a gather reads at positions taken from index tensors."""
        return any(gather.positions[n].atoms(sp.Indexed) for n in gather.computed)

    @staticmethod
    def clipped(flat: ir.Expr, valid: ir.Expr) -> ir.Expr:
        """Positions with those out of bounds sent to 0 (TF's CPU gather raises on them)."""
        return ir.Call("where", (valid, flat, ir.Lit("0")))

    def all_in_bounds(self, body: _Body, valid: ir.Expr) -> ir.Expr:
        return ir.Var(body.bind(ir.Call("reduce_all", (valid,))))

    def zero_outside(self, body: _Body, value: ir.Expr, valid: ir.Expr, inner, indices):
        """`value` (axes `indices`) with zeros where its reads were out of bounds (`valid`,
        over `inner`, is false)."""
        body.uses_dtype = True
        zero = ir.Call("zeros", (ir.Lit("[]"),), (("dtype", ir.Var("dtype")),))
        mask = self.align(body, valid, inner, indices, beside_full=True)
        if len(indices) > MAX_BROADCAST_RANK:
            return ir.Call("select", (mask, value, ir.Call("zeros_like", (value,))))
        return ir.Call("where", (mask, value, zero))

    def reads_rows(self, scatter: Scatter) -> bool:
        """Whether a gather reads whole rows (computed positions on the first axis only,
        like `W[ids[b, t], d]`): its gradient can then be sparse, as TF's Gather's is."""
        if scatter.level in self.convolutions or scatter.level in self.bands:
            return False
        return self.levels[scatter.level].gather.computed == (0,)

    def sparse_rows(self, body: _Body, scatter: Scatter) -> ir.Expr:
        """The gradient of a row gather as `tf.IndexedSlices`: the rows read and their
        gradients, never a dense tensor the size of the table (rows read out of bounds
        carry zeros)."""
        level = self.levels[scatter.level]
        gather = level.gather
        flat, valid, inner = self.gather_plan(body, level)
        grad: ir.Expr = ir.Var(body.tensors[grad_name(level.name)])
        rank = self.program.rank(gather.source)
        if valid is not None:  # as in `gather`: mask only when some read is out of bounds
            inside = self.all_in_bounds(body, valid)
            masked = self.zero_outside(body, grad, valid, inner, level.indices)
            grad = ir.Var(body.bind(ir.Cond(inside, grad, masked)))
            flat = ir.Var(body.bind(self.clipped(flat, valid)))  # small: one cond is enough
        rows = [
            self.size_product(body, inner),
            *(ir.Var(self.axis_size(body, gather.source, n)) for n in range(1, rank)),
        ]
        values = ir.Call("reshape", (grad, ir.List(tuple(rows))))
        ids = ir.Call("reshape", (flat, ir.List((ir.Lit("-1"),))))
        shape = ir.Call("shape", (ir.Var(body.tensors[gather.source]),))
        return ir.Call("sparse_rows", (values, ids, shape))

    def gather_blocks(self, body: _Body, level: Level, blocks) -> ir.Expr:
        """x[:, :s*n_i, ..] reshaped to (.., n_i, s, ..)."""
        gather = level.gather
        rank = self.program.rank(gather.source)
        by_axis = {axis: (i, stride) for axis, i, _, stride in blocks}
        begin, size, shape = [], [], []
        for n in range(rank):
            begin.append(ir.Lit("0"))
            if n in by_axis:
                i, stride = by_axis[n]
                count = self.index_size(body, i)
                size.append(ir.Binary("*", ir.Lit(str(stride)), ir.Var(count)))
                shape += [(count,), (str(stride),)]
            else:
                size.append(ir.Lit("-1"))
                shape.append((self.axis_size(body, gather.source, n),))
        window = ir.Call(
            "slice",
            (ir.Var(body.tensors[gather.source]), ir.List(tuple(begin)), ir.List(tuple(size))),
        )
        return ir.Call("reshape", (window, ir.Shape(tuple(shape))))

    def scatter_blocks(self, body: _Body, level: Level, blocks) -> ir.Expr:
        """The transpose of `gather_blocks`: reshape back, pad with zeros to x's size."""
        gather = level.gather
        rank = self.program.rank(gather.source)
        by_axis = {axis: (i, stride) for axis, i, _, stride in blocks}
        shape, paddings = [], []
        for n in range(rank):
            size = self.axis_size(body, gather.source, n)
            if n in by_axis:
                i, stride = by_axis[n]
                count = self.index_size(body, i)
                shape.append((str(stride), count))
                used = ir.Binary("*", ir.Lit(str(stride)), ir.Var(count))
                paddings.append(ir.List((ir.Lit("0"), ir.Binary("-", ir.Var(size), used))))
            else:
                shape.append((size,))
                paddings.append(ir.List((ir.Lit("0"), ir.Lit("0"))))
        grad = ir.Var(body.tensors[grad_name(level.name)])
        window = ir.Var(body.bind(ir.Call("reshape", (grad, ir.Shape(tuple(shape))))))
        return ir.Call("pad", (window, ir.List(tuple(paddings))))

    def scatter(self, body: _Body, scatter: Scatter, indices: tuple[Index, ...]) -> ir.Expr:
        """The transpose of a gather: its gradient added back where it read (reads out of
        bounds add nothing), shaped like the source with axes `indices`."""
        if scatter.level in self.convolutions:
            return self.convolution_input_gradient(body, self.convolutions[scatter.level])
        if scatter.level in self.bands:
            return self.band_gradient(body, scatter.level, indices)
        level = self.levels[scatter.level]
        blocks = self.blocks(level)
        if blocks is not None:
            return self.scatter_blocks(body, level, blocks)
        if splits.reshape_grid(level):
            grad = ir.Var(body.tensors[grad_name(level.name)])
            return splits.reshape_back(self, body, level, grad)
        grad, ids = self.scatter_rows(body, level)
        total = ir.Var(
            body.bind(ir.Call(self.scatter_kernel(level), (grad, ids, self.row_count(body, level))))
        )
        return self.scatter_layout(body, level, total)

    def scatter_rows(self, body: _Body, level: Level) -> tuple[ir.Expr, ir.Expr]:
        """What a plain scatter adds, as (rows of the gradient, their flat positions in the
        source, -1 for reads out of bounds): the gradient over (*inner, *rest) indices,
        positions over the inner ones."""
        gather = level.gather
        # -1 (or one past the end, `outside_row`): dropped by the segment sum
        outside = self.past_the_end(body, level) if self.outside_row(level) else "-1"
        ids, _, inner = self.gather_plan(body, level, outside)
        if not _is_simple(ids):
            ids = ir.Var(body.bind(ids))
        self.rows(body, gather)
        grad = ir.Var(body.tensors[grad_name(level.name)])
        rest = tuple(i for i in level.indices if i not in inner)
        grad = align(grad, level.indices, (*inner, *rest))
        if not _is_simple(grad):
            grad = ir.Var(body.bind(grad))
        return grad, ids

    def scatter_kernel(self, level: Level) -> str:
        """The segment sum of a scatter's rows: `segment_sum_in` when its ids are all
        within the rows or one past them (`outside_row`), else `segment_sum`."""
        return "segment_sum_in" if self.outside_row(level) else "segment_sum"

    def row_count(self, body: _Body, level: Level) -> ir.Expr:
        """The number of rows a scatter adds into: the product of the computed axes."""
        rows = self.rows(body, level.gather)
        count: ir.Expr = ir.Var(rows[0])
        for row in rows[1:]:
            count = ir.Binary("*", count, ir.Var(row))
        return count

    def scatter_layout(self, body: _Body, level: Level, total: ir.Expr) -> ir.Expr:
        """The segment sum `total` of a scatter of `level` (the computed axes, flattened,
        first, then the plain ones in order) in the layout of its source."""
        gather = level.gather
        computed = gather.computed
        rank = self.program.rank(gather.source)
        plain = [n for n in range(rank) if n not in computed]
        if len(computed) == 1:
            order = (computed[0], *plain)
            value: ir.Expr = total
        else:
            dims = [(self.axis_size(body, gather.source, n),) for n in (*computed, *plain)]
            value = ir.Call("reshape", (total, ir.Shape(tuple(dims))))
            order = (*computed, *plain)
        if order != tuple(range(rank)):
            inverse = [order.index(n) for n in range(rank)]
            value = ir.Call("transpose", (value, ir.Lit(repr(inverse))))
        return value


def _filled(valid, flat, outside: str | ir.Expr) -> ir.Call:
    """The flat positions where the read is in bounds, `outside` elsewhere: a literal,
    or an expression (the one where-step of both layouts of a gather's positions)."""
    return ir.Call("where", (valid, flat, _outside(outside)))


def _outside(outside: str | ir.Expr) -> ir.Expr:
    """The position of a read outside its source: a literal, or an expression."""
    return outside if isinstance(outside, ir.Expr) else ir.Lit(outside)

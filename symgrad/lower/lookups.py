"""Index tensors read at computed positions (`idx[b, n, 0]`, `indptr[s + 1]`,
`tri[tid[p], v]`) and index clamps (`max(min(i - ns, L - K), 0)`), see symgrad/lookups.py.

A lookup is a gather of the flattened index tensor at its flat position, as int64. A
lookup outside its tensor is *invalid*: every read at a position that uses it reads zero
(adds nothing to gradients), and a condition that uses it is false (its `where` takes the
`otherwise` branch, `not` or no `not`). Validity travels in `self.lookup_valid`: each
lookup appends its mask (aligned to the axes it was asked for), and the read or the
condition that uses the position collects the masks it caused.
"""

from __future__ import annotations

import sympy as sp

from .. import indexing, ir
from ..model import Index
from .common import _Body, _is_simple, both, in_range


class Lookups:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

    lookup_valid: list[tuple[ir.Expr, tuple[Index, ...]]] | None = None

    def is_lookup(self, access: sp.Indexed) -> bool:
        """An index-tensor read that is no plain read of its axes (a computed position, a
        repeated index, or an index sized by `ranges` rather than by the axis)."""
        positions = tuple(access.indices)
        if len(set(positions)) != len(positions):
            return True
        extents = dict(self.program.extents)
        return any(not indexing.is_plain(p) or p in extents for p in positions)

    def collect_valid(self, body: _Body, run, target: tuple[Index, ...]):
        """`run()` with the validity of the lookups it lowers collected: (its value, the
        conjunction of their masks aligned to `target`, or None)."""
        outer, self.lookup_valid = self.lookup_valid, []
        try:
            value = run()
            masks = self.lookup_valid
        finally:
            self.lookup_valid = outer
        valid: ir.Expr | None = None
        for mask, axes in masks:
            aligned = self.align(body, mask, axes, target)
            valid = both(valid, aligned)
        return value, valid

    def lookup(self, body: _Body, access: sp.Indexed, target: tuple[Index, ...]) -> ir.Expr:
        """`ids[positions]` as int64 aligned to `target`; its validity is recorded."""
        name = access.base.label.name
        positions = tuple(access.indices)
        inner = indexing.read_indices(positions, tuple(range(len(positions))), target)
        flat: ir.Expr | None = None
        valid: ir.Expr | None = None
        for axis, position in enumerate(positions):
            where, nested = self.collect_valid(
                body, lambda p=position: self.position(body, p, inner), inner
            )
            if not _is_simple(where):
                where = ir.Var(body.bind(ir.Call("to_int64", (where,))))
            size = ir.Call("to_int64", (ir.Var(self.axis_size(body, name, axis)),))
            inside = in_range(where, size)
            if nested is not None:
                inside = ir.Call("logical_and", (inside, nested))
            valid = both(valid, inside)
            flat = where if flat is None else ir.Binary("+", ir.Binary("*", flat, size), where)
        shape = ir.Shape(tuple((self.index_size(body, i),) for i in inner))
        valid_var = ir.Var(body.bind(ir.Call("broadcast_to", (valid, shape))))
        at = ir.Call("where", (valid_var, flat, ir.Lit("0")))
        at = ir.Var(body.bind(ir.Call("broadcast_to", (at, shape))))
        table = ir.Call("reshape", (ir.Var(name), ir.List((ir.Lit("-1"),))))
        read = ir.Call("gather", (table, at), (("axis", ir.Lit("0")),))
        value = ir.Var(body.bind(ir.Call("to_int64", (read,))))
        if self.lookup_valid is not None:
            self.lookup_valid.append((valid_var, inner))
        return self.align(body, value, inner, target)

    def clamp(self, body: _Body, e: sp.Expr, target: tuple[Index, ...]) -> ir.Expr:
        """`Min`/`Max` of index expressions: `minimum`/`maximum` folded over the args."""
        function = "minimum" if isinstance(e, sp.Min) else "maximum"
        # numbers last: TF converts a Python int first argument to int32 before it sees
        # the int64 positions beside it (`tf.maximum(0, p)` refused p)
        args = sorted(e.args, key=lambda a: (a.is_Integer, sp.default_sort_key(a)))
        result = self.expr(body, args[0], target)
        for arg in args[1:]:
            result = ir.Call(function, (result, self.expr(body, arg, target)))
        return result

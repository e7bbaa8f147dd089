"""Gathers whose positions are separable, read one axis at a time.

A window read `x[b, c, 2*p + u, 2*q + v]` has, along each computed axis, a position that
depends on indices of its own (`2*p + u` on p and u only, `2*q + v` on q and v). Flattened
into one position over every window axis (`gather_plan`), the positions are int64 tensors
over [p, u, q, v], the same for every channel and as large as one channel's window in
float64: at 4 channels of 16 x 16 filtered_lrelu's chunks held its windows' positions
beside their windows. Read one axis at a time, the positions are [p, u] and [q, v]:
`gather(gather(x, rows, axis 2), columns, axis 4)`, the first read no larger than the
source times the rows' window.

The gradient stays one segment sum at the flattened positions (`Gathers.scatter`): summed
back one axis at a time, the first sum is the source times the other axes' windows (a
correlation's 7 x 7 displacements: 7 times the source), and PyTorch's steps took 1.3-1.8x
their time.

Only over the source's last axes (channels first, as filtered_lrelu's and upfirdn2d's
[B, C, H, W]): behind trailing plain axes (NATTEN's [B, heads, H, W, D], a correlation's
channels last) each flattened position reads a row of them, its int64 a small part of
the row, while reading the first axis first copies the source times its window (NATTEN's
7 x 7 at 24 x 24: 4 MB against positions of 226 KB; its PyTorch step took 1.17x its
time). Only affine positions without index tensors (a lookup's position depends on the
indices of the lookup, shared by every axis), each axis over its own indices, in the
order of the axes (the result is laid out as the flattened read's).
"""

from __future__ import annotations

import sympy as sp

from .. import indexing, ir
from ..model import Index, Level
from .common import _Body, _is_simple, both, in_range


class SeparableGathers:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

    def separable(self, level: Level) -> tuple[tuple[Index, ...], ...] | None:
        """The indices each computed axis reads at, when the gather reads one axis at a
        time (see the module's docstring); None otherwise."""
        gather = level.gather
        computed = gather.computed
        if len(computed) < 2 or computed != tuple(range(computed[0], len(gather.positions))):
            return None
        if any(gather.positions[n].atoms(sp.Indexed) for n in computed):
            return None
        inner = gather.inner(level.indices)
        parts = tuple(indexing.read_indices(gather.positions, (n,), inner) for n in computed)
        if any(not part for part in parts) or sum(parts, ()) != inner:
            return None
        plain = [gather.positions[n] for n in range(len(gather.positions)) if n not in computed]
        if not all(isinstance(p, sp.Symbol) for p in plain):
            return None
        if len(level.indices) != len(inner) + len(plain) or set(level.indices) != {
            *inner,
            *plain,
        }:
            return None
        return parts

    def axis_positions(self, body: _Body, level: Level, n: int, part):
        """The positions along computed axis `n` over its indices `part` (shaped like
        them), 0 where a read is out of bounds, and the mask of reads in bounds (None when
        every read is)."""
        gather = level.gather
        position = self.position(body, gather.positions[n], part)
        if not _is_simple(position):
            position = ir.Var(body.bind(position))
        valid = None
        if not gather.bounded[gather.computed.index(n)]:
            size = self.position_int(ir.Var(self.axis_size(body, gather.source, n)))
            valid = ir.Var(body.bind(in_range(position, size)))
            position = ir.Call("where", (valid, position, ir.Lit("0")))
        shape = ir.Shape(tuple((self.index_size(body, i),) for i in part))
        return ir.Var(body.bind(ir.Call("broadcast_to", (position, shape)))), valid

    def separable_gather(self, body: _Body, level: Level, parts) -> ir.Expr:
        """`X` read one computed axis at a time; reads out of bounds are zero."""
        gather = level.gather
        inner = sum(parts, ())
        value: ir.Expr = ir.Var(body.tensors[gather.source])
        axis = gather.computed[0]
        valid: ir.Expr | None = None
        # The first axis first: a chunk of the op's rows reads the source's rows it needs,
        # not every row at the columns it needs.
        for n, part in zip(gather.computed, parts, strict=True):
            position, inside = self.axis_positions(body, level, n, part)
            # Unnamed: each read but the last is freed once the next has read it.
            value = ir.Call("gather", (value, position), (("axis", ir.Lit(str(axis))),))
            axis += len(part)
            if inside is not None:
                inside = self.align(body, inside, part, inner)
                valid = both(valid, inside)
        if valid is None:
            return value
        return self.zero_outside(body, value, valid, inner, level.indices)

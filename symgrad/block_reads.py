"""Block reads: an input axis read at `h*K + k`, a block of K rows per value of h.

fairseq's DynamicconvLayer reads its weight_linear's rows as `wl[h*K + k, c]`, the
`view(T, B, H, K)` of its output, with `K = wl.shape[0] // H` and h over H, k over K. The
gather of such a read holds H * K rows, never more than the axis's `wl.shape[0]`: it is
no larger than the input it reads, like a plain read, and is no temporary a plan must
bound (`tile.big_sets`); else the gathered weights, which no output index runs along,
would leave no index to tile the op along.

A computed position is a block read when it is `E*h + k` (k's coefficient 1), k runs over
E, and h's extent times E is at most the axis's size because one of the two is the
axis's size floor-divided by the other (`K = S // H`, h over H; or h over `S // K`,
k over K). A read of a vector (`bl[h*K + k]`, its only axis) may fit the block in any
input's axis: it then has no more elements than that input. A composite read
`wl[(h, k), c]` known to stay inside its axis (sized from it) is a reshape of it: no
larger either, and so is one sized from elsewhere (padded with zeros to its members'
product) where that product fits as a block read's does.
"""

from __future__ import annotations

import sympy as sp

from . import splits
from .indexing import shape_symbol
from .lets import symbol as let_symbol
from .model import Index, Level, Program


def no_larger(level: Level, program: Program) -> bool:
    """Whether `level` is a gather of an input whose every computed position is a block
    read (or a composite one) and whose plain axes each hold one index, so that it has no
    more elements than the input."""
    gather = level.gather
    if level.kind != "gather" or gather is None or gather.source not in program.inputs:
        return False
    extents = dict(program.extents)
    lets = {let_symbol(name): value for name, value in program.lets}
    used: list[sp.Symbol] = []
    for axis, position in enumerate(gather.positions):
        if axis not in gather.computed:
            if not isinstance(position, sp.Symbol):
                return False
            used.append(position)
            continue
        if isinstance(position, splits.Composite):
            bounded = gather.bounded[gather.computed.index(axis)]
            size = shape_symbol(gather.source, axis)
            pair = _composite(position, bounded, size, extents, lets)
            if pair is None:
                return False
            used += pair
            continue
        # a read of the whole source is no larger than any axis its block fits in
        sizes = [shape_symbol(gather.source, axis)]
        if len(gather.positions) == 1:
            sizes += [shape_symbol(x, a) for x in program.inputs for a in range(program.rank(x))]
        pair = next(
            (p for z in sizes if (p := _block(position, set(level.indices), z, extents, lets))),
            None,
        )
        if pair is None:
            return False
        used += pair
    return len(used) == len(set(used)) and set(used) == set(level.indices)


def _composite(position: sp.Expr, bounded: bool, size, extents: dict, lets: dict):
    """The members of a composite read `(h, k)` that stays inside its axis of `size`:
    sized from it (`bounded`), or h's extent times k's at most `size` as for a block read
    (one sized from elsewhere is padded with zeros to their product, which may outgrow
    the axis: `splits.reshape_grid`); else None."""
    members = position.args
    if not all(isinstance(m, sp.Symbol) for m in members) or len(set(members)) != len(members):
        return None
    if bounded:
        return members
    if len(members) != 2:
        return None
    h, k = members
    inner = extents.get(k)
    if not (isinstance(inner, sp.Max) and len(inner.args) == 2 and 0 in inner.args):
        return None
    (factor,) = (a for a in inner.args if a != 0)
    return members if _fits(extents.get(h), inner, factor, size, lets) else None


def _block(position: sp.Expr, grid: set[Index], size: sp.Symbol, extents: dict, lets: dict):
    """(h, k) when `position` is a block read of an axis of `size` by two of the
    indices `grid`, else None."""
    indices = [s for s in position.free_symbols if s in grid]
    if len(indices) != 2:
        return None
    for h, k in (indices, indices[::-1]):
        scale = sp.expand(position - k)
        if sp.expand(scale - scale.coeff(h) * h) != 0:
            continue
        factor = scale.coeff(h)
        if factor.free_symbols & set(indices):
            continue
        if _fits(extents.get(h), extents.get(k), factor, size, lets):
            return h, k
    return None


def _fits(outer, inner, factor: sp.Expr, size: sp.Symbol, lets: dict) -> bool:
    """Whether k's extent `inner` is `factor` (as `Max(0, factor)`) and the extents'
    product is at most `size`: one of the two is `size` floor-divided by the other."""
    if outer is None or inner is None or sp.simplify(inner - sp.Max(0, factor)) != 0:
        return False
    a, b = _value(outer, lets), _value(inner, lets)
    if a is None or b is None:
        return False
    return sp.simplify(a - sp.floor(size / b)) == 0 or sp.simplify(b - sp.floor(size / a)) == 0


def _value(extent: sp.Expr, lets: dict) -> sp.Expr | None:
    """The positive integer an extent `Max(0, v)` clamps, a let replaced by its value."""
    if not (isinstance(extent, sp.Max) and len(extent.args) == 2 and 0 in extent.args):
        return None
    (value,) = (a for a in extent.args if a != 0)
    return lets.get(value, value)

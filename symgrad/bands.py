"""Banded windows: a 1-D sliding window `S[.., i + u + o, ..]` multiplied with one other
tensor, computed as matrix products of chunks of rows i against the rows of S they read,
never as the gathered window.

Local attention's scores `Σ_d q[b,i,h,d] · k[b, i + u - w, h, d]` gather a window of k
that is `U = 2w + 1` times the size of k. Tiled, each chunk still gathers its slice of the
window and scatters it back: at n = 1024, w = 256 (12 heads of 64, one thread) a training
step took 5 s in PyTorch and 3.4 s in TF, where one matrix product per chunk of rows takes
0.09 s. A chunk of `c` rows i (c >= U - 1) reads the rows
`[c·m + o, c·m + c + U - 1 + o)` of S; the product of the chunk with that slab holds
every value the chunk needs, on the band `column = row + u` (Longformer's
`sliding_chunks` matmul does the same by hand).

Three forms read such a window `G[.., i, u, ..]` (i its centre, u its offset):
- scores: `Σ_C G · O` with O over (batch, i, C) and no u; the result over (batch, i, u)
  (attention's `q · kᵀ`);
- apply: `Σ_u G · P` with P over (batch, i, u); the result over (batch, i, cols), cols the
  axes of S that P lacks (attention's `p · v`);
- scatter: the window's gradient, a product `P · O` of one tensor over (batch, i, u) and
  one over (batch, i, cols), added back into the rows of S it read (the transpose).
The gradient of each form is another form: the window is *banded* when every read of it,
in the op's formulas and in the contributions of its gradient, is one of them. It is
then never computed, and tiling counts no temporary for it (`tile.big_sets`): the
forms hold about twice their own inputs and outputs (`Bands` in lower/bands.py).
At most one axis of C or of cols: several would need a reshape of S (not done; such a
window stays a gather).

A window may start at a clamped position: NATTEN's `S[max(min(i - K // 2, L - K), 0) + u]`
(a window kept inside the sequence). Its start differs from i by a shift `s(i)` that
interval arithmetic bounds by `lo <= s(i) <= hi` over `0 <= i < n` (`_interval`, after
moving `- i` into the max and min); the kernels then read the wider band
`S[i + lo + v]`, `v < count + hi - lo`, and each row's window is its part at
`v = s(i) - lo + u`: the kernels take each row's shift `s(i) - lo` and the spread
`hi - lo`, and per group of chunks cut each row's window out of the products (scores) or
place each row's weights in its band (apply, scatter). The bound is sound for every size,
so every row's window lies inside the band it reads.

A window may be dilated: `S[.., i + d·u + o, ..]` with d an integer or a product of int
attrs (Longformer's dilation when every head shares it), a Python int when the op is
called, of any sign. The kernels read it as |d| plain windows, one per residue ρ of the
rows mod |d| (a dilated convolution's space-to-batch): rows `i = j·|d| + ρ` read the
source's rows `ρ + o + |d|·(j + u)`, the offsets reversed for d < 0; at d = 0 every offset
reads row `i + o`. A dilation over a let or a size (a tensor in a TensorFlow graph), or
beside a clamped start, stays a gather.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import sympy as sp

from . import indexing, patterns
from .derive import Backward, derive
from .model import Index, Level, Program

# The int attr a chunk's formulas add to the tiled index (tile.py): a tensor in TensorFlow's
# loop and traced in JAX's, so no band's width (a clamped start's spread) may depend on it.
TILE_START = "tile_start"


@dataclass(frozen=True)
class Band:
    """A gather level read at `centre + offset_index + offset` on one axis of its source."""

    level: str
    source: str
    axis: int  # the source's axis read at the computed position
    centre: Index  # i, the level's index along which rows are chunked
    offset_index: Index  # u, the window's offset
    offset: sp.Expr  # o: integer, over attrs, lets and sizes
    # a clamped start: row i reads centre + shift(i) + offset_index + offset, with
    # 0 <= shift(i) <= spread (None: no shift, spread 0)
    shift: sp.Expr | None = None
    spread: sp.Expr = sp.S.Zero
    # a dilated window: row i reads centre + dilation * offset_index + offset (an integer
    # literal or int attrs: a Python int at run time, of any sign; never with a shift)
    dilation: sp.Expr = sp.S.One


@dataclass(frozen=True)
class Form:
    """One read of a band in a product of two tensors (labels as written in the term)."""

    kind: str  # "scores" or "apply"
    band: Band
    window: sp.Indexed  # the read of the band
    other: sp.Indexed  # O (scores) or P (apply)
    centre: Index
    offset_index: Index
    batch: tuple[Index, ...]  # the result's other axes, in the result's order
    columns: tuple[Index, ...]  # C summed (scores), or cols of S kept (apply): 0 or 1
    # the label of the window's read at each axis of the source (the band axis: centre)
    source_labels: tuple[Index, ...]
    coefficient: sp.Expr  # a scalar factor (numbers, attrs)


@dataclass(frozen=True)
class ScatterForm:
    """A contribution `P · O` to the gradient of a band (labels of its own indices)."""

    band: Band
    rows: sp.Indexed  # P, over (batch, i, u)
    values: sp.Indexed  # O, over (batch, i, cols)
    centre: Index
    offset_index: Index
    batch: tuple[Index, ...]  # the summed axes H first, then the window's own
    columns: tuple[Index, ...]
    source_labels: tuple[Index, ...]
    coefficient: sp.Expr


def _windows(program: Program) -> list[tuple[Level, int, tuple[Index, Index], sp.Expr]]:
    """Gathers of an input at a position over two of the level's indices read nowhere else
    in the position, every other axis read plainly by one index of its own: (level, axis,
    the pair, the position). `_band` tells which of the pair is the centre."""
    kernels = patterns.convolutions(program)
    found = []
    for level in program.intermediates:
        gather = level.gather
        if level.kind != "gather" or gather is None or level.name in kernels:
            continue
        if gather.source not in program.inputs or gather.source in program.index_inputs:
            continue
        if len(gather.computed) != 1:
            continue
        (axis,) = gather.computed
        position = sp.expand(gather.positions[axis])
        if position.atoms(sp.Indexed):
            continue
        plain = [p for n, p in enumerate(gather.positions) if n != axis]
        if not all(isinstance(p, sp.Symbol) and p in level.indices for p in plain):
            continue
        pair = [i for i in level.indices if i in position.free_symbols]
        if len(pair) != 2 or len(set(plain)) != len(plain) or set(pair) & set(plain):
            continue
        if set(level.indices) != {*plain, *pair}:
            continue
        found.append((level, axis, (pair[0], pair[1]), position))
    return found


def _band(
    level: Level, axis: int, centre: Index, offset_index: Index, position: sp.Expr, program
) -> Band | None:
    """The band of a window read at `position`: `centre + d·offset_index + o` (d a
    dilation: an integer or int attrs), or, for a clamped start, `centre + s(centre) +
    offset_index` with s bounded (`_interval`); None for any other position (a dilation
    over lets or sizes, a start that is no max or min of sums)."""
    # polynomial in the indices: an offset may hold a floor or a remainder of attrs
    # (`i + u - K // 2`, `K % 2`)
    plain = position.is_polynomial(*level.indices)
    dilation = sp.expand(position).coeff(offset_index) if plain else sp.S.One
    rest = sp.expand(position - dilation * offset_index)
    if offset_index in rest.free_symbols or not _dilation(dilation, program):
        return None
    shift = _moved_in(rest - centre)
    if not shift.free_symbols & set(level.indices):
        if not plain:
            return None
        source = level.gather.source
        return Band(level.name, source, axis, centre, offset_index, shift, dilation=dilation)
    if dilation != 1:
        return None
    if shift.free_symbols & set(level.indices) != {centre}:
        return None
    n = _size(program, centre)
    bounds = None if n is None else _interval(shift, centre, n)
    if bounds is None:
        return None
    lo, hi = bounds
    spread = sp.Max(hi - lo, 0)
    length = indexing.shape_symbol(level.gather.source, axis)
    if _grows(spread, n, length, program) or _in_a_loop(spread):
        return None
    return Band(level.name, level.gather.source, axis, centre, offset_index, lo, shift - lo, spread)


def _dilation(d: sp.Expr, program: Program) -> bool:
    """Whether a window's dilation is a nonzero integer literal or a product of int attrs
    (or their powers) and an integer (a Python int when the op is called, in every target;
    the kernels take any sign). A let or a size stays a gather: it may be a tensor in a
    TensorFlow graph."""
    if d == 0 or not d.is_polynomial():
        return False
    attrs = {
        sp.Symbol(f"_int_{name}", integer=True) for name, kind in program.attrs if kind == "int"
    }
    number, rest = d.as_coeff_Mul()
    factors = {
        f.base if f.is_Pow and f.exp.is_Integer and f.exp > 0 else f for f in sp.Mul.make_args(rest)
    }
    return number.is_Integer and factors - {sp.S.One} <= attrs


def _size(program: Program, index: Index) -> sp.Expr | None:
    """The size of an index as an integer expression (an input's axis, or an extent)."""
    for i, places in program.dims:
        if i == index and places:
            return indexing.shape_symbol(*places[0])
    return dict(program.extents).get(index)


def _grows(spread: sp.Expr, n: sp.Expr, length: sp.Expr, program: Program) -> bool:
    """Whether the band's spread may grow with the number of rows n when the source is as
    long (a start clamped at a constant, or at another tensor's size): its band would be
    as wide as the source, a product over all pairs of rows, so the window stays a
    gather. Tried at two large n, every other size and attr a small number of its own
    (the lets in terms of them). A source of another length than the rows widens the
    band by the difference (NATTEN's kernels refuse such inputs)."""
    for name, value in reversed(program.lets):
        spread = spread.subs(sp.Symbol(f"_int_{name}", integer=True), value)
    others = sorted(spread.free_symbols - {n, length}, key=sp.default_sort_key)
    fixed = {x: 5 + 2 * k for k, x in enumerate(others)}
    values = [spread.subs(fixed).subs({n: rows, length: rows}) for rows in (10**6, 2 * 10**6)]
    return not all(v.is_Integer for v in values) or values[0] != values[1]


def _in_a_loop(spread: sp.Expr) -> bool:
    """Whether a clamped start's spread depends on a chunk's start (`TILE_START`): a chunk
    of rows i is centred at `i + tile_start` inside the clamp (an op tiled along i for
    another temporary, NATTEN's `exp(q·k) · v` in one formula), and its band's width would
    be a tensor in the loop. That window stays a gather in the chunk (the plan, made on
    the op, counts it as banded: it may hold more than the plan says)."""
    prefix = f"_int_{TILE_START}"
    return any(x.name.startswith(prefix) for x in spread.free_symbols)


def _moved_in(e: sp.Expr) -> sp.Expr:
    """`max(a, b) + c` -> `max(a + c, b + c)` (and min, nested): the terms outside a max or
    min moved into it, so that an index outside and inside cancel (`max(min(i - k, m),
    0) - i` -> `max(min(-k, m - i), -i)`) before `_interval` bounds it."""
    e = sp.expand(e)
    if isinstance(e, sp.Max | sp.Min):
        return e.func(*(_moved_in(a) for a in e.args), evaluate=False)
    if not isinstance(e, sp.Add):
        return e
    clamps = [a for a in e.args if isinstance(a, sp.Max | sp.Min)]
    if len(clamps) != 1:
        return e
    (clamp,) = clamps
    others = e - clamp
    return clamp.func(*(_moved_in(a + others) for a in clamp.args), evaluate=False)


def _interval(e: sp.Expr, index: Index, n: sp.Expr) -> tuple[sp.Expr, sp.Expr] | None:
    """Bounds (lo, hi) of e over `0 <= index < n`, the other symbols fixed: interval
    arithmetic over sums, products by numbers, max and min (sound, perhaps wider than
    the exact range); None for anything else."""
    if index not in e.free_symbols:
        return e, e
    if e == index:
        return sp.Integer(0), n - 1
    if isinstance(e, sp.Add | sp.Max | sp.Min):
        parts = [_interval(a, index, n) for a in e.args]
        if any(p is None for p in parts):
            return None
        lows, highs = [p[0] for p in parts], [p[1] for p in parts]
        if isinstance(e, sp.Add):
            return sp.Add(*lows), sp.Add(*highs)
        return e.func(*lows), e.func(*highs)
    if isinstance(e, sp.Mul):
        number, rest = e.as_coeff_Mul()
        if not number.is_Integer or number in (0, 1):  # 1: a product with a symbol
            return None
        part = _interval(rest, index, n)
        if part is None:
            return None
        lo, hi = part
        return (number * lo, number * hi) if number > 0 else (number * hi, number * lo)
    return None


def _labels(band: Band, level: Level, read) -> dict[Index, Index]:
    """The level's indices -> the labels of a read of it (`read`: an access or labels)."""
    labels = tuple(read.indices) if isinstance(read, sp.Indexed) else tuple(read)
    return dict(zip(level.indices, labels, strict=True))


def _source_labels(band: Band, level: Level, mapping: dict[Index, Index], program: Program):
    gather = level.gather
    return tuple(
        mapping[band.centre] if n == band.axis else mapping[p]
        for n, p in enumerate(gather.positions)
    )


def _product(e: sp.Expr, indices) -> tuple[list[sp.Indexed], sp.Expr] | None:
    """e as two reads times a scalar coefficient free of `indices` (attention's
    1/sqrt(d)); None for any other product."""
    factors = sp.Mul.make_args(e)
    reads = [f for f in factors if isinstance(f, sp.Indexed)]
    coefficient = sp.Mul(*(f for f in factors if not isinstance(f, sp.Indexed)))
    if len(reads) != 2 or coefficient.atoms(sp.Indexed):
        return None
    labels = {*indices, *(i for r in reads for i in r.indices)}
    if coefficient.free_symbols & labels:
        return None
    return reads, coefficient


def read_form(
    e: sp.Expr,
    summed: tuple[Index, ...],
    out: tuple[Index, ...],
    band: Band,
    level: Level,
    program: Program,
) -> Form | None:
    """The form of `Σ_summed e` into `out` when it is a product of a read of the band and
    one other plain read (times a scalar), as `scores` or `apply`; else None."""
    product = _product(e, (*summed, *out))
    if product is None:
        return None
    factors, coefficient = product
    windows = [f for f in factors if f.base.label.name == band.level]
    if len(windows) != 1:
        return None
    (window,) = windows
    (other,) = [f for f in factors if f is not window]
    if other.base.label.name == band.level:
        return None
    if len(set(window.indices)) != len(window.indices):
        return None
    if len(set(other.indices)) != len(other.indices):
        return None
    if not all(isinstance(i, sp.Symbol) for i in (*window.indices, *other.indices)):
        return None
    mapping = _labels(band, level, window)
    i, u = mapping[band.centre], mapping[band.offset_index]
    rest = tuple(mapping[p] for p in level.indices if p not in (band.centre, band.offset_index))
    mine, theirs = set(rest), set(other.indices)
    if len(set(summed)) != len(summed) or len(set(out)) != len(out):
        return None
    source_labels = _source_labels(band, level, mapping, program)
    if u not in theirs:  # scores: Σ_C G[.., i, u, ..] · O[.., i, ..]
        columns = tuple(summed)
        batch = tuple(j for j in out if j not in (i, u) and j in mine | theirs)
        if i not in theirs or i not in out or u not in out or len(columns) > 1:
            return None
        if not set(columns) <= mine & theirs:
            return None
        if not (mine | theirs) - {i} <= {*batch, *columns}:
            return None
        return Form("scores", band, window, other, i, u, batch, columns, source_labels, coefficient)
    # apply: Σ_u G[.., i, u, ..] · P[.., i, u]
    if tuple(summed) != (u,) or i not in theirs or i not in out:
        return None
    columns = tuple(j for j in rest if j not in theirs)
    batch = tuple(j for j in out if j != i and j not in columns and j in mine | theirs)
    if len(columns) > 1 or set(out) != (mine | theirs) - {u}:
        return None
    return Form("apply", band, window, other, i, u, batch, columns, source_labels, coefficient)


def scatter_form(c, band: Band, level: Level, program: Program) -> ScatterForm | None:
    """The form of a contribution to the band's gradient: `Σ_H P · O`, H (perhaps none)
    axes of both, summed after the products (multi-query attention's heads)."""
    if c.diagonal:
        return None
    product = _product(c.grad * c.partial, (*c.indices, *c.summed))
    if product is None:
        return None
    factors, coefficient = product
    if any(len(set(f.indices)) != len(f.indices) for f in factors):
        return None
    mapping = _labels(band, level, c.indices)
    i, u = mapping[band.centre], mapping[band.offset_index]
    with_u = [f for f in factors if u in f.indices]
    if len(with_u) != 1:
        return None
    (rows,) = with_u
    (values,) = [f for f in factors if f is not rows]
    if i not in rows.indices or i not in values.indices:
        return None
    summed = set(c.summed)
    if not summed <= set(rows.indices) & set(values.indices) or summed & {i, u}:
        return None
    own = set(c.indices) - {i, u}
    columns = tuple(j for j in values.indices if j not in rows.indices and j != i)
    batch = (*c.summed, *(j for j in c.indices if j in own and j not in columns))
    present = set(rows.indices) | set(values.indices)
    if len(columns) > 1 or not own <= present or not present <= set(c.indices) | summed:
        return None
    source_labels = _source_labels(band, level, mapping, program)
    return ScatterForm(band, rows, values, i, u, batch, columns, source_labels, coefficient)


@functools.cache
def bands(program: Program) -> dict[str, Band]:
    """The banded windows of a program: every read of them, forward and backward, is a
    form (with one choice of centre for all)."""
    windows = _windows(program)
    if not windows:
        return {}
    backward = derive(program)
    found = {}
    for level, axis, (a, b), position in windows:
        for centre, offset_index in ((a, b), (b, a)):
            band = _band(level, axis, centre, offset_index, position, program)
            if band is not None and _all_forms(program, backward, band, level):
                found[level.name] = band
                break
    return found


def _all_forms(program: Program, backward: Backward, band: Band, level: Level) -> bool:
    """Whether every read of the band is a form, and its gradient goes only to its source
    as scatter forms."""
    name = band.level
    # a product of two windows: the other is no operand a band kernel reads
    others = {lv.name for lv, *_ in _windows(program)} - {name}
    levels = [*program.intermediates, *(o.level for o in program.outputs)]
    for other in levels:
        if other.gather is not None and other.gather.source == name:
            return False
        for term in other.terms:
            reads = {a.base.label.name for a in term.expr.atoms(sp.Indexed)}
            if name not in reads:
                continue
            if other.kind != "sum" or reads & others:
                return False
            if read_form(term.expr, term.summed, other.indices, band, level, program) is None:
                return False
    pointwise: dict[str, int] = {}
    for c in backward.contributions:
        if not c.summed and not c.diagonal:
            pointwise[c.target] = pointwise.get(c.target, 0) + 1
    for c in backward.contributions:
        reads = {a.base.label.name for a in (c.grad * c.partial).atoms(sp.Indexed)}
        if c.target == name:
            if reads & others or scatter_form(c, band, level, program) is None:
                return False
            continue
        if name not in reads:
            continue
        if reads & others or c.diagonal or (not c.summed and pointwise[c.target] > 1):
            return False  # merged with other terms (`Lowerer.gradient`): no product
        if read_form(c.grad * c.partial, c.summed, c.indices, band, level, program) is None:
            return False
    scatters = [s for s in backward.scatters if s.level == name]
    return len(scatters) == 1 and scatters[0].target == band.source

"""A segment given as several coordinates: `where(vx[r,n] == i and vy[r,n] == j and
vz[r,n] == k, ..)` (mmcv's roiaware_pool3d, a voxel per point and roi).

Written densely the conjunction is a mask over [r, n, i, j, k]. It is one segment over
the composite index (i, j, k): the cell id `(vx·J + vy)·K + vz`, taken row-major as a
composite output index is (README, "Composite output indices"). A flat id alone aliases
(vy = J lands in the next row of i), so the cell id is -1, in no segment, wherever any
coordinate lies outside its index's range [0, size): an id out of range belongs to no
segment, as in the dense form. The same id tensor compared twice (`vx[n] == i and vx[n]
== j`) is exact too: its cells are those with i == j.

One equality of an integer expression of index tensors with a row-major composite of
indices is a cell too: `where(ind[l,k] - 1 == (o*H + h)*W + w, ..)` (mmcv's
active_rotated_filter: a table of 1-based flat positions). Where the strides are the
sizes of the indices inside (w's range is W, h's is H), the composite runs once over
[0, O·H·W) as (o, h, w) runs over its box, so the equality holds for exactly the (o, h, w)
whose row-major position the expression's value is, and for none where the value lies
outside [0, O·H·W): the expression is the cell id, -1 outside. A stride that is not
provably the size inside (a let, another attr) leaves the mask dense.

`flatten` writes a term with the conjunction as `_cell[r,n] == w` (`w` standing for
(i, j, k)) and every tensor read at i, j and k as a read at w (the tensor with those
axes last, merged); the segment lowerings (`lower/segments.py`,
`lower/segment_extrema.py`) then see a segment by one id, and the tile plan
(`tile.big_sets`) its rows instead of the mask. Refused (the dense mask, which is what
the formula says) unless: every equality compares an index tensor read at the same
distinct plain indices with an index the ids lack, the indices distinct; the term has no
other conjunction; and i, j and k are read nowhere but in that conjunction and in reads
holding all three at plain positions. A conjunction with a condition that is not such an
equality (`vx[n] == i and x[n] > 0`) or an equality with an expression (`vx[n] + 1 ==
i`) is therefore no cell.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import sympy as sp

from . import functions as fn
from .indexing import IOTA, index_symbols, is_iota, on_indices, shape_symbol
from .model import Index
from .segment_forms import segment_condition

CELL = "_cell"  # the cell ids' tensor name, then the coordinates' names


@dataclass(frozen=True)
class Cell:
    """A conjunction of equalities that is one segment over a composite index."""

    condition: sp.Expr  # the conjunction as the term writes it
    ids: tuple[sp.Indexed, ...]  # one index tensor read per equality, all at `n`
    at: tuple[Index, ...]  # the index each is compared with, row-major
    key: Index  # the composite index (at..), of size Π |at|
    access: sp.Indexed  # the cell ids at n
    # a composite equality's side with the index tensors (`ind[l,k] - 1`): the cell id
    # where it lies in [0, Π |at|); None for a conjunction (the id is computed from `ids`)
    value: sp.Expr | None = None

    @property
    def name(self) -> str:
        return self.access.base.label.name


@dataclass(frozen=True)
class Flat:
    """A term with its cell as a segment by one id."""

    expr: sp.Expr
    # reads at the cell: (name of the read at `key`, the tensor, its indices as read)
    reads: tuple[tuple[str, str, tuple[Index, ...]], ...]


def find(expr: sp.Expr, ids, order=(), sizes=None) -> Cell | None:
    """The one conjunction of segment equalities the selects of `expr` test, or None
    (none, several, or one that is no cell). `order`: indices in the order the result is
    laid out (the cell's coordinates follow it, so its reads need no transpose).
    `sizes` (`lower.common.size_sources`): where given, one equality with a row-major
    composite of indices is a cell too (`composite`)."""
    conditions = expr.atoms(sp.And)
    if not conditions and sizes is not None:
        return composite(expr, ids, order, sizes)
    if len(conditions) != 1:
        return None
    (condition,) = conditions
    pairs = []
    for equality in condition.args:
        pair = segment_condition(equality, ids)
        if pair is None:
            return None
        pairs.append(pair)
    n = tuple(pairs[0][0].indices)
    at = [v for _, v in pairs]
    if any(tuple(a.indices) != n for a, _ in pairs) or len(set(at)) != len(at):
        return None
    if set(at) & set(n):
        return None
    place = _places(order)
    pairs.sort(key=lambda p: place(p[1]))
    at = tuple(v for _, v in pairs)
    # the ids paired with their indices: the same ids compared with other indices (another
    # output's cell, of other sizes) are other cell ids
    names = "_".join(f"{a.base.label.name}_{v.name}" for a, v in pairs)
    key = _key(at)
    access = sp.IndexedBase(f"{CELL}_{names}", real=True)[n]
    return Cell(condition, tuple(a for a, _ in pairs), at, key, access)


def composite(expr: sp.Expr, ids, order, sizes) -> Cell | None:
    """The one equality the selects of `expr` test, `value == (o*H + h)*W + w`, as a cell
    over (o, h, w) with `value` its id: when `value` is an integer expression of index
    tensors (names in `ids`) and the other side a row-major composite of distinct indices
    whose strides are the sizes inside them; None otherwise (and for a plain
    `seg[n] == v`, a segment of its own, `lower/segments.py`)."""
    equalities = {s.args[0] for s in expr.atoms(fn.select) if isinstance(s.args[0], sp.Eq)}
    if len(equalities) != 1 or len(expr.atoms(sp.Eq)) != 1:
        return None
    (equality,) = equalities
    if segment_condition(equality, ids) is not None:
        return None
    for value, position in (equality.args, reversed(equality.args)):
        at = _row_major(position, sizes)
        if at is None or not _integer_of_ids(value, ids):
            continue
        n = _indices_of(value)
        if not n or set(n) & set(at):
            return None
        n = tuple(sorted(n, key=_places(order)))
        digest = hashlib.sha256(sp.srepr(equality).encode()).hexdigest()[:8]
        names = "_".join(sorted({a.base.label.name for a in value.atoms(sp.Indexed)}))
        access = sp.IndexedBase(f"{CELL}_{names}_{digest}", real=True)[n]
        return Cell(equality, (), at, _key(at), access, value)
    return None


def _places(order):
    """A sort key: an index's place in `order` (those not in it after, by name)."""
    rank = {index: place for place, index in enumerate(order)}
    return lambda i: (rank.get(i, len(rank)), sp.default_sort_key(i))


def _key(at: tuple[Index, ...]) -> Index:
    """The composite index of a cell over `at`."""
    return Index(f"{CELL}_{'_'.join(v.name for v in at)}")


def _row_major(position: sp.Expr, sizes) -> tuple[Index, ...] | None:
    """The indices of `c_o·o + c_h·h + w` (index values, `_iota[o]`), outermost first,
    when the stride of each is the product of the sizes of those inside it; None for any
    other expression. A size `Max(0, s)` counts as s: were s not positive, the index
    inside would be empty, and so the box and the mask."""
    if not on_indices(position) or not position.atoms(sp.Indexed):
        return None
    stride_of: dict[Index, sp.Expr] = {}
    for term in sp.Add.make_args(sp.expand(position)):
        reads = [f for f in sp.Mul.make_args(term) if is_iota(f)]
        if len(reads) != 1:
            return None
        (read,) = reads
        index = read.indices[0]
        if not isinstance(index, sp.Symbol) or index in stride_of:
            return None
        stride = sp.Mul(*[f for f in sp.Mul.make_args(term) if f is not read])
        if stride.atoms(sp.Indexed):
            return None
        stride_of[index] = _by_name(stride)
    inner: list[Index] = []
    stride: sp.Expr = sp.Integer(1)
    while stride_of:
        found = [i for i, s in stride_of.items() if sp.expand(s - stride) == 0]
        if len(found) != 1:
            return None
        (index,) = found
        del stride_of[index]
        inner.append(index)
        if stride_of:
            size = _positive_size(sizes.get(index))
            if size is None:
                return None
            stride = stride * size
    return tuple(reversed(inner))


def _positive_size(source) -> sp.Expr | None:
    """An index's size (`size_sources`), `Max(0, s)` as s, symbols by name."""
    if source is None:
        return None
    if isinstance(source, tuple):
        return _by_name(shape_symbol(*source))
    if isinstance(source, sp.Max) and len(source.args) == 2 and sp.S.Zero in source.args:
        (source,) = [a for a in source.args if a != 0]
    return _by_name(source)


def _by_name(e: sp.Expr) -> sp.Expr:
    """`e` with its symbols free of assumptions (a stride and a range written apart)."""
    return e.xreplace({s: sp.Symbol(s.name) for s in e.free_symbols if isinstance(s, sp.Symbol)})


def _integer_of_ids(value: sp.Expr, ids) -> bool:
    """Whether `value` is a sum of integer multiples of index-tensor reads and integer
    attrs, with at least one read."""
    reads = value.atoms(sp.Indexed)
    if not reads or any(a.base.label.name not in ids for a in reads):
        return False

    def integer(e) -> bool:
        if isinstance(e, sp.Indexed):
            return True
        if isinstance(e, sp.Integer):
            return True
        if isinstance(e, sp.Symbol):
            return bool(e.is_integer)
        if isinstance(e, (sp.Add, sp.Mul)):
            return all(integer(a) for a in e.args)
        return False

    return integer(value)


def _indices_of(value: sp.Expr) -> set[Index]:
    """The indices an integer expression of reads reads at."""
    return {
        i
        for a in value.atoms(sp.Indexed)
        for p in a.indices
        for i in ([p] if isinstance(p, sp.Symbol) else index_symbols(p))
    }


def flatten(expr: sp.Expr, cell: Cell) -> Flat | None:
    """`expr` with the cell's conjunction as `cell id == key` and every read at all of
    its coordinates (plain, distinct positions) read at `key`; None when a coordinate is
    used otherwise (in another read, a position, an index value)."""
    iota = sp.IndexedBase(IOTA, real=True)
    flat = expr.xreplace({cell.condition: sp.Eq(cell.access, iota[cell.key])})
    at = set(cell.at)
    mapping = {}
    reads = []
    for a in sorted(flat.atoms(sp.Indexed), key=sp.default_sort_key):
        labels = tuple(a.indices)
        if not at & set(labels):
            continue
        plain = all(isinstance(i, sp.Symbol) for i in labels) and len(set(labels)) == len(labels)
        if not plain or not at <= set(labels):
            return None
        base = a.base.label.name
        name = f"{base}{CELL}[{','.join(i.name for i in labels)}]"
        mapping[a] = sp.IndexedBase(name, real=True)[merged(labels, cell)]
        reads.append((name, base, labels))
    flat = flat.xreplace(mapping)
    if flat.free_symbols & at:
        return None
    return Flat(flat, tuple(reads))


def flat_term(expr: sp.Expr, indices, summed, ids, sizes=None):
    """A term (`expr` over free `indices`, summed over `summed`) with its cell, if it has
    one whose coordinates are all free or all summed, as a segment by one id: (expr,
    indices, summed, ids, cell); the term as it is (cell None) otherwise. `sizes`: as
    `find`'s."""
    cell = find(expr, ids, (*indices, *summed), sizes)
    flat = None if cell is None else flatten(expr, cell)
    if flat is None:
        return expr, tuple(indices), tuple(summed), tuple(ids), None
    at = set(cell.at)
    if at <= set(indices):
        indices = merged(indices, cell)
    elif at <= set(summed):
        summed = (*(i for i in summed if i not in at), cell.key)
    else:
        return expr, tuple(indices), tuple(summed), tuple(ids), None
    return flat.expr, tuple(indices), tuple(summed), (*ids, cell.name), cell


def merged(labels, cell: Cell) -> tuple[Index, ...]:
    """A read's indices with the cell's coordinates as its key: in their place where
    they follow each other in the cell's order (a reshape), else last (a transpose)."""
    labels = tuple(labels)
    width = len(cell.at)
    for start in range(len(labels) - width + 1):
        if labels[start : start + width] == cell.at:
            return (*labels[:start], cell.key, *labels[start + width :])
    return (*(i for i in labels if i not in cell.at), cell.key)


def unflatten(indices, cell: Cell | None) -> tuple[Index, ...]:
    """Indices with the cell's key as its coordinates."""
    if cell is None:
        return tuple(indices)
    out: list[Index] = []
    for i in indices:
        out += list(cell.at) if i == cell.key else [i]
    return tuple(out)

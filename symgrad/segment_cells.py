"""A segment given as several coordinates: `where(vx[r,n] == i and vy[r,n] == j and
vz[r,n] == k, ..)` (mmcv's roiaware_pool3d, a voxel per point and roi).

Written densely the conjunction is a mask over [r, n, i, j, k]. It is one segment over
the composite index (i, j, k): the cell id `(vx·J + vy)·K + vz`, taken row-major as a
composite output index is (README, "Composite output indices"). A flat id alone aliases
(vy = J lands in the next row of i), so the cell id is -1, in no segment, wherever any
coordinate lies outside its index's range [0, size): an id out of range belongs to no
segment, as in the dense form. The same id tensor compared twice (`vx[n] == i and vx[n]
== j`) is exact too: its cells are those with i == j.

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

from dataclasses import dataclass

import sympy as sp

from .indexing import IOTA
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

    @property
    def name(self) -> str:
        return self.access.base.label.name


@dataclass(frozen=True)
class Flat:
    """A term with its cell as a segment by one id."""

    expr: sp.Expr
    # reads at the cell: (name of the read at `key`, the tensor, its indices as read)
    reads: tuple[tuple[str, str, tuple[Index, ...]], ...]


def find(expr: sp.Expr, ids, order=()) -> Cell | None:
    """The one conjunction of segment equalities the selects of `expr` test, or None
    (none, several, or one that is no cell). `order`: indices in the order the result is
    laid out (the cell's coordinates follow it, so its reads need no transpose)."""
    conditions = expr.atoms(sp.And)
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
    rank = {index: position for position, index in enumerate(order)}
    pairs.sort(key=lambda p: (rank.get(p[1], len(rank)), sp.default_sort_key(p[1])))
    at = tuple(v for _, v in pairs)
    # the ids paired with their indices: the same ids compared with other indices (another
    # output's cell, of other sizes) are other cell ids
    names = "_".join(f"{a.base.label.name}_{v.name}" for a, v in pairs)
    key = Index(f"{CELL}_{'_'.join(v.name for v in at)}")
    access = sp.IndexedBase(f"{CELL}_{names}", real=True)[n]
    return Cell(condition, tuple(a for a, _ in pairs), at, key, access)


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


def flat_term(expr: sp.Expr, indices, summed, ids):
    """A term (`expr` over free `indices`, summed over `summed`) with its cell, if it has
    one whose coordinates are all free or all summed, as a segment by one id: (expr,
    indices, summed, ids, cell); the term as it is (cell None) otherwise."""
    cell = find(expr, ids, (*indices, *summed))
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

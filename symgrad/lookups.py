"""Index tensors read anywhere in brackets, and index clamps (issue 17, items 4 and 5).

An index tensor may be read at any index expression, not only at plain indices:

- at constants, `x[b, idx[b, n, 0], c]` (PAConv's centre point);
- shifted, `where(indptr[s] <= n < indptr[s + 1], x[n, f], 0)` (a CSR segment);
- nested, `attr[tri[tid[p], v], c]` (nvdiffrast's interpolate);
- as a data-dependent stride, `k[b, i + D[h] * (j - w), h, m]` (Longformer's dilation).

Such a *lookup* is an `Indexed` of the index tensor at SymPy positions inside the position
of the read it feeds. Lowering gathers it like any read at computed positions; a lookup
outside its tensor makes every read that depends on it out of bounds (zero, adding
nothing to gradients), and a `where` whose condition reads it takes its `otherwise`
branch there (symgrad/lower/lookups.py; the reference evaluator does the same). An index tensor is also read as a lookup when one of its plain
indices is sized by `ranges` (`indptr[s]` with `s` over `indptr.shape[0] - 1`), so the
range may be shorter or longer than the axis.

`min(a, b)` and `max(a, b)` of index expressions are SymPy `Min`/`Max` (NATTEN's window
start `max(min(i - ns, L - K), 0)`). Positions with lookups or clamps are not affine: no
range is inferred from them, and their reads are always masked.
"""

from __future__ import annotations

import sympy as sp

from . import indexing
from .parse import Access, Call

CLAMPS = {"min": sp.Min, "max": sp.Max}


def ranged(builder, name: str) -> bool:
    """Whether an index (by its written name) has a `ranges` entry."""
    return name in dict(builder.op.ranges)


def is_lookup(builder, node: Access) -> bool:
    """An index-tensor read that is no plain read of its axes."""
    return not node.plain or any(ranged(builder, i) for i in node.indices)


def lookup(builder, node: Access, scope, found: list) -> sp.Expr:
    """`ids[positions]` as SymPy; plain indices not sized by `ranges` take the axis size."""
    builder.mark(builder.index_inputs, node.tensor, node.col)
    builder.register(node.tensor, len(node.positions), node.col)
    positions = []
    for axis, position in enumerate(node.positions):
        value = builder.position(position, scope, found)
        if indexing.is_plain(value) and not ranged(builder, value.name):
            builder.add_dim(value, node.tensor, axis)
        positions.append(value)
    found.append(node)
    return sp.IndexedBase(node.tensor)[tuple(positions)]


def clamp(builder, node: Call, scope, found: list) -> sp.Expr:
    left, right = (builder.position(a, scope, found) for a in node.args)
    return CLAMPS[node.function](left, right)


def affine(position: sp.Expr) -> bool:
    """Whether a position is affine in indices and int attrs (no lookup, no clamp)."""
    return not position.atoms(sp.Indexed) and not position.has(sp.Min, sp.Max)

"""The key under which equal gathers are shared: the same window read under other
index names is one gather.

A sum written twice over the same window binds its index twice (`k`, then `k'`, and
`d`, `d'` inside), so the two reads `kk[b, i + k - w, h, d]` and `kk[b, i + k' - w, h,
d']` differ only in names. An index is renamed to a canonical name only where its size
cannot depend on the name:

- read as a whole position (`d` at axis 3): it takes that axis of the source, the same
  for both reads of the same source;
- otherwise, only if its name (unprimed) has a `ranges` entry: every index of that name
  takes that range (a plain read of it would be refused, see `model._extents`).

Any other index (sized by a plain read elsewhere, or inferred) keeps its own name, so
reads that could differ in size are never merged.
"""

from __future__ import annotations

import itertools

import sympy as sp

from . import indexing

# Orderings tried for indices of one name read twice in a gather (`x[i + k + k']`).
_MAX_ORDERS = 24


def gather_key(source: str, positions: tuple, grid: tuple, ranged: frozenset[str]) -> str:
    """A name-independent key for `source[positions]` laid out over `grid`; `ranged`:
    the index names with a `ranges` entry. The key includes the renamed grid in order,
    so a level found under it has the axes of `grid`."""
    symbols: dict[sp.Symbol, None] = dict.fromkeys(grid)
    for position in positions:
        symbols.update(dict.fromkeys(indexing.index_symbols(position)))
    mapping: dict[sp.Symbol, sp.Symbol] = {}
    for axis, position in enumerate(positions):
        if indexing.is_plain(position) and position not in mapping:
            mapping[position] = sp.Symbol(f"_p{axis}")
    groups: dict[str, list[sp.Symbol]] = {}
    for symbol in symbols:
        if symbol not in mapping and indexing.written_name(symbol) in ranged:
            groups.setdefault(indexing.written_name(symbol), []).append(symbol)
    names = sorted(groups)
    choices = [list(itertools.permutations(groups[n])) for n in names]
    best = None
    for count, orders in enumerate(itertools.product(*choices)):
        if count >= _MAX_ORDERS:
            break
        renamed = dict(mapping)
        for name, order in zip(names, orders, strict=True):
            renamed.update({s: sp.Symbol(f"_r{n}_{name}") for n, s in enumerate(order)})
        text = repr(
            (
                "gather",
                source,
                tuple(sp.srepr(p.xreplace(renamed)) for p in positions),
                tuple(str(renamed.get(s, s)) for s in grid),
            )
        )
        if best is None or text < best:
            best = text
    return best

"""Reads at computed positions: affine index expressions, index tensors, index ranges.

An access whose positions are not all plain indices (`A[b, 2*i + k - 1, c]`,
`W[ids[b, t], d]`) is a *gather*: the tensor of the values it reads over the grid of
the indices it uses. The model turns each one into an intermediate (a `Gather` level) that
the rest of the pipeline reads like an input, so contractions, pointwise functions and
derivation need no new rules: the gradient of the source is the transpose of the gather,
a scatter-add (`tf.math.unsorted_segment_sum`), exactly what TF's own `Gather` gradient
does. A read outside the source's bounds is zero (zero padding).

The sizes of indices that are no plain index of an input axis (an output index only used
at computed positions, a window offset) are `Extent`s: integer SymPy expressions over the
input sizes (`A.shape[1]`) and int attrs, from the spec's `ranges` or inferred as the
largest range whose reads stay in bounds at the upper end (TF's `VALID`).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

Index = sp.Symbol

IOTA = "_iota"  # `_iota[i]` is the value of index i (0, 1, ...) in a condition


def written_name(symbol: Index) -> str:
    """The name the user wrote for an index symbol (bound copies are primed)."""
    return symbol.name.rstrip("'")


def is_iota(e: sp.Expr) -> bool:
    """Whether `e` is `_iota[i]`, an index's value in a condition."""
    return isinstance(e, sp.Indexed) and e.base.label.name == IOTA


def on_indices(condition: sp.Expr) -> bool:
    """Whether a condition reads index values alone (`k <= i`): every access in it is an
    `_iota` (true of a condition with no access)."""
    return all(is_iota(a) for a in condition.atoms(sp.Indexed))


def read_indices(
    positions: tuple[sp.Expr, ...], computed: tuple[int, ...], order
) -> tuple[Index, ...]:
    """The indices (of `order`, in its order) that the computed positions read at."""
    used = {i for n in computed for i in index_symbols(positions[n])}
    return tuple(i for i in order if i in used)


@dataclass(frozen=True)
class Gather:
    """`source[positions]` over `grid` (the level's indices, in the layout lowering uses).

    Each position is an integer-linear SymPy expression in index symbols, int attrs and
    index-tensor accesses (`ids[b, t]`). `computed` lists the source axes read at a
    computed position; the other axes are plain (one index used nowhere else in the access)
    and are carried through. `bounded` is per computed axis: whether every read is known to
    be in bounds, so no mask is needed.
    """

    source: str
    positions: tuple[sp.Expr, ...]
    computed: tuple[int, ...]
    bounded: tuple[bool, ...]

    def inner(self, grid) -> tuple[Index, ...]:
        """The indices of `grid` that the computed positions read at (the shape of the
        positions' tensor)."""
        return read_indices(self.positions, self.computed, grid)


def shape_symbol(tensor: str, axis: int) -> sp.Symbol:
    """The size of axis `axis` of input `tensor`, as it appears in extents."""
    return sp.Symbol(f"{tensor}.shape[{axis}]", integer=True, nonnegative=True)


def parse_shape_symbol(symbol: sp.Symbol) -> tuple[str, int] | None:
    name = symbol.name
    if ".shape[" not in name or not name.endswith("]"):
        return None
    tensor, axis = name[:-1].split(".shape[")
    return tensor, int(axis)


def index_values(position: sp.Expr) -> sp.Expr:
    """`2*i + ids[b, t]` -> `2*_iota[i] + ids[b, t]`: indices outside accesses read as
    their values (0, 1, ...), so lowering aligns them over their axes like tensors."""
    hidden = {a: sp.Dummy(real=True) for a in position.atoms(sp.Indexed)}
    plain = position.xreplace(hidden)
    iota = sp.IndexedBase(IOTA, real=True)
    mapping = {s: iota[s] for s in plain.free_symbols if is_plain(s)}
    return plain.xreplace(mapping).xreplace({d: a for a, d in hidden.items()})


def index_symbols(expr: sp.Expr) -> list[Index]:
    """The index symbols of a position (outside and inside index-tensor accesses), in a
    deterministic order: SymPy's print order is not the written order, so callers that
    care about written order track it themselves."""
    found: dict[Index, None] = {}
    for atom in sp.preorder_traversal(expr):
        if isinstance(atom, sp.Indexed):
            for index in atom.indices:
                for s in sorted(index.free_symbols, key=sp.default_sort_key):
                    found.setdefault(s, None)
    for s in sorted(expr.free_symbols, key=sp.default_sort_key):
        if _is_index(s):
            found.setdefault(s, None)
    return list(found)


def _is_index(symbol: sp.Basic) -> bool:
    return isinstance(symbol, sp.Symbol) and not symbol.is_real and not symbol.is_integer


def is_plain(position: sp.Expr) -> bool:
    return isinstance(position, sp.Symbol) and _is_index(position)


def layout(
    positions: tuple[sp.Expr, ...], written: list[Index]
) -> tuple[tuple[int, ...], tuple[Index, ...]]:
    """Which axes are computed, and the gathered tensor's axes in the order lowering
    produces them: with one computed axis, `tf.gather(X, P, axis=c)` puts the indices of
    P where axis c was; adjacent computed axes are merged into one first and gathered in
    place the same way; otherwise they are moved to the front and flattened, so the
    indices of P come first and the plain axes follow."""
    uses: dict[Index, int] = {}
    for position in positions:
        for index in index_symbols(position):
            uses[index] = uses.get(index, 0) + 1
    computed = tuple(
        n for n, position in enumerate(positions) if not is_plain(position) or uses[position] > 1
    )
    inner = list(read_indices(positions, computed, written))
    plain = [(n, positions[n]) for n in range(len(positions)) if n not in computed]
    if computed and computed == tuple(range(computed[0], computed[-1] + 1)):
        # One computed axis, or adjacent ones merged into one (the spatial axes of
        # NHWC): gathered in place, so batch and channels keep their positions.
        axis = computed[0]
        grid = (
            *[p for n, p in plain if n < axis],
            *inner,
            *[p for n, p in plain if n > axis],
        )
    else:
        grid = (*inner, *[p for _, p in plain])
    return computed, tuple(grid)


def coefficient(position: sp.Expr, index: Index) -> sp.Expr:
    """The coefficient of `index` in an affine position (0 when absent)."""
    return sp.expand(position).coeff(index)


def upper_bound(
    position: sp.Expr,
    index: Index,
    size: sp.Expr,
    extents: dict[Index, sp.Expr],
) -> sp.Expr | None:
    """The largest range of `index` for which `position` stays below `size` (every other
    index over its whole range), or None when this read says nothing about it.

    Int attrs that scale an index are taken as positive (strides, dilations)."""
    expanded = sp.expand(position)
    c = expanded.coeff(index)
    if c == 0:
        return None
    rest = expanded - c * index
    high = extreme(rest, extents, upper=True)
    low = extreme(rest, extents, upper=False)
    if high is None or low is None:
        return None
    direction = sign(c)
    if direction is None:
        return None
    if direction < 0:
        # position = c*i + rest >= 0  for i up to n-1:  n <= low // (-c) + 1
        return sp.floor(low / -c) + 1
    return sp.floor((size - 1 - high) / c) + 1


def sign(c: sp.Expr) -> int | None:
    """+1 or -1 for a coefficient that is a number or a sum of int attrs with coefficients
    of one sign (int attrs that scale an index are required to be positive: `d`, `2*s`;
    `-d`), None when it cannot be told (`s - d`)."""
    if c.is_number:
        return 1 if c > 0 else -1 if c < 0 else None
    coefficients = [t.as_coeff_Mul()[0] for t in sp.Add.make_args(sp.expand(c))]
    if all(k > 0 for k in coefficients):
        return 1
    if all(k < 0 for k in coefficients):
        return -1
    return None


def extreme(expr: sp.Expr, extents: dict[Index, sp.Expr], *, upper: bool) -> sp.Expr | None:
    """max (or min) of an affine expression over the known ranges of its indices."""
    total = sp.Integer(0)
    for term in sp.Add.make_args(sp.expand(expr)):
        symbols = [s for s in term.free_symbols if _is_index(s)]
        if not symbols:
            total += term
            continue
        if len(symbols) != 1 or term.atoms(sp.Indexed):
            return None
        (index,) = symbols
        if index not in extents:
            return None
        c = term.coeff(index)
        top = c * (extents[index] - 1)
        direction = sign(c)
        if direction is None:
            return None
        negative = direction < 0
        if upper:
            total += 0 if negative else top
        else:
            total += top if negative else 0
    return total

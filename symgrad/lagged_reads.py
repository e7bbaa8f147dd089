"""Inputs of a recurrence read at a lag of the scan index: `x[b,t-1]`, `x[b,t-2]`, or
`x[b,t-k]` summed over k (the feed-forward part of an IIR filter), and in a reverse
recurrence `r[b,t+1]`.

Such an input is part of the step's window, like the past states: the step reads its
recent slices, newest first, `x_recent[e, b]` being `x` at `e` positions back in scan
order (zero before the start), and every read of it, at the scan position too (e = 0),
goes through that window. The window holds the largest lag plus one slices. The step's
derived vector-Jacobian product gives the gradient of the window, whose slice `e` is
the gradient of the input at `e` positions back: the scan adds it there. So the
gradient is derived like every other, and nothing is copied L times over.

The lag is in the scan's direction: a forward recurrence reads its inputs at the scan
position or earlier, a reverse one at the scan position or later (reads past the end
read zero). A lag is a constant plus summed indices with non-negative coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy as sp

from .parse import Access, Equation, IndexRef, index_names, names_outside_lookups


@dataclass
class Recent:
    """An input read at lags: its axis along the scan index and its window's depth,
    `const` plus coefficient * (size - 1) per (input, axis) of `sizes`."""

    axis: int
    const: int = 1
    sizes: dict[tuple[str, int], int] = field(default_factory=dict)


def input_lag(a, eq: Equation, access: Access, index: str) -> tuple[int, sp.Expr] | None:
    """(axis, lag in scan order) of an input read along the scan index `index` (lag 0 at
    `index` itself); None when the read is not along it. A SymgradError with a caret when
    the position is not `index` minus a lag that runs with the scan."""
    from .recurrence import _symbolic

    axes = [k for k, p in enumerate(access.positions) if index in names_outside_lookups(p)]
    if not axes:
        return None
    if len(axes) > 1:
        raise a.fail(f"{access.tensor!r} is read on a diagonal of {index!r}", access.col, eq)
    axis = axes[0]
    p = access.positions[axis]
    if isinstance(p, IndexRef):
        return axis, sp.Integer(0)
    t = sp.Symbol(index, integer=True)
    position = sp.expand(_symbolic(p, lambda message, col: a.fail(message, col, eq)))
    lag = sp.expand(t - position)
    if position.coeff(t) != 1 or lag.has(t):
        raise a.fail(
            f"{access.tensor!r} is read at a position along the scan index {index!r} that is "
            f"not {index} plus or minus a lag; a recurrence reads its inputs at {index} or at "
            f"a lag of it ({access.tensor}[..., {index} - 1, ...])",
            access.col,
            eq,
        )
    lag = -lag if a.reverse else lag
    attrs = {n for n, _ in a.op.attrs} | {n for n, _ in a.op.lets}
    if any(s.name in attrs for s in lag.free_symbols):
        raise a.fail(
            f"{access.tensor!r} is read at a lag that depends on an attr; a lag is a constant "
            "plus summed indices",
            access.col,
            eq,
        )
    const = lag.subs({s: 0 for s in lag.free_symbols})
    if const < 0 or any(lag.coeff(s) < 0 for s in lag.free_symbols):
        way = "later" if not a.reverse else "earlier"
        kind = "forward" if not a.reverse else "reverse"
        raise a.fail(
            f"{access.tensor!r} is read at {way} positions of {index!r} than the one computed "
            f"in a {kind} recurrence; inputs are read at the scan position or at positions "
            "already passed (earlier ones in a forward recurrence, later ones in a reverse one)",
            access.col,
            eq,
        )
    return axis, lag


def find_recent(a, equations: list[tuple[Equation, str]]) -> dict[str, Recent]:
    """The op inputs read at a lag in any equation (each with its scan index name), with
    their windows."""
    from .recurrence import _accesses

    found: dict[str, Recent] = {}
    reads: list[tuple[Equation, Access, int, sp.Expr]] = []
    for eq, index in equations:
        for access in _accesses(eq.rhs):
            if access.tensor == a.state or access.tensor in a.defined:
                continue
            lagged = input_lag(a, eq, access, index)
            if lagged is None:
                continue
            reads.append((eq, access, *lagged))
            if lagged[1] != 0:
                found.setdefault(access.tensor, Recent(lagged[0]))
    for eq, access, axis, lag in reads:
        recent = found.get(access.tensor)
        if recent is None:
            continue
        if axis != recent.axis:
            raise a.fail(
                f"{access.tensor!r} is read along the scan index on two different axes",
                access.col,
                eq,
            )
        recent.const = max(recent.const, int(lag.subs({s: 0 for s in lag.free_symbols})) + 1)
        for s in lag.free_symbols:
            source = a.sized(s.name, access.col, eq)
            recent.sizes[source] = max(recent.sizes.get(source, 0), int(lag.coeff(s)))
    return found


def recent_text(a, eq: Equation, access: Access, index: str, name: str, swap=None) -> str:
    """The step's read of an input read at lags: its window at the lag, then the other
    positions (`x[b,t-1]` -> `x_recent[1, b]`), the index tensors read there by `swap`."""
    from .recurrence import _index_text, text

    axis, lag = input_lag(a, eq, access, index)
    rest = [text(p, swap or (lambda _: None)) for k, p in enumerate(access.positions) if k != axis]
    return f"{name}[{', '.join([_index_text(lag), *rest])}]"


def length_source(a, recent: dict[str, Recent]) -> tuple[str, int] | None:
    """An input axis whose size is the number of positions, among those read at lags."""
    for name, r in recent.items():
        return name, r.axis
    return None


def lagged_source(a, index: str) -> tuple[str, int] | None:
    """An input axis read at `index` minus a constant (`D[b,i-1,j-1]` for j): an input
    read at a lag has the index's length along that axis."""
    from .recurrence import _accesses

    i = sp.Symbol(index, integer=True)
    for eq in a.equations:
        for access in _accesses(eq.rhs):
            if access.tensor == a.state or access.tensor in a.defined:
                continue
            for axis, p in enumerate(access.positions):
                if index not in index_names(p):
                    continue
                try:
                    position = sp.expand(_symbolic_or_none(p))
                except ValueError:
                    continue
                if position.coeff(i) == 1 and not (position - i).free_symbols:
                    return access.tensor, axis
    return None


def _symbolic_or_none(node) -> sp.Expr:
    from .recurrence import _symbolic

    def fail(message, col):
        return ValueError(message)

    return _symbolic(node, fail)

"""Two-index (wavefront) recurrences, e.g. soft-DTW's

    R[b,i,j] = D[b,i,j] - gamma * log(exp(-R[b,i-1,j-1]/gamma) + exp(-R[b,i-1,j]/gamma)
                                      + exp(-R[b,i,j-1]/gamma))

A recurrence that reads its own tensor at earlier positions along two indices is ordered
row by row: an outer scan along the first index (`i`) whose state is a whole row
`R[b,i,:]`, and whose step is itself a one-index recurrence along the second (`j`),
reading the previous rows (`R[b,i-1,j]`, and `R[b,i-1,j-1]` as the previous row read one
position back along `j`) and its own row at earlier `j`. The step is rendered by the same
machinery (a scan) and embedded in the outer scan, so the gradient is the adjoint scan of
adjoint scans, derived like every other.

It can be ordered when, for the first index, every read is at a constant lag >= 0, and
the reads at lag 0 are at a constant earlier position of the second index; the reads at
an earlier row are at the second index itself or a constant earlier position.
"""

from __future__ import annotations

import sympy as sp

from .parse import Access, IndexRef


def _offsets(a, access: Access, outer: int, inner: int) -> tuple[int, int] | None:
    """(lag along the outer index, shift back along the inner) of a self read, or None
    when it is not of the ordered form."""
    from .recurrence import _symbolic

    lhs = a.eq.output_indices
    for k, p in enumerate(access.positions):
        if k not in (outer, inner) and not (isinstance(p, IndexRef) and p.name == lhs[k]):
            return None
    found = []
    for k in (outer, inner):
        t = sp.Symbol(lhs[k], integer=True)
        position = _symbolic(access.positions[k], lambda message, col: a.fail(message, col))
        lag = sp.expand(t - position)
        if lag.free_symbols or not lag.is_integer or lag < 0:
            return None
        found.append(int(lag))
    lag, shift = found
    return None if lag == 0 and shift == 0 else (lag, shift)


def wavefront_axes(a, axes: list[int]) -> tuple[int, int]:
    """(outer axis, inner axis) of a recurrence reading itself along two axes; a
    SymgradError with a caret when its reads cannot be ordered row by row."""
    reads = a.self_reads(a.eq)
    lhs = a.eq.output_indices
    if len(axes) == 2:
        for outer, inner in (axes, axes[::-1]):
            if all(_offsets(a, r, outer, inner) is not None for r in reads):
                return outer, inner
    raise a.fail(
        f"{a.state!r} reads itself at other positions along "
        f"{', '.join(lhs[k] for k in axes)}, which cannot be ordered: a recurrence along "
        "two indices reads earlier rows (i - e, j - s with e >= 1, s >= 0) and earlier "
        "positions of its own row (i, j - s with s >= 1), with constant e and s",
        reads[0].col,
    )


def wavefront_read(a, node: Access, lag: int, rest: list[str]) -> str:
    """The outer step's text for a self read `lag` rows back (the step's own tensor when
    `lag` is 0: the inner recurrence)."""
    from .recurrence import text

    lhs = a.eq.output_indices
    inner = lhs.index(a.inner)
    _, shift = _offsets(a, node, a.axis, inner)
    if lag == 0:
        return f"{a.state}[{', '.join(rest)}]"
    if shift == 0:
        a.lags.add(lag)
        return f"{a.lag_name(lag)}[{', '.join(rest)}]"
    a.shifts.add((lag, shift))
    kept = [a.inner if k == inner else text(p) for k, p in enumerate(node.positions) if k != a.axis]
    return f"{a.shift_name(lag, shift)}[{', '.join(kept)}]"

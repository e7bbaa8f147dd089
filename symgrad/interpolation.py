"""Linear interpolation as one function, `lerp(f, lo, hi) = (1 - f)·lo + f·hi`, whose
derivative in the fraction is the difference of the neighbours, taken first.

A sampled read (sampling.py) nests one `lerp` per float axis: bilinear is
`lerp(fy, lerp(fx, x00, x01), lerp(fx, x10, x11))`. Written out as the sum of the four
corners times their weights, SymPy's derivative in fy is
`(1 - fx)·x10 + fx·x11 - (1 - fx)·x00 - fx·x01`: products of the values first, then their
difference, which in float32 loses everything the values have in common (an image around
1e4 whose neighbours differ by 1 keeps three digits of that difference). As a `lerp`, the
derivative in f is `hi - lo` with the difference pushed inside the inner lerps,
`lerp(fx, x10 - x00, x11 - x01)`: the neighbours are subtracted before anything is
multiplied, as in PyTorch's grid_sampler backward, and the gradient of the position is
as accurate as the values' differences are.
"""

from __future__ import annotations

import sympy as sp

from . import ir


class lerp(sp.Function):
    """(1 - f)·lo + f·hi, for f in [0, 1): a sampled read along one axis."""

    is_real = True
    nargs = 3

    @classmethod
    def eval(cls, f, lo, hi):
        if f == 0:
            return lo
        if lo == hi:
            return lo
        return None

    def fdiff(self, argindex=1):
        f, lo, hi = self.args
        if argindex == 1:
            return difference(hi, lo)
        return 1 - f if argindex == 2 else f

    def expanded(self) -> sp.Expr:
        f, lo, hi = self.args
        return (1 - f) * lo + f * hi

    # Shown with its weights, `((1 - f)*lo + f*hi)` (parenthesized: it may be a factor).
    def _sympystr(self, printer) -> str:
        return f"({printer._print(self.written())})"

    _symgrad_str = _sympystr  # notation.IndexPrinter

    def _latex(self, printer) -> str:
        return rf"\left({printer._print(self.written())}\right)"

    def written(self) -> sp.Expr:
        """The weighted sum with the inner lerps written out too."""
        return self.replace(lambda n: isinstance(n, lerp), lambda n: n.expanded())


def difference(a: sp.Expr, b: sp.Expr) -> sp.Expr:
    """a - b, subtracted inside lerps of the same fraction: lerp(f, a0, a1) - lerp(f, b0,
    b1) is lerp(f, a0 - b0, a1 - b1), exact for neighbours that are close."""
    if isinstance(a, lerp) and isinstance(b, lerp) and a.args[0] == b.args[0]:
        return lerp(a.args[0], difference(a.args[1], b.args[1]), difference(a.args[2], b.args[2]))
    return a - b


def lower(lowerer, body, e: lerp, target) -> ir.Expr:
    """(1 - f)·lo + f·hi as code over `target`'s axes."""
    return lowerer.expr(body, e.expanded(), target)

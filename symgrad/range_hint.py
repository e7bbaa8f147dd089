"""The example in the error for an index without a range, taken from the formula itself
(or from an int attr declared and not used: the range the user meant to write).

An index that no input axis reads plainly needs a `ranges` entry. The example names an
input the formula reads at that index: the range that keeps every such read inside the
input when one read alone decides it (`sum(x[b, u + 1], u)`: `x.shape[1] - 1`), else the
axis it moves along (a window's tap: its length is the user's choice).
"""

from __future__ import annotations

import sympy as sp

from . import indexing

# A read at a computed position: (position, input, axis).
Read = tuple[sp.Expr, str, int]


def range_example(
    symbol: sp.Symbol,
    name: str,
    reads: list[Read],
    sized: dict,
    inputs: list[str],
    spare: tuple[str, ...] = (),
) -> str:
    """`e.g. ranges = { u = "..." }` and why, for index `symbol` (spelled `name`);
    `spare`: int attrs no formula or range uses, the first one suggested before all
    else (`attrs = { V = "int" }` declared for the range the user forgot)."""
    if spare:
        return (
            f'e.g. ranges = {{ {name} = "{spare[0]}" }} (int attr {spare[0]!r} is declared '
            "but nothing uses it)"
        )
    moving = [(p, s, a) for p, s, a in reads if symbol in p.free_symbols]
    for position, source, axis in moving:
        text = _bound_text(position, symbol, source, axis, sized)
        if text is not None:
            return (
                f'e.g. ranges = {{ {name} = "{text}" }}, which keeps the reads of {source} '
                f"at {name} inside its axis {axis}"
            )
    if moving:
        _, source, axis = moving[0]
        return (
            f'e.g. ranges = {{ {name} = "{source}.shape[{axis}]" }} ({name} moves along axis '
            f'{axis} of {source}; for a window of fixed length, a number or an int attr: {name} = "3")'
        )
    if inputs:
        return f'e.g. ranges = {{ {name} = "{inputs[0]}.shape[0]" }} or a number'
    return f'e.g. ranges = {{ {name} = "3" }}'


def _bound_text(position, symbol, source: str, axis: int, sized: dict) -> str | None:
    """The range one read gives `symbol`, as spec text, when it is a plain sum of sizes,
    int attrs and whole numbers (no rounding); else None."""
    if position.atoms(sp.Indexed):
        return None
    bound = indexing.upper_bound(position, symbol, indexing.shape_symbol(source, axis), sized)
    if bound is None or bound.atoms(sp.floor, sp.Min, sp.Max) or not bound.is_polynomial():
        return None
    if bound.free_symbols:
        poly = sp.Poly(bound, *sorted(bound.free_symbols, key=str))
        if poly.total_degree() > 1 or not all(c.is_integer for c in poly.coeffs()):
            return None
    return _spec_text(sp.expand(bound))


def _spec_text(bound: sp.Expr) -> str:
    """A linear bound as a spec range: sizes, then int attrs, then the number
    (`x.shape[1] - p + 1`)."""
    constant, rest = bound.as_coeff_Add()
    terms = sorted(
        (t.as_coeff_Mul() for t in sp.Add.make_args(rest) if t != 0),
        key=lambda cs: (cs[1].name.startswith("_int_"), cs[1].name),
    )
    parts = [(c, s.name.removeprefix("_int_")) for c, s in terms]
    if constant or not parts:
        parts.append((constant, ""))
    text = ""
    for coefficient, name in parts:
        size = abs(coefficient)
        word = name if size == 1 and name else f"{size}*{name}" if name else str(size)
        sign = "-" if coefficient < 0 else "+"
        text = f"{sign}{word}" if not text else f"{text} {sign} {word}"
    return text.removeprefix("+")


__all__ = ["range_example"]

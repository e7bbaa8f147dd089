"""Index notation for people: the derived gradients as docstring lines and `explain` text.

Gradient indices get the names the formula gives the tensor's axes (`grad_A[b,i,k]` for
`A[b,i,k]`); a summed index that would clash with one of them is primed.
"""

from __future__ import annotations

import sympy as sp
from sympy.printing.str import StrPrinter

from .derive import Backward, Contribution, grad_name
from .model import Index, Program, accesses, size_of


class IndexPrinter(StrPrinter):
    """SymPy's str printer with `A[b,i,k]` accesses and `[x >= y]` masks."""

    printmethod = "_symgrad_str"  # not `_sympystr`, which Indexed defines for itself

    def _print_Indexed(self, expr):
        return f"{expr.base.label}[{','.join(self._print(i) for i in expr.indices)}]"

    def _print_step_ge(self, expr):
        return f"[{self._print(expr.args[0])} >= {self._print(expr.args[1])}]"

    def _print_step_le(self, expr):
        return f"[{self._print(expr.args[0])} <= {self._print(expr.args[1])}]"

    def _print_maximum(self, expr):
        return f"max({self._print(expr.args[0])}, {self._print(expr.args[1])})"

    def _print_minimum(self, expr):
        return f"min({self._print(expr.args[0])}, {self._print(expr.args[1])})"


def show(expr: sp.Expr) -> str:
    return IndexPrinter().doprint(expr)


def axis_names(program: Program) -> dict[str, tuple[str, ...]]:
    """For each tensor, the index names of its first access (its axes' names)."""
    names: dict[str, tuple[str, ...]] = {}
    levels = [*(o.level for o in program.outputs), *program.intermediates]
    for level in levels:
        names.setdefault(level.name, tuple(i.name for i in level.indices))
        for term in level.terms:
            for access in accesses(term.expr):
                names.setdefault(access.base.label.name, tuple(i.name for i in access.indices))
    return names


def display_indices(names: tuple[str, ...]) -> tuple[Index, ...]:
    """Distinct display symbols for a tensor's axes (`A[b,i,i]` -> b, i, i')."""
    chosen: list[str] = []
    for name in names:
        while name in chosen:
            name += "'"
        chosen.append(name)
    return tuple(sp.Symbol(n) for n in chosen)


def rename(c: Contribution, shown: tuple[Index, ...]) -> dict[Index, Index]:
    """Symbols of a contribution -> display symbols, with summed clashes primed."""
    mapping = dict(zip(c.indices, shown, strict=True))
    taken = {s.name for s in shown}
    for symbol in c.summed:
        name = symbol.name
        while name in taken:
            name += "'"
        taken.add(name)
        mapping[symbol] = sp.Symbol(name)
    return mapping


def contribution_text(c: Contribution, shown: tuple[Index, ...]) -> str:
    mapping = rename(c, shown)
    sizes = {size_of(old): size_of(new) for old, new in mapping.items() if old != new}
    grad = c.grad.xreplace(mapping)
    body = c.partial.xreplace(mapping).xreplace(sizes)
    sign = ""
    if body.could_extract_minus_sign():
        sign, body = "-", -body
    numerator, denominator = (
        sp.fraction(body) if isinstance(body, sp.Mul | sp.Pow) else (body, sp.Integer(1))
    )
    text = show(grad)
    if numerator != 1:
        shown_numerator = show(numerator)
        text += (
            f"*({shown_numerator})" if isinstance(numerator, sp.Add) else (f"*{shown_numerator}")
        )
    if denominator != 1:
        shown_denominator = show(denominator)
        text += (
            f"/({shown_denominator})"
            if isinstance(denominator, sp.Add | sp.Mul)
            else (f"/{shown_denominator}")
        )
    if c.diagonal:
        deltas = "*".join(f"δ({mapping[a]},{mapping[b]})" for a, b in c.diagonal)
        text = f"{deltas}*{text}"
    if c.summed:
        summed = ",".join(mapping[s].name for s in c.summed)
        text = f"Σ_{summed} {text}"
    return sign + text


def gradient_line(target: str, contributions: list[Contribution], names) -> str:
    shown = display_indices(names[target])
    left = f"{grad_name(target)}[{','.join(s.name for s in shown)}]"
    right = ""
    for c in contributions:
        text = contribution_text(c, shown)
        if not right:
            right = text
        elif text.startswith("-"):
            right += f" - {text[1:]}"
        else:
            right += f" + {text}"
    return f"{left} = {right}"


def gradient_lines(program: Program, backward: Backward) -> tuple[str, ...]:
    """One line per gradient: intermediates' (in the order computed), then inputs'."""
    names = axis_names(program)
    by_target: dict[str, list[Contribution]] = {}
    for c in backward.contributions:
        by_target.setdefault(c.target, []).append(c)
    lines = []
    outputs = {o.level.name for o in program.outputs}
    for name in backward.order:
        if name not in outputs and name in by_target:
            lines.append(gradient_line(name, by_target[name], names))
    for name in program.inputs:
        if name in program.no_gradient:
            lines.append(f"{grad_name(name)} = None  (no_gradient)")
        elif name in by_target:
            lines.append(gradient_line(name, by_target[name], names))
        else:
            lines.append(f"{grad_name(name)} = 0")
    return tuple(lines)


def level_line(name: str, indices, terms, kind: str = "sum") -> str:
    """`v[F] = Σ_k expr + ...` for a level."""
    parts = []
    for term in terms:
        text = show(term.expr)
        if term.summed:
            wrapped = f"({text})" if isinstance(term.expr, sp.Add) else text
            text = f"Σ_{','.join(s.name for s in term.summed)} {wrapped}"
        parts.append(text)
    right = " + ".join(parts) if parts else "0"
    if kind == "logsumexp":
        (term,) = terms
        right = f"log Σ_{','.join(s.name for s in term.summed)} exp({show(term.expr)})"
    return f"{name}[{','.join(i.name for i in indices)}] = {right}"

"""Index notation for people: the derived gradients as docstring lines and `explain` text.

Gradient indices get the names the formula gives the tensor's axes (`grad_A[b,i,k]` for
`A[b,i,k]`); a summed index that would clash with one of them is primed.
"""

from __future__ import annotations

import sympy as sp
from sympy.printing.str import StrPrinter

from . import indexing, splits
from .derive import Backward, Contribution, Scatter, grad_name
from .model import Index, Level, Program, accesses, size_of


class IndexPrinter(StrPrinter):
    """SymPy's str printer with `A[b,i,k]` accesses and `[x >= y]` masks."""

    printmethod = "_symgrad_str"  # not `_sympystr`, which Indexed defines for itself

    def _print_step_ge(self, expr):
        return f"[{self._print(expr.args[0])} >= {self._print(expr.args[1])}]"

    def _print_step_le(self, expr):
        return f"[{self._print(expr.args[0])} <= {self._print(expr.args[1])}]"

    def _print_maximum(self, expr):
        return f"max({self._print(expr.args[0])}, {self._print(expr.args[1])})"

    def _print_minimum(self, expr):
        return f"min({self._print(expr.args[0])}, {self._print(expr.args[1])})"

    def _print_Max(self, expr):  # an index clamp, as written
        return f"max({', '.join(self._print(a) for a in expr.args)})"

    def _print_Min(self, expr):
        return f"min({', '.join(self._print(a) for a in expr.args)})"

    def _print_step_eq(self, expr):
        return f"[{self._print(expr.args[0])} == {self._print(expr.args[1])}]"

    def _print_index_value(self, expr):  # an index as a value: the index itself
        return self._print(expr.args[0])

    def _print_select(self, expr):
        cond, then, otherwise = (self._print(a) for a in expr.args)
        return f"where({cond}, {then}, {otherwise})"

    def _print_Symbol(self, expr):
        if expr.name == "_neg_inf":
            return "-inf"
        # an int attr or a let in index arithmetic, or a let as a value
        return expr.name.removeprefix("_int_").removeprefix("_letvalue_")

    def _print_Indexed(self, expr):  # `_iota[i]` is the index i itself
        if expr.base.label.name == indexing.IOTA:
            return self._print(expr.indices[0])
        return f"{expr.base.label}[{','.join(self._print(i) for i in expr.indices)}]"

    def _print_And(self, expr):
        return " and ".join(self._print(a) for a in sorted(expr.args, key=str))

    def _print_Or(self, expr):
        return " or ".join(f"({self._print(a)})" for a in sorted(expr.args, key=str))

    def _print_Not(self, expr):
        return f"not ({self._print(expr.args[0])})"


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
                if all(isinstance(i, sp.Symbol) for i in access.indices):  # not a lookup
                    names.setdefault(access.base.label.name, tuple(i.name for i in access.indices))
    for level in levels:  # index tensors read plainly only inside positions
        for position in level.gather.positions if level.gather is not None else ():
            for access in position.atoms(sp.Indexed):
                if all(isinstance(i, sp.Symbol) for i in access.indices):
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


def show_position(e: sp.Expr) -> str:
    """An affine position with its positive terms first: `i + u - r`, not `-r + i + u`."""
    if not isinstance(e, sp.Add):
        return show(e)
    terms = sorted(e.args, key=lambda t: (t.could_extract_minus_sign(), not t.free_symbols))
    text = show(terms[0])
    for term in terms[1:]:
        text += f" - {show(-term)}" if term.could_extract_minus_sign() else f" + {show(term)}"
    return text


def gather_line(level: Level) -> str:
    """`_g1[b,i,k,c] = A[b,2*i + k - 1,c]`: what a gather reads (0 outside A)."""
    gather = level.gather
    positions = ", ".join(show_position(p) for p in gather.positions)
    left = f"{level.name}[{','.join(show(i) for i in level.indices)}]"
    return f"{left} = {gather.source}[{positions}]  (0 outside {gather.source})"


def scatter_text(level: Level, shown: tuple[Index, ...]) -> str:
    """`Σ_{i,k: 2*i + k - 1 = p} _grad_g1[b,i,k,c]`: the transpose of a gather, with the
    index equations it solves visible."""
    gather = level.gather
    inner = gather.inner(level.indices)
    mapping = {gather.positions[n]: shown[n] for n in range(len(shown)) if n not in gather.computed}
    equations = [
        splits.equation(gather.positions[n], f"{show_position(gather.positions[n])} = {shown[n]}")
        for n in gather.computed
    ]
    grad = tensor_text(grad_name(level.name), [mapping.get(i, i) for i in level.indices])
    return f"Σ_{{{','.join(show(i) for i in inner)}: {', '.join(equations)}}} {grad}"


def tensor_text(name: str, indices) -> str:
    return f"{name}[{','.join(show(i) for i in indices)}]"


def gradient_lines(program: Program, backward: Backward) -> tuple[str, ...]:
    """One line per gradient: intermediates' (in the order computed), then inputs'.
    Gathers come first, as definitions: the gradients read them."""
    names = axis_names(program)
    by_target: dict[str, list[Contribution]] = {}
    for c in backward.contributions:
        by_target.setdefault(c.target, []).append(c)
    scatters: dict[str, list[Scatter]] = {}
    for s in backward.scatters:
        scatters.setdefault(s.target, []).append(s)
    levels = {lv.name: lv for lv in program.intermediates}
    lines = [gather_line(lv) for lv in program.intermediates if lv.gather is not None]
    outputs = {o.level.name for o in program.outputs}
    for name in backward.order:
        if name not in outputs and name in by_target:
            lines.append(gradient_line(name, by_target[name], names))
    for name in program.inputs:
        if name in program.index_inputs:
            lines.append(f"{grad_name(name)} = None  (index tensor)")
        elif name in program.no_gradient:
            lines.append(f"{grad_name(name)} = None  (no_gradient)")
        elif name in by_target or name in scatters:
            line = ""
            if name in by_target:
                line = gradient_line(name, by_target[name], names)
            shown = scatter_names(program, name, names)
            for s in scatters.get(name, []):
                text = scatter_text(levels[s.level], shown)
                left = f"{grad_name(name)}[{','.join(i.name for i in shown)}]"
                line = f"{line} + {text}" if line else f"{left} = {text}"
            lines.append(line)
        else:
            lines.append(f"{grad_name(name)} = 0")
    return tuple(lines)


def scatter_names(program: Program, name: str, names) -> tuple[Index, ...]:
    """Display indices of an input's axes: the names its plain reads give them, else
    p, q, ... for axes only read at computed positions."""
    rank = program.rank(name)
    given = names.get(name)
    if given is not None:
        return display_indices(given)
    taken = {str(i) for lv in program.intermediates for i in lv.indices}
    taken |= {name for name, _ in program.attrs} | {str(i) for i, _ in program.dims}
    taken |= {str(i) for i, _ in program.extents}
    for level in program.intermediates:
        if level.gather is not None and level.gather.source == name:
            chosen: list[str] = []
            spare = iter(c for c in "pqrstuvwxyz" if c not in taken)
            for n, position in enumerate(level.gather.positions):
                if n in level.gather.computed:
                    chosen.append(next(spare))
                else:
                    chosen.append(str(position))
            return display_indices(tuple(chosen))
    return display_indices(tuple(f"p{n}" for n in range(rank)))


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

"""`symgrad explain`: what must my gradient function return, and why?

For each input X (and each intermediate the gradient flows through), in three steps:

1. the partial derivatives of the formula w.r.t. an element `X[p']` with fresh, primed
   indices, as a partial times Kronecker deltas:
   `∂y[b,i,j]/∂A[b',i',k'] = Σ_k B[b,k,j] · δ(b,b')δ(i,i')δ(k,k')`;
2. the contraction with `grad_y` that `gradient()` must compute, and the same once the
   deltas are eliminated: `grad_A[b,i,k] = Σ_j grad_y[b,i,j]*B[b,k,j]`;
3. the TensorFlow code lowering produces: `grad_A = tf.einsum("bkj,bij->bik", B, grad_y)`.

Pure: `explain(program, fmt)` returns text. The math is assembled once from the derivation
(`derive.Backward`) and printed by one of two printers (plain text / LaTeX), so the formats
cannot disagree; markdown is the text printer inside fenced blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import sympy as sp
from sympy.printing.latex import LatexPrinter, greek_letters_set, tex_greek_dictionary

from . import ir
from .derive import Contribution, Partial, derive, grad_name
from .lower import lower
from .model import Level, Program
from .notation import (
    axis_names,
    display_indices,
    gradient_line,
    gradient_lines,
    rename,
    scatter_names,
    show,
)
from .render import code

FORMATS = ("text", "markdown", "latex")
FORWARD = "forward, in TensorFlow (the body of the generated _compute):"


# ------------------------------------------------------------------------------ printers


class _TextMath:
    """Index notation as in the generated docstrings: `A[b,i,k]`, `Σ_k`, `δ(i,i')`."""

    def index(self, symbol: sp.Expr) -> str:
        return show(symbol)

    def tensor(self, name: str, indices: list[str]) -> str:
        return f"{name}[{','.join(indices)}]"

    def grad(self, name: str) -> str:
        return grad_name(name)

    def expr(self, e: sp.Expr) -> str:
        return show(e)

    def sum(self, indices: list[str]) -> str:
        return f"Σ_{','.join(indices)} " if indices else ""

    def join(self, terms: list[str]) -> str:
        return _join(terms)

    def deltas(self, pairs: list[tuple[str, str]]) -> str:
        return "".join(f"δ({u},{v})" for u, v in pairs)

    def times(self, left: str, right: str) -> str:
        return f"{left} · {right}"

    def partial(self, numerator: str, denominator: str) -> str:
        return f"∂{numerator}/∂{denominator}"

    def group(self, text: str) -> str:
        return f"({text})"

    def note(self, text: str) -> str:
        """A remark after an equation, in words."""
        return f" {text}"

    def logsumexp(self, indices: list[str], body: str) -> str:
        return f"log Σ_{','.join(indices)} exp({body})"

    def extremum(self, kind: str, indices: list[str], body: str) -> str:
        return f"{kind}_{','.join(indices)} {body}"

    none = "None (no_gradient)"


class _TexExpr(LatexPrinter):
    """SymPy's LaTeX printer with symgrad's tensors, masks and max/min."""

    def _print_Symbol(self, expr, style="plain"):
        name = expr.name
        if name.startswith("|") and name.endswith("|"):  # the size of an index (`mean`)
            return rf"\lvert {self._print(sp.Symbol(name[1:-1]))} \rvert"
        stem = name.rstrip("'")
        greek = stem.lower() in greek_letters_set or stem in tex_greek_dictionary
        if len(stem) > 1 and not greek:
            # `eps`, `x1`, `batch`: one name, not a product of letters or a subscript
            return rf"\mathit{{{stem.replace('_', chr(92) + '_')}}}" + name[len(stem) :]
        return super()._print_Symbol(expr, style)

    def _print_Indexed(self, expr):
        indices = [self._print(i) for i in expr.indices]
        return f"{_tex_name(expr.base.label.name)}_{{{','.join(indices)}}}"

    def _print_step_ge(self, expr):
        return rf"\left[{self._print(expr.args[0])} \geq {self._print(expr.args[1])}\right]"

    def _print_step_le(self, expr):
        return rf"\left[{self._print(expr.args[0])} \leq {self._print(expr.args[1])}\right]"

    def _print_maximum(self, expr):
        return rf"\max\left({self._print(expr.args[0])}, {self._print(expr.args[1])}\right)"

    def _print_minimum(self, expr):
        return rf"\min\left({self._print(expr.args[0])}, {self._print(expr.args[1])}\right)"

    def _print_Max(self, expr):  # an index clamp
        return rf"\max\left({', '.join(self._print(a) for a in expr.args)}\right)"

    def _print_Min(self, expr):
        return rf"\min\left({', '.join(self._print(a) for a in expr.args)}\right)"


def lookups_note(positions) -> str:
    """`, or where tri, tid are read outside them` for positions that read index tensors:
    a lookup outside its index tensor reads zero too (symgrad/lookups.py)."""
    names = sorted({a.base.label.name for p in positions for a in p.atoms(sp.Indexed)})
    # A sampled read's positions and fractions (`_s2`) are the op's own intermediates,
    # read at exactly the indices they are computed over: never outside.
    names = [name for name in names if not name.startswith("_")]
    if not names:
        return ""
    return f", or where {', '.join(names)} {'is' if len(names) == 1 else 'are'} read outside"


def _tex_name(name: str) -> str:
    """`A` -> `A`; `weights` -> `\\mathit{weights}`; `grad_A` -> `\\bar{A}`."""
    if name.startswith("_grad"):  # the gradient of an intermediate `_s1`
        return rf"\overline{{{_tex_name(name[len('_grad') :])}}}"
    if name.startswith("grad_"):
        inner = _tex_name(name[len("grad_") :])
        return rf"\bar{{{inner}}}" if len(name) == len("grad_") + 1 else rf"\overline{{{inner}}}"
    if len(name) == 1:
        return name
    return rf"\mathit{{{name.replace('_', chr(92) + '_')}}}"


class _TexMath:
    """The same notation in LaTeX math (amsmath): `A_{b,i,k}`, `\\sum_{k}`, `\\delta_{i,i'}`."""

    def __init__(self) -> None:
        self._printer = _TexExpr()

    def index(self, symbol: sp.Expr) -> str:
        return self._printer.doprint(symbol)

    def tensor(self, name: str, indices: list[str]) -> str:
        return f"{_tex_name(name)}_{{{','.join(indices)}}}"

    def grad(self, name: str) -> str:
        return grad_name(name)

    def expr(self, e: sp.Expr) -> str:
        return self._printer.doprint(e)

    def sum(self, indices: list[str]) -> str:
        return rf"\sum_{{{','.join(indices)}}} " if indices else ""

    def join(self, terms: list[str]) -> str:
        return _join(terms)

    def deltas(self, pairs: list[tuple[str, str]]) -> str:
        return " ".join(rf"\delta_{{{u},{v}}}" for u, v in pairs)

    def times(self, left: str, right: str) -> str:
        return rf"{left} \, {right}"

    def partial(self, numerator: str, denominator: str) -> str:
        return rf"\frac{{\partial {numerator}}}{{\partial {denominator}}}"

    def group(self, text: str) -> str:
        return rf"\left({text}\right)"

    def note(self, text: str) -> str:
        """A remark after an equation, in words: text, not math."""
        return rf" \quad \text{{{_tex_text(text)}}}"

    def logsumexp(self, indices: list[str], body: str) -> str:
        return rf"\log \sum_{{{','.join(indices)}}} \exp\left({body}\right)"

    def extremum(self, kind: str, indices: list[str], body: str) -> str:
        return rf"\{kind}_{{{','.join(indices)}}} {body}"

    none = r"\text{None (no\_gradient)}"


# --------------------------------------------------------------------------- the math


@dataclass(frozen=True)
class Equation:
    """`left = right`, printed by one printer."""

    left: str
    right: str


@dataclass(frozen=True)
class Section:
    """The answer for one gradient (or the formula itself)."""

    title: str
    target: str = ""  # the tensor whose gradient this is ("" for the formula)
    partials: tuple[Equation, ...] = ()  # ∂level/∂X[p'] = partial · deltas, one per level
    contraction: Equation | None = None  # grad_X[p'] = Σ grad_level · ∂level/∂X[p']
    result: Equation | None = None  # after the deltas are eliminated
    notes: tuple[str, ...] = ()  # plain-text remarks (composite axes)
    code: tuple[str, ...] = ()  # the TensorFlow lines that compute it


class _Explainer:
    def __init__(self, program: Program, printer) -> None:
        self.program = program
        self.p = printer
        self.backward = derive(program)
        self.module = lower(program, self.backward)
        self.names = axis_names(program)
        # The docstring's gradient line of each input with one: `grad_A[...] = ...`.
        self.lines = {
            line.split("[", 1)[0]: line
            for line in gradient_lines(program, self.backward)
            if line.startswith("grad_") and "[" in line.split(" = ", 1)[0]
        }
        self.outputs = {o.level.name: o for o in program.outputs}
        self.levels: dict[str, Level] = {lv.name: lv for lv in program.intermediates}
        self.levels.update({o.level.name: o.level for o in program.outputs})

    # -- pieces --------------------------------------------------------------------

    def level_access(self, name: str, shown_as: str | None = None) -> str:
        """`y[b,i,j]`, or `y[b,(i,k),(j,l)]` for an output with composite axes; `shown_as`
        prints another tensor on the same indices (`grad_y[b,i,j]`)."""
        if name in self.outputs:
            groups = self.outputs[name].groups
            shown = [
                self.p.index(g[0])
                if len(g) == 1
                else "(" + ",".join(self.p.index(i) for i in g) + ")"
                for g in groups
            ]
        else:
            shown = [self.p.index(i) for i in self.levels[name].indices]
        return self.p.tensor(shown_as or name, shown)

    def level_equation(self, level: Level) -> Equation:
        parts = []
        for term in level.terms:
            body = self.p.expr(term.expr)
            if term.summed:
                if isinstance(term.expr, sp.Add) or body.startswith("-"):
                    body = self.p.group(body)
                body = self.p.sum([self.p.index(s) for s in term.summed]) + body
            parts.append(body)
        right = self.p.join(parts) if parts else "0"
        if level.kind == "logsumexp":
            (term,) = level.terms
            right = self.p.logsumexp([self.p.index(s) for s in term.summed], self.p.expr(term.expr))
        if level.kind in ("max", "min"):
            (term,) = level.terms
            indices = [self.p.index(s) for s in term.summed]
            right = self.p.extremum(level.kind, indices, self.p.expr(term.expr))
        if level.gather is not None:
            gather = level.gather
            right = self.p.tensor(gather.source, [self.p.expr(q) for q in gather.positions])
            right += self.p.note(f"(0 outside {gather.source}{lookups_note(gather.positions)})")
        return Equation(self.level_access(level.name), right)

    def primed(self, target: str, partials: list[Partial]) -> tuple[sp.Symbol, ...]:
        """Display names for the fresh indices of `target`: its axis names, primed until
        they clash with no index of the formula (`A[b,i,k]` -> `b',i',k'`)."""
        taken = {s.name for p in partials for s in p.partial.free_symbols}
        for p in partials:
            taken |= {s.name for s in self.levels[p.level].indices}
            taken |= {s.name for s in p.summed}
            taken |= {s.name for i in p.access.indices for s in i.free_symbols}
        chosen = []
        for name in self.names[target]:
            name += "'"
            while name in taken:
                name += "'"
            taken.add(name)
            chosen.append(sp.Symbol(name))
        return tuple(chosen)

    def partial_equation(self, level: str, parts: list[Partial], primed) -> Equation:
        """`∂y[b,i,j]/∂A[b',i',k'] = Σ_k B[b,k,j] · δ(b,b')δ(i,i')δ(k,k')` (+ one summand
        per access of A in the level's terms)."""
        summands = []
        for part in parts:
            mapping = dict(zip([q for _, q in part.deltas], primed, strict=True))
            deltas = self.p.deltas(
                [(self.p.index(u), self.p.index(mapping[q])) for u, q in part.deltas]
            )
            body = part.partial
            if body == 1:
                text = deltas
            else:
                shown = self.p.expr(body)
                if isinstance(body, sp.Add):
                    shown = self.p.group(shown)
                text = self.p.times(shown, deltas)
            summed = [self.p.index(s) for s in part.summed]
            if summed and len(parts) > 1:
                text = self.p.group(text)
            summands.append(self.p.sum(summed) + text)
        target = parts[0].target
        left = self.p.partial(
            self.level_access(level),
            self.p.tensor(target, [self.p.index(s) for s in primed]),
        )
        return Equation(left, self.p.join(summands))

    def contraction(self, target: str, levels: list[str], primed) -> Equation:
        """`grad_A[b',i',k'] = Σ_b,i,j grad_y[b,i,j] · ∂y[b,i,j]/∂A[b',i',k']`."""
        wrt = self.p.tensor(target, [self.p.index(s) for s in primed])
        parts = []
        for level in levels:
            indices = [self.p.index(i) for i in self.levels[level].indices]
            access = self.level_access(level)
            grad = self.level_access(level, shown_as=grad_name(level))
            parts.append(self.p.sum(indices) + self.p.times(grad, self.p.partial(access, wrt)))
        left = self.p.tensor(grad_name(target), [self.p.index(s) for s in primed])
        return Equation(left, " + ".join(parts))

    def result(self, target: str, contributions: list[Contribution]) -> Equation:
        """The gradient after elimination; in text exactly the generated docstring's line."""
        if isinstance(self.p, _TextMath):
            line = self.lines.get(grad_name(target))
            if line is None:  # an intermediate's gradient: not among the inputs' lines
                line = gradient_line(target, contributions, self.names)
            left, right = line.split(" = ", 1)
            return Equation(left, right)
        shown = display_indices(self.names[target])
        terms = [self.contribution(c, shown) for c in contributions]
        left = self.p.tensor(grad_name(target), [self.p.index(s) for s in shown])
        return Equation(left, self.p.join(terms))

    def contribution(self, c: Contribution, shown) -> str:
        mapping = rename(c, shown)
        grad = self.p.expr(c.grad.xreplace(mapping))
        body = c.partial.xreplace(mapping)
        sign = ""
        if body.could_extract_minus_sign():
            sign, body = "-", -body
        if body == 1:
            text = grad
        else:
            factor = self.p.expr(body)
            if isinstance(body, sp.Add):
                factor = self.p.group(factor)
            text = f"{grad} {factor}"
        if c.diagonal:
            pairs = [(self.p.index(mapping[a]), self.p.index(mapping[b])) for a, b in c.diagonal]
            text = f"{self.p.deltas(pairs)} {text}"
        if c.summed:
            text = self.p.sum([self.p.index(mapping[s]) for s in c.summed]) + text
        return f"- {text}" if sign else text

    # -- sections -----------------------------------------------------------------

    def sections(self) -> list[Section]:
        program = self.program
        out = [
            Section(
                "Formula",
                partials=tuple(
                    [self.level_equation(o.level) for o in program.outputs]
                    + [self.level_equation(lv) for lv in program.intermediates]
                ),
                # What the forward computes can differ in form from the formula (a
                # polynomial expanded, a sum in log space): show it.
                code=tuple(f"{s.target} = {code(s.value)}" for s in self.module.forward.steps),
            )
        ]
        by_target: dict[str, list[Contribution]] = {}
        for c in self.backward.contributions:
            by_target.setdefault(c.target, []).append(c)
        scattered = {s.target for s in self.backward.scatters}
        intermediates = [n for n in self.backward.order if n in by_target and n not in self.outputs]
        for name in [*intermediates, *program.inputs]:
            title = f"Gradient of {name}" + (" (intermediate)" if name in intermediates else "")
            shown = [self.p.index(s) for s in display_indices(self.names.get(name, ()))]
            if name in program.no_gradient:
                shown = [self.p.index(s) for s in scatter_names(program, name, self.names)]
                result = Equation(self.p.tensor(grad_name(name), shown), self.p.none)
                out.append(Section(title, name, result=result))
                continue
            if name not in by_target and name not in scattered:
                result = Equation(self.p.tensor(grad_name(name), shown), "0")
                out.append(Section(title, name, result=result))
                continue
            if name not in by_target:  # read only at computed positions: a scatter-add
                left, right = self.scatter_equation(name, self.lines[grad_name(name)])
                out.append(
                    Section(
                        title,
                        name,
                        result=Equation(left, right),
                        notes=("the transpose of a gather: a scatter-add of its gradient",),
                        code=tuple(_code_for(self.module, grad_name(name))),
                    )
                )
                continue
            partials = [p for p in self.backward.partials if p.target == name]
            primed = self.primed(name, partials)
            levels = list(dict.fromkeys(p.level for p in partials))
            notes = []
            for level in levels:
                output = self.outputs.get(level)
                if output and any(len(g) > 1 for g in output.groups):
                    split = ",".join(i.name for i in output.level.indices)
                    notes.append(
                        f"{grad_name(level)}[{split}] is {grad_name(level)} with its "
                        "composite axes split (a reshape)"
                    )
            out.append(
                Section(
                    title,
                    name,
                    partials=tuple(
                        self.partial_equation(lv, [p for p in partials if p.level == lv], primed)
                        for lv in levels
                    ),
                    contraction=self.contraction(name, levels, primed),
                    result=self.result(name, by_target[name]),
                    notes=tuple(notes),
                    code=tuple(_code_for(self.module, grad_name(name))),
                )
            )
        return out

    def scatter_equation(self, name: str, line: str) -> tuple[str, str]:
        """`grad_x[b,q,c] = Σ_{i,k: s*i + k - p = q} _grad_g1[b,i,k,c]`: in text the
        docstring's line; otherwise built with the printer."""
        if isinstance(self.p, _TextMath):
            left, right = line.split(" = ", 1)
            return left, right
        parts = []
        shown = scatter_names(self.program, name, self.names)
        for scatter in self.backward.scatters:
            if scatter.target != name:
                continue
            level = self.levels[scatter.level]
            gather = level.gather
            inner = gather.inner(level.indices)
            mapping = {
                gather.positions[n]: shown[n] for n in range(len(shown)) if n not in gather.computed
            }
            equations = ", ".join(
                f"{self.p.expr(gather.positions[n])} = {self.p.index(shown[n])}"
                for n in gather.computed
            )
            summed = self.p.sum([", ".join(self.p.index(i) for i in inner) + ": " + equations])
            grad = self.p.tensor(
                grad_name(level.name), [self.p.index(mapping.get(i, i)) for i in level.indices]
            )
            parts.append(summed + grad)
        left = self.p.tensor(grad_name(name), [self.p.index(s) for s in shown])
        return left, self.p.join(parts)

    def signature(self) -> str:
        """`gradient(op, grad_y) returns (grad_A, grad_B)`."""
        grads = ", ".join(grad_name(o.level.name) for o in self.program.outputs)
        returns = [
            "None" if n in self.program.no_gradient else grad_name(n) for n in self.program.inputs
        ]
        tuple_text = f"({', '.join(returns)}{',' if len(returns) == 1 else ''})"
        return f"gradient(op, {grads}) returns {tuple_text}"


def _join(terms: list[str]) -> str:
    """`a + b`, and `a - b` for a term printed with a leading minus."""
    text = ""
    for n, term in enumerate(terms):
        if n == 0:
            text = term
        elif term.startswith("- "):
            text += f" - {term[2:]}"
        elif term.startswith("-"):
            text += f" - {term[1:]}"
        else:
            text += f" + {term}"
    return text


def _code_for(module, target: str) -> list[str]:
    """The backward steps that compute `target` (and the temporaries it needs)."""
    kept = ir.prune(module.backward, (target,), set()).steps
    return [f"{s.target} = {code(s.value)}" for s in kept]


# ---------------------------------------------------------------------------- formats


def _intro(program: Program) -> str:
    """What every gradient below is: the vector-Jacobian product."""
    outs = [o.level.name for o in program.outputs]
    terms = " + ".join(f"Σ_{y} {grad_name(y)} · ∂{y}/∂X" for y in outs)
    sums = ", ".join(f"Σ_{y}" for y in outs)
    over = outs[0] if len(outs) == 1 else "that output"
    return f"grad_X = {terms} for each input X ({sums}: over every index of {over})"


def explain(program: Program, fmt: str = "text") -> str:
    """The explanation of one op's gradient in `fmt` ("text", "markdown" or "latex")."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    if fmt == "latex":
        return _latex(program)
    explainer = _Explainer(program, _TextMath())
    sections = explainer.sections()
    return (
        _markdown(program, explainer, sections)
        if fmt == "markdown"
        else _text(program, explainer, sections)
    )


def _text_block(section: Section) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(label, equation lines) groups, and code lines, for the text-like formats."""
    groups: list[tuple[str, list[str]]] = []
    if section.partials and section.title != "Formula":
        groups.append(
            (
                "partial derivatives (δ is the Kronecker delta):",
                [f"{e.left} = {e.right}" for e in section.partials],
            )
        )
    if section.contraction:
        c = section.contraction
        groups.append(("contracted with the incoming gradient:", [f"{c.left} = {c.right}"]))
    if section.result:
        r = section.result
        label = "deltas eliminated:" if section.contraction else "gradient:"
        groups.append((label, [f"{r.left} = {r.right}", *section.notes]))
    return groups, list(section.code)


def _let_lines(program: Program) -> list[str]:
    """The op's `let` integers, as computed when the op is called."""
    if not program.lets:
        return []
    lines = ["let (integers computed when the op is called):"]
    for name, value in program.lets:
        lines.append(f"  {name} = {_IntegerPrinter().doprint(value)}")
    return lines


class _IntegerPrinter(sp.printing.str.StrPrinter):
    """An integer expression as written in a spec: `(K - 1) // 2`, attrs by name."""

    def _print_floor(self, expr):
        numerator, denominator = sp.fraction(sp.together(expr.args[0]))
        return f"({self._print(numerator)}) // {self._print(denominator)}"

    def _print_Symbol(self, expr):
        return expr.name.removeprefix("_int_")


def _text(program: Program, explainer: _Explainer, sections: list[Section]) -> str:
    formula, *gradients = sections
    lines = ["Formula:", *(f"  {f}" for f in program.formulas)]
    lines += [f"  {line}" for line in _let_lines(program)]
    if program.intermediates:
        lines.append("  where (intermediates symgrad computes once):")
        lines += [f"    {e.left} = {e.right}" for e in formula.partials[len(program.outputs) :]]
    lines += [f"  {FORWARD}", *(f"    {c}" for c in formula.code)]
    lines += [
        "",
        f"{explainer.signature()}, the vector-Jacobian product:",
        f"  {_intro(program)}",
        "",
    ]
    for section in gradients:
        lines.append(f"{section.title}:")
        groups, code_lines = _text_block(section)
        for label, equations in groups:
            lines.append(f"  {label}")
            lines += [f"    {e}" for e in equations]
        if code_lines:
            lines.append("  TensorFlow:")
            lines += [f"    {c}" for c in code_lines]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _markdown(program: Program, explainer: _Explainer, sections: list[Section]) -> str:
    formula, *gradients = sections
    lines = [f"# Gradient of {program.op}" if program.op != "Formula" else "# Gradient", ""]
    lines += ["```text", *program.formulas, *_let_lines(program)]
    if program.intermediates:
        lines.append("where (intermediates symgrad computes once):")
        lines += [f"  {e.left} = {e.right}" for e in formula.partials[len(program.outputs) :]]
    lines += [
        "```",
        "",
        FORWARD[0].upper() + FORWARD[1:],
        "",
        "```python",
        *formula.code,
        "```",
        "",
        f"`{explainer.signature()}`, the vector-Jacobian product:",
        "",
        f"    {_intro(program)}",
        "",
    ]
    for section in gradients:
        lines += [f"## {section.title}", ""]
        groups, code_lines = _text_block(section)
        for label, equations in groups:
            lines += [label[0].upper() + label[1:], "", "```text", *equations, "```", ""]
        if code_lines:
            lines += ["TensorFlow:", "", "```python", *code_lines, "```", ""]
    return "\n".join(lines).rstrip() + "\n"


LEGEND = (
    r"Here $\bar{X}$ is \texttt{grad\_X} $= \partial L / \partial X$, the gradient of the "
    r"loss; $\delta$ is the Kronecker delta; an index on the right that is not on the left "
    r"is summed."
)


def _latex(program: Program) -> str:
    """A LaTeX fragment (needs amsmath): `\\input` it, or paste it into a document."""
    explainer = _Explainer(program, _TexMath())
    formula, *gradients = explainer.sections()
    lines = [
        f"% symgrad explain: {program.op}" if program.op != "Formula" else "% symgrad explain",
        "% A LaTeX fragment; the document needs \\usepackage{amsmath}.",
        r"\paragraph{Formula}",
        *_align([*formula.partials]),
        _tex_text(FORWARD[0].upper() + FORWARD[1:]),
        r"\begin{verbatim}",
        *formula.code,
        r"\end{verbatim}",
        LEGEND,
        "",
    ]
    for section in gradients:
        suffix = " (intermediate)" if section.title.endswith("(intermediate)") else ""
        lines.append(rf"\paragraph{{Gradient of ${_tex_name(section.target)}${suffix}}}")
        equations = [*section.partials]
        if section.contraction:
            equations.append(section.contraction)
        if section.result:
            equations.append(section.result)
        lines += _align(equations)
        for note in section.notes:
            lines.append(_tex_text(note))
        if section.code:
            lines += ["TensorFlow:", r"\begin{verbatim}", *section.code, r"\end{verbatim}"]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _align(equations: list[Equation]) -> list[str]:
    rows = [f"  {e.left} &= {e.right}" for e in equations]
    return [r"\begin{align*}", " \\\\\n".join(rows), r"\end{align*}"]


def _tex_text(text: str) -> str:
    """Plain text for a LaTeX paragraph: special characters escaped."""
    return re.sub(r"([_#%&$])", r"\\\1", text)

"""`symgrad explain`: what must my gradient function return?

For each input: the partial derivative of the formula with its Kronecker deltas, the
contraction with `grad` once the deltas are eliminated, and the TensorFlow code lowering
produces. Pure: returns text.
"""

from __future__ import annotations

import re

import sympy as sp

from .derive import Partial, grad_name
from .lower import Lowerer, lower
from .model import Program
from .notation import axis_names, display_indices, gradient_line, level_line, show
from .render import code

FORMATS = ("text", "markdown", "latex")


def _partial_text(p: Partial, names) -> str:
    shown = display_indices(names[p.target])
    mapping = dict(zip([d[1] for d in p.deltas], shown, strict=True))
    deltas = "*".join(f"δ({show(u)},{mapping[q]})" for u, q in p.deltas)
    left = f"∂{p.level}[{','.join(i.name for i in _level_indices(p))}]"
    target = f"∂{p.target}[{','.join(s.name for s in shown)}]"
    summed = f"Σ_{','.join(s.name for s in p.summed)} " if p.summed else ""
    partial = show(p.partial)
    partial = f"({partial})" if isinstance(p.partial, sp.Add) else partial
    return f"{left} / {target} = {summed}{partial} * {deltas}  (for {show(p.access)})"


_LEVEL_INDICES: dict[int, tuple] = {}


def _level_indices(p: Partial):
    return _LEVEL_INDICES.get(id(p), ())


def sections(program: Program) -> list[tuple[str, list[str], list[str]]]:
    """(title, math lines, code lines) per part of the answer."""
    lowerer = Lowerer(program)
    backward = lowerer.backward
    module = lower(program)
    names = axis_names(program)
    levels = {o.level.name: o.level for o in program.outputs}
    levels.update({lv.name: lv for lv in program.intermediates})
    for p in backward.partials:
        _LEVEL_INDICES[id(p)] = levels[p.level].indices
    out: list[tuple[str, list[str], list[str]]] = []
    formula_lines = [*(o.formula for o in program.outputs)]
    if program.intermediates:
        formula_lines.append("where (intermediates symgrad computes once):")
        formula_lines += [
            "  " + level_line(lv.name, lv.indices, lv.terms, lv.kind)
            for lv in program.intermediates
        ]
    out.append(("Formula", formula_lines, []))
    by_target: dict[str, list] = {}
    for c in backward.contributions:
        by_target.setdefault(c.target, []).append(c)
    for name in [*[n for n in backward.order if n in by_target], *program.inputs]:
        if name in program.no_gradient:
            out.append((f"Gradient of {name}", [f"{grad_name(name)} = None (no_gradient)"], []))
            continue
        if name not in by_target:
            if name in program.inputs:
                out.append((f"Gradient of {name}", [f"{grad_name(name)} = 0"], []))
            continue
        partial_lines = [
            _partial_text(p, names) for p in backward.partials if p.target == name
        ]
        lines = ["partial derivatives (δ is the Kronecker delta):"]
        lines += ["  " + line for line in partial_lines]
        lines.append("contracted with grad, deltas eliminated:")
        lines.append("  " + gradient_line(name, by_target[name], names))
        code_lines = _code_for(module, grad_name(name))
        out.append((f"Gradient of {name}", lines, code_lines))
    return out


def _code_for(module, target: str) -> list[str]:
    """The backward steps that compute `target` (and the temporaries it needs)."""
    steps = list(module.backward.steps)
    needed = {target}
    kept = []
    for step in reversed(steps):
        if step.target in needed:
            kept.append(step)
            needed |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code(step.value)))
    return [f"{s.target} = {code(s.value)}" for s in reversed(kept)]


def explain(program: Program, fmt: str = "text") -> str:
    parts = sections(program)
    lines: list[str] = []
    for title, math, code_lines in parts:
        if fmt == "markdown":
            lines.append(f"## {title}")
            lines.append("")
            lines.append("```text")
            lines += math
            lines.append("```")
            if code_lines:
                lines.append("")
                lines.append("```python")
                lines += code_lines
                lines.append("```")
            lines.append("")
        elif fmt == "latex":
            lines.append(f"% {title}")
            lines += [_latex(line) for line in math if "=" in line]
            if code_lines:
                lines += [f"% {c}" for c in code_lines]
            lines.append("")
        else:
            lines.append(f"{title}:")
            lines += [f"  {line}" for line in math]
            if code_lines:
                lines.append("  TensorFlow:")
                lines += [f"    {c}" for c in code_lines]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _latex(line: str) -> str:
    """A display-math rendering of one line of index notation."""
    text = line.strip()
    text = re.sub(r"Σ_([A-Za-z0-9_',]+)", lambda m: r"\sum_{" + m.group(1) + "}", text)
    text = re.sub(r"δ\(([^,()]+),([^()]+)\)", r"\\delta_{\1\2}", text)
    text = text.replace("∂", r"\partial ").replace("*", r" \cdot ")
    text = re.sub(r"\[([^\[\]]+)\]", r"_{\1}", text)
    return f"\\[ {text} \\]"

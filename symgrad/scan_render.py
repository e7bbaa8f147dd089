"""A recurrence op's module: its steps' functions, generated like any op's module and
embedded under a prefix, then the scan (`ir.Scan`) around them in the target's idiom
(`templates/scan_<target>.py.j2`).

A step's module is rendered by the ordinary pipeline; only the functions `_compute` and
`_backward` and what they reference are kept, every top-level name prefixed (`_step_`,
`_init_`), so one module holds both steps without clashes.
"""

from __future__ import annotations

import ast
import re
from dataclasses import replace

from . import ir
from .render import environment

# Top-level names an embedded step reads from the module around it, neither renamed nor
# copied: the budget, so that a scan or tiling inside a step follows the module's
# MAX_TEMP_BYTES at call time (the including templates define it).
SHARED = frozenset({"MAX_TEMP_BYTES"})


def embed(source: str, prefix: str) -> tuple[list[str], str]:
    """The imports and the definitions `_compute` and `_backward` need of a module, with
    every top-level name `n` renamed `{prefix}{n}` (prefix like `_step`), but for the
    names in `SHARED`, read from the module the step is embedded in."""
    tree = ast.parse(source)
    defined: dict[str, ast.stmt] = {}
    imports: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            defined[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    defined[target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            imports.append(ast.unparse(node))
    wanted: set[str] = set()
    todo = ["_compute", "_backward"]
    while todo:
        name = todo.pop()
        if name in wanted or name not in defined or name in SHARED:
            continue
        wanted.add(name)
        for sub in ast.walk(defined[name]):
            if isinstance(sub, ast.Name) and sub.id in defined:
                todo.append(sub.id)

    def rename(name: str) -> str:
        return f"{prefix}{name}" if name.startswith("_") else f"{prefix}_{name}"

    # Renamed in the module's own (formatted, lint-clean) text rather than unparsed from
    # the tree: ast.unparse writes `tuple((x for x in xs))`, which is not lint-clean.
    # A name is a whole word not after a dot (an attribute of another object keeps it).
    pattern = re.compile(
        r"(?<![\w.])("
        + "|".join(re.escape(n) for n in sorted(wanted, key=len, reverse=True))
        + r")(?!\w)"
    )
    kept = []
    seen: set[int] = set()
    for node in tree.body:
        names = (
            [node.name]
            if isinstance(node, ast.FunctionDef)
            else [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        )
        if any(n in wanted for n in names) and id(node) not in seen:
            seen.add(id(node))
            text = ast.get_source_segment(source, node)
            kept.append(pattern.sub(lambda m: rename(m.group(1)), text))
    return imports, "\n\n\n".join(kept)


def render(scan: ir.Scan, target: str, steps: dict[str, str]) -> str:
    """The module source of a scan for a target; `steps` maps a step's prefix to its
    module's source."""
    from .targets import TARGETS

    imports: list[str] = []
    code = []
    for prefix, source in steps.items():
        found, text = embed(source, prefix)
        imports += [i for i in found if i not in imports]
        code.append(text)
    chosen = TARGETS[target]
    return _unique_imports(
        environment(chosen)
        .get_template(f"scan_{target}.py.j2")
        .render(
            s=scan,
            imports=imports,
            steps="\n\n\n".join(code),
            content_hash="{content_hash}",
            cut_inputs=[
                n for n, a in zip(scan.inputs, scan.cut_axes, strict=True) if a is not None
            ],
            whole_inputs=[n for n, a in zip(scan.inputs, scan.cut_axes, strict=True) if a is None],
            cut=dict(zip(scan.inputs, scan.cut_axes, strict=True)),
            grads=[f"grad_{o}" for o in scan.outputs],
            differentiable=[n for n in scan.inputs if n not in scan.no_gradient],
            recent={
                r.input: r
                for st in (scan.body, scan.init)
                if st is not None
                for r in st.reads
                if r.kind == "recent"
            },
            shifted=any(
                r.shift for st in (scan.body, scan.init) if st is not None for r in st.reads
            ),
        )
    )


def module_text(op, source_name: str, target: str, *, associative: bool | None = None) -> str:
    """A recurrence op's module for a target: its steps compiled and rendered like any
    op's, embedded, and the scan around them; formatted, validated, stamped. A linear
    first-order recurrence is an associative scan instead (`assoc_scan`) when
    `associative` is true; None takes the target's default (`assoc_scan.BY_DEFAULT`);
    false keeps the sequential scan (benchmarks compare the two)."""
    from . import assoc_scan, pipeline
    from .coupled import CoupledPlan, step_source
    from .recurrence import plan
    from .spec import snake_case

    if associative is None:
        associative = target in assoc_scan.BY_DEFAULT
    linear = assoc_scan.linear(op) if associative else None
    if linear is not None:  # h[t] = a[t] * h[t-1] + b[t]: an associative scan
        return assoc_scan.module_text(op, linear, source_name, target)
    found = plan(op)
    steps = {}
    for prefix, spec in (("_step", found.body), ("_init", found.init)):
        if isinstance(found, CoupledPlan) and spec is not None:  # one stacked state
            steps[prefix] = step_source(found, target)
        elif spec is not None:
            steps[prefix] = _step_source(spec, target)
    scan = replace(found.scan, **_step_lines(found.body))
    name = f"{snake_case(op.name)}.py"
    source = render(scan, target, steps)
    source = source.replace(f"# source: {op.source}", f"# source: {source_name} [ops.{op.name}]")
    formatted = pipeline.format_source(source, name)
    try:
        compile(formatted, name, "exec")
    except SyntaxError as exc:  # pragma: no cover - would be a symgrad bug
        raise pipeline.SymgradError(
            f"generated code for {op.name} does not compile: {exc}"
        ) from None
    pipeline._check_structure(formatted, op.name)
    return pipeline.stamp(formatted)


def _step_lines(spec) -> dict:
    """The step's formulas and gradient lines for the module's docstring (of the inner
    step, when the step is itself a recurrence: a two-index recurrence's row)."""
    from . import pipeline
    from .recurrence import is_recurrence, plan

    if is_recurrence(spec):
        inner = plan(spec)
        lines = _step_lines(inner.body)
        return {
            "gradient_lines": lines["gradient_lines"],
            "step_formulas": (*spec.formulas, "whose step is", *lines["step_formulas"]),
        }
    module = pipeline.compile_op(spec)
    return {"gradient_lines": module.gradient_lines, "step_formulas": module.formulas}


def _step_source(spec, target: str) -> str:
    """A step's module source with `_compute` and `_backward` in the step convention:
    an ordinary op's, or, when the step is itself a recurrence (the row of a two-index
    recurrence), its scan module with adapters (its checkpoints are the saved values)."""
    from . import pipeline
    from .recurrence import is_recurrence, plan

    if not is_recurrence(spec):
        return pipeline.render(pipeline.compile_op(spec), target)
    inner = plan(spec)
    steps = {
        prefix: _step_source(step, target)
        for prefix, step in (("_step", inner.body), ("_init", inner.init))
        if step is not None
    }
    scan = replace(inner.scan, **_step_lines(inner.body))
    text = render(scan, target, steps)
    # Only the definitions are renamed (the adapter below takes their names); the text
    # stays as rendered, not unparsed, so it stays lint-clean.
    text = re.sub(r"^def (_compute|_backward)\(", r"def _scan\1(", text, flags=re.MULTILINE)
    return text + ADAPTER


ADAPTER = """


def _compute(*_args, **_attrs):
    _outputs, _checkpoints = _scan_compute(*_args, **_attrs)
    return _outputs, (_checkpoints,)


def _backward(*_args, **_attrs):
    _n, _m = len(INPUTS), len(OUTPUTS)
    _grads = _args[_n + _m + 1 :]
    return _scan_backward(*_args[:_n], _args[_n + _m], *_grads, **_attrs)
"""


def _unique_imports(text: str) -> str:
    """The module without repeated top-level import lines: the template imports `math`
    and its framework itself, and a nested step's module (a recurrence whose step is a
    recurrence) brings the same imports again."""
    seen: set[str] = set()
    lines = []
    for line in text.split("\n"):
        if line.startswith(("import ", "from ")):
            if line in seen:
                continue
            seen.add(line)
        lines.append(line)
    return "\n".join(lines)

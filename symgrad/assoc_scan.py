"""Linear first-order recurrences, `h[t] = a[t] * h[t-1] + b[t]` elementwise in the other
indices, computed by an associative (parallel) scan instead of a sequential one.

Recognised from the derived step: the recurrent equation with its read of the previous
state made an input (`h_prev`) is an ordinary op; symgrad derives it, and when its partial
in `h_prev` is elementwise and does not read `h_prev` the recurrence is linear with

    a = that partial (derived, never written by hand),
    b = the equation with the previous state read as 0.

Three ordinary ops are then compiled and embedded like a scan's steps:
- `_coef`: (a, b) at every position from the inputs (the scan index kept);
- `_out`: the equations after the recurrence (Mamba's `y`), with the state an input;
- `_init`: the first position's step of `where(t == 0, h0, ...)` (the scan's own).

The pairs (a, b) compose associatively, `(a1, b1) then (a2, b2) = (a1*a2, a2*b1 + b2)`, so
the states of a chunk of positions are a log-depth scan of its pairs applied to the state
before the chunk. The gradient is the adjoint, itself a linear recurrence run the other
way, `gh[t] = g[t] + a[t+1] * gh[t+1]`, by the same scan; then `grad_a = gh * h[t-1]` and
`grad_b = gh` go into the inputs through `_coef`'s derived vector-Jacobian product.

Memory: the sequence runs in chunks of C positions, C from MAX_TEMP_BYTES and the state's
size at call time (one chunk when everything fits); only the state before each chunk is
kept, and the backward recomputes each chunk's states from it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from . import ir
from .errors import SymgradError
from .parse import Access, IndexRef
from .recurrence import (
    Plan,
    _accesses,
    _decide,
    _equations,
    _value_indices,
    _without_vanished_attrs,
    plan,
    reads_itself,
    text,
)
from .spec import OpSpec


@dataclass(frozen=True)
class Linear:
    """A linear recurrence's ops: the coefficients, the later equations, and the plan of
    its sequential scan (whose `init` step gives the first state)."""

    plan: Plan
    coef: OpSpec  # inputs -> (a, b), laid out like the state
    out: OpSpec | None  # inputs and the state -> the later outputs
    coef_cut: tuple[int | None, ...]  # per coef input, the axis of the scan index
    out_cut: tuple[int | None, ...]  # per out input, the axis of the scan index
    state_axis: int  # the scan index's axis in the state
    a_text: str  # the derived coefficient, for the docstring


def linear(op: OpSpec) -> Linear | None:
    """The linear form of a recurrence op, or None when it is not a linear first-order
    recurrence elementwise in its other indices (it then keeps the sequential scan)."""
    try:
        return _linear(op)
    except SymgradError:
        return None


def _linear(op: OpSpec) -> Linear | None:
    from .coupled import CoupledPlan

    found = plan(op)
    if isinstance(found, CoupledPlan):
        return None  # several recurrent tensors (one stacked carry): the sequential scan
    scan = found.scan
    if scan.depth != 1 or scan.depth_sizes:
        return None
    reads = found.scan.body.reads
    if [r.kind for r in reads if r.kind != "input"] != ["lag"] or any(r.shift for r in reads):
        return None
    if found.init is not None and any(r.kind != "input" for r in scan.init.reads):
        return None
    equations = _equations(op)
    eq, later = equations[0], equations[1:]
    t = scan.index
    lhs = eq.output_indices
    axis = lhs.index(t)
    # every input is read at t itself or not along t (a lagged input read would cross
    # chunk boundaries); the scan index is no value
    for e in equations:
        for access in _accesses(e.rhs):
            if access.tensor == eq.output or access.lookups:
                continue
            for p in access.positions:
                if t in _names(p) and not (isinstance(p, IndexRef) and p.name == t):
                    return None
    rhs = eq.rhs
    if scan.init is not None:
        rhs = _decide(rhs, _Shim(t, op), first=False)
    if any(ref.name == t for ref in _value_indices(rhs)):
        return None
    for e in later:
        if any(ref.name == t for ref in _value_indices(e.rhs)):
            return None
    # the self reads: h at the same other indices, one position back (or on)
    for access in _accesses(rhs):
        if access.tensor != eq.output:
            continue
        for k, (p, i) in enumerate(zip(access.positions, lhs, strict=True)):
            if k != axis and not (isinstance(p, IndexRef) and p.name == i):
                return None

    taken = {a.tensor for e in equations for a in _accesses(e.rhs)} | {e.output for e in equations}
    prev, a_name, b_name = (_fresh(n, taken) for n in (f"{eq.output}prev", "coefa", "coefb"))
    indices = ", ".join(lhs)

    def swap(value: str):
        def inner(access: Access) -> str | None:
            return value if access.tensor == eq.output else None

        return inner

    step_text = text(rhs, swap(f"{prev}[{indices}]"))
    found_texts = _partial(op, f"{eq.output}[{indices}] = {step_text}", prev, scan)
    if found_texts is None:
        return None
    a_text, b_text = found_texts
    rebuilt = f"{eq.output}[{indices}] = ({a_text}) * {prev}[{indices}] + ({b_text})"
    if not _same_step(op, scan, f"{eq.output}[{indices}] = {step_text}", rebuilt, prev):
        return None
    inputs = scan.inputs
    formulas = (f"{a_name}[{indices}] = {a_text}", f"{b_name}[{indices}] = {b_text}")
    used = _used(formulas)
    coef = _spec(op, "Coef", formulas, tuple(n for n in inputs if n in used), (a_name, b_name))
    out = None
    if later:
        formulas = tuple(e.text for e in later)
        used = _used(formulas)
        out_inputs = (*(n for n in inputs if n in used), eq.output)
        out = _spec(op, "Out", formulas, out_inputs, tuple(e.output for e in later))
    from .pipeline import compile_op

    for spec in (coef, out):
        if spec is not None:
            compile_op(spec)  # raises (and the sequential scan is kept) if it cannot
    cut = dict(zip(scan.inputs, scan.cut_axes, strict=True))
    cut[eq.output] = axis
    return Linear(
        plan=found,
        coef=coef,
        out=out,
        coef_cut=tuple(cut[n] for n in coef.inputs),
        out_cut=tuple(cut[n] for n in out.inputs) if out else (),
        state_axis=axis,
        a_text=a_text,
    )


def _partial(op: OpSpec, formula: str, prev: str, scan: ir.Scan) -> tuple[str, str] | None:
    """The derived partial of the step in the previous state, and the step with the
    previous state read as zero, as formula text, when the partial is elementwise and
    free of the state (the recurrence is linear); else None."""
    import sympy as sp

    from .derive import derive
    from .model import accesses, build
    from .notation import show

    spec = _spec(op, "Step", (formula,), (*scan.inputs, prev), None)
    spec = replace(spec, inputs=tuple(n for n in spec.inputs if n in _used((formula,))))
    program = build(spec)
    if program.intermediates or len(program.outputs) != 1:
        return None
    level = program.outputs[0].level
    parts = [p for p in derive(program).partials if p.target == prev]
    if not parts or level.kind != "sum":
        return None

    def summed(body: str, indices) -> str:
        return f"sum({body}, {', '.join(map(str, indices))})" if indices else body

    texts = []
    for part in parts:
        if tuple(part.access.indices) != tuple(level.indices) or part.level != level.name:
            return None
        if any(str(x.base.label) == prev for x in accesses(part.partial)):
            return None  # the partial reads the state: not linear
        texts.append(summed(show(part.partial), part.summed))
    rest = []
    for term in level.terms:
        zero = {x: sp.Integer(0) for x in accesses(term.expr) if str(x.base.label) == prev}
        expr = term.expr.xreplace(zero)
        if expr != 0:
            rest.append(summed(show(expr), term.summed))
    if not rest:
        return None
    a_text = texts[0] if len(texts) == 1 else " + ".join(f"({t})" for t in texts)
    return a_text, " + ".join(rest)


def _same_step(op: OpSpec, scan: ir.Scan, step: str, rebuilt: str, prev: str) -> bool:
    """Whether `a * prev + b`, rebuilt from the printed coefficients, is the step itself.

    The coefficients travel as formula text (printed from SymPy, parsed again), so the
    round trip is checked: both are built and their terms compared symbolically. Anything
    that does not compare equal (a sum whose index was renamed, a different term split)
    keeps the sequential scan, never a different recurrence."""
    import sympy as sp

    from .model import build

    def terms(formula: str):
        spec = _spec(op, "Check", (formula,), (*scan.inputs, prev), None)
        spec = replace(spec, inputs=tuple(n for n in spec.inputs if n in _used((formula,))))
        program = build(spec)
        if program.intermediates or len(program.outputs) != 1:
            return None
        return program.outputs[0].level.terms

    try:
        ours, theirs = terms(step), terms(rebuilt)
    except SymgradError:
        return False
    if ours is None or theirs is None or any(t.summed for t in (*ours, *theirs)):
        return False
    difference = sum(t.expr for t in ours) - sum(t.expr for t in theirs)
    return sp.expand(difference) == 0


def _spec(op: OpSpec, suffix: str, formulas, inputs, outputs) -> OpSpec:
    used = _used(formulas)
    spec = OpSpec(
        name=f"{op.name}{suffix}",
        formulas=tuple(formulas),
        inputs=tuple(inputs),
        attrs=tuple((n, k) for n, k in op.attrs if n in used),
        no_gradient=tuple(n for n in op.no_gradient if n in inputs),
        source=op.source,
        sizes=op.sizes,
        ranges=op.ranges,
        max_temp_bytes=op.max_temp_bytes,
        outputs=outputs,
        lets=op.lets,
    )
    return _without_vanished_attrs(spec)


class _Shim(SimpleNamespace):
    """What `_decide` reads of a recurrence's analysis."""

    def __init__(self, index: str, op: OpSpec) -> None:
        super().__init__(index=index, op=op)

    def fail(self, message, col, equation=None):
        return SymgradError(message)


def _names(node) -> set[str]:
    from .parse import index_names

    return set(index_names(node))


def _used(formulas) -> set[str]:
    import re

    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", " ".join(formulas)))


def _fresh(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "_"
    return name


def is_linear(op: OpSpec) -> bool:
    return reads_itself(_equations(op)[0]) and linear(op) is not None


# ----------------------------------------------------------------------------- rendering

# State-sized temporaries per position of a chunk (the pairs, the states, the adjoint and
# the scan's own), by which MAX_TEMP_BYTES is divided; measured on the selective scan's
# training step (TensorFlow's gathers and selects and its while_loop hold more).
PER_POSITION = {"jax": 16, "pytorch": 16, "tensorflow": 32}

# Targets whose generated modules take the associative scan by default. TensorFlow keeps
# the sequential scan: measured on the selective scan's training step at L = 8192 (CPU),
# its associative scan's TensorArray stacks and transposes peaked at 5.8x the inputs and
# outputs, over the memory bound, where the sequential scan with sqrt(L) checkpoints
# stays at 1.7x and was within 1.2x of its time. `module_text(..., associative=True)`
# still gives TensorFlow's (tested, and compared in benchmarks/recurrences.py).
BY_DEFAULT = ("jax", "pytorch")

# Targets whose scan takes a chunk again, with each product of a kept as a mantissa and
# a power of two, where its states came out non-finite (products of a over many
# positions overflow where a growing state that starts at zero does not). TensorFlow's
# associative scan, generated only on request, does not.
RESCANS = ("jax", "pytorch")

SCAN_KIND = {
    "jax": "jax.lax.associative_scan",
    "tensorflow": "a log-depth (Hillis-Steele) scan",
    "pytorch": "a log-depth (Hillis-Steele) scan",
}


def module_text(op: OpSpec, lin: Linear, source_name: str, target: str) -> str:
    """The module of a linear recurrence for a target: the coefficient, later-output and
    initial-step ops compiled and embedded, and the chunked associative scan around
    them; formatted, validated, stamped."""
    from . import pipeline, scan_render
    from .render import environment
    from .spec import snake_case
    from .targets import TARGETS

    lines = tuple(
        line
        for spec in (lin.coef, lin.out)
        if spec is not None
        for line in pipeline.compile_op(spec).gradient_lines
    )
    scan = replace(lin.plan.scan, gradient_lines=lines)
    specs = {"_coef": lin.coef, "_out": lin.out, "_init": lin.plan.init}
    imports: list[str] = []
    code = []
    for prefix, spec in specs.items():
        if spec is None:
            continue
        found, text_ = scan_render.embed(pipeline.render(pipeline.compile_op(spec), target), prefix)
        imports += [i for i in found if i not in imports]
        code.append(text_)
    cut = dict(zip(scan.inputs, scan.cut_axes, strict=True))
    differentiable = [n for n in scan.inputs if n not in scan.no_gradient]
    contrib: dict[str, list[tuple[str, int, int | None]]] = {n: [] for n in differentiable}
    for kind, spec in (("coef", lin.coef), ("out", lin.out)):
        if spec is None:
            continue
        for k, n in enumerate(spec.inputs):
            if n in contrib:
                contrib[n].append((kind, k, cut[n]))
    init_args = None
    if scan.init is not None:
        init_args = [(r.name, r.axis) for r in scan.init.reads]
        for k, r in enumerate(scan.init.reads):
            if r.name in contrib:
                contrib[r.name].append(("init", k, r.axis))
    later_axes = scan.body.output_axes[1:]
    source = (
        environment(TARGETS[target])
        .get_template(f"assoc_{target}.py.j2")
        .render(
            s=scan,
            imports=imports,
            steps="\n\n\n".join(code),
            content_hash="{content_hash}",
            cut_inputs=[n for n, a in cut.items() if a is not None],
            whole_inputs=[n for n, a in cut.items() if a is None],
            cut=cut,
            grads=[f"grad_{o}" for o in scan.outputs],
            differentiable=differentiable,
            shifted=False,
            coef_args=list(zip(lin.coef.inputs, lin.coef_cut, strict=True)),
            coef_attrs=[n for n, _ in lin.coef.attrs],
            coef_formulas=lin.coef.formulas,
            out_args=(
                list(zip(lin.out.inputs[:-1], lin.out_cut[:-1], strict=True)) if lin.out else None
            ),
            out_attrs=[n for n, _ in lin.out.attrs] if lin.out else [],
            out_formulas=lin.out.formulas if lin.out else (),
            out_outputs=(
                list(zip(scan.body.outputs[1:], later_axes, strict=True)) if lin.out else []
            ),
            init_args=init_args,
            state_axis=lin.state_axis,
            contrib=contrib,
            per_position=PER_POSITION[target],
            scan_kind=SCAN_KIND[target],
            rescans=target in RESCANS,
        )
    )
    source = scan_render._unique_imports(source)
    name = f"{snake_case(op.name)}.py"
    source = source.replace(f"# source: {op.source}", f"# source: {source_name} [ops.{op.name}]")
    formatted = pipeline.format_source(source, name)
    try:
        compile(formatted, name, "exec")
    except SyntaxError as exc:  # pragma: no cover - would be a symgrad bug
        raise SymgradError(f"generated code for {op.name} does not compile: {exc}") from None
    pipeline._check_structure(formatted, op.name)
    return pipeline.stamp(formatted)

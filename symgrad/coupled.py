"""Coupled recurrences: several recurrent tensors scanned together, each reading its own
and the others' earlier positions, and equations after them that read them at earlier
positions too. RWKV-4's WKV is the example: a running numerator and denominator,

    num[b,t,c] = exp(w[c]) * num[b,t-1,c] + exp(k[b,t,c]) * v[b,t,c]
    den[b,t,c] = exp(w[c]) * den[b,t-1,c] + exp(k[b,t,c])
    y[b,t,c] = (num[b,t-1,c] + exp(u[c] + k[b,t,c]) * v[b,t,c]) / (den[b,t-1,c] + ...)

The states (every tensor read at an earlier position) form one carry: they share their
indices apart from the scan index, and are stacked along a new last axis, so the scan
(`ir.Scan`, `templates/scan_<target>.py.j2`) is the one of a single state. The step is an
ordinary op over one position with one output per state and per op output, and one input
per past state read (`num_lag1[b,c]`); a small adapter in the module (`adapter`) unstacks
the carry into those inputs and stacks the new states. The gradient is the step's
derived vector-Jacobian product run backwards, as for one state.

Within a position the equations are ordered by what they read at that position; a cycle
(two tensors each reading the other at the same position) cannot be ordered and is
refused with a caret.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import sympy as sp

from . import composite_states, ir
from .errors import SymgradError
from .parse import Access, Equation, IndexRef, index_names
from .recurrence import (
    Plan,
    _accesses,
    _equations,
    _size_names,
    _symbolic,
    _value_indices,
    _without_vanished_attrs,
    reads_itself,
    step_sizes,
    text,
)
from .spec import OpSpec


@dataclass(frozen=True)
class CoupledPlan(Plan):
    """A plan whose state is several recurrent tensors (`states`) stacked along a last
    axis, or one, the carry itself; `lags` maps (state, lag) to the step input that reads
    it."""

    states: tuple[str, ...] = ()
    lags: tuple[tuple[str, int, str], ...] = ()  # (state, lag, step input name)

    @property
    def stacked(self) -> bool:
        """Whether the carry stacks the states along a last axis (several of them): a
        single state has no axis of size 1, which XLA lays out apart and copies around
        its loops."""
        return len(self.states) > 1


def is_coupled(op: OpSpec) -> bool:
    """Whether a recurrence op needs the coupled scan: several equations read their own
    tensor, or an equation reads another's tensor other than as the single scan does (the
    recurrent tensor, at plain indices, from an equation after it)."""
    return _coupling(op) is not None


def _coupling(op: OpSpec) -> str | None:
    """What makes `op` a coupled recurrence (`is_coupled`), said for messages; None when
    the single scan serves it."""
    equations = _equations(op)
    recurrent = [e.output for e in equations if reads_itself(e)]
    if len(recurrent) > 1:
        return f"{' and '.join(repr(n) for n in recurrent)} each read themselves"
    defined = {e.output for e in equations}
    for e in equations:
        for access in _accesses(e.rhs):
            if access.tensor not in defined or access.tensor == e.output:
                continue
            if access.tensor not in recurrent:
                return f"{e.output!r} reads {access.tensor!r}, which does not recur"
            if not all(isinstance(p, IndexRef) for p in access.positions):
                return f"{e.output!r} reads {access.tensor!r} at another position"
    return None


class _Coupled:
    def __init__(self, op: OpSpec) -> None:
        self.op = op
        self.equations = _equations(op)
        self.defined = {e.output: e for e in self.equations}
        self.taken = (
            {a.tensor for e in self.equations for a in _accesses(e.rhs)}
            | set(self.defined)
            | {n for n, _ in op.attrs}
            | {n for n, _ in op.lets}
        )

    def fail(self, message: str, col: int | None, equation: Equation) -> SymgradError:
        return SymgradError(message, where=self.op.source, formula=equation.text, column=col)

    def fresh(self, name: str) -> str:
        while name in self.taken:
            name += "_"
        self.taken.add(name)
        return name

    # -- the scan index --------------------------------------------------------------

    def scan_index(self) -> str:
        first = next(e for e in self.equations if reads_itself(e))
        lhs = first.output_indices
        found = set()
        for access in _accesses(first.rhs):
            if access.tensor != first.output:
                continue
            for k, (p, i) in enumerate(zip(access.positions, lhs, strict=False)):
                if not (isinstance(p, IndexRef) and p.name == i) and i in index_names(p):
                    found.add(i)
        if len(found) != 1:
            raise self.fail(
                f"{first.output!r} is read at shifted positions of {len(found)} indices; "
                "coupled recurrences run along one index",
                first.output_col,
                first,
            )
        index = found.pop()
        for e in self.equations:
            if len(set(e.output_indices)) != len(e.output_indices):
                raise self.fail(
                    f"in a coupled recurrence every tensor has one plain index per axis: "
                    f"{e.output!r} repeats an index",
                    e.output_col,
                    e,
                )
            if index not in e.output_indices:
                raise self.fail(
                    f"every equation of a coupled recurrence has the scan index {index!r}",
                    e.output_col,
                    e,
                )
            for ref in _value_indices(e.rhs):
                if ref.name == index:
                    raise self.fail(
                        f"the scan index {index!r} is used as a value (an initial state, "
                        f"where({index} == 0, ..)?); the op is a coupled recurrence "
                        f"({_coupling(self.op)}), which reads zero before the start "
                        "(initial states there: not yet)",
                        ref.col,
                        e,
                    )
        return index

    # -- reads -------------------------------------------------------------------------

    def lag(self, e: Equation, access: Access) -> int:
        """e with a read of a defined tensor at t - e (negative: a later position)."""
        axis = self.defined[access.tensor].output_indices.index(self.index)
        if len(access.positions) != len(self.defined[access.tensor].output_indices):
            raise self.fail(
                f"{access.tensor!r} is read with {len(access.positions)} indices; it has "
                f"{len(self.defined[access.tensor].output_indices)}",
                access.col,
                e,
            )
        t = sp.Symbol(self.index, integer=True)

        def fail(message, col):
            return self.fail(message, col, e)

        position = _symbolic(access.positions[axis], fail)
        lag = sp.expand(t - position)
        if lag.free_symbols:
            raise self.fail(
                f"{access.tensor!r} is read at {self.index} - ({lag}); a coupled recurrence "
                f"reads its tensors at constant offsets of {self.index}",
                access.col,
                e,
            )
        for k, p in enumerate(access.positions):
            if k != axis and self.index in index_names(p):
                raise self.fail(
                    f"{access.tensor!r} is read with the scan index {self.index!r} on another axis",
                    access.col,
                    e,
                )
        return int(lag)

    def analyse(self) -> None:
        """The lag of every read of a defined tensor, the states, the direction, and
        the order of the equations within a position."""
        self.reads: list[tuple[Equation, Access, int]] = []
        for e in self.equations:
            for access in _accesses(e.rhs):
                if access.tensor in self.defined:
                    if access.lookups:
                        raise self.fail("a recurrence reads no index tensors", access.col, e)
                    lag = self.lag(e, access)
                    if lag == 0 and access.tensor == e.output:
                        raise self.fail(
                            f"{e.output!r} reads itself at the same position: a recurrence "
                            "reads its own tensor only at earlier (or only at later) positions",
                            access.col,
                            e,
                        )
                    self.reads.append((e, access, lag))
        signs = {lag > 0 for _, _, lag in self.reads if lag != 0}
        if len(signs) > 1:
            e, access, _ = next(r for r in self.reads if r[2] != 0)
            raise self.fail(
                f"a coupled recurrence reads both before and after {self.index}: it cannot "
                "be ordered",
                access.col,
                e,
            )
        self.reverse = signs == {False}
        self.states = tuple(
            e.output
            for e in self.equations
            if any(a.tensor == e.output and lag != 0 for _, a, lag in self.reads)
        )
        rest = {s: self.rest(self.defined[s]) for s in self.states}
        first = self.states[0]
        for s in self.states[1:]:
            if rest[s] != rest[first]:
                raise self.fail(
                    f"the recurrent tensors {first!r} and {s!r} are scanned together and "
                    f"have the same indices apart from {self.index!r} "
                    f"({', '.join(rest[first])} and {', '.join(rest[s])} here)",
                    self.defined[s].output_col,
                    self.defined[s],
                )
        self.order = self.ordered()

    def ordered(self) -> list[Equation]:
        """The equations in an order where each comes after what it reads at the same
        position; a cycle is refused at the read that closes it."""
        after = {
            e.output: [(a, x) for x, a, lag in self.reads if x is e and lag == 0]
            for e in self.equations
        }
        done: list[Equation] = []
        visiting: list[str] = []

        def visit(e: Equation) -> None:
            if e in done:
                return
            visiting.append(e.output)
            for access, reader in after[e.output]:
                if access.tensor in visiting:
                    cycle = " -> ".join([*visiting[visiting.index(access.tensor) :], access.tensor])
                    raise self.fail(
                        f"{reader.output!r} reads {access.tensor!r} at the same position "
                        f"and {access.tensor!r} depends on it there ({cycle}): the equations "
                        "cannot be ordered within a position",
                        access.col,
                        reader,
                    )
                visit(self.defined[access.tensor])
            visiting.pop()
            done.append(e)

        for e in self.equations:
            visit(e)
        return done

    def rest(self, e: Equation) -> list[str]:
        return [i for i in e.output_indices if i != self.index]

    # -- the step ------------------------------------------------------------------------

    def cut(self, e: Equation, access: Access) -> None:
        """Record along which axis input `access.tensor` is read at the scan position."""
        plain = []
        for k, p in enumerate(access.positions):
            if isinstance(p, IndexRef) and p.name == self.index:
                plain.append(k)
            elif self.index in index_names(p):
                raise self.fail(
                    f"{access.tensor!r} is read at a position computed from the scan index "
                    f"{self.index!r}; a recurrence reads its inputs at {self.index} itself",
                    access.col,
                    e,
                )
        if len(plain) > 1:
            raise self.fail(
                f"{access.tensor!r} is read on a diagonal of {self.index!r}", access.col, e
            )
        axis = plain[0] if plain else None
        if self.cuts.get(access.tensor, axis) != axis:
            raise self.fail(
                f"{access.tensor!r} is read both at {self.index} and elsewhere along another "
                "axis; a recurrence reads each input at the scan position along one axis, "
                "or whole",
                access.col,
                e,
            )
        self.cuts[access.tensor] = axis

    def step(self, outputs: tuple[str, ...]) -> tuple[list[str], tuple[str, ...]]:
        """The step's formulas and its outputs (the states, then the op's other outputs)."""
        step_outputs = (*self.states, *(o for o in outputs if o not in self.states))
        read_now = {a.tensor for _, a, lag in self.reads if lag == 0}
        now = {
            e.output: self.fresh(f"{e.output}_now")
            for e in self.equations
            if e.output in read_now and e.output in step_outputs
        }
        self.cuts: dict[str, int | None] = {}
        self.lag_names: dict[tuple[str, int], str] = {}
        formulas = []
        for e in self.order:

            def fail(message, col, e=e):
                return self.fail(message, col, e)

            def swap(access: Access, e=e) -> str | None:
                if access.tensor not in self.defined:
                    if access.lookups:
                        raise self.fail("a recurrence reads no index tensors", access.col, e)
                    self.cut(e, access)
                    axis = self.cuts[access.tensor]
                    kept = [text(p) for k, p in enumerate(access.positions) if k != axis]
                    return f"{access.tensor}[{', '.join(kept)}]"
                defining = self.defined[access.tensor]
                axis = defining.output_indices.index(self.index)
                kept = ", ".join(text(p) for k, p in enumerate(access.positions) if k != axis)
                lag = abs(self.lag(e, access))
                if lag == 0:
                    return f"{now.get(access.tensor, access.tensor)}[{kept}]"
                key = (access.tensor, lag)
                if key not in self.lag_names:
                    self.lag_names[key] = self.fresh(f"{access.tensor}_lag{lag}")
                return f"{self.lag_names[key]}[{kept}]"

            body = text(e.rhs, swap)
            lhs = ", ".join(self.rest(e))
            if e.output in now:
                formulas.append(f"{now[e.output]}[{lhs}] = {body}")
                formulas.append(f"{e.output}[{lhs}] = {now[e.output]}[{lhs}]")
            else:  # a composite axis stays one (what an equation reads is split)
                formulas.append(f"{composite_states.lhs(e, self.index, fail)} = {body}")
        return formulas, step_outputs

    def state_size(self, index: str, e: Equation) -> tuple[tuple[str | None, int], tuple]:
        """The input axis that sizes state axis `index`, and what its size is divided by
        (an index read only inside a composite axis, or sized by its range)."""

        def plain(name: str) -> tuple[str, int] | None:
            try:
                return self.plain_source(name, e, e.output_col)
            except SymgradError:
                return None

        found = plain(index)
        if found is not None:
            return found, ()

        def fail(message, col=e.output_col):
            return self.fail(message, col, e)

        found = composite_states.state_size(
            self.op, self.equations, set(self.defined), index, plain, fail
        )
        if found is None:
            raise self.fail(
                f"index {index!r} of a recurrence must be read plainly by some input axis "
                "(it sizes the scan's state), inside a composite read whose other indices "
                "are, or have a range from input shapes",
                e.output_col,
                e,
            )
        return found

    def plain_source(self, index: str, e: Equation, col: int) -> tuple[str, int]:
        """An op input axis that `index` reads plainly (it sizes the state's axis)."""
        for eq in self.equations:
            for access in _accesses(eq.rhs):
                if access.tensor in self.defined:
                    continue
                for axis, p in enumerate(access.positions):
                    if isinstance(p, IndexRef) and p.name == index:
                        return access.tensor, axis
        raise self.fail(
            f"index {index!r} of a recurrence must be read plainly by some input axis "
            "(it sizes the scan's state)",
            col,
            e,
        )


def plan(op: OpSpec) -> CoupledPlan:
    """The scan and the step op of a coupled recurrence op. SymgradError (with a caret) on
    what cannot be ordered or is not supported."""
    c = _Coupled(op)
    c.index = c.scan_index()
    c.analyse()
    if any(name == c.index for name, _ in op.ranges):
        first = c.defined[c.states[0]]
        raise c.fail(
            f"the scan index {c.index!r} takes its size from an input, not a range",
            first.output_col,
            first,
        )
    outputs = op.outputs or tuple(e.output for e in c.equations)
    formulas, step_outputs = c.step(outputs)
    used = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", " ".join(formulas)))
    op_inputs = op.inputs or tuple(
        dict.fromkeys(
            a.tensor for e in c.equations for a in _accesses(e.rhs) if a.tensor not in c.defined
        )
    )
    lags = sorted({lag for _, lag in c.lag_names})
    lag_inputs = [
        c.lag_names[(s, lag)] for lag in lags for s in c.states if (s, lag) in c.lag_names
    ]
    step_inputs = [n for n in op_inputs if n in used] + lag_inputs
    spec = OpSpec(
        name=f"{op.name}Step",
        formulas=tuple(formulas),
        inputs=tuple(step_inputs),
        attrs=tuple((n, k) for n, k in op.attrs if n in used | _size_names(op)),
        no_gradient=tuple(n for n in op.no_gradient if n in used),
        source=op.source,
        sizes=tuple((i, s) for i, s in op.sizes if i != c.index),
        ranges=op.ranges,
        max_temp_bytes=op.max_temp_bytes,
        outputs=step_outputs,
        lets=op.lets,
    )
    lets, ranges = step_sizes(op, c.cuts, c.index, set(step_inputs))
    spec = _without_vanished_attrs(replace(spec, lets=lets, ranges=ranges))
    stack = c.fresh("_".join(c.states) + "_stack" if len(c.states) > 1 else c.states[0] + "_")
    reads = [ir.ScanRead("input", n, c.cuts.get(n)) for n in op_inputs if n in used]
    reads += [ir.ScanRead("lag", f"_lag{lag}", None, lag) for lag in lags]
    body_outputs = (stack, *(o for o in step_outputs if o in outputs))
    body = ir.ScanStep(
        prefix="_step",
        reads=tuple(reads),
        outputs=body_outputs,
        output_axes=(
            0,
            *(composite_states.axis_of(c.defined[o], c.index) for o in body_outputs[1:]),
        ),
        attrs=tuple(n for n, _ in spec.attrs),
    )
    first = c.defined[c.states[0]]
    state_sizes = [c.state_size(i, first) for i in c.rest(first)]
    state_axes = tuple(axes for axes, _ in state_sizes)
    divisors = tuple(d for _, d in state_sizes)
    length = c.plain_source(c.index, first, first.index_col(c.index))
    ranks = []
    for n in op_inputs:
        found = [len(a.positions) for e in c.equations for a in _accesses(e.rhs) if a.tensor == n]
        ranks.append(found[0])
    scan = ir.Scan(
        op=op.name,
        source=op.source,
        formulas=op.formulas,
        index=c.index,
        reverse=c.reverse,
        inputs=tuple(op_inputs),
        ranks=tuple(ranks),
        cut_axes=tuple(c.cuts.get(n) for n in op_inputs),
        attrs=tuple(
            ir.Attr(n, k, {"float": "float", "int": "int", "bool": "bool"}[k]) for n, k in op.attrs
        ),
        no_gradient=op.no_gradient,
        outputs=tuple(outputs),
        output_ranks=tuple(len(c.defined[o].groups) for o in outputs),
        state=stack,
        internal=True,
        # several states are stacked along a last axis of the carry, its size their number;
        # a single state is the carry itself (no axis of size 1, which XLA lays out apart
        # and copies around its loops)
        state_axes=(*state_axes, (None, len(c.states))) if len(c.states) > 1 else state_axes,
        state_divisors=(
            ((*divisors, ()) if len(c.states) > 1 else divisors) if any(divisors) else ()
        ),
        length=length,
        depth=max(lags),
        depth_sizes=(),
        body=body,
        init=None,
        max_temp_bytes=op.max_temp_bytes,
    )
    return CoupledPlan(
        scan,
        spec,
        None,
        states=c.states,
        lags=tuple(
            (s, lag, name)
            for (s, lag), name in sorted(
                c.lag_names.items(), key=lambda item: (item[0][1], c.states.index(item[0][0]))
            )
        ),
    )


# ----------------------------------------------------------------------------- rendering

_STACK = {"tensorflow": "tf.stack", "pytorch": "torch.stack", "jax": "jnp.stack"}
_ZEROS = {"tensorflow": "tf.zeros_like", "pytorch": "torch.zeros_like", "jax": "jnp.zeros_like"}


def adapter(found: CoupledPlan, inner_inputs, inner_outputs, target: str) -> str:
    """The step functions `_compute` and `_backward` in the scan's convention (one stacked
    state) around the step op's `_coupled_compute` and `_coupled_backward` (one input per
    past state read, one output per state). A single state is not stacked: the carry is
    the state itself."""
    scan = found.scan
    step = scan.body
    stack, zeros = _STACK[target], _ZEROS[target]
    single = not found.stacked
    lag_of = {name: (s, lag) for s, lag, name in found.lags}
    params = [r.name for r in step.reads]

    def part(name: str, j: int) -> str:  # state j of a stacked carry `name`
        return name if single else f"{name}[..., {j}]"

    inner_args = []
    for n in inner_inputs:
        if n in lag_of:
            s, lag = lag_of[n]
            inner_args.append(part(f"_lag{lag}", found.states.index(s)))
        else:
            inner_args.append(n)
    states = ", ".join(f"_outputs[{inner_outputs.index(s)}]" for s in found.states)
    if not single:
        states = f"{stack}([{states}], -1)"
    others = "".join(f", _outputs[{inner_outputs.index(o)}]" for o in step.outputs[1:])
    grads = []
    for o in inner_outputs:
        terms = []
        if o in found.states:
            terms.append(part("_grad_0", found.states.index(o)))
        if o in step.outputs[1:]:
            terms.append(f"_grad_{step.outputs.index(o)}")
        grads.append(" + ".join(terms))
    returns = []
    for r in step.reads:
        if r.kind == "input":
            returns.append(f"_found[{inner_inputs.index(r.name)}]")
            continue
        parts = []
        for j, s in enumerate(found.states):
            name = next((n for s2, lag, n in found.lags if s2 == s and lag == r.lag), None)
            parts.append(
                f"_found[{inner_inputs.index(name)}]"
                if name is not None
                else f"{zeros}({part(r.name, j)})"
            )
        returns.append(parts[0] if single else f"{stack}([{', '.join(parts)}], -1)")
    outs = [f"_out_{k}" for k in range(len(step.outputs))]
    if single:
        compute_doc = "The step op's outputs, its state first (the carry)."
        backward_doc = "The step op's vector-Jacobian product, its gradient of the past state last."
    else:
        compute_doc = (
            "The step on the stacked states: unstacked into the step op's past states, its new\n"
            "    states stacked along the last axis."
        )
        backward_doc = (
            "The step op's vector-Jacobian product, its gradients of the past states stacked."
        )
    gs = [f"_grad_{k}" for k in range(len(step.outputs))]
    args = ", ".join(inner_args)
    return f'''


def _compute({", ".join(params)}, **_attrs):
    """{compute_doc}"""
    _outputs, _saved = _coupled_compute({args}, **_attrs)
    return ({states}{others}), (_outputs, _saved)


def _backward({", ".join([*params, *outs])}, _outputs, _saved, {", ".join(gs)}, **_attrs):
    """{backward_doc}"""
    _found = _coupled_backward(
        {args}, *_outputs, *_saved, {", ".join(grads)}, **_attrs
    )
    return ({", ".join(returns)},)
'''


def step_source(found: CoupledPlan, target: str) -> str:
    """The step's module source: the step op's, its `_compute` and `_backward` renamed,
    with the adapter to one stacked state."""
    import ast

    from . import pipeline

    module = pipeline.compile_op(found.body)
    source = pipeline.render(module, target)
    constants = {}
    for node in ast.parse(source).body:
        target_ = node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target_, ast.Name) and target_.id in ("INPUTS", "OUTPUTS"):
            constants[target_.id] = ast.literal_eval(node.value)
    source = re.sub(r"^def (_compute|_backward)\(", r"def _coupled\1(", source, flags=re.MULTILINE)
    return source + adapter(found, constants["INPUTS"], constants["OUTPUTS"], target)


# ----------------------------------------------------------------------------- explain, check


def recurrence_lines(found: CoupledPlan, op: OpSpec) -> list[str]:
    """The coupled recurrence and its adjoint, in words (plain text)."""
    scan = found.scan
    t = scan.index
    way = "from the last position back" if scan.reverse else "from the first position on"
    back = "first" if scan.reverse else "last"
    sign = "+" if scan.reverse else "-"
    states = ", ".join(found.states)
    lines = [f"Coupled recurrence along {t} ({way}; reads before the start read zero):"]
    lines += [f"  {f}" for f in op.formulas]
    carry = f", stacked along a last axis ({scan.state})" if found.stacked else f" ({scan.state})"
    lines.append(
        f"  computed by one scan whose state is {states}{carry}; the step below at each "
        f"position of {t}, where"
    )
    for s, lag, name in found.lags:
        lines.append(f"    {name} is {s} at {t} {sign} {lag} (zero before the start)")
    for read in scan.body.reads:
        if read.kind == "input" and read.axis is not None:
            lines.append(f"    {read.name} is read at position {t} (axis {read.axis})")
    lines.append(
        "  the states are internal: kept as one window of states per chunk of about sqrt(L) "
        "positions, recomputed chunk by chunk for the gradient"
    )
    lines += [
        "",
        f"Adjoint recurrence (the gradient; run from the {back} position):",
        (
            f"  ḡ_s at {t}, for each state s ({states}) = the gradient reaching s[{t}] from "
            f"its direct uses + for each step at {t} {'-' if scan.reverse else '+'} e that "
            "reads s at lag e, that step's gradient of it (grad_s_lag<e>);"
        ),
        (
            f"  the step's vector-Jacobian product at {t}, fed ḡ_s as grad_s, gives the "
            f"gradients of the inputs at {t} (cut inputs) or adds to them (inputs read whole)."
        ),
        "",
        "The step (an op over one position; its gradient derived like every op's):",
    ]
    return lines


def reference(found: CoupledPlan, op: OpSpec, attrs: dict):
    """The formula's forward as a loop of dense step evaluations, in NumPy: the step's
    equations at each position, the past states from what the loop computed before."""
    import numpy as np
    import tensorflow as tf

    from .check import with_lets
    from .reference import evaluate_op

    scan = found.scan
    int_attrs = frozenset(n for n, kind in op.attrs if kind == "int")
    spec = found.body
    built: dict = {}  # the step's lets, per shapes

    def run(arrays):
        named = dict(zip(scan.inputs, arrays, strict=True))
        length = named[scan.length[0]].shape[scan.length[1]]
        order = range(length - 1, -1, -1) if scan.reverse else range(length)
        axes = scan.state_axes[:-1] if found.stacked else scan.state_axes
        shape = composite_states.shape_of(
            axes, scan.state_divisors, lambda n, a: named[n].shape[a], attrs
        )
        history: dict[str, list] = {s: [] for s in found.states}
        results: dict[str, list] = {o: [] for o in spec.outputs}
        for t in order:
            given = {}
            for read in scan.body.reads:
                if read.kind == "input":
                    value = named[read.name]
                    given[read.name] = value if read.axis is None else np.take(value, t, read.axis)
            for s, lag, name in found.lags:
                past = history[s]
                given[name] = past[-lag] if lag <= len(past) else np.zeros(shape, arrays[0].dtype)
            tensors = {n: tf.constant(v) for n, v in given.items() if n in spec.inputs}
            shapes = {n: v.shape for n, v in given.items() if n in spec.inputs}
            outputs = evaluate_op(
                spec.formulas,
                tensors,
                with_lets(spec, {n: attrs[n] for n in scan.body.attrs}, shapes, built),
                outputs=set(spec.outputs),
                int_attrs=int_attrs | {n for n, _ in spec.lets},
            )
            computed = [f.split("[", 1)[0].strip() for f in spec.formulas]
            names = [n for n in computed if n in spec.outputs]
            for name, value in zip(names, outputs, strict=True):
                results[name].append(np.asarray(value))
                if name in history:
                    history[name].append(np.asarray(value))
        placed = []
        for name in scan.outputs:
            stack = np.stack(results[name])
            if scan.reverse:
                stack = stack[::-1]
            axis = scan.body.output_axes[scan.body.outputs.index(name)]
            placed.append(np.moveaxis(stack, 0, axis))
        return placed

    return run


__all__ = ["CoupledPlan", "is_coupled", "plan", "reference", "step_source"]

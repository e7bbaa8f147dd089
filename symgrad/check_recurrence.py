"""`symgrad check` for recurrences: sizes and the formula's forward of an op whose
equation reads its own tensor at earlier positions.

The formula's forward is a plain loop over the positions of the scan index, each position
a dense evaluation of the step's equations (`reference.evaluate_op`, sharing nothing
with lowering or with the generated scan), the past states read from what the loop
computed before (zero before the start). The gradient check is the usual adjoint test
against central differences of the generated forward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .check import Sizes, plan_sizes, with_lets
from .composite_states import shape_of
from .errors import SymgradError
from .model import build
from .recurrence import is_recurrence, plan
from .spec import OpSpec


@dataclass(frozen=True)
class _Index:
    name: str


@dataclass(frozen=True)
class _Level:
    name: str


@dataclass(frozen=True)
class _Output:
    level: _Level
    groups: tuple[tuple[_Index, ...], ...]


@dataclass(frozen=True)
class Program:
    """What `check` reads of a program, for a recurrence op (which has no `model.Program`:
    its step has)."""

    inputs: tuple[str, ...]
    no_gradient: tuple[str, ...]
    outputs: tuple[_Output, ...]
    attrs: tuple[tuple[str, str], ...]
    source: str
    index_inputs: tuple[str, ...] = ()
    compared: tuple[str, ...] = ()  # inputs the step reads only in == and != (compared.py)


def program(op: OpSpec) -> Program:
    found = plan(op)
    scan = found.scan
    step = _step_program(found.body)
    axes = dict(zip(scan.body.outputs, scan.body.output_axes, strict=True))
    outputs = []
    for name in scan.outputs:
        out = next(o for o in step.outputs if o.level.name == name)
        groups = [tuple(_Index(i.name.rstrip("'")) for i in g) for g in out.groups]
        groups.insert(axes[name], (_Index(scan.index),))
        outputs.append(_Output(_Level(name), tuple(groups)))
    compared = tuple(name for name in step.compared if name in scan.inputs)
    return Program(
        scan.inputs, scan.no_gradient, tuple(outputs), op.attrs, op.source, compared=compared
    )


def sizes(op: OpSpec, attrs: dict, shapes: dict | None = None, given: dict | None = None) -> Sizes:
    """The step's sizes (distinct per index), and a distinct length for the scan index;
    `shapes` (input -> shape, --shape) and `given` (index -> size, --size) fix some: the
    step sees an input without its cut axis, whose size is the scan's length."""
    found = plan(op)
    scan = found.scan
    cut = dict(zip(scan.inputs, scan.cut_axes, strict=True))
    recent = _recent_reads(scan)
    step_shapes, lengths = {}, {}
    for name, shape in (shapes or {}).items():
        at = cut[name]
        if name not in recent:  # a window of recent positions has a shape of its own
            step_shapes[name] = shape if at is None else shape[:at] + shape[at + 1 :]
        if at is not None:
            lengths[f"--shape {name} (axis {at})"] = shape[at]
    given = dict(given or {})
    if scan.index in given:
        lengths[f"--size {scan.index}"] = given.pop(scan.index)
    if len(set(lengths.values())) > 1:
        raise SymgradError(
            f"the scan length ({scan.index!r}) differs: "
            + ", ".join(f"{k} = {v}" for k, v in lengths.items()),
            where=op.source,
        )
    if is_recurrence(found.body):  # a two-index recurrence: its step is a scan along the row
        step = sizes(found.body, attrs, step_shapes, given)
        program = None
    else:
        program = build(found.body)
        step = plan_sizes(program, attrs, shapes=step_shapes, sizes=given)
    # The past states have the state's shape (the step alone does not know it: an RNN's
    # h_lag1[b,e] is summed over e against W[d,e]).

    # the inputs only the initial step reads, planned once at the step's index sizes
    initial = _initial_shapes(found, step, attrs, step_shapes, program)
    step = replace(step, shapes={**initial, **step.shapes})

    def size(name: str | None, axis: int) -> int:
        if name is None:  # the axis that stacks coupled states: its size is their number
            return axis
        at = cut[name]
        if name in recent:  # the step reads its window: [depth, the other axes]
            return step.shapes[recent[name].name][1 + axis - (axis > at)]
        return step.shapes[name][axis - (at is not None and axis > at)]

    state = shape_of(scan.state_axes, scan.state_divisors, size, attrs)
    depth = scan.depth + sum(c * (size(n, a) - 1) for c, n, a in scan.depth_sizes)
    # coupled: each past state read is the carry's, less the axis stacking several
    stacked = getattr(found, "stacked", False)
    fixed = {name: state[:-1] if stacked else state for _, _, name in getattr(found, "lags", ())}
    for read in scan.body.reads + (scan.init.reads if scan.init else ()):
        if read.kind == "lag":
            fixed[read.name] = state
        elif read.kind == "window":
            fixed[read.name] = (depth, *state)
        elif read.kind == "recent":
            window = read.depth + sum(c * (size(n, a) - 1) for c, n, a in read.depth_sizes)
            fixed[read.name] = (window, *step.shapes[read.name][1:])
    if fixed and program is not None:
        fixed = {n: s for n, s in fixed.items() if n in program.inputs}
        step = plan_sizes(program, attrs, shapes={**step_shapes, **fixed}, sizes=given)
        step = replace(step, shapes={**initial, **step.shapes})
    length = next(iter(lengths.values()), max([*step.indices.values(), 4]) + 1)
    shapes = {}
    for name, axis in zip(scan.inputs, scan.cut_axes, strict=True):
        shape = list(step.shapes[recent[name].name][1:] if name in recent else step.shapes[name])
        if axis is not None:
            shape.insert(axis, length)
        shapes[name] = tuple(shape)
    return Sizes(shapes, {**step.indices, scan.index: length})


def _initial_shapes(found, step: Sizes, attrs: dict, shapes: dict, program) -> dict:
    """The shapes of the initial step's inputs (`h0[b]` of `where(t == 0, h0[b], ..)`,
    which the body step may not read), at the step's sizes of the indices they share: the
    state may be sized by one (this was an internal KeyError)."""
    if found.init is None or program is None:
        return {}
    init = build(found.init)
    known = plan_sizes(init, attrs).indices
    shared = {name: step.indices[name] for name in known if name in step.indices}
    given = {name: shape for name, shape in shapes.items() if name in init.inputs}
    return plan_sizes(init, attrs, shapes=given, sizes=shared).shapes


def reference(op: OpSpec, attrs: dict):
    """The formula's forward as a loop of dense step evaluations, in NumPy."""
    import tensorflow as tf

    from .coupled import CoupledPlan
    from .coupled import reference as coupled_reference
    from .reference import evaluate_op

    found = plan(op)
    if isinstance(found, CoupledPlan):  # several states in one carry
        return coupled_reference(found, op, attrs)
    scan = found.scan
    int_attrs = frozenset(n for n, kind in op.attrs if kind == "int")
    steps = [(found.body, scan.body), (found.init, scan.init)]
    built: dict = {}  # the steps' lets, per shapes

    def run(arrays):
        named = dict(zip(scan.inputs, arrays, strict=True))
        length = named[scan.length[0]].shape[scan.length[1]]
        order = range(length - 1, -1, -1) if scan.reverse else range(length)
        states: list = []  # in scan order
        results: dict[str, list] = {name: [] for name in scan.body.outputs}
        for count, t in enumerate(order):
            spec, step = steps[1] if count == 0 and scan.init is not None else steps[0]
            given = {}
            for read in step.reads:
                if read.kind == "recent":
                    given[read.name] = _recent(named, read, order, count)
                elif read.kind == "input":
                    value = named[read.name]
                    given[read.name] = value if read.axis is None else np.take(value, t, read.axis)
                elif read.kind == "lag":
                    given[read.name] = _back(_past(states, read.lag, arrays, scan, attrs), read)
                else:
                    depth = _depth(scan, named)
                    given[read.name] = np.stack(
                        [_past(states, j + 1, arrays, scan, attrs) for j in range(depth)]
                    )
            if is_recurrence(spec):  # the row of a two-index recurrence: a loop too
                inner = reference(spec, {n: attrs[n] for n in step.attrs})
                outputs = inner([given[r.name] for r in step.reads])
                for name, value in zip(step.outputs, outputs, strict=True):
                    results[name].append(np.asarray(value))
                states.append(results[scan.state][-1])
                continue
            tensors = {n: tf.constant(v) for n, v in given.items()}
            shapes = {n: v.shape for n, v in given.items()}
            outputs = evaluate_op(
                spec.formulas,
                tensors,
                with_lets(spec, {n: attrs[n] for n in step.attrs}, shapes, built),
                outputs=set(step.outputs),
                int_attrs=int_attrs | {n for n, _ in spec.lets},
            )
            for name, value in zip(step.outputs, outputs, strict=True):
                results[name].append(np.asarray(value))
            states.append(results[scan.state][-1])
        placed = []
        for name in scan.outputs:
            stack = np.stack(results[name]) if results[name] else None
            if scan.reverse:
                stack = stack[::-1]
            axis = scan.body.output_axes[scan.body.outputs.index(name)]
            placed.append(np.moveaxis(stack, 0, axis))
        return placed

    return run


def _recent_reads(scan) -> dict:
    """The op inputs read at lags, with their step reads."""
    steps = (scan.body, scan.init) if scan.init else (scan.body,)
    return {r.input: r for st in steps for r in st.reads if r.kind == "recent"}


def _recent(named: dict, read, order, count: int) -> np.ndarray:
    """An input's window at the `count`-th position of the scan: the input at the
    positions `count`, `count - 1`, ... of the scan order (zero before the start)."""
    value = named[read.input]
    depth = read.depth + sum(c * (named[n].shape[a] - 1) for c, n, a in read.depth_sizes)
    zero = np.zeros_like(np.take(value, 0, read.axis))
    return np.stack(
        [
            np.take(value, order[count - e], read.axis) if count - e >= 0 else zero
            for e in range(depth)
        ]
    )


def _past(states: list, lag: int, arrays, scan, attrs: dict) -> np.ndarray:
    if lag <= len(states):
        return states[-lag]
    named = dict(zip(scan.inputs, arrays, strict=True))
    shape = shape_of(scan.state_axes, scan.state_divisors, lambda n, a: named[n].shape[a], attrs)
    return np.zeros(shape, arrays[0].dtype)


def _depth(scan, named) -> int:
    return scan.depth + sum(c * (named[n].shape[a] - 1) for c, n, a in scan.depth_sizes)


def _back(state: np.ndarray, read) -> np.ndarray:
    """A past state read `read.shift` positions back along its axis (zero before)."""
    if not read.shift:
        return state
    moved = np.moveaxis(state, read.axis, 0)
    shifted = np.zeros_like(moved)
    shifted[read.shift :] = moved[: moved.shape[0] - read.shift]
    return np.moveaxis(shifted, 0, read.axis)


def _step_program(spec: OpSpec):
    """The step's program, or, for a step that is itself a recurrence, its `Program`."""
    return program(spec) if is_recurrence(spec) else build(spec)

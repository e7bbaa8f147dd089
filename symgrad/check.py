"""`symgrad check`: an op against its formula, and against the gradient its framework uses.

Per op and attr setting, on small random inputs whose sizes differ per index (so a swapped
layout shows):

1. forward: the op's outputs against the formula's. With a library, the op is the
   user's and the formula is the generated `forward`; without one, the generated
   `forward` is checked against `reference.evaluate`, a dense evaluation of the formula
   that shares nothing with lowering.
2. gradient: a dot-product (adjoint) test that does not trust symgrad's derivation. For a
   direction v in one input, <u, J v> from central differences of the op's forward must
   equal <J^T u, v> from the framework's differentiation of the op (`tf.GradientTape`,
   `torch.autograd.grad`, `jax.vjp`), which runs the generated gradient as it is on disk.
   Taking u = J v (from the differences) makes <u, J v> = |J v|^2 > 0: a gradient off by
   a factor shows as that factor, never hidden by cancellation between entries.
3. interface (library only): the op's input, output and attr names against the spec,
   matched the way the registered gradient matches them.

Attrs are checked at the op's defaults and at samples distinct from each other and from
0 and 1 (`attr_settings`). The framework's side lives in check_tf.py, check_torch.py and
check_jax.py, each giving `run` a `Library` and `Target`s that work on NumPy arrays.
`plan_sizes` is pure (SymPy only); `render_table` and `as_json` format a `Report`.
Nothing here writes.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import sympy as sp

from . import indexing, recurrence, splits
from .emit import intact
from .errors import SymgradError, counted
from .folders import spec_source
from .model import Program, build
from .pipeline import module_text
from .spec import OpSpec, Spec, snake_case

DTYPES = ("float64", "float32")
# Forward: the largest difference allowed, relative to the largest |output| (the issue's
# numbers: a few hundred ulps of a sum of a few dozen terms).
FORWARD_TOL = {"float64": 1e-10, "float32": 1e-5}
# Gradient: central differences with step h have truncation error ~h^2 and rounding error
# ~eps/h, relative to |J v|. float64: h = 1e-6 leaves both near 1e-10 (measured on this
# repo's ops: at most 3e-11), so 1e-6 catches a gradient off by 0.001%. float32: h = 1e-3
# puts rounding near 1e-5 (measured: at most 1.5e-5); 1e-3 still catches a gradient off by
# 1% (it scores 3.5e-3). A small step also makes it unlikely that a difference crosses a
# kink (max, abs, where) whose two sides disagree.
STEP = {"float64": 1e-6, "float32": 1e-3}
GRADIENT_TOL = {"float64": 1e-6, "float32": 1e-3}
DIRECTIONS = 3  # per input; the median error decides, so one kink crossed is no failure
GROWTH_ROUNDS = 8  # attempts at larger windowed axes until every index has a range >= 2


# ----------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Sizes:
    """Input shapes, the size of every index, and the values index tensors may take."""

    shapes: dict[str, tuple[int, ...]]
    indices: dict[str, int]
    index_values: dict[str, tuple[int, int]] = field(default_factory=dict)  # [low, high)


def plan_sizes(
    program: Program,
    attrs: dict[str, object],
    *,
    shapes: dict[str, tuple[int, ...]] | None = None,
    sizes: dict[str, int] | None = None,
) -> Sizes:
    """Small sizes, distinct per index: indices that share an input axis (through the
    formula) share a size; axes read at computed positions (windows, strides) get larger
    sizes, grown until every range inferred from them is at least 2, and axes read at the
    same position expression (`k[b, i + w - r, c]` and `v[b, i + w - r, e]`) share one.
    `shapes` (input -> shape) and `sizes` (index -> size) fix some of them (--shape,
    --size). Index tensors get a range of values that keeps every read in bounds (an op is
    free to fail on others)."""
    shapes = shapes or {}
    sizes = sizes or {}
    for name in program.positive_attrs:  # as the module refuses them when called
        if name in attrs and attrs[name] <= 0:
            raise SymgradError(
                f"attr {name} is {attrs[name]}; it scales an index or divides a range, "
                "and must be positive",
                where=program.source,
            )
    groups = _axis_groups(program)
    ranks = dict(program.ranks)
    plain_axes = {axis for members in groups for axis in members if isinstance(axis, tuple)}
    free = [(t, a) for t in program.inputs for a in range(ranks[t]) if (t, a) not in plain_axes]
    tied = _tied_axes(program, free)
    given = {(t, a): n for t, shape in shapes.items() for a, n in enumerate(shape)}
    fixed = _fixed_group_sizes(program, groups, given, sizes)
    ints = {f"_int_{name}": value for name, value in attrs.items() if isinstance(value, int)}
    best: Sizes | None = None
    for attempt in range(GROWTH_ROUNDS):
        size_of: dict[object, int] = {}
        for n, members in enumerate(groups):
            for member in members:
                size_of[member] = fixed.get(n, 2 + n)
        start = 2 + len(groups) + 3 + 4 * attempt
        for n, members in enumerate(tied):
            chosen = [given[axis] for axis in members if axis in given]
            for axis in members:
                size_of[axis] = given.get(axis, chosen[0] if chosen else start + n)
        indices = {i.name: size for i, size in size_of.items() if isinstance(i, sp.Symbol)}
        for axis, size in splits.check_sizes(program, indices, ints).items():
            size_of[axis] = given.get(axis, size)  # an axis read at c // G, c % G, (h, r)
        planned = {t: tuple(size_of[(t, a)] for a in range(ranks[t])) for t in program.inputs}
        values = {
            **{
                indexing.shape_symbol(t, a).name: s
                for t, s2 in planned.items()
                for a, s in enumerate(s2)
            },
            **ints,
        }
        for name, value in program.lets:  # in dependency order
            values[f"_int_{name}"] = _evaluate(value, values)
        for index, extent in program.extents:
            indices[index.name] = _evaluate(extent, values)
        lets = {k: v for k, v in values.items() if k.startswith("_int_")}
        bounds = _index_value_ranges(program, planned, indices, {**ints, **lets})
        result = Sizes(planned, indices, bounds)
        enough = all(indices[i.name] >= 2 for i, _ in program.extents) and all(
            high - low >= 2 for low, high in bounds.values()
        )
        if enough:
            return result
        if best is None and all(indices[i.name] >= 1 for i, _ in program.extents):
            best = result
    if best is None or any(high <= low for low, high in best.index_values.values()):
        raise SymgradError(
            "cannot choose input sizes for which every index has a range (check the attrs"
            + (", --shape and --size)" if shapes or sizes else ")"),
            where=program.source,
        )
    return best


def _tied_axes(program: Program, free: list) -> list[list]:
    """The axes read at computed positions, grouped by position expression: inputs read at
    the same expression along an axis get the same length (a real kernel that reads two
    inputs at one position usually requires that), in order of first appearance."""
    key_of: dict[tuple[str, int], str] = {}
    for level in program.intermediates:
        gather = level.gather
        if gather is None:
            continue
        for axis in gather.computed:
            key_of.setdefault((gather.source, axis), str(sp.expand(gather.positions[axis])))
    tied: dict[object, list] = {}
    for axis in free:
        tied.setdefault(key_of.get(axis, axis), []).append(axis)
    return list(tied.values())


def _fixed_group_sizes(program, groups, given, sizes) -> dict[int, int]:
    """Group number -> the size --shape or --size gives it; a contradiction is an error."""
    fixed: dict[int, int] = {}
    origin: dict[int, str] = {}
    named = {
        member.name: n
        for n, members in enumerate(groups)
        for member in members
        if isinstance(member, sp.Symbol)
    }
    wanted = [
        (f"--size {name}={size}", named.get(name), size, name) for name, size in sizes.items()
    ]
    for n, members in enumerate(groups):
        for member in members:
            if member in given:
                t, a = member
                wanted.append((f"--shape {t} (axis {a}) = {given[member]}", n, given[member], None))
    for what, n, size, index in wanted:
        if n is None:
            raise SymgradError(
                f"{what}: index {index} is not the index of an input axis; its size follows "
                "from the inputs' shapes (set those with --shape)",
                where=program.source,
            )
        if n in fixed and fixed[n] != size:
            raise SymgradError(f"{what} contradicts {origin[n]}", where=program.source)
        fixed[n], origin[n] = size, what
    return fixed


def _axis_groups(program: Program) -> list[list]:
    """Indices and the input axes they name, joined where they share one (`A[b,i,j]`
    with `A[b,i,m]` puts j and m on one axis), in order of first appearance."""
    parent: dict[object, object] = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    order: list[object] = []
    for index, axes in program.dims:
        for member in (index, *axes):
            if member not in parent:
                order.append(member)
            parent[find(member)] = find(index)
    groups: dict[object, list] = {}
    for member in order:
        groups.setdefault(find(member), []).append(member)
    return list(groups.values())


def _let_values(program: Program, attrs: dict[str, object], shapes: dict) -> dict[str, int]:
    """The op's lets for inputs of these shapes, in dependency order."""
    values = {
        **{f"_int_{n}": v for n, v in attrs.items() if isinstance(v, int)},
        **{
            indexing.shape_symbol(t, a).name: int(s)
            for t, shape in shapes.items()
            for a, s in enumerate(shape)
        },
    }
    for name, value in program.lets:
        values[f"_int_{name}"] = _evaluate(value, values)
    return {name: values[f"_int_{name}"] for name, _ in program.lets}


def with_lets(spec, attrs: dict[str, object], shapes: dict, cache: dict) -> dict[str, object]:
    """`attrs` and the lets of `spec` (a recurrence's step op) for inputs of these shapes,
    for the loop references, which evaluate a step's formulas with its lets as int attrs.
    `cache` keeps one model build per step and shapes."""
    if not spec.lets:
        return attrs
    key = (spec.name, tuple(sorted((n, tuple(s)) for n, s in shapes.items())))
    if key not in cache:
        from .model import build

        cache[key] = _let_values(build(spec), attrs, shapes)
    return {**attrs, **cache[key]}


def _evaluate(expr: sp.Expr, values: dict[str, int]) -> int:
    value = sp.sympify(expr).xreplace(
        {s: sp.Integer(values[s.name]) for s in expr.free_symbols if s.name in values}
    )
    if value.free_symbols:
        raise SymgradError(f"cannot size {expr} from the inputs and attrs")
    return int(value)


def _index_value_ranges(program, shapes, indices, ints) -> dict[str, tuple[int, int]]:
    """For each index tensor, the values [low, high) that keep its reads in bounds:
    `X[b, idx[b,i] + k, c]` with k < K needs 0 <= idx < X.shape[1] - (K - 1)."""
    ranges: dict[str, tuple[int, int]] = {}
    extents = {sp.Symbol(name): sp.Integer(size) for name, size in indices.items()}
    for level in program.intermediates:
        gather = level.gather
        if gather is None:
            continue
        for axis in gather.computed:
            position = sp.expand(gather.positions[axis]).xreplace(
                {
                    s: sp.Integer(ints[s.name])
                    for s in gather.positions[axis].free_symbols
                    if s.name in ints
                }
            )
            reads = position.atoms(sp.Indexed)
            size = _axis_size(program, shapes, indices, gather.source, axis)
            for read in reads:
                name = str(read.base.label)
                low, high = 0, size
                rest = position - read
                by_name = {s.name: s for s in rest.free_symbols}
                rest = rest.xreplace({s: sp.Symbol(s.name) for s in by_name.values()})
                top = indexing.extreme(rest, extents, upper=True)
                bottom = indexing.extreme(rest, extents, upper=False)
                if len(reads) == 1 and position.coeff(read) == 1 and None not in (top, bottom):
                    low, high = max(0, -int(bottom)), min(size, size - int(top))
                old_low, old_high = ranges.get(name, (low, high))
                ranges[name] = (max(low, old_low), min(high, old_high))
    return ranges


def _axis_size(program, shapes, indices, source: str, axis: int) -> int:
    """The size of axis `axis` of an input (its planned shape) or of an internal tensor
    (the size of the index its equation writes there: `s[index[n], h]` reads `s[v,h]`)."""
    if source in shapes:
        return shapes[source][axis]
    (level,) = [level for level in program.intermediates if level.name == source]
    return indices[level.indices[axis].name]


# ----------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Result:
    """One check of one op. `passed` is None for a check that did not apply."""

    check: str  # "interface" | "forward" | "gradient"
    passed: bool | None
    error: float | None = None
    tolerance: float | None = None
    detail: str = ""


@dataclass(frozen=True)
class OpReport:
    op: str
    results: tuple[Result, ...]
    sizes: dict[str, int]  # every index of the formula
    shapes: dict[str, tuple[int, ...]]  # every input
    attrs: tuple[tuple[str, object, str], ...]  # (name, value, where it came from)
    notes: tuple[str, ...] = ()
    setting: str = ""  # "defaults" | "samples" when an op is checked at two attr settings

    @property
    def label(self) -> str:
        return f"{self.op}[{self.setting}]" if self.setting else self.op

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(r.check for r in self.results if r.passed is False)


@dataclass(frozen=True)
class Report:
    spec: str
    library: str | None
    dtype: str
    seed: int
    ops: tuple[OpReport, ...]
    warnings: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()  # spec ops the library does not define
    target: str = "tensorflow"

    @property
    def ok(self) -> bool:
        return not any(op.failed for op in self.ops)


def render_table(report: Report) -> str:
    """The report as text: one row per op and check, then what was sampled."""
    against = f"against {report.library}" if report.library else "generated forward"
    if report.target != "tensorflow":
        against += f" ({report.target})"
    lines = [f"symgrad check: {report.spec}, {against} ({report.dtype}, seed {report.seed})"]
    lines += [f"warning: {w}" for w in report.warnings]
    width = max([len("op"), *(len(op.label) for op in report.ops)])
    lines.append(f"{'op':<{width}}  {'check':<9}  {'max error':>9}  {'tolerance':>9}  result")
    for op in report.ops:
        for r in op.results:
            error = "-" if r.error is None else f"{r.error:.1e}"
            tolerance = "-" if r.tolerance is None else f"{r.tolerance:.0e}"
            result = {True: "pass", False: "FAIL", None: "n/a"}[r.passed]
            row = f"{op.label:<{width}}  {r.check:<9}  {error:>9}  {tolerance:>9}  {result}"
            lines.append(f"{row}  {r.detail}" if r.detail else row)
    for op in report.ops:
        shapes = ", ".join(f"{n} {'x'.join(map(str, s)) or 'scalar'}" for n, s in op.shapes.items())
        sizes = ", ".join(f"{k}={v}" for k, v in op.sizes.items())
        attrs = ", ".join(f"{n}={v!r} ({how})" for n, v, how in op.attrs)
        line = f"{op.label}: inputs {shapes} ({sizes})"
        lines.append(line + (f"; attrs {attrs}" if attrs else ""))
        lines += [f"{op.label}: {note}" for note in op.notes]
    if report.skipped:
        lines.append(f"not in the library (not checked): {', '.join(report.skipped)}")
    failed = [f"{op.label} {check}" for op in report.ops for check in op.failed]
    if failed:
        lines.append(f"FAIL: {', '.join(failed)}")
    else:
        lines.append(f"all checks passed ({counted(len(report.ops), 'op')})")
    return "\n".join(lines) + "\n"


def as_json(report: Report) -> dict:
    """The report as one JSON document (for CI)."""

    def number(x):
        return None if x is None or not math.isfinite(x) else x

    return {
        "ok": report.ok,
        "spec": report.spec,
        "library": report.library,
        "target": report.target,
        "dtype": report.dtype,
        "seed": report.seed,
        "warnings": list(report.warnings),
        "skipped": list(report.skipped),
        "ops": [
            {
                "op": op.op,
                "setting": op.setting,
                "ok": not op.failed,
                "sizes": op.sizes,
                "shapes": {name: list(shape) for name, shape in op.shapes.items()},
                "attrs": [{"name": n, "value": v, "from": how} for n, v, how in op.attrs],
                "notes": list(op.notes),
                "checks": [
                    {
                        "check": r.check,
                        "passed": r.passed,
                        "error": number(r.error),
                        "tolerance": r.tolerance,
                        "detail": r.detail,
                    }
                    for r in op.results
                ],
            }
            for op in report.ops
        ],
    }


# ----------------------------------------------------------------------------- inputs


def parse_attr_values(spec: Spec, ops: tuple[OpSpec, ...], given: list[str]) -> dict:
    """`--attr NAME=VALUE` strings -> {name: value}, typed by the attr's kind in the spec."""
    kinds = {name: kind for op in ops for name, kind in op.attrs}
    values: dict[str, object] = {}
    for text in given:
        name, sep, value = text.partition("=")
        name = name.strip()
        if not sep or not name:
            raise SymgradError(f"--attr {text!r}: expected NAME=VALUE")
        if name not in kinds:
            known = ", ".join(sorted(kinds)) or "none"
            raise SymgradError(f"--attr {name}: no op checked has this attr (attrs: {known})")
        values[name] = _typed(name, kinds[name], value.strip())
    return values


def _typed(name: str, kind: str, text: str):
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            number = float(text)
            if not math.isfinite(number):
                raise ValueError
            return number
    except ValueError:
        raise SymgradError(
            f"--attr {name}={text}: expected {'an integer' if kind == 'int' else 'a finite number'}"
        ) from None
    if text.lower() in ("true", "1"):
        return True
    if text.lower() in ("false", "0"):
        return False
    raise SymgradError(f"--attr {name}={text}: expected true or false")


# Sample attrs differ from each other and from 0 and 1, so that swapping two attrs, or
# an attr that multiplies or is multiplied by 1, changes the result.
INT_SAMPLES = (2, 3, 5, 7, 11, 13, 17, 19)
FLOAT_SAMPLES = (0.75, 1.5, 2.5, 3.25, 4.5, 5.75, 6.5, 7.25)  # exact in float32


def sample_attrs(attrs: tuple[tuple[str, str], ...], given: dict) -> dict:
    """A value for every attr nobody gave, each distinct from the others (given ones
    included) and from 0 and 1: ints 2, 3, 5, ..., floats 0.75, 1.5, 2.5, ..."""
    taken = set(given.values())
    values = {}
    for name, kind in attrs:
        if name in given:
            continue
        if kind == "bool":
            values[name] = True
            continue
        pool = INT_SAMPLES if kind == "int" else FLOAT_SAMPLES
        value = next(v for v in pool if v not in taken)
        taken.add(value)
        values[name] = value
    return values


def other_samples(attrs: tuple[tuple[str, str], ...], given: dict, samples: dict) -> dict:
    """A second sample set: every attr differs from its value in `samples`, and the values
    stay distinct from each other and from 0 and 1 (the int samples rotated, 2, 3, 5 ->
    3, 5, 2; a lone one takes the next value; bools False)."""
    taken = set(given.values()) | set(samples.values())
    values = {}
    for kind, pool in (("int", INT_SAMPLES), ("float", FLOAT_SAMPLES)):
        names = [name for name, k in attrs if k == kind and name in samples]
        if len(names) == 1:
            values[names[0]] = next(v for v in pool if v not in taken)
        for n, name in enumerate(names if len(names) > 1 else ()):
            values[name] = samples[names[(n + 1) % len(names)]]
    values.update({name: False for name, k in attrs if k == "bool" and name in samples})
    return values


def attr_settings(program: Program, op: OpSpec, given: dict, defaults: dict) -> list:
    """The attr settings an op is checked at: (label, [(name, value, where from)]).

    At least two unless --attr fixes every attr: the op's own defaults where it has them
    ("defaults"; its other attrs from a second sample set), else a second sample set
    ("samples-2"), and a set of distinct samples ("samples"). --attr fixes an attr in
    all of them."""
    del program
    ours = {name: given[name] for name, _ in op.attrs if name in given}
    samples = sample_attrs(op.attrs, ours)
    others = other_samples(op.attrs, ours, samples)
    kinds = dict(op.attrs)

    def typed(name, value):
        return {"int": int, "float": float, "bool": bool}[kinds[name]](value)

    first, second = [], []
    for name, _ in op.attrs:
        if name in ours:
            first.append((name, ours[name], "--attr"))
            second.append((name, ours[name], "--attr"))
            continue
        if name in defaults:
            first.append((name, typed(name, defaults[name]), "op default"))
        else:
            first.append((name, others[name], "sample"))
        second.append((name, samples[name], "sample"))
    if first == second:
        return [("", first)]
    if any(how == "op default" for _, _, how in first):
        return [("defaults", first), ("samples", second)]
    return [("samples", second), ("samples-2", first)]


def parse_shapes(ops: tuple[OpSpec, ...], given: list[str]) -> dict[str, dict]:
    """`--shape NAME=2x9x4` strings -> {op name: {input: shape}} for the ops that have the
    input; an input no op checked has, or a shape of the wrong rank, is an error."""
    found: dict[str, dict] = {}
    for text in given:
        name, sep, value = text.partition("=")
        name = name.strip()
        try:
            shape = tuple(int(n) for n in value.strip().lower().split("x")) if value.strip() else ()
        except ValueError:
            shape = None
        if not sep or not name or shape is None or any(n < 1 for n in shape):
            raise SymgradError(f"--shape {text!r}: expected NAME=SIZExSIZE... (e.g. x=2x9x4)")
        hit = False
        for op in ops:
            ranks = _input_ranks(op)
            if name not in ranks:
                continue
            hit = True
            if len(shape) != ranks[name]:
                raise SymgradError(
                    f"--shape {text}: input {name} has rank {ranks[name]}, not {len(shape)}",
                    where=op.source,
                )
            found.setdefault(op.name, {})[name] = shape
        if not hit:
            raise SymgradError(f"--shape {name}: no op checked has this input")
    return found


def _input_ranks(op: OpSpec) -> dict[str, int]:
    """The op's inputs and their ranks (for --shape); a recurrence's from its scan."""
    if recurrence.is_recurrence(op):
        scan = recurrence.plan(op).scan
        return dict(zip(scan.inputs, scan.ranks, strict=True))
    program = build(op)
    return {name: rank for name, rank in program.ranks if name in program.inputs}


def _index_names(op: OpSpec) -> set[str]:
    """The op's indices (for --size); a recurrence's are its scan index and its step's."""
    if recurrence.is_recurrence(op):
        found = recurrence.plan(op)
        return {found.scan.index, *_index_names(found.body)}
    program = build(op)
    return {i.name for i, _ in program.dims} | {i.name for i, _ in program.extents}


def parse_sizes(ops: tuple[OpSpec, ...], given: list[str]) -> dict[str, dict]:
    """`--size INDEX=N` strings -> {op name: {index: N}} for the ops that use the index."""
    found: dict[str, dict] = {}
    for text in given:
        name, sep, value = text.partition("=")
        name = name.strip()
        try:
            size = int(value)
        except ValueError:
            size = 0
        if not sep or not name or size < 1:
            raise SymgradError(f"--size {text!r}: expected INDEX=N with N >= 1")
        hit = False
        for op in ops:
            if name in _index_names(op):
                hit = True
                found.setdefault(op.name, {})[name] = size
        if not hit:
            raise SymgradError(f"--size {name}: no op checked has this index")
    return found


def _random_inputs(program: Program, sizes: Sizes, dtype: str, rng, *, positive: bool):
    arrays = {}
    ids = program.compared
    for name in program.inputs:
        shape = sizes.shapes[name]
        if name in program.index_inputs:
            low, high = sizes.index_values.get(name, (0, 1))
            arrays[name] = rng.integers(low, high, shape)
        elif name in ids:
            # few distinct values, so that equal ones occur (see compared.py)
            arrays[name] = rng.integers(0, 3, shape).astype(dtype) + (1 if positive else 0)
        elif positive:
            arrays[name] = rng.uniform(0.5, 1.5, shape).astype(dtype)
        else:
            arrays[name] = rng.standard_normal(shape).astype(dtype)
    return [arrays[name] for name in program.inputs]


# ----------------------------------------------------------------------------- comparing


def _labels(program: Program, n: int) -> list[str]:
    return [
        group[0].name if len(group) == 1 else "(" + ",".join(i.name for i in group) + ")"
        for group in program.outputs[n].groups
    ]


def compare_forward(program: Program, got: list, want: list, tolerance: float) -> Result:
    """The op's outputs (`got`) against the formula's (`want`), as NumPy arrays: the
    largest difference relative to the largest |output|, and where they differ."""
    worst, details = 0.0, []
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        name = program.outputs[n].level.name
        if g.shape != w.shape:
            hint = (
                " (the same sizes in another order: a transposed layout?)"
                if sorted(g.shape) == sorted(w.shape)
                else ""
            )
            details.append(f"{name} has shape {g.shape}, the formula gives {w.shape}{hint}")
            worst = math.inf
            continue
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        finite = np.abs(w64[np.isfinite(w64)])
        scale = float(np.max(finite)) if finite.size else 0.0
        scale = scale if scale > 0 else 1.0
        # nan where the formula is nan (a mean over an empty segment, 0/0), or the same
        # infinity, agrees; any other nan in either is a difference
        agree = (g64 == w64) | (np.isnan(g64) & np.isnan(w64))
        with np.errstate(invalid="ignore"):
            difference = np.where(agree, 0.0, np.abs(g64 - w64))
        difference = np.where(np.isnan(difference), np.inf, difference)
        error = float(np.max(difference)) / scale if w.size else 0.0
        worst = max(worst, error)
        if error > tolerance:
            details.append(
                _where_it_differs(name, _labels(program, n), g, w, difference > tolerance * scale)
            )
    return Result("forward", worst <= tolerance, worst, tolerance, "; ".join(details))


def _where_it_differs(name: str, labels: list[str], got, want, bad) -> str:
    """`y differs only where i = 4 (the last): 2 of 10 entries; the op wrote 0 there`."""
    count, total = int(bad.sum()), bad.size
    places = []
    for axis, label in enumerate(labels):
        others = tuple(a for a in range(bad.ndim) if a != axis)
        hit = np.flatnonzero(bad.any(axis=others)) if others else np.flatnonzero(bad)
        size = bad.shape[axis]
        if 0 < len(hit) < size:
            places.append(f"{label} = {_positions(hit, size)}")
    where = f"only where {' and '.join(places)}" if places else "everywhere"
    text = f"{name} differs {where}: {count} of {total} entries"
    g, w = got[bad].astype(np.float64), want[bad].astype(np.float64)
    if not np.any(g):
        return text + "; the op wrote 0 there"
    norm = float(np.dot(w, w))
    if norm > 0:
        factor = float(np.dot(g, w)) / norm
        close = np.allclose(g, factor * w, rtol=1e-6, atol=1e-12 * math.sqrt(norm))
        if close and f"{factor:.6g}" != "1":  # never "1 x": that explains nothing
            return text + f"; the op's values are {factor:.6g} x the formula's"
    k = int(np.flatnonzero(bad)[0])
    at = np.unravel_index(k, bad.shape)
    op, formula = _distinct(float(got[at]), float(want[at]))
    return text + f"; e.g. at {list(map(int, at))}: op {op}, formula {formula}"


def _distinct(a: float, b: float) -> tuple[str, str]:
    """Two numbers with as many digits as it takes to tell them apart."""
    for digits in (6, 9, 12, 17):
        shown = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if shown[0] != shown[1]:
            return shown
    return shown


def _positions(hit, size: int) -> str:
    if len(hit) == 1:
        k = int(hit[0])
        end = ", the last" if k == size - 1 else ", the first" if k == 0 else ""
        return f"{k}{end} of 0..{size - 1}"
    shown = ", ".join(str(int(k)) for k in hit[:6])
    return "{" + shown + (", ..." if len(hit) > 6 else "") + "}" + f" of 0..{size - 1}"


# ----------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Target:
    """What is checked for one op, in NumPy, inputs and outputs in the spec's order.

    `call(arrays)` runs the op; `reference(arrays)` the formula; `pullback(arrays, k, us)`
    the gradient of input k for output cotangents `us`, through the framework's own
    differentiation of the op (its registered gradient)."""

    call: Callable[[list], list]
    reference: Callable[[list], list]
    pullback: Callable[[list, int, list], np.ndarray]
    results: tuple[Result, ...] = ()  # checks done before running (the interface)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Library:
    """A loaded library, for one framework: which spec ops it defines, and per op what
    `run` needs."""

    defines: frozenset[str]  # spec op names
    # (op, program, module) -> {attr name: default} of the op's own defaults
    defaults: Callable[[OpSpec, Program], dict]
    # (op, program, name, value) -> the value the op holds (a float32 attr rounds)
    holds: Callable[[OpSpec, str, object], object]
    # (op, program, module, attrs, dtype) -> Target
    target: Callable[..., Target]
    listing: str  # what it defines, for messages


# A check of a framework: `load(library path, options)` -> Library, `generated(program,
# module, attrs, sizes)` -> Target, `import_module(path, name)` -> module.
FRAMEWORKS = ("tensorflow", "pytorch", "jax")


def _framework(name: str):
    if name == "tensorflow":
        from . import check_tf as framework
    elif name == "pytorch":
        from . import check_torch as framework
    elif name == "jax":
        from . import check_jax as framework
    else:
        raise SymgradError(f"unknown target {name!r} (known: {', '.join(FRAMEWORKS)})")
    return framework


def run(
    spec: Spec,
    out: Path,
    *,
    target: str = "tensorflow",
    library: str | None = None,
    namespace: str | None = None,
    op_names: tuple[str, ...] = (),
    attr_args: tuple[str, ...] = (),
    shape_args: tuple[str, ...] = (),
    size_args: tuple[str, ...] = (),
    dtype: str = "float64",
    seed: int = 0,
) -> Report:
    """Check every op of `spec` (or those named) that the library defines, or every op's
    generated forward when there is no library. SymgradError for usage and spec errors."""
    by_name = {op.name: op for op in spec.ops}
    for name in op_names:
        if name not in by_name:
            raise SymgradError(
                f"no op {name!r} in the spec (ops: {', '.join(by_name)})", where=spec.path
            )
    chosen = tuple(by_name[n] for n in dict.fromkeys(op_names)) if op_names else spec.ops
    if library is not None and not Path(library).is_file():
        raise SymgradError("library not found", where=library)
    framework = _framework(target)
    warnings = _module_state(spec, chosen, out, target)
    skipped: tuple[str, ...] = ()
    loaded = None
    if library is not None:
        loaded = framework.load(library, spec, chosen, namespace)
        missing = [op.name for op in chosen if op.name not in loaded.defines]
        if op_names and missing:
            raise SymgradError(
                f"the library does not define {', '.join(missing)} (it defines: "
                f"{loaded.listing or 'no ops'})",
                where=library,
            )
        skipped = tuple(missing)
        chosen = tuple(op for op in chosen if op.name in loaded.defines)
        if not chosen:
            raise SymgradError(
                f"the library defines none of the spec's ops (it defines: "
                f"{loaded.listing or 'no ops'})",
                where=library,
            )
    given = parse_attr_values(spec, chosen, list(attr_args))
    shapes_given = parse_shapes(chosen, list(shape_args))
    sizes_given = parse_sizes(chosen, list(size_args))
    # Every op's sizes first: a bad --shape or --size is an error before any generated
    # module (and with it the framework, whose start-up notices go to stderr) is imported.
    from . import check_recurrence  # it reads this module's sizes

    planned = []
    for n, op in enumerate(chosen):
        recurrent = recurrence.is_recurrence(op)
        program = check_recurrence.program(op) if recurrent else build(op)
        defaults = loaded.defaults(op, program) if loaded else {}
        for label, attrs in attr_settings(program, op, given, defaults):
            if loaded is not None:
                attrs = [_held(loaded, op, name, value, how) for name, value, how in attrs]
            values = {name: value for name, value, _ in attrs}
            if recurrent:
                sizes = check_recurrence.sizes(
                    op, values, shapes_given.get(op.name, {}), sizes_given.get(op.name, {})
                )
            else:
                sizes = plan_sizes(
                    program,
                    values,
                    shapes=shapes_given.get(op.name, {}),
                    sizes=sizes_given.get(op.name, {}),
                )
            planned.append((n, op, program, recurrent, label, attrs, values, sizes))
    reports, modules = [], {}
    for n, op, program, recurrent, label, attrs, values, sizes in planned:
        if op.name not in modules:
            modules[op.name] = framework.import_module(out / f"{snake_case(op.name)}.py", op)
        module = modules[op.name]
        if loaded is None:
            checked = framework.generated(program, module, values, sizes)
            if recurrent:  # the formula's forward: a loop over the positions
                checked = replace(checked, reference=check_recurrence.reference(op, values))
        else:
            checked = loaded.target(op, program, module, values, dtype)
        rng = np.random.default_rng([seed, n])
        results, notes = _check_op(program, checked, sizes, dtype, rng)
        written = {i: size for i, size in sizes.indices.items() if "'" not in i}
        reports.append(
            OpReport(
                op.name,
                (*checked.results, *results),
                written,
                sizes.shapes,
                tuple(attrs),
                (*checked.notes, *notes),
                label,
            )
        )
    return Report(spec.path, library, dtype, seed, tuple(reports), tuple(warnings), skipped, target)


def _held(loaded: Library, op: OpSpec, name: str, value, how: str) -> tuple:
    """(name, the value the op holds, where from): a TF float attr holds a float32."""
    held = loaded.holds(op, name, value)
    return (name, held, how if held == value else f"{how} {value!r}, as the op holds it")


def _module_state(spec: Spec, ops, out: Path, target: str) -> list[str]:
    """Each op's module must be on disk as `symgrad generate` would write it now; a module
    edited by hand is checked as it is, with a warning."""
    source_name = spec_source(spec, out)
    warnings = []
    for op in ops:
        path = out / f"{snake_case(op.name)}.py"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise SymgradError(
                f"no generated module {path} for op {op.name}; run `symgrad generate`",
                where=spec.path,
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise SymgradError(f"cannot read {path}: {exc}", where=spec.path) from None
        if text == module_text(op, source_name, target):
            continue
        if intact(text):
            raise SymgradError(
                f"{path} is stale against the spec (op {op.name}); run `symgrad generate`",
                where=spec.path,
            )
        warnings.append(f"{path} was edited by hand since symgrad generated it; checked as it is")
    return warnings


def import_file(path: Path, op: OpSpec, prefix: str):
    """A Python file imported under `prefix.<stem>` (a generated module registers its
    gradient when imported); SymgradError if importing it fails."""
    name = f"{prefix}.{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise SymgradError(f"cannot import {path}", where=op.source if op else None)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - a module edited by hand may fail in any way
        del sys.modules[name]
        where = op.source if op else str(path)
        raise SymgradError(f"cannot import {path}: {_short(exc)}", where=where) from None
    return module


def outputs_of(result) -> list:
    return list(result) if isinstance(result, tuple | list) else [result]


def _check_op(program, target: Target, sizes: Sizes, dtype, rng):
    """The forward and gradient checks of one op."""
    notes = []
    results = []
    if ids := program.compared:
        notes.append(
            f"{', '.join(ids)} drawn from 0..2 (read only in == and !=, so that equal values "
            "occur), with no gradient to check"
        )
    arrays = _random_inputs(program, sizes, dtype, rng, positive=False)
    try:
        want = [np.asarray(w) for w in target.reference(arrays)]
    except Exception as exc:  # noqa: BLE001 - a module edited by hand may fail in any way
        return [
            Result("forward", False, detail=f"the formula's forward raised {_short(exc)}")
        ], notes
    if not all(np.all(np.isfinite(w)) for w in want):
        # Outside the formula's domain (log, sqrt of negatives): positive inputs instead.
        arrays = _random_inputs(program, sizes, dtype, rng, positive=True)
        want = [np.asarray(w) for w in target.reference(arrays)]
        notes.append("inputs drawn from [0.5, 1.5]: the formula is not finite at signed inputs")
    try:
        got = [np.asarray(t) for t in target.call(arrays)]
    except Exception as exc:  # noqa: BLE001 - the op's own error, reported as a failure
        raised = f"the op raised {_short(exc)}"
        return [
            Result("forward", False, detail=raised),
            Result("gradient", False, detail=raised),
        ], notes
    results.append(compare_forward(program, got, want, FORWARD_TOL[dtype]))
    results.append(_adjoint_test(program, target, arrays, dtype, rng))
    return results, notes


def _short(exc: Exception) -> str:
    """An exception's type and first line, without TF's `{{function_node ...}}` prefix."""
    text = str(exc).strip().splitlines()
    first = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text[0] if text else "")
    return f"{type(exc).__name__}: {first[:300]}"


def _adjoint_test(program, target: Target, arrays, dtype, rng) -> Result:
    """<u, J v> by central differences of the op against <J^T u, v> from the framework's
    differentiation of the op, per input that has a gradient, median over DIRECTIONS
    directions."""
    tolerance = GRADIENT_TOL[dtype]
    skipped = {*program.index_inputs, *program.no_gradient, *program.compared}
    inputs = [k for k, name in enumerate(program.inputs) if name not in skipped]
    if not inputs:
        return Result("gradient", None, detail="no input has a gradient")
    worst, worst_input, worst_ratio = 0.0, inputs[0], 1.0
    for k in inputs:
        errors, ratios = [], []
        for _ in range(DIRECTIONS):
            try:
                error, ratio = _one_direction(target, arrays, k, program.inputs[k], dtype, rng)
            except _Raised as exc:
                return Result("gradient", False, None, tolerance, str(exc))
            errors.append(error)
            ratios.append(ratio)
        error = float(np.median(errors))
        if error > worst:
            worst, worst_input, worst_ratio = error, k, float(np.median(ratios))
    names = ", ".join(program.inputs[k] for k in inputs)
    if worst <= tolerance:
        return Result(
            "gradient", True, worst, tolerance, f"{DIRECTIONS} directions per input ({names})"
        )
    return Result(
        "gradient",
        False,
        worst,
        tolerance,
        f"the gradient of {program.inputs[worst_input]} disagrees with the op's differences: "
        f"<J^T u, v> / <u, J v> = {worst_ratio:.6g} (median of {DIRECTIONS} directions)",
    )


class _Raised(Exception):
    """The op or its gradient raised during the gradient check (the message says which)."""


def _one_direction(target: Target, arrays, k, name, dtype, rng) -> tuple[float, float]:
    x = arrays[k]
    v = rng.standard_normal(x.shape)
    scale = max(1.0, float(np.sqrt(np.mean(np.square(x))))) if x.size else 1.0
    h = STEP[dtype] * scale

    def shifted(sign):
        args = list(arrays)
        args[k] = x + (sign * h * v).astype(x.dtype)
        return [np.asarray(y, np.float64) for y in target.call(args)]

    try:
        plus, minus = shifted(1.0), shifted(-1.0)
    except Exception as exc:  # noqa: BLE001 - the op's own error
        raise _Raised(f"the op raised {_short(exc)}") from None
    # Outputs that are not finite (a mean over an empty segment, 0/0) have no derivative:
    # J v and u are zero there, and the test runs on the rest. A nan there had made every
    # norm nan and the error 0: any gradient passed.
    finite = [np.isfinite(p) & np.isfinite(m) for p, m in zip(plus, minus, strict=True)]
    with np.errstate(invalid="ignore"):
        jv = [
            np.where(f, (p - m) / (2 * h), 0.0) for p, m, f in zip(plus, minus, finite, strict=True)
        ]
    norm_jv = math.sqrt(sum(float(np.sum(a * a)) for a in jv))
    # u = J v / |J v| + r / |r| for a random r: the first part makes <u, J v> large (a
    # gradient off by a factor shows as that factor), the second reaches the entries where
    # J v is zero (an op that leaves an entry at 0 still differs from the formula there).
    r = [rng.standard_normal(a.shape) * f for a, f in zip(jv, finite, strict=True)]
    norm_r = math.sqrt(sum(float(np.sum(a * a)) for a in r)) or 1.0
    u = [a / norm_r + (b / norm_jv if norm_jv > 0 else 0) for a, b in zip(r, jv, strict=True)]
    cotangents = [a.astype(x.dtype) for a in u]
    try:
        g = target.pullback(list(arrays), k, cotangents)
    except Exception as exc:  # noqa: BLE001 - e.g. the registered gradient raised
        raise _Raised(f"the gradient of {name} raised {_short(exc)}") from None
    g = np.zeros(x.shape) if g is None else np.asarray(g, np.float64)
    u64 = [np.asarray(a, np.float64) for a in cotangents]
    lhs = sum(float(np.sum(a * b)) for a, b in zip(u64, jv, strict=True))
    rhs = float(np.sum(g * v))
    norm_u = math.sqrt(sum(float(np.sum(a * a)) for a in u64))
    bound = norm_u * norm_jv + float(np.linalg.norm(g)) * float(np.linalg.norm(v))
    if not math.isfinite(lhs + rhs + bound):  # a gradient that is not finite fails
        return math.inf, rhs / lhs if lhs != 0 else math.inf
    error = abs(lhs - rhs) / bound if bound > 0 else 0.0
    ratio = rhs / lhs if lhs != 0 else (1.0 if rhs == 0 else math.inf)
    return error, ratio


__all__ = ["Library", "Report", "Result", "Target", "as_json", "plan_sizes", "render_table", "run"]

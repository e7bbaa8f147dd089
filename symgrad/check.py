"""`symgrad check`: a compiled op against its formula, and against the gradient TF uses.

Per op, on small random inputs whose sizes differ per index (so a swapped layout shows):

1. forward: the op's outputs against the formula's. With a library, the op is the
   compiled one and the formula is the generated `forward`; without one, the generated
   `forward` is checked against `reference.evaluate`, a dense evaluation of the formula
   that shares nothing with lowering.
2. gradient: a dot-product (adjoint) test that does not trust symgrad's derivation. For a
   direction v in one input, <u, J v> from central differences of the op's forward must
   equal <J^T u, v> from `tf.GradientTape` through the op, which runs the gradient TF has
   registered for it (the generated one, as it is on disk). Taking u = J v (from the
   differences) makes <u, J v> = |J v|^2 > 0: a gradient off by a factor shows as that
   factor, never hidden by cancellation between entries.
3. interface (library only): the op def's input, output and attr names against the spec,
   matched the way the registered gradient matches them, and the dtypes it accepts.

`plan_sizes` is pure (SymPy only); `run` imports TensorFlow and the generated modules, and
loads the library; `render_table` and `as_json` format a `Report`. Nothing here writes.
"""

from __future__ import annotations

import importlib.util
import keyword
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sympy as sp

from . import indexing
from .emit import intact
from .errors import SymgradError
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


def plan_sizes(program: Program, attrs: dict[str, object]) -> Sizes:
    """Small sizes, distinct per index: indices that share an input axis (through the
    formula) share a size; axes read at computed positions (windows, strides) get larger
    sizes, grown until every range inferred from them is at least 2. Index tensors get a
    range of values that keeps every read in bounds (an op is free to fail on others)."""
    groups = _axis_groups(program)
    ranks = dict(program.ranks)
    plain_axes = {axis for members in groups for axis in members if isinstance(axis, tuple)}
    free = [(t, a) for t in program.inputs for a in range(ranks[t]) if (t, a) not in plain_axes]
    ints = {f"_int_{name}": value for name, value in attrs.items() if isinstance(value, int)}
    best: Sizes | None = None
    for attempt in range(GROWTH_ROUNDS):
        size_of: dict[object, int] = {}
        for n, members in enumerate(groups):
            for member in members:
                size_of[member] = 2 + n
        start = 2 + len(groups) + 3 + 4 * attempt
        for n, axis in enumerate(free):
            size_of[axis] = start + n
        shapes = {t: tuple(size_of[(t, a)] for a in range(ranks[t])) for t in program.inputs}
        indices = {i.name: size for i, size in size_of.items() if isinstance(i, sp.Symbol)}
        values = {
            **{
                indexing.shape_symbol(t, a).name: s
                for t, s2 in shapes.items()
                for a, s in enumerate(s2)
            },
            **ints,
        }
        for name, value in program.lets:  # in dependency order
            values[f"_int_{name}"] = _evaluate(value, values)
        for index, extent in program.extents:
            indices[index.name] = _evaluate(extent, values)
        lets = {k: v for k, v in values.items() if k.startswith("_int_")}
        bounds = _index_value_ranges(program, shapes, indices, {**ints, **lets})
        sizes = Sizes(shapes, indices, bounds)
        enough = all(indices[i.name] >= 2 for i, _ in program.extents) and all(
            high - low >= 2 for low, high in bounds.values()
        )
        if enough:
            return sizes
        if best is None and all(indices[i.name] >= 1 for i, _ in program.extents):
            best = sizes
    if best is None or any(high <= low for low, high in best.index_values.values()):
        raise SymgradError(
            "cannot choose input sizes for which every index has a range (check the attrs)",
            where=program.source,
        )
    return best


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
            size = shapes[gather.source][axis]
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

    @property
    def ok(self) -> bool:
        return not any(op.failed for op in self.ops)


def render_table(report: Report) -> str:
    """The report as text: one row per op and check, then what was sampled."""
    against = f"against {report.library}" if report.library else "generated forward"
    lines = [f"symgrad check: {report.spec}, {against} ({report.dtype}, seed {report.seed})"]
    lines += [f"warning: {w}" for w in report.warnings]
    width = max([len("op"), *(len(op.op) for op in report.ops)])
    lines.append(f"{'op':<{width}}  {'check':<9}  {'max error':>9}  {'tolerance':>9}  result")
    for op in report.ops:
        for r in op.results:
            error = "-" if r.error is None else f"{r.error:.1e}"
            tolerance = "-" if r.tolerance is None else f"{r.tolerance:.0e}"
            result = {True: "pass", False: "FAIL", None: "n/a"}[r.passed]
            row = f"{op.op:<{width}}  {r.check:<9}  {error:>9}  {tolerance:>9}  {result}"
            lines.append(f"{row}  {r.detail}" if r.detail else row)
    for op in report.ops:
        shapes = ", ".join(f"{n} {'x'.join(map(str, s)) or 'scalar'}" for n, s in op.shapes.items())
        sizes = ", ".join(f"{k}={v}" for k, v in op.sizes.items())
        attrs = ", ".join(f"{n}={v!r} ({how})" for n, v, how in op.attrs)
        line = f"{op.op}: inputs {shapes} ({sizes})"
        lines.append(line + (f"; attrs {attrs}" if attrs else ""))
        lines += [f"{op.op}: {note}" for note in op.notes]
    if report.skipped:
        lines.append(f"not in the library (not checked): {', '.join(report.skipped)}")
    failed = [f"{op.op} {check}" for op in report.ops for check in op.failed]
    if failed:
        lines.append(f"FAIL: {', '.join(failed)}")
    else:
        lines.append(f"all checks passed ({len(report.ops)} ops)")
    return "\n".join(lines) + "\n"


def as_json(report: Report) -> dict:
    """The report as one JSON document (for CI)."""

    def number(x):
        return None if x is None or not math.isfinite(x) else x

    return {
        "ok": report.ok,
        "spec": report.spec,
        "library": report.library,
        "dtype": report.dtype,
        "seed": report.seed,
        "warnings": list(report.warnings),
        "skipped": list(report.skipped),
        "ops": [
            {
                "op": op.op,
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


def sample_attr(kind: str, positive: bool):
    """A value for an attr nobody gave: small, and away from the special cases (a stride
    of 1, a scale of 1 or 0)."""
    return {"int": 2 if positive else 1, "float": 0.75, "bool": True}[kind]


def _random_inputs(program: Program, sizes: Sizes, dtype: str, rng, *, positive: bool):
    arrays = {}
    for name in program.inputs:
        shape = sizes.shapes[name]
        if name in program.index_inputs:
            low, high = sizes.index_values.get(name, (0, 1))
            arrays[name] = rng.integers(low, high, shape)
        elif positive:
            arrays[name] = rng.uniform(0.5, 1.5, shape).astype(dtype)
        else:
            arrays[name] = rng.standard_normal(shape).astype(dtype)
    return arrays


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
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        scale = scale if scale > 0 else 1.0
        difference = np.abs(g.astype(np.float64) - w.astype(np.float64))
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
        if np.allclose(g, factor * w, rtol=1e-6, atol=1e-12 * math.sqrt(norm)):
            return text + f"; the op's values are {factor:.6g} x the formula's"
    k = int(np.flatnonzero(bad)[0])
    at = np.unravel_index(k, bad.shape)
    return text + f"; e.g. at {list(map(int, at))}: op {got[at]:.6g}, formula {want[at]:.6g}"


def _positions(hit, size: int) -> str:
    if len(hit) == 1:
        k = int(hit[0])
        end = ", the last" if k == size - 1 else ", the first" if k == 0 else ""
        return f"{k}{end} of 0..{size - 1}"
    shown = ", ".join(str(int(k)) for k in hit[:6])
    return "{" + shown + (", ..." if len(hit) > 6 else "") + "}" + f" of 0..{size - 1}"


# ----------------------------------------------------------------------------- running


@dataclass(frozen=True)
class _Target:
    """What is checked for one op: `call(tensors)` -> outputs, both in the spec's order."""

    call: object
    reference: object  # inputs -> the formula's outputs
    results: tuple[Result, ...] = ()  # checks done before running (the interface)
    notes: tuple[str, ...] = ()


def run(
    spec: Spec,
    out: Path,
    *,
    library: str | None = None,
    op_names: tuple[str, ...] = (),
    attr_args: tuple[str, ...] = (),
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
    warnings = _module_state(spec, chosen, out)
    tf = _tensorflow()
    skipped: tuple[str, ...] = ()
    op_defs: dict = {}
    wrappers = None
    if library is not None:
        wrappers, op_defs = _load_library(tf, library)
        missing = [op.name for op in chosen if op.name not in op_defs]
        if op_names and missing:
            raise SymgradError(
                f"the library does not define {', '.join(missing)} (it defines: "
                f"{', '.join(sorted(op_defs)) or 'no ops'})",
                where=library,
            )
        skipped = tuple(missing)
        chosen = tuple(op for op in chosen if op.name in op_defs)
        if not chosen:
            raise SymgradError(
                f"the library defines none of the spec's ops (it defines: "
                f"{', '.join(sorted(op_defs)) or 'no ops'})",
                where=library,
            )
    given = parse_attr_values(spec, chosen, list(attr_args))
    reports = []
    for n, op in enumerate(chosen):
        module = _import_module(op, out)
        program = build(op)
        rng = np.random.default_rng([seed, n])
        op_def = op_defs.get(op.name)
        attrs = _attr_values(program, op, given, op_def)
        values = {name: value for name, value, _ in attrs}
        sizes = plan_sizes(program, values)
        if library is None:
            target = _generated_target(tf, program, module, values, sizes)
        else:
            target = _library_target(tf, program, module, values, op_def, wrappers, dtype)
        results, notes = _check_op(tf, program, module, target, sizes, dtype, rng)
        written = {i: size for i, size in sizes.indices.items() if "'" not in i}
        reports.append(
            OpReport(
                op.name,
                (*target.results, *results),
                written,
                sizes.shapes,
                tuple(attrs),
                (*target.notes, *notes),
            )
        )
    return Report(spec.path, library, dtype, seed, tuple(reports), tuple(warnings), skipped)


def _tensorflow():
    # TF's C++ log lines (an op's failure is also printed there) would interleave with the
    # report; the failures reach the report as exceptions.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf
    except ImportError:
        raise SymgradError("symgrad check needs TensorFlow: pip install 'symgrad[tf]'") from None
    return tf


def _module_state(spec: Spec, ops, out: Path) -> list[str]:
    """Each op's module must be on disk as `symgrad generate` would write it now; a module
    edited by hand is checked as it is, with a warning."""
    source_name = Path(spec.path).name
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
        if text == module_text(op, source_name):
            continue
        if intact(text):
            raise SymgradError(
                f"{path} is stale against the spec (op {op.name}); run `symgrad generate`",
                where=spec.path,
            )
        warnings.append(f"{path} was edited by hand since symgrad generated it; checked as it is")
    return warnings


def _import_module(op: OpSpec, out: Path):
    """The generated module as it is on disk (importing it registers its gradient)."""
    path = out / f"{snake_case(op.name)}.py"
    name = f"_symgrad_check.{snake_case(op.name)}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - a module edited by hand may fail in any way
        raise SymgradError(
            f"cannot import {path}: {type(exc).__name__}: {exc}", where=op.source
        ) from None
    sys.modules[name] = module
    return module


def _load_library(tf, library: str):
    """The library's Python wrappers, and the op defs it registers, by op type."""
    path = Path(library)
    from tensorflow.core.framework import op_def_pb2
    from tensorflow.python.client import pywrap_tf_session  # the op list has no public API

    try:
        wrappers = tf.load_op_library(str(path.resolve()))
        handle = pywrap_tf_session.TF_LoadLibrary(str(path.resolve()))
        try:
            op_list = op_def_pb2.OpList.FromString(pywrap_tf_session.TF_GetOpList(handle))
        finally:
            pywrap_tf_session.TF_DeleteLibraryHandle(handle)
    except Exception as exc:  # noqa: BLE001 - TF raises several types for a bad library
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SymgradError(f"cannot load the library: {first}", where=library) from None
    return wrappers, {op_def.name: op_def for op_def in op_list.op}


def _attr_values(program: Program, op: OpSpec, given: dict, op_def) -> list:
    """(name, value, where from) per attr: --attr, else the op def's default, else a sample."""
    values = []
    defaults = {}
    if op_def is not None:
        for attr in op_def.attr:
            if attr.HasField("default_value"):
                kind = attr.default_value.WhichOneof("value")
                if kind in ("i", "f", "b"):
                    defaults[attr.name.lower()] = getattr(attr.default_value, kind)
    for name, kind in op.attrs:
        if name in given:
            values.append((name, given[name], "--attr"))
        elif name.lower() in defaults:
            value = defaults[name.lower()]
            value = {"int": int, "float": float, "bool": bool}[kind](value)
            values.append((name, value, "op default"))
        else:
            values.append((name, sample_attr(kind, name in program.positive_attrs), "sample"))
    return values


def _outputs(result) -> list:
    return list(result) if isinstance(result, tuple | list) else [result]


def _generated_target(tf, program, module, attrs, sizes) -> _Target:
    """No library: the generated forward against the dense evaluation of the formula."""
    from .reference import evaluate_op

    int_attrs = frozenset(n for n, kind in program.attrs if kind == "int")
    outputs = {o.level.name for o in program.outputs}

    def reference(tensors):
        named = dict(zip(program.inputs, tensors, strict=True))
        lets = _let_values(program, attrs, {n: tuple(t.shape) for n, t in named.items()})
        return evaluate_op(
            program.formulas,
            named,
            {**attrs, **lets},
            outputs=outputs,
            sizes=sizes.indices,
            int_attrs=int_attrs | frozenset(lets),
        )

    def call(tensors):
        return _outputs(module.forward(*tensors, **attrs))

    return _Target(call, reference)


def _library_target(tf, program, module, attrs, op_def, wrappers, dtype) -> _Target:
    """The compiled op, its inputs and outputs matched to the spec's by name as the
    registered gradient matches them; the interface check says whether that worked."""
    results = []
    problems = []
    fake = _OpDefView(op_def)
    try:
        inputs_at, outputs_at, attr_names = module._match(fake)
        matched = True
    except (ValueError, LookupError) as exc:
        problems.append(str(exc))
        count = len(op_def.input_arg)
        inputs_at = tuple(range(len(program.inputs))) if count == len(program.inputs) else None
        outputs_at = tuple(range(len(program.outputs)))
        attr_names = {a.name.lower(): a.name for a in op_def.attr}
        attr_names = {n: attr_names.get(n.lower(), n) for n, _ in program.attrs}
        matched = False
    problems += _dtype_problems(program, op_def, dtype, inputs_at)
    if matched:
        mapping = ", ".join(
            f"{op_def.input_arg[k].name}={name}"
            for name, k in zip(program.inputs, inputs_at, strict=True)
        )
        detail = f"inputs by name: {mapping}"
    else:
        detail = "; ".join(problems)
    results.append(Result("interface", not problems, detail="; ".join(problems) or detail))
    notes = () if matched else ("the op's inputs are passed in the spec's order (names differ)",)
    wrapper = _wrapper(wrappers, op_def.name)
    index_dtype = _index_dtype(op_def, program, inputs_at)

    def call(tensors):
        if inputs_at is None:
            raise ValueError("the op's inputs cannot be matched to the formula's")
        # The wrappers take keyword arguments only, named as in the op def.
        keywords = {_keyword(attr_names[n]): v for n, v in attrs.items()}
        for tensor, k, name in zip(tensors, inputs_at, program.inputs, strict=True):
            if name in program.index_inputs:
                tensor = tf.cast(tensor, index_dtype)
            keywords[_keyword(op_def.input_arg[k].name)] = tensor
        result = _outputs(wrapper(**keywords))
        return [result[k] for k in outputs_at]

    def reference(tensors):
        return _outputs(module.forward(*tensors, **attrs))

    return _Target(call, reference, tuple(results), notes)


def _keyword(name: str) -> str:
    """A Python wrapper's parameter name for an op def name (`lambda` becomes `lambda_`)."""
    return f"{name}_" if keyword.iskeyword(name) else name


class _OpDefView:
    """What the module's `_match` reads of an op: its type and op def."""

    def __init__(self, op_def) -> None:
        self.type = op_def.name
        self.op_def = op_def


def _wrapper(wrappers, op_type: str):
    """The library's Python function for an op (`BatchedMatMul` -> `batched_mat_mul`)."""
    wanted = op_type.lower()
    for name in sorted(dir(wrappers)):
        if name.replace("_", "").lower() == wanted and callable(getattr(wrappers, name)):
            return getattr(wrappers, name)
    raise SymgradError(f"the library has no Python wrapper for op {op_type}")


def _allowed(op_def, arg) -> list[str] | None:
    """The dtype names an input or output accepts, None for any."""
    from tensorflow.python.framework import dtypes

    if arg.type_attr:
        for attr in op_def.attr:
            if attr.name == arg.type_attr:
                listed = attr.allowed_values.list.type
                return [dtypes.as_dtype(t).name for t in listed] if listed else None
        return None
    return [dtypes.as_dtype(arg.type).name]


def _dtype_problems(program, op_def, dtype, inputs_at) -> list[str]:
    if inputs_at is None:
        return []
    problems = []
    for name, k in zip(program.inputs, inputs_at, strict=True):
        arg = op_def.input_arg[k]
        allowed = _allowed(op_def, arg)
        if allowed is None:
            continue
        if name in program.index_inputs:
            if not {"int32", "int64"} & set(allowed):
                problems.append(
                    f"index input {arg.name} takes {', '.join(allowed)}, not int32 or int64"
                )
        elif dtype not in allowed:
            problems.append(f"input {arg.name} takes {', '.join(allowed)}, not {dtype}")
    return problems


def _index_dtype(op_def, program, inputs_at):
    import tensorflow as tf

    if inputs_at is None:
        return tf.int32
    for name, k in zip(program.inputs, inputs_at, strict=True):
        if name in program.index_inputs:
            allowed = _allowed(op_def, op_def.input_arg[k])
            if allowed is not None and "int32" not in allowed:
                return tf.int64
    return tf.int32


def _check_op(tf, program, module, target: _Target, sizes: Sizes, dtype, rng):
    """The forward and gradient checks of one op."""
    notes = []
    results = []
    arrays = _random_inputs(program, sizes, dtype, rng, positive=False)
    tensors = _tensors(tf, program, arrays)
    try:
        want = [t.numpy() for t in target.reference(tensors)]
    except Exception as exc:  # noqa: BLE001 - a module edited by hand may fail in any way
        return [
            Result("forward", False, detail=f"the formula's forward raised {_short(exc)}")
        ], notes
    if not all(np.all(np.isfinite(w)) for w in want):
        # Outside the formula's domain (log, sqrt of negatives): positive inputs instead.
        arrays = _random_inputs(program, sizes, dtype, rng, positive=True)
        tensors = _tensors(tf, program, arrays)
        want = [t.numpy() for t in target.reference(tensors)]
        notes.append("inputs drawn from [0.5, 1.5]: the formula is not finite at signed inputs")
    try:
        got = [np.asarray(t) for t in target.call(tensors)]
    except Exception as exc:  # noqa: BLE001 - the op's own error, reported as a failure
        results.append(Result("forward", False, detail=f"the op raised {_short(exc)}"))
        got = None
    if got is not None:
        results.append(compare_forward(program, got, want, FORWARD_TOL[dtype]))
    results.append(_adjoint_test(tf, program, target.call, tensors, dtype, rng))
    return results, notes


def _tensors(tf, program, arrays):
    return [tf.constant(arrays[name]) for name in program.inputs]


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:300]}"


def _adjoint_test(tf, program, call, tensors, dtype, rng) -> Result:
    """<u, J v> by central differences of `call` against <J^T u, v> from the tape through
    `call`, per input that has a gradient, median over DIRECTIONS directions."""
    tolerance = GRADIENT_TOL[dtype]
    inputs = [
        k
        for k, name in enumerate(program.inputs)
        if name not in program.index_inputs and name not in program.no_gradient
    ]
    if not inputs:
        return Result("gradient", None, detail="no input has a gradient")
    worst, worst_input, worst_ratio = 0.0, inputs[0], 1.0
    for k in inputs:
        errors, ratios = [], []
        for _ in range(DIRECTIONS):
            try:
                error, ratio = _one_direction(tf, call, tensors, k, dtype, rng)
            except Exception as exc:  # noqa: BLE001 - e.g. the registered gradient raised
                return Result(
                    "gradient",
                    False,
                    math.inf,
                    tolerance,
                    f"gradient of {program.inputs[k]}: {_short(exc)}",
                )
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


def _one_direction(tf, call, tensors, k, dtype, rng) -> tuple[float, float]:
    x = tensors[k]
    v = rng.standard_normal(x.shape.as_list())
    scale = (
        max(1.0, float(np.sqrt(np.mean(np.square(x.numpy()))))) if x.shape.num_elements() else 1.0
    )
    h = STEP[dtype] * scale

    def shifted(sign):
        args = list(tensors)
        args[k] = x + tf.constant(sign * h * v, x.dtype)
        return [np.asarray(y, np.float64) for y in call(args)]

    plus, minus = shifted(1.0), shifted(-1.0)
    jv = [(p - m) / (2 * h) for p, m in zip(plus, minus, strict=True)]
    norm_jv = math.sqrt(sum(float(np.sum(a * a)) for a in jv))
    # u = J v / |J v| + r / |r| for a random r: the first part makes <u, J v> large (a
    # gradient off by a factor shows as that factor), the second reaches the entries where
    # J v is zero (an op that leaves an entry at 0 still differs from the formula there).
    r = [rng.standard_normal(a.shape) for a in jv]
    norm_r = math.sqrt(sum(float(np.sum(a * a)) for a in r)) or 1.0
    u = [a / norm_r + (b / norm_jv if norm_jv > 0 else 0) for a, b in zip(r, jv, strict=True)]
    with tf.GradientTape() as tape:
        tape.watch(x)
        ys = call(list(tensors[:k]) + [x] + list(tensors[k + 1 :]))
    grads = [tf.constant(a, y.dtype) for a, y in zip(u, ys, strict=True)]
    g = tape.gradient(ys, x, output_gradients=grads)
    g = (
        np.zeros(x.shape.as_list())
        if g is None
        else np.asarray(tf.convert_to_tensor(g), np.float64)
    )
    u64 = [np.asarray(a, np.float64) for a in u]
    lhs = sum(float(np.sum(a * b)) for a, b in zip(u64, jv, strict=True))
    rhs = float(np.sum(g * v))
    norm_u = math.sqrt(sum(float(np.sum(a * a)) for a in u64))
    bound = norm_u * norm_jv + float(np.linalg.norm(g)) * float(np.linalg.norm(v))
    error = abs(lhs - rhs) / bound if bound > 0 else 0.0
    ratio = rhs / lhs if lhs != 0 else (1.0 if rhs == 0 else math.inf)
    return error, ratio


__all__ = ["Report", "Result", "as_json", "plan_sizes", "render_table", "run"]

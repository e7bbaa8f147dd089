"""`symgrad check --target pytorch`: ops of a library loaded with `torch.ops.load_library`
(a .so) or imported (a .py that registers them with `torch.library`), each spec op being
`NS::snake_case(name)`. The generated module's `register` gives each op its backward, and
`torch.autograd.grad` through the op runs it; the interface check reads the op's schema.

`load`, `import_module` and `generated` are what `check.run` calls (see `check.Library`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .check import Library, Result, Target, import_file, outputs_of
from .errors import SymgradError
from .model import Program
from .spec import OpSpec, Spec, snake_case


def torch_module():
    try:
        import torch
    except ImportError:
        raise SymgradError(
            "symgrad check --target pytorch needs PyTorch: pip install torch"
        ) from None
    return torch


def import_module(path: Path, op: OpSpec):
    torch_module()
    return import_file(path, op, "_symgrad_check_torch")


def generated(program: Program, module, attrs: dict, sizes) -> Target:
    """No library: the generated forward against the dense evaluation of the formula."""
    from .check_tf import formula_reference

    call, pullback = _numpy_pair(torch_module(), program, lambda ts: module.forward(*ts, **attrs))
    return Target(call, formula_reference(program, attrs, sizes), pullback)


def _numpy_pair(torch, program, call_torch):
    """`call` and `pullback` in NumPy around an op called on torch tensors."""

    def tensors_of(arrays):
        return [
            torch.from_numpy(np.ascontiguousarray(a)).to(torch.int64)
            if name in program.index_inputs
            else torch.from_numpy(np.ascontiguousarray(a))
            for name, a in zip(program.inputs, arrays, strict=True)
        ]

    def call(arrays):
        with torch.no_grad():
            return [y.detach().numpy() for y in outputs_of(call_torch(tensors_of(arrays)))]

    def pullback(arrays, k, cotangents):
        tensors = tensors_of(arrays)
        tensors[k] = tensors[k].clone().requires_grad_(True)
        ys = outputs_of(call_torch(tensors))
        grads = [
            torch.from_numpy(np.ascontiguousarray(u)).to(y.dtype)
            for u, y in zip(cotangents, ys, strict=True)
        ]
        pairs = [(y, g) for y, g in zip(ys, grads, strict=True) if y.requires_grad]
        if not pairs:
            raise ValueError("the op's outputs do not require grad: it has no backward")
        (g,) = torch.autograd.grad(
            [y for y, _ in pairs], [tensors[k]], [g for _, g in pairs], allow_unused=True
        )
        return None if g is None else g.detach().numpy()

    return call, pullback


def load(library: str, spec: Spec, ops, namespace: str | None) -> Library:
    """Load the .so or import the .py, and find each spec op as NS::snake_case(name)."""
    del spec
    torch = torch_module()
    names = torch._C._dispatch_get_all_op_names  # every registered "ns::name"
    before = set(names())
    path = Path(library)
    try:
        if path.suffix == ".py":
            import_file(path.resolve(), None, "_symgrad_check_torch_library")
        else:
            torch.ops.load_library(str(path.resolve()))
    except SymgradError as exc:
        raise SymgradError(exc.message, where=library) from None
    except Exception as exc:  # noqa: BLE001 - torch raises several types for a bad library
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SymgradError(f"cannot load the library: {first}", where=library) from None
    registered = set(names())
    new = sorted(registered - before)
    namespace = namespace or _namespace(new, ops, library)
    found = {}
    for op in ops:
        qualified = f"{namespace}::{snake_case(op.name)}"
        if qualified in registered:
            packet = getattr(getattr(torch.ops, namespace), snake_case(op.name))
            found[op.name] = packet.default if hasattr(packet, "default") else packet
    listing = ", ".join(new) if new else ""

    def defaults(op: OpSpec, program: Program) -> dict:
        arguments = {a.name: a for a in found[op.name]._schema.arguments}
        return {
            name: arguments[name].default_value
            for name, _ in op.attrs
            if name in arguments and arguments[name].default_value is not None
        }

    def holds(op: OpSpec, name: str, value):
        return value  # a schema's float is a double

    def target(op, program, module, attrs, dtype):
        return _library_target(torch, program, module, attrs, found[op.name])

    return Library(frozenset(found), defaults, holds, target, listing)


def _namespace(new: list[str], ops, library: str) -> str:
    """The namespace the library registers the spec's ops in, when --namespace is not given."""
    wanted = {snake_case(op.name) for op in ops}
    spaces = sorted({q.split("::", 1)[0] for q in new if q.split("::", 1)[1] in wanted})
    if len(spaces) == 1:
        return spaces[0]
    if not spaces:
        raise SymgradError(
            "the library registers none of the spec's ops as NS::snake_case(name) (it "
            f"registers: {', '.join(new) or 'no ops'}); name the namespace with --namespace",
            where=library,
        )
    raise SymgradError(
        f"the library registers the spec's ops in several namespaces ({', '.join(spaces)}); "
        "choose one with --namespace",
        where=library,
    )


def interface_problems(program: Program, schema) -> list[str]:
    """What of the op's schema does not fit what the registered backward reads: the
    spec's inputs in order, then its attrs, and one tensor per output."""
    theirs = [a.name for a in schema.arguments]
    attrs = [name for name, _ in program.attrs]
    ours = [*program.inputs, *attrs]
    problems = []
    missing = [n for n in ours if n not in theirs]
    for name in missing:
        kind = "input" if name in program.inputs else "attr"
        problems.append(f"op {schema.name} has no argument {name!r} (the spec's {kind})")
    extra = [a.name for a in schema.arguments if a.name not in ours and a.default_value is None]
    if extra:
        problems.append(
            f"op {schema.name} takes {', '.join(map(repr, extra))}, which the spec has not"
        )
    if not missing and theirs[: len(ours)] != ours:
        problems.append(
            f"op {schema.name} takes ({', '.join(theirs)}); its backward needs the spec's "
            f"inputs then attrs in this order: ({', '.join(ours)})"
        )
    if len(schema.returns) != len(program.outputs):
        problems.append(
            f"op {schema.name} returns {len(schema.returns)} tensor(s); the formula has "
            f"{len(program.outputs)}"
        )
    return problems


def _library_target(torch, program, module, attrs, op) -> Target:
    schema = op._schema
    problems = interface_problems(program, schema)
    theirs = [a.name for a in schema.arguments]
    by_name = all(name in theirs for name in program.inputs)
    notes = []
    if not by_name:
        notes.append("the op's inputs are passed in the spec's order (names differ)")
    missing = [name for name in attrs if name not in theirs]
    if missing:
        notes.append(f"the op has no attr {', '.join(missing)}: checked without passing it")
    try:
        module.register(op)
    except (ValueError, TypeError, LookupError, RuntimeError) as exc:
        problems.append(f"register: {exc}")
    if not problems:
        detail = f"schema {schema.name}({', '.join(theirs)})"
    else:
        detail = "; ".join(problems)
    results = (Result("interface", not problems, detail=detail),)
    passed = {name: value for name, value in attrs.items() if name in theirs}

    def call_torch(tensors):
        if by_name:
            return op(**dict(zip(program.inputs, tensors, strict=True)), **passed)
        return op(*tensors, **passed)

    call, pullback = _numpy_pair(torch, program, call_torch)

    def reference(arrays):
        tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        with torch.no_grad():
            return [y.numpy() for y in outputs_of(module.forward(*tensors, **attrs))]

    return Target(call, reference, pullback, results, tuple(notes))

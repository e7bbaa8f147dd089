"""`symgrad check --target jax`: a Python module that defines, per spec op, a primal
function `snake_case(name)(*inputs, **attrs)` (a `jax.ffi.ffi_call`, a `pure_callback`,
plain `jax.numpy`). The gradient checked is the generated module's `wrap(primal)`, as a
user differentiates the op; the interface check reads the function's signature.

`load`, `import_module` and `generated` are what `check.run` calls (see `check.Library`).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np

from .check import Library, Result, Target, import_file, outputs_of
from .errors import SymgradError
from .model import Program
from .spec import OpSpec, Spec, snake_case


def jax_modules():
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        raise SymgradError("symgrad check --target jax needs JAX: pip install jax") from None
    jax.config.update("jax_enable_x64", True)  # float64 checks need float64 arrays
    return jax, jnp


def import_module(path: Path, op: OpSpec):
    jax_modules()
    return import_file(path, op, "_symgrad_check_jax")


def generated(program: Program, module, attrs: dict, sizes) -> Target:
    """No library: the generated forward against the dense evaluation of the formula."""
    from .check_tf import formula_reference

    call, pullback = _numpy_pair(program, lambda *xs: module.forward(*xs, **attrs))
    return Target(call, formula_reference(program, attrs, sizes), pullback)


def _numpy_pair(program, function):
    """`call` and `pullback` (through jax.vjp) in NumPy around a function of JAX arrays."""
    jax, jnp = jax_modules()

    def arrays_of(arrays):
        return [
            jnp.asarray(a, jnp.int32 if name in program.index_inputs else a.dtype)
            for name, a in zip(program.inputs, arrays, strict=True)
        ]

    def call(arrays):
        return [np.asarray(y) for y in outputs_of(function(*arrays_of(arrays)))]

    def pullback(arrays, k, cotangents):
        xs = arrays_of(arrays)

        def of_input(x):
            return tuple(outputs_of(function(*xs[:k], x, *xs[k + 1 :])))

        ys, back = jax.vjp(of_input, xs[k])
        (g,) = back(tuple(jnp.asarray(u, y.dtype) for u, y in zip(cotangents, ys, strict=True)))
        return np.asarray(g)

    return call, pullback


def load(library: str, spec: Spec, ops, namespace: str | None) -> Library:
    """Import the module and find each spec op's primal as snake_case(name)."""
    del spec
    if namespace is not None:
        raise SymgradError("--namespace is for --target pytorch (JAX functions have none)")
    if Path(library).suffix != ".py":
        raise SymgradError(
            "--target jax checks a Python module (FILE.py) that defines a primal function "
            "snake_case(name) per op",
            where=library,
        )
    jax_modules()
    try:
        module = import_file(Path(library).resolve(), None, "_symgrad_check_jax_library")
    except SymgradError as exc:
        raise SymgradError(exc.message, where=library) from None
    found = {
        op.name: getattr(module, snake_case(op.name))
        for op in ops
        if callable(getattr(module, snake_case(op.name), None))
    }
    listing = ", ".join(
        sorted(
            name
            for name, value in vars(module).items()
            if callable(value)
            and not name.startswith("_")
            and not isinstance(value, type)
            and getattr(value, "__module__", None) == module.__name__
        )
    )

    def defaults(op: OpSpec, program: Program) -> dict:
        parameters = _parameters(found[op.name])
        return {
            name: parameters[name].default
            for name, _ in op.attrs
            if name in parameters and parameters[name].default is not inspect.Parameter.empty
        }

    def holds(op: OpSpec, name: str, value):
        return value

    def target(op, program, module, attrs, dtype):
        return _library_target(program, module, attrs, found[op.name], snake_case(op.name))

    return Library(frozenset(found), defaults, holds, target, listing)


def _parameters(function) -> dict:
    try:
        return dict(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return {}


def interface_problems(program: Program, function, name: str) -> tuple[list[str], list[str]]:
    """What of the primal's signature does not fit `wrap`'s call `primal(*inputs, **attrs)`:
    the spec's inputs first, in order, then each attr as a keyword. Also the attrs it
    cannot take (not passed to it)."""
    parameters = _parameters(function)
    if not parameters:
        return [], []
    kinds = inspect.Parameter
    positional = [
        p.name
        for p in parameters.values()
        if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    varargs = any(p.kind == kinds.VAR_POSITIONAL for p in parameters.values())
    keywords = any(p.kind == kinds.VAR_KEYWORD for p in parameters.values())
    problems = []
    ours = list(program.inputs)
    head = positional[: len(ours)]
    if len(head) < len(ours) and not varargs:
        problems.append(
            f"{name} takes {len(head)} positional input(s) ({', '.join(head)}); the spec has "
            f"{len(ours)} ({', '.join(ours)})"
        )
    elif [n.lower() for n in head] != [n.lower() for n in ours[: len(head)]]:
        problems.append(
            f"{name} takes its inputs as ({', '.join(head)}); the spec's are "
            f"({', '.join(ours)}), passed in this order"
        )
    missing = []
    for attr, _ in program.attrs:
        p = parameters.get(attr)
        if (p is None and not keywords) or (p is not None and p.kind == kinds.POSITIONAL_ONLY):
            missing.append(attr)
            problems.append(f"{name} has no keyword argument {attr!r} (the spec's attr)")
    return problems, missing


def _library_target(program, module, attrs, function, name) -> Target:
    problems, missing = interface_problems(program, function, name)
    notes = []
    if missing:
        notes.append(f"the op has no attr {', '.join(missing)}: checked without passing it")
    parameters = _parameters(function)
    detail = "; ".join(problems) or f"{name}({', '.join(parameters)})"
    results = (Result("interface", not problems, detail=detail),)

    def primal(*xs, **given):
        return function(*xs, **{k: v for k, v in given.items() if k not in missing})

    wrapped = module.wrap(primal)
    call, _ = _numpy_pair(program, lambda *xs: primal(*xs, **attrs))
    _, pullback = _numpy_pair(program, lambda *xs: wrapped(*xs, **attrs))

    def reference(arrays):
        return [np.asarray(y) for y in outputs_of(module.forward(*arrays, **attrs))]

    return Target(call, reference, pullback, results, tuple(notes))

"""`symgrad check` for TensorFlow: a library loaded with `tf.load_op_library`, its op defs
read for the interface check, and `tf.GradientTape` through the op for the gradient (TF
runs the generated gradient registered for the op type).

`load`, `import_module` and `generated` are what `check.run` calls (see `check.Library`).
"""

from __future__ import annotations

import contextlib
import keyword
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

from .check import Library, Result, Target, import_file, outputs_of
from .errors import SymgradError
from .model import Program
from .spec import OpSpec, Spec, snake_case


def tensorflow():
    # TF's C++ log lines (an op's failure is also printed there) would interleave with the
    # report; the failures reach the report as exceptions.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        with _start_up_notices_dropped():
            import tensorflow as tf
    except ImportError:
        raise SymgradError("symgrad check needs TensorFlow: pip install 'symgrad[tf]'") from None
    return tf


# TensorFlow's notices at import (oneDNN on, the CPU's instructions), printed by its C++
# logger before TF_CPP_MIN_LOG_LEVEL applies on CPUs where oneDNN runs.
_NOTICE = re.compile(
    r"absl::InitializeLog|port\.cc:\d+\] oneDNN custom operations|cpu_feature_guard"
    r"|^To enable the following instructions:"
)


@contextlib.contextmanager
def _start_up_notices_dropped():
    """Run the block with the process's stderr (file descriptor 2, which TF's C++ logger
    writes to) caught, then pass on every line but TF's start-up notices."""
    if "tensorflow" in sys.modules:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not _NOTICE.search(line)))


def import_module(path: Path, op: OpSpec):
    """The generated module as it is on disk (importing it registers its gradient)."""
    tensorflow()
    return import_file(path, op, "_symgrad_check")


def generated(program: Program, module, attrs: dict, sizes) -> Target:
    """No library: the generated forward against the dense evaluation of the formula."""

    def call_tf(tensors):
        return outputs_of(module.forward(*tensors, **attrs))

    call, pullback = _numpy_pair(tensorflow(), call_tf)
    return Target(call, formula_reference(program, attrs, sizes), pullback)


def formula_reference(program: Program, attrs: dict, sizes):
    """The dense evaluation of the formula (`reference.evaluate`, in TensorFlow), in NumPy:
    what a generated forward is checked against when there is no library."""
    tf = tensorflow()
    from .check import _let_values
    from .reference import evaluate_op

    int_attrs = frozenset(n for n, kind in program.attrs if kind == "int")
    outputs = {o.level.name for o in program.outputs}

    def reference(arrays):
        named = {n: tf.constant(a) for n, a in zip(program.inputs, arrays, strict=True)}
        lets = _let_values(program, attrs, {n: tuple(a.shape) for n, a in named.items()})
        found = evaluate_op(
            program.formulas,
            named,
            {**attrs, **lets},
            outputs=outputs,
            sizes=sizes.indices,
            int_attrs=int_attrs | frozenset(lets),
            floats=frozenset(program.float_positions),
        )
        return [np.asarray(y) for y in found]

    return reference


def _numpy_pair(tf, call_tf):
    """`call` and `pullback` in NumPy around an op called on TF tensors."""

    def call(arrays):
        return [np.asarray(y) for y in call_tf([tf.constant(a) for a in arrays])]

    def pullback(arrays, k, cotangents):
        tensors = [tf.constant(a) for a in arrays]
        x = tensors[k]
        with tf.GradientTape() as tape:
            tape.watch(x)
            ys = call_tf(tensors)
        grads = [tf.constant(u, y.dtype) for u, y in zip(cotangents, ys, strict=True)]
        g = tape.gradient(ys, x, output_gradients=grads)
        return None if g is None else np.asarray(tf.convert_to_tensor(g))

    return call, pullback


def load(library: str, spec: Spec, ops, namespace: str | None) -> Library:
    """The library's Python wrappers and op defs, as a `check.Library`."""
    del spec, ops
    if namespace is not None:
        raise SymgradError("--namespace is for --target pytorch (TF op types have none)")
    tf = tensorflow()
    wrappers, op_defs = _load_library(tf, library)

    def defaults(op: OpSpec, program: Program) -> dict:
        found = {}
        for attr in op_defs[op.name].attr:
            if attr.HasField("default_value"):
                kind = attr.default_value.WhichOneof("value")
                if kind in ("i", "f", "b"):
                    found[attr.name.lower()] = getattr(attr.default_value, kind)
        return {name: found[name.lower()] for name, _ in op.attrs if name.lower() in found}

    def holds(op: OpSpec, name: str, value):
        return held_value(op_defs[op.name], name, value)

    def target(op, program, module, attrs, dtype):
        return _library_target(tf, program, module, attrs, op_defs[op.name], wrappers, dtype)

    return Library(frozenset(op_defs), defaults, holds, target, ", ".join(sorted(op_defs)))


def held_value(op_def, name: str, value):
    """The value an attr of the op holds once set to `value`, read back through the op's
    own attr storage: a TF float attr is a float32 (`0.7` holds 0.699999988079071)."""
    from tensorflow.core.framework import attr_value_pb2

    for attr in op_def.attr:
        if attr.name.lower() == name.lower() and attr.type == "float":
            return attr_value_pb2.AttrValue(f=value).f
    return value


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


def _library_target(tf, program, module, attrs, op_def, wrappers, dtype) -> Target:
    """The compiled op, its inputs and outputs matched to the spec's by name as the
    registered gradient matches them; the interface check says whether that worked."""
    problems = []
    fake = _OpDefView(op_def)
    try:
        inputs_at, outputs_at, attr_names = module._match(fake)
        matched = True
    except (ValueError, LookupError) as exc:
        problems.append(str(exc))
        matched = False
        inputs_at, outputs_at, attr_names = _match_parts(program, op_def)
    problems += _dtype_problems(program, op_def, dtype, inputs_at)
    notes = []
    if matched:
        mapping = ", ".join(
            f"{op_def.input_arg[k].name}={name}"
            for name, k in zip(program.inputs, inputs_at, strict=True)
        )
        detail = f"inputs by name: {mapping}"
    else:
        detail = "; ".join(problems)
        if inputs_at is not None and not _inputs_by_name(program, op_def):
            notes.append("the op's inputs are passed in the spec's order (names differ)")
        missing = [name for name in attrs if name not in attr_names]
        if missing:
            notes.append(f"the op has no attr {', '.join(missing)}: checked without passing it")
    results = (Result("interface", not problems, detail="; ".join(problems) or detail),)
    wrapper = _wrapper(wrappers, op_def.name)
    index_dtype = _index_dtype(tf, op_def, program, inputs_at)

    def call_tf(tensors):
        if inputs_at is None:
            raise ValueError("the op's inputs cannot be matched to the formula's")
        # The wrappers take keyword arguments only, named as in the op def.
        keywords = {_keyword(attr_names[n]): v for n, v in attrs.items() if n in attr_names}
        for tensor, k, name in zip(tensors, inputs_at, program.inputs, strict=True):
            if name in program.index_inputs:
                tensor = tf.cast(tensor, index_dtype)
            keywords[_keyword(op_def.input_arg[k].name)] = tensor
        result = outputs_of(wrapper(**keywords))
        if outputs_at is None:
            return result
        return [result[k] for k in outputs_at]

    def reference(arrays):
        tensors = [tf.constant(a) for a in arrays]
        return [np.asarray(y) for y in outputs_of(module.forward(*tensors, **attrs))]

    call, pullback = _numpy_pair(tf, call_tf)
    return Target(call, reference, pullback, results, tuple(notes))


def _inputs_by_name(program, op_def) -> bool:
    return _by_name([a.name for a in op_def.input_arg], program.inputs) is not None


def _by_name(theirs: list[str], ours) -> tuple[int, ...] | None:
    """Each of our names' position among theirs (ignoring case), None if they differ."""
    if len(theirs) != len(ours):
        return None
    if len(ours) == 1:
        return (0,)
    folded = [n.lower() for n in theirs]
    if sorted(folded) != sorted(n.lower() for n in ours) or len(set(folded)) != len(folded):
        return None
    return tuple(folded.index(n.lower()) for n in ours)


def _match_parts(program, op_def):
    """Where `_match` failed: the parts that do match, each on its own (inputs by name, else
    in the spec's order when the counts agree; the attrs the op has)."""
    inputs_at = _by_name([a.name for a in op_def.input_arg], program.inputs)
    if inputs_at is None and len(op_def.input_arg) == len(program.inputs):
        inputs_at = tuple(range(len(program.inputs)))
    outputs_at = _by_name([a.name for a in op_def.output_arg], _output_names(program))
    if outputs_at is None and len(op_def.output_arg) == len(_output_names(program)):
        outputs_at = tuple(range(len(_output_names(program))))
    theirs = {a.name.lower(): a.name for a in op_def.attr}
    attr_names = {n: theirs[n.lower()] for n, _ in program.attrs if n.lower() in theirs}
    return inputs_at, outputs_at, attr_names


def _output_names(program) -> list[str]:
    return [output.level.name for output in program.outputs]


def _keyword(name: str) -> str:
    """A Python wrapper's parameter name for an op def name (`lambda` becomes `lambda_`)."""
    return f"{name}_" if keyword.iskeyword(name) else name


class _OpDefView:
    """What the module's `_match` reads of an op: its type and op def."""

    def __init__(self, op_def) -> None:
        self.type = op_def.name
        self.op_def = op_def


def _wrapper(wrappers, op_type: str):
    """The library's Python function for an op, by TensorFlow's own name for it, which is
    the module's (`BatchedMatMul` -> `batched_mat_mul`): `AB` is `ab`, never `a_b`."""
    function = getattr(wrappers, snake_case(op_type), None)
    if callable(function):
        return function
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


def _index_dtype(tf, op_def, program, inputs_at):
    if inputs_at is None:
        return tf.int32
    for name, k in zip(program.inputs, inputs_at, strict=True):
        if name in program.index_inputs:
            allowed = _allowed(op_def, op_def.input_arg[k])
            if allowed is not None and "int32" not in allowed:
                return tf.int64
    return tf.int32

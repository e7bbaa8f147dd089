"""Generate a module from formulas in a temp folder, import it, and check it numerically.

Every check is float64: the generated `forward`, `vjp`, the registered `gradient(op, ...)`
and a tape over `forward` (the custom-gradient path) against TF autodiff over the
independent reference evaluator, plus finite differences (`tf.test.compute_gradient`).
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import tensorflow as tf

from symgrad.model import build
from symgrad.pipeline import module_text
from symgrad.reference import evaluate_op
from symgrad.spec import OpSpec

_counter = itertools.count()


@dataclass
class Case:
    """A formula (or several), how to make its inputs, and its attrs."""

    formulas: tuple[str, ...] | str
    shapes: dict[str, tuple[int, ...]]
    attrs: dict[str, object] = field(default_factory=dict)
    attr_types: dict[str, str] = field(default_factory=dict)
    low: float = -1.0
    high: float = 1.0
    no_gradient: tuple[str, ...] = ()
    inputs: tuple[str, ...] | None = None
    rtol: float = 1e-9
    fd_tol: float = 1e-5
    finite_differences: bool = True
    # Index ranges for the spec (index -> integer expression over int literals, int attrs
    # and `X.shape[n]`), and, independently, the sizes the reference uses for indices that
    # no input axis reads plainly. The two must agree; the test states both.
    ranges: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    # Integer index tensors: name -> (shape, low, high[, dtype]); values are drawn uniformly
    # from [low, high), so a range wider than the indexed axis tests the zero rule. They
    # are passed as int tensors and must get None as gradient everywhere.
    index_inputs: dict[str, tuple] = field(default_factory=dict)
    # Finite differences along this many random directions per input instead of the full
    # Jacobian (which costs two forward calls per element: too slow for images).
    fd_directions: int | None = None
    # The op's outputs when some left-hand tensors are internal (the spec's `outputs`).
    outputs: tuple[str, ...] | None = None
    # The spec's `let` (name -> integer expression), and, independently, the values the
    # reference uses for them with these inputs and attrs. The two must agree.
    lets: dict[str, str] = field(default_factory=dict)
    let_values: dict[str, int] = field(default_factory=dict)

    @property
    def equations(self) -> tuple[str, ...]:
        return (self.formulas,) if isinstance(self.formulas, str) else tuple(self.formulas)


def op_spec(case: Case, name: str) -> OpSpec:
    attr_types = dict(case.attr_types)
    for attr, value in case.attrs.items():
        attr_types.setdefault(
            attr,
            "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "float",
        )
    return OpSpec(
        name,
        case.equations,
        case.inputs,
        tuple(attr_types.items()),
        case.no_gradient,
        f"test [ops.{name}]",
        ranges=tuple(case.ranges.items()),
        outputs=case.outputs,
        lets=tuple(case.lets.items()),
    )


def int_attrs(case: Case) -> frozenset[str]:
    """The attrs of `case` that are ints in the spec (and so may appear in index
    expressions)."""
    types = dict(op_spec(case, "Probe").attrs)
    return frozenset(a for a, kind in types.items() if kind == "int")


def load_module(text: str, folder: Path, stem: str):
    """Import generated source from a file under a unique module name."""
    path = folder / f"{stem}.py"
    path.write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[stem] = module
    spec.loader.exec_module(module)
    return module


_ONCE: dict = {}


def generated_once(stem: str, op: OpSpec, target: str, folder: Path):
    """The module of `op` for `target`, generated and imported once per test process
    under `stem` (the tests of a file that share a module share this one; JAX's in
    float64)."""
    if target == "jax":
        from frameworks import _enable_x64  # frameworks imports this module

        _enable_x64()
    if stem not in _ONCE:
        _ONCE[stem] = load_module(module_text(op, "test", target), folder, stem)
    return _ONCE[stem]


def generate(case: Case, folder: Path, prefix: str = "Corpus", target: str = "tensorflow"):
    """The module of `case` for `target`, imported under a unique name."""
    name = f"{prefix}{next(_counter)}"
    text = module_text(op_spec(case, name), "test.toml", target)
    stem = "symgrad_test" if target == "tensorflow" else f"symgrad_{target}"
    return load_module(text, folder, f"{stem}_{name.lower()}")


class FakeOp:
    """What TF hands a registered gradient: the op's type and definition (the names of its
    inputs, outputs and attrs), its input and output tensors, and its attr values.

    The names default to the module's own; pass others to play a differently declared op.
    """

    def __init__(
        self,
        inputs,
        outputs,
        attrs,
        module,
        *,
        input_names=None,
        output_names=None,
        attr_names=None,
        op_type=None,
    ):
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self._attrs = attrs
        self.type = op_type or module.OP_TYPE
        self.op_def = SimpleNamespace(
            input_arg=_args(module.INPUTS if input_names is None else input_names),
            output_arg=_args(module.OUTPUTS if output_names is None else output_names),
            attr=_args(module.ATTRS if attr_names is None else attr_names),
        )

    def get_attr(self, name):
        return self._attrs[name]


def _args(names):
    return [SimpleNamespace(name=n, number_attr="", type_list_attr="") for n in names]


def make_tensors(case: Case, names, seed: int = 0, dtype=tf.float64) -> list:
    """Random inputs in the order of `names`: floats in [low, high), index tensors as ints."""
    rng = np.random.default_rng(seed)
    tensors = []
    for name in names:
        if name in case.index_inputs:
            shape, low, high, *kind = case.index_inputs[name]
            values = rng.integers(low, high, shape)
            tensors.append(tf.constant(values, dtype=kind[0] if kind else tf.int32))
        else:
            tensors.append(
                tf.constant(rng.uniform(case.low, case.high, case.shapes[name]), dtype=dtype)
            )
    return tensors


def make_inputs(case: Case, program, seed: int = 0, dtype=tf.float64):
    return make_tensors(case, program.inputs, seed, dtype)


def reference(case: Case, named: dict) -> list:
    """The reference outputs of `case` for inputs given by name."""
    return evaluate_op(
        case.equations,
        named,
        {**case.attrs, **case.let_values},
        outputs=case.outputs,
        sizes=case.sizes,
        int_attrs=int_attrs(case) | frozenset(case.let_values),
    )


def reference_outputs(case: Case, program, tensors):
    return reference(case, dict(zip(program.inputs, tensors, strict=True)))


def no_gradient(case: Case, name: str) -> bool:
    return name in case.no_gradient or name in case.index_inputs


def check(case: Case, module, seed: int = 0) -> None:
    """All numerical checks of one generated module against the reference."""
    program = build(op_spec(case, module.OP_TYPE))
    tensors = make_inputs(case, program, seed)
    rng = np.random.default_rng(seed + 1)

    # Forward values.
    expected = reference_outputs(case, program, tensors)
    got = module.forward(*tensors, **case.attrs)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=case.rtol, atol=1e-9)

    # Reference gradients by TF autodiff.
    grads = [tf.constant(rng.standard_normal(e.shape.as_list())) for e in expected]
    floats = [t for n, t in zip(program.inputs, tensors, strict=True) if not no_gradient(case, n)]
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(floats)
        outs = reference_outputs(case, program, tensors)
    want = tape.gradient(outs, tensors, output_gradients=grads)

    def compare(got_grads, how: str) -> None:
        assert len(got_grads) == len(tensors), how
        for name, g, w in zip(program.inputs, got_grads, want, strict=True):
            if no_gradient(case, name):
                assert g is None, f"{how}: {name} should get None"
                continue
            w = np.zeros(tensors[program.inputs.index(name)].shape) if w is None else w
            # A gather's gradient may be tf.IndexedSlices (TF's own Gather does that):
            # compare its dense value.
            np.testing.assert_allclose(
                np.asarray(tf.convert_to_tensor(g)),
                np.asarray(tf.convert_to_tensor(w)),
                rtol=case.rtol,
                atol=1e-9,
                err_msg=f"{how}: gradient of {name}",
            )

    compare(module.vjp(*tensors, *grads, **case.attrs), "vjp")
    outputs = module.forward(*tensors, **case.attrs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    fake = FakeOp(tensors, outputs, case.attrs, module)
    compare(module.gradient(fake, *grads), "registered gradient")
    with tf.GradientTape() as tape:
        tape.watch(floats)
        outs = module.forward(*tensors, **case.attrs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        loss = tf.add_n([tf.reduce_sum(o * g) for o, g in zip(outs, grads, strict=True)])
    taped = tape.gradient(loss, tensors)
    # `no_gradient` float inputs are checked through vjp and gradient above; an index
    # tensor is an int, and the tape must return None for it by itself.
    taped = [
        None if n in case.no_gradient else t for n, t in zip(program.inputs, taped, strict=True)
    ]
    compare(taped, "tape over forward")

    # Finite differences of the scalar <forward, grads>, one input at a time.
    for index, name in enumerate(program.inputs):
        if no_gradient(case, name) or not case.finite_differences:
            continue

        def scalar(x, index=index):
            args = list(tensors)
            args[index] = x
            outs = module.forward(*args, **case.attrs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            return tf.add_n([tf.reduce_sum(o * g) for o, g in zip(outs, grads, strict=True)])

        if case.fd_directions is not None:
            _directional_differences(case, scalar, tensors[index], name, rng)
            continue
        theoretical, numerical = tf.test.compute_gradient(scalar, [tensors[index]])
        np.testing.assert_allclose(
            theoretical[0],
            numerical[0],
            rtol=case.fd_tol,
            atol=case.fd_tol,
            err_msg=f"finite differences: {name}",
        )


def _directional_differences(case: Case, scalar, x, name: str, rng, step: float = 1e-6):
    """Central differences of `scalar` along random unit directions `v`, against
    `<d scalar/dx, v>` from a tape over the generated forward (its registered gradient)."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = scalar(x)
    gradient = tf.convert_to_tensor(tape.gradient(value, x)).numpy()
    for _ in range(case.fd_directions):
        v = rng.standard_normal(x.shape)
        v /= np.linalg.norm(v)
        shift = tf.constant(step * v, x.dtype)
        numerical = (scalar(x + shift) - scalar(x - shift)).numpy() / (2 * step)
        np.testing.assert_allclose(
            np.sum(gradient * v),
            numerical,
            rtol=case.fd_tol,
            atol=case.fd_tol,
            err_msg=f"finite differences along a random direction: {name}",
        )


def check_second_derivatives(forward, args, v, eps: float = 1e-6) -> None:
    """Hessian-vector products of sum(forward(*xs)²) along `v` (one direction per arg):
    forward-over-reverse (a ForwardAccumulator over the gradient) and reverse-over-reverse
    (a tape over it), each equal to central differences of the gradient."""

    def first(xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            loss = tf.reduce_sum(forward(*xs) ** 2)
        return tape.gradient(loss, xs)

    ahead = first([a + eps * d for a, d in zip(args, v, strict=True)])
    behind = first([a - eps * d for a, d in zip(args, v, strict=True)])
    fd = [(a - b) / (2 * eps) for a, b in zip(ahead, behind, strict=True)]
    with tf.autodiff.ForwardAccumulator(args, v) as acc:
        grads = first(args)
    forward_over_reverse = [acc.jvp(g) for g in grads]
    with tf.GradientTape() as outer:
        outer.watch(args)
        grads = first(args)
        along = tf.add_n([tf.reduce_sum(g * d) for g, d in zip(grads, v, strict=True)])
    reverse_over_reverse = outer.gradient(along, args)
    for got in (forward_over_reverse, reverse_over_reverse):
        for g, want in zip(got, fd, strict=True):
            np.testing.assert_allclose(g.numpy(), want.numpy(), rtol=1e-6, atol=1e-8)

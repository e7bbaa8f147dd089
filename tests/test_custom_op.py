"""End-to-end check: a symgrad-generated gradient drives a real C++ TensorFlow op.

A small shared library (tests/custom_op/symgrad_test_ops.cc) defines two CPU
ops, ``BatchedMatMul`` and ``ScaledAdd``, *without* any gradient.  Importing
``generated.batched_mat_mul`` / ``generated.scaled_add`` registers their
``gradient`` functions with ``tf.RegisterGradient``.  The tests show that

* the C++ forward is correct (against ``tf.einsum`` / plain TF),
* ``tf.GradientTape`` over the C++ op reproduces the gradients of a pure-TF
  reference (impossible without a registered gradient: TF raises
  ``LookupError: gradient registry has no entry for: BatchedMatMul``),
* the function TF looks up and actually calls is the generated one,
* the same holds in graph mode (``tf.function``),
* the gradient matches the op's inputs and outputs to the formula's by name
  (``WeightedSqErr``, ``SumAndProduct`` declare them in another order), and an op
  whose names, attrs or counts do not fit the formula (``PlainAdd``) is a clear error.

The library is compiled once per session (tests/conftest.py, ~9 s).
"""

from __future__ import annotations

import importlib
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from harness import Case, load_module, op_spec
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.framework import registry as tf_registry

from symgrad.pipeline import module_text

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

_modules = itertools.count()

# Gradients of the C++ op (loop kernel + generated gradient) and of the TF
# reference are computed with different summation orders; values are O(1).
RTOL = 1e-10
ATOL = 1e-12


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def op_lib(op_library_path):
    """tests/custom_op/symgrad_test_ops.cc, compiled and loaded (once per session)."""
    so_path = op_library_path("symgrad_test_ops")
    return tf.load_op_library(str(so_path))


@pytest.fixture(scope="module")
def bmm_mod():
    """The real generated module; importing it registers the gradient."""
    return importlib.import_module("generated.batched_mat_mul")


@pytest.fixture(scope="module")
def sa_mod():
    return importlib.import_module("generated.scaled_add")


@pytest.fixture
def rng():
    return np.random.default_rng(20240531)


def _spy_on_registered_gradient(monkeypatch, op_type):
    """Wrap the registry entry for ``op_type`` so calls are recorded.

    Returns ``(calls, original)``; the original entry is restored by monkeypatch.
    """
    entry = tf_ops._gradient_registry._registry[op_type]
    original = entry[tf_registry._TYPE_TAG]
    calls = []

    def spy(op, *grads):
        calls.append(op.type)
        return original(op, *grads)

    monkeypatch.setitem(entry, tf_registry._TYPE_TAG, spy)
    return calls, original


def _bmm_inputs(rng, dtype=np.float64):
    a = rng.standard_normal((3, 4, 5)).astype(dtype)
    b = rng.standard_normal((3, 5, 2)).astype(dtype)
    w = rng.standard_normal((3, 4, 2)).astype(dtype)
    return tf.constant(a), tf.constant(b), tf.constant(w)


def _assert_close(actual, expected, **kw):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=RTOL, atol=ATOL, **kw)


# --------------------------------------------------------------------------- BatchedMatMul


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_batched_mat_mul_forward_matches_einsum(op_lib, rng, dtype):
    a, b, _ = _bmm_inputs(rng, dtype)
    y = op_lib.batched_mat_mul(a, b)
    assert y.dtype == tf.as_dtype(dtype)
    assert y.shape == (3, 4, 2)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == np.float64 else {"rtol": 1e-5, "atol": 1e-5}
    np.testing.assert_allclose(y.numpy(), tf.einsum("bik,bkj->bij", a, b).numpy(), **tol)


def test_batched_mat_mul_registered_gradient_is_generated(bmm_mod):
    assert bmm_mod.OP_TYPE == "BatchedMatMul"
    assert tf_ops._gradient_registry.lookup("BatchedMatMul") is bmm_mod.gradient


def test_batched_mat_mul_tape_gradient_matches_einsum_reference(op_lib, bmm_mod, rng):
    a, b, w = _bmm_inputs(rng)

    with tf.GradientTape() as tape:
        tape.watch([a, b])
        loss = tf.reduce_sum(op_lib.batched_mat_mul(a, b) * w)
    ga, gb = tape.gradient(loss, [a, b])

    with tf.GradientTape() as tape:
        tape.watch([a, b])
        loss_ref = tf.reduce_sum(tf.einsum("bik,bkj->bij", a, b) * w)
    ga_ref, gb_ref = tape.gradient(loss_ref, [a, b])

    assert ga is not None and gb is not None
    assert ga.dtype == tf.float64 and gb.dtype == tf.float64
    _assert_close(loss, loss_ref)
    _assert_close(ga, ga_ref)
    _assert_close(gb, gb_ref)


def test_batched_mat_mul_tape_calls_generated_gradient(op_lib, bmm_mod, rng, monkeypatch):
    assert tf_ops._gradient_registry.lookup("BatchedMatMul") is bmm_mod.gradient
    calls, original = _spy_on_registered_gradient(monkeypatch, "BatchedMatMul")
    assert original is bmm_mod.gradient

    a, b, w = _bmm_inputs(rng)
    with tf.GradientTape() as tape:
        tape.watch([a, b])
        loss = tf.reduce_sum(op_lib.batched_mat_mul(a, b) * w)
    ga, gb = tape.gradient(loss, [a, b])

    assert calls == ["BatchedMatMul"]
    # Analytic VJP of y = a @ b with upstream w.
    _assert_close(ga, tf.einsum("bij,bkj->bik", w, b))
    _assert_close(gb, tf.einsum("bik,bij->bkj", a, w))


def test_batched_mat_mul_gradient_in_tf_function(op_lib, bmm_mod, rng, monkeypatch):
    calls, _ = _spy_on_registered_gradient(monkeypatch, "BatchedMatMul")
    a, b, w = _bmm_inputs(rng)

    @tf.function
    def grads(a, b, w):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            loss = tf.reduce_sum(op_lib.batched_mat_mul(a, b) * w)
        return tape.gradient(loss, [a, b])

    @tf.function
    def grads_ref(a, b, w):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            loss = tf.reduce_sum(tf.einsum("bik,bkj->bij", a, b) * w)
        return tape.gradient(loss, [a, b])

    concrete = grads.get_concrete_function(a, b, w)
    op_types = {op.type for op in concrete.graph.get_operations()}
    assert "BatchedMatMul" in op_types, sorted(op_types)
    assert calls == ["BatchedMatMul"]  # looked up and called while tracing

    ga, gb = grads(a, b, w)
    ga_ref, gb_ref = grads_ref(a, b, w)
    _assert_close(ga, ga_ref)
    _assert_close(gb, gb_ref)


# Worked example: a (1,2,2), b (1,2,3), c = a @ b = [[24, 27, 30], [54, 61, 68]].
_A = [[[1.0, 2.0], [3.0, 4.0]]]
_B = [[[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]]


def test_worked_example_all_ones_upstream(op_lib, bmm_mod):
    a = tf.constant(_A, dtype=tf.float64)
    b = tf.constant(_B, dtype=tf.float64)
    with tf.GradientTape() as tape:
        tape.watch([a, b])
        c = op_lib.batched_mat_mul(a, b)
    ga, gb = tape.gradient(c, [a, b])  # implicit all-ones upstream
    np.testing.assert_array_equal(c.numpy(), [[[24, 27, 30], [54, 61, 68]]])
    np.testing.assert_array_equal(ga.numpy(), [[[21, 30], [21, 30]]])
    np.testing.assert_array_equal(gb.numpy(), [[[4, 4, 4], [6, 6, 6]]])


@pytest.mark.parametrize("how", ["output_gradients", "half_sum_of_squares"])
def test_worked_example_backprop_c_itself(op_lib, bmm_mod, how):
    a = tf.constant(_A, dtype=tf.float64)
    b = tf.constant(_B, dtype=tf.float64)
    with tf.GradientTape() as tape:
        tape.watch([a, b])
        c = op_lib.batched_mat_mul(a, b)
        loss = 0.5 * tf.reduce_sum(c**2)
    if how == "output_gradients":
        ga, gb = tape.gradient(c, [a, b], output_gradients=c)
    else:
        ga, gb = tape.gradient(loss, [a, b])
    np.testing.assert_array_equal(ga.numpy(), [[[573, 816], [1295, 1844]]])
    np.testing.assert_array_equal(gb.numpy(), [[[186, 210, 234], [264, 298, 332]]])


# --------------------------------------------------------------------------- ScaledAdd

ALPHA = 2.5  # exactly representable, so the float attr round-trips exactly


def _sa_inputs(rng):
    a = tf.constant(rng.standard_normal((2, 3, 4)))
    b = tf.constant(rng.standard_normal((2, 3, 4)))
    w = tf.constant(rng.standard_normal((2, 3, 4)))
    return a, b, w


def test_scaled_add_forward(op_lib, rng):
    a, b, _ = _sa_inputs(rng)
    y = op_lib.scaled_add(a, b, alpha=ALPHA)
    assert y.dtype == tf.float64 and y.shape == (2, 3, 4)
    _assert_close(y, ALPHA * a + b)


def test_scaled_add_registered_gradient_is_generated(sa_mod):
    assert sa_mod.OP_TYPE == "ScaledAdd"
    assert tf_ops._gradient_registry.lookup("ScaledAdd") is sa_mod.gradient


def test_scaled_add_tape_calls_generated_gradient(op_lib, sa_mod, rng, monkeypatch):
    calls, original = _spy_on_registered_gradient(monkeypatch, "ScaledAdd")
    assert original is sa_mod.gradient
    a, b, w = _sa_inputs(rng)

    with tf.GradientTape() as tape:
        tape.watch([a, b])
        loss = tf.reduce_sum(op_lib.scaled_add(a, b, alpha=ALPHA) * w)
    ga, gb = tape.gradient(loss, [a, b])

    with tf.GradientTape() as tape:
        tape.watch([a, b])
        loss_ref = tf.reduce_sum((ALPHA * a + b) * w)
    ga_ref, gb_ref = tape.gradient(loss_ref, [a, b])

    assert calls == ["ScaledAdd"]
    _assert_close(ga, ALPHA * w)
    _assert_close(gb, w)
    _assert_close(ga, ga_ref)
    _assert_close(gb, gb_ref)


def test_scaled_add_gradient_in_tf_function(op_lib, sa_mod, rng, monkeypatch):
    calls, _ = _spy_on_registered_gradient(monkeypatch, "ScaledAdd")
    a, b, w = _sa_inputs(rng)

    @tf.function
    def grads(a, b, w):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            loss = tf.reduce_sum(op_lib.scaled_add(a, b, alpha=ALPHA) * w)
        return tape.gradient(loss, [a, b])

    concrete = grads.get_concrete_function(a, b, w)
    op_types = {op.type for op in concrete.graph.get_operations()}
    assert "ScaledAdd" in op_types, sorted(op_types)
    assert calls == ["ScaledAdd"]

    ga, gb = grads(a, b, w)
    _assert_close(ga, ALPHA * w)
    _assert_close(gb, w)


# --------------------------------------------------------------------------- names, not positions


def _module_for(op_type, formulas, folder, **case):
    """A generated module registering the gradient of `op_type` (a C++ op in the library)."""
    text = module_text(op_spec(Case(formulas, {}, **case), op_type), "test.toml")
    return load_module(text, folder, f"symgrad_custom_{op_type.lower()}_{next(_modules)}")


def _tape_and_graph(fn, *args):
    """`fn(*args)` eagerly, then traced by tf.function (where the gradient sees a graph op)."""
    return fn(*args), tf.function(fn)(*args)


def test_gradient_matches_the_ops_input_order_by_name(op_lib, tmp_path, rng):
    """INPUTS is (w, p, t) by first appearance; the C++ op declares p, t, w."""
    module = _module_for("WeightedSqErr", "y[b] = w[b,i] * (p[b,i] - t[b,i])**2", tmp_path)
    assert module.INPUTS == ("w", "p", "t")
    p, t, w = (tf.constant(rng.standard_normal((3, 5))) for _ in range(3))
    g = tf.constant(rng.standard_normal(3))

    def grads(p, t, w):
        with tf.GradientTape() as tape:
            tape.watch([p, t, w])
            y = op_lib.weighted_sq_err(p, t, w)
        return tape.gradient(y, [p, t, w], output_gradients=g)

    with tf.GradientTape() as tape:
        tape.watch([p, t, w])
        y_ref = tf.reduce_sum(w * (p - t) ** 2, axis=1)
    want = tape.gradient(y_ref, [p, t, w], output_gradients=g)
    for got in _tape_and_graph(grads, p, t, w):
        for name, x, ref in zip("ptw", got, want, strict=True):
            _assert_close(x, ref, err_msg=f"gradient of {name}")


def test_gradient_matches_the_ops_output_order_by_name(op_lib, tmp_path, rng):
    module = _module_for(
        "SumAndProduct", ("y[b,i] = A[b,i] + B[b,i]", "z[b,i] = A[b,i] * B[b,i]"), tmp_path
    )
    assert module.OUTPUTS == ("y", "z")
    a, b = (tf.constant(rng.standard_normal((2, 4))) for _ in range(2))
    gz, gy = (tf.constant(rng.standard_normal((2, 4))) for _ in range(2))

    def grads(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            z, y = op_lib.sum_and_product(a, b)
        return tape.gradient([z, y], [a, b], output_gradients=[gz, gy])

    for ga, gb in _tape_and_graph(grads, a, b):
        _assert_close(ga, gy + gz * b)
        _assert_close(gb, gy + gz * a)


def _plain_add_gradient(op_lib):
    x = tf.constant(np.arange(6.0).reshape(2, 3))
    z = tf.constant(np.ones((2, 3)))

    def grads(x, z):
        with tf.GradientTape() as tape:
            tape.watch([x, z])
            out = op_lib.plain_add(x, z)
        return tape.gradient(out, [x, z])

    return grads, (x, z)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize(
    ("formulas", "case", "message"),
    [
        (
            "y[b,i] = A[b,i] + B[b,i]",
            {},
            (
                r"PlainAdd: cannot match the inputs of op PlainAdd \('x', 'z'\) to the "
                r"formula's \('A', 'B'\) by name \(ignoring case\); rename them in the op "
                r"or the spec"
            ),
        ),
        (
            "out[b,i] = alpha * x[b,i] + z[b,i]",
            {"attr_types": {"alpha": "float"}},
            r"PlainAdd: op PlainAdd has no attr 'alpha' \(its attrs: T\)",
        ),
        (
            "out[b,i] = x[b,i] + z[b,i] * c[b,i]",
            {},
            (
                r"PlainAdd: op PlainAdd has 2 inputs \('x', 'z'\); the formula has 3 "
                r"\('x', 'z', 'c'\)"
            ),
        ),
        (
            ("out[b,i] = x[b,i] + z[b,i]", "extra[b,i] = x[b,i] * z[b,i]"),
            {},
            r"PlainAdd: op PlainAdd has 1 outputs \('out',\); the formula has 2",
        ),
    ],
    ids=["names", "attr", "inputs", "outputs"],
)
def test_an_op_that_does_not_fit_the_formula_is_a_clear_error(
    op_lib, tmp_path, formulas, case, message, graph
):
    _module_for("PlainAdd", formulas, tmp_path, **case)
    grads, args = _plain_add_gradient(op_lib)
    with pytest.raises(ValueError, match=message):
        (tf.function(grads) if graph else grads)(*args)


def test_an_op_with_the_formulas_names_in_upper_case_order(op_lib, tmp_path):
    """`Z` and `X` in the formula are the op's `z` and `x`: matched ignoring case."""
    module = _module_for("PlainAdd", "out[b,i] = Z[b,i] * 2 + X[b,i]", tmp_path)
    assert module.INPUTS == ("Z", "X")
    grads, args = _plain_add_gradient(op_lib)
    gx, gz = grads(*args)
    np.testing.assert_array_equal(gx.numpy(), np.ones((2, 3)))  # x is X: d/dX = 1
    np.testing.assert_array_equal(gz.numpy(), np.full((2, 3), 2.0))  # z is Z: d/dZ = 2

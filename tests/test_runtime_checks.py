"""What a generated module does at call time: constants in every dtype and context,
checks of the incoming gradients and of mixed input dtypes, and a `vjp` that runs only
the part of the forward pass its backward reads."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from harness import Case, FakeOp, check, generate

RNG = np.random.default_rng(11)
DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
TOLERANCE = {tf.float16: 2e-2, tf.bfloat16: 8e-2, tf.float32: 1e-5, tf.float64: 1e-12}


def rand(*shape, dtype=tf.float64):
    return tf.constant(RNG.uniform(-1, 1, shape), dtype=dtype)


# ----------------------------------------------------------------------------- constants

# Each puts a Python number where TF would give it its own dtype (int32 or float32) in
# graph mode: an argument of tf.maximum/minimum, a base or exponent, a broadcast constant,
# a comparison in a derivative's mask, a size in a mean.
CONSTANT_FORMULAS = {
    "max(0, A)": ("y[b,i] = max(0, A[b,i]) * B[b,i]", {"A": (3, 4), "B": (3, 4)}),
    "min/max with floats": (
        "y[b,i] = min(A[b,i], 0.5) + max(-1.5, B[b,i]) * 2.5",
        {"A": (3, 4), "B": (3, 4)},
    ),
    "nested max/min": ("y[b,i] = max(0.25, min(A[b,i], B[b,i]))", {"A": (3, 4), "B": (3, 4)}),
    "powers": (
        "y[b,i] = 2 ** A[b,i] + 0.5 ** B[b,i] + pi * A[b,i] ** 3",
        {"A": (3, 4), "B": (3, 4)},
    ),
    "broadcast constant": ("y[b,i,j] = A[b,i] * 0 + 2.5 + B[b,j]", {"A": (3, 4), "B": (3, 5)}),
    "mean and division": (
        "y[b] = mean(A[b,k] * B[b,k], k) / 3 + sum(A[b,k], k) * 0.1",
        {"A": (3, 5), "B": (3, 5)},
    ),
    "functions of shifted inputs": (
        (
            "y[b,i] = abs(A[b,i] - 0.5) * sigmoid(B[b,i]) + softplus(1.5 * A[b,i])"
            " + sqrt(A[b,i]**2 + 1) + exp(-0.5 * B[b,i])"
        ),
        {"A": (3, 4), "B": (3, 4)},
    ),
}


@pytest.fixture(scope="module")
def constant_modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("constants")
    modules = {}
    for name, (formula, shapes) in CONSTANT_FORMULAS.items():
        case = Case(formula, shapes)
        modules[name] = (generate(case, folder, "Constants"), case)
    return modules


@pytest.mark.parametrize("name", list(CONSTANT_FORMULAS))
def test_constant_formulas_are_right_in_float64(constant_modules, name):
    module, case = constant_modules[name]
    check(case, module)


def _everything(module):
    """forward, vjp, a tape over forward and the registered gradient, as one function."""

    def run(A, B, grad):
        with tf.GradientTape() as tape:
            tape.watch([A, B])
            y = module.forward(A, B)
        taped = tape.gradient(y, [A, B], output_gradients=grad)
        registered = module.gradient(FakeOp([A, B], [y], {}, module), grad)
        return [y, *module.vjp(A, B, grad), *taped, *registered]

    return run


def test_a_constant_argument_is_cast_to_the_inputs_dtype(constant_modules):
    module, _ = constant_modules["max(0, A)"]
    with open(module.__file__, encoding="utf-8") as source:
        assert "tf.maximum(tf.cast(0, dtype), A)" in source.read()


@pytest.mark.parametrize("how", ["eager", "tf.function", "jit_compile"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("name", list(CONSTANT_FORMULAS))
def test_constants_take_the_inputs_dtype_everywhere(constant_modules, name, dtype, how):
    module, case = constant_modules[name]
    A, B = (rand(*case.shapes[n], dtype=dtype) for n in ("A", "B"))
    y64 = module.forward(tf.cast(A, tf.float64), tf.cast(B, tf.float64))
    grad = rand(*y64.shape, dtype=dtype)
    run = _everything(module)
    if how != "eager":
        run = tf.function(run, jit_compile=how == "jit_compile")
    got = run(A, B, grad)
    want = _everything(module)(*(tf.cast(t, tf.float64) for t in (A, B, grad)))
    tol = TOLERANCE[dtype]
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == dtype, f"result {n} has dtype {g.dtype.name}"
        w = w.numpy()
        np.testing.assert_allclose(
            tf.cast(g, tf.float64).numpy(),
            w,
            rtol=tol,
            atol=tol * max(1.0, float(np.abs(w).max())),
            err_msg=f"result {n}",
        )


# ----------------------------------------------------------------------------- vjp's gradients


def scaled_add():
    return importlib.import_module("generated.scaled_add")


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((3,), r"ScaledAdd: grad_y has shape \(3,\); expected \(2, 3, 4\) like y"),
        ((1, 3, 4), r"ScaledAdd: grad_y has shape \(1, 3, 4\); expected \(2, 3, 4\) like y"),
        ((2, 3, 4, 1), r"ScaledAdd: grad_y has shape \(2, 3, 4, 1\); expected \(2, 3, 4\)"),
        ((2, 4, 3), r"ScaledAdd: grad_y has shape \(2, 4, 3\); expected \(2, 3, 4\)"),
    ],
)
def test_vjp_refuses_a_gradient_not_shaped_like_its_output(shape, message):
    A, B = rand(2, 3, 4), rand(2, 3, 4)
    with pytest.raises(ValueError, match=message):
        scaled_add().vjp(A, B, tf.ones(shape, tf.float64), alpha=2.0)


def test_vjp_checks_composite_output_axes():
    module = importlib.import_module("generated.batch_kron")
    A, B = rand(2, 3, 4), rand(2, 5, 6)
    module.vjp(A, B, rand(2, 15, 24))  # y[b,(i,k),(j,l)]: (2, 3*5, 4*6)
    with pytest.raises(ValueError, match=r"BatchKron: grad_y has shape \(2, 3, 120\)"):
        module.vjp(A, B, rand(2, 3, 120))


def test_vjp_refuses_a_gradient_of_another_dtype_or_none():
    A, B = rand(2, 3, 4), rand(2, 3, 4)
    with pytest.raises(
        TypeError, match=r"^ScaledAdd: grad_y has dtype float32; expected float64, the inputs'"
    ):
        scaled_add().vjp(A, B, tf.ones((2, 3, 4), tf.float32), alpha=2.0)
    with pytest.raises(TypeError, match=r"^ScaledAdd: grad_y is None"):
        scaled_add().vjp(A, B, None, alpha=2.0)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=lambda d: d.name)
@pytest.mark.parametrize("kind", ["list", "numpy"])
def test_vjp_takes_python_and_numpy_gradients_in_the_inputs_dtype(kind, dtype):
    A, B = rand(2, 3, 4, dtype=dtype), rand(2, 3, 4, dtype=dtype)
    ones = np.ones((2, 3, 4), dtype.as_numpy_dtype)
    grad_a, grad_b = scaled_add().vjp(A, B, ones.tolist() if kind == "list" else ones, alpha=2.0)
    assert grad_a.dtype == dtype
    np.testing.assert_array_equal(grad_a.numpy(), np.full((2, 3, 4), 2.0))
    np.testing.assert_array_equal(grad_b.numpy(), np.ones((2, 3, 4)))


def test_vjp_with_several_outputs_takes_none_as_zeros():
    module = importlib.import_module("generated.mat_mul_and_squares")
    A, B = rand(2, 3, 4), rand(2, 4, 5)
    grad_y = rand(2, 3, 5)
    with_none = module.vjp(A, B, grad_y, None)
    with_zeros = module.vjp(A, B, grad_y, tf.zeros((2, 3), tf.float64))
    for g, w in zip(with_none, with_zeros, strict=True):
        np.testing.assert_array_equal(g.numpy(), w.numpy())
    with pytest.raises(ValueError, match=r"MatMulAndSquares: grad_z has shape \(2, 4\)"):
        module.vjp(A, B, grad_y, rand(2, 4))


def test_vjp_shape_checks_under_tf_function_use_the_static_shapes():
    module = importlib.import_module("generated.batched_mat_mul")
    a_spec = tf.TensorSpec([None, 3, None], tf.float64)
    b_spec = tf.TensorSpec([None, None, 5], tf.float64)

    def traced(grad_shape):
        grad_spec = tf.TensorSpec(grad_shape, tf.float64)
        return tf.function(module.vjp).get_concrete_function(a_spec, b_spec, grad_spec)

    traced([None, 3, 5])
    traced([None, None, None])  # nothing static to compare
    with pytest.raises(
        ValueError, match=r"BatchedMatMul: grad_y has shape \(None, 4, 5\); expected \(None, 3, 5\)"
    ):
        traced([None, 4, 5])


# ----------------------------------------------------------------------------- mixed inputs


@pytest.mark.parametrize("call", ["forward", "vjp"])
@pytest.mark.parametrize(
    ("A", "B", "found"),
    [
        (rand(2, 3, 4, dtype=tf.float32), rand(2, 3, 4), "A float32, B float64"),
        (np.ones((2, 3, 4)), rand(2, 3, 4, dtype=tf.float32), "A float64, B float32"),
    ],
    ids=["tensors", "array and tensor"],
)
def test_mixed_input_dtypes_are_one_short_line(call, A, B, found):
    args = (A, B, tf.ones((2, 3, 4))) if call == "vjp" else (A, B)
    with pytest.raises(TypeError) as error:
        getattr(scaled_add(), call)(*args, alpha=2.0)
    assert str(error.value) == f"ScaledAdd: inputs must share one dtype; got {found}"


def test_python_lists_take_the_dtype_of_the_tensor_inputs():
    B = rand(2, 3, 4)
    y = scaled_add().forward(np.ones((2, 3, 4)).tolist(), B, alpha=2.0)
    assert y.dtype == tf.float64
    np.testing.assert_array_equal(y.numpy(), 2.0 + B.numpy())


# ----------------------------------------------------------------------------- vjp's work


def _op_types(fn, *args):
    graph = tf.function(fn).get_concrete_function(*args).graph
    return [op.type for op in graph.get_operations()]


def test_vjp_skips_the_forward_pass_its_backward_does_not_read():
    """grad_A = grad_y·Bᵀ and grad_B = Aᵀ·grad_y need no y: two contractions, not three."""
    module = importlib.import_module("generated.batched_mat_mul")
    A, B, grad = rand(2, 3, 4), rand(2, 4, 5), rand(2, 3, 5)
    types = _op_types(module.vjp, A, B, grad)
    assert types.count("Einsum") + types.count("BatchMatMulV2") == 2, types


def test_vjp_runs_the_forward_pass_when_its_backward_reads_the_output():
    """exp(A·B)'s gradient reads y = exp(A·B): one forward contraction and its exp."""
    module = importlib.import_module("generated.exp_mat_mul")
    A, B, grad = rand(2, 3, 4), rand(2, 4, 5), rand(2, 3, 5)
    types = _op_types(module.vjp, A, B, grad)
    assert types.count("Exp") == 1, types
    grad_a, _ = module.vjp(A, B, grad)
    want = tf.einsum("bij,bkj->bik", grad * tf.exp(tf.matmul(A, B)), B)
    np.testing.assert_allclose(grad_a.numpy(), want.numpy(), rtol=1e-12)


def test_vjp_checks_unknown_sizes_when_the_graph_runs():
    """tf.function with None dims: the sizes are compared by a tf.debugging assert."""
    spec = tf.TensorSpec([None, None, None], tf.float64)
    run = tf.function(
        lambda A, B, grad: scaled_add().vjp(A, B, grad, alpha=2.0), input_signature=[spec] * 3
    )
    A, B = rand(2, 3, 4), rand(2, 3, 4)
    grad_a, _ = run(A, B, tf.ones((2, 3, 4), tf.float64))
    np.testing.assert_array_equal(grad_a.numpy(), np.full((2, 3, 4), 2.0))
    for wrong in ((1, 3, 4), (2, 4, 3)):  # broadcasts; same element count
        with pytest.raises(
            tf.errors.InvalidArgumentError, match=r"ScaledAdd: grad_y is not shaped like y"
        ):
            run(A, B, tf.ones(wrong, tf.float64))


# ----------------------------------------------------------------------------- gradient(op)


def test_gradient_needs_no_name_for_a_single_input_or_output():
    module = importlib.import_module("generated.log_sum_exp")
    A = rand(2, 3, 4)
    y = module.forward(A)
    grad = rand(2, 3)
    fake = FakeOp([A], [y], {}, module, input_names=["logits"], output_names=["out"])
    (got,) = module.gradient(fake, grad)
    (want,) = module.vjp(A, grad)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)


def test_gradient_refuses_list_inputs_and_unknown_op_types():
    module = scaled_add()
    A, B = rand(2, 3, 4), rand(2, 3, 4)
    fake = FakeOp([A, B], [A + B], {"alpha": 1.0}, module, op_type="ScaledAddList")
    fake.op_def.input_arg[0].number_attr = "N"
    with pytest.raises(ValueError, match=r"ScaledAdd: op ScaledAddList declares A as a list"):
        module.gradient(fake, A)
    unknown = FakeOp([A, B], [A + B], {"alpha": 1.0}, module, op_type="NoSuchOpType")
    del unknown.op_def  # like the eager tape's op: only its type
    with pytest.raises(LookupError, match=r"ScaledAdd: op type NoSuchOpType is not known"):
        module.gradient(unknown, A)


def test_gradient_reads_an_attr_named_in_another_case():
    module = scaled_add()
    A, B, grad = rand(2, 3, 4), rand(2, 3, 4), rand(2, 3, 4)
    fake = FakeOp([A, B], [A + B], {"Alpha": 3.0}, module, attr_names=["Alpha"], op_type="SA2")
    grad_a, grad_b = module.gradient(fake, grad)
    np.testing.assert_allclose(grad_a.numpy(), 3.0 * grad.numpy())
    np.testing.assert_allclose(grad_b.numpy(), grad.numpy())


def test_xla_drops_the_runtime_size_assert():
    """What the README says: under jit_compile only sizes known at trace time are checked."""
    spec = tf.TensorSpec([None, None, None], tf.float64)
    run = tf.function(
        lambda A, B, grad: scaled_add().vjp(A, B, grad, alpha=2.0),
        input_signature=[spec] * 3,
        jit_compile=True,
    )
    A, B = rand(2, 3, 4), rand(2, 3, 4)
    grad_a, _ = run(A, B, tf.ones((1, 3, 4), tf.float64))
    assert grad_a.shape == (1, 3, 4)


# ----------------------------------------------------------------------------- eager overhead


def test_static_sizes_and_new_axes_cost_no_shape_or_slice_ops():
    """Each `tf.shape(X)[k]` or `x[:, tf.newaxis]` is several ops per eager call."""
    module = importlib.import_module("generated.batch_kron")
    A, B = rand(2, 3, 4), rand(2, 5, 6)

    def step(A, B):
        with tf.GradientTape() as tape:
            tape.watch([A, B])
            y = module.forward(A, B)
        return tape.gradient(y, [A, B])

    types = set(_op_types(step, A, B))
    assert not types & {"Shape", "StridedSlice", "Pack"}, sorted(types)


def test_explain_prints_sizes_without_the_modules_helpers(capsys):
    from symgrad.cli import main

    assert main(["explain", "y[b,(i,k),(j,l)] = A[b,i,j] * B[b,k,l]"]) == 0
    printed = capsys.readouterr().out
    assert "tf.shape(A)[0]" in printed
    assert "_dim(" not in printed


def test_an_int_attr_refuses_bools_and_floats_instead_of_truncating(tmp_path):
    """`s=True` would read as a stride of 1 and `s=2.5` fail deep inside TF: both are one
    line naming the attr; NumPy integers are ints."""
    case = Case(
        "y[b,i] = x[b, s*i]",
        {"x": (2, 6)},
        attr_types={"s": "int"},
        ranges={"i": "x.shape[1] // s"},
    )
    module = generate(case, tmp_path, prefix="IntAttr")
    x = rand(2, 6)
    for bad, kind in ((True, "bool"), (2.5, "float")):
        with pytest.raises(TypeError, match=rf"attr s must be an int, not {kind}"):
            module.forward(x, s=bad)
    np.testing.assert_array_equal(module.forward(x, s=np.int64(2)).numpy(), x.numpy()[:, ::2])


def test_an_int_attr_a_range_divides_by_must_be_positive(tmp_path):
    case = Case(
        "y[b,i] = x[b, i + 1]",
        {"x": (2, 6)},
        attr_types={"n": "int"},
        ranges={"i": "x.shape[1] // n"},
    )
    module = generate(case, tmp_path, prefix="DivAttr")
    x = rand(2, 6)
    with pytest.raises(ValueError, match="attr n is 0; it scales an index or divides a range"):
        module.forward(x, n=0)
    np.testing.assert_array_equal(module.forward(x, n=3).numpy(), x.numpy()[:, 1:3])

"""Generated `forward` in the places TF code runs: tf.function with unknown dims, XLA,
MirroredStrategy, higher-order gradients; dtypes; stability; what the gradient computes."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from harness import Case, FakeOp, generate

ROOT = Path(__file__).resolve().parent.parent
RNG = np.random.default_rng(3)


def rand(*shape, dtype=tf.float64):
    return tf.constant(RNG.uniform(-1, 1, shape), dtype=dtype)


def matmul_module():
    return importlib.import_module("generated.batched_mat_mul")


def test_forward_in_tf_function_with_unknown_batch():
    module = importlib.import_module("generated.attention_softmax")
    spec = tf.TensorSpec([None, None, 4], tf.float64)

    @tf.function(input_signature=[spec, spec])
    def loss_and_grads(Q, K):
        with tf.GradientTape() as tape:
            tape.watch([Q, K])
            loss = tf.reduce_sum(module.forward(Q, K) ** 2)
        return loss, tape.gradient(loss, [Q, K])

    for batch, n in ((2, 3), (5, 1)):
        Q, K = rand(batch, n, 4), rand(batch, n + 2, 4)
        _, grads = loss_and_grads(Q, K)
        with tf.GradientTape() as tape:
            tape.watch([Q, K])
            ref = tf.reduce_sum(tf.nn.softmax(tf.matmul(Q, K, transpose_b=True)) ** 2)
        want = tape.gradient(ref, [Q, K])
        for g, w in zip(grads, want, strict=True):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["batch_kron", "layer_norm", "sin_diag_outer"])
def test_forward_and_gradient_under_xla(name):
    module = importlib.import_module(f"generated.{name}")
    shapes = {
        "batch_kron": [(2, 2, 2), (2, 3, 3)],
        "layer_norm": [(3, 5)],
        "sin_diag_outer": [(2, 3, 3), (2, 4, 4)],
    }[name]
    attrs = {"eps": 1e-3} if name == "layer_norm" else {}
    inputs = [rand(*s) for s in shapes]

    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            loss = tf.reduce_sum(tf.sin(module.forward(*xs, **attrs)))
        return tape.gradient(loss, xs)

    eager = step(*inputs)
    compiled = tf.function(step, jit_compile=True)(*inputs)
    for e, c in zip(eager, compiled, strict=True):
        np.testing.assert_allclose(c.numpy(), e.numpy(), rtol=1e-10, atol=1e-12)


def test_second_order_gradient():
    module = importlib.import_module("generated.exp_mat_mul")
    A, B = rand(2, 3, 4), rand(2, 4, 2)
    with tf.GradientTape() as outer:
        outer.watch(A)
        with tf.GradientTape() as inner:
            inner.watch(A)
            loss = tf.reduce_sum(module.forward(A, B))
        grad = inner.gradient(loss, A)
        second = tf.reduce_sum(grad**2)
    got = outer.gradient(second, A)
    with tf.GradientTape() as outer:
        outer.watch(A)
        with tf.GradientTape() as inner:
            inner.watch(A)
            loss = tf.reduce_sum(tf.exp(tf.matmul(A, B)))
        grad = inner.gradient(loss, A)
        second = tf.reduce_sum(grad**2)
    want = outer.gradient(second, A)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10)


def test_mirrored_strategy_over_two_logical_cpus():
    """Logical devices must be configured before TF starts: run in a fresh process."""
    script = textwrap.dedent(
        """
        import numpy as np
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        from generated import batched_mat_mul as m
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            w = tf.Variable(np.ones((1, 4, 3)), dtype=tf.float64)
        x = tf.constant(np.arange(24.0).reshape(2, 3, 4), dtype=tf.float64)
        dataset = tf.data.Dataset.from_tensor_slices(x).batch(2)
        dist = strategy.experimental_distribute_dataset(dataset)

        @tf.function
        def step(batch):
            def replica(b):
                with tf.GradientTape() as tape:
                    y = m.forward(b, tf.tile(w, [tf.shape(b)[0], 1, 1]))
                    loss = tf.reduce_sum(y)
                return tape.gradient(loss, w)
            grads = strategy.run(replica, args=(batch,))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, grads, axis=None)

        for batch in dist:
            got = step(batch).numpy()
        want = np.einsum("bik->k", x.numpy())[None, :, None] * np.ones((1, 4, 3))
        assert strategy.num_replicas_in_sync == 2
        np.testing.assert_allclose(got, want)
        print("ok", strategy.num_replicas_in_sync)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        check=False,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ok 2" in result.stdout


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64])
def test_generated_code_follows_the_input_dtype(dtype):
    module = importlib.import_module("generated.layer_norm")
    x = rand(3, 8, dtype=dtype)
    y = module.forward(x, eps=1e-3)
    assert y.dtype == dtype
    (grad,) = module.vjp(x, tf.ones_like(y), eps=1e-3)
    assert grad.dtype == dtype
    x64 = tf.cast(x, tf.float64)
    want = module.forward(x64, eps=1e-3)
    tol = {tf.float16: 2e-2, tf.bfloat16: 1e-1, tf.float32: 1e-5, tf.float64: 1e-12}[dtype]
    np.testing.assert_allclose(tf.cast(y, tf.float64).numpy(), want.numpy(), atol=tol, rtol=tol)
    kron = importlib.import_module("generated.sin_diag_outer")  # tf.eye follows the dtype
    A, B = rand(2, 3, 3, dtype=dtype), rand(2, 4, 4, dtype=dtype)
    grads = kron.vjp(A, B, tf.ones([2, 3, 4], dtype))
    assert all(g.dtype == dtype for g in grads)


def test_complex_inputs_are_refused_at_call_time():
    with pytest.raises(TypeError, match=r"BatchedMatMul: input A has dtype complex128"):
        matmul_module().forward(
            tf.zeros([1, 2, 2], tf.complex128), tf.zeros([1, 2, 2], tf.complex128)
        )


def test_rank_and_size_mismatch_name_op_tensor_and_index():
    module = matmul_module()
    with pytest.raises(ValueError, match=r"BatchedMatMul: input B has rank 2; expected 3"):
        module.forward(rand(1, 2, 3), rand(3, 4))
    with pytest.raises(ValueError, match=r"BatchedMatMul: index k has different sizes"):
        module.forward(rand(1, 2, 3), rand(1, 4, 2))


def test_logits_in_the_hundreds_stay_finite():
    lse = importlib.import_module("generated.log_sum_exp")
    soft = importlib.import_module("generated.attention_softmax")
    A = tf.constant([[[800.0, 799.0, -900.0, 5.0]]], tf.float64)
    y = lse.forward(A)
    np.testing.assert_allclose(y.numpy(), tf.reduce_logsumexp(A, -1).numpy(), rtol=1e-14)
    (grad,) = lse.vjp(A, tf.ones_like(y))
    np.testing.assert_allclose(grad.numpy(), tf.nn.softmax(A).numpy(), rtol=1e-12)
    Q = tf.constant([[[30.0, -20.0], [25.0, 40.0]]], tf.float64)
    K = tf.constant([[[10.0, 1.0], [-10.0, 3.0], [9.0, -8.0]]], tf.float64)
    y = soft.forward(Q, K)
    want = tf.nn.softmax(tf.matmul(Q, K, transpose_b=True))
    np.testing.assert_allclose(y.numpy(), want.numpy(), rtol=1e-12, atol=1e-300)
    grads = soft.vjp(Q, K, tf.ones_like(y) + y)
    assert all(np.isfinite(g.numpy()).all() for g in grads)
    for g32 in soft.vjp(tf.cast(Q, tf.float32) * 10, tf.cast(K, tf.float32), tf.ones([1, 2, 3])):
        assert np.isfinite(g32.numpy()).all()


def _graph_ops(fn, *args):
    graph = tf.function(fn).get_concrete_function(*args).graph
    return graph.get_operations()


def test_registered_gradient_reuses_outputs_instead_of_recomputing():
    """Like TF's own Exp/Tanh/Softmax gradients: read op.outputs, never recompute them."""
    for name, inputs, banned in (
        ("exp_mat_mul", (rand(2, 3, 4), rand(2, 4, 5)), {"Exp"}),
        ("attention_softmax", (rand(2, 3, 4), rand(2, 5, 4)), {"Exp", "Softmax", "Max"}),
        ("log_sum_exp", (rand(2, 3, 6),), {"Log", "Max"}),
    ):
        module = importlib.import_module(f"generated.{name}")
        outputs = [module.forward(*inputs)]
        grad = tf.ones_like(outputs[0])

        def run(*xs, module=module):
            return module.gradient(FakeOp(xs[:-2], xs[-2:-1], {}, module), xs[-1])

        types = {op.type for op in _graph_ops(run, *inputs, *outputs, grad)}
        assert not types & banned, f"{name}: gradient recomputes {types & banned}"


@pytest.mark.parametrize(
    "name",
    [
        "attention_softmax",
        "batch_kron",
        "batched_mat_mul",
        "exp_mat_mul",
        "gram_tanh",
        "layer_norm",
        "log_sum_exp",
        "mat_mul_and_squares",
        "pairwise_sq_dist",
        "sin_diag_outer",
    ],
)
def test_no_tensor_larger_than_the_largest_input_or_output(name):
    """Forward + backward through `forward`: e.g. pairwise distances never build (b,i,j,k)."""
    from test_generated_ops import OPS

    module = importlib.import_module(f"generated.{name}")
    inputs, attrs, reference = OPS[name]
    outputs = reference(*inputs, **attrs)
    limit = max(int(np.prod(t.shape)) for t in (*inputs, *outputs))

    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            outs = module.forward(*xs, **attrs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            loss = tf.add_n([tf.reduce_sum(o) for o in outs])
        return tape.gradient(loss, xs)

    n = len(inputs)

    def run_gradient(*xs):  # the op's outputs come in from outside, as TF hands them over
        ins, outs = xs[:n], xs[n:]
        return module.gradient(FakeOp(ins, outs, attrs, module), *[tf.ones_like(o) for o in outs])

    for fn, args in ((step, inputs), (run_gradient, (*inputs, *outputs))):
        for op in _graph_ops(fn, *args):
            for out in op.outputs:
                if out.shape.is_fully_defined():
                    size = int(np.prod(out.shape))
                    assert size <= limit, f"{op.type} makes {out.shape} (> {limit} elements)"


def test_diagonal_gradient_is_embedded_without_a_jacobian(tmp_path):
    module = generate(Case("y[b,i] = A[b,i,i]", {}), tmp_path, "DiagPart")
    A = rand(2, 4, 4)
    grad = rand(2, 4)
    (got,) = module.vjp(A, grad)
    np.testing.assert_array_equal(got.numpy(), tf.linalg.diag(grad).numpy())


@pytest.mark.parametrize("jit", [False, True])
def test_scalar_intermediate_in_tf_function_with_unknown_dims(jit, tmp_path):
    """A sum over every index inside a function is a rank-0 intermediate: it must work
    with unknown dims and under XLA, and its gradient must reduce to each input's shape."""
    case = Case("y[b,i] = A[b,i] / sum(w[k], k) + exp(sum(w[k] * w[k], k))", {})
    module = generate(case, tmp_path, prefix="ScalarLevel")
    spec_a, spec_w = tf.TensorSpec([None, None], tf.float64), tf.TensorSpec([None], tf.float64)

    @tf.function(input_signature=[spec_a, spec_w], jit_compile=jit)
    def loss_and_grads(A, w):
        with tf.GradientTape() as tape:
            tape.watch([A, w])
            loss = tf.reduce_sum(module.forward(A, w) ** 2)
        return loss, tape.gradient(loss, [A, w])

    for shape_a, k in (((2, 3), 5), ((4, 1), 2)):
        A, w = rand(*shape_a), tf.constant(RNG.uniform(0.5, 1.0, (k,)))
        loss, grads = loss_and_grads(A, w)
        with tf.GradientTape() as tape:
            tape.watch([A, w])
            ref = tf.reduce_sum((A / tf.reduce_sum(w) + tf.exp(tf.reduce_sum(w * w))) ** 2)
        want = tape.gradient(ref, [A, w])
        np.testing.assert_allclose(loss.numpy(), ref.numpy(), rtol=1e-12)
        for g, wanted in zip(grads, want, strict=True):
            assert g.shape == wanted.shape
            np.testing.assert_allclose(g.numpy(), wanted.numpy(), rtol=1e-10, atol=1e-12)


def _constant_size_extrema(graph_def) -> list[str]:
    """The integer Maximum and Minimum nodes of a graph (and of its functions: loop
    bodies, gradients) whose two inputs are constants: a max of sizes known when the graph
    is built, made an op."""
    found = []
    functions = [graph_def.node, *(f.node_def for f in graph_def.library.function)]
    for nodes in functions:
        constants = {n.name for n in nodes if n.op == "Const"}
        for n in nodes:
            if n.op not in ("Maximum", "Minimum") or n.attr["T"].type not in (3, 9):
                continue  # 3: int32, 9: int64
            inputs = [i.split(":")[0].lstrip("^") for i in n.input]
            if inputs and all(i in constants for i in inputs):
                found.append(n.name)
    return found


# a training step's inputs (shapes, each index its own size) and attrs, of modules whose
# sizes include a max or min of sizes and int attrs
GRAPH_STEPS = {
    "carafe": ([(1, 3, 5, 6), (1, 25, 10, 12)], {"K": 5, "S": 2}),
    "natten_qk2d": ([(1, 2, 9, 11, 4), (1, 2, 9, 11, 4)], {"K": 5}),
    "natten_qk1d": ([(1, 2, 13, 4), (1, 2, 13, 4)], {"kernel_size": 5}),
    "upfirdn2d": (
        [(1, 2, 7, 9), (4, 3)],
        {"up_x": 2, "up_y": 2, "down_x": 1, "down_y": 1}
        | {"pad_x0": 2, "pad_x1": 1, "pad_y0": 1, "pad_y1": 2},
    ),
}


@pytest.mark.parametrize("name", sorted(GRAPH_STEPS))
def test_a_max_of_sizes_stays_a_number_in_a_graph(name):
    """Under tf.function with every size known, a max or min of sizes and int attrs
    (`_n_u = max(K, 0)`, a band's clamped count) is a Python int (`_int_max`), never a
    graph op: a plan over such an op was computed in the graph and ran every chunk at
    once. Checked on a training step's graph, its loops and gradients included."""
    module = importlib.import_module(f"generated.{name}")
    shapes, attrs = GRAPH_STEPS[name]
    args = [tf.constant(RNG.standard_normal(s), tf.float32) for s in shapes]

    @tf.function
    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            loss = tf.reduce_sum(module.forward(*xs, **attrs) ** 2)
        return tape.gradient(loss, xs)

    graph_def = step.get_concrete_function(*args).graph.as_graph_def()
    assert _constant_size_extrema(graph_def) == []


@pytest.mark.parametrize("budget", [2**31, 10**12, 2**62, 2**70])
def test_a_huge_budget_under_unknown_sizes_runs_one_chunk(budget, tmp_path):
    """A budget meant as no limit, under tf.function with every size unknown: the planned
    chunk is at most the whole (MAX_TEMP_BYTES * n // held had wrapped in int32 at 10**12,
    a negative slice), the values those of the eager call."""
    case = Case(
        "y[b,i] = min(sum((x[b,i,c] - z[b,j,c])**2, c), j)", {"x": (1, 23, 2), "z": (1, 7, 2)}
    )
    module = generate(case, tmp_path, prefix="HugeBudget")
    module.MAX_TEMP_BYTES = budget
    rng = np.random.default_rng(7)
    x, z = (tf.constant(rng.standard_normal(case.shapes[n])) for n in ("x", "z"))
    g = tf.constant(rng.standard_normal((1, 23)))
    specs = [tf.TensorSpec([None] * t.shape.rank, tf.float64) for t in (x, z, g)]
    graph = tf.function(
        lambda x, z, g: (module.forward(x, z), module.vjp(x, z, g)), input_signature=specs
    )
    y, grads = graph(x, z, g)
    np.testing.assert_allclose(y.numpy(), module.forward(x, z).numpy(), rtol=1e-12)
    for got, want in zip(grads, module.vjp(x, z, g), strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)

"""The JAX target: every formula of the two corpora against the TF reference and TF
autodiff, and against JAX's own autodiff (`target_harness.check_target`), in float64; the
same numbers as the TensorFlow module; jax.jit, jax.vmap, second-order gradients, a
primitive of one's own through `wrap`, and one-line errors naming the op.

The corpora run under jax.jit (one XLA compile per function instead of one per op: about
three times faster); the cross-check against the TensorFlow module runs eagerly.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

jax = pytest.importorskip("jax")
tf = pytest.importorskip("tensorflow")

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from harness import Case, generate, make_tensors, op_spec
from jax.test_util import check_grads
from target_harness import Framework, check_target, generate_for
from test_indexing import KNOWN
from test_numeric import CORPUS

from symgrad import ir
from symgrad.errors import SymgradError
from symgrad.pipeline import module_text
from symgrad.targets.jax import JaxPrinter, contraction_path

ROOT = Path(__file__).resolve().parent.parent


def _autodiff(f, inputs, wrt, grads):
    """jax.vjp of f(*inputs) (a tuple of outputs) for the inputs at positions `wrt`."""

    def of_wrt(*xs):
        args = list(inputs)
        for k, x in zip(wrt, xs, strict=True):
            args[k] = x
        return f(*args)

    _, pullback = jax.vjp(of_wrt, *(inputs[k] for k in wrt))
    return list(pullback(tuple(grads)))


JAX = Framework("jax", tensor=jnp.asarray, numpy=np.asarray, autodiff=_autodiff)

# Not in the corpora: a 3-D convolution, strided along one axis (Conv3DBackprop*V2).
CONV3D = Case(
    "y[b,i,j,l,o] = sum(x[b, i+u, 2*j+v, l+w, c] * W[u,v,w,c,o], u, v, w, c)",
    {"x": (2, 5, 9, 6, 3), "W": (2, 3, 3, 3, 4)},
    sizes={"i": 4, "j": 4, "l": 4},
)
CASES = {**CORPUS, **{name: known.case for name, known in KNOWN.items()}, "conv3d": CONV3D}
assert len(CASES) == len(CORPUS) + len(KNOWN) + 1, "the corpora share a name"


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """`modules(name)`: the JAX module of a case, generated once per test run."""
    folder = tmp_path_factory.mktemp("jax")
    made = {}

    def module(name: str):
        if name not in made:
            made[name] = generate_for(CASES[name], "jax", folder)
        return made[name]

    module.folder = folder
    return module


def jitted(module):
    """The module's functions under jax.jit, attrs static (what check_target calls)."""
    static = module.ATTRS
    return SimpleNamespace(
        OP_NAME=module.OP_NAME,
        forward=jax.jit(module.forward, static_argnames=static),
        vjp=jax.jit(module.vjp, static_argnames=static),
        _compute=jax.jit(module._compute, static_argnames=static),
    )


def inputs_of(name: str, module, seed: int = 0) -> list:
    """Random inputs of a case in the module's input order, as JAX arrays."""
    tensors = make_tensors(CASES[name], module.INPUTS, seed)
    return [jnp.asarray(t.numpy()) for t in tensors]


def float_positions(name: str, module) -> list[int]:
    case = CASES[name]
    return [
        k
        for k, n in enumerate(module.INPUTS)
        if n not in case.index_inputs and n not in case.no_gradient
    ]


# ----------------------------------------------------------------------------- the corpora


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus(name, modules):
    check_target(CORPUS[name], jitted(modules(name)), JAX)


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_indexing_corpus(name, modules):
    check_target(KNOWN[name].case, jitted(modules(name)), JAX)


def test_conv3d_against_tensorflow(modules):
    """Not in the corpora (the reference evaluator broadcasts beyond TF's rank 8 here):
    against tf.nn.conv3d and TF autodiff of it, and JAX's own autodiff of `forward`."""
    module = modules("conv3d")
    x, w = make_tensors(CONV3D, module.INPUTS, seed=2)
    grad = tf.constant(np.random.default_rng(3).standard_normal([2, 4, 4, 4, 4]))
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        want = tf.nn.conv3d(x, w, strides=[1, 1, 2, 1, 1], padding="VALID")
    want_grads = tape.gradient(want, [x, w], output_gradients=grad)
    arrays = [jnp.asarray(t.numpy()) for t in (x, w)]
    got = jax.jit(module.forward)(*arrays)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-12, atol=1e-12)
    _, pullback = jax.vjp(module.forward, *arrays)
    for how, grads in (
        ("vjp", module.vjp(*arrays, jnp.asarray(grad.numpy()))),
        ("autodiff through forward", pullback(jnp.asarray(grad.numpy()))),
    ):
        for g, w in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(
                np.asarray(g), w.numpy(), rtol=1e-12, atol=1e-12, err_msg=how
            )


# Eagerly, against the TensorFlow module of the same case on the same inputs.
CROSS_CHECK = [
    "batched_matmul",
    "layer_norm",
    "two_outputs_shared",
    "no_gradient_mask",
    "attrs_all_kinds",
    "sin_diag_outer",
    "embedding_plus_position",
    "gather_out_of_range",
    "conv1d_same_stride2",
    "conv2d_stride2",
    "conv3d",
    "cumsum_reverse_exclusive",
    "max_pool_2x3",
    "correlation",
    "causal_softmax",
]


@pytest.mark.parametrize("name", CROSS_CHECK)
def test_same_numbers_as_the_tensorflow_module(name, modules, tmp_path):
    case = CASES[name]
    ours, theirs = modules(name), generate(case, tmp_path, prefix="CrossCheck")
    assert ours.INPUTS == theirs.INPUTS and ours.OUTPUTS == theirs.OUTPUTS
    tensors = make_tensors(case, ours.INPUTS, seed=5)
    arrays = [jnp.asarray(t.numpy()) for t in tensors]
    want = theirs.forward(*tensors, **case.attrs)
    got = ours.forward(*arrays, **case.attrs)
    want, got = (x if isinstance(x, tuple) else (x,) for x in (want, got))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w.numpy(), rtol=1e-12, atol=1e-12)
    rng = np.random.default_rng(6)
    grads = [rng.standard_normal(w.shape) for w in want]
    want = theirs.vjp(*tensors, *(tf.constant(g) for g in grads), **case.attrs)
    got = ours.vjp(*arrays, *(jnp.asarray(g) for g in grads), **case.attrs)
    for n, g, w in zip(ours.INPUTS, got, want, strict=True):
        assert (g is None) == (w is None), n
        if w is not None:
            w = tf.convert_to_tensor(w).numpy()
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-12, atol=1e-12, err_msg=n)


# ----------------------------------------------------------------------------- transformations


def of_floats(module, name: str, arrays):
    """`f(*floats)`: the outputs (a tuple) as a function of the float inputs that have a
    gradient, the others held at `arrays`; and those floats."""
    case = CASES[name]
    positions = float_positions(name, module)

    def f(*floats):
        args = list(arrays)
        for k, x in zip(positions, floats, strict=True):
            args[k] = x
        outs = module.forward(*args, **case.attrs)
        return outs if isinstance(outs, tuple) else (outs,)

    return f, [arrays[k] for k in positions]


def loss_of(module, name: str, arrays, seed: int = 1):
    """`loss(*floats)`: <outputs, fixed random weights>; and the floats."""
    f, floats = of_floats(module, name, arrays)
    rng = np.random.default_rng(seed)
    weights = [jnp.asarray(rng.standard_normal(o.shape)) for o in f(*floats)]

    def loss(*floats):
        return sum(jnp.sum(o * w) for o, w in zip(f(*floats), weights, strict=True))

    return loss, floats


TRANSFORMED = [
    "batched_matmul",
    "attrs_all_kinds",
    "two_outputs",
    "no_gradient_mask",
    "layer_norm",
    "gather",
    "pointnet_weighted",
    "conv2d_same",
    "cumsum",
    "max_pool_2x2",
]


@pytest.mark.parametrize("name", TRANSFORMED)
def test_jit_of_forward_and_of_grad(name, modules):
    module = modules(name)
    arrays = inputs_of(name, module)
    attrs = CASES[name].attrs
    eager = module.forward(*arrays, **attrs)
    compiled = jax.jit(module.forward, static_argnames=module.ATTRS)(*arrays, **attrs)
    for e, c in zip(*(x if isinstance(x, tuple) else (x,) for x in (eager, compiled))):
        np.testing.assert_allclose(np.asarray(c), np.asarray(e), rtol=1e-12, atol=1e-12)
    loss, floats = loss_of(module, name, arrays)
    wrt = tuple(range(len(floats)))
    eager = jax.grad(loss, argnums=wrt)(*floats)
    compiled = jax.jit(jax.grad(loss, argnums=wrt))(*floats)
    for e, c in zip(eager, compiled, strict=True):
        np.testing.assert_allclose(np.asarray(c), np.asarray(e), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", TRANSFORMED)
def test_vmap_over_a_leading_axis(name, modules):
    """forward, jax.grad and vjp under jax.vmap against a Python loop over the axis."""
    module = modules(name)
    attrs = CASES[name].attrs
    batches = [inputs_of(name, module, seed) for seed in range(3)]
    stacked = [jnp.stack(xs) for xs in zip(*batches, strict=True)]

    def forward(*xs):
        out = module.forward(*xs, **attrs)
        return out if isinstance(out, tuple) else (out,)

    mapped = jax.vmap(forward)(*stacked)
    looped = [forward(*xs) for xs in batches]
    for k, m in enumerate(mapped):
        want = np.stack([np.asarray(outs[k]) for outs in looped])
        np.testing.assert_allclose(np.asarray(m), want, rtol=1e-12, atol=1e-12)

    def gradient(*xs):
        loss, floats = loss_of(module, name, list(xs))
        return jax.grad(loss, argnums=tuple(range(len(floats))))(*floats)

    mapped = jax.vmap(gradient)(*stacked)
    looped = [gradient(*xs) for xs in batches]
    for k, m in enumerate(mapped):
        want = np.stack([np.asarray(g[k]) for g in looped])
        np.testing.assert_allclose(np.asarray(m), want, rtol=1e-12, atol=1e-12)

    rng = np.random.default_rng(2)
    grads = [jnp.asarray(rng.standard_normal(o.shape)) for o in forward(*batches[0])]

    def vjp(*xs):
        return module.vjp(*xs, *grads, **attrs)

    mapped = jax.vmap(vjp)(*stacked)
    looped = [vjp(*xs) for xs in batches]
    for k, m in enumerate(mapped):
        if m is None:
            assert all(g[k] is None for g in looped)
            continue
        want = np.stack([np.asarray(g[k]) for g in looped])
        np.testing.assert_allclose(np.asarray(m), want, rtol=1e-12, atol=1e-12)


SECOND_ORDER = [
    "batched_matmul",
    "tanh_sigmoid",
    "layer_norm",
    "attention_softmax",
    "logsumexp",
    "rbf_kernel",
    "kron",
    "gather",
    "conv1d_same_stride2",
    "conv2d_stride2",
    "cumsum_reverse_exclusive",
    "causal_softmax",
]


@pytest.mark.parametrize("name", SECOND_ORDER)
def test_second_order_gradients(name, modules):
    """The generated backward is made of differentiable JAX ops: grad of grad works."""
    module = modules(name)
    arrays = inputs_of(name, module)
    f, floats = of_floats(module, name, arrays)
    check_grads(jax.jit(f), tuple(floats), order=2, modes=["rev"])


# ----------------------------------------------------------------------------- wrap


def _batched_matmul(A, B):
    return np.einsum("bik,bkj->bij", A, B)


def _layer_norm(x, *, eps):
    centered = x - x.mean(axis=1, keepdims=True)
    return centered / np.sqrt((centered**2).mean(axis=1, keepdims=True) + eps)


def _pointnet_weighted(X, idx, w):
    rows = X[np.arange(X.shape[0])[:, None, None], idx]  # (b, n, k, c)
    return np.einsum("bnkc,bnk->bnc", rows, w)


def _two_outputs(A, B):
    return np.einsum("bik,bkj->bij", A, B), np.einsum("bik,bik->bi", A, A)


def _max_pool_2x2(x):
    b, h, w, c = x.shape
    cropped = x[:, : h // 2 * 2, : w // 2 * 2]
    return cropped.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


NUMPY = {
    "batched_matmul": _batched_matmul,
    "layer_norm": _layer_norm,  # intermediates recomputed from the output
    "pointnet_weighted": _pointnet_weighted,  # an index input, a gather recomputed
    "two_outputs": _two_outputs,
    "max_pool_2x2": _max_pool_2x2,  # output sized by a range
}


def callback_primal(module, implementation):
    """A JAX primitive of one's own: a NumPy implementation through jax.pure_callback,
    its result shapes from the generated forward traced abstractly."""

    def primal(*arrays, **attrs):
        shapes = jax.eval_shape(lambda *xs: module.forward(*xs, **attrs), *arrays)

        def run(*xs):
            out = implementation(*(np.asarray(x) for x in xs), **attrs)
            return jax.tree.map(np.asarray, out)

        return jax.pure_callback(run, shapes, *arrays, vmap_method="sequential")

    return primal


@pytest.mark.parametrize("name", sorted(NUMPY))
def test_wrap_a_pure_callback_primitive(name, modules):
    """`wrap`: the primitive's values, the generated gradient (orders 1 and 2: the
    gradient reads the primitive's outputs through the op itself), jit and vmap."""
    module = modules(name)
    attrs = CASES[name].attrs
    wrapped = module.wrap(callback_primal(module, NUMPY[name]))
    arrays = inputs_of(name, module)
    got, want = wrapped(*arrays, **attrs), module.forward(*arrays, **attrs)
    for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want)), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12, atol=1e-12)

    ours = SimpleNamespace(forward=wrapped, ATTRS=module.ATTRS, INPUTS=module.INPUTS)
    f, floats = of_floats(ours, name, arrays)
    check_grads(f, tuple(floats), order=2, modes=["rev"])

    loss, floats = loss_of(ours, name, arrays)
    generated, _ = loss_of(module, name, arrays)
    wrt = tuple(range(len(floats)))
    got = jax.jit(jax.grad(loss, argnums=wrt))(*floats)
    want = jax.grad(generated, argnums=wrt)(*floats)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12, atol=1e-12)

    stacked = [jnp.stack([x, x + 1]) if x.dtype.kind == "f" else jnp.stack([x, x]) for x in arrays]
    mapped = jax.vmap(lambda *xs: wrapped(*xs, **attrs))(*stacked)
    looped = jax.vmap(lambda *xs: module.forward(*xs, **attrs))(*stacked)
    for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (mapped, looped)), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12, atol=1e-12)


FLOAT32 = ["gather_out_of_range", "conv2d_stride2", "layer_norm", "cumsum_reverse_exclusive"]


def test_float32_stays_float32_without_x64(modules):
    """JAX's default (no jax_enable_x64, int64 unavailable), in a fresh process with
    warnings as errors: float32 in, float32 out, forward, vjp and jax.grad under jit."""
    runs = [
        (modules(n).__name__, CASES[n].attrs, CASES[n].shapes, CASES[n].index_inputs)
        for n in FLOAT32
    ]
    script = f"""
import importlib, sys, warnings
warnings.simplefilter("error")
sys.path.insert(0, {str(modules.folder)!r})
import jax, jax.numpy as jnp, numpy as np
for name, attrs, shapes, index_inputs in {runs!r}:
    m = importlib.import_module(name)
    rng = np.random.default_rng(0)
    arrays = [
        jnp.asarray(rng.integers(*index_inputs[n][1:3], index_inputs[n][0]), jnp.int32)
        if n in index_inputs
        else jnp.asarray(rng.uniform(0.5, 1.0, shapes[n]), jnp.float32)
        for n in m.INPUTS
    ]
    y = m.forward(*arrays, **attrs)
    assert y.dtype == jnp.float32, (name, y.dtype)
    grads = m.vjp(*arrays, jnp.ones_like(y), **attrs)
    assert all(g is None or g.dtype == jnp.float32 for g in grads), name
    floats = [k for k, n in enumerate(m.INPUTS) if n not in index_inputs]

    def loss(*xs):
        args = list(arrays)
        for k, x in zip(floats, xs):
            args[k] = x
        return jnp.sum(m.forward(*args, **attrs))

    found = jax.jit(jax.grad(loss, argnums=tuple(range(len(floats)))))(*(arrays[k] for k in floats))
    assert all(g.dtype == jnp.float32 for g in found), name
print("ok")
"""
    env = {"PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# ----------------------------------------------------------------------------- errors


def one_line_error(kind, call, message: str, op: str) -> None:
    with pytest.raises(kind) as raised:
        call()
    text = str(raised.value)
    assert text.startswith(f"{op}: "), text
    assert message in text, text
    assert "\n" not in text, text


def test_call_time_errors_are_one_line_naming_the_op(modules):
    m = modules("batched_matmul")  # A (2, 3, 5), B (2, 5, 4)
    op = m.OP_NAME
    A, B = inputs_of("batched_matmul", m)
    grad = jnp.ones((2, 3, 4))
    one_line_error(ValueError, lambda: m.forward(A[0], B), "input A has rank 2; expected 3", op)
    one_line_error(
        TypeError,
        lambda: m.forward(A.astype(jnp.float32), B),
        "inputs must share one dtype; got A float32, B float64",
        op,
    )
    one_line_error(
        TypeError, lambda: m.forward(A.astype(jnp.int32), B), "input A has dtype int32", op
    )
    one_line_error(
        ValueError,
        lambda: m.forward(A, jnp.ones((2, 6, 4))),
        "index k has different sizes: A[axis 2] = 5, B[axis 1] = 6",
        op,
    )
    one_line_error(
        ValueError,
        lambda: m.vjp(A, B, jnp.ones((2, 3, 5))),
        "grad_y has shape (2, 3, 5); expected (2, 3, 4) like y",
        op,
    )
    one_line_error(
        TypeError,
        lambda: m.vjp(A, B, grad.astype(jnp.float32)),
        "grad_y has dtype float32; expected float64",
        op,
    )
    one_line_error(TypeError, lambda: m.vjp(A, B, None), "grad_y is None", op)
    # under jax.jit the same checks run while tracing: shapes are static in JAX
    one_line_error(
        ValueError, lambda: jax.jit(m.forward)(A[0], B), "input A has rank 2; expected 3", op
    )
    one_line_error(
        ValueError,
        lambda: jax.jit(m.vjp)(A, B, jnp.ones((2, 3, 5))),
        "grad_y has shape (2, 3, 5)",
        op,
    )


def test_index_and_attr_errors_are_one_line_naming_the_op(modules):
    m = modules("gather")
    W, ids = inputs_of("gather", m)
    one_line_error(
        TypeError,
        lambda: m.forward(W, ids.astype(jnp.float64)),
        "index tensor ids has dtype float64; expected int32 or int64",
        m.OP_NAME,
    )
    m = modules("scaled_add")
    A, B = inputs_of("scaled_add", m)
    one_line_error(
        TypeError,
        lambda: jax.jit(lambda a, b, alpha: m.forward(a, b, alpha=alpha))(A, B, 2.5),
        "attr alpha must be a static Python float, not a DynamicJaxprTracer",
        m.OP_NAME,
    )
    m = modules("conv1d_stride2")
    x, w = inputs_of("conv1d_stride2", m)
    one_line_error(
        ValueError,
        lambda: m.forward(x, w, s=0),
        "attr s is 0; it scales an index or divides a range, and must be positive",
        m.OP_NAME,
    )
    one_line_error(
        TypeError, lambda: m.forward(x, w, s=2.5), "attr s is 2.5; expected an int", m.OP_NAME
    )


def test_a_wrapped_primal_that_returns_the_wrong_shape_is_one_line(modules):
    m = modules("batched_matmul")
    A, B = inputs_of("batched_matmul", m)
    wrapped = m.wrap(lambda A, B: jnp.einsum("bik,bkj->bji", A, B))
    one_line_error(
        ValueError,
        lambda: wrapped(A, B),
        "the primal's y has shape (2, 4, 3); expected (2, 3, 4)",
        m.OP_NAME,
    )
    wrapped = m.wrap(lambda A, B: (A, B))
    one_line_error(
        ValueError, lambda: wrapped(A, B), "the primal returned 2 outputs; expected 1", m.OP_NAME
    )


# ----------------------------------------------------------------------------- the printer

P = JaxPrinter()
A, B, X = ir.Var("A"), ir.Var("B"), ir.Var("x")
N = ir.Var("_n_i")


@pytest.mark.parametrize(
    ("expr", "text"),
    [
        (
            ir.Einsum("bik,bkj->bij", (A, B)),
            'jnp.einsum("bik,bkj->bij", A, B, optimize=[(0, 1)])',
        ),
        (ir.Einsum("bii->bi", (A,)), 'jnp.einsum("bii->bi", A, optimize=[(0,)])'),
        (ir.View(A, (1, 0), (None, 0, 1)), "jnp.transpose(A, (1, 0))[None]"),
        (ir.View(A, None, (0, None, 1, None)), "A[:, None, :, None]"),
        (ir.View(ir.Binary("+", A, B), None, (0, None)), "(A + B)[..., None]"),
        (ir.AxisSize("x", 2), "x.shape[2]"),
        (ir.FloatSize("_n_k"), "jnp.asarray(_n_k, dtype)"),
        # size arithmetic stays Python (static under jit); tensors use jnp
        (
            ir.Call("maximum", (ir.Binary("-", ir.AxisSize("x", 1), ir.Lit("2")), ir.Lit("0"))),
            "max(x.shape[1] - 2, 0)",
        ),
        (ir.Call("maximum", (A, ir.Lit("0"))), "jnp.maximum(A, 0)"),
        (ir.Call("minimum", (N, ir.Var("_int_s"))), "min(_n_i, _int_s)"),
        (ir.Call("to_int64", (N,)), "_n_i"),
        (ir.Call("to_int64", (ir.Binary("+", N, ir.Lit("1")),)), "(_n_i + 1)"),
        (ir.Call("to_int64", (ir.Var("ids"),)), "jnp.asarray(ids, int)"),
        (ir.Call("cast", (ir.Var("mask"), ir.Var("dtype"))), "jnp.asarray(mask, dtype)"),
        (
            ir.Call("gather", (X, ir.Var("p")), (("axis", ir.Lit("1")),)),
            "_gather(x, p, axis=1)",  # jnp.take, never from an empty axis
        ),
        (ir.Call("segment_sum", (X, ir.Var("ids"), N)), "_segment_sum(x, ids, _n_i)"),
        (
            ir.Call("sparse_rows", (X, ir.Var("rows"), ir.Call("shape", (ir.Var("W"),)))),
            "jax.ops.segment_sum(x, rows, num_segments=W.shape[0])",
        ),
        (
            ir.Call(
                "slice",
                (
                    X,
                    ir.List((ir.Lit("0"), ir.Lit("1"), ir.Lit("0"))),
                    ir.List((ir.Lit("-1"), N, ir.Lit("-1"))),
                ),
            ),
            "x[:, 1:1 + _n_i]",
        ),
        (ir.Call("slice", (X, ir.Var("begin"))), "_slice(x, begin)"),
        (ir.Call("reduce_sum", (X,), (("axis", ir.Lit("[1, 2]")),)), "jnp.sum(x, axis=(1, 2))"),
        (
            ir.Call("reduce_max", (X,), (("axis", ir.Lit("[1]")),)),
            "jnp.max(x, axis=1, initial=-jnp.inf)",
        ),
        (ir.Call("cumsum", (X,), (("axis", ir.Lit("1")),)), "jnp.cumsum(x, axis=1)"),
        (
            ir.Call("cumsum", (X,), (("axis", ir.Lit("1")), ("reverse", ir.Lit("True")))),
            "jax.lax.cumsum(x, axis=1, reverse=True)",
        ),
        (
            ir.Call("cumsum", (X,), (("axis", ir.Lit("0")), ("exclusive", ir.Lit("True")))),
            "_exclusive_cumsum(x, axis=0)",
        ),
        (
            ir.Call(
                "convolution",
                (X, ir.Var("w")),
                (("strides", ir.List((ir.Lit("2"),))), ("padding", ir.Lit('"VALID"'))),
            ),
            (
                '_convolution(x, w, window_strides=[2], padding="VALID", '
                "dimension_numbers=('NWC', 'WIO', 'NWC'))"
            ),
        ),
    ],
)
def test_printer_spells(expr, text):
    assert P.code(expr) == text


def test_contraction_path_keeps_the_fewest_indices_first():
    assert contraction_path("bij,jk->bik") == [(0, 1)]
    # the diagonal factor first (it leaves b, i), then the two b,i tensors, then i,a
    assert contraction_path("bij,bjj,bi,ia->bia") == [(0, 1), (0, 2), (0, 1)]


# ----------------------------------------------------------------------------- the modules


def test_generated_modules_are_derived_and_lint_clean(modules):
    """No JAX autodiff inside a generated module, no dead predicate of a `cond` (its
    `otherwise` branch is printed alone), and `ruff check` finds nothing."""
    for name in sorted(CASES):
        text = Path(modules(name).__file__).read_text(encoding="utf-8")
        called = re.findall(r"\.(\w+)\(", text)  # jax.vjp( and the like
        autodiff = {"vjp", "grad", "value_and_grad", "jvp", "linearize", "linear_transpose"}
        assert not autodiff & set(called), name
        assert "jnp.all(" not in text, name
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", str(modules.folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:]


def test_generate_with_target_jax_never_imports_jax(tmp_path):
    spec = tmp_path / "symgrad.toml"
    spec.write_text(
        '[ops.BatchedMatMul]\nformula = "y[b,i,j] = A[b,i,k] * B[b,k,j]"\n', encoding="utf-8"
    )
    script = (
        "import sys\n"
        "from symgrad.cli import main\n"
        f"assert main(['generate', {str(spec)!r}, '--target', 'jax']) == 0\n"
        "assert 'jax' not in sys.modules and 'tensorflow' not in sys.modules\n"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "generated_jax" / "batched_mat_mul.py").read_text(encoding="utf-8")
    assert text.startswith("# Code generated by symgrad. DO NOT EDIT.\n")
    assert "y[b,i,j] = A[b,i,k] * B[b,k,j]" in text  # the formula in the docstring
    assert re.search(r"grad_A\[b,i,k\] = ", text)  # and the gradients in index form


@pytest.mark.parametrize("name", ["jax", "jnp", "lax", "torch", "tf", "wrap", "register"])
def test_an_input_named_like_a_module_generated_code_calls_is_refused(name):
    """An input `jnp` would shadow the module the JAX code calls: refused for every target."""
    case = Case(f"y[b,i] = exp({name}[b,i])", {name: (2, 3)})
    with pytest.raises(SymgradError, match="reserved"):
        module_text(op_spec(case, "Named"), "t", "jax")


# ----------------------------------------------------------------------------- README


def jax_section() -> str:
    """The README's JAX section."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return readme.split("\n## JAX\n", 1)[1].split("\n## ", 1)[0]


def test_readme_jax_example_runs(tmp_path):
    """The example as it is, after `symgrad generate --target jax`, in a fresh process:
    a pure_callback kernel through `wrap`, trained with jax.grad under jax.jit."""
    (example,) = re.findall(r"```python\n(.*?)\n```", jax_section(), flags=re.DOTALL)
    (tmp_path / "symgrad.toml").write_text(
        '[ops.BatchedMatMul]\nformula = "y[b,i,j] = A[b,i,k] * B[b,k,j]"\ninputs = ["A", "B"]\n',
        encoding="utf-8",
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    generate = [sys.executable, "-m", "symgrad", "generate", "--target", "jax"]
    subprocess.run(generate, cwd=tmp_path, env=env, check=True, capture_output=True)
    (tmp_path / "example.py").write_text(example + "\n", encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    claimed = re.search(r"down to (\d\.\d+)", example).group(1)
    assert result.stdout.strip() == f"loss {claimed}", result.stdout

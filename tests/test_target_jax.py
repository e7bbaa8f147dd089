"""The JAX target: every formula of the two corpora against the TF reference and TF
autodiff, and against JAX's own autodiff (`target_harness.check_target`), in float64; the
same numbers as the TensorFlow module.

The corpora run under jax.jit (one XLA compile per function instead of one per op: about
three times faster); the cross-check against the TensorFlow module runs eagerly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

jax = pytest.importorskip("jax")
tf = pytest.importorskip("tensorflow")

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from harness import Case, generate, make_tensors
from target_harness import Framework, check_target, generate_for
from test_indexing import KNOWN
from test_numeric import CORPUS


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

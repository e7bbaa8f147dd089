"""The activations of the formula language (`relu silu gelu gelu_tanh elu`, symgrad/functions.py):
each is its framework's own function forward, and its gradient is exact in float64
against TF autodiff of TensorFlow's function and against finite differences, in every
target; in float32 far from the origin (|x| up to 90, where `exp` overflows and
`sigmoid` underflows) values and gradients stay finite and close to float64's."""

from __future__ import annotations

import numpy as np
import pytest
from all_targets import jnp, modules_fixture, tf, torch
from harness import Case, check
from target_harness import check_target, frameworks

from symgrad.reference import FUNCTIONS

ACTIVATIONS = ["relu", "silu", "gelu", "gelu_tanh", "elu"]
# Each index its own size; x crosses 0 so that both sides of elu are read; a constant
# argument folds to its number.
CASES = {
    f: Case(
        f"y[b,i] = {f}(A[b,i] * C[i] + 0.25) + A[b,i] * {f}(-1.5)",
        {"A": (3, 5), "C": (5,)},
        low=-3.0,
        high=3.0,
    )
    for f in ACTIVATIONS
}
FAR = {f: Case(f"y[b,i] = {f}(A[b,i]) * C[i]", {"A": (4, 6), "C": (6,)}) for f in ACTIVATIONS}
modules = modules_fixture({**CASES, **{f"far_{f}": c for f, c in FAR.items()}}, "Activation")

# The framework's own function, printed into the module forward, one per target (GELU
# written out in TensorFlow).
SPELLED = {
    "tensorflow": {
        "silu": "tf.nn.silu(",
        "gelu": "tf.math.erfc(",  # tf.nn.gelu is 1e-8 off in float64
        "gelu_tanh": "0.7978845608028654 * (",
        "elu": "tf.nn.elu(",
        "relu": "tf.nn.relu(",
    },
    "pytorch": {
        "silu": "torch.nn.functional.silu(",
        "gelu": "torch.nn.functional.gelu(",
        "gelu_tanh": 'approximate="tanh")',
        "elu": "torch.nn.functional.elu(",
        "relu": "torch.relu(",
    },
    "jax": {
        "silu": "jax.nn.silu(",
        "gelu": "approximate=False)",
        "gelu_tanh": "approximate=True)",
        "elu": "jax.nn.elu(",
        "relu": "jax.nn.relu(",
    },
}


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_is_exact_in_tensorflow(name, modules):
    """forward, vjp, the registered gradient and a tape over forward against TF autodiff
    of TensorFlow's function, and finite differences (float64)."""
    check(CASES[name], modules(name))


@pytest.mark.parametrize("target", ["pytorch", "jax"])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_is_exact_in_pytorch_and_jax(name, target, modules):
    """Against TF autodiff (forward, vjp, autodiff through forward and through the
    generated forward ops), then finite differences of forward (float64)."""
    module = modules(name, target)
    check_target(CASES[name], module, frameworks()[target])
    rng = np.random.default_rng(3)
    arrays = [rng.uniform(-3, 3, (3, 5)), rng.uniform(-3, 3, (5,))]
    if target == "pytorch":
        args = [torch.tensor(a, requires_grad=True) for a in arrays]
        assert torch.autograd.gradcheck(module.forward, args)
    else:
        from jax.test_util import check_grads

        check_grads(module.forward, [jnp.asarray(a) for a in arrays], order=1, modes=["rev"])


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_is_its_frameworks_function(name, target, modules):
    import inspect

    source = inspect.getsource(modules(name, target)._compute)
    assert SPELLED[target][name] in source


def _far_inputs():
    """A at -90..90 (and near 0), C at 0.5..2: float32."""
    a = np.array([-90, -60, -30, -12, -3, -0.5, 0, 0.5, 3, 12, 30, 90], np.float64)
    A = np.resize(a, (4, 6)) * np.linspace(0.9, 1.1, 24).reshape(4, 6)
    C = np.linspace(0.5, 2, 6)
    return [A.astype(np.float32), C.astype(np.float32)]


def _far_reference(name, A, C, g):
    """float64 output and gradients by TF autodiff of TensorFlow's own function."""
    A, C, g = (tf.constant(x, tf.float64) for x in (A, C, g))
    with tf.GradientTape() as tape:
        tape.watch([A, C])
        y = FUNCTIONS[name](A) * C
    return [y.numpy(), *(t.numpy() for t in tape.gradient(y, [A, C], output_gradients=g))]


def _far_run(module, target, A, C, g):
    if target == "tensorflow":
        y = module.forward(tf.constant(A), tf.constant(C))
        got = [y, *module.vjp(tf.constant(A), tf.constant(C), tf.constant(g))]
        return [t.numpy() for t in got]
    if target == "pytorch":
        args = [torch.tensor(x) for x in (A, C, g)]
        return [t.numpy() for t in (module.forward(*args[:2]), *module.vjp(*args))]
    args = [jnp.asarray(x) for x in (A, C, g)]
    return [np.asarray(t) for t in (module.forward(*args[:2]), *module.vjp(*args))]


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_far_from_the_origin_in_float32(name, target, modules):
    A, C = _far_inputs()
    g = np.random.default_rng(4).uniform(0.5, 1.5, (4, 6)).astype(np.float32)
    want = _far_reference(name, A, C, g)
    got = _far_run(modules(f"far_{name}", target), target, A, C, g)
    for what, x, w in zip(("y", "grad A", "grad C"), got, want, strict=True):
        assert x.dtype == np.float32, what
        assert np.all(np.isfinite(x)), f"{name} {target}: {what} is not finite"
        np.testing.assert_allclose(x, w, rtol=1e-5, atol=1e-6, err_msg=f"{name} {target} {what}")

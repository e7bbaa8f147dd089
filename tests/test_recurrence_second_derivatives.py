"""Second derivatives through recurrences: the gradient of Σ|∂L/∂inputs|² for
L = Σ sin(y), in every target, against a JAX loop differentiated twice (float64).

Two were silently wrong while first derivatives were exact (found by an adversarial
trial): PyTorch's backward started the adjoint scan from checkpoints the forward had
saved without a graph, so a gradient of the gradient treated the states as constants
(10-100% off, in every form, at budgets that make checkpoints); and TensorFlow inside
tf.function, where a state read at two lags went through TF's gradient of a TensorArray
gather in a while_loop, which is wrong where one element is read at several positions
(lag 1 + lag 2, lfilter: 10-50% off)."""

from __future__ import annotations

import numpy as np
import pytest
from frameworks import _enable_x64
from harness import generated_once, load_module
from test_recurrences import op_spec

from symgrad.pipeline import module_text

B, T = 2, 7

# name -> (formula, inputs, step of the loop over (a, x, h1, h2) in scan order, reverse)
FORMS = {
    "linear": ("h[b,t] = a[b,t] * h[b,t-1] + x[b,t]", False),
    "tanh": ("h[b,t] = tanh(a[b,t] * h[b,t-1] + x[b,t])", False),
    "two_lags": ("h[b,t] = a[b,t] * h[b,t-1] + 0.3 * h[b,t-2] + tanh(x[b,t])", False),
    "two_lags_reverse": ("h[b,t] = a[b,t] * h[b,t+1] + 0.3 * h[b,t+2] + tanh(x[b,t])", True),
}


def _step(name, a, x, h1, h2):
    import jax.numpy as jnp

    if name == "linear":
        return a * h1 + x
    if name == "tanh":
        return jnp.tanh(a * h1 + x)
    return a * h1 + 0.3 * h2 + jnp.tanh(x)


def _truth(name, a, x):
    """(first, second) derivatives of L = Σ sin(h) by a JAX loop."""
    import jax
    import jax.numpy as jnp

    reverse = FORMS[name][1]

    def loop(a, x):
        order = range(T - 1, -1, -1) if reverse else range(T)
        hs = {}
        for t in order:
            back = 1 if not reverse else -1
            h1 = hs.get(t - back, jnp.zeros(B))
            h2 = hs.get(t - 2 * back, jnp.zeros(B))
            hs[t] = _step(name, a[:, t], x[:, t], h1, h2)
        return jnp.stack([hs[t] for t in range(T)], 1)

    def first(a, x):
        return jnp.sum(jnp.sin(loop(a, x)))

    def second(a, x):
        return sum(jnp.sum(g**2) for g in jax.grad(first, argnums=(0, 1))(a, x))

    args = (jnp.asarray(a), jnp.asarray(x))
    return (
        [np.asarray(g) for g in jax.grad(first, argnums=(0, 1))(*args)],
        [np.asarray(g) for g in jax.grad(second, argnums=(0, 1))(*args)],
    )


def _module(name, target, folder):
    op = op_spec(f"Second{name.title().replace('_', '')}", FORMS[name][0], inputs=("a", "x"))
    return generated_once(f"second_{name}_{target}", op, target, folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("second")


def _values(seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, (B, T)), rng.standard_normal((B, T))


def _torch_second(module, *arrays):
    """(first, second) derivatives of L = Σ sin(y) through `forward`, for every input."""
    import torch

    leaves = [torch.tensor(v, requires_grad=True) for v in arrays]
    first = torch.autograd.grad(torch.sin(module.forward(*leaves)).sum(), leaves, create_graph=True)
    second = torch.autograd.grad(sum((g**2).sum() for g in first), leaves)
    return [g.detach().numpy() for g in first], [g.numpy() for g in second]


def _tf_second(module, *arrays, graph):
    """`_torch_second` in TensorFlow: two tapes, eagerly or under tf.function with every
    size unknown."""
    import tensorflow as tf

    def step(*args):
        with tf.GradientTape() as outer:
            outer.watch(list(args))
            with tf.GradientTape() as inner:
                inner.watch(list(args))
                loss = tf.reduce_sum(tf.sin(module.forward(*args)))
            first = inner.gradient(loss, list(args))
            total = tf.add_n([tf.reduce_sum(g**2) for g in first])
        return first, outer.gradient(total, list(args))

    if graph:
        specs = [tf.TensorSpec([None] * np.ndim(v), tf.float64) for v in arrays]
        step = tf.function(step, input_signature=specs)
    first, second = step(*[tf.constant(v) for v in arrays])
    return [g.numpy() for g in first], [g.numpy() for g in second]


def _jax_second(module, a, x):
    import jax
    import jax.numpy as jnp

    def first(a, x):
        return jnp.sum(jnp.sin(module.forward(a, x)))

    def second(a, x):
        return sum(jnp.sum(g**2) for g in jax.grad(first, argnums=(0, 1))(a, x))

    args = (jnp.asarray(a), jnp.asarray(x))
    return (
        [np.asarray(g) for g in jax.grad(first, argnums=(0, 1))(*args)],
        [np.asarray(g) for g in jax.jit(jax.grad(second, argnums=(0, 1)))(*args)],
    )


RUNS = {
    "pytorch": _torch_second,
    "tensorflow": lambda m, a, x: _tf_second(m, a, x, graph=False),
    "tf_function": lambda m, a, x: _tf_second(m, a, x, graph=True),
    "jax": _jax_second,
}


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("name", sorted(FORMS))
def test_second_derivatives_of_a_recurrence(name, run, budget, folder):
    pytest.importorskip({"pytorch": "torch", "jax": "jax"}.get(run, "tensorflow"))
    _enable_x64()
    module = _module(name, "tensorflow" if run == "tf_function" else run, folder)
    default = module.MAX_TEMP_BYTES
    module.MAX_TEMP_BYTES = default if budget is None else budget
    try:
        a, x = _values()
        want_first, want_second = _truth(name, a, x)
        first, second = RUNS[run](module, a, x)
    finally:
        module.MAX_TEMP_BYTES = default
    for got, want in zip(first + second, want_first + want_second, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


# The coupled scan (RWKV-4's WKV) and the two-index one (soft-DTW) run the same hooks:
# PyTorch's second derivatives pass torch's own numerical gradgradcheck, and TensorFlow's,
# eagerly and under tf.function with unknown sizes, equal PyTorch's.
SCANS = {
    "coupled": (
        (
            "num[b,t,c] = exp(w[c]) * num[b,t-1,c] + exp(k[b,t,c]) * v[b,t,c]",
            "den[b,t,c] = exp(w[c]) * den[b,t-1,c] + exp(k[b,t,c])",
            (
                "y[b,t,c] = (num[b,t-1,c] + exp(u[c] + k[b,t,c]) * v[b,t,c])"
                " / (den[b,t-1,c] + exp(u[c] + k[b,t,c]))"
            ),
        ),
        ("y",),
        {"w": (2,), "k": (1, 4, 2), "v": (1, 4, 2), "u": (2,)},
    ),
    "two_index": (
        (
            (
                "R[b,i,j] = D[b,i,j] + where(i == 0 and j == 0, 0, -log("
                "where(i > 0 and j > 0, exp(-R[b,i-1,j-1]), 0) + where(i > 0, exp(-R[b,i-1,j]), 0)"
                " + where(j > 0, exp(-R[b,i,j-1]), 0)))"
            ),
        ),
        None,
        {"D": (1, 4, 3)},
    ),
}


# the two-index scan at a budget of one byte alone (checkpoints at every level): its
# nested while_loops take a minute to trace for second derivatives
@pytest.mark.parametrize(("name", "budget"), [("coupled", None), ("coupled", 1), ("two_index", 1)])
def test_second_derivatives_of_coupled_and_two_index_scans(name, budget, folder):
    torch = pytest.importorskip("torch")

    formulas, outputs, shapes = SCANS[name]
    op = op_spec(f"SecondScan{name.title().replace('_', '')}", formulas, outputs=outputs)
    modules = {
        t: load_module(module_text(op, "test", t), folder, f"second_scan_{name}_{t}_{budget}")
        for t in ("pytorch", "tensorflow")
    }
    for module in modules.values():
        module.MAX_TEMP_BYTES = module.MAX_TEMP_BYTES if budget is None else budget
    rng = np.random.default_rng(11)
    values = {
        n: rng.standard_normal(s) * (0.3 if n in ("w", "u") else 1) for n, s in shapes.items()
    }
    arrays = [values[n] for n in modules["pytorch"].INPUTS]
    leaves = [torch.tensor(v, requires_grad=True) for v in arrays]
    assert torch.autograd.gradgradcheck(modules["pytorch"].forward, leaves)
    _, want = _torch_second(modules["pytorch"], *arrays)
    for graph in (False, True):
        _, got = _tf_second(modules["tensorflow"], *arrays, graph=graph)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11)

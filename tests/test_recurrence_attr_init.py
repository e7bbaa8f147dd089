"""An attr in a linear recurrence's initial state, `where(t == 0, h0[b] * n, a * h[t-1] +
x)`: PyTorch's and JAX's associative scan wrote `_init_compute(h0, , n=n)` (the initial
step's inputs ended in a comma before the attrs), and generating failed in ruff (found by
a random-formula trial). Forward and gradient against a loop, differentiated by JAX, in
every target, whole and in chunks."""

from __future__ import annotations

import numpy as np
import pytest
from harness import load_module
from target_harness import converters

from symgrad.scan_render import module_text
from symgrad.spec import OpSpec

OP = OpSpec(
    "AttrInitState",
    ("h[b,t] = where(t == 0, h0[b] * n, a[b,t] * h[b,t-1] + x[b,t])",),
    None,
    (("n", "float"),),
    (),
    "test [ops.AttrInitState]",
)


def _truth(h0, a, x, n, grad):
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)

    def loop(h0, a, x):
        states = [h0 * n]
        for t in range(1, a.shape[1]):
            states.append(a[:, t] * states[-1] + x[:, t])
        return jnp.stack(states, 1)

    y, pullback = jax.vjp(loop, *(jnp.asarray(v) for v in (h0, a, x)))
    return np.asarray(y), [np.asarray(g) for g in pullback(jnp.asarray(grad))]


@pytest.mark.parametrize("budget", [None, 64])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_an_attr_in_the_initial_state(target, budget, tmp_path):
    module = load_module(module_text(OP, "test", target), tmp_path, f"attr_init_{target}")
    if budget is not None:
        module.MAX_TEMP_BYTES = budget
    tensor, numpy = converters(target)
    rng = np.random.default_rng(1)
    named = {"h0": rng.standard_normal(2), "a": rng.uniform(-1, 1, (2, 7))}
    named["x"] = rng.standard_normal((2, 7))
    grad = rng.standard_normal((2, 7))
    want_y, want_grads = _truth(named["h0"], named["a"], named["x"], 2.5, grad)
    args = [tensor(named[name]) for name in module.INPUTS]
    np.testing.assert_allclose(numpy(module.forward(*args, n=2.5)), want_y, rtol=1e-10)
    grads = dict(zip(module.INPUTS, module.vjp(*args, tensor(grad), n=2.5), strict=True))
    for name, want in zip(("h0", "a", "x"), want_grads, strict=True):
        np.testing.assert_allclose(numpy(grads[name]), want, rtol=1e-10, atol=1e-12)

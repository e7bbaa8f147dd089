"""The associative scan's products of a span many positions (assoc_scan.py): where they
overflow the dtype but the loop's states do not, the scan must still give the loop's
numbers. A growing recurrence h = a * h + x (a near 1.44) over 256 positions of float32
has products up to 1.44**255 ~ 1e40 > 3.4e38, while a state that starts at zero, or is
tiny, stays in range; 0 * inf was nan there in PyTorch and JAX (TensorFlow's sequential
scan is the control). The gradient's adjoint recurrence runs the same products backward."""

from __future__ import annotations

import numpy as np
import pytest
from frameworks import FRAMEWORKS
from harness import load_module
from test_recurrences import op_spec

from symgrad.scan_render import module_text

LINEAR = op_spec("GrowingRec", "h[b,t,d] = a[b,t,d] * h[b,t-1,d] + x[b,t,d]")
B, T, D = 2, 256, 3


def _loop(a, x, g):
    """The recurrence and its vector-Jacobian product, as written, in float64."""
    h = np.zeros((B, T, D))
    state = np.zeros((B, D))
    for t in range(T):
        state = a[:, t] * state + x[:, t]
        h[:, t] = state
    gh = np.zeros((B, T, D))
    pending = np.zeros((B, D))
    for t in range(T - 1, -1, -1):
        gh[:, t] = g[:, t] + pending
        pending = a[:, t] * gh[:, t]
    previous = np.concatenate([np.zeros((B, 1, D)), h[:, :-1]], 1)
    return h, gh * previous, gh


def _values(seed, first_zeros):
    """Growth a in [1.42, 1.46]; x of 1e-6 (zero over the first positions when asked); the
    incoming gradient 1e-20 on the last positions only, zero before them."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(1.42, 1.46, (B, T, D))
    x = rng.standard_normal((B, T, D)) * 1e-6
    x[:, :first_zeros] = 0
    g = np.zeros((B, T, D))
    g[:, -3:] = rng.standard_normal((B, 3, D)) * 1e-20
    return a, x, g


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("first_zeros", [0, 20])
def test_products_that_overflow_where_the_states_do_not(target, first_zeros, tmp_path):
    """Float32 forward and vjp against the loop in float64: finite everywhere, within
    float32 rounding of a 256-step recurrence. Before, PyTorch's and JAX's forward held 228
    nans of 1536 and their gradients were nan."""
    module = load_module(module_text(LINEAR, "test", target), tmp_path, f"grow_{target}")
    fw = FRAMEWORKS[target]
    a, x, g = _values(3, first_zeros)
    h, grad_a, grad_x = _loop(a, x, g)
    assert np.isfinite(h).all() and np.abs(h).max() > 1e30  # the state is in range, big
    assert np.prod(a, 1).max() > np.finfo(np.float32).max  # and a's product is not
    inputs = {"a": a, "x": x}
    args = [fw.tensor(inputs[n].astype(np.float32)) for n in module.INPUTS]
    got = fw.numpy(module.forward(*args))
    assert np.isfinite(got).all(), np.isnan(got).sum()
    np.testing.assert_allclose(got, h, rtol=2e-4, atol=1e-12)
    found = dict(
        zip(module.INPUTS, module.vjp(*args, fw.tensor(g.astype(np.float32))), strict=True)
    )
    for name, want in (("a", grad_a), ("x", grad_x)):
        mine = fw.numpy(found[name])
        assert np.isfinite(mine).all(), (name, np.isnan(mine).sum())
        np.testing.assert_allclose(mine, want, rtol=2e-4, atol=1e-30, err_msg=name)


@pytest.mark.parametrize("target", ["pytorch", "jax"])
def test_a_training_step_through_the_growing_scan(target, tmp_path):
    """The framework's own gradient of a loss through `forward` (autograd, jax.grad under
    jit) takes the same scan back: finite and equal to the loop's."""
    module = load_module(module_text(LINEAR, "test", target), tmp_path, f"grow_step_{target}")
    a, x, g = _values(4, 20)
    _, grad_a, grad_x = _loop(a, x, g)
    values = {"a": a.astype(np.float32), "x": x.astype(np.float32)}
    if target == "pytorch":
        import torch

        leaves = [torch.tensor(values[n], requires_grad=True) for n in module.INPUTS]
        (module.forward(*leaves) * torch.tensor(g, dtype=torch.float32)).sum().backward()
        found = {n: leaf.grad.numpy() for n, leaf in zip(module.INPUTS, leaves, strict=True)}
    else:
        import jax
        import jax.numpy as jnp

        def loss(*xs):
            return jnp.sum(module.forward(*xs) * jnp.asarray(g, jnp.float32))

        args = [jnp.asarray(values[n]) for n in module.INPUTS]
        grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
        found = {n: np.asarray(v) for n, v in zip(module.INPUTS, grads, strict=True)}
    for name, want in (("a", grad_a), ("x", grad_x)):
        assert np.isfinite(found[name]).all(), name
        np.testing.assert_allclose(found[name], want, rtol=2e-4, atol=1e-30, err_msg=name)


_FLUSHES = pytest.mark.xfail(strict=True, reason="PyTorch's scan flushes a's products below normal")


@pytest.mark.parametrize("target", [pytest.param("pytorch", marks=_FLUSHES), "jax"])
def test_a_state_that_decays_by_more_than_the_float_range_as_written(target, tmp_path):
    """x = 1e30 at the first position and 0 after, a = 0.5: the loop's state at position
    150 is 1e30 / 2**150 ~ 7e-16, while the product 0.5**128 is below the smallest normal
    float32. JAX keeps it; PyTorch's scan flushes it to 0 (denormal arithmetic is many
    times slower on CPU), a known limit: nothing non-finite shows, so no chunk is scanned
    again."""
    module = load_module(module_text(LINEAR, "test", target), tmp_path, f"decay_{target}")
    fw = FRAMEWORKS[target]
    a = np.full((B, T, D), 0.5)
    x = np.zeros((B, T, D))
    x[:, 0] = 1e30
    h, _, _ = _loop(a, x, np.zeros((B, T, D)))
    inputs = {"a": a, "x": x}
    got = fw.numpy(
        module.forward(*[fw.tensor(inputs[n].astype(np.float32)) for n in module.INPUTS])
    )
    np.testing.assert_allclose(got[:, :150], h[:, :150], rtol=1e-5)

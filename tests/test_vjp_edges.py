"""Edges of `vjp` and of a recurrence's gradient (found by an adversarial trial):

- MAX_TEMP_BYTES changed between a forward and its gradient. JAX's associative scan read
  checkpoints past the forward's (a clamped index) and returned a wrong gradient of the
  coefficients, silently (off by 100% at 16 MiB -> 64); PyTorch's failed with an unclear
  shape error. Every scan now refuses it as the sequential scans did.
- `vjp` given None for one output's gradient: every target failed (None values not
  supported, movedim(NoneType), None is not a valid value for jnp.array), where a
  module with several outputs counts None as zeros. So did PyTorch's windowed op with
  two outputs once it ran in chunks ('NoneType' object has no attribute 'narrow')."""

from __future__ import annotations

import numpy as np
import pytest
from harness import generated_once
from target_harness import converters

from symgrad.spec import OpSpec

TARGETS = ["tensorflow", "pytorch", "jax"]
LINEAR = OpSpec("LinRec", ("h[b,t,d] = a[b,t,d] * h[b,t-1,d] + x[b,t,d]",), None, (), (), "test")
TWO_OUTPUTS = OpSpec(
    "ScanTwo",
    ("h[b,t] = a[b,t] * h[b,t-1] + x[b,t]", "y[b,t] = h[b,t] * c[b,t]"),
    None,
    (),
    (),
    "test",
)
WINDOWED = OpSpec(
    "TwoOut",
    ("y[b,i] = max(x[b, i + u], u)", "z[b,i] = sum(x[b, i + u] * x[b, i + u], u)"),
    None,
    (),
    (),
    "test",
    ranges=(("u", "4"),),
)
COUPLED = OpSpec(
    "Coupled",
    ("u[b,t] = a[b,t] * u[b,t-1] + v[b,t-1] * x[b,t]", "v[b,t] = tanh(u[b,t-1]) + x[b,t]"),
    None,
    (),
    (),
    "test",
)


def _gradient_after_budget_change(module, target, a, x, g, before, after):
    """The gradient of sum(g * forward(a, x)) with the forward run at budget `before` and
    its gradient at `after`, through the target's own autodiff."""
    tensor, numpy = converters(target)
    module.MAX_TEMP_BYTES = before
    if target == "tensorflow":
        import tensorflow as tf

        a, x = tf.Variable(a), tf.Variable(x)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(module.forward(a, x) * g)
        module.MAX_TEMP_BYTES = after
        return [numpy(d) for d in tape.gradient(loss, [a, x])]
    if target == "pytorch":
        import torch

        a, x = (torch.tensor(v, requires_grad=True) for v in (a, x))
        loss = (module.forward(a, x) * torch.tensor(g)).sum()
        module.MAX_TEMP_BYTES = after
        return [numpy(d) for d in torch.autograd.grad(loss, [a, x])]
    import jax

    _, pullback = jax.vjp(module.forward, tensor(a), tensor(x))
    module.MAX_TEMP_BYTES = after
    return [numpy(d) for d in pullback(tensor(g))]


@pytest.mark.parametrize("target", TARGETS)
def test_a_budget_changed_before_the_gradient_is_refused(target, tmp_path):
    module = generated_once(f"linrec_{target}", LINEAR, target, tmp_path)
    default = module.MAX_TEMP_BYTES
    rng = np.random.default_rng(0)
    a, x, g = (
        rng.uniform(-1, 1, (2, 37, 3)),
        rng.standard_normal((2, 37, 3)),
        rng.standard_normal((2, 37, 3)),
    )
    try:
        same = _gradient_after_budget_change(module, target, a, x, g, 64, 64)
        whole = _gradient_after_budget_change(module, target, a, x, g, default, default)
        for got, want in zip(same, whole, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
        for before, after in ((default, 64), (64, 4096)):
            with pytest.raises(
                Exception, match="MAX_TEMP_BYTES changed between the forward and its gradient"
            ):
                _gradient_after_budget_change(module, target, a, x, g, before, after)
    finally:
        module.MAX_TEMP_BYTES = default


@pytest.mark.parametrize("budget", [None, 64])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("op", [TWO_OUTPUTS, COUPLED, WINDOWED], ids=lambda op: op.name)
def test_vjp_counts_a_missing_output_gradient_as_zeros(op, target, budget, tmp_path):
    module = generated_once(f"none_grads_{op.name}_{target}", op, target, tmp_path)
    default = module.MAX_TEMP_BYTES
    module.MAX_TEMP_BYTES = default if budget is None else budget
    tensor, numpy = converters(target)
    rng = np.random.default_rng(1)
    shapes = {"a": (2, 11), "x": (2, 11), "c": (2, 11)}  # b = 2, t (or i + u) = 11
    args = [tensor(rng.uniform(-1, 1, shapes[n])) for n in module.INPUTS]
    try:
        sizes = [np.shape(numpy(y)) for y in module.forward(*args)]
        grads = [rng.standard_normal(size) for size in sizes]
        for missing in range(len(module.OUTPUTS)):
            given = [None if k == missing else tensor(g) for k, g in enumerate(grads)]
            zeros = [tensor(np.zeros_like(g) if k == missing else g) for k, g in enumerate(grads)]
            got = module.vjp(*args, *given)
            want = module.vjp(*args, *zeros)
            assert any(np.abs(numpy(w)).max() > 0 for w in want)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(numpy(g), numpy(w), rtol=1e-12, atol=1e-14)
    finally:
        module.MAX_TEMP_BYTES = default

"""Two SGD steps of a generated module's training, through each framework's own autodiff:
PyTorch eagerly (an optimizer with momentum), JAX under jit and grad, TensorFlow with a
tape over the registered gradient. Tests compare the parameters after the steps, tiled
against untiled."""

from __future__ import annotations

import numpy as np


def total(x, lib):
    """The sum of all of x's elements in `lib` (tf, torch or jnp)."""
    import tensorflow as tf

    return tf.reduce_sum(x) if lib is tf else lib.sum(x)


def two_steps(target: str, module, arrays, loss_of, lr: float) -> list[np.ndarray]:
    """The inputs after two SGD steps on `loss_of(module.forward(*inputs), lib)`, started
    from `arrays`."""
    return {"pytorch": _torch, "jax": _jax, "tensorflow": _tensorflow}[target](
        module, arrays, loss_of, lr
    )


def _torch(module, arrays, loss_of, lr):
    import torch

    params = [torch.nn.Parameter(torch.tensor(a)) for a in arrays]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        loss_of(module.forward(*params), torch).backward()
        optimizer.step()
    return [p.detach().numpy() for p in params]


def _jax(module, arrays, loss_of, lr):
    import jax
    import jax.numpy as jnp

    def step(params):
        grads = jax.grad(lambda ps: loss_of(module.forward(*ps), jnp))(params)
        return tuple(p - lr * g for p, g in zip(params, grads, strict=True))

    run = jax.jit(lambda params: step(step(params)))  # traced with the current budget
    return [np.asarray(p) for p in run(tuple(map(jnp.asarray, arrays)))]


def _tensorflow(module, arrays, loss_of, lr):
    import tensorflow as tf

    params = [tf.Variable(a) for a in arrays]
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = loss_of(module.forward(*params), tf)
        for p, g in zip(params, tape.gradient(loss, params), strict=True):
            p.assign_sub(lr * g)
    return [p.numpy() for p in params]

"""The three targets behind one small interface, for tests that run the same checks in
TensorFlow, PyTorch and JAX: tensors in and out, every way a module's gradient is reached
(`gradients`), and a training step (`train_step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf
from harness import Case, FakeOp, make_tensors


@dataclass(frozen=True)
class Target:
    name: str

    def tensor(self, a):
        a = np.asarray(a)
        if self.name == "tensorflow":
            return tf.constant(a)
        if self.name == "pytorch":
            import torch

            return torch.from_numpy(np.array(a))
        import jax.numpy as jnp

        return jnp.asarray(a)

    def numpy(self, t) -> np.ndarray | None:
        if t is None:
            return None
        if self.name == "tensorflow":
            return np.asarray(tf.convert_to_tensor(t))
        if self.name == "pytorch":
            return t.detach().numpy()
        return np.asarray(t)


def _enable_x64():
    import jax

    jax.config.update("jax_enable_x64", True)


FRAMEWORKS = {name: Target(name) for name in ("tensorflow", "pytorch", "jax")}


def _tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def inputs(case: Case, module, fw: Target, seed: int = 0) -> list:
    """Random float64 inputs (int index tensors) of `case`, in the module's order."""
    if fw.name == "jax":
        _enable_x64()
    return [fw.tensor(t.numpy()) for t in make_tensors(case, module.INPUTS, seed)]


def _floats(case: Case, module) -> list[int]:
    return [
        k
        for k, n in enumerate(module.INPUTS)
        if n not in case.index_inputs and n not in case.no_gradient
    ]


def run_everywhere(fw: Target, module, case: Case, seed: int = 0):
    """The outputs ({how: [arrays]}) and the input gradients ({how: [array or None]}) of
    `module` on random inputs, with random output gradients, through every path: forward
    and vjp; in TF the registered gradient and a tape over forward; in PyTorch autograd
    through forward; in JAX jax.vjp through forward, also under jax.jit."""
    args = inputs(case, module, fw, seed)
    attrs = dict(case.attrs)
    outputs = [fw.numpy(o) for o in _tuple(module.forward(*args, **attrs))]
    rng = np.random.default_rng(seed + 1)
    grads = [fw.tensor(rng.standard_normal(o.shape)) for o in outputs]
    floats = _floats(case, module)
    found = {"vjp": [fw.numpy(g) for g in module.vjp(*args, *grads, **attrs)]}
    outs = {"forward": outputs}

    def full(by_position):
        return [by_position.get(k) for k in range(len(args))]

    if fw.name == "tensorflow":
        fake = FakeOp(args, [tf.constant(o) for o in outputs], attrs, module)
        found["registered gradient"] = [fw.numpy(g) for g in module.gradient(fake, *grads)]
        watched = [args[k] for k in floats]
        with tf.GradientTape() as tape:
            tape.watch(watched)
            ys = _tuple(module.forward(*args, **attrs))
        taped = tape.gradient(list(ys), watched, output_gradients=grads)
        found["tape over forward"] = full(
            {k: fw.numpy(g) for k, g in zip(floats, taped, strict=True)}
        )
    elif fw.name == "pytorch":
        import torch

        leaves = [a.clone().requires_grad_(k in floats) for k, a in enumerate(args)]
        ys = _tuple(module.forward(*leaves, **attrs))
        taken = torch.autograd.grad(
            ys, [leaves[k] for k in floats], grads, allow_unused=True, materialize_grads=True
        )
        found["autograd through forward"] = full(
            {k: fw.numpy(g) for k, g in zip(floats, taken, strict=True)}
        )
    else:
        import jax

        def of(*xs):
            a = list(args)
            for k, x in zip(floats, xs, strict=True):
                a[k] = x
            return _tuple(module.forward(*a, **attrs))

        for how, f in (("jax.vjp through forward", of), ("under jax.jit", jax.jit(of))):
            ys, pullback = jax.vjp(f, *(args[k] for k in floats))
            outs[how] = [fw.numpy(y) for y in ys]
            got = pullback(tuple(grads))
            found[how] = full({k: fw.numpy(g) for k, g in zip(floats, got, strict=True)})
    return outs, found


def train_step(fw: Target, module, case: Case, seed: int = 0, rate: float = 0.1) -> dict[str, Any]:
    """One training step through the generated module: forward, the loss
    `Σ ½(y - target)²` over every output, its gradient through the framework's own
    machinery (TF: a tape over tf.Variables; PyTorch: `loss.backward()` on leaves that
    require grad; JAX: `jax.value_and_grad`), an SGD update, and the loss after it.

    Returns {"loss", "grads" (one array per trainable input), "after"}."""
    args = inputs(case, module, fw, seed)
    attrs = dict(case.attrs)
    trainable = _floats(case, module)
    if fw.name == "jax":  # shapes by tracing: eager JAX compiles op by op
        import jax

        found = jax.eval_shape(lambda *xs: _tuple(module.forward(*xs, **attrs)), *args)
        shapes = [o.shape for o in found]
    else:
        shapes = [np.shape(fw.numpy(o)) for o in _tuple(module.forward(*args, **attrs))]
    rng = np.random.default_rng(seed + 2)
    targets = [fw.tensor(rng.standard_normal(s)) for s in shapes]

    if fw.name == "tensorflow":
        variables = {k: tf.Variable(args[k]) for k in trainable}
        call = [variables.get(k, a) for k, a in enumerate(args)]

        def loss_of():
            ys = _tuple(module.forward(*call, **attrs))
            return tf.add_n([0.5 * tf.reduce_sum((y - t) ** 2) for y, t in zip(ys, targets)])

        with tf.GradientTape() as tape:
            loss = loss_of()
        taken = tape.gradient(loss, [variables[k] for k in trainable])
        grads = []
        for k, g in zip(trainable, taken, strict=True):
            if g is None:
                g = tf.zeros_like(variables[k])
            if isinstance(g, tf.IndexedSlices):  # a row gather's sparse gradient
                variables[k].scatter_sub(tf.IndexedSlices(rate * g.values, g.indices))
            else:
                variables[k].assign_sub(rate * g)
            grads.append(fw.numpy(g))
        return {"loss": float(loss), "grads": grads, "after": float(loss_of())}

    if fw.name == "pytorch":
        import torch

        leaves = [a.clone().requires_grad_(k in trainable) for k, a in enumerate(args)]

        def loss_of(xs):
            ys = _tuple(module.forward(*xs, **attrs))
            return sum(0.5 * ((y - t) ** 2).sum() for y, t in zip(ys, targets))

        loss = loss_of(leaves)
        if loss.requires_grad:
            loss.backward()
        grads = []
        with torch.no_grad():
            for k in trainable:
                g = leaves[k].grad
                g = torch.zeros_like(leaves[k]) if g is None else g
                leaves[k] -= rate * g  # an optimizer's in-place update
                grads.append(fw.numpy(g))
            after = loss_of(leaves)
        return {"loss": loss.item(), "grads": grads, "after": after.item()}

    import jax

    def loss_of(*xs):
        a = list(args)
        for k, x in zip(trainable, xs, strict=True):
            a[k] = x
        ys = _tuple(module.forward(*a, **attrs))
        return sum(0.5 * ((y - t) ** 2).sum() for y, t in zip(ys, targets))

    params = [args[k] for k in trainable]
    if not params:
        return {"loss": float(loss_of()), "grads": [], "after": float(loss_of())}
    # Under jax.jit: one XLA compile for the step instead of one per op.
    step = jax.jit(jax.value_and_grad(loss_of, argnums=tuple(range(len(params)))))
    loss, taken = step(*params)
    updated = [p - rate * g for p, g in zip(params, taken, strict=True)]
    return {
        "loss": float(loss),
        "grads": [fw.numpy(g) for g in taken],
        "after": float(step(*updated)[0]),  # the same compiled step, at the new values
    }


def reference_train_step(case: Case, names, seed: int = 0, rate: float = 0.1) -> dict:
    """The same step over the independent reference evaluator, with TF autodiff."""
    from harness import reference

    tensors = make_tensors(case, names, seed)
    trainable = [
        k for k, n in enumerate(names) if n not in case.index_inputs and n not in case.no_gradient
    ]
    shapes = [o.shape.as_list() for o in reference(case, dict(zip(names, tensors)))]
    rng = np.random.default_rng(seed + 2)
    targets = [tf.constant(rng.standard_normal(s)) for s in shapes]

    def loss_of(xs):
        ys = reference(case, dict(zip(names, xs)))
        return tf.add_n([0.5 * tf.reduce_sum((y - t) ** 2) for y, t in zip(ys, targets)])

    watched = [tensors[k] for k in trainable]
    with tf.GradientTape() as tape:
        tape.watch(watched)
        loss = loss_of(tensors)
    taken = tape.gradient(loss, watched)
    grads = [
        np.zeros(w.shape) if g is None else np.asarray(tf.convert_to_tensor(g))
        for w, g in zip(watched, taken)
    ]
    updated = list(tensors)
    for k, g in zip(trainable, grads, strict=True):
        updated[k] = tensors[k] - rate * g
    return {"loss": float(loss), "grads": grads, "after": float(loss_of(updated))}

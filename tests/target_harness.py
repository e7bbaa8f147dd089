"""One numeric check for every target: a module generated for PyTorch or JAX against the
independent TF reference of the formula (`symgrad.reference`) and TF autodiff on it, and
against the framework's own autodiff through the generated forward ops.

A target's test supplies a `Framework` adapter (tensors in and out, its autodiff) and runs
`check_target` over the shared corpora (`test_numeric.CORPUS`, `test_indexing.KNOWN`), so
every target is held to the same numbers as the TensorFlow one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
from harness import Case, check, generate, make_tensors, op_spec, reference

from symgrad.model import build


@dataclass(frozen=True)
class Framework:
    """What `check_target` needs of a framework."""

    target: str  # the symgrad target name
    tensor: Callable[[np.ndarray], Any]  # a NumPy array as the framework's tensor
    numpy: Callable[[Any], np.ndarray]  # and back
    # autodiff(f, inputs, wrt, grads): the framework's own vector-Jacobian product of
    # f(*inputs) (a tuple of outputs) with `grads`, for the inputs at positions `wrt`.
    autodiff: Callable[..., list]


def generate_for(case: Case, target: str, folder: Path, prefix: str = "Target", budget=None):
    """The module of `case` for `target`, imported under a unique name, its
    MAX_TEMP_BYTES set to `budget` (None: the default)."""
    module = generate(case, folder, prefix, target)
    if budget is not None:
        module.MAX_TEMP_BYTES = budget
    return module


def _expected(case: Case, names, tensors, grads):
    """TF reference outputs and TF autodiff gradients (None where no gradient flows)."""
    floats = [t for n, t in zip(names, tensors, strict=True) if n not in case.index_inputs]
    with tf.GradientTape() as tape:
        tape.watch(floats)
        outs = reference(case, dict(zip(names, tensors, strict=True)))
    tf_grads = [tf.constant(g) for g in grads]
    want = tape.gradient(outs, tensors, output_gradients=tf_grads)
    return [o.numpy() for o in outs], want


def check_target(case: Case, module, fw: Framework, seed: int = 0) -> None:
    """forward, vjp, autodiff through `forward` (the generated backward) and through the
    generated ops themselves (`_compute`), against the TF reference, in float64."""
    program = build(op_spec(case, module.OP_NAME))
    names = program.inputs
    tensors = make_tensors(case, names, seed)
    rng = np.random.default_rng(seed + 1)
    outputs = reference(case, dict(zip(names, tensors, strict=True)))
    grads = [rng.standard_normal(o.shape.as_list()) for o in outputs]
    want_y, want_g = _expected(case, names, tensors, grads)
    args = [fw.tensor(t.numpy()) for t in tensors]
    attrs = dict(case.attrs)

    got = module.forward(*args, **attrs)
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, want_y, strict=True):
        np.testing.assert_allclose(fw.numpy(g), w, rtol=case.rtol, atol=1e-9, err_msg="forward")

    differentiable = [
        k for k, n in enumerate(names) if n not in case.index_inputs and n not in case.no_gradient
    ]

    def compare(got_grads, how: str) -> None:
        for k, name in enumerate(names):
            g = got_grads[k]
            if k not in differentiable:
                assert g is None, f"{how}: {name} should get None"
                continue
            w = want_g[k]
            w = np.zeros(tensors[k].shape) if w is None else tf.convert_to_tensor(w).numpy()
            np.testing.assert_allclose(
                fw.numpy(g), w, rtol=case.rtol, atol=1e-9, err_msg=f"{how}: gradient of {name}"
            )

    fw_grads = [fw.tensor(g) for g in grads]
    compare(list(module.vjp(*args, *fw_grads, **attrs)), "vjp")

    def through(f):
        found = fw.autodiff(f, args, differentiable, fw_grads)
        full = [None] * len(names)
        for k, g in zip(differentiable, found, strict=True):
            full[k] = g
        return full

    def forward(*xs):
        out = module.forward(*xs, **attrs)
        return out if isinstance(out, tuple) else (out,)

    compare(through(forward), "autodiff through forward (the generated backward)")

    def ops_only(*xs):
        return tuple(module._compute(*xs, **attrs)[0])

    compare(through(ops_only), "the framework's own autodiff of the generated forward ops")


def _torch_autodiff(f, inputs, wrt, grads):
    import torch

    args, leaves = list(inputs), []
    for k in wrt:
        leaf = args[k].detach().clone().requires_grad_(True)
        leaves.append(leaf)
        args[k] = leaf
    return list(torch.autograd.grad(f(*args), leaves, grads, allow_unused=True))


def _jax_autodiff(f, inputs, wrt, grads):
    import jax

    def of_wrt(*xs):
        args = list(inputs)
        for k, x in zip(wrt, xs, strict=True):
            args[k] = x
        return f(*args)

    _, pullback = jax.vjp(of_wrt, *(inputs[k] for k in wrt))
    return list(pullback(tuple(grads)))


def frameworks() -> dict[str, Framework]:
    """PyTorch's and JAX's adapters (float64 JAX), for tests that run both."""
    import jax
    import jax.numpy as jnp
    import torch

    jax.config.update("jax_enable_x64", True)
    return {
        "pytorch": Framework(
            "pytorch",
            tensor=torch.from_numpy,
            numpy=lambda t: t.detach().numpy(),
            autodiff=_torch_autodiff,
        ),
        "jax": Framework("jax", tensor=jnp.asarray, numpy=np.asarray, autodiff=_jax_autodiff),
    }


def converters(target: str) -> tuple[Callable, Callable]:
    """(NumPy array -> the target's tensor, and back) for "tensorflow", "pytorch", "jax"."""
    if target == "tensorflow":
        return tf.constant, lambda t: t.numpy()
    import pytest

    pytest.importorskip("torch" if target == "pytorch" else "jax")
    fw = frameworks()[target]
    return fw.tensor, fw.numpy


def check_graphs_equal_eager(module, args: list, attrs: dict | None = None) -> None:
    """A TF module's forward and gradients of sum(sin(y)) under tf.function with every
    size unknown while tracing, under XLA, and under XLA traced with every size unknown,
    equal the module run eagerly (float64; `attrs`: the op's attrs)."""
    attrs = attrs or {}

    def step(*a):
        with tf.GradientTape() as tape:
            tape.watch(list(a))
            y = module.forward(*a, **attrs)
            loss = tf.reduce_sum(tf.sin(y))
        return y, tape.gradient(loss, list(a))

    want = step(*args)
    specs = [tf.TensorSpec([None] * len(a.shape), a.dtype) for a in args]
    for compiled in (
        tf.function(step, input_signature=specs),
        tf.function(step, jit_compile=True),
        tf.function(step, input_signature=specs, jit_compile=True),
    ):
        y, grads = compiled(*args)
        np.testing.assert_allclose(y.numpy(), want[0].numpy(), rtol=1e-12, atol=1e-12)
        for g, e in zip(grads, want[1], strict=True):
            if e is None:  # an index input
                assert g is None
                continue
            np.testing.assert_allclose(
                tf.convert_to_tensor(g).numpy(),
                tf.convert_to_tensor(e).numpy(),
                rtol=1e-12,
                atol=1e-12,
            )


def check_in_target(case: Case, target: str, folder: Path) -> None:
    """`check_target` of `case`'s module for `target` ("pytorch" or "jax")."""
    import pytest

    pytest.importorskip("torch" if target == "pytorch" else "jax")
    check_target(case, generate_for(case, target, folder), frameworks()[target])


def check_in_every_target(case: Case, target: str, folder: Path, prefix: str, budget=None):
    """Generate `case` for `target`, set its MAX_TEMP_BYTES to `budget` (None: the
    default), and check it against the reference: `check` in TensorFlow (with finite
    differences), `check_target` in PyTorch and JAX."""
    module = generate_for(case, target, folder, prefix, budget)
    if target == "tensorflow":
        check(case, module)
    else:
        check_target(case, module, frameworks()[target])

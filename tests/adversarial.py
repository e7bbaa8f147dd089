"""The check the adversarial real-op files share: a module in chunks (a budget of one
byte, as many chunks as the plan allows) equals the untiled module in float64 on every
path, and the untiled forward equals the independent reference evaluator.
"""

from __future__ import annotations

import numpy as np
from frameworks import FRAMEWORKS, inputs, run_everywhere, train_step
from harness import Case, generate, make_tensors, reference

TINY = 1  # every temporary is over the budget: as many chunks as the plan allows


def as_numpy(t):
    """A tensor of any target as a NumPy array (a torch tensor detached); None stays None."""
    return None if t is None else np.asarray(t.detach() if hasattr(t, "detach") else t)


def same(got, want, how):
    """Equal within float64 rounding, None where the other is None."""
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None, how
        else:
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=how)


def chunks_equal_the_untiled_module(case: Case, target: str, folder, prefix: str) -> None:
    """forward, vjp, the registered gradient and a tape (TF), autograd (PyTorch), jax.vjp
    and jit (JAX), and a training step through the framework's own autodiff: at a budget
    of 1 byte (several chunks), equal to the untiled module in float64; the untiled
    forward equals the reference evaluator."""
    fw = FRAMEWORKS[target]
    module = generate(case, folder, prefix=prefix, target=target)
    module.MAX_TEMP_BYTES = 2**40
    want = run_everywhere(fw, module, case), train_step(fw, module, case)
    named = dict(zip(module.INPUTS, make_tensors(case, module.INPUTS), strict=True))
    for got, expected in zip(want[0][0]["forward"], reference(case, named), strict=True):
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-10, atol=1e-12)
    module.MAX_TEMP_BYTES = TINY
    n, c = module._tile_plan(*inputs(case, module, fw), **case.attrs)[:2]
    assert c < n  # several chunks (TF's nested plan may take several whole positions)
    (outputs, grads), step = run_everywhere(fw, module, case), train_step(fw, module, case)
    for how, got in outputs.items():
        same(got, want[0][0][how], how)
    for how, got in grads.items():
        same(got, want[0][1][how], how)
    same(step["grads"], want[1]["grads"], "training step")
    np.testing.assert_allclose([step["loss"], step["after"]], [want[1]["loss"], want[1]["after"]])


def unknown_sizes_equal_eager(module, args, attrs, seed: int, autograph: bool = True) -> None:
    """TF: forward and vjp under tf.function with every size unknown, at a 1-byte budget
    (chunk counts known only when the graph runs), equal to the untiled module run
    eagerly in float64 (a cotangent drawn with `seed`). `autograph=False` traces the
    generated code as it is written (no Python branch on a tensor may remain): most of
    a trace's time is AutoGraph rewriting the module's functions."""
    import tensorflow as tf

    module.MAX_TEMP_BYTES = 2**40
    y = module.forward(*args, **attrs)
    cotangent = tf.constant(np.random.default_rng(seed).standard_normal(y.shape))
    want = [y, *module.vjp(*args, cotangent, **attrs)]
    module.MAX_TEMP_BYTES = TINY
    spec = [tf.TensorSpec([None] * t.shape.rank, t.dtype) for t in (*args, cotangent)]

    def run(*xs):
        return [module.forward(*xs[:-1], **attrs), *module.vjp(*xs, **attrs)]

    got = tf.function(run, input_signature=spec, autograph=autograph)(*args, cotangent)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-12, atol=1e-12)


def torch_step_peaks(module, xs, attrs, budget):
    """(untiled, tiled, bound): the peak bytes of a PyTorch training step (forward, the sum
    of sin of the output, the gradient of every input that requires one) untiled and at
    `budget`, and the bound 4x the bytes of the inputs and outputs plus the budget."""
    import torch
    from peaks import torch_peak

    def step():
        out = module.forward(*xs, **attrs)
        torch.autograd.grad(torch.sin(out).sum(), [x for x in xs if x.requires_grad])

    bound = 4 * (sum(x.nbytes for x in xs) + module.forward(*xs, **attrs).nbytes) + budget
    module.MAX_TEMP_BYTES = 2**40
    untiled = torch_peak(step)
    module.MAX_TEMP_BYTES = budget
    assert module._tile_plan(*xs, **attrs) is not None
    return untiled, torch_peak(step), bound

"""MAX_TEMP_BYTES set at run time to a float: `module.MAX_TEMP_BYTES = 1e5` raised
TypeError ('float' object cannot be interpreted as an integer) in every tiled, banded and
scanned module of TensorFlow and PyTorch, where chunk sizes divide the budget. A whole
float now counts as its int and inf as no limit, in every target and every kind of plan;
a budget that is no number of bytes (nan, negative, a string, a bool) is refused by name."""

from __future__ import annotations

import re

import numpy as np
import pytest
from harness import generated_once
from target_harness import converters

from symgrad.spec import OpSpec

OPS = {
    # a window read from a second tensor: tiled over i, or a band kernel
    "correlation": "y[b,i,d] = sum(x[b,i,c] * z[b,i+d-2,c], c)",
    # a pairwise min: tiled over the first point set
    "pairwise": "y[b,n] = min(sum((p[b,n,c] - q[b,m,c])**2, c), m)",
    # a nonlinear recurrence: a sequential scan with checkpoints
    "scan": "h[b,t] = tanh(a[b,t] * h[b,t-1] + x[b,t])",
    # a linear recurrence: an associative scan in chunks
    "linear": "h[b,t] = a[b,t] * h[b,t-1] + x[b,t]",
}
SHAPES = {  # a different size for every index
    "correlation": {"x": (2, 7, 3), "z": (2, 7, 3)},
    "pairwise": {"p": (2, 6, 3), "q": (2, 11, 3)},
    "scan": {"a": (3, 13), "x": (3, 13)},
    "linear": {"a": (3, 13), "x": (3, 13)},
}


def _module(name, target, folder):
    op = OpSpec(name.title(), (OPS[name],), None, (), (), f"test [ops.{name}]")
    return generated_once(f"budget_{name}_{target}", op, target, folder)


def _vjp(name, module, target, seed=0):
    tensor, numpy = converters(target)
    rng = np.random.default_rng(seed)
    shapes = SHAPES[name]
    args = [tensor(rng.uniform(-1, 1, shapes[n])) for n in module.INPUTS]
    y = module.forward(*args)
    grad = tensor(rng.standard_normal(numpy(y).shape))
    return [numpy(g) for g in module.vjp(*args, grad)]


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_a_float_budget_counts_as_its_int(name, target, tmp_path):
    module = _module(name, target, tmp_path)
    default = module.MAX_TEMP_BYTES
    try:
        module.MAX_TEMP_BYTES = 64
        want_tiny = _vjp(name, module, target)
        module.MAX_TEMP_BYTES = default
        want_whole = _vjp(name, module, target)
        for budget, want in (
            (64.0, want_tiny),
            (np.float32(64.9), want_tiny),
            (1e12, want_whole),
            (float("inf"), want_whole),
        ):
            module.MAX_TEMP_BYTES = budget
            for got, expected in zip(_vjp(name, module, target), want, strict=True):
                np.testing.assert_allclose(
                    got, expected, rtol=1e-12, atol=1e-14, err_msg=repr(budget)
                )
    finally:
        module.MAX_TEMP_BYTES = default


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("budget", [float("nan"), -1, float("-inf"), "1e8", True])
def test_a_budget_that_is_no_number_of_bytes_is_refused_by_name(budget, target, tmp_path):
    for name in ("correlation", "scan"):
        module = _module(name, target, tmp_path)
        default = module.MAX_TEMP_BYTES
        module.MAX_TEMP_BYTES = budget
        try:
            with pytest.raises(
                ValueError,
                match=rf"^{name.title()}: MAX_TEMP_BYTES must be a number of bytes, at least 0; got {re.escape(repr(budget))}",
            ):
                _vjp(name, module, target)
        finally:
            module.MAX_TEMP_BYTES = default

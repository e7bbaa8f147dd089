"""Composite reads `x[b, (h, i)]` of plain indices are a reshape of x, where they used to be
a gather of positions h*N + i with a mask: also where the members' sizes come from other
inputs, so that H*N may differ from x's axis. There the axis is first cut to its first H*N
positions, or padded with zeros to them (`_fit`), exactly the masked gather: reads past
the axis are zero, and the gradient of the positions no read reaches is zero. Checked in
float64 against NumPy in every target, eager and (TF) with unknown dims while tracing."""

from __future__ import annotations

import numpy as np
import pytest
from frameworks import FRAMEWORKS, _enable_x64
from harness import load_module
from test_recurrences import op_spec

from symgrad.pipeline import module_text

TARGETS = ("tensorflow", "pytorch", "jax")
FORMULA = "y[b,h,i] = x[b,(h,i)] * a[h,i]"
_MODULES: dict = {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("composite_reshape")


def module(target, folder):
    if target == "jax":
        _enable_x64()
    if target not in _MODULES:
        text = module_text(op_spec("CompositeScale", FORMULA, inputs=("x", "a")), "test", target)
        assert "_fit(" in text and "_gather(" not in text  # a reshape, no gather
        _MODULES[target] = load_module(text, folder, f"composite_reshape_{target}")
    return _MODULES[target]


def reference(x, a, g):
    """y and the vjp of the formula, reads past x's axis zero."""
    B, C = x.shape
    H, N = a.shape
    padded = np.zeros((B, max(C, H * N)))
    padded[:, :C] = x
    read = padded[:, : H * N].reshape(B, H, N)
    y = read * a
    grad = np.zeros_like(padded)
    grad[:, : H * N] = (g * a).reshape(B, H * N)
    return y, grad[:, :C], np.sum(g * read, axis=0)


@pytest.mark.parametrize("C", [12, 10, 15], ids=["exact", "padded", "cut"])
@pytest.mark.parametrize("target", TARGETS)
def test_a_composite_read_of_another_size_reads_zeros_past_the_axis(C, target, folder):
    fw = FRAMEWORKS[target]
    rng = np.random.default_rng(C)
    x, a = rng.standard_normal((2, C)), rng.standard_normal((3, 4))
    g = rng.standard_normal((2, 3, 4))
    want_y, want_x, want_a = reference(x, a, g)
    m = module(target, folder)
    np.testing.assert_allclose(fw.numpy(m.forward(fw.tensor(x), fw.tensor(a))), want_y, rtol=1e-14)
    found = m.vjp(fw.tensor(x), fw.tensor(a), fw.tensor(g))
    np.testing.assert_allclose(fw.numpy(found[0]), want_x, rtol=1e-14)
    np.testing.assert_allclose(fw.numpy(found[1]), want_a, rtol=1e-14)


@pytest.mark.parametrize("C", [12, 10, 15], ids=["exact", "padded", "cut"])
def test_a_composite_read_with_unknown_dims_under_tf_function(C, folder):
    import tensorflow as tf

    m = module("tensorflow", folder)
    rng = np.random.default_rng(C + 1)
    x, a = rng.standard_normal((2, C)), rng.standard_normal((3, 4))
    g = rng.standard_normal((2, 3, 4))
    spec = [tf.TensorSpec([None, None], tf.float64)] * 2
    vjp = tf.function(m.vjp, input_signature=[*spec, tf.TensorSpec([None] * 3, tf.float64)])
    want_y, want_x, want_a = reference(x, a, g)
    found = vjp(tf.constant(x), tf.constant(a), tf.constant(g))
    np.testing.assert_allclose(found[0].numpy(), want_x, rtol=1e-14)
    np.testing.assert_allclose(found[1].numpy(), want_a, rtol=1e-14)
    forward = tf.function(m.forward, input_signature=spec)
    np.testing.assert_allclose(forward(tf.constant(x), tf.constant(a)).numpy(), want_y, rtol=1e-14)

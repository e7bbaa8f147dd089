"""Real C++ ops with a window and a gather (tests/custom_op/window_ops.cc, plain loops, no
gradient in C++) get their gradients from this repo's generated modules: a tape through the
compiled op runs `generated.strided_conv1d.gradient` / `generated.embedding_lookup.gradient`
and must match TF autodiff over an independent reference, eagerly and in a tf.function."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from test_generated_ops import strided_conv1d

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RNG = np.random.default_rng(5)


@pytest.fixture(scope="module")
def ops(op_library_path):
    library = op_library_path("window_ops")
    importlib.import_module("generated.strided_conv1d")  # registers the gradients
    importlib.import_module("generated.embedding_lookup")
    return tf.load_op_library(str(library))


def rand(*shape):
    return tf.constant(RNG.uniform(-1, 1, shape), tf.float64)


@pytest.mark.parametrize("attrs", [{"s": 2, "d": 2, "p": 1}, {"s": 1, "d": 1, "p": 0}])
@pytest.mark.parametrize("graph", [False, True])
def test_a_compiled_strided_dilated_convolution_gets_the_generated_gradient(ops, attrs, graph):
    x, w = rand(2, 13, 3), rand(3, 3, 4)
    y = strided_conv1d(x, w, **attrs)
    grad = rand(*y.shape)

    def through_the_op(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            out = ops.strided_conv1d(x, w, **attrs)
        return out, tape.gradient(out, [x, w], output_gradients=grad)

    run = tf.function(through_the_op) if graph else through_the_op
    out, got = run(x, w)
    np.testing.assert_allclose(out.numpy(), y.numpy(), rtol=1e-12, atol=1e-12)
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        reference = strided_conv1d(x, w, **attrs)
    want = tape.gradient(reference, [x, w], output_gradients=grad)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64])
def test_a_compiled_embedding_lookup_gets_the_generated_gradient(ops, index_dtype):
    w = rand(7, 3)
    ids = tf.constant([[0, 3, 3, 9], [6, -1, 0, 2]], index_dtype)  # 9 and -1: outside w
    grad = rand(2, 4, 3)
    with tf.GradientTape() as tape:
        tape.watch(w)
        out = ops.embedding_lookup(w, ids)
    got = tf.convert_to_tensor(tape.gradient(out, w, output_gradients=grad))
    inside = (ids >= 0) & (ids < 7)
    safe = tf.where(inside, ids, tf.zeros_like(ids))
    want = tf.math.unsorted_segment_sum(
        tf.where(inside[..., None], grad, tf.zeros_like(grad)), safe, 7
    )
    np.testing.assert_allclose(out.numpy()[0, 3], 0.0)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)

"""Reads along one axis of a rank-10 tensor in TensorFlow, whose Pad, Slice, StridedSlice,
ReverseV2 and slice update raise 'Unhandled input dimensions' past rank 8.

A padded window and a flipped read of a rank-10 input run (their reads are gathers along
the one axis). A split read of an axis it does not size (padded, then cut) and a summed
window in chunks (cuts and slice updates along the chunked axis) run on the tensor
reshaped to [axes before, axis, axes after]. Each equals NumPy."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from harness import Case, generate

SHAPE = (2, 3, 1, 2, 1, 2, 1, 1, 3, 5)  # a different size on most axes; 360 elements
L = "a,b,c,d,e,f,g,h,i"


def _window(x, offsets):
    """y[..., j] = sum over o of x[..., j + o], zero outside x; and its transpose."""
    n = x.shape[-1]

    def forward(x):
        y = np.zeros_like(x)
        for j in range(n):
            for o in offsets:
                if 0 <= j + o < n:
                    y[..., j] += x[..., j + o]
        return y

    def backward(g):
        gx = np.zeros_like(g)
        for j in range(n):
            for o in offsets:
                if 0 <= j + o < n:
                    gx[..., j + o] += g[..., j]
        return gx

    return forward(x), backward


CASES = {
    "padded_window": (
        Case(f"y[{L},j] = X[{L},j-1] + X[{L},j+1]", {"X": SHAPE}, ranges={"j": "X.shape[9]"}),
        lambda x: _window(x, (-1, 1)),
    ),
    "flipped_read": (
        Case(f"y[{L},j] = X[{L},4-j]", {"X": SHAPE}, ranges={"j": "X.shape[9]"}),
        lambda x: (np.flip(x, -1), lambda g: np.flip(g, -1)),
    ),
    "split_read": (  # 6 positions over an axis of 5: padded with a zero (Pad, Slice)
        Case(f"y[{L},j,k] = X[{L},(j,k)]", {"X": SHAPE}, ranges={"j": "2", "k": "3"}),
        lambda x: (
            np.pad(x, [(0, 0)] * 9 + [(0, 1)]).reshape(SHAPE[:9] + (2, 3)),
            lambda g: g.reshape(SHAPE[:9] + (6,))[..., :5],
        ),
    ),
    "summed_window": (
        Case(
            f"y[{L},j] = sum(X[{L},j+k-1], k)",
            {"X": SHAPE},
            ranges={"j": "X.shape[9]", "k": "3"},
        ),
        lambda x: _window(x, (-1, 0, 1)),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rank_10_reads_along_one_axis_equal_numpy(name, tmp_path):
    """Forward and vjp of a rank-10 read, float64, untiled and at a 1-byte budget (the
    split read raised in Pad, the summed window in chunks in TensorStridedSliceUpdate,
    before they ran over merged axes): equal to NumPy."""
    case, numpy_op = CASES[name]
    module = generate(case, tmp_path, prefix="Rank10")
    rng = np.random.default_rng(3)
    x = rng.standard_normal(SHAPE)
    want, backward = numpy_op(x)
    cotangent = rng.standard_normal(want.shape)
    for budget in (2**40, 1):
        module.MAX_TEMP_BYTES = budget
        y = module.forward(tf.constant(x))
        (gx,) = module.vjp(tf.constant(x), tf.constant(cotangent))
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(gx.numpy(), backward(cotangent), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("how", ["unknown_dims", "jit_compile"])
@pytest.mark.parametrize("name", ["split_read", "summed_window"])
def test_rank_10_merged_axes_in_graphs(name, how, tmp_path):
    """The merged-axes cuts, slice updates and fits at a 1-byte budget inside a
    tf.function whose input dims are all unknown, and under XLA: equal to NumPy."""
    case, numpy_op = CASES[name]
    module = generate(case, tmp_path, prefix="Rank10Graph")
    module.MAX_TEMP_BYTES = 1
    rng = np.random.default_rng(4)
    x = rng.standard_normal(SHAPE)
    want, backward = numpy_op(x)
    cotangent = rng.standard_normal(want.shape)

    def both(x, g):
        return module.forward(x), module.vjp(x, g)[0]

    if how == "jit_compile":
        run = tf.function(both, jit_compile=True)
    else:
        specs = [tf.TensorSpec([None] * len(s), tf.float64) for s in (SHAPE, want.shape)]
        run = tf.function(both, input_signature=specs)
    y, gx = run(tf.constant(x), tf.constant(cotangent))
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gx.numpy(), backward(cotangent), rtol=1e-12, atol=1e-12)


def test_rank_10_log_sum_exp(tmp_path):
    """log Σ_j exp(X[.., j]) over ten axes equals NumPy, forward and vjp. Its peak's
    where(is_finite(peak), peak, 0) was a SelectV2 past rank 8, which raises 'Broadcast
    ... is not supported yet' even between one shape: now selected flat."""
    case = Case(f"y[{L}] = log(sum(exp(X[{L},j]), j))", {"X": SHAPE})
    module = generate(case, tmp_path, prefix="Rank10Lse")
    x = np.random.default_rng(5).standard_normal(SHAPE)
    got = module.forward(tf.constant(x)).numpy()
    want = np.log(np.exp(x).sum(-1))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    cotangent = np.random.default_rng(6).standard_normal(got.shape)
    softmax = np.exp(x - np.log(np.exp(x).sum(-1, keepdims=True)))
    (grad,) = module.vjp(tf.constant(x), tf.constant(cotangent))
    np.testing.assert_allclose(grad.numpy(), cotangent[..., None] * softmax, rtol=1e-12, atol=1e-12)
    tensor = tf.constant(x)
    with tf.GradientTape() as tape:  # the registered gradient
        tape.watch(tensor)
        y = module.forward(tensor)
    grad = tape.gradient(y, tensor, output_gradients=tf.constant(cotangent))
    np.testing.assert_allclose(grad.numpy(), cotangent[..., None] * softmax, rtol=1e-12, atol=1e-12)
    row = (0, 1, 0, 1, 0, 1, 0, 0, 2)
    masked = x.copy()
    masked[row] = -np.inf  # a row with every entry masked: log 0, the other rows as before
    got = module.forward(tf.constant(masked)).numpy()
    assert got[row] == -np.inf
    others = np.ones(got.shape, bool)
    others[row] = False
    np.testing.assert_allclose(got[others], want[others], rtol=1e-12, atol=1e-12)

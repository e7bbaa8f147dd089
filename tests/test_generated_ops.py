"""The repo's own generated modules (generated/, from symgrad.toml) against hand-written TF.

Each reference below is ordinary TensorFlow (tf.linalg.matmul, tf.nn.softmax,
tf.reduce_logsumexp, LinearOperatorKronecker, ...), so a tape over it runs TensorFlow's
own registered gradients: the generated gradient must agree with them, and with finite
differences.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from harness import FakeOp

RNG = np.random.default_rng(7)


def rand(*shape, low=-1.0, high=1.0):
    return tf.constant(RNG.uniform(low, high, shape), dtype=tf.float64)


def kron(A, B):
    ops = [tf.linalg.LinearOperatorFullMatrix(A), tf.linalg.LinearOperatorFullMatrix(B)]
    return tf.linalg.LinearOperatorKronecker(ops).to_dense()


def layer_norm(x, eps):
    mean, variance = tf.nn.moments(x, axes=[1], keepdims=True)
    return (x - mean) / tf.sqrt(variance + eps)


def strided_conv1d(x, w, s, d, p):
    """Direct loops over the taps: x read at s*i + d*k - p, zero outside."""
    length, taps = x.shape[1], w.shape[0]
    out = (length - 1 + p - d * (taps - 1)) // s + 1
    columns = []
    for i in range(out):
        total = 0
        for k in range(taps):
            at = s * i + d * k - p
            if 0 <= at < length:
                total += tf.linalg.matmul(x[:, at, :], w[k])
        columns.append(total)
    return tf.stack(columns, axis=1)


def correlation(f1, f2, r):
    """FlowNet's cost volume by padding and stacking shifted copies of f2."""
    padded = tf.pad(f2, [[0, 0], [r, r], [r, r], [0, 0]])
    height, width = f1.shape[1], f1.shape[2]
    rows = []
    for u in range(2 * r + 1):
        row = []
        for v in range(2 * r + 1):
            shifted = padded[:, u : u + height, v : v + width, :]
            row.append(tf.reduce_mean(f1 * shifted, axis=-1))
        rows.append(tf.stack(row, axis=-1))
    return tf.stack(rows, axis=-2)


def causal_softmax(A):
    n = A.shape[-1]
    keep = tf.linalg.band_part(tf.ones((n, n), tf.bool), -1, 0)
    return tf.nn.softmax(tf.where(keep, A, tf.constant(-np.inf, A.dtype)), axis=-1)


def chamfer(x, z):
    return tf.reduce_min(tf.reduce_sum(tf.square(x[:, :, None] - z[:, None]), -1), -1)


IDS = tf.constant([[0, 3, 3, 5], [6, 1, 0, 2]], tf.int32)


def wkv_kernel(w, u, k, v):
    """RWKV-4's kernel_forward (RWKV-v4/cuda/wkv_cuda.cu) loop for loop, its threads (one
    per b, c) as the lanes of [B, C] tensors: running sums p, q scaled by exp(-o)."""
    p = tf.zeros_like(k[:, 0])
    q = tf.zeros_like(k[:, 0])
    o = tf.fill(tf.shape(k[:, 0]), tf.constant(-1e38, k.dtype))
    ys = []
    for i in range(k.shape[1]):
        kk, vv = k[:, i], v[:, i]
        no = tf.maximum(o, u + kk)
        a, e = tf.exp(o - no), tf.exp(u + kk - no)
        ys.append((a * p + e * vv) / (a * q + e))
        no = tf.maximum(w + o, kk)
        a, e = tf.exp(w + o - no), tf.exp(kk - no)
        p, q, o = a * p + e * vv, a * q + e, no
    return tf.stack(ys, axis=1)


def lightconv(w, x):
    """fairseq's lightconv forward, one head per channel, padding_l = (K - 1) // 2:
    y[b,c,t] = sum_k w[c,k] * x[b, c, t + k - padding_l], zero outside."""
    taps = w.shape[1]
    pad = (taps - 1) // 2
    padded = tf.pad(x, [[0, 0], [0, 0], [pad, taps]])
    steps = x.shape[2]
    return tf.add_n([w[None, :, k, None] * padded[:, :, k : k + steps] for k in range(taps)])


SEGMENTS = tf.constant([2, 0, 1, 2, 0, 1, 1], tf.int32)  # every segment non-empty


def separated(*shape):
    """Values at least 0.01 apart: finite differences never cross a tie of a max."""
    values = RNG.permutation(int(np.prod(shape))).reshape(shape) * 0.01 - 0.5
    return tf.constant(values, dtype=tf.float64)


# module -> (inputs, attrs, reference returning a tuple of outputs)
OPS = {
    "rwkv_wkv": (
        (-tf.exp(rand(3)), rand(3), rand(2, 5, 3, low=-2, high=2), rand(2, 5, 3)),
        {},
        lambda w, u, k, v: (wkv_kernel(w, u, k, v),),
    ),
    "rows_segment_max": (
        (SEGMENTS, separated(7, 2)),
        {"num_segments": 3},
        lambda seg, x, num_segments: (tf.math.unsorted_segment_max(x, seg, num_segments),),
    ),
    "lightconv_same": (
        (rand(3, 5), rand(2, 3, 7)),
        {},
        lambda w, x: (lightconv(w, x),),
    ),
    "strided_conv1d": (
        (rand(2, 13, 3), rand(3, 3, 4)),
        {"s": 2, "d": 2, "p": 1},
        lambda x, w, s, d, p: (strided_conv1d(x, w, s, d, p),),
    ),
    "conv2d_same": (
        (rand(2, 5, 6, 3), rand(3, 3, 3, 4)),
        {},
        lambda x, w: (tf.nn.conv2d(x, w, 1, "SAME"),),
    ),
    "correlation": (
        (rand(2, 4, 5, 3), rand(2, 4, 5, 3)),
        {"r": 1},
        lambda f1, f2, r: (correlation(f1, f2, r),),
    ),
    "embedding_lookup": ((rand(7, 3), IDS), {}, lambda W, ids: (tf.gather(W, ids),)),
    "max_pool2x2": (
        (separated(2, 6, 4, 3),),
        {},
        lambda x: (tf.nn.max_pool2d(x, 2, 2, "VALID"),),
    ),
    "causal_softmax": ((rand(2, 5, 5),), {}, lambda A: (causal_softmax(A),)),
    "prefix_sum": ((rand(3, 7),), {}, lambda x: (tf.cumsum(x, axis=1),)),
    "chamfer_distance": (
        (separated(2, 5, 3), separated(2, 4, 3)),
        {},
        lambda x, z: (chamfer(x, z),),
    ),
    "batched_mat_mul": ((rand(2, 3, 4), rand(2, 4, 5)), {}, lambda A, B: (tf.linalg.matmul(A, B),)),
    "batch_kron": ((rand(2, 2, 2), rand(2, 3, 3)), {}, lambda A, B: (kron(A, B),)),
    "sin_diag_outer": (
        (rand(2, 3, 3), rand(2, 4, 4)),
        {},
        lambda A, B: (
            tf.sin(tf.linalg.diag_part(A))[:, :, None] * tf.linalg.diag_part(B)[:, None, :],
        ),
    ),
    "scaled_add": (
        (rand(2, 3, 4), rand(2, 3, 4)),
        {"alpha": 2.5},
        lambda A, B, alpha: (alpha * A + B,),
    ),
    "mat_mul_and_squares": (
        (rand(2, 3, 4), rand(2, 4, 5)),
        {},
        lambda A, B: (tf.linalg.matmul(A, B), tf.reduce_sum(tf.square(A), axis=-1)),
    ),
    "masked": ((rand(2, 3, 4), rand(2, 3, 4)), {}, lambda A, M: (A * M,)),
    "exp_mat_mul": (
        (rand(2, 3, 4), rand(2, 4, 5)),
        {},
        lambda A, B: (tf.exp(tf.linalg.matmul(A, B)),),
    ),
    "attention_softmax": (
        (rand(2, 3, 4), rand(2, 5, 4)),
        {},
        lambda Q, K: (tf.nn.softmax(tf.linalg.matmul(Q, K, transpose_b=True), axis=-1),),
    ),
    "log_sum_exp": ((rand(2, 3, 6),), {}, lambda A: (tf.reduce_logsumexp(A, axis=-1),)),
    "layer_norm": ((rand(3, 6),), {"eps": 1e-3}, lambda x, eps: (layer_norm(x, eps),)),
    "pairwise_sq_dist": (
        (rand(2, 4, 3),),
        {},
        lambda x: (tf.reduce_sum(tf.math.squared_difference(x[:, :, None], x[:, None]), -1),),
    ),
    "gram_tanh": (
        (rand(2, 3, 4),),
        {},
        lambda A: (tf.linalg.matmul(tf.tanh(A), tf.tanh(A), transpose_b=True),),
    ),
}


def _tuple(value):
    return value if isinstance(value, tuple) else (value,)


@pytest.mark.parametrize("name", sorted(OPS))
def test_generated_module_matches_tensorflow(name):
    module = importlib.import_module(f"generated.{name}")
    inputs, attrs, reference = OPS[name]
    no_gradient = {"masked": {"M"}}.get(name, set()) | set(getattr(module, "_INDEX_INPUTS", ()))
    want_out = reference(*inputs, **attrs)
    got_out = _tuple(module.forward(*inputs, **attrs))
    for got, want in zip(got_out, want_out, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10, atol=1e-12)

    grads = [rand(*o.shape.as_list()) for o in want_out]
    with tf.GradientTape() as tape:
        tape.watch([x for x in inputs if x.dtype.is_floating])
        outs = reference(*inputs, **attrs)
    want = tape.gradient(outs, list(inputs), output_gradients=grads)
    fake = FakeOp(inputs, got_out, attrs, module)
    for how, got in (
        ("vjp", module.vjp(*inputs, *grads, **attrs)),
        ("registered gradient", module.gradient(fake, *grads)),
    ):
        for input_name, g, w in zip(module.INPUTS, got, want, strict=True):
            if input_name in no_gradient:
                assert g is None, f"{how}: {input_name} is no_gradient"
                continue
            np.testing.assert_allclose(
                tf.convert_to_tensor(g).numpy(),  # gathers' gradients are IndexedSlices
                tf.convert_to_tensor(w).numpy(),
                rtol=1e-9,
                atol=1e-12,
                err_msg=f"{how}: grad of {input_name}",
            )


@pytest.mark.parametrize("name", sorted(OPS))
def test_generated_module_finite_differences(name):
    module = importlib.import_module(f"generated.{name}")
    inputs, attrs, reference = OPS[name]
    weights = [rand(*o.shape.as_list()) for o in reference(*inputs, **attrs)]
    for index, input_name in enumerate(module.INPUTS):
        if name == "masked" and input_name == "M":
            continue
        if input_name in getattr(module, "_INDEX_INPUTS", ()):
            continue

        def scalar(x, index=index):
            args = list(inputs)
            args[index] = x
            outs = _tuple(module.forward(*args, **attrs))
            return tf.add_n([tf.reduce_sum(o * w) for o, w in zip(outs, weights, strict=True)])

        theoretical, numerical = tf.test.compute_gradient(scalar, [inputs[index]])
        np.testing.assert_allclose(theoretical[0], numerical[0], rtol=1e-5, atol=1e-6)


def test_worked_example_from_the_design():
    """c = a @ b; backprop ones gives [[21,30],[21,30]], backprop c gives [[573,816],...]."""
    module = importlib.import_module("generated.batched_mat_mul")
    a = tf.constant([[[1.0, 2.0], [3.0, 4.0]]], dtype=tf.float64)
    b = tf.constant([[[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]], dtype=tf.float64)
    c = module.forward(a, b)
    np.testing.assert_array_equal(c.numpy()[0], [[24, 27, 30], [54, 61, 68]])
    grad_a, _ = module.vjp(a, b, tf.ones_like(c))
    np.testing.assert_array_equal(grad_a.numpy()[0], [[21, 30], [21, 30]])
    grad_a, _ = module.vjp(a, b, c)
    np.testing.assert_array_equal(grad_a.numpy()[0], [[573, 816], [1295, 1844]])


# -- TensorFlow's hand-written gradients, written as formulas -------------------------------

BUILTINS = {
    "MatMul": ("y[i,j] = A[i,k] * B[k,j]", (rand(3, 4), rand(4, 5)), tf.linalg.matmul),
    "BatchMatMulV2": (
        "y[b,i,j] = A[b,i,k] * B[b,k,j]",
        (rand(2, 3, 4), rand(2, 4, 5)),
        lambda A, B: tf.raw_ops.BatchMatMulV2(x=A, y=B),
    ),
    "Sigmoid": ("y[b,i] = sigmoid(x[b,i])", (rand(2, 5),), tf.sigmoid),
    "Softplus": ("y[b,i] = softplus(x[b,i])", (rand(2, 5),), tf.nn.softplus),
    "SquaredDifference": (
        "y[b,i] = (x[b,i] - z[b,i])**2",
        (rand(2, 5), rand(2, 5)),
        tf.math.squared_difference,
    ),
    "MatrixDiagPart": ("y[b,i] = A[b,i,i]", (rand(2, 4, 4),), tf.linalg.diag_part),
    "Trace": ("y[b] = A[b,i,i]", (rand(2, 4, 4),), tf.linalg.trace),
    "Softmax": ("y[b,i] = exp(x[b,i]) / sum(exp(x[b,k]), k)", (rand(2, 5),), tf.nn.softmax),
    "LogSoftmax": ("y[b,i] = x[b,i] - log(sum(exp(x[b,k]), k))", (rand(2, 5),), tf.nn.log_softmax),
    "Tanh": ("y[b,i] = tanh(x[b,i])", (rand(2, 5),), tf.tanh),
    "Maximum": ("y[b,i] = max(x[b,i], z[b,i])", (rand(2, 5), rand(2, 5)), tf.maximum),
    "Abs": ("y[b,i] = abs(x[b,i])", (rand(2, 5),), tf.abs),
    "Erf": ("y[b,i] = erf(x[b,i])", (rand(2, 5),), tf.math.erf),
}


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_agrees_with_tensorflow_registered_gradient(name, tmp_path):
    from harness import Case, generate

    formula, inputs, tf_op = BUILTINS[name]
    shapes = {}
    case = Case(formula, shapes)
    module = generate(case, tmp_path, prefix=f"Builtin{name}")
    grad = rand(*tf_op(*inputs).shape.as_list())
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        out = tf_op(*inputs)
    want = tape.gradient(out, list(inputs), output_gradients=grad)
    got = module.gradient(FakeOp(inputs, [module.forward(*inputs)], {}, module), grad)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-10, atol=1e-12)


def test_max_tie_goes_to_first_argument_like_tensorflow(tmp_path):
    from harness import Case, generate

    module = generate(Case("y[i] = max(x[i], z[i]) + min(x[i], z[i])", {}), tmp_path, "Ties")
    x = tf.constant([1.0, 2.0, 3.0], tf.float64)
    z = tf.constant([1.0, 0.0, 5.0], tf.float64)
    with tf.GradientTape() as tape:
        tape.watch([x, z])
        out = tf.maximum(x, z) + tf.minimum(x, z)
    want = tape.gradient(out, [x, z])
    got = module.vjp(x, z, tf.ones_like(x))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.numpy(), w.numpy())
    assert got[0].numpy().tolist() == [2.0, 1.0, 1.0]  # ties: both max and min pick x


def test_several_outputs_none_grad_counts_as_zeros():
    """TF hands a registered gradient None for an output nothing downstream used."""
    module = importlib.import_module("generated.mat_mul_and_squares")
    A, B = rand(2, 3, 4), rand(2, 4, 5)
    y, z = module.forward(A, B)
    grad_y = rand(2, 3, 5)
    fake = FakeOp((A, B), (y, z), {}, module)
    only_y = module.gradient(fake, grad_y, None)
    with_zeros = module.gradient(fake, grad_y, tf.zeros_like(z))
    for g, w in zip(only_y, with_zeros, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=0, atol=0)
    with tf.GradientTape() as tape:  # the custom-gradient path, only z used downstream
        tape.watch([A, B])
        _, z = module.forward(A, B)
        loss = tf.reduce_sum(z)
    grad_A, grad_B = tape.gradient(loss, [A, B])
    np.testing.assert_allclose(grad_A.numpy(), 2 * A.numpy(), rtol=1e-12)
    assert grad_B is None or not np.any(grad_B.numpy())

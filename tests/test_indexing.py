"""Windows, shifts, gathers and extrema: affine accesses with zero padding, `ranges`,
`where` with conditions, `max`/`min` over indices, and integer index tensors.

First the reference evaluator itself is checked against TensorFlow's own ops (and a few
independent numpy loops) in float64, forward and gradient; then every formula goes through
the generated module (`harness.check`: forward, vjp, registered gradient, tape, finite
differences). Sizes differ per index wherever the operation allows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from harness import Case, check, generate, make_tensors, op_spec, reference

from symgrad.errors import SymgradError
from symgrad.model import build
from symgrad.reference import evaluate


@dataclass(frozen=True)
class Known:
    """A formula and an independent way to compute it from named inputs.

    `truth` returns a TF tensor built from TF's own ops (then gradients are compared too,
    `differentiable=True`) or a numpy array from a plain loop.
    """

    case: Case
    truth: Callable[[dict], object]
    differentiable: bool = True


def _names(case: Case) -> list[str]:
    return [*case.shapes, *case.index_inputs]


def _conv1d_loop(x, w, stride, dilation, pad, out):
    """`y[b,i,o] = sum_k,c x[b, stride*i + dilation*k - pad, c] w[k,c,o]`, zero outside x."""
    x, w = np.asarray(x), np.asarray(w)
    y = np.zeros((x.shape[0], out, w.shape[2]))
    for i in range(out):
        for k in range(w.shape[0]):
            position = stride * i + dilation * k - pad
            if 0 <= position < x.shape[1]:
                y[:, i, :] += x[:, position, :] @ w[k]
    return y


def _correlation(f1, f2, r, q):
    """FlowNet correlation: pad f2 by (r, q) with zeros, stack the shifted products."""
    f1, f2 = np.asarray(f1), np.asarray(f2)
    _, h, w, _ = f1.shape
    padded = np.pad(f2, ((0, 0), (r, r), (q, q), (0, 0)))
    planes = [
        [np.mean(f1 * padded[:, u : u + h, v : v + w, :], axis=-1) for v in range(2 * q + 1)]
        for u in range(2 * r + 1)
    ]
    return np.stack([np.stack(row, axis=-1) for row in planes], axis=-2)


def _gather_rows(table, ids):
    """`table[ids]` along axis 0, with rows outside the table read as zero."""
    table, ids = np.asarray(table), np.asarray(ids)
    inside = (ids >= 0) & (ids < table.shape[0])
    rows = table[np.clip(ids, 0, table.shape[0] - 1)]
    return np.where(inside[..., None], rows, 0.0)


def _gather_window(x, idx, width):
    """`y[b,i,k,c] = x[b, idx[b,i] + k, c]` for k < width, zero outside x."""
    x, idx = np.asarray(x), np.asarray(idx)
    batch, n = idx.shape
    y = np.zeros((batch, n, width, x.shape[2]))
    for b in range(batch):
        for i in range(n):
            for k in range(width):
                position = idx[b, i] + k
                if 0 <= position < x.shape[1]:
                    y[b, i, k] = x[b, position]
    return y


def _causal_softmax(s):
    rows, cols = s.shape[1], s.shape[2]
    mask = np.arange(cols)[None, :] <= np.arange(rows)[:, None]
    return tf.nn.softmax(tf.where(mask, s, -np.inf * tf.ones_like(s)), axis=-1)


KNOWN = {
    # -- convolutions ------------------------------------------------------------------
    "conv1d_valid": Known(
        Case(
            "y[b,i,o] = sum(x[b, i + k, c] * w[k,c,o], k, c)",
            {"x": (2, 10, 3), "w": (4, 3, 5)},
            sizes={"i": 7},
        ),
        lambda t: tf.nn.conv1d(t["x"], t["w"], 1, "VALID"),
    ),
    "conv1d_stride2": Known(
        Case(
            "y[b,i,o] = sum(x[b, s*i + k, c] * w[k,c,o], k, c)",
            {"x": (2, 15, 3), "w": (4, 3, 5)},
            attrs={"s": 2},
            sizes={"i": 6},
        ),
        lambda t: tf.nn.conv1d(t["x"], t["w"], 2, "VALID"),
    ),
    "conv1d_same_stride2": Known(
        Case(
            "y[b,i,o] = sum(x[b, 2*i + k - 1, c] * w[k,c,o], k, c)",
            {"x": (2, 11, 4), "w": (3, 4, 5)},
            ranges={"i": "(x.shape[1] + 1) // 2"},
            sizes={"i": 6},
        ),
        lambda t: tf.nn.conv1d(t["x"], t["w"], 2, "SAME"),
    ),
    "conv2d_valid": Known(
        Case(
            "y[b,i,j,o] = sum(x[b, i+u, j+v, c] * w[u,v,c,o], u, v, c)",
            {"x": (2, 12, 11, 3), "w": (4, 5, 3, 6)},
            sizes={"i": 9, "j": 7},
        ),
        lambda t: tf.nn.conv2d(t["x"], t["w"], 1, "VALID"),
    ),
    "conv2d_stride2": Known(
        Case(
            "y[b,i,j,o] = sum(x[b, 2*i+u, 2*j+v, c] * w[u,v,c,o], u, v, c)",
            {"x": (2, 15, 19, 4), "w": (3, 5, 4, 6)},
            sizes={"i": 7, "j": 8},
        ),
        lambda t: tf.nn.conv2d(t["x"], t["w"], 2, "VALID"),
    ),
    "conv2d_same": Known(
        Case(
            "y[b,i,j,o] = sum(x[b, i+u-1, j+v-2, c] * w[u,v,c,o], u, v, c)",
            {"x": (2, 7, 8, 4), "w": (3, 5, 4, 6)},
            ranges={"i": "x.shape[1]", "j": "x.shape[2]"},
            sizes={"i": 7, "j": 8},
        ),
        lambda t: tf.nn.conv2d(t["x"], t["w"], 1, "SAME"),
    ),
    # Windows without a channel or a batch axis: convolutions with unit axes inserted.
    "conv1d_no_channels": Known(
        Case(
            "y[b,i] = sum(x[b, i + k] * w[k], k)",
            {"x": (3, 11), "w": (4,)},
            sizes={"i": 8},
        ),
        lambda t: tf.nn.conv1d(t["x"][..., None], t["w"][:, None, None], 1, "VALID")[..., 0],
    ),
    "conv1d_no_batch_same": Known(
        Case(
            "y[i,o] = sum(x[i + k - 1, c] * w[k,c,o], k, c)",
            {"x": (10, 4), "w": (3, 4, 5)},
            ranges={"i": "x.shape[0]"},
            sizes={"i": 10},
        ),
        lambda t: tf.nn.conv1d(t["x"][None], t["w"], 1, "SAME")[0],
    ),
    "conv1d_out_channels_only_stride2": Known(
        Case(
            "y[b,i,o] = sum(x[b, 2*i + k] * w[k,o], k)",
            {"x": (2, 13), "w": (3, 4)},
            sizes={"i": 6},
        ),
        lambda t: tf.nn.conv1d(t["x"][..., None], t["w"][:, None], 2, "VALID"),
    ),
    "conv2d_no_channels_same_even": Known(
        Case(
            "y[b,i,j] = sum(x[b, i+u-1, j+v-1] * w[u,v], u, v)",
            {"x": (2, 7, 9), "w": (3, 4)},
            ranges={"i": "x.shape[1]", "j": "x.shape[2]"},
            sizes={"i": 7, "j": 9},
        ),
        lambda t: tf.nn.conv2d(t["x"][..., None], t["w"][..., None, None], 1, "SAME")[..., 0],
    ),
    "conv2d_no_batch_no_channels_cropped": Known(
        Case(
            "y[i,j] = sum(x[i+u+1, j+v] * w[u,v], u, v)",
            {"x": (9, 8), "w": (2, 3)},
            sizes={"i": 7, "j": 6},
        ),
        lambda t: tf.nn.conv2d(t["x"][None, 1:, :, None], t["w"][..., None, None], 1, "VALID")[
            0, ..., 0
        ],
    ),
    "conv1d_dilated": Known(
        Case(
            "y[b,i,o] = sum(x[b, i + d*k, c] * w[k,c,o], k, c)",
            {"x": (2, 13, 3), "w": (4, 3, 5)},
            attrs={"d": 2},
            sizes={"i": 7},
        ),
        lambda t: _conv1d_loop(t["x"], t["w"], 1, 2, 0, 7),
        differentiable=False,
    ),
    "conv1d_strided_dilated_padded": Known(
        Case(
            "y[b,i,o] = sum(x[b, s*i + d*k - p, c] * w[k,c,o], k, c)",
            {"x": (2, 17, 3), "w": (4, 3, 5)},
            attrs={"s": 2, "d": 2, "p": 1},
            sizes={"i": 6},  # (L - 1 + p - d*(K-1)) // s + 1
        ),
        lambda t: _conv1d_loop(t["x"], t["w"], 2, 2, 1, 6),
        differentiable=False,
    ),
    "depthwise_conv2d": Known(
        Case(
            "y[b,i,j,(c,m)] = sum(x[b,i+u,j+v,c] * w[u,v,c,m], u, v)",
            {"x": (2, 11, 10, 3), "w": (4, 5, 3, 7)},
            sizes={"i": 8, "j": 6},
        ),
        lambda t: tf.nn.depthwise_conv2d(t["x"], t["w"], [1, 1, 1, 1], "VALID"),
    ),
    # -- shifts and differences --------------------------------------------------------
    "shift_right": Known(
        Case("y[b,i] = x[b, i - 1]", {"x": (3, 7)}, ranges={"i": "x.shape[1]"}, sizes={"i": 7}),
        lambda t: tf.pad(t["x"][:, :-1], [[0, 0], [1, 0]]),
    ),
    "forward_difference": Known(
        Case("y[b,i] = x[b, i + 1] - x[b, i]", {"x": (3, 7)}),
        lambda t: tf.concat([t["x"][:, 1:] - t["x"][:, :-1], -t["x"][:, -1:]], axis=1),
    ),
    # -- pooling and extrema -----------------------------------------------------------
    "max_pool_2x2": Known(
        Case(
            "y[b,i,j,c] = max(x[b, 2*i+u, 2*j+v, c], u, v)",
            {"x": (3, 11, 13, 4)},
            ranges={"u": "2", "v": "2"},
            sizes={"u": 2, "v": 2, "i": 5, "j": 6},
        ),
        lambda t: tf.nn.max_pool2d(t["x"], 2, 2, "VALID"),
    ),
    "max_pool_2x3": Known(
        Case(
            "y[b,i,j,c] = max(x[b, 2*i+u, 3*j+v, c], u, v)",
            {"x": (4, 17, 20, 5)},
            ranges={"u": "2", "v": "3"},
            sizes={"u": 2, "v": 3, "i": 8, "j": 6},
        ),
        lambda t: tf.nn.max_pool2d(t["x"], (2, 3), (2, 3), "VALID"),
    ),
    "reduce_max": Known(
        Case("y[b,j] = max(x[b,i,j], i)", {"x": (3, 4, 5)}),
        lambda t: tf.reduce_max(t["x"], axis=1),
    ),
    "reduce_min_two": Known(
        Case("y[b] = min(x[b,i,j], i, j)", {"x": (3, 4, 5)}),
        lambda t: tf.reduce_min(t["x"], axis=[1, 2]),
    ),
    "max_minus_min": Known(
        Case("y[b,j] = max(x[b,i,j], i) - min(2 * x[b,i,j], i)", {"x": (3, 4, 5)}),
        lambda t: tf.reduce_max(t["x"], axis=1) - tf.reduce_min(2 * t["x"], axis=1),
    ),
    # -- conditions --------------------------------------------------------------------
    "cumsum": Known(
        Case(
            "y[b,i] = sum(where(k <= i, x[b,k], 0), k)",
            {"x": (3, 7)},
            ranges={"i": "x.shape[1]"},
            sizes={"i": 7},
        ),
        lambda t: tf.cumsum(t["x"], axis=1),
    ),
    "cumsum_first_rows": Known(
        Case(
            "y[b,i] = sum(where(k <= i, x[b,k], 0), k)",
            {"x": (3, 7)},
            ranges={"i": "x.shape[1] - 2"},
            sizes={"i": 5},
        ),
        lambda t: tf.cumsum(t["x"], axis=1)[:, :5],
    ),
    "cumsum_reverse_exclusive": Known(
        Case(
            "y[b,i] = sum(where(k > i, x[b,k], 0), k)",
            {"x": (3, 7)},
            ranges={"i": "x.shape[1]"},
            sizes={"i": 7},
        ),
        lambda t: tf.cumsum(t["x"], axis=1, exclusive=True, reverse=True),
    ),
    "causal_softmax": Known(
        Case(
            "y[b,i,j] = where(j <= i, exp(s[b,i,j]), 0) / sum(where(m <= i, exp(s[b,i,m]), 0), m)",
            {"s": (2, 4, 6)},
        ),
        lambda t: _causal_softmax(t["s"]),
    ),
    "leaky_relu": Known(
        Case(
            "y[b,i] = where(x[b,i] > 0, x[b,i], alpha * x[b,i])",
            {"x": (3, 7)},
            attrs={"alpha": 0.25},  # exact in the float32 attr of LeakyRelu
        ),
        lambda t: tf.nn.leaky_relu(t["x"], 0.25),
    ),
    "band": Known(
        Case("y[b,i,j] = where(i - w <= j <= i + w, A[b,i,j], 0)", {"A": (2, 5, 6)}, {"w": 1}),
        lambda t: tf.linalg.band_part(t["A"], 1, 1),
    ),
    "upper_band_not_or": Known(
        Case(
            "y[b,i,j] = where(not (j < i or j > i + w), A[b,i,j], 0)",
            {"A": (2, 5, 6)},
            {"w": 2},
        ),
        lambda t: tf.linalg.band_part(t["A"], 0, 2),
    ),
    "shrink_and": Known(
        Case(
            "y[b,i] = where(x[b,i] > -0.5 and x[b,i] < 0.5, 0, x[b,i])",
            {"x": (3, 7)},
        ),
        lambda t: tf.where(tf.abs(t["x"]) < 0.5, tf.zeros_like(t["x"]), t["x"]),
    ),
    # -- correlation over displacements ------------------------------------------------
    "correlation": Known(
        Case(
            "y[b,i,j,u,v] = mean(f1[b,i,j,c] * f2[b, i+u-r, j+v-q, c], c)",
            {"f1": (2, 4, 6, 7), "f2": (2, 4, 6, 7)},
            attrs={"r": 1, "q": 2},
            ranges={"u": "2*r + 1", "v": "2*q + 1"},
            sizes={"u": 3, "v": 5},
        ),
        lambda t: _correlation(t["f1"], t["f2"], 1, 2),
        differentiable=False,
    ),
    # -- integer index tensors ---------------------------------------------------------
    "gather": Known(
        Case(
            "y[b,t,d] = W[ids[b,t], d]",
            {"W": (11, 5)},
            index_inputs={"ids": ((2, 3), 0, 11)},
        ),
        lambda t: tf.gather(t["W"], t["ids"]),
    ),
    "embedding_plus_position": Known(
        Case(
            "y[b,t,d] = W[ids[b,t], d] + P[t,d]",
            {"W": (11, 5), "P": (3, 5)},
            index_inputs={"ids": ((2, 3), 0, 11, tf.int64)},
        ),
        lambda t: tf.gather(t["W"], t["ids"]) + t["P"],
    ),
    "gather_batch_dims": Known(
        Case(
            "y[b,n,c] = X[b, idx[b,n], c]",
            {"X": (2, 9, 4)},
            index_inputs={"idx": ((2, 5), 0, 9)},
        ),
        lambda t: tf.gather(t["X"], t["idx"], batch_dims=1),
    ),
    "pointnet_group": Known(
        Case(
            "y[b,n,k,c] = X[b, idx[b,n,k], c]",
            {"X": (2, 9, 3)},
            index_inputs={"idx": ((2, 4, 5), 0, 9)},
        ),
        lambda t: tf.gather(t["X"], t["idx"], batch_dims=1),
    ),
    "pointnet_weighted": Known(
        Case(
            "y[b,n,c] = sum(X[b, idx[b,n,k], c] * w[b,n,k], k)",
            {"X": (2, 9, 3), "w": (2, 4, 5)},
            index_inputs={"idx": ((2, 4, 5), 0, 9)},
        ),
        lambda t: tf.einsum("bnkc,bnk->bnc", tf.gather(t["X"], t["idx"], batch_dims=1), t["w"]),
    ),
    "gather_window": Known(
        Case(
            "y[b,i,k,c] = X[b, idx[b,i] + k, c]",
            {"X": (2, 9, 4)},
            index_inputs={"idx": ((2, 5), 0, 9)},
            ranges={"k": "3"},
            sizes={"k": 3},
        ),
        lambda t: _gather_window(t["X"], t["idx"], 3),
        differentiable=False,
    ),
    "gather_out_of_range": Known(
        Case(
            "y[b,t,d] = W[ids[b,t], d]",
            {"W": (11, 5)},
            index_inputs={"ids": ((3, 4), -3, 15)},
        ),
        lambda t: _gather_rows(t["W"], t["ids"]),
        differentiable=False,
    ),
}


def _inputs(case: Case, seed: int = 0) -> dict:
    names = _names(case)
    return dict(zip(names, make_tensors(case, names, seed), strict=True))


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_reference_matches_tensorflow(name):
    """The oracle itself: forward against TF's op (or a loop), and TF autodiff through the
    reference against TF autodiff through TF's op."""
    known = KNOWN[name]
    case = known.case
    named = _inputs(case)
    floats = [named[n] for n in case.shapes]
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(floats)
        (got,) = reference(case, named)
        want = known.truth(named)
    np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-12, atol=1e-12)
    if not known.differentiable:
        return
    grad = tf.constant(np.random.default_rng(3).standard_normal(got.shape.as_list()))
    for name_, x in zip(case.shapes, floats, strict=True):
        g_ref = tape.gradient(got, x, output_gradients=grad)
        g_tf = tape.gradient(want, x, output_gradients=grad)
        np.testing.assert_allclose(
            tf.convert_to_tensor(g_ref).numpy(),
            tf.convert_to_tensor(g_tf).numpy(),
            rtol=1e-12,
            atol=1e-12,
            err_msg=f"gradient of {name_}",
        )


def test_reference_reads_zero_outside_and_needs_sizes():
    x = tf.constant(np.arange(6.0).reshape(1, 6))
    shifted = evaluate("y[b,i] = x[b, 2*i - 1]", {"x": x}, sizes={"i": 4})
    np.testing.assert_array_equal(shifted.numpy(), [[0.0, 1.0, 3.0, 5.0]])
    with pytest.raises(KeyError, match="'i'"):
        evaluate("y[b,i] = x[b, 2*i - 1]", {"x": x})


def test_reference_dilated_conv_against_convolution():
    """The dilated loop above is itself checked against TF's forward convolution."""
    case = KNOWN["conv1d_dilated"].case
    named = _inputs(case)
    want = tf.nn.convolution(named["x"], named["w"], padding="VALID", dilations=2)
    got = _conv1d_loop(named["x"], named["w"], 1, 2, 0, 7)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- generated


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_generated_module(name, tmp_path):
    case = replace(KNOWN[name].case, fd_directions=4)
    check(case, generate(case, tmp_path, prefix="Indexing"))


def _module_inputs(case: Case, module, seed: int = 0) -> list:
    return make_tensors(case, module.INPUTS, seed)


def test_ties_in_max_split_the_gradient_equally(tmp_path):
    """Like `tf.reduce_max`: every tied maximum gets an equal share."""
    case = Case("y[b,j] = max(x[b,i,j], i)", {"x": (2, 4, 3)})
    module = generate(case, tmp_path, prefix="Ties")
    x = np.random.default_rng(0).uniform(-1, 1, (2, 4, 3))
    x[0, [0, 2, 3], 1] = 5.0  # a three-way tie
    x[1, [1, 2], 0] = 7.0  # a two-way tie
    x[1, :, 2] = -0.5  # all four tied
    x = tf.constant(x)
    grad = tf.constant(np.random.default_rng(1).uniform(1, 2, (2, 3)))
    (got,) = module.vjp(x, grad)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_max(x, axis=1)
    want = tape.gradient(y, x, output_gradients=grad)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.numpy()[0, [0, 2, 3], 1], [grad.numpy()[0, 1] / 3] * 3)
    np.testing.assert_allclose(got.numpy()[1, :, 2], [grad.numpy()[1, 2] / 4] * 4)
    np.testing.assert_allclose(module.forward(x).numpy(), tf.reduce_max(x, axis=1).numpy())


def test_ties_in_max_pool(tmp_path):
    case = KNOWN["max_pool_2x3"].case
    module = generate(case, tmp_path, prefix="PoolTies")
    # Values on a coarse grid tie often inside 2x3 windows.
    x = tf.constant(np.random.default_rng(0).integers(0, 3, (4, 17, 20, 5)).astype(np.float64))
    grad = tf.constant(np.random.default_rng(1).standard_normal((4, 8, 6, 5)))
    with tf.GradientTape() as tape:
        tape.watch(x)
        (y,) = reference(case, {"x": x})
    want = tape.gradient(y, x, output_gradients=grad)
    (got,) = module.vjp(x, grad)
    np.testing.assert_allclose(module.forward(x).numpy(), y.numpy())
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["leaky_relu", "max_pool_2x2", "reduce_min_two", "shrink_and"])
def test_all_zero_inputs(name, tmp_path):
    """Zeros sit on every boundary: `x > 0` is false, every window is one big tie."""
    case = KNOWN[name].case
    module = generate(case, tmp_path, prefix="Zeros")
    x = tf.zeros(case.shapes["x"], tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(x)
        (y,) = reference(case, {"x": x})
    grad = tf.constant(np.random.default_rng(2).standard_normal(y.shape.as_list()))
    want = tape.gradient(y, x, output_gradients=grad)
    np.testing.assert_allclose(module.forward(x, **case.attrs).numpy(), y.numpy())
    (got,) = module.vjp(x, grad, **case.attrs)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)


def test_out_of_range_index_values_read_zero(tmp_path):
    case = KNOWN["gather_out_of_range"].case
    module = generate(case, tmp_path, prefix="Outside")
    ids = tf.constant([[-3, 0, 10, 11], [14, -1, 5, 5], [2, 12, 0, 3]], tf.int32)
    W = tf.constant(np.random.default_rng(0).standard_normal((11, 5)))
    args = {"W": W, "ids": ids}
    tensors = [args[n] for n in module.INPUTS]
    y = module.forward(*tensors)
    np.testing.assert_array_equal(y.numpy(), _gather_rows(W, ids))
    assert not np.any(y.numpy()[0, 0]) and not np.any(y.numpy()[1, 0])
    grad = tf.constant(np.random.default_rng(1).standard_normal((3, 4, 5)))
    grads = dict(zip(module.INPUTS, module.vjp(*tensors, grad), strict=True))
    assert grads["ids"] is None
    want = np.zeros((11, 5))
    for (b, t), row in np.ndenumerate(ids.numpy()):
        if 0 <= row < 11:
            want[row] += grad.numpy()[b, t]
    np.testing.assert_allclose(tf.convert_to_tensor(grads["W"]).numpy(), want, rtol=1e-12)


def test_padding_reads_zero_at_both_ends(tmp_path):
    """`x[b, i - 1]` and `x[b, i + 1]` at the ends read zero, and get no gradient there."""
    case = Case(
        "y[b,i] = x[b, i - 1] + 10 * x[b, i + 1]",
        {"x": (2, 5)},
        ranges={"i": "x.shape[1]"},
        sizes={"i": 5},
    )
    module = generate(case, tmp_path, prefix="Ends")
    x = tf.constant(np.arange(10.0).reshape(2, 5) + 1)
    want = np.pad(x.numpy()[:, :-1], ((0, 0), (1, 0))) + 10 * np.pad(
        x.numpy()[:, 1:], ((0, 0), (0, 1))
    )
    np.testing.assert_array_equal(module.forward(x).numpy(), want)
    (g,) = module.vjp(x, tf.ones((2, 5), tf.float64))
    np.testing.assert_array_equal(g.numpy(), [[1, 11, 11, 11, 10]] * 2)


@pytest.mark.parametrize(
    ("formula", "branch"),
    [
        ("y[b,i] = where(x[b,i] > 0, sqrt(x[b,i]), 0)", "sqrt"),
        ("y[b,i] = where(x[b,i] > 0, log(x[b,i]), x[b,i])", "log"),
        ("y[b,i] = where(x[b,i] != 0, 1 / x[b,i], 0)", "reciprocal"),
    ],
)
def test_branch_not_taken_does_not_leak_nan(formula, branch, tmp_path):
    case = Case(formula, {"x": (2, 6)})
    module = generate(case, tmp_path, prefix="Select")
    x_np = np.array([[-1.0, 0.0, 0.25, 4.0, -0.0, 1.0], [0.0, -2.0, 9.0, 0.5, 0.0, -3.0]])
    x = tf.constant(x_np)
    grad = tf.constant(np.random.default_rng(0).standard_normal((2, 6)))
    positive = x_np > 0 if branch != "reciprocal" else x_np != 0
    safe = np.where(positive, x_np, 1.0)
    if branch == "sqrt":
        y, dy = np.where(positive, np.sqrt(safe), 0.0), np.where(positive, 0.5 / np.sqrt(safe), 0)
    elif branch == "log":
        y, dy = np.where(positive, np.log(safe), x_np), np.where(positive, 1 / safe, 1.0)
    else:
        y, dy = np.where(positive, 1 / safe, 0.0), np.where(positive, -1 / safe**2, 0.0)
    np.testing.assert_allclose(module.forward(x).numpy(), y, rtol=1e-14)
    (got,) = module.vjp(x, grad)
    assert np.all(np.isfinite(got.numpy()))
    np.testing.assert_allclose(got.numpy(), dy * grad.numpy(), rtol=1e-14)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(module.forward(x) * grad)
    np.testing.assert_allclose(tape.gradient(loss, x).numpy(), dy * grad.numpy(), rtol=1e-14)


# ----------------------------------------------------------------------------- unknown dims


def _signature(module, tensors, known_axes):
    """TensorSpecs with every axis unknown except those listed per input name."""
    return [
        tf.TensorSpec(
            [d if axis in known_axes.get(name, ()) else None for axis, d in enumerate(t.shape)],
            t.dtype,
        )
        for name, t in zip(module.INPUTS, tensors, strict=True)
    ]


@pytest.mark.parametrize(
    ("name", "known_axes"),
    [("conv1d_same_stride2", {}), ("conv2d_stride2", {}), ("gather_batch_dims", {})],
)
def test_unknown_dims_under_tf_function(name, known_axes, tmp_path):
    case = KNOWN[name].case
    module = generate(case, tmp_path, prefix="Unknown")
    tensors = _module_inputs(case, module)
    (want,) = reference(case, dict(zip(module.INPUTS, tensors, strict=True)))
    signature = _signature(module, tensors, known_axes)
    forward = tf.function(lambda *a: module.forward(*a, **case.attrs), input_signature=signature)
    np.testing.assert_allclose(forward(*tensors).numpy(), want.numpy(), rtol=1e-12, atol=1e-12)

    grad = tf.constant(np.random.default_rng(1).standard_normal(want.shape.as_list()))
    grad_spec = tf.TensorSpec([None] * len(want.shape), tf.float64)
    vjp = tf.function(
        lambda *a: module.vjp(*a, **case.attrs), input_signature=[*signature, grad_spec]
    )
    floats = [t for n, t in zip(module.INPUTS, tensors, strict=True) if n in case.shapes]
    with tf.GradientTape() as tape:
        tape.watch(floats)
        (ref,) = reference(case, dict(zip(module.INPUTS, tensors, strict=True)))
    expected = tape.gradient(ref, floats, output_gradients=grad)
    got = vjp(*tensors, grad)
    got = [g for n, g in zip(module.INPUTS, got, strict=True) if n in case.shapes]
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(
            tf.convert_to_tensor(g).numpy(), tf.convert_to_tensor(e).numpy(), rtol=1e-12, atol=1e-12
        )

    @tf.function(input_signature=signature)
    def taped(*args):
        with tf.GradientTape() as tape:
            watched = [a for n, a in zip(module.INPUTS, args, strict=True) if n in case.shapes]
            tape.watch(watched)
            loss = tf.reduce_sum(module.forward(*args, **case.attrs) * grad)
        return tape.gradient(loss, watched)

    for g, e in zip(taped(*tensors), expected, strict=True):
        np.testing.assert_allclose(
            tf.convert_to_tensor(g).numpy(), tf.convert_to_tensor(e).numpy(), rtol=1e-12, atol=1e-12
        )


# ----------------------------------------------------------------------------- refusals


REFUSALS = [
    # (formula, shapes, ranges, words the message must contain, text at the caret)
    ("y[b,2*i] = x[b,i]", {"x": (2, 3)}, {}, ["index", "plain"], "2*i"),
    ("y[b,i] = A[b, i*k]", {"A": (2, 3)}, {}, ["product of indices"], "i*k"),
    # (`A[b, 0.5*i]` is a sampled read now: tests/test_sampled_reads.py)
    ("y[b,i] = A[b, i ** 2]", {"A": (2, 3)}, {}, ["operator", "**"], "i ** 2"),
    ("y[b,i] = W[ids[b,i]] * ids[b,i]", {"W": (5,), "ids": (2, 3)}, {}, ["ids"], "ids"),
    ("y[b,i] = sum(A[b, i+k], k)", {"A": (2, 5)}, {}, ["'k'", "range"], None),
]


@pytest.mark.parametrize(("formula", "shapes", "ranges", "words", "caret"), REFUSALS)
def test_refusals(formula, shapes, ranges, words, caret):
    case = Case(formula, shapes, ranges=ranges)
    with pytest.raises(SymgradError) as info:
        build(op_spec(case, "Refused"))
    error = info.value
    lines = error.render().splitlines()
    assert lines[0].startswith("error: ") and "Refused" in lines[0], lines
    for word in words:
        assert word in lines[0], lines[0]
    assert error.column is not None, lines
    assert len(lines) == 3 and lines[2].strip() == "^", lines
    if caret is not None:
        assert formula[error.column :].startswith(caret), (formula, error.column)
    else:  # the caret points at a use of the index that has no range
        assert formula[error.column] == "k" or formula[error.column :].startswith("sum"), lines


def test_index_tensor_used_as_value_in_another_formula_is_refused():
    case = Case(("y[b,i] = W[ids[b,i]]", "z[b,i] = ids[b,i] * 2"), {"W": (5,)})
    with pytest.raises(SymgradError, match="ids"):
        build(op_spec(case, "Refused"))


# ----------------------------------------------------------------------------- more


def test_zero_padding_takes_part_in_max(tmp_path):
    """Padding is zero, not -inf: a window of negative values at the border has max 0,
    and that output sends no gradient into x."""
    case = Case(
        "y[b,i] = max(x[b, i + k - 1], k)", {"x": (2, 5)}, ranges={"i": "x.shape[1]", "k": "3"}
    )
    module = generate(case, tmp_path, prefix="PadMax")
    x = tf.constant(-np.arange(1.0, 11.0).reshape(2, 5))  # all negative, decreasing
    y = module.forward(x)
    want = np.maximum.reduce([np.pad(x.numpy(), ((0, 0), (1, 1)))[:, k : k + 5] for k in range(3)])
    np.testing.assert_array_equal(y.numpy(), want)
    assert np.all(y.numpy()[:, [0, -1]] == 0)
    (g,) = module.vjp(x, tf.ones((2, 5), tf.float64))
    # The first and last windows take the padding; window i in between takes x[b, i - 1].
    np.testing.assert_array_equal(g.numpy(), [[1, 1, 1, 0, 0]] * 2)


@pytest.mark.parametrize("name", ["conv1d_same_stride2", "shift_right", "max_pool_2x3", "gather"])
def test_ranges_follow_the_shapes_of_each_call(name, tmp_path):
    """One module, inputs of other sizes: ranges are evaluated from the actual shapes."""
    case = replace(KNOWN[name].case, fd_directions=1)
    module = generate(case, tmp_path, prefix="Resized")
    resized = {
        "conv1d_same_stride2": ({"x": (3, 8, 4), "w": (3, 4, 5)}, {}, {"i": 4}),
        "shift_right": ({"x": (2, 4)}, {}, {"i": 4}),
        "max_pool_2x3": ({"x": (1, 9, 7, 2)}, {}, {"u": 2, "v": 3, "i": 4, "j": 2}),
        "gather": ({"W": (6, 3)}, {"ids": ((4, 2), 0, 6)}, {}),
    }
    shapes, index_inputs, sizes = resized[name]
    case = replace(case, shapes=shapes, index_inputs=index_inputs or case.index_inputs, sizes=sizes)
    check(case, module, seed=5)


def test_directional_differences_catch_a_wrong_gradient():
    """The harness's cheap finite differences fail on a gradient that is off by 1%."""
    from harness import _directional_differences

    @tf.custom_gradient
    def almost_sin(x):
        return tf.sin(x), lambda g: g * tf.cos(x) * 1.01

    x = tf.constant(np.random.default_rng(0).uniform(-1, 1, (3, 4)))
    case = Case("y[i] = x[i]", {"x": (3, 4)}, fd_directions=2)
    with pytest.raises(AssertionError, match="random direction"):
        _directional_differences(
            case, lambda t: tf.reduce_sum(almost_sin(t)), x, "x", np.random.default_rng(1)
        )
    _directional_differences(
        case, lambda t: tf.reduce_sum(tf.sin(t)), x, "x", np.random.default_rng(1)
    )


# ----------------------------------------------------------------------------- TF contexts


CONTEXT_CASES = [
    "conv1d_strided_dilated_padded",
    "depthwise_conv2d",
    "max_pool_2x3",
    "cumsum_reverse_exclusive",
    "causal_softmax",
    "correlation",
    "gather_window",
    "pointnet_weighted",
    "gather_out_of_range",
]


def _float_names(case: Case, module) -> list[int]:
    return [n for n, name in enumerate(module.INPUTS) if name in case.shapes]


@pytest.mark.parametrize("name", CONTEXT_CASES)
@pytest.mark.parametrize("context", ["unknown_dims", "xla"])
def test_forward_and_tape_in_tf_contexts(name, context, tmp_path):
    """The same numbers eagerly (reference), in a tf.function with every dim unknown, and
    compiled by XLA (where TF's own gather clamps instead of failing: the zero rule must
    still hold)."""
    case = KNOWN[name].case
    module = generate(case, tmp_path, prefix=f"Context{context.title().replace('_', '')}")
    tensors = _module_inputs(case, module, seed=7)
    floats = _float_names(case, module)
    named = dict(zip(module.INPUTS, tensors, strict=True))
    with tf.GradientTape() as tape:
        tape.watch([tensors[n] for n in floats])
        (want,) = reference(case, named)
    grad = tf.constant(np.random.default_rng(8).standard_normal(want.shape.as_list()))
    expected = tape.gradient(want, [tensors[n] for n in floats], output_gradients=grad)

    def run(*args):
        with tf.GradientTape() as tape:
            watched = [args[n] for n in floats]
            tape.watch(watched)
            y = module.forward(*args, **case.attrs)
            loss = tf.reduce_sum(y * grad)
        return y, tape.gradient(loss, watched)

    if context == "xla":
        function = tf.function(run, jit_compile=True)
    else:
        function = tf.function(run, input_signature=_signature(module, tensors, {}))
    y, grads = function(*tensors)
    np.testing.assert_allclose(y.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)
    for g, e in zip(grads, expected, strict=True):
        np.testing.assert_allclose(
            tf.convert_to_tensor(g).numpy(),
            tf.convert_to_tensor(e).numpy(),
            rtol=1e-12,
            atol=1e-12,
        )


@pytest.mark.parametrize("name", ["conv1d_same_stride2", "max_pool_2x3", "gather", "cumsum"])
def test_second_order_gradients(name, tmp_path):
    """d/dx <d<y, g>/dx, h> through the generated gradient, against the reference."""
    case = KNOWN[name].case
    module = generate(case, tmp_path, prefix="Second")
    tensors = _module_inputs(case, module, seed=3)
    floats = _float_names(case, module)
    named = dict(zip(module.INPUTS, tensors, strict=True))
    (y,) = reference(case, named)
    rng = np.random.default_rng(4)
    grad = tf.constant(rng.standard_normal(y.shape.as_list()))
    directions = [tf.constant(rng.standard_normal(tensors[n].shape)) for n in floats]

    def second(forward):
        watched = [tensors[n] for n in floats]
        with tf.GradientTape() as outer:
            outer.watch(watched)
            with tf.GradientTape() as inner:
                inner.watch(watched)
                loss = tf.reduce_sum(forward() * grad)
            firsts = inner.gradient(loss, watched)
            dot = tf.add_n(
                [tf.reduce_sum(tf.convert_to_tensor(f) * h) for f, h in zip(firsts, directions)]
            )
        return [
            tf.convert_to_tensor(g).numpy() for g in outer.gradient(dot, watched) if g is not None
        ] or [np.zeros(())]

    got = second(lambda: module.forward(*tensors, **case.attrs))
    want = second(lambda: reference(case, named)[0])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


def test_sparse_gradient_of_a_lookup_applies_to_a_variable(tmp_path):
    """The tape's gradient of a row gather may be tf.IndexedSlices; with out-of-range ids
    it must still apply with `scatter_sub` (which refuses out-of-range rows) and move
    exactly the rows that were read."""
    case = KNOWN["gather_out_of_range"].case
    module = generate(case, tmp_path, prefix="Sparse")
    W = tf.Variable(np.random.default_rng(0).standard_normal((11, 5)))
    ids = tf.constant([[-3, 0, 10, 11], [14, -1, 5, 5], [2, 12, 0, 3]], tf.int32)
    grad = tf.constant(np.random.default_rng(1).standard_normal((3, 4, 5)))
    args = {"W": W, "ids": ids}
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(module.forward(*[args[n] for n in module.INPUTS]) * grad)
    step = tape.gradient(loss, W)
    want = np.zeros((11, 5))
    for (b, t), row in np.ndenumerate(ids.numpy()):
        if 0 <= row < 11:
            want[row] += grad.numpy()[b, t]
    before = W.numpy().copy()
    if isinstance(step, tf.IndexedSlices):
        W.scatter_sub(step)
    else:
        W.assign_sub(step)
    np.testing.assert_allclose(before - W.numpy(), want, rtol=1e-12, atol=1e-12)

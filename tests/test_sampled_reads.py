"""Sampled reads (issue 18, item 1): a float position inside a value input's brackets reads
by (multi)linear interpolation, neighbours outside the input read zero. Each op is checked
in float64, forward and both gradients, in TensorFlow, PyTorch and JAX, against an
independent reference: PyTorch's own grid_sample (and its autograd), or a NumPy loop
transcription of the public kernel (torchvision's deform_conv2d bilinear_interpolate,
ROI Align with zero padding), and against finite differences away from integer positions.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import tensorflow as tf
from harness import load_module

from symgrad.errors import SymgradError
from symgrad.explain import explain
from symgrad.model import build
from symgrad.pipeline import module_text
from symgrad.spec import parse_op

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp

TARGETS = ("tensorflow", "pytorch", "jax")

GRID_SAMPLE = {
    "formula": "y[n,c,h,w] = x[n, c, (g[n,h,w,1] + 1) * (H - 1) / 2, "
    "(g[n,h,w,0] + 1) * (W - 1) / 2]",
    "let": {"H": "x.shape[2]", "W": "x.shape[3]"},
}
DEFORM_CONV = {
    "formula": "y[b,o,i,j] = sum(w[o,c,u,v] * x[b, c, s*i - p + u + off[b, 2*(u*KW + v), i, j], "
    "s*j - p + v + off[b, 2*(u*KW + v) + 1, i, j]], c, u, v)",
    "attrs": {"s": "int", "p": "int"},
    "let": {"KW": "w.shape[3]"},
    "inputs": ["x", "w", "off"],
}
ROI_ALIGN = {
    "formula": "y[r,c,i,j] = mean(x[bi[r], c, y0[r] + (i + (a + 0.5) / S) * bh[r], "
    "x0[r] + (j + (q + 0.5) / S) * bw[r]], a, q)",
    "inputs": ["x", "bi", "y0", "x0", "bh", "bw"],
    "attrs": {"S": "int", "PH": "int", "PW": "int"},
    "ranges": {"i": "PH", "j": "PW", "a": "S", "q": "S"},
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("sampled")


_modules: dict = {}


def module(table: dict, target: str, folder, name: str = "Sampled"):
    key = (repr(sorted(table.items())), target, name)
    if key not in _modules:
        spec = parse_op(name, table, "test.toml")
        text = module_text(spec, "test.toml", target)
        stem = f"sampled_{target}_{len(_modules)}"
        _modules[key] = load_module(text, folder, stem)
    return _modules[key]


def to(target: str, array):
    if target == "tensorflow":
        return tf.constant(array)
    if target == "pytorch":
        return torch.tensor(array)
    return jnp.asarray(array)


def numpy(value):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.detach().numpy()
    return np.asarray(value)


def run(table, target, folder, inputs, grad, attrs=None):
    """forward and vjp of the generated module, as NumPy."""
    m = module(table, target, folder)
    args = [to(target, a) for a in inputs]
    attrs = attrs or {}
    out = m.forward(*args, **attrs)
    grads = m.vjp(*args, to(target, grad), **attrs)
    return numpy(out), [numpy(g) for g in grads]


# -- references ---------------------------------------------------------------------------


def bilinear(x: np.ndarray, image, h, w) -> np.ndarray:
    """torchvision's deform_conv2d `bilinear_interpolate` (ops/cpu/deform_conv2d_kernel.cpp),
    for many points at once: x[image] (all channels, last) at rows h and columns w, the
    four neighbours of each point weighted by the fractions, each one outside the image
    (or an image index outside the batch) reading zero."""
    batch, _, height, width = x.shape
    h0, w0 = np.floor(h), np.floor(w)
    lh, lw = h - h0, w - w0
    total = 0.0
    for dy, wy in ((0, 1 - lh), (1, lh)):
        for dx, wx in ((0, 1 - lw), (1, lw)):
            yy, xx = (h0 + dy).astype(int), (w0 + dx).astype(int)
            inside = (0 <= yy) & (yy < height) & (0 <= xx) & (xx < width)
            inside &= (0 <= image) & (image < batch)
            value = x[
                np.clip(image, 0, batch - 1),
                :,
                np.clip(yy, 0, height - 1),
                np.clip(xx, 0, width - 1),
            ]
            total = total + (wy * wx * inside)[..., None] * value
    return total


def deform_conv_loop(x, w, off, s, p):
    """torchvision.ops.deform_conv2d (one offset group, no mask, no dilation): offset
    channel 2*(u*KW + v) moves tap (u, v) along the rows, 2*(u*KW + v) + 1 along columns;
    y[b, :, i, j] = Σ_{c,u,v} w[:, c, u, v] * x[b, c] at (s*i - p + u + dh, s*j - p + v + dw)."""
    batch = x.shape[0]
    _, _, kh, kw = w.shape
    out_h, out_w = off.shape[2], off.shape[3]
    b, u, v, i, j = np.meshgrid(
        range(batch), range(kh), range(kw), range(out_h), range(out_w), indexing="ij"
    )
    h = s * i - p + u + off[b, 2 * (u * kw + v), i, j]
    ww = s * j - p + v + off[b, 2 * (u * kw + v) + 1, i, j]
    columns = bilinear(x, b, h, ww)  # (b, u, v, i, j, c)
    return np.einsum("ocuv,buvijc->boij", w, columns)


def roi_align_loop(x, bi, y0, x0, bh, bw, S, PH, PW):
    """ROI Align with a fixed sampling ratio S: bin (i, j) of roi r is the mean of S x S
    bilinear samples at y0 + (i + (a + 0.5) / S) * bh, x0 + (j + (q + 0.5) / S) * bw, reading
    zero outside the image (torchvision clamps samples within one pixel of the border to it
    instead)."""
    r, i, j, a, q = np.meshgrid(
        range(len(bi)), range(PH), range(PW), range(S), range(S), indexing="ij"
    )
    h = y0[r] + (i + (a + 0.5) / S) * bh[r]
    w = x0[r] + (j + (q + 0.5) / S) * bw[r]
    samples = bilinear(x, bi[r], h, w)  # (r, i, j, a, q, c)
    return samples.mean(axis=(3, 4)).transpose(0, 3, 1, 2)


def numpy_vjp(f, inputs, grad, wrt, step=1e-6):
    """Central differences of sum(grad * f(inputs)) for the inputs at `wrt`."""
    result = []
    for k in wrt:
        g = np.zeros_like(inputs[k])
        for idx in np.ndindex(inputs[k].shape):
            plus = [a.copy() for a in inputs]
            minus = [a.copy() for a in inputs]
            plus[k][idx] += step
            minus[k][idx] -= step
            g[idx] = np.sum(grad * (f(*plus) - f(*minus))) / (2 * step)
        result.append(g)
    return result


def grid_sample_torch(x, g, grad):
    xt = torch.tensor(x, requires_grad=True)
    gt = torch.tensor(g, requires_grad=True)
    yt = torch.nn.functional.grid_sample(
        xt, gt, mode="bilinear", padding_mode="zeros", align_corners=True
    )
    yt.backward(torch.tensor(grad))
    return yt.detach().numpy(), xt.grad.numpy(), gt.grad.numpy()


# -- grid_sample ----------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_grid_sample_is_torchs_with_its_gradients(folder, target):
    """Every index a different size; grid points past the border (|g| up to 1.3) read
    zero-padded neighbours, as padding_mode="zeros"."""
    rng = np.random.default_rng(0)
    n, c, h, w, ho, wo = 2, 3, 5, 4, 6, 7
    x = rng.standard_normal((n, c, h, w))
    g = rng.uniform(-1.3, 1.3, (n, ho, wo, 2))
    grad = rng.standard_normal((n, c, ho, wo))
    y, (gx, gg) = run(GRID_SAMPLE, target, folder, [x, g], grad)
    want_y, want_gx, want_gg = grid_sample_torch(x, g, grad)
    np.testing.assert_allclose(y, want_y, atol=1e-12)
    np.testing.assert_allclose(gx, want_gx, atol=1e-12)
    np.testing.assert_allclose(gg, want_gg, atol=1e-12)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch"])  # JAX: the test above
def test_grid_sample_at_integer_positions_takes_torchs_one_sided_gradient(folder, target):
    """Grid points exactly on pixels (and on the borders, ±1): the value is the pixel and
    the grid's gradient the forward difference x[p + 1] - x[p] (zero past the last pixel),
    as in aten/src/ATen/native/GridSampler.cpp."""
    rng = np.random.default_rng(1)
    n, c, h, w, ho, wo = 1, 2, 5, 3, 4, 5
    x = rng.standard_normal((n, c, h, w))
    rows = rng.integers(0, h, (n, ho, wo))
    cols = rng.integers(0, w, (n, ho, wo))
    rows[0, 1, 2] = 2  # a pixel inside, checked by hand below
    g = np.stack([cols / (w - 1) * 2 - 1, rows / (h - 1) * 2 - 1], axis=-1)
    g[0, 0, 0] = [-1.0, -1.0]
    g[0, 0, 1] = [1.0, 1.0]
    grad = rng.standard_normal((n, c, ho, wo))
    y, (gx, gg) = run(GRID_SAMPLE, target, folder, [x, g], grad)
    want_y, want_gx, want_gg = grid_sample_torch(x, g, grad)
    np.testing.assert_allclose(y, want_y, atol=1e-12)
    np.testing.assert_allclose(gx, want_gx, atol=1e-12)
    np.testing.assert_allclose(gg, want_gg, atol=1e-12)
    # The row gradient at a pixel p inside: grad * (H-1)/2 * (x[p+1] - x[p]).
    q = cols[0, 1, 2]
    difference = x[0, :, 3, q] - x[0, :, 2, q]
    np.testing.assert_allclose(
        gg[0, 1, 2, 1], np.sum(grad[0, :, 1, 2] * difference) * (h - 1) / 2, atol=1e-12
    )


def test_grid_sample_matches_finite_differences(folder, target="tensorflow"):
    """(Every target's gradient is torch's above; this one also against differences.)"""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 4, 3))
    g = rng.uniform(-0.9, 0.9, (1, 2, 3, 2))
    grad = rng.standard_normal((1, 2, 2, 3))
    _, (gx, gg) = run(GRID_SAMPLE, target, folder, [x, g], grad)

    def f(x, g):
        return grid_sample_torch(x, g, np.zeros_like(grad))[0]

    want_gx, want_gg = numpy_vjp(f, [x, g], grad, [0, 1])
    np.testing.assert_allclose(gx, want_gx, atol=1e-7)
    np.testing.assert_allclose(gg, want_gg, atol=1e-7)


# -- deformable convolution -------------------------------------------------------------------


def deform_inputs(seed=3, batch=2, in_c=3, height=7, width=6, out_c=4, kh=3, kw=2, s=2, p=1):
    rng = np.random.default_rng(seed)
    out_h = (height + 2 * p - kh) // s + 1
    out_w = (width + 2 * p - kw) // s + 1
    x = rng.standard_normal((batch, in_c, height, width))
    w = rng.standard_normal((out_c, in_c, kh, kw))
    off = rng.uniform(-2.5, 2.5, (batch, 2 * kh * kw, out_h, out_w))
    grad = rng.standard_normal((batch, out_c, out_h, out_w))
    return x, w, off, grad, {"s": s, "p": p}


@pytest.mark.parametrize("target", TARGETS)
def test_deformable_conv_is_torchvisions_loop(folder, target):
    x, w, off, grad, attrs = deform_inputs()
    y, grads = run(DEFORM_CONV, target, folder, [x, w, off], grad, attrs)

    def f(x, w, off):
        return deform_conv_loop(x, w, off, attrs["s"], attrs["p"])

    np.testing.assert_allclose(y, f(x, w, off), atol=1e-12)
    want = numpy_vjp(f, [x, w, off], grad, [0, 1, 2])
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-6)


# -- ROI Align --------------------------------------------------------------------------------


def roi_inputs(seed=4):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 9, 8))
    bi = np.array([1, 0, 1, 5], dtype=np.int64)  # roi 3 names no image: zeros
    y0 = np.array([0.3, -1.6, 4.2, 1.0])  # roi 1 starts above the image
    x0 = np.array([1.1, 2.7, -0.4, 0.5])
    bh = np.array([1.7, 2.3, 1.9, 1.1])  # roi 2 ends below it
    bw = np.array([1.3, 0.9, 2.6, 1.4])
    attrs = {"S": 2, "PH": 3, "PW": 4}
    grad = rng.standard_normal((4, 3, 3, 4))
    return [x, bi, y0, x0, bh, bw], grad, attrs


@pytest.mark.parametrize("target", TARGETS)
def test_roi_align_is_the_loop_with_zero_padding(folder, target):
    inputs, grad, attrs = roi_inputs()
    y, grads = run(ROI_ALIGN, target, folder, inputs, grad, attrs)
    x, bi, y0, x0, bh, bw = inputs

    def f(x, y0, x0, bh, bw):
        return roi_align_loop(x, bi, y0, x0, bh, bw, **attrs)

    np.testing.assert_allclose(y, f(x, y0, x0, bh, bw), atol=1e-12)
    assert grads[1] is None  # bi: an index tensor
    floats = [x, y0, x0, bh, bw]
    want = numpy_vjp(f, floats, grad, range(5))
    for got, expected in zip([grads[0], *grads[2:]], want, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-6)


# -- ROI Pool: floor and where ------------------------------------------------------------

ROI_POOL = {
    "formula": "y[r,c,i,j] = max(where(h >= floor(y0[r] + i * bh[r]) and "
    "h < -floor(-(y0[r] + (i + 1) * bh[r])) and w >= floor(x0[r] + j * bw[r]) and "
    "w < -floor(-(x0[r] + (j + 1) * bw[r])), x[bi[r], c, h, w], -inf), h, w)",
    "inputs": ["x", "bi", "y0", "x0", "bh", "bw"],
    "attrs": {"PH": "int", "PW": "int"},
    "ranges": {"i": "PH", "j": "PW"},
}


def roi_pool_loop(x, bi, y0, x0, bh, bw, PH, PW):
    """torchvision's roi_pool (ops/cpu/roi_pool_kernel.cpp) from the rounded roi start
    (y0, x0) and the bin sizes: bin (i, j) is the max over rows floor(i*bh) + y0 up to
    ceil((i + 1)*bh) + y0 (exclusive), clipped to the image, and the same for columns."""
    height, width = x.shape[2], x.shape[3]
    y = np.zeros((len(bi), x.shape[1], PH, PW))
    for r, i, j in itertools.product(range(len(bi)), range(PH), range(PW)):
        h0 = min(max(math.floor(i * bh[r]) + int(y0[r]), 0), height)
        h1 = min(max(math.ceil((i + 1) * bh[r]) + int(y0[r]), 0), height)
        w0 = min(max(math.floor(j * bw[r]) + int(x0[r]), 0), width)
        w1 = min(max(math.ceil((j + 1) * bw[r]) + int(x0[r]), 0), width)
        assert h0 < h1 and w0 < w1  # no empty bin here (torchvision gives 0, we -inf)
        y[r, :, i, j] = x[bi[r], :, h0:h1, w0:w1].max(axis=(1, 2))
    return y


@pytest.mark.parametrize("target", ["tensorflow", "pytorch"])  # JAX's floor: grid_sample
def test_roi_pool_written_with_floor_and_where_is_torchvisions_loop(folder, target):
    """The bin edges are floors of float expressions in value comparisons with the
    indices h, w; the gradient goes to each bin's maximum, and floor passes none to the
    roi coordinates."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 7, 9))
    bi = np.array([1, 0, 1], dtype=np.int64)
    y0 = np.array([0.0, 2.0, -1.0])
    x0 = np.array([1.0, 3.0, 6.0])  # roi 2 runs past the right border
    bh = np.array([1.6, 1.2, 2.1])
    bw = np.array([1.3, 2.2, 1.7])
    attrs = {"PH": 3, "PW": 2}
    grad = rng.standard_normal((3, 3, 3, 2))
    y, grads = run(ROI_POOL, target, folder, [x, bi, y0, x0, bh, bw], grad, attrs)
    np.testing.assert_allclose(y, roi_pool_loop(x, bi, y0, x0, bh, bw, **attrs), atol=1e-12)
    (want_gx,) = numpy_vjp(lambda x: roi_pool_loop(x, bi, y0, x0, bh, bw, **attrs), [x], grad, [0])
    np.testing.assert_allclose(grads[0], want_gx, atol=1e-7)
    assert grads[1] is None
    for g in grads[2:]:
        np.testing.assert_array_equal(g, 0)


def test_floor_is_a_value_with_zero_gradient(folder):
    table = {"formula": "y[b,i] = floor(x[b,i]) * x[b,i] + x[b, floor(2.5 * x[b,i])]"}
    program = build(parse_op("FloorRead", table, "test.toml"))
    gathers = [lv for lv in program.intermediates if lv.gather and lv.gather.source == "x"]
    assert len(gathers) == 1  # an integer position reads one element, not two corners
    x = np.array([[0.3, 1.7, -0.2, 2.9], [1.0, 0.5, 3.5, -1.5]])
    grad = np.arange(8.0).reshape(2, 4) - 3
    y, (gx,) = run(table, "tensorflow", folder, [x], grad)
    # floor(2.5 x) is an integer: the read is that element (0 outside), with no gradient
    # through the position.
    rows = np.floor(2.5 * x).astype(int)
    inside = (rows >= 0) & (rows < 4)
    picked = np.where(inside, np.take_along_axis(x, np.clip(rows, 0, 3), 1), 0)
    np.testing.assert_allclose(y, np.floor(x) * x + picked, atol=1e-12)
    want = np.floor(x) * grad
    for b, i in np.ndindex(x.shape):
        if inside[b, i]:
            want[b, rows[b, i]] += grad[b, i]
    np.testing.assert_allclose(gx, want, atol=1e-12)


# -- training, unknown dims, explain, refusals ------------------------------------------------


def test_a_training_step_in_every_target_is_torchs_grid_sample_step(folder):
    """loss = Σ y², its gradient by each framework's own machinery through the generated
    module, one SGD step, the loss after: all equal to the same step through
    torch.nn.functional.grid_sample."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 5, 4))
    g = rng.uniform(-1.1, 1.1, (2, 6, 7, 2))
    lr = 0.05

    def torch_step(f):
        xt, gt = torch.tensor(x, requires_grad=True), torch.tensor(g, requires_grad=True)
        loss = f(xt, gt).square().sum()
        loss.backward()
        with torch.no_grad():
            after = f(xt - lr * xt.grad, gt - lr * gt.grad).square().sum()
        return float(loss.detach()), xt.grad.numpy(), gt.grad.numpy(), float(after)

    want = torch_step(lambda a, b: torch.nn.functional.grid_sample(a, b, "bilinear", "zeros", True))
    got = {"pytorch": torch_step(module(GRID_SAMPLE, "pytorch", folder).forward)}
    m = module(GRID_SAMPLE, "tensorflow", folder)
    xv, gv = tf.Variable(x), tf.Variable(g)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(m.forward(xv, gv)))
    dx, dg = tape.gradient(loss, [xv, gv])
    xv.assign_sub(lr * dx)
    gv.assign_sub(lr * dg)
    after = tf.reduce_sum(tf.square(m.forward(xv, gv)))
    got["tensorflow"] = (float(loss), dx.numpy(), dg.numpy(), float(after))
    m = module(GRID_SAMPLE, "jax", folder)

    def jax_loss(a, b):
        return jnp.sum(jnp.square(m.forward(a, b)))

    value, (dx, dg) = jax.value_and_grad(jax_loss, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(g))
    after = jax_loss(jnp.asarray(x) - lr * dx, jnp.asarray(g) - lr * dg)
    got["jax"] = (float(value), np.asarray(dx), np.asarray(dg), float(after))
    for target, step in got.items():
        for a, b in zip(step, want, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-10, err_msg=target)


def test_unknown_dims_under_tf_function(folder):
    """Every size (and the lets H, W) unknown while tracing; two calls, two shapes."""
    m = module(GRID_SAMPLE, "tensorflow", folder)
    spec = [tf.TensorSpec([None] * 4, tf.float64), tf.TensorSpec([None, None, None, 2], tf.float64)]

    @tf.function(input_signature=spec)
    def step(x, g):
        with tf.GradientTape() as tape:
            tape.watch([x, g])
            y = m.forward(x, g)
            loss = tf.reduce_sum(y * y)
        return (y, *tape.gradient(loss, [x, g]))

    rng = np.random.default_rng(7)
    for shape, grid in (((1, 2, 4, 6), (1, 3, 2, 2)), ((2, 1, 3, 5), (2, 4, 3, 2))):
        x, g = rng.standard_normal(shape), rng.uniform(-1.2, 1.2, grid)
        y, dx, dg = step(tf.constant(x), tf.constant(g))
        want_y = grid_sample_torch(x, g, np.zeros(y.shape))[0]
        _, want_dx, want_dg = grid_sample_torch(x, g, 2 * want_y)
        np.testing.assert_allclose(y.numpy(), want_y, atol=1e-12)
        np.testing.assert_allclose(dx.numpy(), want_dx, atol=1e-12)
        np.testing.assert_allclose(dg.numpy(), want_dg, atol=1e-12)


def test_explain_shows_the_corners_and_their_weights():
    text = explain(build(parse_op("GridSample", GRID_SAMPLE, "test.toml")))
    # Each position and its fraction are intermediates, each corner a gather at
    # floor(position) + 0 or 1, and the sample is their weighted sum.
    assert "_s2[n,h,w] = (H - 1)*(_g1[n,h,w] + 1)/2" in text
    assert "_s3[n,h,w] = -floor(_s2[n,h,w]) + _s2[n,h,w]" in text
    assert (
        "_g10[n,h,w,c] = x[n,c,floor(_s2[n,h,w]) + 1,floor(_s5[n,h,w]) + 1] (0 outside x)" in text
    )
    # the weighted sum nests one interpolation per axis, and the derivative in a fraction
    # subtracts the neighbours first (interpolation.py)
    assert "(1 - _s3[n,h,w])*((1 - _s6[n,h,w])*_g7[n,h,w,c] + _g8[n,h,w,c]*_s6[n,h,w])" in text
    assert "(-_g7[n,h,w,c] + _g9[n,h,w,c])" in text


@pytest.mark.parametrize(
    ("formula", "message", "caret"),
    [
        (
            "y[b,i] = W[idx[b,i], 0] + idx[b, i / 2]",
            "tensor 'idx' is an integer index tensor; a float position cannot interpolate it",
            "idx[b, i / 2]",
        ),
        (
            "y[b,i] = W[b, i / 2] + idx[b, i] * W[b, idx[b,i]]",
            "tensor 'idx' is used both as an index tensor",
            "idx[b,i]]",
        ),
    ],
)
def test_what_cannot_be_sampled_is_refused_with_a_caret(formula, message, caret):
    table = {"formula": formula, "ranges": {"i": "3"}}
    with pytest.raises(SymgradError) as error:
        build(parse_op("Refused", table, "test.toml"))
    assert message in error.value.message
    assert error.value.column == formula.index(caret)


def test_an_internal_tensor_read_at_a_float_position_is_refused():
    table = {
        "formula": ["h[b,i] = x[b,i] * 2", "y[b,i] = h[b, i / 2]"],
        "outputs": ["y"],
    }
    with pytest.raises(SymgradError) as error:
        build(parse_op("Refused", table, "test.toml"))
    assert "internal tensor 'h' is read at a float position" in error.value.message
    assert error.value.column == table["formula"][1].index("h[b, i / 2]")


def test_symgrad_checks_reference_interpolates_like_torch():
    """`symgrad check` without a library holds the generated forward against the dense
    evaluation of the formula (symgrad/reference.py): its interpolation is torch's too."""
    from symgrad.reference import evaluate_op

    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 5, 4))
    g = rng.uniform(-1.3, 1.3, (2, 6, 7, 2))
    (y,) = evaluate_op(
        [GRID_SAMPLE["formula"]], {"x": tf.constant(x), "g": tf.constant(g)}, {"H": 5, "W": 4}
    )
    np.testing.assert_allclose(y.numpy(), grid_sample_torch(x, g, np.zeros((2, 3, 6, 7)))[0])


@pytest.mark.parametrize("target", TARGETS)
def test_deformable_conv_runs_in_chunks_under_a_small_budget(tmp_path, target):
    """The gathered columns (B·C·KH·KW·H·W, four corners) outgrow the inputs: the module
    tiles the output rows i, and in chunks it is still the loop, forward and gradients."""
    spec = parse_op("DeformChunks", DEFORM_CONV, "test.toml")
    m = load_module(module_text(spec, "test.toml", target), tmp_path, f"deform_chunks_{target}")
    assert "chunks of i" in m.__doc__
    x, w, off, grad, attrs = deform_inputs(seed=9)
    whole_y, whole_grads = run(DEFORM_CONV, target, tmp_path, [x, w, off], grad, attrs)
    m.MAX_TEMP_BYTES = 1024  # one output row per chunk
    args = [to(target, a) for a in (x, w, off)]
    assert m._tile_plan(*args, **attrs) is not None
    y = numpy(m.forward(*args, **attrs))
    grads = [numpy(g) for g in m.vjp(*args, to(target, grad), **attrs)]
    np.testing.assert_allclose(y, deform_conv_loop(x, w, off, **attrs), atol=1e-12)
    np.testing.assert_allclose(y, whole_y, atol=1e-12)
    for got, want in zip(grads, whole_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("target", TARGETS)
def test_grid_sample_runs_in_chunks_of_output_rows_and_is_still_torchs(tmp_path, target):
    """A bilinear read's corners are no larger than the output but number about ten
    (symgrad/sampled_temps.py): the module tiles the output rows h under a small budget,
    is exact in chunks (forward and both gradients, float64), and below the budget runs
    untiled as before."""
    spec = parse_op("GridChunks", GRID_SAMPLE, "test.toml")
    m = load_module(module_text(spec, "test.toml", target), tmp_path, f"grid_chunks_{target}")
    assert "chunks of h" in m.__doc__
    rng = np.random.default_rng(11)
    n, c, h, w, ho, wo = 2, 3, 5, 4, 6, 7
    x = rng.standard_normal((n, c, h, w))
    g = rng.uniform(-1.3, 1.3, (n, ho, wo, 2))
    grad = rng.standard_normal((n, c, ho, wo))
    args = [to(target, a) for a in (x, g)]
    assert m._tile_plan(*args) is None  # the default budget: untiled, as before
    whole_y = numpy(m.forward(*args))
    whole_grads = [numpy(t) for t in m.vjp(*args, to(target, grad))]
    m.MAX_TEMP_BYTES = 64  # one output row per chunk
    assert m._tile_plan(*args) is not None
    y = numpy(m.forward(*args))
    grads = [numpy(t) for t in m.vjp(*args, to(target, grad))]
    want_y, want_gx, want_gg = grid_sample_torch(x, g, grad)
    np.testing.assert_allclose(y, want_y, atol=1e-12)
    np.testing.assert_allclose(y, whole_y, atol=1e-12)
    for got, whole, want in zip(grads, whole_grads, (want_gx, want_gg), strict=True):
        np.testing.assert_allclose(got, whole, atol=1e-12)
        np.testing.assert_allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_nan_or_infinite_position_reads_outside_in_every_target(tmp_path, target, bad):
    """A position that is NaN or ±inf has no neighbours: its corners read zero, the forward
    and its grid gradient are NaN (weights NaN times zero), and x's gradient gets nothing from
    it, as torch's grid_sample, untiled and in chunks (and for JAX under jit too). XLA casts
    NaN to 0: JAX read x[..., 0:2, 0:2] and scattered NaN into x's gradient there."""
    spec = parse_op("GridBad", GRID_SAMPLE, "test.toml")
    m = load_module(module_text(spec, "test.toml", target), tmp_path, f"grid_bad_{target}")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 2, 4, 3))
    g = rng.uniform(-1.2, 1.2, (1, 3, 2, 2))
    g[0, 0, 0, :] = bad  # both coordinates
    g[0, 1, 1, 1] = bad  # the row only
    g[0, 2, 0, 0] = bad  # the column only
    grad = rng.standard_normal((1, 2, 3, 2))
    want = grid_sample_torch(x, g, grad)
    assert np.isnan(want[0]).any() and not np.isnan(want[1]).any()  # the case at issue
    args = [to(target, a) for a in (x, g)]
    runs = [(m.forward, m.vjp)]
    if target == "jax":
        runs.append((jax.jit(m.forward), jax.jit(m.vjp)))
    for budget in (None, 1):
        if budget is not None:
            m.MAX_TEMP_BYTES = budget
            assert m._tile_plan(*args) is not None
        for forward, vjp in runs:
            y = numpy(forward(*args))
            grads = [numpy(t) for t in vjp(*args, to(target, grad))]
            for got, expected in zip([y, *grads], want, strict=True):
                np.testing.assert_allclose(got, expected, atol=1e-12, err_msg=f"{budget}")


class _CastsNanToZero:
    """TensorFlow as it runs on CUDA for a cast of a float to an integer: NaN gives 0 (the
    CPU gives int64's least value, outside every input, so a test on CPU alone cannot tell a
    module that relies on that cast from one that does not)."""

    def __init__(self):
        self._tf = tf

    def __getattr__(self, name):
        return getattr(self._tf, name)

    def cast(self, x, dtype, name=None):
        x = tf.convert_to_tensor(x)
        if x.dtype.is_floating and tf.as_dtype(dtype).is_integer:
            x = tf.where(tf.math.is_nan(x), tf.zeros_like(x), x)
        return tf.cast(x, dtype, name=name)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch"])
def test_a_nan_position_reads_outside_where_a_cast_of_nan_gives_zero(tmp_path, target):
    """A NaN position reads outside in TF and PyTorch whatever their cast of NaN gives: on
    CUDA it gives 0 (XLA's does too), which read x[..., 0:2, 0:2] and scattered NaN into
    x's gradient there; every target now takes NaN as -inf before its cast."""
    spec = parse_op("GridNan", GRID_SAMPLE, "test.toml")
    m = load_module(module_text(spec, "test.toml", target), tmp_path, f"grid_nan_{target}")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 2, 4, 3))
    g = rng.uniform(-1.2, 1.2, (1, 3, 2, 2))
    g[0, 0, 0, :] = math.nan
    g[0, 2, 0, 0] = math.nan
    grad = rng.standard_normal((1, 2, 3, 2))
    want = grid_sample_torch(x, g, grad)
    assert not np.isnan(want[1]).any()
    args = [to(target, a) for a in (x, g)]
    if target == "tensorflow":
        m.tf = _CastsNanToZero()

        def runs():
            return [m.forward(*args), *m.vjp(*args, to(target, grad))]

    else:
        from torch.overrides import TorchFunctionMode

        class CastsNanToZero(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is torch.Tensor.to and args[0].is_floating_point():
                    dtypes = [
                        a for a in (*args[1:], kwargs.get("dtype")) if isinstance(a, torch.dtype)
                    ]
                    if torch.int64 in dtypes:
                        args = (torch.where(args[0].isnan(), 0.0, args[0]), *args[1:])
                return func(*args, **kwargs)

        def runs():
            with CastsNanToZero():
                return [m.forward(*args), *m.vjp(*args, to(target, grad))]

    for budget in (None, 1):
        if budget is not None:
            m.MAX_TEMP_BYTES = budget
        for got, expected in zip([numpy(t) for t in runs()], want, strict=True):
            np.testing.assert_allclose(got, expected, atol=1e-12, err_msg=f"{budget}")


def test_non_integer_coefficients_in_brackets_interpolate(folder):
    """`A[b, 0.5*i]` and `A[b, i + 0.5]` were refused as non-integer index expressions;
    they are sampled reads: halfway between neighbours, the last one past the end."""
    a = np.array([[1.0, 3.0, 7.0], [2.0, -2.0, 4.0]])
    grad = np.arange(1.0, 11.0).reshape(2, 5)
    table = {"formula": "y[b,i] = A[b, 0.5*i] + A[b, i / 2 + 0.5]", "ranges": {"i": "5"}}
    y, (ga,) = run(table, "tensorflow", folder, [a], grad)
    padded = np.pad(a, ((0, 0), (0, 2)))
    at = np.arange(5) / 2
    lower, fraction = np.floor(at).astype(int), at - np.floor(at)
    half = padded[:, lower] * (1 - fraction) + padded[:, lower + 1] * fraction
    at = at + 0.5
    lower, fraction = np.floor(at).astype(int), at - np.floor(at)
    shifted = padded[:, lower] * (1 - fraction) + padded[:, lower + 1] * fraction
    np.testing.assert_allclose(y, half + shifted, atol=1e-12)
    (want,) = numpy_vjp(
        lambda a: run(table, "tensorflow", folder, [a], grad)[0], [a], grad, [0], step=1e-3
    )
    np.testing.assert_allclose(ga, want, atol=1e-9)


def test_a_constant_float_position_and_a_float_attr_interpolate(folder):
    """`x[b, 1.5]` (a constant position: it crashed the bounds analysis) and a position
    scaled by a float attr."""
    x = np.array([[1.0, 2.0, 4.0], [3.0, 5.0, 9.0]])
    y, (gx,) = run({"formula": "y[b] = x[b, 1.5]"}, "tensorflow", folder, [x], np.array([1.0, 2.0]))
    np.testing.assert_allclose(y, [3.0, 7.0])
    np.testing.assert_allclose(gx, [[0, 0.5, 0.5], [0, 1, 1]])
    table = {
        "formula": "y[b,i] = x[b, i * scale]",
        "attrs": {"scale": "float"},
        "ranges": {"i": "3"},
    }
    y, (gx,) = run(table, "tensorflow", folder, [x], np.ones((2, 3)), {"scale": 0.75})
    np.testing.assert_allclose(y, [[1.0, 1.75, 3.0], [3.0, 4.5, 7.0]])
    np.testing.assert_allclose(gx, [[1.25, 1.25, 0.5]] * 2)


def test_a_float_positions_name_that_is_no_input_is_refused():
    with pytest.raises(SymgradError, match="`float_positions` names 'of', which is not an input"):
        build(parse_op("Typo", {**GRID_SAMPLE, "float_positions": ["of"]}, "test.toml"))


def test_explain_takes_float_positions_as_a_flag(capsys):
    from symgrad.cli import main

    args = ["explain", DEFORM_CONV["formula"], "--attr", "s=int", "--attr", "p=int"]
    args += ["--attr", "KW=int", "--float", "off"]
    assert main(args) == 0
    assert "_g1[b,u,v,i,j] = off[b,2*KW*u + 2*v,i,j] (0 outside off)" in capsys.readouterr().out


def test_the_repos_ops_are_the_ones_tested_here():
    """symgrad.toml's GridSample, DeformConv2d, RoiAlign and RoiPool are the tables above,
    and the committed PyTorch GridSample module is torch's grid_sample."""
    import importlib
    import sys
    from pathlib import Path

    from symgrad.spec import load_spec

    root = Path(__file__).resolve().parent.parent
    ops = {op.name: op for op in load_spec(root / "symgrad.toml").ops}
    tables = {
        "GridSample": GRID_SAMPLE,
        "DeformConv2d": DEFORM_CONV,
        "RoiAlign": ROI_ALIGN,
        "RoiPool": ROI_POOL,
    }
    for name, table in tables.items():
        here = replace(parse_op(name, table, "symgrad.toml"), source=ops[name].source)
        assert here == ops[name], name
    sys.path.insert(0, str(root))
    try:
        committed = importlib.import_module("generated_torch.grid_sample")
    finally:
        sys.path.remove(str(root))
    rng = np.random.default_rng(10)
    x, g = rng.standard_normal((2, 3, 5, 4)), rng.uniform(-1.2, 1.2, (2, 6, 7, 2))
    y = committed.forward(torch.tensor(x), torch.tensor(g)).numpy()
    np.testing.assert_allclose(y, grid_sample_torch(x, g, np.zeros((2, 3, 6, 7)))[0], atol=1e-12)

"""An eleventh set of real ops in their published layouts, none of them in the earlier
adversarial files, written from the kernels' index arithmetic: mmcv's corner pool
(TopPool, a max over the rows at and below each row), apex's softmax cross-entropy
with label smoothing (contrib/xentropy), Megatron's scaled_masked_softmax (a uint8
mask that sets a logit to -10000, not -inf), TransformerEngine's fused RoPE (the
non-interleaved rotate-half, over the first d2 of d channels, freqs [s, 1, 1, d2]; and
interleaved, pairs (2i, 2i + 1) read through d % 2; and rotate-half again as one split
read at (d + d2/2) % d2) and compressai's GDN (x / sqrt(beta + gamma x^2) across
channels).

Each is checked against a NumPy transcription of its kernel, forward and backward
(float64, 1e-12), in TensorFlow, PyTorch and JAX; against TF float64 autodiff over the
reference evaluator and finite differences (harness.check); the corner pool (the only
one with a temporary past its input, the [n,c,h,s,w] masked rows) in chunks at a
1-byte budget against the untiled module in the three targets; and with hostile
values: float32 logits in the hundreds, RoPE angles near 1e3, ties in the max (split
equally), zeros, labels outside the classes (-1, C, -C: read 0, never wrapped), empty
axes, and every size unknown under tf.function; second-order gradients through the
generated forward against TF's nested autodiff. A corner pool written with a range
that names the row (`s` over `x.shape[2] - h`) is refused by `symgrad generate`: exit
2, the op, the index and a caret, no traceback, nothing written.

Found: nothing silently wrong. Two kernels' backwards are not the adjoint of their
forwards, and symgrad's gradient is the adjoint (TF autodiff, finite differences):
Megatron's scaled_masked_softmax backward, scale * (g y - y sum(g y)), gives a fully
masked row (every logit -10000, a uniform output that does not depend on x) a
nonzero gradient (above 0.05 per entry in the test) where the derivative is 0; and
mmcv's top_pool backward sends a tie's whole gradient to the last (bottom-most) of
the tied rows (its scan up from the last row keeps the first strict maximum), where
symgrad splits it equally, as tf.reduce_max does. A mask compared with a constant
(`mask[b,0,i,j] == 1`) is a value, not an index tensor: an int32 mask is refused when
the op is called with a TypeError naming the op, the input and the float dtypes it
takes (the reference evaluator, a test tool, fails there with TF's own Equal dtype
error), so the mask is passed as float, with no gradient.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

from adversarial import TINY, as_numpy, chunks_equal_the_untiled_module, unknown_sizes_equal_eager
from frameworks import _enable_x64
from harness import Case, check, generate

BIG = 2**40
TARGETS = ("tensorflow", "pytorch", "jax")
LSE = "log(sum(exp(x[n,k]), k))"

REAL = {
    # mmcv/ops/csrc/pytorch/corner_pool.cpp, top_pool_forward: output = input, then for
    # ind = 1, 2, 4, ..: output[:, :, :H - ind] = max(output[:, :, :H - ind],
    # output[:, :, ind:]): each row the max of the rows at and below it
    "top_pool": Case(
        "y[n,c,h,w] = max(where(s >= h, x[n,c,s,w], -inf), s)",
        {"x": (2, 3, 5, 4)},
        ranges={"h": "x.shape[2]"},
        sizes={"h": 5},
    ),
    # apex/contrib/csrc/xentropy/xentropy_kernel.cu, cunn_SoftMaxXEntropyForward:
    # losses = (lse - sum_k x[k] / C) * smoothing - (x[label] - lse) * (1 - smoothing)
    "xentropy": Case(
        f"loss[n] = ({LSE} - mean(x[n,j], j)) * smoothing - (x[n, label[n]] - {LSE})"
        " * (1 - smoothing)",
        {"x": (4, 7)},
        attrs={"smoothing": 0.1},
        index_inputs={"label": ((4,), 0, 7)},
    ),
    # megatron/fused_kernels/scaled_masked_softmax.h, scaled_masked_softmax_warp_forward:
    # input [b, np, sq, sk], mask [b, 1, sq, sk]; an element whose mask is 1 is -10000,
    # else input * scale; then the softmax over sk
    "masked_softmax": Case(
        "y[b,h,i,j] = exp(where(mask[b,0,i,j] == 1, -10000, scale * x[b,h,i,j])) "
        "/ sum(exp(where(mask[b,0,i,k] == 1, -10000, scale * x[b,h,i,k])), k)",
        {"x": (2, 3, 4, 5), "mask": (2, 1, 4, 5)},
        attrs={"scale": 0.5},
        no_gradient=("mask",),
    ),
    # TransformerEngine transformer_engine/common/fused_rope/fused_rope.cu,
    # fused_rope_block_forward (not interleaved): t [s, b, h, d], freqs [s, 1, 1, d2];
    # for d < d2: t[d] cos + (d + d2/2 < d2 ? -t[d + d2/2] : t[d - d2/2]) sin, else t[d]
    "rope": Case(
        "y[s,b,h,d] = where(d < D2, t[s,b,h,d] * cos(f[s,0,0,d]) "
        "+ where(d < H2, -t[s,b,h,d + H2], t[s,b,h,d - H2]) * sin(f[s,0,0,d]), t[s,b,h,d])",
        {"t": (5, 2, 3, 8), "f": (5, 1, 1, 4)},
        ranges={"d": "t.shape[3]"},
        sizes={"d": 8},
        lets={"D2": "f.shape[3]", "H2": "f.shape[3] // 2"},
        let_values={"D2": 4, "H2": 2},
    ),
    # the same kernel, interleaved: the pairs (2i, 2i + 1) rotate, d even reads
    # -t[d + 1], d odd t[d - 1], both at freqs[d] (TransformerEngine's interleaved
    # freqs repeat each frequency for the two of a pair; any values are read as given)
    "rope_interleaved": Case(
        "y[s,b,h,d] = where(d < D2, t[s,b,h,d] * cos(f[s,0,0,d]) "
        "+ where(d % 2 == 0, -t[s,b,h,d + 1], t[s,b,h,d - 1]) * sin(f[s,0,0,d]), t[s,b,h,d])",
        {"t": (5, 2, 3, 8), "f": (5, 1, 1, 4)},
        ranges={"d": "t.shape[3]"},
        sizes={"d": 8},
        lets={"D2": "f.shape[3]"},
        let_values={"D2": 4},
    ),
    # compressai/layers/gdn.py, GDN.forward: norm = conv2d(x**2, gamma[:, :, None, None],
    # beta); out = x * rsqrt(norm)
    "gdn": Case(
        "y[b,c,h,w] = x[b,c,h,w] / sqrt(beta[c] + sum(gamma[c,j] * x[b,j,h,w]**2, j))",
        {"x": (2, 3, 4, 5), "beta": (3,), "gamma": (3, 3)},
        low=0.1,
        high=1.0,
    ),
}


# ------------------------------------------------------- the kernels, transcribed


def top_pool_kernel(x):
    """top_pool_forward (the doubling loop) and top_pool_backward (a scan up from the
    last row keeping the first strict maximum, a scatter-add of each row's gradient to
    it): (forward, backward)."""
    H = x.shape[2]
    out = x.copy()
    ind = 1
    while ind < H:
        out[:, :, : H - ind] = np.maximum(out[:, :, : H - ind], out[:, :, ind:].copy())
        ind <<= 1

    def backward(grad):
        g = np.zeros_like(x)
        if H == 0:
            return [g]
        max_val = x[:, :, H - 1].copy()
        max_ind = np.full(max_val.shape, H - 1)
        g[:, :, H - 1] = grad[:, :, H - 1]
        n, c, w = np.indices(max_val.shape)
        for i in range(1, H):
            row = x[:, :, H - i - 1]
            gt = row > max_val
            max_val[gt], max_ind[gt] = row[gt], H - i - 1
            np.add.at(g, (n, c, max_ind, w), grad[:, :, H - i - 1])
        return [g]

    return out, backward


def xentropy_kernel(x, label, smoothing):
    """cunn_SoftMaxXEntropyForward and cunn_SoftMaxXEntropyBackward: gradInput =
    gradOutput * (exp(x - lse) - (1 - smoothing) [k == label] - smoothing / C)."""
    N, C = x.shape
    m = x.max(1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(1, keepdims=True)))[:, 0]
    picked = x[np.arange(N), label]
    loss = (lse - x.sum(1) / C) * smoothing - (picked - lse) * (1 - smoothing)

    def backward(grad):
        onehot = np.zeros_like(x)
        onehot[np.arange(N), label] = 1
        p = np.exp(x - lse[:, None])
        return [grad[:, None] * (p - (1 - smoothing) * onehot - smoothing / C)]

    return loss, backward


def masked_softmax_kernel(x, mask, scale):
    """scaled_masked_softmax_warp_forward and _backward: grad_input = scale * (g y -
    y sum(g y)), the backward of an unmasked softmax (see the test on masked rows)."""
    z = np.where(mask == 1, -10000.0, scale * x)
    e = np.exp(z - z.max(-1, keepdims=True))
    y = e / e.sum(-1, keepdims=True)

    def backward(grad):
        return [scale * (grad * y - y * (grad * y).sum(-1, keepdims=True))]

    return y, backward


def rope_kernel(t, freqs):
    """fused_rope_block_forward and fused_rope_block_backward, not interleaved, and the
    freqs' gradient (which TransformerEngine's FusedRoPEFunc does not return)."""
    d2 = freqs.shape[3]
    half = d2 // 2
    cos, sin = np.cos(freqs), np.sin(freqs)
    out = t.copy()
    rot = np.concatenate([-t[..., half:d2], t[..., :half]], -1)
    out[..., :d2] = t[..., :d2] * cos + rot * sin

    def backward(grad):
        g = grad.copy()
        rot = np.concatenate(
            [grad[..., half:d2] * sin[..., half:d2], -grad[..., :half] * sin[..., :half]], -1
        )
        g[..., :d2] = grad[..., :d2] * cos + rot
        # the kernel returns no gradient for freqs; its derivative, summed over b and h
        turned = t[..., :d2] * -sin + np.concatenate([-t[..., half:d2], t[..., :half]], -1) * cos
        return [g, (grad[..., :d2] * turned).sum((1, 2), keepdims=True)]

    return out, backward


def rope_interleaved_kernel(t, freqs):
    """fused_rope_block_forward and fused_rope_block_backward, interleaved, and the
    freqs' gradient (not returned by the kernel)."""
    d2 = freqs.shape[3]
    cos, sin = np.cos(freqs), np.sin(freqs)

    def rotate(u):  # d even: -u[d + 1]; d odd: u[d - 1]
        r = np.empty_like(u)
        r[..., 0::2], r[..., 1::2] = -u[..., 1::2], u[..., 0::2]
        return r

    out = t.copy()
    out[..., :d2] = t[..., :d2] * cos + rotate(t[..., :d2]) * sin

    def backward(grad):
        g = grad.copy()
        gs = grad[..., :d2] * sin  # d even reads gs[d + 1]; d odd reads -gs[d - 1]
        back = np.empty_like(gs)
        back[..., 0::2], back[..., 1::2] = gs[..., 1::2], -gs[..., 0::2]
        g[..., :d2] = grad[..., :d2] * cos + back
        turned = t[..., :d2] * -sin + rotate(t[..., :d2]) * cos
        return [g, (grad[..., :d2] * turned).sum((1, 2), keepdims=True)]

    return out, backward


def gdn_kernel(x, beta, gamma):
    """compressai's GDN forward; its backward is autograd's, written out: with r =
    beta + gamma x^2, dx[j] = g[j] / sqrt(r[j]) - x[j] sum_c gamma[c,j] g[c] x[c] r[c]^-1.5,
    dbeta = -sum g x r^-1.5 / 2, dgamma[c,j] = -sum g[c] x[c] x[j]^2 r[c]^-1.5 / 2."""
    r = beta[None, :, None, None] + np.einsum("cj,bjhw->bchw", gamma, x**2)
    y = x / np.sqrt(r)

    def backward(grad):
        u = grad * x * r**-1.5
        gx = grad / np.sqrt(r) - x * np.einsum("cj,bchw->bjhw", gamma, u)
        return [gx, -u.sum((0, 2, 3)) / 2, -np.einsum("bchw,bjhw->cj", u, x**2) / 2]

    return y, backward


def _kernel_inputs(name, rng):
    """(inputs by name, attrs, (forward, backward)), each size its own."""
    if name == "top_pool":
        x = rng.standard_normal((3, 2, 7, 4))
        return {"x": x}, {}, top_pool_kernel(x)
    if name == "xentropy":
        x, label = rng.standard_normal((5, 9)), rng.integers(0, 9, 5).astype(np.int32)
        return {"x": x, "label": label}, {"smoothing": 0.2}, xentropy_kernel(x, label, 0.2)
    if name == "masked_softmax":
        x = rng.standard_normal((2, 3, 4, 6))
        mask = (rng.random((2, 1, 4, 6)) < 0.4).astype(np.float64)
        mask[:, :, :, 0] = 0  # no row fully masked (that row: the next test)
        return {"x": x, "mask": mask}, {"scale": 0.7}, masked_softmax_kernel(x, mask, 0.7)
    if name == "rope":
        t, f = rng.standard_normal((6, 2, 3, 10)), rng.uniform(-4, 4, (6, 1, 1, 6))
        return {"t": t, "f": f}, {}, rope_kernel(t, f)
    if name == "rope_interleaved":
        t, f = rng.standard_normal((6, 2, 3, 10)), rng.uniform(-4, 4, (6, 1, 1, 6))
        return {"t": t, "f": f}, {}, rope_interleaved_kernel(t, f)
    x = rng.uniform(-1, 1, (2, 4, 3, 5))
    beta, gamma = rng.uniform(0.5, 1.5, 4), rng.uniform(0, 0.3, (4, 4))
    return {"x": x, "beta": beta, "gamma": gamma}, {}, gdn_kernel(x, beta, gamma)


def _tensor(target, a):
    a = np.asarray(a)
    if target == "tensorflow":
        return tf.constant(a)
    if target == "pytorch":
        return torch.from_numpy(a.copy())
    import jax.numpy as jnp

    _enable_x64()
    return jnp.asarray(a)


def _run(module, target, named, cotangent, attrs, dtype, budget):
    """forward and vjp (as NumPy) of `module` at `budget`, float inputs cast to `dtype`."""
    module.MAX_TEMP_BYTES = budget
    args = [
        _tensor(target, named[n] if named[n].dtype == np.int32 else named[n].astype(dtype))
        for n in module.INPUTS
    ]
    y = module.forward(*args, **attrs)
    grads = module.vjp(*args, _tensor(target, np.asarray(cotangent).astype(dtype)), **attrs)
    return [as_numpy(t) for t in (y, *grads)]


def _differentiable(module, case):
    return [n for n in module.INPUTS if n not in case.no_gradient and n not in case.index_inputs]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(REAL))
def test_real_ops_equal_their_kernels(name, target, tmp_path):
    """float64: forward and vjp equal the NumPy transcription of the kernel and of its
    backward, untiled and at a 1-byte budget (the mask, the label: None)."""
    case = REAL[name]
    module = generate(case, tmp_path, prefix="Kernel11", target=target)
    named, attrs, (want, backward) = _kernel_inputs(name, np.random.default_rng(11))
    cotangent = np.random.default_rng(12).standard_normal(want.shape)
    expected = dict(zip(_differentiable(module, case), backward(cotangent), strict=True))
    for budget in (BIG, TINY):
        y, *grads = _run(module, target, named, cotangent, attrs, np.float64, budget)
        np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
        for n, g in zip(module.INPUTS, grads, strict=True):
            if n in expected:
                np.testing.assert_allclose(g, expected[n], rtol=1e-12, atol=1e-12, err_msg=n)
            else:
                assert g is None, n


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_ops_equal_tf_autodiff(name, tmp_path):
    """forward, vjp, the registered gradient and a tape against TF autodiff over the
    reference evaluator and finite differences."""
    check(REAL[name], generate(REAL[name], tmp_path, prefix="Check11"))


@pytest.mark.parametrize("target", TARGETS)
def test_top_pool_in_chunks_equals_the_untiled_module(target, tmp_path):
    """The corner pool's masked rows [n,c,h,s,w] outgrow x: at a 1-byte budget (several
    chunks) forward, every gradient path and a training step equal the untiled module."""
    chunks_equal_the_untiled_module(REAL["top_pool"], target, tmp_path, "Chunks11")


def test_only_the_corner_pool_plans_chunks(tmp_path):
    """The others hold no temporary past their inputs and outputs (a softmax's row sums,
    a gather at the label, a rotation, a channel contraction): no tile plan."""
    for name in ("xentropy", "masked_softmax", "rope", "rope_interleaved", "gdn"):
        for target in TARGETS:
            module = generate(REAL[name], tmp_path, "Plan11", target)
            assert not hasattr(module, "_tile_plan"), (name, target)
    assert hasattr(generate(REAL["top_pool"], tmp_path, "Plan11", "jax"), "_tile_plan")


# --------------------------------------------------- where the kernels' backwards differ


@pytest.mark.parametrize("target", TARGETS)
def test_a_fully_masked_row_gets_no_gradient_where_megatrons_backward_gives_one(target, tmp_path):
    """A row whose mask is all 1 is uniform (1/sk) whatever x is: its derivative is 0.
    Megatron's backward, scale * (g y - y sum(g y)), is nonzero there; symgrad's is 0
    (and equal to Megatron's on the other rows)."""
    module = generate(REAL["masked_softmax"], tmp_path, prefix="Masked11", target=target)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4, 6))
    mask = (rng.random((2, 1, 4, 6)) < 0.3).astype(np.float64)
    mask[:, :, :, 0] = 0
    mask[1, 0, 2] = 1  # row 2 of batch 1: every key masked
    want, backward = masked_softmax_kernel(x, mask, 0.7)
    g = rng.standard_normal(want.shape)
    named = {"x": x, "mask": mask}
    y, *grads = _run(module, target, named, g, {"scale": 0.7}, np.float64, BIG)
    gx = grads[module.INPUTS.index("x")]
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(y[1, :, 2], 1 / 6, rtol=1e-14)
    assert not gx[1, :, 2].any()
    (megatron,) = backward(g)
    assert np.abs(megatron[1, :, 2]).max() > 0.05
    keep = np.ones(y.shape, bool)
    keep[1, :, 2] = False
    np.testing.assert_allclose(gx[keep], megatron[keep], rtol=1e-12, atol=1e-12)


def _ties_split_equally(x, grad):
    """The gradient of y[h] = max(x[s], s >= h) with the tied rows splitting it."""
    g = np.zeros_like(x)
    H = x.shape[2]
    y = np.flip(np.maximum.accumulate(np.flip(x, 2), 2), 2)
    for h in range(H):
        hit = (x[:, :, h:] == y[:, :, h : h + 1]).astype(float)
        g[:, :, h:] += hit * (grad[:, :, h : h + 1] / hit.sum(2, keepdims=True))
    return y, g


@pytest.mark.parametrize("target", TARGETS)
def test_top_pool_ties_split_equally_in_chunks(target, tmp_path):
    """Values from {0, 1, 2} (ties in almost every window) and a column of one value:
    untiled and at a 1-byte budget, the forward is mmcv's and the gradient splits each
    row's between its tied maxima (tf.reduce_max's rule), where mmcv's backward gives it
    all to the lowest tied row; total gradient kept (each row's sums to its grad)."""
    module = generate(REAL["top_pool"], tmp_path, prefix="Ties11", target=target)
    rng = np.random.default_rng(4)
    x = rng.integers(0, 3, (2, 3, 6, 5)).astype(np.float64)
    x[0, 0, :, 0] = 1.0
    grad = rng.standard_normal(x.shape)
    want, split = _ties_split_equally(x, grad)
    mmcv_y, mmcv_backward = top_pool_kernel(x)
    np.testing.assert_array_equal(want, mmcv_y)
    for budget in (BIG, TINY):
        y, gx = _run(module, target, {"x": x}, grad, {}, np.float64, budget)
        np.testing.assert_array_equal(y, want)
        np.testing.assert_allclose(gx, split, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(gx.sum(2), grad.sum(2), rtol=1e-12, atol=1e-12)
    (mmcv,) = mmcv_backward(grad)
    np.testing.assert_allclose(mmcv[0, 0, 5, 0], grad[0, 0, :, 0].sum(), rtol=1e-12)
    np.testing.assert_allclose(gx[0, 0, :, 0], np.cumsum(grad[0, 0, :, 0] / np.arange(6, 0, -1)))


# ------------------------------------------------------------------ float32, hostile


def _float32_against_float64(module, target, named, cotangent, attrs, rtol):
    want = _run(module, target, named, cotangent, attrs, np.float64, BIG)
    got = _run(module, target, named, cotangent, attrs, np.float32, TINY)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
            continue
        assert g.dtype == np.float32 and np.isfinite(g).all()
        np.testing.assert_allclose(g, w, rtol=0, atol=rtol * max(np.abs(w).max(), 1))
    return got, want


@pytest.mark.parametrize("target", TARGETS)
def test_logits_in_the_hundreds_in_float32(target, tmp_path):
    """xentropy with logits around +-300 and a spread of 50, the masked softmax with
    scale * x around 400: float32 forward and gradients finite and within float32
    rounding of float64 (exp(300) overflows float32; the kernels subtract the max)."""
    rng = np.random.default_rng(5)
    xent = generate(REAL["xentropy"], tmp_path, prefix="Hot11", target=target)
    x = 300 * np.sign(rng.standard_normal((6, 11))) + 50 * rng.standard_normal((6, 11))
    label = rng.integers(0, 11, 6).astype(np.int32)
    g = rng.standard_normal(6)
    got, _ = _float32_against_float64(
        xent, target, {"x": x, "label": label}, g, {"smoothing": 0.1}, 1e-5
    )
    want, backward = xentropy_kernel(x, label, 0.1)
    np.testing.assert_allclose(got[0], want, rtol=1e-5)
    np.testing.assert_allclose(got[xent.INPUTS.index("x") + 1], backward(g)[0], atol=1e-5)

    soft = generate(REAL["masked_softmax"], tmp_path, prefix="Hot11", target=target)
    x = 400 + 30 * rng.standard_normal((2, 3, 5, 7))
    mask = (rng.random((2, 1, 5, 7)) < 0.3).astype(np.float64)
    mask[0, 0, 1] = 1
    g = rng.standard_normal(x.shape)
    got, _ = _float32_against_float64(soft, target, {"x": x, "mask": mask}, g, {"scale": 2.0}, 1e-5)
    assert not got[1 + soft.INPUTS.index("x")][0, :, 1].any()


@pytest.mark.parametrize("target", TARGETS)
def test_rope_at_angles_near_a_thousand_and_gdn_far_out_in_float32(target, tmp_path):
    """RoPE at positions times frequencies near 1e3 (a long context): float32 within
    1e3 * eps of float64 (the angle's own rounding), the freqs' gradient too; GDN with
    x near 1e3 and a zero channel: finite, within float32 rounding."""
    rng = np.random.default_rng(6)
    rope = generate(REAL["rope"], tmp_path, prefix="Far11", target=target)
    named = {"t": rng.standard_normal((7, 2, 3, 12)), "f": 1e3 + rng.uniform(0, 4, (7, 1, 1, 8))}
    _float32_against_float64(rope, target, named, rng.standard_normal((7, 2, 3, 12)), {}, 3e-4)

    gdn = generate(REAL["gdn"], tmp_path, prefix="Far11", target=target)
    x = 1e3 + rng.standard_normal((2, 3, 4, 5))
    x[:, 1] = 0.0
    named = {"x": x, "beta": rng.uniform(0.5, 1.5, 3), "gamma": rng.uniform(0, 0.3, (3, 3))}
    got, _ = _float32_against_float64(gdn, target, named, rng.standard_normal(x.shape), {}, 1e-5)
    assert not got[0][:, 1].any()


@pytest.mark.parametrize("target", TARGETS)
def test_zeros(target, tmp_path):
    """GDN at x = 0: y = 0, grad_x = g / sqrt(beta), no gradient to beta or gamma;
    xentropy at all-zero logits: loss log C, grad (1/C - (1 - s) onehot - s/C) g."""
    rng = np.random.default_rng(7)
    gdn = generate(REAL["gdn"], tmp_path, prefix="Zero11", target=target)
    beta = rng.uniform(0.5, 1.5, 3)
    named = {"x": np.zeros((2, 3, 4, 5)), "beta": beta, "gamma": rng.uniform(0, 0.3, (3, 3))}
    g = rng.standard_normal((2, 3, 4, 5))
    y, *grads = _run(gdn, target, named, g, {}, np.float64, TINY)
    by = dict(zip(gdn.INPUTS, grads, strict=True))
    assert not y.any() and not by["beta"].any() and not by["gamma"].any()
    np.testing.assert_allclose(by["x"], g / np.sqrt(beta)[None, :, None, None], rtol=1e-14)

    xent = generate(REAL["xentropy"], tmp_path, prefix="Zero11", target=target)
    label = np.array([0, 4, 2], np.int32)
    g = rng.standard_normal(3)
    named = {"x": np.zeros((3, 5)), "label": label}
    loss, *grads = _run(xent, target, named, g, {"smoothing": 0.1}, np.float64, TINY)
    np.testing.assert_allclose(loss, np.log(5), rtol=1e-14)
    np.testing.assert_allclose(
        grads[xent.INPUTS.index("x")], xentropy_kernel(named["x"], label, 0.1)[1](g)[0], atol=1e-15
    )


EMPTY = {  # name -> its float inputs with one axis of size 0
    "top_pool": {"x": (2, 3, 0, 4)},
    "xentropy": {"x": (0, 7)},
    "masked_softmax": {"x": (2, 3, 0, 5), "mask": (2, 1, 0, 5)},
    "rope": {"t": (0, 2, 3, 8), "f": (0, 1, 1, 4)},
    "rope_interleaved": {"t": (2, 0, 3, 8), "f": (2, 1, 1, 4)},
    "gdn": {"x": (2, 3, 0, 5)},
}


@pytest.mark.parametrize(
    ("name", "target"),
    [(n, t) for n in sorted(EMPTY) for t in TARGETS if t != "jax" or n == "top_pool"],
)
def test_empty_axes_at_a_one_byte_budget(name, target, tmp_path):
    """No rows, no examples, no queries, no positions, no pixels: at a 1-byte budget the
    output is empty, shaped, and every gradient is zero, shaped like its input."""
    case = REAL[name]
    module = generate(case, tmp_path, prefix="Empty11", target=target)
    rng = np.random.default_rng(8)
    named = {n: rng.uniform(-1, 1, s) for n, s in (case.shapes | EMPTY[name]).items()}
    if name == "xentropy":
        named["label"] = np.zeros(0, np.int32)
    module.MAX_TEMP_BYTES = TINY
    args = [_tensor(target, named[n]) for n in module.INPUTS]
    y = as_numpy(module.forward(*args, **case.attrs))
    assert y.size == 0
    grads = [
        as_numpy(g) for g in module.vjp(*args, _tensor(target, np.ones(y.shape)), **case.attrs)
    ]
    for n, g in zip(module.INPUTS, grads, strict=True):
        if n in case.no_gradient or n in case.index_inputs:
            assert g is None
        else:
            assert g.shape == named[n].shape and not g.any(), n


@pytest.mark.parametrize("name", sorted(REAL))
def test_unknown_sizes_under_tf_function(name, tmp_path):
    """Every size unknown when tf.function traces (RoPE's d2 and d2/2 lets from freqs'
    shape, the corner pool's row range, the label's gather): forward and vjp at a 1-byte
    budget equal the untiled module run eagerly. Traced without AutoGraph."""
    case, (named, attrs, _) = REAL[name], _kernel_inputs(name, np.random.default_rng(10))
    module = generate(case, tmp_path, prefix="Unknown11")
    args = [tf.constant(named[n]) for n in module.INPUTS]
    unknown_sizes_equal_eager(module, args, attrs, seed=9, autograph=False)


# --------------------------------------------------------- labels, masks, refusals


@pytest.mark.parametrize("target", TARGETS)
def test_labels_outside_the_classes_read_zero_and_never_wrap(target, tmp_path):
    """Labels -1, C and -C (an ignore label, one past the end, one that a negative
    index would wrap to class 0): x[n, label[n]] reads 0 there (no class picked, no
    one-hot in the gradient), untiled and at a 1-byte budget; the in-range label as the
    kernel."""
    module = generate(REAL["xentropy"], tmp_path, prefix="Label11", target=target)
    rng = np.random.default_rng(13)
    x, label = rng.standard_normal((4, 6)), np.array([-1, 6, 2, -6], np.int32)
    g = rng.standard_normal(4)
    _, backward = xentropy_kernel(x, np.clip(label, 0, 5), 0.1)
    lse = np.log(np.exp(x).sum(1))
    want = (lse - x.mean(1)) * 0.1 + lse * 0.9
    want[2] -= 0.9 * x[2, 2]
    gx = g[:, None] * (np.exp(x - lse[:, None]) - 0.1 / 6)
    gx[2] = backward(g)[0][2]
    for budget in (BIG, TINY):
        y, *grads = _run(
            module, target, {"x": x, "label": label}, g, {"smoothing": 0.1}, np.float64, budget
        )
        np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grads[module.INPUTS.index("x")], gx, rtol=1e-12, atol=1e-12)
        assert grads[module.INPUTS.index("label")] is None


def test_an_int_mask_compared_with_a_constant_is_a_value_and_is_refused_by_name(tmp_path):
    """`mask[b,0,i,j] == 1` compares the mask with a number, not an index: the mask is a
    value input, and Megatron's uint8 mask passed as int32 is refused when the op is
    called, naming the op, the input and the dtypes it takes (never compared as 0)."""
    module = generate(REAL["masked_softmax"], tmp_path, prefix="IntMask11")
    args = {"x": tf.zeros([1, 2, 3, 4], tf.float64), "mask": tf.zeros([1, 1, 3, 4], tf.int32)}
    with pytest.raises(
        TypeError, match=rf"^{module.OP_TYPE}: input mask has dtype int32; expected"
    ):
        module.forward(*[args[n] for n in module.INPUTS], scale=1.0)


def test_a_corner_pool_whose_range_depends_on_the_row_is_refused_by_the_cli(tmp_path):
    """The top pool as a max over the rows below, `max(x[n,c,h + s,w], s)` with s over
    `x.shape[2] - h`: a range may not name an index. `symgrad generate` exits 2 with
    the op, the index and a caret under the name, no traceback, and writes nothing."""
    import subprocess
    import sys

    (tmp_path / "symgrad.toml").write_text(
        'out = "generated"\n\n[ops.TopPool]\nformula = "y[n,c,h,w] = max(x[n,c,h + s,w], s)"\n'
        'ranges = { s = "x.shape[2] - h" }\n',
        encoding="utf-8",
    )
    result = subprocess.run(
        [sys.executable, "-m", "symgrad", "generate"],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    first, source, caret = result.stderr.rstrip().splitlines()
    assert first == (
        "error: symgrad.toml [ops.TopPool]: range of index 's': unknown name 'h': a range "
        "uses int literals, int attrs and input sizes `X.shape[n]` (X an input of the formula)"
    )
    assert source.strip() == "x.shape[2] - h" and caret.strip() == "^"
    assert source.rindex("h") == caret.index("^")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["symgrad.toml"]


ROPE_MOD = Case(  # the rotate-half partner as one read at (d + d2/2) % d2
    "y[s,b,h,d] = where(d < D2, t[s,b,h,d] * cos(f[s,0,0,d]) "
    "+ where(d < H2, -1, 1) * t[s,b,h,(d + H2) % D2] * sin(f[s,0,0,d]), t[s,b,h,d])",
    {"t": (5, 2, 3, 8), "f": (5, 1, 1, 4)},
    ranges={"d": "t.shape[3]"},
    sizes={"d": 8},
    lets={"D2": "f.shape[3]", "H2": "f.shape[3] // 2"},
    let_values={"D2": 4, "H2": 2},
)


@pytest.mark.parametrize("target", TARGETS)
def test_rope_with_the_partner_read_modulo_d2_equals_the_kernel(target, tmp_path):
    """RoPE's partner written as one split read `t[.., (d + H2) % D2]` and a sign, where
    REAL's spelling has two shifted reads: the same forward and gradients (the kernel's,
    and the freqs'), at a 1-byte budget."""
    module = generate(ROPE_MOD, tmp_path, prefix="RopeMod11", target=target)
    named, attrs, (want, backward) = _kernel_inputs("rope", np.random.default_rng(11))
    g = np.random.default_rng(14).standard_normal(want.shape)
    y, *grads = _run(module, target, named, g, attrs, np.float64, TINY)
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
    for n, e in zip(("t", "f"), backward(g), strict=True):
        np.testing.assert_allclose(grads[module.INPUTS.index(n)], e, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------- second order


@pytest.mark.parametrize("target", TARGETS)
def test_second_order_equals_tf_autodiff_of_the_reference(target, tmp_path):
    """The gradient of <g, cos(g)>, g the gradient of sum(sin(forward)), through the
    generated forward at a 1-byte budget (TF: nested tapes; PyTorch: create_graph;
    JAX: grad of grad, for xentropy and GDN) equals TF's nested autodiff over the
    reference evaluator."""
    from harness import make_tensors, reference

    names = ("xentropy", "masked_softmax", "rope_interleaved", "gdn")
    for name in names if target != "jax" else names[::3]:  # eager JAX: two ops
        case = REAL[name]
        module = generate(case, tmp_path, prefix="Second11", target=target)
        module.MAX_TEMP_BYTES = TINY
        ts = make_tensors(case, module.INPUTS, seed=1)
        fl = [
            k
            for k, n in enumerate(module.INPUTS)
            if n not in (*case.no_gradient, *case.index_inputs)
        ]

        def tf_second(fn, ts=ts, fl=fl):
            floats = [ts[k] for k in fl]
            with tf.GradientTape() as outer:
                outer.watch(floats)
                with tf.GradientTape() as inner:
                    inner.watch(floats)
                    loss = tf.reduce_sum(tf.sin(fn()))
                gs = [tf.convert_to_tensor(g) for g in inner.gradient(loss, floats)]
                s = tf.add_n([tf.reduce_sum(g * tf.cos(g)) for g in gs])
            return [np.asarray(w) for w in outer.gradient(s, floats)]

        want = tf_second(
            lambda case=case, ts=ts, names=module.INPUTS: reference(
                case, dict(zip(names, ts, strict=True))
            )[0]
        )
        if target == "tensorflow":
            got = tf_second(
                lambda case=case, ts=ts, module=module: module.forward(*ts, **case.attrs)
            )
        elif target == "pytorch":
            args = [torch.tensor(t.numpy(), requires_grad=k in fl) for k, t in enumerate(ts)]
            leaves = [args[k] for k in fl]
            y = module.forward(*args, **case.attrs)
            gs = torch.autograd.grad(torch.sin(y).sum(), leaves, create_graph=True)
            got = torch.autograd.grad(sum((g * torch.cos(g)).sum() for g in gs), leaves)
            got = [g.numpy() for g in got]
        else:
            import jax
            import jax.numpy as jnp

            _enable_x64()
            ja = [jnp.asarray(t.numpy()) for t in ts]

            def loss(*f, ja=ja, fl=fl, module=module, case=case):
                a = list(ja)
                for k, v in zip(fl, f, strict=True):
                    a[k] = v
                return jnp.sum(jnp.sin(module.forward(*a, **case.attrs)))

            def s2(*f, loss=loss, fl=fl):
                gs = jax.grad(loss, argnums=tuple(range(len(fl))))(*f)
                return sum(jnp.sum(g * jnp.cos(g)) for g in gs)

            got = jax.grad(s2, argnums=tuple(range(len(fl))))(*[ja[k] for k in fl])
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-10, atol=1e-12, err_msg=name)

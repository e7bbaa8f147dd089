"""An eighth set of real ops in their published layouts, none of them in the earlier
adversarial files, written from the kernels' own index arithmetic: Mamba's causal_conv1d
with seq_idx (Dao-AILab/causal-conv1d, the channel-last forward: a tap is kept only where
its seq_idx equals the output step's, a step whose seq_idx is negative is 0), FlowNet2's
resample2d (a bilinear warp by a flow field, every corner clamped to the image) and
channelnorm (the L2 norm over channels), mmcv's rotated_feature_align (a feature plus
bilinear samples at a rotated box's center and corners, mmcv's border clamps), and
NATTEN's 2-D neighborhood attention with dilation, causal along rows and not along
columns, on sizes the dilation does not divide (the flex backend's mask: a dilation
group's own length, the causal window ending at the query).

Each is checked against a NumPy transcription of its kernel (FlowNet2's backward kernels
too), against TF float64 autodiff over the reference evaluator and finite differences
(harness.check), in chunks against the untiled module, with logits in the hundreds in
float32, at ties (flow that lands exactly on pixels and on the clamps, a seq_idx reset at
every step, rotated boxes whose corners fall on pixels and exactly on the clamps, an
all-zero pixel), on empty axes and under tf.function with unknown sizes.

Found: resample2d's flow gradient at the last row and column under zero flow (the
identity warp) was -x[H - 1] and -x[W - 1] -- the clamp `min(e, W - 1)` sent its tie to e
and the read took the forward difference with the zero outside the image; FlowNet2's
kernel (and either one-sided derivative but this) gives 0 and x[W-1] - x[W-2]. A clamp
inside a float position now takes its right derivative (sampling._right_sided_clamps).

Found: mmcv's prroi_pool (a bin's integral of the bilinear interpolation over its area,
0 for an empty bin: `where(AR > 0, sum(...) / AR, 0)`) had nan gradients for x and the
roi beside an empty roi, where the kernel has 0: the select masked the quotient's
cotangent with a 0/1 factor, and the chain multiplied it by 1 / AR = inf. The partials
of an intermediate inside a where's branch now select their non-finite factors away
outside it (taken_branch.py); x's gradient is the kernel's backward. Its forward is the
kernel's.

Refused, clearly, at the call: the clamped warp written with integer bounds only
(`min(max(j + f[b,0,i,j], 0), W - 1)` is an integer position, `f` an index tensor):
"index tensor f has dtype float64; expected int32 or int64 (to interpolate at float
positions, list it in the spec: `float_positions = ["f"]`)". Written with `0.0` it
interpolates.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from adversarial import TINY, as_numpy, chunks_equal_the_untiled_module, unknown_sizes_equal_eager
from harness import Case, check, generate

jax.config.update("jax_enable_x64", True)

BIG = 2**40

# causal_conv1d: output step t reads x at t + k - (K - 1); seq_idx read at the same step
TAP = "t + k - K + 1"
CONV = f"S[b,d,t] = bias[d] + sum(where(seq[b,{TAP}] == seq[b,t], w[d,k] * x[b,d,{TAP}], 0), k)"

# NATTEN (flex backend, stride 1): a row's causal window ends at the query inside its
# dilation group; a column's window starts at max(min(j // D1 - K1 // 2, n - K1), 0) with
# n = (W - j % D1 + D1 - 1) // D1 the length of j's dilation group
NAT_ROW = "i % D0 + D0*(i // D0 - u)"
NAT_COL = "j % D1 + D1*(max(min(j // D1 - K1 // 2, (W - j % D1 + D1 - 1) // D1 - K1), 0) + s)"
NAT_EXP = f"exp(scale * sum(query[b,i,j,h,d] * key[b,{NAT_ROW},{NAT_COL},h,d], d))"
NAT_IN = "i // D0 - u >= 0"

# mmcv rotated_feature_align: sample p of pixel (h, w) is the box's center (p = 0) or a
# corner, center + sw * (w/2 along the angle) + sh * (h/2 across it)
SW = "where(p == 0, 0, where(p == 1 or p == 4, 1, -1))"
SH = "where(p == 0, 0, where(p < 3, 1, -1))"
RFA_Y, RFA_X = "PY[n,h,w,p]", "PX[n,h,w,p]"
RFA_IN = f"{RFA_Y} >= -1 and {RFA_Y} <= H and {RFA_X} >= -1 and {RFA_X} <= W"

WARP = (
    "y[b,c,i,j] = x[b, c, min(max(i + f[b,1,i,j], 0.0), H - 1),"
    " min(max(j + f[b,0,i,j], 0.0), W - 1)]"
)

# mmcv prroi_pool: the integral of the bilinear interpolation over a bin is, per pixel,
# the product of the integrals of its row's and column's hat function over the bin's
# extent; G is the hat's antiderivative


def _hat_integral(u):
    return (
        f"where({u} <= -1, 0, where({u} <= 0, ({u} + 1)**2 / 2,"
        f" where({u} <= 1, 1 - (1 - {u})**2 / 2, 1)))"
    )


BIN_H = "max(rois[r,4] - rois[r,2], 0) * scale / PH"
BIN_W = "max(rois[r,3] - rois[r,1], 0) * scale / PW"
PRROI_ROWS = f"({_hat_integral('(EY[r,i] - a)')} - {_hat_integral('(BY[r,i] - a)')})"
PRROI_COLS = f"({_hat_integral('(EX[r,j] - q)')} - {_hat_integral('(BX[r,j] - q)')})"

# mmcv/ops/csrc/common/cuda/prroi_pool_cuda_kernel.cuh, prroi_pool_forward_cuda_kernel:
# rois [K, 5] = (batch index, x1, y1, x2, y2) times spatial_scale, a bin's integral of
# the bilinear interpolation (pixels outside read 0) over its area; 0 for an empty bin.
# The per-pixel weights are written inside the sum: as internal tensors IY[r,i,a] their
# axis a is sized by no input in their own equation ("output index 'a' is not used by any
# input"), and with `ranges` for a the read x[.., a, q] refuses it ("index 'a' is a
# plain index of x (axis 2) ...; remove it from `ranges`"): no spelling has both
PRROI = Case(
    (
        f"BY[r,i] = rois[r,2] * scale + {BIN_H} * i",
        f"EY[r,i] = rois[r,2] * scale + {BIN_H} * (i + 1)",
        f"BX[r,j] = rois[r,1] * scale + {BIN_W} * j",
        f"EX[r,j] = rois[r,1] * scale + {BIN_W} * (j + 1)",
        f"AR[r] = {BIN_H} * {BIN_W}",
        (
            "y[r,c,i,j] = where(AR[r] > 0, sum(x[floor(rois[r,0]), c, a, q]"
            f" * {PRROI_ROWS} * {PRROI_COLS}, a, q) / AR[r], 0)"
        ),
    ),
    {"x": (2, 3, 6, 7), "rois": (4, 5)},
    attrs={"scale": 0.5, "PH": 2, "PW": 3},
    inputs=("x", "rois"),
    ranges={"i": "PH", "j": "PW"},
    sizes={"i": 2, "j": 3},
    outputs=("y",),
)
PRROI_ROIS = np.array(
    [
        [0, 2.3, 1.1, 9.7, 8.2],
        [1, -3.0, -2.5, 6.0, 7.5],  # past the top-left border
        [1, 10.0, 9.0, 17.0, 14.5],  # past the bottom-right border
        [0, 5.5, 1.0, 5.5, 9.0],  # no width: every bin empty, 0
    ]
)

REAL = {
    # csrc/causal_conv1d_fwd.cu, causal_conv1d_channellast_fwd_kernel with seq_idx: x
    # [B, D, L] (a channel-last view), weight [D, K], bias [D], seq_idx [B, L]; out = 0
    # where seq_idx < 0, else silu(bias + the taps whose seq_idx equals the step's)
    "causal_conv1d_seq_idx": Case(
        (CONV, "y[b,d,t] = where(seq[b,t] >= 0, S[b,d,t] * sigmoid(S[b,d,t]), 0)"),
        {"x": (2, 4, 10), "w": (4, 3), "bias": (4,), "seq": (2, 10)},
        inputs=("x", "w", "bias", "seq"),
        lets={"K": "w.shape[1]"},
        let_values={"K": 3},
        ranges={"t": "x.shape[2]"},
        sizes={"t": 10},
        outputs=("y",),
        no_gradient=("seq",),
    ),
    # networks/resample2d_package/resample2d_kernel.cu, kernel_resample2d_update_output
    # (bilinear, kernel_size 1): xf = x + flow[b,0], yf = y + flow[b,1], each corner
    # clamped to the image, which is the position clamped to [0, size - 1]
    "resample2d": Case(
        WARP,
        {"x": (2, 3, 5, 6), "f": (2, 2, 5, 6)},
        inputs=("x", "f"),
        lets={"H": "x.shape[2]", "W": "x.shape[3]"},
        let_values={"H": 5, "W": 6},
        ranges={"i": "f.shape[2]", "j": "f.shape[3]"},
        sizes={"i": 5, "j": 6},
        fd_directions=2,
    ),
    # networks/channelnorm_package/channelnorm_kernel.cu: output [B, 1, H, W], the
    # square root of the sum over channels of the squares (norm_deg is not read)
    "channelnorm": Case(
        "y[b,o,h,w] = sqrt(sum(x[b,c,h,w]**2, c))",
        {"x": (2, 3, 4, 5)},
        ranges={"o": "1"},
        sizes={"o": 1},
    ),
    # mmcv/ops/csrc/pytorch/cpu/rotated_feature_align.cpp (the CUDA kernel's twin):
    # features [N, C, H, W], best_rbboxes [N, H, W, 5] = (y, x, w, h, a), spatial_scale,
    # points 1 or 5; out = the feature plus bilinear_interpolate (0 beyond one pixel
    # outside, clamped within it) at each point; the boxes get no gradient
    "rotated_feature_align": Case(
        (
            (
                f"PY[n,h,w,p] = scale * (rb[n,h,w,0] + {SW} * sin(rb[n,h,w,4]) * rb[n,h,w,2] / 2"
                f" + {SH} * cos(rb[n,h,w,4]) * rb[n,h,w,3] / 2)"
            ),
            (
                f"PX[n,h,w,p] = scale * (rb[n,h,w,1] + {SW} * cos(rb[n,h,w,4]) * rb[n,h,w,2] / 2"
                f" - {SH} * sin(rb[n,h,w,4]) * rb[n,h,w,3] / 2)"
            ),
            (
                f"y[n,c,h,w] = x[n,c,h,w] + sum(where({RFA_IN}, x[n, c, min(max({RFA_Y}, 0.0),"
                f" H - 1), min(max({RFA_X}, 0.0), W - 1)], 0), p)"
            ),
        ),
        {"x": (2, 3, 5, 6), "rb": (2, 5, 6, 5)},
        attrs={"scale": 0.25, "P": 5},
        inputs=("x", "rb"),
        lets={"H": "x.shape[2]", "W": "x.shape[3]"},
        let_values={"H": 5, "W": 6},
        ranges={"p": "P"},
        sizes={"p": 5},
        outputs=("y",),
        no_gradient=("rb",),
        fd_directions=2,
    ),
    # NATTEN na2d, q, k, v [B, H, W, heads, head_dim], kernel (K0, K1), dilation (D0, D1),
    # is_causal (True, False): src/natten/backends/flex.py, get_na_flex_mask
    "natten2d_causal_dilated": Case(
        f"y[b,i,j,h,e] = sum(where({NAT_IN}, {NAT_EXP} * value[b,{NAT_ROW},{NAT_COL},h,e], 0),"
        f" u, s) / sum(where({NAT_IN}, {NAT_EXP}, 0), u, s)",
        {"query": (1, 7, 7, 2, 3), "key": (1, 7, 7, 2, 3), "value": (1, 7, 7, 2, 3)},
        attrs={"K0": 3, "K1": 3, "D0": 2, "D1": 2, "scale": 0.5},
        inputs=("query", "key", "value"),
        lets={"W": "key.shape[2]"},
        let_values={"W": 7},
        ranges={"u": "K0", "s": "K1"},
        sizes={"u": 3, "s": 3},
        fd_directions=2,
    ),
}


# ------------------------------------------------------- the kernels, transcribed


def causal_conv1d_seq_idx(x, w, bias, seq):
    """causal_conv1d_channellast_fwd_kernel with seq_idx and silu: a step before 0 has
    seq_idx -1; a tap counts where its seq_idx equals the output step's."""
    batch, dim, length = x.shape
    width = w.shape[1]
    out = np.zeros_like(x)
    for b in range(batch):
        ids = np.concatenate([-np.ones(width - 1), seq[b]])
        xs = np.concatenate([np.zeros((dim, width - 1)), x[b]], 1)
        for t in range(length):
            current = ids[t + width - 1]
            if current < 0:
                continue
            total = bias.copy()
            for k in range(width):
                if ids[t + k] == current:
                    total += w[:, k] * xs[:, t + k]
            out[b, :, t] = total / (1 + np.exp(-total))
    return out


def _corners(f, b, y, x, dim_h, dim_w):
    xf, yf = x + f[b, 0, y, x], y + f[b, 1, y, x]
    x_left = max(min(int(np.floor(xf)), dim_w - 1), 0)
    x_right = max(min(int(np.floor(xf) + 1), dim_w - 1), 0)
    y_top = max(min(int(np.floor(yf)), dim_h - 1), 0)
    y_bottom = max(min(int(np.floor(yf) + 1), dim_h - 1), 0)
    return xf, yf, x_left, x_right, y_top, y_bottom


def resample2d(x, f):
    """kernel_resample2d_update_output, bilinear, kernel_size 1."""
    batch, channels, dim_h, dim_w = x.shape
    out = np.zeros((batch, channels, *f.shape[2:]))
    for b, c, y, xx in np.ndindex(out.shape):
        xf, yf, xl, xr, yt, yb = _corners(f, b, y, xx, dim_h, dim_w)
        alpha, beta = xf - np.floor(xf), yf - np.floor(yf)
        img = x[b, c]
        out[b, c, y, xx] = (
            (1 - alpha) * (1 - beta) * img[yt, xl]
            + alpha * (1 - beta) * img[yt, xr]
            + (1 - alpha) * beta * img[yb, xl]
            + alpha * beta * img[yb, xr]
        )
    return out


def resample2d_flow_grad(x, f, grad_out):
    """kernel_resample2d_backward_input2 (kernel_size 1): channel 0 (dx) takes the
    difference of the right and left columns, channel 1 (dy) of the bottom and top rows,
    each weighted by the other axis's fraction, summed over the image's channels."""
    _, channels, dim_h, dim_w = x.shape
    grad = np.zeros_like(f)
    for b, c, y, xx in np.ndindex(f.shape):
        xf, yf, xl, xr, yt, yb = _corners(f, b, y, xx, dim_h, dim_w)
        total = 0.0
        for ch in range(channels):
            img, g = x[b, ch], grad_out[b, ch, y, xx]
            if c % 2:
                gamma = 1 - (xf - np.floor(xf))
                total += gamma * g * (img[yb, xl] - img[yt, xl])
                total += (1 - gamma) * g * (img[yb, xr] - img[yt, xr])
            else:
                gamma = 1 - (yf - np.floor(yf))
                total += gamma * g * (img[yt, xr] - img[yt, xl])
                total += (1 - gamma) * g * (img[yb, xr] - img[yb, xl])
        grad[b, c, y, xx] = total
    return grad


def channelnorm(x):
    """kernel_channelnorm_update_output."""
    return np.sqrt((x * x).sum(1, keepdims=True))


def channelnorm_grad(x, grad_out):
    """kernel_channelnorm_backward_input1: gradOutput * input / (output + 1e-9)."""
    return grad_out * x / (channelnorm(x) + 1e-9)


def rotated_feature_align(x, rb, scale, P):
    """rotated_feature_align_forward_cpu_kernel: px, py of the center and the four
    corners, each read with mmcv's bilinear_interpolate, added to the feature."""
    from test_tiling_adversarial_6 import bilinear_interpolate

    out = x.copy()
    for n, c, h, w in np.ndindex(x.shape):
        roi_y, roi_x, roi_w, roi_h, roi_a = rb[n, h, w] * [scale, scale, scale, scale, 1]
        wx, wy = np.cos(roi_a) * roi_w / 2, np.sin(roi_a) * roi_w / 2
        hx, hy = -np.sin(roi_a) * roi_h / 2, np.cos(roi_a) * roi_h / 2
        px = [roi_x, roi_x + wx + hx, roi_x - wx + hx, roi_x - wx - hx, roi_x + wx - hx]
        py = [roi_y, roi_y + wy + hy, roi_y - wy + hy, roi_y - wy - hy, roi_y + wy - hy]
        for i in range(P):
            out[n, c, h, w] += bilinear_interpolate(x[n, c], py[i], px[i])
    return out


def bilinear_interpolate_gradient(height, width, y, x):
    """rotated_feature_align.cpp's bilinear_interpolate_gradient: the four weights and
    their (clamped) corners; none beyond one pixel outside."""
    if y < -1.0 or y > height or x < -1.0 or x > width:
        return []
    y, x = max(y, 0.0), max(x, 0.0)
    y_low, x_low = int(y), int(x)
    if y_low >= height - 1:
        y_high = y_low = height - 1
        y = float(y_low)
    else:
        y_high = y_low + 1
    if x_low >= width - 1:
        x_high = x_low = width - 1
        x = float(x_low)
    else:
        x_high = x_low + 1
    ly, lx = y - y_low, x - x_low
    hy, hx = 1 - ly, 1 - lx
    return [
        (hy * hx, y_low, x_low),
        (hy * lx, y_low, x_high),
        (ly * hx, y_high, x_low),
        (ly * lx, y_high, x_high),
    ]


def prroi_pool(x, rois, scale, PH, PW):
    """prroi_pool_forward_cuda_kernel: each bin the sum over the unit cells it overlaps
    of PrRoIPoolingMatCalculation (the four corners' integrals), over the bin's area."""

    def get(img, h, w):
        inside = 0 <= h < img.shape[0] and 0 <= w < img.shape[1]
        return img[h, w] if inside else 0.0

    def part(a, lim):
        return lim - 0.5 * lim * lim - a + 0.5 * a * a

    def cell(img, s_h, s_w, y0, x0, y1, x1):
        e_h, e_w = s_h + 1, s_w + 1
        rows = (part(y0 - s_h, y1 - s_h), part(e_h - y1, e_h - y0))
        cols = (part(x0 - s_w, x1 - s_w), part(e_w - x1, e_w - x0))
        return sum(
            get(img, h, w) * rows[m] * cols[k]
            for m, h in enumerate((s_h, e_h))
            for k, w in enumerate((s_w, e_w))
        )

    out = np.zeros((rois.shape[0], x.shape[1], PH, PW))
    for n, c, ph, pw in np.ndindex(out.shape):
        batch, x1, y1, x2, y2 = rois[n] * [1, scale, scale, scale, scale]
        bin_h, bin_w = max(y2 - y1, 0) / PH, max(x2 - x1, 0) / PW
        bx1, by1 = x1 + bin_w * pw, y1 + bin_h * ph
        bx2, by2 = bx1 + bin_w, by1 + bin_h
        if max(0.0, bin_w * bin_h) == 0:
            continue
        total = 0.0
        for bx in range(int(np.floor(bx1)), int(np.ceil(bx2))):
            for by in range(int(np.floor(by1)), int(np.ceil(by2))):
                y0, x0 = max(by1, by), max(bx1, bx)
                y1_, x1_ = min(by2, by + 1.0), min(bx2, bx + 1.0)
                total += cell(x[int(batch), c], by, bx, y0, x0, y1_, x1_)
        out[n, c, ph, pw] = total / (bin_w * bin_h)
    return out


def prroi_pool_x_gradient(x, rois, grad, scale, PH, PW):
    """prroi_pool_backward_cuda_kernel's gradient of the image: each bin's cotangent over
    its area (0 for an empty bin: `win_size == 0 ? 0 : grad / win_size`) distributed to
    the four corners of every unit cell it overlaps (PrRoIPoolingMatDistributeDiff, the
    forward's coefficients; corners outside the image take nothing)."""

    def part(a, lim):
        return lim - 0.5 * lim * lim - a + 0.5 * a * a

    out = np.zeros_like(x)
    for n, c, ph, pw in np.ndindex(grad.shape):
        batch, x1, y1, x2, y2 = rois[n] * [1, scale, scale, scale, scale]
        bin_h, bin_w = max(y2 - y1, 0) / PH, max(x2 - x1, 0) / PW
        bx1, by1 = x1 + bin_w * pw, y1 + bin_h * ph
        bx2, by2 = bx1 + bin_w, by1 + bin_h
        area = max(0.0, bin_w * bin_h)
        diff = 0.0 if area == 0 else grad[n, c, ph, pw] / area
        img = out[int(batch), c]
        for bx in range(int(np.floor(bx1)), int(np.ceil(bx2))):
            for by in range(int(np.floor(by1)), int(np.ceil(by2))):
                y0, x0 = max(by1, by), max(bx1, bx)
                y1_, x1_ = min(by2, by + 1.0), min(bx2, bx + 1.0)
                rows = (part(y0 - by, y1_ - by), part(by + 1 - y1_, by + 1 - y0))
                cols = (part(x0 - bx, x1_ - bx), part(bx + 1 - x1_, bx + 1 - x0))
                for m, h in enumerate((by, by + 1)):
                    for k, w in enumerate((bx, bx + 1)):
                        if 0 <= h < img.shape[0] and 0 <= w < img.shape[1]:
                            img[h, w] += diff * rows[m] * cols[k]
    return out


def _natten_mask(q_crd, kv_crd, extent, kernel, dilation, causal):
    """get_na_flex_mask's single_dim_tiling_mask along one axis, stride 1."""
    q_di, kv_di = q_crd // dilation, kv_crd // dilation
    group = q_crd % dilation
    padding = 1 - ((group + (dilation - (extent % dilation))) // dilation)
    corrected = extent // dilation + padding
    same_group = group == kv_crd % dilation
    if causal:
        leader = min(q_di, corrected - 1)
        return q_di - kv_di >= 0 and leader - kv_di < kernel and same_group
    left, right = kernel // 2, kernel // 2 + (kernel % 2 - 1)
    center = min(max(min(q_di, corrected - 1), left), corrected - 1 - right)
    w0, w1 = center - kv_di, kv_di - center
    return ((0 <= w0 <= left) or (0 <= w1 <= right)) and same_group


def natten2d(query, key, value, K0, K1, D0, D1, scale):
    """Attention of each query over the keys the flex mask keeps (causal rows)."""
    batch, dim_h, dim_w, heads, _ = query.shape
    out = np.zeros(value.shape)
    for b, i, j, h in np.ndindex(batch, dim_h, dim_w, heads):
        keys = [
            (p, q)
            for p in range(dim_h)
            for q in range(dim_w)
            if _natten_mask(i, p, dim_h, K0, D0, True) and _natten_mask(j, q, dim_w, K1, D1, False)
        ]
        scores = np.array([scale * query[b, i, j, h] @ key[b, p, q, h] for p, q in keys])
        weights = np.exp(scores - scores.max())
        weights /= weights.sum()
        out[b, i, j, h] = sum(wt * value[b, p, q, h] for wt, (p, q) in zip(weights, keys))
    return out


def _kernel_inputs(name, rng):
    """Inputs a user of the published op would pass, and the transcribed kernel's output."""
    case = REAL[name]
    named = {n: rng.uniform(-1, 1, shape) for n, shape in case.shapes.items()}
    if name == "causal_conv1d_seq_idx":
        # packed sequences (a reset at steps 3 and 4, one of a single step), padding
        # tokens (-1) at the end of one batch
        named["seq"] = np.array([[0, 0, 0, 1, 2, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, -1, -1, -1]])
        named["seq"] = named["seq"].astype(float)
        return named, causal_conv1d_seq_idx(**named)
    if name == "resample2d":
        named["f"] = rng.uniform(-3, 3, named["f"].shape)  # past every border
        return named, resample2d(**named)
    if name == "channelnorm":
        return named, channelnorm(**named)
    if name == "rotated_feature_align":
        # boxes in image pixels (scale 0.25: the 5 x 6 map is 20 x 24 pixels), centers
        # and corners past every border, any angle
        shape = case.shapes["rb"][:3]
        named["rb"] = np.stack(
            [
                rng.uniform(-4, 24, shape),
                rng.uniform(-4, 28, shape),
                rng.uniform(2, 16, shape),
                rng.uniform(2, 16, shape),
                rng.uniform(-np.pi, np.pi, shape),
            ],
            -1,
        )
        return named, rotated_feature_align(**named, **case.attrs)
    return named, natten2d(**named, **case.attrs)


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_ops_equal_their_kernels(name, tmp_path):
    """float64, TensorFlow: the forward equals the NumPy transcription of the published
    kernel on the inputs its users pass (packed sequences and padding tokens, flow past
    every border, windows in dilation groups of unequal lengths)."""
    case = REAL[name]
    module = generate(case, tmp_path, prefix="Kernel8")
    named, want = _kernel_inputs(name, np.random.default_rng(1))
    got = module.forward(*(tf.constant(named[n]) for n in module.INPUTS), **case.attrs)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_ops_equal_tf_autodiff(name, tmp_path):
    """float64, TensorFlow: forward, vjp, the registered gradient and a tape equal TF
    autodiff over the reference evaluator and finite differences (harness.check)."""
    case = REAL[name]
    check(case, generate(case, tmp_path, prefix="Check8"))


def _tensor(target, a):
    a = np.asarray(a)
    if target == "tensorflow":
        return tf.constant(a)
    if target == "jax":
        return jax.numpy.asarray(a)
    return torch.from_numpy(a.copy())


def _run(module, target, named, cotangent, attrs, dtype, budget):
    """forward and vjp (as NumPy) of `module` at `budget` on NumPy inputs given by name,
    floats cast to `dtype`."""
    module.MAX_TEMP_BYTES = budget
    args = [_tensor(target, named[n].astype(dtype)) for n in module.INPUTS]
    y = module.forward(*args, **attrs)
    grads = module.vjp(*args, _tensor(target, cotangent.astype(dtype)), **attrs)
    return [as_numpy(t) for t in (y, *grads)]


@pytest.mark.parametrize(
    ("flow", "target"),
    [
        ("random", "tensorflow"),
        ("zero", "tensorflow"),
        ("zero", "pytorch"),
        ("integer", "pytorch"),
    ],
)
def test_resample2d_flow_gradient_is_flownet2s_backward_kernel(flow, target, tmp_path):
    """The flow's gradient equals kernel_resample2d_backward_input2, untiled and at a
    1-byte budget: at random flow, at zero flow (the identity warp: every sample on a
    pixel, the last row and column on the clamps) and at integer flow past the borders.
    At zero flow the last column's dx and the last row's dy were -x there (the clamp's tie
    sent the gradient into the read's difference with the zero outside the image); the
    kernel gives 0. The image's gradient equals the kernel's scatter of the weights.
    (JAX at zero flow passed too, in 28 s, its eager chunks slow: not run here.)"""
    case = REAL["resample2d"]
    module = generate(case, tmp_path, prefix="Flow8", target=target)
    rng = np.random.default_rng(2)
    x = rng.standard_normal(case.shapes["x"])
    f = {
        "random": rng.uniform(-3, 3, case.shapes["f"]),
        "zero": np.zeros(case.shapes["f"]),
        "integer": rng.integers(-7, 8, case.shapes["f"]).astype(float),
    }[flow]
    cotangent = rng.standard_normal(case.shapes["x"][:2] + case.shapes["f"][2:])
    want_x = np.zeros_like(x)
    for b, c, y, xx in np.ndindex(cotangent.shape):  # kernel_resample2d_backward_input1
        xf, yf, xl, xr, yt, yb = _corners(f, b, y, xx, *x.shape[2:])
        alpha, beta = xf - np.floor(xf), yf - np.floor(yf)
        g = cotangent[b, c, y, xx]
        want_x[b, c, yt, xl] += (1 - alpha) * (1 - beta) * g
        want_x[b, c, yt, xr] += alpha * (1 - beta) * g
        want_x[b, c, yb, xl] += (1 - alpha) * beta * g
        want_x[b, c, yb, xr] += alpha * beta * g
    want_f = resample2d_flow_grad(x, f, cotangent)
    for budget in (BIG, TINY):
        y, gx, gf = _run(module, target, {"x": x, "f": f}, cotangent, {}, np.float64, budget)
        np.testing.assert_allclose(y, resample2d(x, f), rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(gx, want_x, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(gf, want_f, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch"])
def test_channelnorm_gradient_is_flownet2s_backward_kernel(target, tmp_path):
    """The gradient equals kernel_channelnorm_backward_input1 (gradOutput * input /
    (output + 1e-9)) within its 1e-9 away from zero; at an all-zero pixel (the norm of
    a difference that vanishes) TF autodiff of sqrt at 0 gives nan, and so does the
    module (a loud nan, not a silent value), where the kernel's 1e-9 gives 0."""
    case = REAL["channelnorm"]
    module = generate(case, tmp_path, prefix="Norm8", target=target)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(case.shapes["x"])
    x[1, :, 2, 3] = 0.0
    cotangent = rng.standard_normal((2, 1, 4, 5))
    y, gx = _run(module, target, {"x": x}, cotangent, {}, np.float64, BIG)
    np.testing.assert_allclose(y, channelnorm(x), rtol=1e-14)
    want = channelnorm_grad(x, cotangent)
    kept = np.ones(x.shape, bool)
    kept[1, :, 2, 3] = False
    np.testing.assert_allclose(gx[kept], want[kept], rtol=1e-8)
    assert np.isnan(gx[1, :, 2, 3]).all(), gx[1, :, 2, 3]


# -------------------------------------------------------------------------- in chunks


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("causal_conv1d_seq_idx", "pytorch"),
        ("resample2d", "pytorch"),
        ("natten2d_causal_dilated", "pytorch"),
    ],
)
def test_real_ops_in_chunks_equal_the_untiled_module(name, target, tmp_path):
    """At a budget of 1 byte (several chunks): forward, every gradient path and a training
    step equal the untiled module in float64; the untiled forward equals the reference
    evaluator (tests/adversarial.py)."""
    chunks_equal_the_untiled_module(REAL[name], target, tmp_path, "Real8")


# ------------------------------------------------------- float32, logits in hundreds


@pytest.mark.parametrize("target", ["pytorch"])
def test_natten_with_logits_in_the_hundreds_in_float32(target, tmp_path):
    """Scores up to about 400 (exp of them is inf in float32): forward and every gradient
    finite, untiled and at a 1-byte budget, within 1e-4 of the largest value of the
    float64 result; float64 equal to the transcribed mask."""
    case = REAL["natten2d_causal_dilated"]
    module = generate(case, tmp_path, prefix="Hundreds8", target=target)
    named, _ = _kernel_inputs("natten2d_causal_dilated", np.random.default_rng(4))
    for n in ("query", "key"):
        named[n] = (20 * named[n]).astype(np.float32).astype(np.float64)
    want_kernel = natten2d(**named, **case.attrs)
    cotangent = np.random.default_rng(5).standard_normal(want_kernel.shape)
    want = _run(module, target, named, cotangent, case.attrs, np.float64, BIG)
    np.testing.assert_allclose(want[0], want_kernel, rtol=1e-10, atol=1e-10)
    for budget in (BIG, TINY):
        got = _run(module, target, named, cotangent, case.attrs, np.float32, budget)
        for n, g, w in zip(("y", *module.INPUTS), got, want, strict=True):
            assert np.isfinite(g).all(), (budget, n)
            assert np.abs(g - w).max() <= 1e-4 * np.abs(w).max(), (budget, n)


# ----------------------------------------------------------------------------- ties


def test_causal_conv1d_with_a_new_sequence_at_every_step_is_silu_of_its_last_tap(tmp_path):
    """seq_idx 0, 1, 2, ... (every step its own sequence): each output reads only its own
    step, silu(w[d, K - 1] * x + bias); seq_idx all equal is the plain causal conv; both
    equal the kernel, untiled and at a 1-byte budget, and the gradients in chunks equal
    the untiled ones."""
    case = REAL["causal_conv1d_seq_idx"]
    module = generate(case, tmp_path, prefix="Reset8", target="pytorch")
    rng = np.random.default_rng(6)
    named = {n: rng.standard_normal(s) for n, s in case.shapes.items()}
    cotangent = rng.standard_normal(case.shapes["x"])
    for seq in (np.arange(10.0) * np.ones((2, 1)), np.full((2, 10), 3.0)):
        named["seq"] = seq
        want = causal_conv1d_seq_idx(**named)
        untiled = _run(module, "pytorch", named, cotangent, {}, np.float64, BIG)
        tiled = _run(module, "pytorch", named, cotangent, {}, np.float64, TINY)
        np.testing.assert_allclose(untiled[0], want, rtol=1e-13, atol=1e-14)
        for g, w in zip(tiled, untiled, strict=True):
            assert (g is None) == (w is None)
            if w is not None:
                np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)
    own = named["w"][:, -1][None, :, None] * named["x"] + named["bias"][None, :, None]
    named["seq"] = np.arange(10.0) * np.ones((2, 1))
    np.testing.assert_allclose(causal_conv1d_seq_idx(**named), own / (1 + np.exp(-own)))


# ----------------------------------------------------------------------- empty axes

EMPTY = {
    "causal_conv1d_seq_idx": {"x": (2, 4, 0), "seq": (2, 0)},
    "resample2d": {"f": (0, 2, 5, 6), "x": (0, 3, 5, 6)},
    "channelnorm": {"x": (2, 0, 4, 5)},
    "rotated_feature_align": {"x": (0, 3, 5, 6), "rb": (0, 5, 6, 5)},
    "natten2d_causal_dilated": {n: (0, 7, 7, 2, 3) for n in ("query", "key", "value")},
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_empty_axes_at_a_one_byte_budget(name, tmp_path):
    """No steps, no batch, no channels: the output has the kernel's shape (channelnorm
    over no channels: zeros), every gradient zero and shaped like its input, at a 1-byte
    budget (PyTorch)."""
    case = REAL[name]
    module = generate(case, tmp_path, prefix="Empty8", target="pytorch")
    rng = np.random.default_rng(7)
    named = {n: rng.uniform(0, 3, s) for n, s in (case.shapes | EMPTY[name]).items()}
    module.MAX_TEMP_BYTES = TINY
    args = [_tensor("pytorch", named[n]) for n in module.INPUTS]
    y = as_numpy(module.forward(*args, **case.attrs))
    if name == "channelnorm":
        np.testing.assert_array_equal(y, np.zeros((2, 1, 4, 5)))
    else:
        assert y.size == 0
    grads = module.vjp(*args, _tensor("pytorch", np.ones(y.shape)), **case.attrs)
    for n, g in zip(module.INPUTS, grads, strict=True):
        if n in case.no_gradient:
            assert g is None
        else:
            assert as_numpy(g).shape == named[n].shape and not as_numpy(g).any(), n


# -------------------------------------------------------------------- unknown sizes


@pytest.mark.parametrize("name", ["resample2d"])
def test_unknown_sizes_under_tf_function_in_chunks(name, tmp_path):
    """Every size unknown when tf.function traces (the image's H and W, the flow's):
    forward and vjp at a 1-byte budget equal the untiled module eagerly. (causal_conv1d
    with seq_idx passed too, in 11 s: not run here.)"""
    case = REAL[name]
    module = generate(case, tmp_path, prefix="Unknown8")
    named, _ = _kernel_inputs(name, np.random.default_rng(8))
    args = [tf.constant(named[n]) for n in module.INPUTS]
    unknown_sizes_equal_eager(module, args, case.attrs, seed=9)


def test_rotated_feature_align_samples_on_pixels_and_on_the_clamps(tmp_path):
    """Boxes at angle 0 whose center and corners fall exactly on pixels, on the borders
    (y = 0, H - 1, and exactly one pixel outside: -1 and H, both still read, clamped) and
    past them (read 0): the forward equals the kernel and the features' gradient equals
    mmcv's backward (the cotangent plus each sample's weights scattered to its clamped
    corners), untiled and at a 1-byte budget (PyTorch)."""
    case = REAL["rotated_feature_align"]
    module = generate(case, tmp_path, prefix="RfaTies8", target="pytorch")
    rng = np.random.default_rng(10)
    x = rng.standard_normal(case.shapes["x"])
    # (y, x, w, h) in image pixels at scale 0.25: a center on pixel (2, 3) with corners
    # on (0, 1) .. (4, 5), one with corners at rows -1 and 5 (= H) and columns -1 and
    # 6 (= W), one past every border (rows -2, 6), one of size 0
    boxes = np.array([[8, 12, 16, 16], [8, 10, 28, 24], [8, 10, 32, 32], [0, 0, 0, 0]])
    rb = np.zeros(case.shapes["rb"])
    rb[..., :4] = boxes[rng.integers(0, 4, rb.shape[:3])]
    named = {"x": x, "rb": rb}
    cotangent = rng.standard_normal(x.shape)
    want_x = cotangent.copy()  # rotated_feature_align_backward: grad_output, then the
    for n, c, h, w in np.ndindex(x.shape):  # weights of each sample scattered
        roi_y, roi_x, roi_w, roi_h = rb[n, h, w, :4] * 0.25
        for dy, dx in ((0, 0), (1, 1), (1, -1), (-1, -1), (-1, 1)):
            py, px = roi_y + dy * roi_h / 2, roi_x + dx * roi_w / 2
            for weight, p, q in bilinear_interpolate_gradient(*x.shape[2:], py, px):
                want_x[n, c, p, q] += weight * cotangent[n, c, h, w]
    want = rotated_feature_align(x, rb, **case.attrs)
    for budget in (BIG, TINY):
        y, gx, grb = _run(module, "pytorch", named, cotangent, case.attrs, np.float64, budget)
        assert grb is None
        np.testing.assert_allclose(y, want, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(gx, want_x, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ peaks


def test_pytorch_natten_causal_dilated_step_stays_within_the_bound(tmp_path):
    """NATTEN 2-D, causal rows, dilation 2, float32 (1 x 16 x 14, 2 heads of 8, K = 5) at a
    64 KiB budget: the untiled step holds every window's scores (2.9 MB, 9.8x the bound),
    in chunks 0.61x. Run on one thread: on two busy cores torch's float32 index_add (the
    chunks' scatter into key and value) took 0.16 s a call against 6 us on one, 33 s a
    step."""
    from adversarial import torch_step_peaks

    case = REAL["natten2d_causal_dilated"]
    module = generate(case, tmp_path, prefix="NatPeak8", target="pytorch")
    rng = np.random.default_rng(11)
    xs = [
        torch.tensor(rng.uniform(-1, 1, (1, 16, 14, 2, 8)), dtype=torch.float32, requires_grad=True)
        for _ in module.INPUTS
    ]
    attrs = {"K0": 5, "K1": 5, "D0": 2, "D1": 2, "scale": 0.25}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        untiled, tiled, bound = torch_step_peaks(module, xs, attrs, 2**16)
    finally:
        torch.set_num_threads(threads)
    assert untiled > 3 * bound, (untiled, bound)
    assert tiled <= bound, (tiled, bound)


# -------------------------------------------------------------------------- prroi_pool


def test_prroi_pool_is_mmcvs_kernel(tmp_path):
    """float64: the forward equals prroi_pool_forward_cuda_kernel's cell-by-cell
    integrals on rois past the borders and an empty one (0), untiled and at a 1-byte
    budget, and the gradients in chunks equal the untiled ones."""
    module = generate(PRROI, tmp_path, prefix="PrRoi8", target="pytorch")
    rng = np.random.default_rng(12)
    named = {"x": rng.standard_normal(PRROI.shapes["x"]), "rois": PRROI_ROIS}
    want = prroi_pool(**named, **PRROI.attrs)
    cotangent = rng.standard_normal(want.shape)
    cotangent[3] = 0.0  # the empty roi: see the next test
    untiled = _run(module, "pytorch", named, cotangent, PRROI.attrs, np.float64, BIG)
    tiled = _run(module, "pytorch", named, cotangent, PRROI.attrs, np.float64, TINY)
    np.testing.assert_allclose(untiled[0], want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(tiled[0], want, rtol=1e-12, atol=1e-14)
    kept = [0, 1, 2]  # the gradients of the rois that have bins
    np.testing.assert_allclose(tiled[2][kept], untiled[2][kept], rtol=1e-12, atol=1e-14)
    assert np.isfinite(untiled[2][kept]).all()


@pytest.mark.parametrize(("target", "budget"), [("tensorflow", BIG), ("pytorch", TINY)])
def test_prroi_pool_gradient_beside_an_empty_roi_is_finite(target, budget, tmp_path):
    """An empty roi (no width: every bin 0, the kernel's `continue`) has no effect on
    any gradient: x's gradient is prroi_pool_backward_cuda_kernel's, and equals the
    one without that roi, and the roi's own is 0, at a nonzero cotangent for it;
    untiled (TF) and at a 1-byte budget (PyTorch). The quotient by the bins' area is an
    intermediate inside `where(AR > 0, .., 0)`: its partials were 1 / AR = inf there,
    times the select's 0 = nan in 126 of 252 gradients of x and in the roi's 4."""
    module = generate(PRROI, tmp_path, prefix="PrRoiNan8", target=target)
    rng = np.random.default_rng(13)
    x = rng.standard_normal(PRROI.shapes["x"])
    cotangent = rng.standard_normal((4, 3, 2, 3))
    named = {"x": x, "rois": PRROI_ROIS}
    grads = _run(module, target, named, cotangent, PRROI.attrs, np.float64, budget)[1:]
    fewer = {"x": x, "rois": PRROI_ROIS[:3]}
    fewer = _run(module, target, fewer, cotangent[:3], PRROI.attrs, np.float64, budget)[1:]
    want = prroi_pool_x_gradient(x, PRROI_ROIS, cotangent, **PRROI.attrs)
    np.testing.assert_allclose(grads[0], want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(grads[0], fewer[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(grads[1][3], 0.0)
    np.testing.assert_allclose(grads[1][:3], fewer[1], rtol=1e-12, atol=1e-14)

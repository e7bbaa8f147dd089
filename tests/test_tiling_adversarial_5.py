"""A fifth set of real ops in their published layouts, none of them in the earlier
adversarial files, at sizes that need chunks: FlowNet2's correlation with kernel_size 3
and both strides 2, mmcv's assign_score_withk (PAConv; symgrad.toml's PaconvAssignScore),
a masked mean over mmcv's ball-query condition (a second point set and d2 == 0 ties),
StyleGAN2-ADA's downsample2d with a 3-tap filter (odd padding 1, 0), Mamba-2's SSD in its
quadratic form with the stable segsum (a pairwise mask around an inner masked sum), with
one group and with heads sharing the B and C of their group, and Swin's window attention
with its gathered relative-position bias and shifted-window mask.

Each is checked against a NumPy transcription of its published kernel, against TF float64
autodiff over the reference evaluator and finite differences (harness.check), in chunks
against the untiled module (`adversarial.chunks_equal_the_untiled_module`: forward, every
gradient path and a training step), in float32 with values far from the origin, at ties,
and under tf.function with unknown sizes; FlowNet2's written from a spec file, and refused
in one line where its channel is computed on the left side.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

from adversarial import TINY, as_numpy, chunks_equal_the_untiled_module, unknown_sizes_equal_eager
from harness import Case, check, generate, op_spec

D2 = "sum((new_xyz[b,m,k] - xyz[b,n,k])**2, k)"
IN_BALL = f"{D2} == 0 or ({D2} >= min_r2 and {D2} < max_r2)"
SEGSUM = "sum(where(s < r and r <= t, A[b,r,h], 0), r)"
SWIN = "exp(scale * sum(q[b,h,i,d] * k[b,h,j,d], d) + table[rpi[i,j], h] + mask[b % NW, i, j])"

REAL = {
    # FlowNet2's Correlation (NVIDIA/flownet2-pytorch, correlation_cuda_kernel.cu,
    # correlation_forward): input1, input2 [N, C, H, W] zero-padded by P; output position
    # (i, j) centres the K x K patch at S1*i + MD (padded), displacement (u, v) moves it
    # by S2*(u - DR); the channel (u, v) is u*(2*DR + 1) + v, the sum over the patch and
    # the channels divided by K*K*C; outH = ceil((H + 2P - 2(MD + KR)) / S1)
    "flownet2_correlation": Case(
        "y[n,(u,v),i,j] = mean(input1[n,c, S1*i + MD - P + a - KR, S1*j + MD - P + e - KR]"
        " * input2[n,c, S1*i + MD - P + a - KR + S2*(u - DR),"
        " S1*j + MD - P + e - KR + S2*(v - DR)], c, a, e)",
        {"input1": (2, 3, 7, 9), "input2": (2, 3, 7, 9)},
        attrs={"P": 2, "K": 3, "MD": 2, "S1": 2, "S2": 2},
        lets={"KR": "(K - 1) // 2", "DR": "MD // S2"},
        let_values={"KR": 1, "DR": 1},
        ranges={
            "u": "2*DR + 1",
            "v": "2*DR + 1",
            "a": "K",
            "e": "K",
            "i": "(input1.shape[2] + 2*P - 2*(MD + KR) - 1) // S1 + 1",
            "j": "(input1.shape[3] + 2*P - 2*(MD + KR) - 1) // S1 + 1",
        },
        sizes={"u": 3, "v": 3, "a": 3, "e": 3, "i": 3, "j": 4},
        fd_directions=2,
    ),
    # mmcv's assign_score_withk, aggregate "sum" (assign_score_withk_cuda_kernel.cuh):
    # scores [B, N1, K, M], points and centers [B, N0, M, O], knn_idx [B, N1, K] whose
    # first neighbour is the centre; output [B, O, N1, K]
    "assign_score_withk": Case(
        "output[b,o,n,k] = sum(points[b, knn_idx[b,n,k], m, o] * scores[b,n,k,m]"
        " - centers[b, knn_idx[b,n,0], m, o] * scores[b,n,k,m], m)",
        {"scores": (2, 5, 4, 3), "points": (2, 7, 3, 2), "centers": (2, 7, 3, 2)},
        inputs=("scores", "points", "centers", "knn_idx"),
        index_inputs={"knn_idx": ((2, 5, 4), 0, 7)},
        fd_directions=2,
    ),
    # mmcv's ball_query condition (ball_query_cuda_kernel.cuh: d2 == 0 or min_radius² <=
    # d2 < max_radius²) over every neighbour (not the first nsample), features [B, C, N]
    # averaged per centre: xyz [B, N, 3], new_xyz [B, M, 3] (no gradient through a mask)
    "ball_query_mean": Case(
        f"y[b,c,m] = sum(where({IN_BALL}, features[b,c,n], 0), n) / sum(where({IN_BALL}, 1, 0), n)",
        {"features": (2, 3, 9), "xyz": (2, 9, 3), "new_xyz": (2, 4, 3)},
        attrs={"min_r2": 0.0, "max_r2": 1.5},
        inputs=("features", "xyz", "new_xyz"),
        no_gradient=("xyz", "new_xyz"),
        fd_directions=2,
    ),
    # StyleGAN2-ADA's downsample2d(x, f, down=2) with a 3 x 3 filter (torch_utils/ops/
    # upfirdn2d.py: padding [(fw - down + 1) // 2, (fw - down) // 2] = [1, 0] per axis),
    # symgrad.toml's Upfirdn2d formula with up 1
    "downsample2d": Case(
        "y[b,c,i,j] = sum(x[b,c,n,m] * f[KH - 1 + down_y*i - up_y*n - pad_y0,"
        " KW - 1 + down_x*j - up_x*m - pad_x0], n, m)",
        {"x": (2, 3, 7, 8), "f": (3, 3)},
        attrs={
            "up_x": 1,
            "up_y": 1,
            "down_x": 2,
            "down_y": 2,
            "pad_x0": 1,
            "pad_x1": 0,
            "pad_y0": 1,
            "pad_y1": 0,
        },
        lets={"KH": "f.shape[0]", "KW": "f.shape[1]"},
        let_values={"KH": 3, "KW": 3},
        ranges={
            "i": "(x.shape[2]*up_y + pad_y0 + pad_y1 - KH) // down_y + 1",
            "j": "(x.shape[3]*up_x + pad_x0 + pad_x1 - KW) // down_x + 1",
        },
        sizes={"i": 3, "j": 4},
        fd_directions=2,
    ),
    # Mamba-2's SSD (state-spaces/mamba, mamba_ssm/modules/ssd_minimal.py,
    # ssd_minimal_discrete) in its quadratic form: X [B, T, H, P], A [B, T, H], B and C
    # [B, T, G, N] (the einsum sums g); exp(segsum(A)) between s <= t, segsum the stable
    # one (a masked sum over s < r <= t, never a difference of cumsums)
    "mamba2_ssd": Case(
        "Y[b,t,h,p] = sum(where(s <= t, C[b,t,g,n] * B[b,s,g,n] * exp("
        f"{SEGSUM}) * X[b,s,h,p], 0), s, g, n)",
        {"X": (2, 8, 3, 2), "A": (2, 8, 3), "B": (2, 8, 1, 4), "C": (2, 8, 1, 4)},
        inputs=("X", "A", "B", "C"),
        sizes={"s": 8, "r": 8},
        fd_directions=2,
    ),
    # Mamba-2 with 2 groups (mamba_chunk_scan_combined: head h reads the B and C of
    # group h // (H / G)); the evaluator behind `symgrad check` and these tests raised
    # "Broadcast between [2,8,4,3,8,1] and [2,1,4,1,8,2] is not supported yet" (TF
    # broadcasts only up to rank 5)
    "mamba2_ssd_groups": Case(
        "Y[b,t,h,p] = sum(where(s <= t, C[b,t,h // HG,n] * B[b,s,h // HG,n] * exp("
        f"{SEGSUM}) * X[b,s,h,p], 0), s, n)",
        {"X": (2, 8, 4, 2), "A": (2, 8, 4), "B": (2, 8, 2, 3), "C": (2, 8, 2, 3)},
        inputs=("X", "A", "B", "C"),
        lets={"HG": "X.shape[2] // B.shape[2]"},
        let_values={"HG": 2},
        sizes={"s": 8, "r": 8},
        fd_directions=2,
    ),
    # Swin's WindowAttention (microsoft/Swin-Transformer, models/swin_transformer.py):
    # q, k, v [B*nW, heads, N, hd], the bias table [(2Wh-1)(2Ww-1), heads] read at the
    # relative_position_index buffer [N, N], the shifted-window mask [nW, N, N] of window
    # b % nW; output (attn @ v).transpose(1, 2).reshape(B_, N, C)
    "swin_window_attention": Case(
        f"x[b,i,(h,e)] = sum({SWIN} * v[b,h,j,e], j) / sum({SWIN}, j)",
        {
            "q": (4, 2, 4, 3),
            "k": (4, 2, 4, 3),
            "v": (4, 2, 4, 3),
            "table": (9, 2),
            "mask": (2, 4, 4),
        },
        attrs={"scale": 3**-0.5},
        inputs=("q", "k", "v", "table", "rpi", "mask"),
        index_inputs={"rpi": ((4, 4), 0, 9)},
        lets={"NW": "mask.shape[0]"},
        let_values={"NW": 2},
        fd_directions=2,
    ),
}


# ------------------------------------------------------- the kernels, transcribed


def flownet2_correlation(input1, input2, P, K, MD, S1, S2):
    """correlation_forward of flownet2-pytorch: channels-last copies padded by P, a patch
    of K x K around (S1*y + MD, S1*x + MD) against the one displaced by S2 * (tj, ti)."""
    n, c, h, w = input1.shape
    pad = ((0, 0), (0, 0), (P, P), (P, P))
    r1, r2 = np.pad(input1, pad), np.pad(input2, pad)
    kr, dr = (K - 1) // 2, MD // S2
    size = 2 * dr + 1
    oh = int(np.ceil((h + 2 * P - 2 * (kr + MD)) / S1))
    ow = int(np.ceil((w + 2 * P - 2 * (kr + MD)) / S1))
    out = np.zeros((n, size * size, oh, ow))
    for y in range(oh):
        for x in range(ow):
            y1, x1 = y * S1 + MD, x * S1 + MD
            for tj in range(-dr, dr + 1):
                for ti in range(-dr, dr + 1):
                    y2, x2 = y1 + tj * S2, x1 + ti * S2
                    total = np.zeros(n)
                    for j in range(-kr, kr + 1):
                        for i in range(-kr, kr + 1):
                            total += (r1[:, :, y1 + j, x1 + i] * r2[:, :, y2 + j, x2 + i]).sum(1)
                    out[:, (tj + dr) * size + ti + dr, y, x] = total / (K * K * c)
    return out


def assign_score_withk(scores, points, centers, knn_idx):
    """assign_score_withk_forward_cuda_kernel: one thread per (b, o, n, k)."""
    b_size, n1, k_size, m_size = scores.shape
    out = np.zeros((b_size, points.shape[3], n1, k_size))
    for b in range(b_size):
        for n in range(n1):
            cn = knn_idx[b, n, 0]
            for k in range(k_size):
                kn = knn_idx[b, n, k]
                for m in range(m_size):
                    out[b, :, n, k] += (points[b, kn, m] - centers[b, cn, m]) * scores[b, n, k, m]
    return out


def ball_query_mean(features, xyz, new_xyz, min_r2, max_r2):
    """The ball-query kernel's test on d2 (computed as the kernel does, coordinate by
    coordinate), every neighbour that passes it, features averaged."""
    d = new_xyz[:, :, None, :] - xyz[:, None, :, :]
    d2 = d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1] + d[..., 2] * d[..., 2]
    inside = (d2 == 0) | ((d2 >= min_r2) & (d2 < max_r2))  # [B, M, N]
    return np.einsum("bcn,bmn->bcm", features, inside) / inside.sum(2)[:, None, :]


def upfirdn2d_ref(x, f, up, down, pad0, pad1):
    """_upfirdn2d_ref of stylegan2-ada-pytorch, one factor and one padding for both axes,
    flip_filter False, gain 1: zero-stuff, pad, conv2d with the flipped filter, subsample."""
    b, c, h, w = x.shape
    stuffed = np.zeros((b, c, h * up, w * up))
    stuffed[:, :, ::up, ::up] = x
    padded = np.pad(stuffed, ((0, 0), (0, 0), (pad0, pad1), (pad0, pad1)))
    flipped = f[::-1, ::-1]
    kh, kw = f.shape
    oh, ow = padded.shape[2] - kh + 1, padded.shape[3] - kw + 1
    out = np.zeros((b, c, oh, ow))
    for a in range(kh):
        for e in range(kw):
            out += padded[:, :, a : a + oh, e : e + ow] * flipped[a, e]
    return out[:, :, ::down, ::down]


def ssd_minimal_discrete(X, A, B, C, block_len):
    """ssd_minimal_discrete without initial states: the diagonal blocks with exp(segsum),
    the chunk states, the inter-chunk recurrence and the state-to-output term."""

    def segsum(x):
        t = x.shape[-1]
        x = np.repeat(x[..., None], t, axis=-1)
        x = np.where(np.tril(np.ones((t, t), bool), -1), x, 0)
        x = np.cumsum(x, axis=-2)
        return np.where(np.tril(np.ones((t, t), bool), 0), x, -np.inf)

    b, length = X.shape[:2]
    c = length // block_len

    def blocks(a):
        return a.reshape(b, c, block_len, *a.shape[2:])

    X, A, B, C = blocks(X), blocks(A), blocks(B), blocks(C)
    A = A.transpose(0, 3, 1, 2)  # b h c l
    a_cumsum = np.cumsum(A, axis=-1)
    L = np.exp(segsum(A))
    y_diag = np.einsum("bclgn,bcsgn,bhcls,bcshp->bclhp", C, B, L, X)
    decay_states = np.exp(a_cumsum[..., -1:] - a_cumsum)
    states = np.einsum("bclgn,bhcl,bclhp->bcghpn", B, decay_states, X)
    states = np.concatenate([np.zeros_like(states[:, :1]), states], axis=1)
    decay_chunk = np.exp(segsum(np.pad(a_cumsum[..., -1], ((0, 0), (0, 0), (1, 0)))))
    states = np.einsum("bhzc,bcghpn->bzghpn", decay_chunk, states)[:, :-1]
    y_off = np.einsum("bclgn,bcghpn,bhcl->bclhp", C, states, np.exp(a_cumsum))
    return (y_diag + y_off).reshape(b, length, *X.shape[3:])


def swin_relative_position_index(wh, ww):
    """WindowAttention's relative_position_index buffer for a wh x ww window."""
    coords = np.stack(np.meshgrid(np.arange(wh), np.arange(ww), indexing="ij")).reshape(2, -1)
    relative = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0)
    relative[:, :, 0] += wh - 1
    relative[:, :, 1] += ww - 1
    relative[:, :, 0] *= 2 * ww - 1
    return relative.sum(-1)


def swin_window_attention(q, k, v, table, rpi, mask, scale):
    """WindowAttention.forward after the qkv projection, without the output projection."""
    b_, heads, n, hd = q.shape
    attn = (q * scale) @ k.transpose(0, 1, 3, 2)
    attn = attn + table[rpi.reshape(-1)].reshape(n, n, heads).transpose(2, 0, 1)[None]
    nw = mask.shape[0]
    attn = attn.reshape(b_ // nw, nw, heads, n, n) + mask[None, :, None]
    attn = attn.reshape(b_, heads, n, n)
    attn = np.exp(attn - attn.max(-1, keepdims=True))
    attn = attn / attn.sum(-1, keepdims=True)
    return (attn @ v).transpose(0, 2, 1, 3).reshape(b_, n, heads * hd)


def swin_shift_mask(h, w, size, shift):
    """SwinTransformerBlock's attn_mask for an h x w map, size x size windows shifted by
    `shift`: 0 within a region, -100 across regions."""
    img = np.zeros((h, w))
    cnt = 0
    for hs in (slice(0, -size), slice(-size, -shift), slice(-shift, None)):
        for ws in (slice(0, -size), slice(-size, -shift), slice(-shift, None)):
            img[hs, ws] = cnt
            cnt += 1
    windows = img.reshape(h // size, size, w // size, size).transpose(0, 2, 1, 3)
    windows = windows.reshape(-1, size * size)
    diff = windows[:, None, :] - windows[:, :, None]
    return np.where(diff != 0, -100.0, 0.0)


def _kernel_inputs(name, rng):
    """Inputs a user of the published op would pass (the real index buffers and masks),
    and the transcribed kernel's output on them."""
    case = REAL[name]
    named = {n: rng.uniform(-1, 1, shape) for n, shape in case.shapes.items()}
    if name == "flownet2_correlation":
        return named, flownet2_correlation(named["input1"], named["input2"], **case.attrs)
    if name == "assign_score_withk":
        knn = rng.integers(0, 7, (2, 5, 4))
        knn[:, :, 0] = [[0, 2, 4, 5, 6], [1, 1, 3, 6, 0]]  # centres; repeats within a row
        knn[0, 1, 2] = knn[0, 1, 0]
        named["knn_idx"] = knn
        return named, assign_score_withk(named["scores"], named["points"], named["centers"], knn)
    if name == "ball_query_mean":
        named["new_xyz"] = named["xyz"][:, [0, 3, 5, 8]]  # centres sampled from the cloud
        attrs = {"min_r2": 0.2, "max_r2": 1.5}
        return named | {"attrs": attrs}, ball_query_mean(
            named["features"], named["xyz"], named["new_xyz"], **attrs
        )
    if name == "downsample2d":
        return named, upfirdn2d_ref(named["x"], named["f"], 1, 2, 1, 0)
    if name.startswith("mamba2_ssd"):
        named["A"] = -np.exp(rng.uniform(-2, 1, named["A"].shape))  # A * dt < 0, as in the model
        x, a, b, c = (named[n] for n in ("X", "A", "B", "C"))
        group = x.shape[2] // b.shape[2]
        return named, np.concatenate(  # a head at a time, with its group's B and C
            [
                ssd_minimal_discrete(
                    x[:, :, [h]], a[:, :, [h]], b[:, :, [h // group]], c[:, :, [h // group]], 4
                )
                for h in range(x.shape[2])
            ],
            axis=2,
        )
    named["rpi"] = swin_relative_position_index(2, 2)
    named["mask"] = swin_shift_mask(4, 2, 2, 1)  # two windows, the second across regions
    named["q"] = named["q"] * 3
    return named, swin_window_attention(**named, scale=case.attrs["scale"])


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_ops_equal_their_kernels_and_tf_autodiff(name, tmp_path):
    """float64, TensorFlow: the forward equals the NumPy transcription of the published
    kernel on the inputs its users pass (Swin's real index buffer and shifted-window
    mask, ball-query centres that are points of the cloud, Mamba-2's negative A over two
    chunks of 4); forward, vjp, the registered gradient and a tape equal TF autodiff over
    the reference evaluator and finite differences (harness.check)."""
    case = REAL[name]
    module = generate(case, tmp_path, prefix="Kernel5")
    named, want = _kernel_inputs(name, np.random.default_rng(1))
    attrs = named.pop("attrs", case.attrs)
    got = module.forward(*(tf.constant(named[n]) for n in module.INPUTS), **attrs)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-13)
    check(case, module)


# -------------------------------------------------------------------------- in chunks


@pytest.mark.parametrize(
    ("name", "target"),
    [
        *((name, "pytorch") for name in sorted(REAL)),
        ("flownet2_correlation", "tensorflow"),
        ("mamba2_ssd", "tensorflow"),
        ("swin_window_attention", "tensorflow"),
        # eager JAX compiles every op of every call (a minute a case on a busy machine):
        # one op here; JAX meets the others' chunks in the tie test below
        ("flownet2_correlation", "jax"),
    ],
)
def test_real_ops_in_chunks_equal_the_untiled_module(name, target, tmp_path):
    """At a budget of 1 byte (several chunks): forward, every gradient path and a training
    step equal the untiled module in float64; the untiled forward equals the reference
    evaluator (tests/adversarial.py)."""
    chunks_equal_the_untiled_module(REAL[name], target, tmp_path, "Real5")


# ------------------------------------------------------------------ float32, far out


def _tensor(target, a):
    a = np.asarray(a)
    if target == "tensorflow":
        return tf.constant(a)
    if target == "pytorch":
        return torch.from_numpy(a.copy())
    import jax

    jax.config.update("jax_enable_x64", True)
    return jax.numpy.asarray(a)


def _run(module, target, named, cotangent, attrs, dtype, budget):
    """forward and vjp (as NumPy) of `module` at `budget` on NumPy inputs given by name,
    floats cast to `dtype`, integer index tensors as they are; the plan of the call."""
    module.MAX_TEMP_BYTES = budget
    args = [
        _tensor(target, a.astype(dtype) if a.dtype.kind == "f" else a)
        for a in (named[n] for n in module.INPUTS)
    ]
    y = module.forward(*args, **attrs)
    grads = module.vjp(*args, _tensor(target, cotangent.astype(dtype)), **attrs)
    return module._tile_plan(*args, **attrs), [as_numpy(t) for t in (y, *grads)]


def _far_out(name, rng):
    """Inputs with float32-hostile values: Swin's logits in the hundreds (so its -100 mask
    does not mask), clouds 1,000 from the origin, Mamba-2 decays down to exp(-60) a step,
    FlowNet2 features around 300 (products near 1e5)."""
    named, _ = _kernel_inputs(name, rng)
    if name == "swin_window_attention":
        named["q"], named["k"] = named["q"] * 12, named["k"] * 12
    elif name == "ball_query_mean":
        named["xyz"] = named["xyz"] + 1000
        named["new_xyz"] = named["xyz"][:, [0, 3, 5, 8]]
    elif name == "mamba2_ssd":
        named["A"] = -rng.uniform(0.1, 60, named["A"].shape)
    elif name == "flownet2_correlation":
        named["input1"], named["input2"] = named["input1"] + 300, named["input2"] - 300
    attrs = named.pop("attrs", REAL[name].attrs)
    exact = {
        n: a.astype(np.float32).astype(np.float64) for n, a in named.items() if a.dtype.kind == "f"
    }
    return named | exact, attrs


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("swin_window_attention", "tensorflow"),
        ("swin_window_attention", "pytorch"),
        ("ball_query_mean", "tensorflow"),
        ("mamba2_ssd", "pytorch"),
        ("flownet2_correlation", "pytorch"),
    ],
)
def test_far_from_the_origin_in_float32_chunks(name, target, tmp_path):
    """float32 in chunks of a 1-byte budget against the untiled module in float64 on the
    same inputs: within float32 rounding of the largest value of every result, as is the
    untiled float32 module; no nan or inf (the logits of Swin reach 400)."""
    module = generate(REAL[name], tmp_path, prefix="Far5", target=target)
    named, attrs = _far_out(name, np.random.default_rng(4))
    args = [_tensor(target, named[n]) for n in module.INPUTS]
    shape = tuple(module.forward(*args, **attrs).shape)
    cotangent = np.random.default_rng(5).standard_normal(shape)
    _, want = _run(module, target, named, cotangent, attrs, np.float64, 2**40)
    errors, plans = {}, {}
    for budget in (TINY, 2**40):
        plans[budget], got = _run(module, target, named, cotangent, attrs, np.float32, budget)
        errors[budget] = max(
            float(np.abs(g - w).max() / np.abs(w).max())
            for g, w in zip(got, want, strict=True)
            if w is not None
        )
        assert all(np.isfinite(g).all() for g in got if g is not None)
    assert plans[TINY] is not None and plans[2**40] is None
    # float32 spacing at Swin's largest logit, 400: 3e-5 (measured 2.1e-5 untiled and
    # 1.8e-5 in chunks in TF, 7.5e-6 and 6.4e-6 in PyTorch); the others 7e-8 to 2e-7
    limit = 1e-4 if name == "swin_window_attention" else 1e-5
    assert errors[TINY] < limit and errors[2**40] < limit, errors


@pytest.mark.parametrize("target", ["tensorflow", "pytorch"])
def test_mamba2_inf_and_nan_at_masked_steps_leave_earlier_outputs_exact(target, tmp_path):
    """X at the last step +inf and -inf, B there nan: every earlier output masks them
    (s <= t), so it equals the output with them 0, untiled and in chunks of a 1-byte
    budget; the last output is not finite. B * C is masked over its own indices and the
    mask's (`where(s <= t, B * C, 0)`) and X contracted with the masked weights in a
    branch exact for non-finite X (masked_values): the exponential's 0 times an unmasked
    inf would be nan at every step."""
    module = generate(REAL["mamba2_ssd"], tmp_path, prefix="Inf5", target=target)
    named, _ = _kernel_inputs("mamba2_ssd", np.random.default_rng(8))
    zeroed = {n: a.copy() for n, a in named.items()}
    zeroed["X"][:, -1], zeroed["B"][:, -1] = 0, 0
    named["X"][:, -1, 0], named["X"][:, -1, 1] = np.inf, -np.inf
    named["B"][:, -1, 0, 1] = np.nan
    for budget in (2**40, TINY):
        module.MAX_TEMP_BYTES = budget
        got, want = (
            as_numpy(module.forward(*(_tensor(target, a[n]) for n in module.INPUTS)))
            for a in (named, zeroed)
        )
        np.testing.assert_allclose(got[:, :-1], want[:, :-1], rtol=1e-14, atol=1e-14)
        assert not np.isfinite(got[:, -1]).any()


def _ssd_terms(X, A, B, C):
    """Mamba-2's quadratic form in NumPy, each kept term C * B * exp(segsum) * X[s] in IEEE
    arithmetic (masked terms are not formed): Y [b, t, h, p]."""
    Y = np.zeros(X.shape)
    with np.errstate(invalid="ignore"):
        for t in range(X.shape[1]):
            for s in range(t + 1):
                decay = np.exp(A[:, s + 1 : t + 1].sum(1))  # [b, h]
                cb = np.einsum("bgn,bgn->b", C[:, t], B[:, s])
                Y[:, t] += (cb[:, None] * decay)[..., None] * X[:, s]
    return Y


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_mamba2_signed_weights_times_inf_and_nan_are_exact(target, tmp_path):
    """X is contracted with the masked decay and B * C (no [b,s,h,p,t] masked copy of X),
    whose weights have either sign: +inf at a step whose weight is negative gives -inf,
    +inf at a weight of exactly 0 (B 0 there) gives nan, +inf and -inf reaching one
    output give nan, nan gives nan, an infinite weight (B inf) at a value of 0 gives nan
    and at a finite or an infinite one the inf of their signs; outputs before those
    steps are finite. Untiled and in
    chunks of a 1-byte budget, every output equal to the kept terms summed in NumPy (the
    non-finite ones exactly)."""
    module = generate(REAL["mamba2_ssd"], tmp_path, prefix="Signed5", target=target)
    named, _ = _kernel_inputs("mamba2_ssd", np.random.default_rng(9))
    X, B = named["X"], named["B"]
    X[0, 3, 0, 0] = np.inf  # batch 0, head 0: signed weights of the steps after 3
    B[1, 5] = 0.0  # batch 1: step 5's weights are all exactly 0
    X[1, 5, 1, 1] = np.inf
    X[0, 6, 2, 1] = -np.inf  # batch 0, head 2: -inf alone
    X[0, 6, 0, 0] = -np.inf  # batch 0, head 0: beside step 3's +inf
    X[1, 2, 2, 0] = np.nan
    B[0, 7, 0, 1] = np.inf  # batch 0, last step: weights of +-inf at every head
    X[0, 7, 1, 0], X[0, 7, 1, 1], X[0, 7, 2, 0] = 0.0, -2.0, np.inf  # nan, -+inf, +-inf
    want = _ssd_terms(X, named["A"], B, named["C"])
    assert np.isneginf(want).any() and np.isposinf(want).any() and np.isnan(want).any()
    for budget in (2**40, TINY):
        module.MAX_TEMP_BYTES = budget
        got = as_numpy(module.forward(*(_tensor(target, named[n]) for n in module.INPUTS)))
        for test in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(test(got), test(want), err_msg=(budget, test))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", ["sliding_sum", "cumsum_times_plain"])
def test_a_mask_no_prefix_sum_takes_is_a_temporary_in_chunks(name, tmp_path):
    """`sum(where(i - 2 <= k <= i, x[b,k], 0), k)` and `sum(where(k <= i, x[b,k], 0), k) *
    x[b,i]` are built as a [b,i,k] `where` (no cumsum takes two bounds, or a factor over
    i beside the mask), as Mamba-2's segsum is: the plan counts it and the op runs in
    chunks of i, equal to the untiled module. The estimate counted no such mask, so the
    ops were never tiled."""
    from test_indexing_siblings import SIBLINGS

    from symgrad.pipeline import compile_op

    tiling = compile_op(op_spec(SIBLINGS[name], "Mask5")).tiling
    assert tiling is not None and tiling.index == "i"
    assert tiling.temporaries == ("[b,i,k]",)
    chunks_equal_the_untiled_module(SIBLINGS[name], "pytorch", tmp_path, "Mask5")


# ------------------------------------------------------------------------------- ties

# Four centres 10 apart on x; around each, points at exactly representable offsets whose
# squared distances are 0, min_r2 = 1/4 and max_r2 = 1 (the kernel's ties), 1/16 (below
# min_r2), 1/2 and 5/4.
CENTRES = np.array([[10.0 * m, 0.0, 0.0] for m in range(4)])
OFFSETS = [
    [(0, 0, 0), (0.5, 0, 0), (1, 0, 0), (0.5, 0.5, 0)],
    [(0, 0.25, 0), (0, 0, -1), (0, -0.5, 0)],
    [(0, 0, 0), (1, 0.5, 0), (0, 0.5, 0.5)],
    [(0, 0, 0.5), (0, -0.5, -0.5), (-0.25, 0, 0), (0, 0, 0), (0.5, 0, -1)],
]


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_ball_query_ties_at_both_radii_in_chunks(target, tmp_path):
    """A neighbour at exactly max_r2 is out, one at exactly min_r2 is in, one at d2 == 0 is
    in although min_r2 > 0 (the centre itself and a duplicate of it), one below min_r2 is
    out, as in mmcv's kernel: in float64 and float32, untiled and in chunks of a 1-byte
    budget, the means and the features' gradient equal the kernel's choice of neighbours
    exactly (float64) or to float32 rounding."""
    module = generate(REAL["ball_query_mean"], tmp_path, prefix="Ties5", target=target)
    rng = np.random.default_rng(6)
    xyz = np.array([CENTRES[m] + o for m, offs in enumerate(OFFSETS) for o in offs])
    xyz = np.stack([xyz, xyz[::-1]])  # [2, 15, 3]; the second batch in another order
    named = {"features": rng.standard_normal((2, 3, 15)), "xyz": xyz}
    named["new_xyz"] = np.stack([CENTRES, CENTRES[::-1]])
    attrs = {"min_r2": 0.25, "max_r2": 1.0}
    want = ball_query_mean(named["features"], xyz, named["new_xyz"], **attrs)
    counts = [3, 1, 2, 3]  # by hand: [0, 1/4, 1/2]; [1/4]; [0, 1/2]; [1/4, 1/2, 0]
    d = named["new_xyz"][:, :, None] - xyz[:, None]
    inside = ((d**2).sum(-1) == 0) | (((d**2).sum(-1) >= 0.25) & ((d**2).sum(-1) < 1))
    assert inside.sum(2).tolist() == [counts, counts[::-1]]
    cotangent = rng.standard_normal(want.shape)
    grad = np.einsum("bcm,bmn->bcn", cotangent / inside.sum(2)[:, None], inside)
    for dtype, tol in ((np.float64, 1e-14), (np.float32, 1e-6)):
        for budget in (2**40, TINY):
            plan, (y, g_features, g_xyz, g_new) = _run(
                module, target, named, cotangent, attrs, dtype, budget
            )
            assert (plan is None) == (budget == 2**40)
            np.testing.assert_allclose(y, want, rtol=tol, atol=tol)
            np.testing.assert_allclose(g_features, grad, rtol=tol, atol=tol)
            assert g_xyz is None and g_new is None


# -------------------------------------------------------------------- unknown sizes


@pytest.mark.parametrize("name", ["flownet2_correlation", "swin_window_attention"])
def test_unknown_sizes_under_tf_function_in_chunks(name, tmp_path):
    """Every size unknown when tf.function traces (FlowNet2's output size, a ceil of
    the padded size over its stride; Swin's window b % nW, nW from the mask's shape), a
    1-byte budget: forward and vjp equal the untiled module run eagerly."""
    from harness import make_tensors

    case = REAL[name]
    module = generate(case, tmp_path, prefix="Unknown5")
    args = make_tensors(case, module.INPUTS)
    unknown_sizes_equal_eager(module, args, case.attrs, seed=7)


# ------------------------------------------------------------------ from a spec file


def _flownet2_table(output: str) -> str:
    case = REAL["flownet2_correlation"]
    formula = case.equations[0].replace("y[n,(u,v),i,j]", output)
    attrs = ", ".join(f'{a} = "int"' for a in case.attrs)
    lets = ", ".join(f'{k} = "{v}"' for k, v in case.lets.items())
    ranges = ", ".join(f'{k} = "{v}"' for k, v in case.ranges.items())
    return (
        f'[ops.FlowNet2Correlation]\nformula = "{formula}"\n'
        f"attrs = {{ {attrs} }}\nlet = {{ {lets} }}\nranges = {{ {ranges} }}\n"
    )


def test_a_spec_file_gives_a_range_to_an_index_named_e(tmp_path, capsys):
    """FlowNet2's patch offsets are (a, e): a formula may name an index `e` (inside
    brackets a constant's name is an index), and the spec's `ranges` (and `sizes`) must
    then take `e = "K"`. They refused it ("index name 'e' is reserved", exit 2), so the
    formula the tests build was impossible to write in symgrad.toml."""
    from symgrad.cli import main

    spec = tmp_path / "symgrad.toml"
    spec.write_text(f'out = "gen"\n\n{_flownet2_table("y[n,(u,v),i,j]")}', encoding="utf-8")
    assert main(["generate", str(spec)]) == 0, capsys.readouterr().err
    assert (tmp_path / "gen" / "flow_net2_correlation.py").is_file()
    sized = spec.read_text(encoding="utf-8") + '\n[ops.Taps]\nformula = "y[e] = x[e]"\n'
    spec.write_text(sized + "sizes = { e = 3 }\n", encoding="utf-8")
    assert main(["generate", str(spec)]) == 0, capsys.readouterr().err


def test_a_computed_output_channel_is_refused_in_one_line(tmp_path, capsys):
    """FlowNet2's kernel writes channel (tj + dr) * (2 dr + 1) + ti + dr: written so on the
    left side it is refused with exit 2 and a one-line reason that shows the spelling
    that works, a composite axis `(u, v)`."""
    from symgrad.cli import main

    spec = tmp_path / "symgrad.toml"
    table = _flownet2_table("y[n, u*(2*DR + 1) + v, i, j]")
    spec.write_text(f'out = "gen"\n\n{table}', encoding="utf-8")
    assert main(["generate", str(spec)]) == 2
    err = capsys.readouterr().err
    reason = err.splitlines()[0]
    assert "[ops.FlowNet2Correlation]: the left side takes plain indices" in reason
    assert "a flattened axis is a composite index such as `y[b, (i, j)]`" in reason
    assert not (tmp_path / "gen").exists()


# ------------------------------------------------------------------------------- peak


SSD_BUDGET = 2**14


def _ssd_peak_arrays(groups: int = 1):
    """Mamba-2's SSD inputs for the peak tests, float32, 1 x 32 steps x 4 heads x 8
    channels, 8 states in each of `groups` groups, A < 0: with one group 10,752 bytes
    of inputs and output, a bound of 59,392."""
    rng = np.random.default_rng(16)
    shapes = {"X": (1, 32, 4, 8), "A": (1, 32, 4), "B": (1, 32, groups, 8)}
    shapes["C"] = shapes["B"]
    return {
        n: (-np.exp(rng.uniform(-2, 1, shape)) if n == "A" else rng.standard_normal(shape)).astype(
            np.float32
        )
        for n, shape in shapes.items()
    }


@pytest.mark.parametrize("name", ["mamba2_ssd", "mamba2_ssd_groups"])
def test_pytorch_mamba2_ssd_step_stays_within_the_bound(name, tmp_path):
    """Mamba-2's SSD, float32 (`_ssd_peak_arrays`; two groups of heads sharing B and C in
    `mamba2_ssd_groups`): untiled the step holds [b,r,h,s,t] segsums (one group: 615 KB,
    10x the bound of 4x the inputs and outputs plus a 16 KiB budget; two: 838 KB; 873 KB
    and 968 KB with X masked over [b,s,h,p,t]). In chunks of one position of t (and of b,
    or h) it holds 41 KB (two groups: 41 KB, 0.60x). It held 467 KB in chunks of 4 (the plan counted
    [b,h,s] a position, and the mask was broadcast to the product's every axis,
    [b,s,g,n,h,p]), untiled 5.0 MB; two groups 1.27 MB in chunks (18.8x)."""
    from adversarial import torch_step_peaks

    module = generate(REAL[name], tmp_path, prefix="SsdPeak", target="pytorch")
    arrays = _ssd_peak_arrays(1 if name == "mamba2_ssd" else 2)
    xs = [torch.tensor(arrays[n], requires_grad=True) for n in module.INPUTS]
    untiled, tiled, bound = torch_step_peaks(module, xs, {}, SSD_BUDGET)
    assert untiled > 3 * bound, (untiled, bound)
    assert tiled <= bound, (tiled, bound)


SSD_MEASURE = """
import json, sys
import tensorflow as tf
sys.path.insert(0, {folder!r})
sys.path.insert(0, {tests!r})
from peaks import tf_step_peaks
from test_tiling_adversarial_5 import SSD_BUDGET, _ssd_peak_arrays
import {stem} as module

arrays = _ssd_peak_arrays()
args = [tf.constant(arrays[n]) for n in module.INPUTS]
print(json.dumps(tf_step_peaks(module, args, SSD_BUDGET)))
"""


def test_tensorflow_mamba2_ssd_step_stays_within_the_bound(tmp_path):
    """TensorFlow's allocator (BFC, a fresh process), the one-group inputs of the PyTorch test:
    untiled 0.90 MB (15x the bound; 1.44 MB with X masked over [b,s,h,p,t]), in chunks
    45 KB (0.75x). It held 1.07 MB in chunks
    (18x), 8.4 MB untiled, with the mask broadcast to the product's every axis."""
    from peaks import run_tensorflow

    stem = generate(REAL["mamba2_ssd"], tmp_path, prefix="SsdPeak").__name__
    tests = str(Path(__file__).resolve().parent)
    found = run_tensorflow(SSD_MEASURE.format(folder=str(tmp_path), tests=tests, stem=stem))
    bound = 4 * found["io"] + SSD_BUDGET
    assert found["untiled"] > 3 * bound, (found, bound)
    assert found["tiled"] <= bound, (found, bound)


def test_jax_mamba2_ssd_step_stays_within_the_bound(tmp_path):
    """XLA's memory_analysis of the jitted step, the one-group inputs of the PyTorch test: untiled
    774 KB of temporaries (13x the bound; 905 KB with X masked over [b,s,h,p,t]), in
    chunks 42 KB (29 KB with X masked: XLA holds the exact branch's counts too). They were 1.66 MB in chunks
    (28x), 6.5 MB untiled, with the mask broadcast to the product's every axis."""
    jnp = pytest.importorskip("jax.numpy")
    from peaks import jax_step_memory

    module = generate(REAL["mamba2_ssd"], tmp_path, prefix="SsdPeak", target="jax")
    arrays = _ssd_peak_arrays()
    xs = [jnp.asarray(arrays[n]) for n in module.INPUTS]
    bound = 4 * (sum(a.nbytes for a in arrays.values()) + module.forward(*xs).nbytes) + SSD_BUDGET
    module.MAX_TEMP_BYTES = 2**40
    untiled = jax_step_memory(module, xs).temp_size_in_bytes
    module.MAX_TEMP_BYTES = SSD_BUDGET
    assert module._tile_plan(*xs) is not None
    tiled = jax_step_memory(module, xs).temp_size_in_bytes
    assert untiled > 3 * bound, (untiled, bound)
    assert tiled <= bound, (tiled, bound)

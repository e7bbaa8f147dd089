"""More real ops in their published layouts, none of them in symgrad.toml, pushed as a new
user would: in chunks under a budget that forces tiling (MAX_TEMP_BYTES = 1: as many chunks
as positions, with second levels, stages and summed chunks where the plan has them), equal
to the untiled module in float64 on every path (forward, vjp, the registered gradient or
autograd, a training step); NATTEN's 3-D window, whose gather has nine axes; unknown sizes
under tf.function; float32 far from the origin; and the peak of a training step.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

from adversarial import chunks_equal_the_untiled_module, torch_step_peaks
from harness import Case, generate, make_tensors, reference

TINY = 1

# ------------------------------------------------------------------------ the real ops

REAL = {
    # fairseq's DynamicConv1dTBC: time first, x [T, B, C], a filter per head and step
    # [T, B, H, K]
    "dynamicconv_tbc": Case(
        "y[t,b,c] = sum(weight[t,b,c // R,k] * x[t + k - P, b, c], k)",
        {"x": (11, 2, 6), "weight": (11, 2, 3, 5)},
        attrs={"R": 2, "P": 2},
    ),
    # NATTEN's 1-D QK with dilation D (a length divisible by D): the window of i is
    # clamped inside i's dilation group
    "natten_qk_1d_dilated": Case(
        "attn[b,h,i,k] = sum(query[b,h,i,d] * "
        "key[b,h, i % D + D*max(min(i // D - ns, L // D - ks), 0) + D*k, d], d)",
        {"query": (2, 3, 12, 4), "key": (2, 3, 12, 4)},
        attrs={"ns": 1, "ks": 3, "D": 2},
        lets={"L": "key.shape[2]"},
        let_values={"L": 12},
        ranges={"k": "ks"},
        sizes={"k": 3},
    ),
    # torchaudio's compute_deltas: replicate padding (clamped reads), x [B, F, T]
    "compute_deltas": Case(
        "y[b,f,t] = sum((n - N) * x[b,f, max(min(t + n - N, T - 1), 0)], n) / Z",
        {"x": (2, 5, 9)},
        attrs={"N": 2, "Z": 10.0},
        lets={"T": "x.shape[2]"},
        let_values={"T": 9},
        ranges={"n": "2*N + 1", "t": "T"},
        sizes={"n": 5, "t": 9},
    ),
    # Mamba's causal_conv1d with its SiLU: x [B, D, T], weight [D, K]
    "causal_conv1d_silu": Case(
        "y[b,d,t] = (sum(w[d,k] * x[b,d,t + k - K + 1], k) + bias[d])"
        " * sigmoid(sum(w[d,k] * x[b,d,t + k - K + 1], k) + bias[d])",
        {"x": (2, 4, 10), "w": (4, 3), "bias": (4,)},
        attrs={"K": 3},
        sizes={"t": 10},
    ),
    # PyTorch Geometric's softmax over the nodes of a segment (a pairwise mask)
    "segment_softmax": Case(
        "y[n] = exp(x[n]) / sum(where(seg[m] == seg[n], exp(x[m]), 0), m)",
        {"x": (9,), "seg": (9,)},
        no_gradient=("seg",),
    ),
    # mmcv's masked_conv2d: a 3x3 SAME convolution kept where the mask is set
    "masked_conv2d": Case(
        "y[b,o,i,j] = where(mask[b,i,j] > 0,"
        " sum(w[o,c,u,v] * x[b,c,i+u-1,j+v-1], c, u, v) + bias[o], 0)",
        {"x": (2, 3, 6, 5), "w": (4, 3, 3, 3), "bias": (4,), "mask": (2, 6, 5)},
        no_gradient=("mask",),
    ),
    # StyleGAN2's modulated, demodulated 3x3 convolution
    "modulated_conv_demod": Case(
        "y[b,o,i,j] = sum(w[o,c,u,v] * s[b,c] * x[b,c,i+u-1,j+v-1], c, u, v)"
        " / sqrt(sum((w[o,c,u,v] * s[b,c])**2, c, u, v) + 1e-8)",
        {"x": (2, 3, 6, 5), "w": (4, 3, 3, 3), "s": (2, 3)},
        ranges={"i": "x.shape[2]", "j": "x.shape[3]"},  # SAME (the default is VALID's)
        sizes={"i": 6, "j": 5},
    ),
    # torchaudio's convolve in "full" mode, a filter shared by the batch
    "fir_full": Case(
        "y[b,n] = sum(x[b, n - k] * h[k], k)",
        {"x": (2, 9), "h": (4,)},
        ranges={"n": "x.shape[1] + h.shape[0] - 1"},
        sizes={"n": 12},
    ),
}


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("dynamicconv_tbc", "tensorflow"),
        ("natten_qk_1d_dilated", "pytorch"),
        ("compute_deltas", "tensorflow"),
        ("causal_conv1d_silu", "pytorch"),
        ("segment_softmax", "tensorflow"),
        ("modulated_conv_demod", "tensorflow"),
        ("fir_full", "pytorch"),
    ],
)
def test_real_ops_in_chunks_equal_the_untiled_module(name, target, tmp_path):
    """forward, vjp, the registered gradient and a tape (TF) or autograd (PyTorch), and a
    training step, at a budget of 1 byte, equal the untiled module in float64; the
    untiled forward equals the independent reference evaluator."""
    chunks_equal_the_untiled_module(REAL[name], target, tmp_path, "Real2")


# ----------------------------------------------------- NATTEN 3-D: a gather of nine axes

NATTEN_3D = Case(
    "attn[b,h,i,j,l,(u,v,w)] = sum(query[b,h,i,j,l,d] * key[b,h,"
    " max(min(i - K // 2, H - K), 0) + u, max(min(j - K // 2, W - K), 0) + v,"
    " max(min(l - K // 2, T - K), 0) + w, d], d)",
    {"query": (1, 2, 5, 4, 6, 3), "key": (1, 2, 5, 4, 6, 3)},
    attrs={"K": 3},
    lets={"H": "key.shape[2]", "W": "key.shape[3]", "T": "key.shape[4]"},
    let_values={"H": 5, "W": 4, "T": 6},
    ranges={"u": "K", "v": "K", "w": "K"},
    sizes={"u": 3, "v": 3, "w": 3},
)


def test_natten_3d_window_runs_in_tensorflow_untiled_and_in_chunks(tmp_path):
    """NATTEN's 3-D QK gathers the window as [b, h, i, u, j, v, l, w, d]: nine axes. Its
    zeros outside the key were a `tf.where` beside a scalar zero, which TensorFlow runs only
    up to rank 8 ("Broadcast between [1,2,5,3,4,3,6,3,3] and ... is not supported yet", on
    every call); a `select` of one shape runs at any rank. Forward against the reference
    evaluator, vjp against TF autodiff over it, and in chunks."""
    module = generate(NATTEN_3D, tmp_path, prefix="Natten3d")
    query, key = make_tensors(NATTEN_3D, module.INPUTS)
    cotangent = tf.constant(np.random.default_rng(4).standard_normal((1, 2, 5, 4, 6, 27)))
    with tf.GradientTape() as tape:
        tape.watch([query, key])
        (expected,) = reference(NATTEN_3D, {"query": query, "key": key})
    want = tape.gradient(expected, [query, key], output_gradients=cotangent)
    for budget in (2**40, TINY):
        module.MAX_TEMP_BYTES = budget
        np.testing.assert_allclose(module.forward(query, key, K=3).numpy(), expected.numpy())
        grads = module.vjp(query, key, cotangent, K=3)
        for got, w in zip(grads, want, strict=True):
            np.testing.assert_allclose(got.numpy(), w.numpy(), rtol=1e-12, atol=1e-12)
    assert module._tile_plan(query, key, K=3)[1] == 1


# ------------------------------------------------------------------ the bound, measured

PEAK_SIZES = {  # op -> (float32 input shapes, attrs); each index its own size
    # PyG's softmax over 1,000 nodes in 7 segments: the mask is [n, m]
    "segment_softmax": ({"x": (1000,), "seg": (1000,)}, {}),
    # NATTEN 3-D, a 5x5x5 window over 12 x 10 x 8 with 16 channels and 2 heads
    "natten_3d": ({"query": (1, 2, 12, 10, 8, 16), "key": (1, 2, 12, 10, 8, 16)}, {"K": 5}),
    # fairseq's dynamicconv, TBC, K = 31, 64 channels in 4 heads
    "dynamicconv_tbc": ({"x": (240, 2, 64), "weight": (240, 2, 4, 31)}, {"R": 16, "P": 15}),
}


@pytest.mark.parametrize("name", sorted(PEAK_SIZES))
def test_pytorch_training_step_of_real_ops_stays_within_the_bound(name, tmp_path):
    """A float32 PyTorch step (forward, the sum of sin of the output, the gradient of every
    float input) at a budget of 256 KiB holds at most 4x the bytes of the inputs and
    outputs plus the budget, where the untiled step holds several times that bound.
    Measured: segment softmax 4.3x of io tiled against 4001x untiled (N = 3000), NATTEN
    3-D 2.4x against 53x, dynamicconv TBC 3.5x against 49x."""

    case = NATTEN_3D if name == "natten_3d" else REAL[name]
    shapes, attrs = PEAK_SIZES[name]
    module = generate(case, tmp_path, prefix="Peak2", target="pytorch")
    rng = np.random.default_rng(6)
    xs = [
        torch.tensor(
            rng.integers(0, 7, shapes[n]) if n == "seg" else rng.standard_normal(shapes[n]),
            dtype=torch.float32,
            requires_grad=n not in case.no_gradient,
        )
        for n in module.INPUTS
    ]

    untiled, tiled, bound = torch_step_peaks(module, xs, attrs, 2**18)
    print(f"{name}: untiled {untiled} bytes, tiled {tiled}, bound {bound}")
    assert untiled > 3 * bound, (untiled, bound)
    assert tiled <= bound, (tiled, bound)


# ------------------------------------------------- pinned: a NaN that graph mode drops


def test_tensorflow_chunks_keep_the_nan_of_a_max_over_a_log_of_negatives(tmp_path):
    """max over m of log(1 + x.z) where some x.z < -1: the untiled forward (eager) is NaN
    at those n, as the reference evaluator; in chunks the same formula gave a finite
    number (0.336 at n = 0 against NaN), silently: TF's graph optimizer had rewritten the
    chunk's max(log(s)) as log(max(s)). NaN where the reference is NaN; elsewhere the
    chunks' dot products round within an ulp of the whole op's."""
    case = Case(
        "y[b,n] = max(log(1 + sum(x[b,n,c] * z[b,m,c], c)), m)",
        {"x": (2, 7, 3), "z": (2, 5, 3)},
    )
    module = generate(case, tmp_path, prefix="NanMax")
    x, z = make_tensors(case, module.INPUTS)
    (expected,) = reference(case, {"x": x, "z": z})
    assert np.isnan(expected.numpy()).any() and not np.isnan(expected.numpy()).all()
    module.MAX_TEMP_BYTES = 2**40
    np.testing.assert_array_equal(module.forward(x, z).numpy(), expected.numpy())
    module.MAX_TEMP_BYTES = TINY
    assert module._tile_plan(x, z) is not None
    got = module.forward(x, z).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected.numpy()))
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-14, atol=0)


# ---------------------------------------------------------------- hostile values, sizes

DISTANCE = "sum((x[b,n,c] - z[b,m,c])**2, c)"
CHAMFER_MEAN = Case(
    f"y[b] = mean(min({DISTANCE}, m), n) + mean(min({DISTANCE}, n), m)",
    {"x": (2, 7, 3), "z": (2, 5, 3)},
)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch"])
def test_chamfer_mean_far_from_the_origin_in_float32_chunks(target, tmp_path):
    """The symmetric Chamfer loss with its means (mmcv's reduction), clouds offset by 1e4
    with spreads of 10: in chunks of one position, float32 stays within float32 rounding
    of the float64 module (measured 5e-8 TF, 1.2e-7 PyTorch, tiled as untiled)."""
    from test_tiling_adversarial import _float32_against_float64

    rng = np.random.default_rng(11)
    x, z = (rng.standard_normal((2, n, 3)) * 10 + 1e4 for n in (7, 5))
    tiled, untiled, plan = _float32_against_float64(CHAMFER_MEAN, [x, z], target, tmp_path)
    assert plan is not None
    assert tiled < 1e-6 and untiled < 1e-6, (tiled, untiled)


def test_natten_dilated_window_under_unknown_sizes_in_chunks(tmp_path):
    """NATTEN's dilated window (`%` and `//` of the position) under tf.function with every
    size unknown and a budget of 1 byte gives the untiled vjp."""
    case = REAL["natten_qk_1d_dilated"]
    module = generate(case, tmp_path, prefix="NattenUnknown")
    query, key = make_tensors(case, module.INPUTS)
    cotangent = tf.constant(np.random.default_rng(12).standard_normal((2, 3, 12, 3)))
    module.MAX_TEMP_BYTES = 2**40
    want = module.vjp(query, key, cotangent, **case.attrs)
    module.MAX_TEMP_BYTES = TINY
    spec = [tf.TensorSpec([None] * 4, tf.float64)] * 3
    unknown = tf.function(lambda q, k, g: module.vjp(q, k, g, **case.attrs), input_signature=spec)
    for got, w in zip(unknown(query, key, cotangent), want, strict=True):
        np.testing.assert_allclose(got.numpy(), w.numpy(), rtol=1e-12, atol=1e-12)

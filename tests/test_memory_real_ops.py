"""The memory bound on windowed ops in their published layouts (the ops of symgrad.toml
that cite mmcv's CARAFE and correlation, involution, fairseq's dynamicconv, NATTEN's 2-D AV,
NATTEN's 2-D QK in its K*K layout (a composite output axis) and Longformer's AV), in all
three targets: a float32 training step (forward, a scalar loss, the gradient of every float
input) at a budget of 256 KiB holds at most 4x the bytes of the op's inputs and outputs
plus the budget, at sizes where the untiled step needs several times that bound. Each
size keeps one position of the tiled index within the budget (a chunk holds at least one
position).

Peaks as in tests/test_tiling.py: TensorFlow's BFC allocator statistics (in a subprocess,
which the allocator needs), the running sum of torch.profiler's allocation events, and the
compiled JAX step's memory_analysis() (temporaries, arguments and outputs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp
from harness import load_module
from peaks import jax_step_bytes, run_tensorflow
from test_tiling import _torch_memory

from symgrad.model import build
from symgrad.pipeline import compile_op, module_text
from symgrad.spec import parse_spec

REPO = Path(__file__).resolve().parent.parent
BUDGET = 2**18

# op -> (module, input shapes in the op's input order, int inputs' values, attrs); each
# index its own size.
SIZES = {
    # features (N, C, H, W), masks (N, K*K, 2H, 2W): tiled along the output rows
    "Carafe": (
        "carafe",
        {"features": (2, 32, 16, 20), "masks": (2, 25, 32, 40)},
        {},
        {"K": 5, "S": 2},
    ),
    # x (B, C, H, W), weight (B, G, K, K, H, W)
    "Involution": ("involution", {"x": (1, 16, 40, 8), "weight": (1, 1, 7, 7, 40, 8)}, {}, {}),
    # input (B, C, T), weight (B, H, K, T)
    "DynamicConv": ("dynamic_conv", {"input": (2, 256, 120), "weight": (2, 4, 31, 120)}, {}, {}),
    # attn (B, heads, H, W, K*K), value (B, heads, H, W, D)
    "NattenAv2d": (
        "natten_av2d",
        {"attn": (1, 1, 64, 8, 25), "value": (1, 1, 64, 8, 32)},
        {},
        {"K": 5},
    ),
    # query, key (B, heads, H, W, D), attn (B, heads, H, W, K*K): tiled along the rows i
    "NattenQk2d": (
        "natten_qk2d",
        {"query": (1, 2, 80, 5, 24), "key": (1, 2, 80, 5, 24)},
        {},
        {"K": 5},
    ),
    # X (b, n, h, 2w+1), Y (b, n, h, m), D (h): tiled along n, the window's centre
    "LongformerAv": (
        "longformer_av",
        {"X": (1, 112, 2, 65), "Y": (1, 112, 2, 32), "D": (2,)},
        {"D": [1, 2]},
        {"w": 32},
    ),
    # input1, input2 (N, C, H, W), the output (N, 2r+1, 2r+1, H, W)
    "MmcvCorrelation": (
        "mmcv_correlation",
        {"input1": (2, 16, 64, 8), "input2": (2, 16, 64, 8)},
        {},
        {"r": 3},
    ),
}


def _arrays(op: str) -> list[np.ndarray]:
    _, shapes, ints, _ = SIZES[op]
    rng = np.random.default_rng(5)
    return [
        np.asarray(ints[n], np.int32) if n in ints else rng.standard_normal(s).astype(np.float32)
        for n, s in shapes.items()
    ]


def _op(name: str):
    spec = parse_spec((REPO / "symgrad.toml").read_text(encoding="utf-8"), "symgrad.toml")
    return next(op for op in spec.ops if op.name == name)


def test_an_attention_times_values_product_is_tiled_along_the_windows_centre():
    """Longformer's AV: one position of the values' channel j would hold the whole
    attention weights [l,i,q,k], several times over per chunk (a step over X (1, 1024, 4,
    129) and Y (1, 1024, 4, 64) at 256 KiB peaked at 1.7x the bound in TensorFlow and 1.9x
    in PyTorch); one position of i holds one window [l,q,k,j] (0.5x the bound)."""
    op = _op("LongformerAv")
    assert compile_op(op).tiling.index == "i"


def test_a_window_of_one_position_ties_and_does_not_move_other_choices():
    """The window rule breaks no choice it does not concern: RWKV's [b,t,i,c] stays along
    t (one channel c would be [b,t,i], a second long axis, not a window), a segment sum by
    CSR pointers along s, PAConv's assign_score along o."""
    for name, index in [("RwkvWkv", "t"), ("SegmentCsrSum", "s"), ("PaconvAssignScore", "o")]:
        assert compile_op(_op(name)).tiling.index == index, name


MEASURE = """
import json, sys
import tensorflow as tf
sys.path.insert(0, {repo!r})
sys.path.insert(0, {tests!r})
import importlib
from test_memory_real_ops import SIZES, _arrays

from peaks import tf_step_peaks

found = {{}}
for op, (stem, shapes, ints, attrs) in SIZES.items():
    module = importlib.import_module("generated." + stem)
    args = [tf.constant(a) for a in _arrays(op)]
    floats = [a for n, a in zip(shapes, args) if n not in ints]
    found[op] = tf_step_peaks(module, args, {budget}, attrs, floats)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def tensorflow_peaks():
    script = MEASURE.format(repo=str(REPO), tests=str(REPO / "tests"), budget=BUDGET)
    return run_tensorflow(script)


def _check(op, target, io, untiled, tiled):
    bound = 4 * io + BUDGET
    print(f"{op} {target}: io {io}, untiled {untiled / bound:.1f}x, tiled {tiled / bound:.2f}x")
    assert untiled > 4 * bound, f"{op} {target}: the size does not test the bound"
    assert tiled <= bound, f"{op} {target}: a tiled step peaks at {tiled} > {bound}"


@pytest.mark.parametrize("op", sorted(SIZES))
def test_tensorflow_training_step_of_a_real_windowed_op_is_bounded(op, tensorflow_peaks):
    found = tensorflow_peaks[op]
    _check(op, "tensorflow", found["io"], found["untiled"], found["tiled"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("real_ops")


def _module(op, target, folder):
    return load_module(module_text(_op(op), "symgrad.toml", target), folder, f"real_{target}_{op}")


@pytest.mark.parametrize("op", sorted(SIZES))
def test_pytorch_training_step_of_a_real_windowed_op_is_bounded(op, folder, monkeypatch):
    module = _module(op, "pytorch", folder)
    _, shapes, ints, attrs = SIZES[op]
    args = [
        torch.tensor(a, requires_grad=n not in ints)
        for n, a in zip(shapes, _arrays(op), strict=True)
    ]
    floats = [a for n, a in zip(shapes, args, strict=True) if n not in ints]
    with torch.no_grad():
        io = sum(a.nbytes for a in args) + module.forward(*args, **attrs).nbytes
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 2**40)
    _, untiled = _torch_memory(module, floats, attrs, args)
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", BUDGET)
    assert module._tile_plan(*args, **attrs) is not None
    _, tiled = _torch_memory(module, floats, attrs, args)
    _check(op, "pytorch", io, untiled, tiled)


@pytest.mark.parametrize("op", sorted(SIZES))
def test_jax_training_step_of_a_real_windowed_op_is_bounded(op, folder, monkeypatch):
    module = _module(op, "jax", folder)
    _, shapes, ints, attrs = SIZES[op]
    args = [jnp.asarray(a) for a in _arrays(op)]
    wrt = tuple(k for k, n in enumerate(shapes) if n not in ints)

    out = jax.eval_shape(lambda *a: module.forward(*a, **attrs), *args)
    io = sum(a.nbytes for a in args) + out.size * out.dtype.itemsize
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 2**40)
    untiled = jax_step_bytes(module, args, attrs, wrt)
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", BUDGET)
    assert module._tile_plan(*args, **attrs) is not None
    _check(op, "jax", io, untiled, jax_step_bytes(module, args, attrs, wrt))


def test_the_sizes_are_the_ops_layouts():
    """Each size's shapes are those its op reads (rank per input, in the op's order)."""
    for op, (_, shapes, _, _) in SIZES.items():
        program = build(_op(op))
        assert list(shapes) == list(program.inputs), op
        for name, shape in shapes.items():
            assert program.rank(name) == len(shape), (op, name)


# ----------------------------------------------------------------------------- exactness


def _at(a, *pos):
    """a[pos], or 0 outside a (the kernels' zero padding)."""
    if any(not 0 <= p < n for p, n in zip(pos, a.shape, strict=True)):
        return 0.0
    return a[pos]


def _carafe(features, masks, K, S):
    N, C, H, W = features.shape
    P = (K - 1) // 2
    y = np.zeros((N, C, H * S, W * S))
    for n, c, i, j in np.ndindex(*y.shape):
        for u, v in np.ndindex(K, K):
            y[n, c, i, j] += masks[n, u * K + v, i, j] * _at(
                features[n, c], i // S + u - P, j // S + v - P
            )
    return y


def _involution(x, weight):
    C, G, K = x.shape[1], weight.shape[1], weight.shape[2]
    y = np.zeros_like(x)
    for b, c, i, j in np.ndindex(*y.shape):
        for u, v in np.ndindex(K, K):
            y[b, c, i, j] += weight[b, c // (C // G), u, v, i, j] * _at(
                x[b, c], i + u - (K - 1) // 2, j + v - (K - 1) // 2
            )
    return y


def _dynamic_conv(x, weight):
    C, H, K = x.shape[1], weight.shape[1], weight.shape[2]
    y = np.zeros_like(x)
    for b, c, t in np.ndindex(*y.shape):
        for k in range(K):
            y[b, c, t] += weight[b, c // (C // H), k, t] * _at(x[b, c], t + k - (K - 1) // 2)
    return y


def _natten_av2d(attn, value, K):
    H, W = value.shape[2:4]
    y = np.zeros_like(value)
    for b, h, i, j in np.ndindex(*value.shape[:4]):
        si, sj = max(min(i - K // 2, H - K), 0), max(min(j - K // 2, W - K), 0)
        for u, v in np.ndindex(K, K):
            y[b, h, i, j] += attn[b, h, i, j, u * K + v] * value[b, h, si + u, sj + v]
    return y


def _natten_qk2d(query, key, K):
    H, W = query.shape[2:4]
    attn = np.zeros((*query.shape[:4], K * K))
    for b, h, i, j in np.ndindex(*query.shape[:4]):
        si, sj = max(min(i - K // 2, H - K), 0), max(min(j - K // 2, W - K), 0)
        for u, v in np.ndindex(K, K):
            attn[b, h, i, j, u * K + v] = query[b, h, i, j] @ key[b, h, si + u, sj + v]
    return attn


def _longformer_av(X, Y, D, w):
    y = np.zeros((*X.shape[:3], Y.shape[3]))
    for b, i, q, j in np.ndindex(*y.shape):
        for k in range(2 * w + 1):
            y[b, i, q, j] += X[b, i, q, k] * _at(Y[b, :, q, j], i + D[q] * (k - w))
    return y


def _mmcv_correlation(input1, input2, r):
    N, C, H, W = input1.shape
    y = np.zeros((N, 2 * r + 1, 2 * r + 1, H, W))
    for n, u, v, i, j in np.ndindex(*y.shape):
        for c in range(C):
            y[n, u, v, i, j] += input1[n, c, i, j] * _at(input2[n, c], i + u - r, j + v - r)
    return y


# op -> (the kernel's loop, tiny shapes, int inputs, attrs); each index its own size
LOOPS = {
    "Carafe": (_carafe, {"features": (2, 3, 4, 5), "masks": (2, 9, 8, 10)}, {}, {"K": 3, "S": 2}),
    "Involution": (_involution, {"x": (2, 4, 5, 6), "weight": (2, 2, 3, 3, 5, 6)}, {}, {}),
    "DynamicConv": (_dynamic_conv, {"input": (2, 6, 9), "weight": (2, 3, 5, 9)}, {}, {}),
    "NattenAv2d": (
        _natten_av2d,
        {"attn": (2, 2, 5, 6, 9), "value": (2, 2, 5, 6, 4)},
        {},
        {"K": 3},
    ),
    "NattenQk2d": (
        _natten_qk2d,
        {"query": (2, 2, 5, 6, 4), "key": (2, 2, 5, 6, 4)},
        {},
        {"K": 3},
    ),
    "LongformerAv": (
        _longformer_av,
        {"X": (2, 9, 3, 5), "Y": (2, 9, 3, 4), "D": (3,)},
        {"D": [1, 2, 1]},
        {"w": 2},
    ),
    "MmcvCorrelation": (
        _mmcv_correlation,
        {"input1": (2, 3, 4, 5), "input2": (2, 3, 4, 5)},
        {},
        {"r": 1},
    ),
}


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("op", sorted(LOOPS))
def test_a_real_windowed_op_is_its_kernels_loop_untiled_and_in_chunks(op, target, folder):
    """float64: forward against the kernel's loop, and the vjp against central differences
    of the loop along a random direction per float input, with today's code and in chunks
    of one position (budget 1 KiB)."""
    loop, shapes, ints, attrs = LOOPS[op]
    module = _module(op, target, folder)
    jax.config.update("jax_enable_x64", True)  # as test_tiling does on import
    rng = np.random.default_rng(7)
    arrays = [
        np.asarray(ints[n]) if n in ints else rng.standard_normal(s) for n, s in shapes.items()
    ]
    tensor = {
        "tensorflow": tf.constant,
        "pytorch": torch.tensor,
        "jax": jnp.asarray,
    }[target]

    def reference(*a):
        return loop(*a, **attrs)

    want = reference(*arrays)
    cotangent = rng.standard_normal(want.shape)
    default = module.MAX_TEMP_BYTES
    try:
        for budget in (default, 1024):
            module.MAX_TEMP_BYTES = budget
            assert (module._tile_plan(*map(tensor, arrays), **attrs) is None) == (budget == default)
            got = np.asarray(module.forward(*map(tensor, arrays), **attrs))
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=f"{op} {budget}")
            grads = module.vjp(*map(tensor, arrays), tensor(cotangent), **attrs)
            for k, name in enumerate(shapes):
                if name in ints:
                    continue
                d = rng.standard_normal(arrays[k].shape)
                eps = 1e-6
                plus = [a + eps * d if j == k else a for j, a in enumerate(arrays)]
                minus = [a - eps * d if j == k else a for j, a in enumerate(arrays)]
                fd = ((reference(*plus) - reference(*minus)) / (2 * eps) * cotangent).sum()
                got = (np.asarray(grads[k]) * d).sum()
                assert abs(got - fd) <= 1e-6 * max(1.0, abs(fd)), (op, name, budget, got, fd)
    finally:
        module.MAX_TEMP_BYTES = default

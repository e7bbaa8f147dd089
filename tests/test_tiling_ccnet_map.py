"""CCNet's attention map (`CcAttentionMap`, speedinghzl/CCNet's ca_map kernels) in chunks.

    o[b,c,i,j] = sum(g[b,c,i,u] * a[b,u,i,j], u)
               + sum(where(v < i, g[b,c,v,j] * a[b, W + v, i, j],
                           where(v > i, g[b,c,v,j] * a[b, W + v - 1, i, j], 0)), v)

Tiled along the rows `i`, then the channels `c`. Its reads `g[b,c,i,u]` and
`a[b, W + v, i, j]` are shifted slices of its inputs (`tile._shifted`), which a level
below the first need not cut, so one position of both holds `[b,v,j]` (0.61 MB at
CCNet's size, 2x512x97x97; `benchmarks/one_position.py`). Required of every level, they
left the batch `b` as the second level, one position of which held the column product
`[c,v,j]` (9.3x the default budget). The
peak tests take one batch position and many channels (where one position of (i, b) was
as large as the whole of `g`): the untiled step is 3.1-6.1x the bound; PyTorch holds
0.54x of it, JAX 0.75x and TensorFlow 0.55x, its chunk's products run in order
(`_in_order`).

The masked branch (`v == i`) contributes 0 whatever `g` holds there, untiled and in chunks,
as the CUDA kernel skips it: an inf in `g` gives +-inf at its own position (through the row
term), not the nan that `inf * 0` would.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from adversarial import unknown_sizes_equal_eager
from frameworks import FRAMEWORKS, inputs, run_everywhere, train_step
from harness import Case, generate
from peaks import jax_step_bytes, run_tensorflow, torch_peak

jax.config.update("jax_enable_x64", True)  # float64, as the other exactness tests

TARGETS = ("tensorflow", "pytorch", "jax")
FORMULA = (
    "o[b,c,i,j] = sum(g[b,c,i,u] * a[b,u,i,j], u) + sum(where(v < i, g[b,c,v,j] * "
    "a[b, W + v, i, j], where(v > i, g[b,c,v,j] * a[b, W + v - 1, i, j], 0)), v)"
)


def _case(b, c, h, w):
    return Case(
        FORMULA,
        {"a": (b, h + w - 1, h, w), "g": (b, c, h, w)},
        inputs=("a", "g"),
        lets={"W": "g.shape[3]"},
        let_values={"W": w},
        ranges={"u": "W"},
        sizes={"u": w},
    )


SMALL = _case(2, 3, 4, 5)  # b, c, i, j: each its own size (v runs over i, u over j)
PEAK = (1, 64, 12, 20)  # one batch position, many channels
PEAK_BUDGET = 32 * 1024
# JAX's untiled step fuses the gradient's masked products (XLA): at PEAK it holds 2.1x the
# bound since the product moved inside its `where` (pointwise._select_last), so JAX takes
# a size where the untiled step still needs several times the bound
PEAK_JAX = (1, 64, 36, 56)


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ccnet_map")
    return {t: generate(SMALL, folder, prefix="CcMap", target=t) for t in TARGETS}


def _ca_map_kernel(a, g):
    """ca_map_forward_kernel (CCNet, cc_attention/src/ca.cu) in loops: the column term skips
    the position itself."""
    batch, channels, height, width = g.shape
    out = np.zeros_like(g)
    for n in range(batch):
        for c in range(channels):
            for y in range(height):
                for x in range(width):
                    total = 0.0
                    for k in range(width):
                        total += g[n, c, y, k] * a[n, k, y, x]
                    for k in range(height):
                        if k == y:
                            continue
                        total += g[n, c, k, x] * a[n, width + (k if k < y else k - 1), y, x]
                    out[n, c, y, x] = total
    return out


def _both_levels(module, monkeypatch):
    """Chunks of one row and one channel: a 1-byte budget, and the plan without the
    step's allowance (which keeps whole channels at these sizes)."""
    plan2 = module._plan2
    monkeypatch.setattr(
        module, "_plan2", lambda n, n2, volumes, itemsize, *_: plan2(n, n2, volumes, itemsize)
    )


@pytest.mark.parametrize("target", TARGETS)
def test_ccnet_map_in_chunks_equals_the_untiled_module_on_every_path(target, modules, monkeypatch):
    """forward, vjp, the registered gradient and a tape (TF), autograd (PyTorch), jax.vjp
    and jit (JAX), and a training step: in chunks of one row and one channel, equal
    to the untiled module in float64."""
    module, fw = modules[target], FRAMEWORKS[target]
    module.MAX_TEMP_BYTES = 2**40
    want = run_everywhere(fw, module, SMALL), train_step(fw, module, SMALL)
    _both_levels(module, monkeypatch)
    module.MAX_TEMP_BYTES = 1
    try:
        assert module._tile_plan(*inputs(SMALL, module, fw)) == (4, 1, 3, 1)
        (outputs, grads), step = run_everywhere(fw, module, SMALL), train_step(fw, module, SMALL)
    finally:
        module.MAX_TEMP_BYTES = 2**40
    for found, wanted in ((outputs, want[0][0]), (grads, want[0][1])):
        for how, got in found.items():
            for g, w in zip(got, wanted[how], strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=how)
    for g, w in zip(step["grads"], want[1]["grads"], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg="training step")


def _ca_map_backward_kernels(a, g, grad_o):
    """ca_map_backward_kernel_w and _g (CCNet) in loops: the gradients of a and g; the
    position itself sends nothing."""
    batch, _, height, width = g.shape
    grad_a, grad_g = np.zeros_like(a), np.zeros_like(g)
    for n in range(batch):
        for y in range(height):
            for x in range(width):
                for k in range(width):
                    grad_a[n, k, y, x] += np.sum(grad_o[n, :, y, x] * g[n, :, y, k])
                    grad_g[n, :, y, k] += grad_o[n, :, y, x] * a[n, k, y, x]
                for k in range(height):
                    if k == y:
                        continue
                    z = width + (k if k < y else k - 1)
                    grad_a[n, z, y, x] += np.sum(grad_o[n, :, y, x] * g[n, :, k, x])
                    grad_g[n, :, k, x] += grad_o[n, :, y, x] * a[n, z, y, x]
    return grad_a, grad_g


@pytest.mark.parametrize("target", TARGETS)
def test_ccnet_map_masked_branch_adds_nothing_whatever_g_holds(target, modules, monkeypatch):
    """inf, -inf and nan in `g`, each also read by the masked branch (v == i) of its own
    position: untiled and in chunks, the outputs and gradients are the CUDA kernels'
    (which skip that branch), so an inf gives +-inf at its own position, not nan, and
    sends no nan to the scores it is not multiplied by."""
    module, fw = modules[target], FRAMEWORKS[target]
    rng = np.random.default_rng(7)
    a = rng.uniform(0.5, 1.5, (2, 8, 4, 5))  # positive: an inf's products keep its sign
    g = rng.standard_normal((2, 3, 4, 5))
    g[0, 1, 2, 3], g[1, 0, 0, 4], g[1, 2, 3, 1] = np.inf, -np.inf, np.nan
    want = _ca_map_kernel(a, g)
    assert want[0, 1, 2, 3] == np.inf and want[1, 0, 0, 4] == -np.inf
    grad_o = rng.standard_normal(want.shape)
    want_grads = _ca_map_backward_kernels(a, g, grad_o)
    assert np.isinf(want_grads[0]).any() and not np.isnan(want_grads[0]).all()
    grad_o = fw.tensor(grad_o)
    _both_levels(module, monkeypatch)
    for budget in (2**40, 1):
        module.MAX_TEMP_BYTES = budget
        try:
            o = fw.numpy(module.forward(fw.tensor(a), fw.tensor(g)))
            grads = [fw.numpy(x) for x in module.vjp(fw.tensor(a), fw.tensor(g), grad_o)]
        finally:
            module.MAX_TEMP_BYTES = 2**40
        np.testing.assert_allclose(o, want, rtol=1e-12, atol=1e-12, err_msg=f"budget {budget}")
        for got, wanted in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(got, wanted, rtol=1e-12, atol=1e-12, err_msg=f"{budget}")


def _peak_arrays(dtype=np.float32, peak=PEAK):
    b, c, h, w = peak
    rng = np.random.default_rng(6)
    a = rng.uniform(-1, 1, (b, h + w - 1, h, w)).astype(dtype)
    g = rng.uniform(-1, 1, (b, c, h, w)).astype(dtype)
    return a, g


def _bound(peak=PEAK):
    a, g = _peak_arrays(peak=peak)
    io = a.nbytes + 2 * g.nbytes  # a, g and o (g's shape)
    return 4 * io + PEAK_BUDGET


def _peak_module(target, tmp_path, peak=PEAK):
    b, c, h, w = peak
    return generate(_case(b, c, h, w), tmp_path, prefix="CcMapPeak", target=target)


def test_pytorch_ccnet_map_step_is_within_the_bound(tmp_path):
    module = _peak_module("pytorch", tmp_path)
    a, g = (torch.tensor(x, requires_grad=True) for x in _peak_arrays())

    def step():
        torch.sin(module.forward(a, g)).sum().backward()

    module.MAX_TEMP_BYTES = 2**40
    untiled = torch_peak(step)
    module.MAX_TEMP_BYTES = PEAK_BUDGET
    assert module._tile_plan(a.detach(), g.detach()) is not None
    tiled = torch_peak(step)
    print(f"pytorch: untiled {untiled / _bound():.2f}x, tiled {tiled / _bound():.2f}x")
    assert untiled > 3 * _bound(), "the size does not test the bound"
    assert tiled <= _bound()


def test_jax_ccnet_map_step_is_within_the_bound(tmp_path):
    module = _peak_module("jax", tmp_path, PEAK_JAX)
    args = [jax.numpy.asarray(x) for x in _peak_arrays(peak=PEAK_JAX)]
    bound = _bound(PEAK_JAX)
    module.MAX_TEMP_BYTES = 2**40
    untiled = jax_step_bytes(module, args)
    module.MAX_TEMP_BYTES = PEAK_BUDGET
    assert module._tile_plan(*args) is not None
    tiled = jax_step_bytes(module, args)
    print(f"jax: untiled {untiled / bound:.2f}x, tiled {tiled / bound:.2f}x")
    assert untiled > 3 * bound, "the size does not test the bound"
    assert tiled <= bound


MEASURE = """
import json, sys
import tensorflow as tf
sys.path.insert(0, {folder!r})
sys.path.insert(0, {tests!r})
from peaks import tf_step_peaks
from test_tiling_ccnet_map import PEAK_BUDGET, _peak_arrays
import {stem} as module

print(json.dumps(tf_step_peaks(module, [tf.constant(x) for x in _peak_arrays()], PEAK_BUDGET)))
"""


def test_tensorflow_ccnet_map_step_is_within_the_bound(tmp_path):
    """TensorFlow runs a graph's independent ops at once: a chunk's backward, its products
    not kept in the order they are made (`_in_order`), held 0.89-1.04x of the bound run
    to run in chunks of (i, b); in order 0.72-0.79x; in chunks of (i, c) 0.55x."""
    stem = _peak_module("tensorflow", tmp_path).__name__
    tests = str(Path(__file__).resolve().parent)
    found = run_tensorflow(MEASURE.format(folder=str(tmp_path), tests=tests, stem=stem))
    print(
        f"tensorflow: untiled {found['untiled'] / _bound():.2f}x, "
        f"tiled {found['tiled'] / _bound():.2f}x"
    )
    assert found["untiled"] > 3 * _bound(), "the size does not test the bound"
    assert found["tiled"] <= 0.9 * _bound()


def test_ccnet_map_without_channels_under_unknown_sizes(modules):
    """TensorFlow under tf.function with every size unknown, at a 1-byte budget, over `g`
    with no channels (the inner level's axis empty): where one row fit, the plan gave the
    inner level chunks of all its positions, none, and the loop divided by that."""
    module = modules["tensorflow"]
    rng = np.random.default_rng(3)
    a = tf.constant(rng.standard_normal((2, 8, 4, 5)))
    g = tf.constant(np.zeros((2, 0, 4, 5)))
    try:
        unknown_sizes_equal_eager(module, [a, g], {}, seed=4)
    finally:
        module.MAX_TEMP_BYTES = 2**40

"""The memory bound on sampled reads whose scatters dominate a chunk (README, "Memory"):
ROI Align, tiled in two levels, in TensorFlow held the chunk's scatter, its transposed
copy, two running sums of the input's size and the forward's transposed copy of the input
at once (1.30x the bound at the size below); multi-scale deformable attention was cut
along its channel, one channel of which holds its corners over the whole of `attn`, dozens
of times (TensorFlow 1.46x, PyTorch 1.77x). Peaks as in tests/test_memory_sampled_reads.py.
JAX's jitted steps of both are bounded too (ROI Align 0.86x, MsDeformAttn 0.77x the bound).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
from peaks import jax_step_bytes, run_tensorflow
from test_tiling import _torch_memory

REPO = Path(__file__).resolve().parent.parent
BUDGETS = {"roi_align": 2**18, "ms_deform_attn": 2**15}  # each where the bound bites

# case -> (module, the float inputs the step differentiates); each index its own size
WATCHED = {"roi_align": (0, 2, 3, 4, 5), "ms_deform_attn": (0, 3, 4)}


def arrays(stem: str):
    """ROI Align: x 2x32x64x72, 40 boxes of 7x6 bins, 2x2 samples; multi-scale deformable
    attention: value 2x756x4x16 over levels 24x24, 12x12, 6x6, 60 queries, 5 points (at
    48x48, 24x24, 12x12 and 300 queries the figures are about the same, in four times the
    chunks: untiled 6.8x, tiled 0.63x the bound in PyTorch)."""
    rng = np.random.default_rng(5)
    if stem == "roi_align":
        x = rng.standard_normal((2, 32, 64, 72)).astype(np.float32)
        bi = rng.integers(0, 2, 40).astype(np.int32)
        boxes = [rng.uniform(-2, n - 10, 40) for n in (64, 72)]
        sizes = [rng.uniform(0.5, 3, 40) for _ in range(2)]
        args = [x, bi, *(a.astype(np.float32) for a in (*boxes, *sizes))]
        return args, {"S": 2, "PH": 7, "PW": 6}
    shapes = np.array([[24, 24], [12, 12], [6, 6]], np.float32)
    start = np.array([0, 576, 720], np.int64)
    value = rng.standard_normal((2, 756, 4, 16)).astype(np.float32)
    loc = rng.uniform(-0.05, 1.05, (2, 60, 4, 3, 5, 2)).astype(np.float32)
    attn = rng.uniform(0, 1, (2, 60, 4, 3, 5)).astype(np.float32)
    return [value, shapes, start, loc, attn], {}


MEASURE = """
import json, sys
sys.path.insert(0, {repo!r})
sys.path.insert(0, {tests!r})
import importlib
import tensorflow as tf
from peaks import tf_step_peaks
from test_memory_sampled_scatters import BUDGETS, WATCHED, arrays

found = {{}}
for stem, watched in WATCHED.items():
    module = importlib.import_module("generated." + stem)
    given, attrs = arrays(stem)
    args = [tf.constant(a) for a in given]
    found[stem] = tf_step_peaks(module, args, BUDGETS[stem], attrs, [args[i] for i in watched])
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def tensorflow_peaks():
    return run_tensorflow(MEASURE.format(repo=str(REPO), tests=str(REPO / "tests")))


def _check(stem, target, io, untiled, tiled):
    bound = 4 * io + BUDGETS[stem]
    print(f"{stem} {target}: untiled {untiled / bound:.2f}x, tiled {tiled / bound:.2f}x")
    assert untiled > 2 * bound, f"{stem} {target}: the size does not test the bound"
    assert tiled <= bound, f"{stem} {target}: a tiled step peaks at {tiled} > {bound}"


@pytest.mark.parametrize("stem", sorted(WATCHED))
def test_tensorflow_step_of_a_scatter_heavy_sampled_read_is_bounded(stem, tensorflow_peaks):
    found = tensorflow_peaks[stem]
    _check(stem, "tensorflow", found["io"], found["untiled"], found["tiled"])


def test_pytorch_step_of_multi_scale_deformable_attention_is_bounded(monkeypatch):
    import generated_torch.ms_deform_attn as module

    given, attrs = arrays("ms_deform_attn")
    args = [torch.tensor(a) for a in given]
    xs = [args[i].requires_grad_(True) for i in WATCHED["ms_deform_attn"]]
    with torch.no_grad():
        io = sum(a.nbytes for a in given) + module.forward(*args).nbytes
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 2**40)
    _, untiled = _torch_memory(module, xs, attrs, args)
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", BUDGETS["ms_deform_attn"])
    assert module._tile_plan(*args) is not None
    _check("ms_deform_attn", "pytorch", io, untiled, _torch_memory(module, xs, attrs, args)[1])


@pytest.mark.parametrize("stem", sorted(WATCHED))
def test_jax_step_of_a_scatter_heavy_sampled_read_is_bounded(stem, monkeypatch):
    import importlib

    jax = pytest.importorskip("jax")
    module = importlib.import_module("generated_jax." + stem)
    given, attrs = arrays(stem)
    args = [jax.numpy.asarray(a) for a in given]
    out = jax.eval_shape(lambda *a: module.forward(*a, **attrs), *args)
    io = sum(a.nbytes for a in given) + out.size * out.dtype.itemsize
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 2**40)
    untiled = jax_step_bytes(module, args, attrs, WATCHED[stem])
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", BUDGETS[stem])
    assert module._tile_plan(*args, **attrs) is not None
    _check(stem, "jax", io, untiled, jax_step_bytes(module, args, attrs, WATCHED[stem]))

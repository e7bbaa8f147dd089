"""The memory bound on sampled reads (bilinear interpolation, symgrad/sampled_temps.py) in
all three targets: a float32 training step (forward, a scalar loss, the gradient of every
float input) holds at most 4x the bytes of the op's inputs and outputs plus the budget.

grid_sample's temporaries are no larger than its output, so it was never tiled (the step
held its four corners, their weights and the backward's scatters: 2-3x the bound);
deformable convolution was tiled, but each chunk held 5-6x the budget, since the plan
counted its columns once (over the bound at a budget of 1 MiB, where the chunk dominates).
With an input larger than its output, grid_sample's chunks each scattered the four
corners into four gradients of the input's size and added them (1.2-1.3x the bound in
TensorFlow and PyTorch at the size below); they are one scatter of the corners' rows
concatenated (symgrad/lower/merged_scatters.py).
Peaks as in tests/test_memory_real_ops.py.
"""

from __future__ import annotations

import ast
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

from symgrad.pipeline import module_text
from symgrad.spec import parse_spec

REPO = Path(__file__).resolve().parent.parent

# case -> (module, input shapes, attrs, budget); each index its own size. A case is named
# by its op, and after a space what it tests.
SIZES = {
    # x (N, C, H, W) into the grid's (N, Ho, Wo, 2): tiled along the output rows
    "GridSample": ("grid_sample", {"x": (3, 16, 24, 28), "g": (3, 64, 72, 2)}, {}, 2**17),
    # the input larger than the output: each chunk's gradient of x is the input's size
    "GridSample larger input": (
        "grid_sample",
        {"x": (3, 32, 48, 56), "g": (3, 40, 52, 2)},
        {},
        2**18,
    ),
    # x (B, C, H, W), w (O, C, KH, KW), off (B, 2*KH*KW, H, W): a budget larger than the
    # inputs and outputs, so that a chunk's excess over it shows
    "DeformConv2d": (
        "deform_conv2d",
        {"x": (1, 16, 64, 20), "w": (24, 16, 3, 3), "off": (1, 18, 64, 20)},
        {"s": 1, "p": 1},
        2**20,
    ),
}


def _arrays(op: str) -> list[np.ndarray]:
    _, shapes, _, _ = SIZES[op]
    rng = np.random.default_rng(7)
    arrays = []
    for name, shape in shapes.items():
        if name == "g":  # grid points inside and a little past the border
            arrays.append(rng.uniform(-1.1, 1.1, shape).astype(np.float32))
        else:
            arrays.append((2 * rng.standard_normal(shape)).astype(np.float32))
    return arrays


def _op(case: str):
    spec = parse_spec((REPO / "symgrad.toml").read_text(encoding="utf-8"), "symgrad.toml")
    return next(op for op in spec.ops if op.name == case.split()[0])


MEASURE = """
import json, sys
import tensorflow as tf
sys.path.insert(0, {repo!r})
sys.path.insert(0, {tests!r})
import importlib
from test_memory_sampled_reads import SIZES, _arrays

from peaks import peak

found = {{}}
for op, (stem, shapes, attrs, budget) in SIZES.items():
    module = importlib.import_module("generated." + stem)
    args = [tf.constant(a) for a in _arrays(op)]

    def step():
        with tf.GradientTape() as tape:
            tape.watch(args)
            loss = tf.reduce_sum(tf.sin(module.forward(*args, **attrs)))
        return [g.numpy() for g in tape.gradient(loss, args)]

    io = sum(a.numpy().nbytes for a in args) + module.forward(*args, **attrs).numpy().nbytes
    module.MAX_TEMP_BYTES = 2**40
    untiled = peak(step)
    module.MAX_TEMP_BYTES = budget
    tiled = module._tile_plan(*args, **attrs) is not None and peak(step)
    found[op] = dict(io=io, untiled=untiled, tiled=tiled)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def tensorflow_peaks():
    script = MEASURE.format(repo=str(REPO), tests=str(REPO / "tests"))
    return run_tensorflow(script)


def _check(op, target, io, untiled, tiled):
    budget = SIZES[op][3]
    bound = 4 * io + budget
    print(f"{op} {target}: io {io}, untiled {untiled / bound:.2f}x, tiled {tiled / bound:.2f}x")
    assert tiled, f"{op} {target}: not tiled at a budget of {budget}"
    if op == "GridSample":  # untiled: the step this tiling bounds (for its larger output)
        assert untiled > 2 * bound, f"{op} {target}: the size does not test the bound"
    assert tiled <= bound, f"{op} {target}: a tiled step peaks at {tiled} > {bound}"


@pytest.mark.parametrize("op", sorted(SIZES))
def test_tensorflow_training_step_of_a_sampled_read_is_bounded(op, tensorflow_peaks):
    found = tensorflow_peaks[op]
    _check(op, "tensorflow", found["io"], found["untiled"], found["tiled"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("sampled_memory")


def _module(op, target, folder):
    text = module_text(_op(op), "symgrad.toml", target)
    return load_module(text, folder, f"sampled_{target}_{op.replace(' ', '_')}")


@pytest.mark.parametrize("op", sorted(SIZES))
def test_pytorch_training_step_of_a_sampled_read_is_bounded(op, folder, monkeypatch):
    module = _module(op, "pytorch", folder)
    _, _, attrs, budget = SIZES[op]
    args = [torch.tensor(a, requires_grad=True) for a in _arrays(op)]
    with torch.no_grad():
        io = sum(a.nbytes for a in args) + module.forward(*args, **attrs).nbytes
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 2**40)
    _, untiled = _torch_memory(module, args, attrs)
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", budget)
    tiled = module._tile_plan(*args, **attrs) is not None and _torch_memory(module, args, attrs)[1]
    _check(op, "pytorch", io, untiled, tiled)


@pytest.mark.parametrize("op", sorted(SIZES))
def test_jax_training_step_of_a_sampled_read_is_bounded(op, folder, monkeypatch):
    module = _module(op, "jax", folder)
    _, _, attrs, budget = SIZES[op]
    args = [jnp.asarray(a) for a in _arrays(op)]
    out = jax.eval_shape(lambda *a: module.forward(*a, **attrs), *args)
    io = sum(a.nbytes for a in args) + out.size * out.dtype.itemsize
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 2**40)
    untiled = jax_step_bytes(module, args, attrs)
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", budget)
    tiled = module._tile_plan(*args, **attrs) is not None and jax_step_bytes(module, args, attrs)
    _check(op, "jax", io, untiled, tiled)


@pytest.mark.parametrize("op", ["GridSample", "MsDeformAttn"])
def test_pytorch_adds_merged_corner_scatters_in_turn_without_concatenating(op):
    """PyTorch index-adds each corner's rows into one gradient (`_segment_sums_in`, the
    ids of reads outside the row past the end, with no bounds test): a
    concatenated copy of the rows made multi-scale deformable attention's tiled step
    hold more (its eight scatters have more rows than its value tensor: 1.96x the bound
    at value 2x3024x4x16, 300 queries, against 1.70x with eight scatters, 1.61x now)."""
    text = module_text(_op(op), "symgrad.toml", "pytorch")
    tree = ast.parse(text)
    (backward,) = (
        ast.get_source_segment(text, node)
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "_backward"
    )
    assert "_segment_sums_in(" in backward
    assert "torch.cat(" not in backward

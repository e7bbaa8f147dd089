"""The memory bound on windowed ops in their published layouts (the ops of symgrad.toml
that cite mmcv's CARAFE and correlation, involution, fairseq's dynamicconv, NATTEN's 2-D AV
and Longformer's AV), in all three targets: a float32 training step (forward, a scalar
loss, the gradient of every float input) at a budget of 256 KiB holds at most 4x the bytes
of the op's inputs and outputs plus the budget, at sizes where the untiled step needs
several times that bound. Each size keeps one position of the tiled index within the
budget (a chunk holds at least one position).

Peaks as in tests/test_tiling.py: TensorFlow's BFC allocator statistics (in a subprocess,
which the allocator needs), the running sum of torch.profiler's allocation events, and the
compiled JAX step's memory_analysis() (temporaries, arguments and outputs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp
from harness import load_module
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
import numpy as np
import tensorflow as tf
sys.path.insert(0, {repo!r})
sys.path.insert(0, {tests!r})
import importlib
from test_memory_real_ops import SIZES, _arrays

def peak(run):
    run()
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    run()
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before

found = {{}}
for op, (stem, shapes, ints, attrs) in SIZES.items():
    module = importlib.import_module("generated." + stem)
    args = [tf.constant(a) for a in _arrays(op)]
    floats = [a for n, a in zip(shapes, args) if n not in ints]

    def step():
        with tf.GradientTape() as tape:
            tape.watch(floats)
            loss = tf.reduce_sum(tf.sin(module.forward(*args, **attrs)))
        return [g.numpy() for g in tape.gradient(loss, floats)]

    io = sum(a.numpy().nbytes for a in args) + module.forward(*args, **attrs).numpy().nbytes
    module.MAX_TEMP_BYTES = 2**40
    untiled = peak(step)
    module.MAX_TEMP_BYTES = {budget}
    tiled = peak(step)
    found[op] = dict(io=io, untiled=untiled, tiled=tiled)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def tensorflow_peaks():
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}
    script = MEASURE.format(repo=str(REPO), tests=str(REPO / "tests"), budget=BUDGET)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


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

    def peak():
        def loss(*a):
            return jnp.sum(jnp.sin(module.forward(*a, **attrs)))

        def grad(*a):  # a new function: traced with the current budget
            return jax.grad(loss, argnums=wrt)(*a)

        analysis = jax.jit(grad).lower(*args).compile().memory_analysis()
        return (
            analysis.temp_size_in_bytes
            + analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
        )

    out = jax.eval_shape(lambda *a: module.forward(*a, **attrs), *args)
    io = sum(a.nbytes for a in args) + out.size * out.dtype.itemsize
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 2**40)
    untiled = peak()
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", BUDGET)
    assert module._tile_plan(*args, **attrs) is not None
    _check(op, "jax", io, untiled, peak())


def test_the_sizes_are_the_ops_layouts():
    """Each size's shapes are those its op reads (rank per input, in the op's order)."""
    for op, (_, shapes, _, _) in SIZES.items():
        program = build(_op(op))
        assert list(shapes) == list(program.inputs), op
        for name, shape in shapes.items():
            assert program.rank(name) == len(shape), (op, name)

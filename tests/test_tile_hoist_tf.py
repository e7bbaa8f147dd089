"""A TensorFlow tiling's chunk-invariant work, once before its chunk loop (`tile_hoist`):
the loop is a tf.while_loop whose body runs every op again each chunk, so what no chunk
changes (grid_sample's layout copy of its map, roi_align_rotated's per-roi geometry) is
computed by `_compute_once` and `_backward_once` before it and read by every chunk. The
values and the ops on them are the chunks' own: bit for bit the same chunks computing
them each for itself (the loop's fallback, where their bytes are too many or unknown)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from harness import load_module, op_spec
from test_tiling_adversarial_4 import REAL

from symgrad.pipeline import module_text
from symgrad.spec import parse_spec

REPO = Path(__file__).resolve().parent.parent


def _grid_sample_text():
    toml = REPO / "symgrad.toml"
    spec = parse_spec(toml.read_text(encoding="utf-8"), "symgrad.toml")
    op = next(op for op in spec.ops if op.name == "GridSample")
    return module_text(op, "symgrad.toml", "tensorflow")


def _roi_text():
    return module_text(op_spec(REAL["roi_align_rotated"], "HoistRoi"), "t.toml", "tensorflow")


def _grid_arrays():
    rng = np.random.default_rng(3)
    return rng.standard_normal((2, 3, 6, 7)), rng.uniform(-1.1, 1.1, (2, 9, 5, 2))


def _roi_arrays():
    rng = np.random.default_rng(7)
    k = 3
    rois = np.stack(
        [
            rng.integers(0, 2, k),
            *rng.uniform(6, 10, (2, k)),
            *rng.uniform(4, 8, (2, k)),
            rng.uniform(-1, 1, k),
        ],
        1,
    )
    return rois, rng.standard_normal((2, 2, 10, 10))


CASES = {
    # name -> (module text, arrays, attrs, budget)
    "grid_sample": (_grid_sample_text, _grid_arrays, {}, 2**11),
    "roi_align_rotated": (_roi_text, _roi_arrays, {"scale": 0.5, "PH": 3, "PW": 3, "S": 2}, 2**12),
}


def _step(module, arrays, attrs):
    """forward, then the gradient of the sum of sin of the output (every input)."""
    xs = [tf.constant(a) for a in arrays]
    with tf.GradientTape() as tape:
        tape.watch(xs)
        out = module.forward(*xs, **attrs)
        loss = tf.reduce_sum(tf.sin(out))
    return (out, *tape.gradient(loss, xs))


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """Per case, the module twice: as generated, and with its loops never holding the
    invariant values (every chunk computes them)."""
    folder = tmp_path_factory.mktemp("hoist_tf")
    found = {}
    for name, (text, *_rest) in CASES.items():
        source = text()
        hoisted = load_module(source, folder, f"hoist_tf_{name}")
        alone = load_module(source, folder, f"hoist_tf_{name}_alone")
        alone._kept_once = lambda values, inputs: None
        found[name] = hoisted, alone
    return found


@pytest.mark.parametrize("name", sorted(CASES))
def test_tensorflow_chunks_take_the_invariant_work_once_bit_for_bit(name, modules, monkeypatch):
    """Every chunk of the forward and the backward reads the values computed before the
    loop (its program is given `_once`), and the outputs and gradients equal, bit for bit,
    the same chunks computing them each for itself, and, to rounding, the untiled step
    (float64)."""
    hoisted, alone = modules[name]
    _, arrays, attrs, budget = CASES[name]
    arrays = arrays()
    hoisted.MAX_TEMP_BYTES = 2**40
    untiled = _step(hoisted, arrays, attrs)
    xs = [tf.constant(a) for a in arrays]
    for module in (hoisted, alone):
        module.MAX_TEMP_BYTES = budget
    plan = hoisted._tile_plan(*xs, **attrs)
    assert plan is not None and -(-plan[0] // plan[1]) >= 2, plan
    # The loop holds the values within an eighth of the budget (here they are larger:
    # held, they would outgrow what the plan counts); the chunks below are given them
    # whatever their size, to compare the two programs at a budget that cuts the op.
    once = hoisted._compute_once(*xs, **attrs)
    held = sum(int(np.prod(v.shape)) * v.dtype.size for v in once if tf.is_tensor(v))
    assert hoisted._kept_once(once, xs) is None
    hoisted.MAX_TEMP_BYTES = held * hoisted._HELD
    assert hoisted._kept_once(once, xs) is once
    hoisted.MAX_TEMP_BYTES = budget
    monkeypatch.setattr(hoisted, "_kept_once", lambda values, inputs: values)

    given = []
    for function in ("_compute", "_backward"):
        original = getattr(hoisted, function)

        def recording(*args, _original=original, _once=None, **kwargs):
            given.append(_once is not None)
            return _original(*args, _once=_once, **kwargs)

        monkeypatch.setattr(hoisted, function, recording)
    got = _step(hoisted, arrays, attrs)
    monkeypatch.undo()
    assert given and all(given), given
    fallback = _step(alone, arrays, attrs)
    for g, f, whole in zip(got, fallback, untiled, strict=True):
        np.testing.assert_array_equal(g.numpy(), f.numpy())
        np.testing.assert_allclose(g.numpy(), whole.numpy(), rtol=1e-12, atol=1e-12)


def test_tensorflow_hoisted_chunks_under_xla_and_unknown_sizes(modules, monkeypatch):
    """Under XLA (jit_compile) the loop holds the invariant values (static sizes; held
    whatever their size here, as in the test above); under a tf.function of unknown sizes
    their bytes are unknown and each chunk computes them: both equal the eager step."""
    hoisted, _ = modules["grid_sample"]

    def held_whatever_size(values, inputs):
        tensors = [*inputs, *(v for v in values if tf.is_tensor(v))]
        return values if all(t.shape.num_elements() is not None for t in tensors) else None

    monkeypatch.setattr(hoisted, "_kept_once", held_whatever_size)
    _, arrays, attrs, budget = CASES["grid_sample"]
    arrays = arrays()
    xs = [tf.constant(a) for a in arrays]
    hoisted.MAX_TEMP_BYTES = budget
    want = _step(hoisted, arrays, attrs)
    grad = tf.constant(np.cos(want[0].numpy()))
    want_vjp = hoisted.vjp(*xs, grad, **attrs)

    def vjp(*a):
        return hoisted.vjp(*a, grad, **attrs)

    spec = [tf.TensorSpec([None] * len(t.shape), t.dtype) for t in xs]
    for run in (tf.function(vjp, jit_compile=True), tf.function(vjp, input_signature=spec)):
        for g, w in zip(run(*xs), want_vjp, strict=True):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-12, atol=1e-12)

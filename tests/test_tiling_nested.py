"""Tiling in two levels (`symgrad/tile_nest.py`): where one position of the tiled index
still holds a temporary larger than every input and output (a row of NATTEN's 2-D
windows times its channels, a row of a correlation's displacement volume), each chunk of
one position runs in chunks of a second output index. Exact in chunks (float64, against
the untiled module) in every target, with unknown dims under tf.function, and a training
step at a budget smaller than one row is within 4 x (inputs + outputs) + the budget where
chunks of one row exceed it.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp
from harness import load_module
from peaks import jax_step_bytes, tf_swapped_plan_peaks, torch_peak
from tiling_steps import (
    STEPS,
    budget_alone,
    chunked_equals_whole,
    compiled,
    one_position_a_chunk,
    spec_text,
    tf_step,
)

# op -> (input shapes, attrs): each index its own size
CASES = {
    "NattenAv2d": ({"attn": (2, 3, 7, 6, 9), "value": (2, 3, 7, 6, 5)}, {"K": 3}),
    "Correlation": ({"f1": (2, 5, 7, 3), "f2": (2, 5, 7, 3)}, {"r": 1}),
    "Carafe": ({"features": (2, 3, 4, 5), "masks": (2, 9, 8, 10)}, {"K": 3, "S": 2}),
    # two programs: the chunk of i and j lowers otherwise than the op
    "NattenQk2d": ({"query": (2, 3, 7, 6, 5), "key": (2, 3, 7, 6, 5)}, {"K": 3}),
    "Involution": ({"x": (2, 4, 5, 6), "weight": (2, 2, 3, 3, 5, 6)}, {}),
}
# Correlation too: its third level's chunk sizes u by the chunk's length (`tile_nest`), which
# lowers otherwise than the chunk of i and j
SEPARATE = {"NattenQk2d", "Involution", "Correlation"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("nested")


def _module(op, target, folder):
    return load_module(spec_text(op, target), folder, f"nest_{target}_{op}")


def _arrays(op, dtype=np.float64):
    shapes, _ = CASES[op]
    rng = np.random.default_rng(3)
    return [rng.standard_normal(s).astype(dtype) for s in shapes.values()]


def test_one_position_too_large_gets_a_second_level_and_bounded_ones_do_not():
    """NATTEN's AV row [b,h,j,u,v,d] and a correlation's [b,j,u,v,c] outgrow every input:
    a second level along j. Chamfer's one position of i is bounded: one level, as before."""
    for name in CASES:
        tiling = compiled(name).tiling
        assert (tiling.index, tiling.inner.index) == ("i", "j"), name
        # one program for every level, or the op's and the chunk's, saying why
        assert (tiling.program is None) == (name in SEPARATE), name
        assert (tiling.separate != "") == (name in SEPARATE), name
    assert compiled("ChamferDistance").tiling.inner is None


@pytest.mark.parametrize("target", sorted(STEPS))
@pytest.mark.parametrize("op", sorted(CASES))
def test_two_levels_of_chunks_are_exact(op, target, folder, monkeypatch):
    if target == "jax":
        jax.config.update("jax_enable_x64", True)  # as the other float64 JAX tests
    module = _module(op, target, folder)
    plan = chunked_equals_whole(
        target, module, _arrays(op), CASES[op][1], monkeypatch, budget_alone
    )
    n, c, n2, c2, *deeper = plan
    assert (c, c2) == (1, 1) and n > 1 and n2 > 1  # one position of i, chunks of j
    # a correlation's position still gathers its window: one displacement u, v a chunk
    assert deeper == ([((3, 1), (3, 1))] if op == "Correlation" else []), deeper


def test_unknown_dims_under_tf_function(folder, monkeypatch):
    """Sizes known only to the running graph: the plan is tensors, both loops
    tf.while_loops, the result the untiled one's."""
    module = _module("NattenAv2d", "tensorflow", folder)
    _, attrs = CASES["NattenAv2d"]
    arrays = _arrays("NattenAv2d")
    spec = [tf.TensorSpec([None] * a.ndim, tf.float64) for a in arrays]

    @tf.function(input_signature=spec)
    def step(attn, value):
        with tf.GradientTape() as tape:
            tape.watch([attn, value])
            y = module.forward(attn, value, **attrs)
            loss = tf.reduce_sum(tf.sin(y))
        return [y, *tape.gradient(loss, [attn, value])]

    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 1)
    monkeypatch.setattr(module, "_plan2", budget_alone(module._plan2))
    chunked = [t.numpy() for t in step(*(tf.constant(a) for a in arrays))]
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 2**40)
    whole = tf_step(module, arrays, attrs)
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)


# A size where one row of NATTEN's AV windows [b,h,j,u,v,d] is far larger than the budget
# and than 4 x the inputs and outputs: few rows, many columns, K = 5, 64 channels.
PEAK_SHAPES = {"attn": (1, 2, 6, 40, 25), "value": (1, 2, 6, 40, 64)}
PEAK_ATTRS = {"K": 5}
BUDGET = 2**15


def _io(arrays):
    y = arrays[1].nbytes  # the output has the value's shape
    return sum(a.nbytes for a in arrays) + y


def _peak_arrays():
    rng = np.random.default_rng(4)
    return [rng.standard_normal(s).astype(np.float32) for s in PEAK_SHAPES.values()]


def _check(target, nested, one_row):
    bound = 4 * _io(_peak_arrays()) + BUDGET
    print(f"{target}: one row a chunk {one_row / bound:.2f}x, two levels {nested / bound:.2f}x")
    assert one_row > bound, "the size does not test the bound"
    assert nested <= bound


def test_tensorflow_step_is_bounded_where_one_row_is_not(folder):
    _module("NattenAv2d", "tensorflow", folder)
    found = tf_swapped_plan_peaks(
        folder,
        "nest_tensorflow_NattenAv2d",
        "test_tiling_nested:_peak_arrays",
        PEAK_ATTRS,
        BUDGET,
        "_plan2",
        "tiling_steps:one_position_a_chunk",
    )
    _check("tensorflow", found["planned"], found["swapped"])


def test_pytorch_step_is_bounded_where_one_row_is_not(folder, monkeypatch):
    module = _module("NattenAv2d", "pytorch", folder)
    xs = [torch.tensor(a, requires_grad=True) for a in _peak_arrays()]

    def step():
        y = module.forward(*xs, **PEAK_ATTRS)
        grads = torch.autograd.grad(torch.sin(y).sum(), xs)
        del y, grads

    monkeypatch.setattr(module, "MAX_TEMP_BYTES", BUDGET)
    step()
    nested = torch_peak(step)
    row = module._plan2
    monkeypatch.setattr(module, "_plan2", one_position_a_chunk(row))
    one_row = torch_peak(step)
    _check("pytorch", nested, one_row)


def test_jax_step_is_bounded_where_one_row_is_not(folder, monkeypatch):
    module = _module("NattenAv2d", "jax", folder)
    args = [jnp.asarray(a) for a in _peak_arrays()]
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", BUDGET)
    nested = jax_step_bytes(module, args, PEAK_ATTRS)
    monkeypatch.setattr(module, "_plan2", one_position_a_chunk(module._plan2))
    _check("jax", nested, jax_step_bytes(module, args, PEAK_ATTRS))

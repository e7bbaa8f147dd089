"""Tiling in two levels (`symgrad/tile_nest.py`): where one position of the tiled index
still holds a temporary larger than every input and output (a row of NATTEN's 2-D
windows times its channels, a row of a correlation's displacement volume), each chunk of
one position runs in chunks of a second output index. Exact in chunks (float64, against
the untiled module) in every target, with unknown dims under tf.function, and a training
step at a budget smaller than one row is within 4 x (inputs + outputs) + the budget where
chunks of one row exceed it.
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
from peaks import run_tensorflow, torch_peak

from symgrad.pipeline import compile_op, module_text
from symgrad.spec import parse_spec

REPO = Path(__file__).resolve().parent.parent

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


def _op(name: str):
    spec = parse_spec((REPO / "symgrad.toml").read_text(encoding="utf-8"), "symgrad.toml")
    return next(op for op in spec.ops if op.name == name)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("nested")


def _module(op, target, folder):
    return load_module(module_text(_op(op), "symgrad.toml", target), folder, f"nest_{target}_{op}")


def _arrays(op, dtype=np.float64):
    shapes, _ = CASES[op]
    rng = np.random.default_rng(3)
    return [rng.standard_normal(s).astype(dtype) for s in shapes.values()]


def test_one_position_too_large_gets_a_second_level_and_bounded_ones_do_not():
    """NATTEN's AV row [b,h,j,u,v,d] and a correlation's [b,j,u,v,c] outgrow every input:
    a second level along j. Chamfer's one position of i is bounded: one level, as before."""
    for name in CASES:
        tiling = compile_op(_op(name)).tiling
        assert (tiling.index, tiling.inner.index) == ("i", "j"), name
        # one program for every level, or the op's and the chunk's, saying why
        assert (tiling.program is None) == (name in SEPARATE), name
        assert (tiling.separate != "") == (name in SEPARATE), name
    assert compile_op(_op("ChamferDistance")).tiling.inner is None


def _tf_step(module, arrays, attrs):
    xs = [tf.constant(a) for a in arrays]
    with tf.GradientTape() as tape:
        tape.watch(xs)
        y = module.forward(*xs, **attrs)
        loss = tf.reduce_sum(tf.sin(y))
    return [y.numpy(), *(g.numpy() for g in tape.gradient(loss, xs))]


def _torch_step(module, arrays, attrs):
    xs = [torch.tensor(a, requires_grad=True) for a in arrays]
    y = module.forward(*xs, **attrs)
    grads = torch.autograd.grad(torch.sin(y).sum(), xs)
    return [y.detach().numpy(), *(g.numpy() for g in grads)]


def _jax_step(module, arrays, attrs):
    xs = [jnp.asarray(a) for a in arrays]

    def loss(*a):
        return jnp.sum(jnp.sin(module.forward(*a, **attrs)))

    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(xs)))))(*xs)
    return [np.asarray(module.forward(*xs, **attrs)), *(np.asarray(g) for g in grads)]


def budget_alone(plan2):
    """The two-level plan without the step's allowance (3 x the inputs and outputs): split
    wherever one position exceeds MAX_TEMP_BYTES, as at tiny sizes a test needs."""

    def plan(n, n2, volumes, itemsize, *allowance):
        return plan2(n, n2, volumes, itemsize)

    return plan


STEPS = {"tensorflow": _tf_step, "pytorch": _torch_step, "jax": _jax_step}


@pytest.mark.parametrize("target", sorted(STEPS))
@pytest.mark.parametrize("op", sorted(CASES))
def test_two_levels_of_chunks_are_exact(op, target, folder, monkeypatch):
    if target == "jax":
        jax.config.update("jax_enable_x64", True)  # as the other float64 JAX tests
    module = _module(op, target, folder)
    _, attrs = CASES[op]
    arrays = _arrays(op)
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 2**40)
    whole = STEPS[target](module, arrays, attrs)
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 1)
    monkeypatch.setattr(module, "_plan2", budget_alone(module._plan2))
    if target == "tensorflow":
        plan = module._tile_plan(*(tf.constant(a) for a in arrays), **attrs)
    else:
        plan = module._tile_plan(
            *(jnp.asarray(a) if target == "jax" else torch.tensor(a) for a in arrays), **attrs
        )
    n, c, n2, c2, *deeper = plan
    assert (c, c2) == (1, 1) and n > 1 and n2 > 1  # one position of i, chunks of j
    # a correlation's position still gathers its window: one displacement u, v a chunk
    assert deeper == ([((3, 1), (3, 1))] if op == "Correlation" else []), deeper
    chunked = STEPS[target](module, arrays, attrs)
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)


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
    whole = _tf_step(module, arrays, attrs)
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)


# A size where one row of NATTEN's AV windows [b,h,j,u,v,d] is far larger than the budget
# and than 4 x the inputs and outputs: few rows, many columns, K = 5, 64 channels.
PEAK_SHAPES = {"attn": (1, 2, 6, 40, 25), "value": (1, 2, 6, 40, 64)}
PEAK_ATTRS = {"K": 5}
BUDGET = 2**15


def one_row_a_chunk(plan2):
    """The two-level plan with one position of the outer index a chunk and the inner one
    whole: the one-level tiling of before, which a chunk of one row bounds."""

    def plan(*args):
        found = plan2(*args)
        return found and (found[0], 1, found[2], found[2])

    return plan


def _io(arrays):
    y = arrays[1].nbytes  # the output has the value's shape
    return sum(a.nbytes for a in arrays) + y


def _peak_arrays():
    rng = np.random.default_rng(4)
    return [rng.standard_normal(s).astype(np.float32) for s in PEAK_SHAPES.values()]


MEASURE = """
import json, sys
import numpy as np
import tensorflow as tf
sys.path.insert(0, {folder!r})
sys.path.insert(0, {tests!r})
from peaks import peak
from test_tiling_nested import _peak_arrays, one_row_a_chunk, PEAK_ATTRS
import {stem} as module

args = [tf.constant(a) for a in _peak_arrays()]

def step():
    with tf.GradientTape() as tape:
        tape.watch(args)
        loss = tf.reduce_sum(tf.sin(module.forward(*args, **PEAK_ATTRS)))
    return [g.numpy() for g in tape.gradient(loss, args)]

module.MAX_TEMP_BYTES = {budget}
nested = peak(step)
row = module._plan2
module._plan2 = one_row_a_chunk(row)
one_row = peak(step)
print(json.dumps(dict(nested=nested, one_row=one_row)))
"""


def _check(target, nested, one_row):
    bound = 4 * _io(_peak_arrays()) + BUDGET
    print(f"{target}: one row a chunk {one_row / bound:.2f}x, two levels {nested / bound:.2f}x")
    assert one_row > bound, "the size does not test the bound"
    assert nested <= bound


def test_tensorflow_step_is_bounded_where_one_row_is_not(folder):
    _module("NattenAv2d", "tensorflow", folder)
    script = MEASURE.format(
        folder=str(folder),
        tests=str(REPO / "tests"),
        stem="nest_tensorflow_NattenAv2d",
        budget=BUDGET,
    )
    found = run_tensorflow(script)
    _check("tensorflow", found["nested"], found["one_row"])


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
    monkeypatch.setattr(module, "_plan2", one_row_a_chunk(row))
    one_row = torch_peak(step)
    _check("pytorch", nested, one_row)


def test_jax_step_is_bounded_where_one_row_is_not(folder, monkeypatch):
    module = _module("NattenAv2d", "jax", folder)
    args = [jnp.asarray(a) for a in _peak_arrays()]

    def peak():
        def loss(*a):
            return jnp.sum(jnp.sin(module.forward(*a, **PEAK_ATTRS)))

        def grad(*a):  # a new function: traced with the current plan
            return jax.grad(loss, argnums=(0, 1))(*a)

        analysis = jax.jit(grad).lower(*args).compile().memory_analysis()
        return (
            analysis.temp_size_in_bytes
            + analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
        )

    monkeypatch.setattr(module, "MAX_TEMP_BYTES", BUDGET)
    nested = peak()
    row = module._plan2
    monkeypatch.setattr(module, "_plan2", one_row_a_chunk(row))
    _check("jax", nested, peak())

"""Tiling an op whose output has a composite axis (`attn[b,h,i,j,(u,v)]`, NATTEN's 2-D QK in
its [B, heads, H, W, K*K] layout): the tiled index is a plain output axis, the chunk keeps
the composite axis, and the module places the chunks along the axis of the actual output
tensor (a composite group counts as one axis). An index inside a composite output group is
never tiled. Exact in float64 against the untiled module in TensorFlow (eager and under
tf.function with unknown sizes), PyTorch and JAX. The memory bound at a real size is in
tests/test_memory_real_ops.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from harness import load_module

from symgrad import tile
from symgrad.model import build
from symgrad.pipeline import compile_op, module_text
from symgrad.spec import OpSpec, parse_spec

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp

REPO = Path(__file__).resolve().parent.parent
GROUP_FIRST = "y[b,(p,q),i] = sum(exp(x[b,i,c] * w[p,q,c] * z[b,j,c]), j, c)"
# a composite output beside a plain one: chunks placed along axis 2 of y, axis 1 of s
TWO_OUTPUTS = [GROUP_FIRST, "s[b,i] = sum(tanh(x[b,i,c] * z[b,j,c]), j, c)"]
TENSOR = {"tensorflow": tf.constant, "pytorch": torch.tensor, "jax": jnp.asarray}


def _op(name: str = "NattenQk2d") -> OpSpec:
    spec = parse_spec((REPO / "symgrad.toml").read_text(encoding="utf-8"), "symgrad.toml")
    return next(op for op in spec.ops if op.name == name)


def _spec_op(formula: str | list[str]) -> OpSpec:
    text = (
        f'"{formula}"'
        if isinstance(formula, str)
        else "[" + ", ".join(f'"{f}"' for f in formula) + "]"
    )
    (op,) = parse_spec(f"[ops.Probe]\nformula = {text}\n", "probe.toml").ops
    return op


# op -> (input shapes, attrs, output shapes); each index its own size
CASES = {
    # query, key (b=2, h=3, i=5, j=4, d=6), K=3: attn (2, 3, 5, 4, 9), tiled along i
    "natten_qk2d": (
        {"query": (2, 3, 5, 4, 6), "key": (2, 3, 5, 4, 6)},
        {"K": 3},
        [(2, 3, 5, 4, 9)],
    ),
    # x (b=2, i=5, c=3), w (p=4, q=6, c=3), z (b=2, j=7, c=3): y (2, 24, 5), tiled along i
    "group_first": ({"x": (2, 5, 3), "w": (4, 6, 3), "z": (2, 7, 3)}, {}, [(2, 24, 5)]),
    "two_outputs": ({"x": (2, 5, 3), "w": (4, 6, 3), "z": (2, 7, 3)}, {}, [(2, 24, 5), (2, 5)]),
}
SHAPES, ATTRS, _ = CASES["natten_qk2d"]


def _case_op(name: str) -> OpSpec:
    formulas = {"group_first": GROUP_FIRST, "two_outputs": TWO_OUTPUTS}
    return _op() if name == "natten_qk2d" else _spec_op(formulas[name])


def _arrays(seed: int = 11, shapes=SHAPES) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [0.3 * rng.standard_normal(s) for s in shapes.values()]


def test_a_composite_output_is_tiled_along_a_plain_axis_counted_by_groups():
    """Tiled along the query rows i: the attn tensor's axis 2. Its flattened indices
    (b, h, i, j, u, v) would give the same here, so also a composite group before the
    tiled index: y[b, (p, q), i] is tiled along i at the tensor's axis 2, not 3."""
    tiling = compile_op(_op()).tiling
    assert tiling is not None and tiling.index == "i"
    assert tiling.output_axes == (2,)
    op = _spec_op(GROUP_FIRST)
    tiling = compile_op(op).tiling
    assert tiling is not None and tiling.index == "i"
    assert tiling.output_axes == (2,)
    tiling = compile_op(_spec_op(TWO_OUTPUTS)).tiling
    assert tiling is not None and tiling.index == "i"
    assert tiling.output_axes == (2, 1)


def test_an_index_inside_a_composite_output_group_is_not_tiled():
    """y[b, (i, j)] over a pairwise temporary: i and j are the only long indices and both
    sit in the composite axis, so only b may be tiled (a chunk of i would not be a slice
    of the output's axis)."""
    op = _spec_op("y[b,(i,j)] = sum(exp(x[b,i,c] * z[b,j,c]), c)")
    program = build(op)
    assert tile.big_sets(program)
    choice = tile.choose(op, program)
    assert choice is not None and choice.index == "b"


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_composite_output_in_chunks_equals_the_untiled_module(case, target, tmp_path):
    shapes, attrs, outs = CASES[case]
    text = module_text(_case_op(case), "symgrad.toml", target)
    module = load_module(text, tmp_path, f"{case}_{target}")
    arrays = _arrays(shapes=shapes)
    tensor = TENSOR[target]
    rng = np.random.default_rng(3)
    cotangents = [tensor(rng.standard_normal(out)) for out in outs]
    default = module.MAX_TEMP_BYTES
    try:
        module.MAX_TEMP_BYTES = 2**40
        assert module._tile_plan(*map(tensor, arrays), **attrs) is None
        want = _listed(module.forward(*map(tensor, arrays), **attrs))
        want_grads = _listed(module.vjp(*map(tensor, arrays), *cotangents, **attrs))
        module.MAX_TEMP_BYTES = 256  # one query row per chunk
        assert module._tile_plan(*map(tensor, arrays), **attrs) is not None
        got = _listed(module.forward(*map(tensor, arrays), **attrs))
        grads = _listed(module.vjp(*map(tensor, arrays), *cotangents, **attrs))
    finally:
        module.MAX_TEMP_BYTES = default
    assert [w.shape for w in want] == outs
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)
    for g, w in zip(grads, want_grads, strict=True):
        assert np.abs(w).max() > 0.1
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)


def _listed(results) -> list[np.ndarray]:
    """One output, or a tuple of outputs or gradients, as a list of arrays."""
    if isinstance(results, tuple | list):
        return [np.asarray(r) for r in results]
    return [np.asarray(results)]


def test_natten_qk2d_in_chunks_under_tf_function_with_unknown_sizes(tmp_path):
    """Also under XLA (jit_compile): the chunks' composite axis keeps static sizes."""
    module = load_module(module_text(_op(), "symgrad.toml", "tensorflow"), tmp_path, "qk_graph")
    tensors = [tf.constant(a) for a in _arrays(5)]
    grad = tf.constant(np.random.default_rng(4).standard_normal((2, 3, 5, 4, 9)))
    default = module.MAX_TEMP_BYTES
    try:
        module.MAX_TEMP_BYTES = 2**40
        want_y = module.forward(*tensors, **ATTRS).numpy()
        want = [g.numpy() for g in module.vjp(*tensors, grad, **ATTRS)]
        module.MAX_TEMP_BYTES = 256
        spec = [tf.TensorSpec([None] * 5, tf.float64)] * 2
        forward = tf.function(lambda *a: module.forward(*a, **ATTRS), input_signature=spec)
        vjp = tf.function(lambda *a: module.vjp(*a, grad, **ATTRS), input_signature=spec)
        xla = tf.function(lambda *a: module.vjp(*a, grad, **ATTRS), jit_compile=True)
        got_y = forward(*tensors).numpy()
        got = [[g.numpy() for g in run(*tensors)] for run in (vjp, xla)]
    finally:
        module.MAX_TEMP_BYTES = default
    np.testing.assert_allclose(got_y, want_y, rtol=0, atol=1e-12)
    for grads in got:
        for g, w in zip(grads, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)


def test_a_psa_mask_is_tiled_along_a_plain_output_index():
    """mmcv's psamask COLLECT, y[n, (p, q), h, w] (a composite output): no temporary is
    larger than the output, but the output is larger than x and computed in several steps
    (the gather's positions, its mask, the gathered values, the `where`), so its own set
    counts as a large temporary (`output_temps`); it is tiled along a plain output index,
    never inside the composite (p, q)."""
    (op,) = parse_spec(PSA_MASK, "psamask.toml").ops
    program = build(op)
    assert [{i.name for i in b} for b in tile.big_sets(program)] == [{"n", "p", "q", "h", "w"}]
    assert compile_op(op).tiling.index == "h"  # the longest plain one, not the batch n


PSA_MASK = """
[ops.PsaMaskCollect]
formula = "y[n,(p,q),h,w] = where(0 <= p - h + HH < Hm and 0 <= q - w + HW < Wm, x[n, (p - h + HH) * Wm + q - w + HW, h, w], 0)"
inputs = ["x"]
attrs = { Hm = "int", Wm = "int" }
let = { HH = "(Hm - 1) // 2", HW = "(Wm - 1) // 2" }
ranges = { p = "x.shape[2]", q = "x.shape[3]" }
"""

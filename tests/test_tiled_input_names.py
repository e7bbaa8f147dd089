"""A tiled module's chunk loop names its position `_start`, `_length` (and `_start2`,
`_length2` in two levels), never a name an op may give an input.

Multi-scale deformable attention has an input `start` (Deformable DETR's
level_start_index): the TensorFlow and JAX chunk closures took `start, length`, so every
chunk read the chunk's first position as the level starts, and a tiled TensorFlow call
failed (`dim 1 not in the interval [-1, 0]` expanding the scalar). Pinned here: the tiled
forward, vjp and training step equal the untiled module's in float64, in all three targets.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from harness import load_module

from symgrad.pipeline import module_text
from symgrad.spec import load_spec

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ["tensorflow", "pytorch", "jax"]


def _inputs():
    """b=2, s=28 (levels 4x5, 2x3, 1x2), m=5, d=7, q=6, l=3, p=4; samples past every border."""
    rng = np.random.default_rng(23)
    shapes = np.array([[4.0, 5.0], [2.0, 3.0], [1.0, 2.0]])
    start = np.array([0, 20, 26])
    value = rng.standard_normal((2, 28, 5, 7))
    loc = rng.uniform(-0.2, 1.2, (2, 6, 5, 3, 4, 2))
    attn = rng.uniform(0, 1, (2, 6, 5, 3, 4))
    grad = rng.standard_normal((2, 6, 5, 7))
    return [value, shapes, start, loc, attn], grad


def _module(target, tmp_path):
    (op,) = [op for op in load_spec(ROOT / "symgrad.toml").ops if op.name == "MsDeformAttn"]
    return load_module(module_text(op, "symgrad.toml", target), tmp_path, f"msda_{target}")


def _tile(module, args, partial=True):
    """Set the smallest budget that tiles into several chunks, the last one partial (or
    not, with `partial` False)."""
    for budget in (int(2 ** (k / 4)) for k in range(24, 120)):  # quarter octaves
        module.MAX_TEMP_BYTES = budget
        plan = module._tile_plan(*args)
        if plan is not None and 1 < plan[1] < plan[0] and (plan[0] % plan[1] or not partial):
            return plan
    raise AssertionError("no budget tiles MsDeformAttn into partial chunks")


def _run(target, module, arrays, grad):
    """The forward, vjp and a training step's gradients (value, loc, attn), as NumPy."""
    if target == "tensorflow":
        args = [tf.constant(a) for a in arrays]
        out = module.forward(*args)
        vjp = module.vjp(*args, tf.constant(grad))
        with tf.GradientTape() as tape:
            tape.watch(args)
            loss = tf.reduce_sum(tf.sin(module.forward(*args)))
        step = tape.gradient(loss, [args[0], args[3], args[4]])
        return [out.numpy(), *(vjp[i].numpy() for i in (0, 3, 4)), *(g.numpy() for g in step)]
    if target == "pytorch":
        args = [torch.tensor(a) for a in arrays]
        with torch.no_grad():
            out = module.forward(*args)
        vjp = module.vjp(*args, torch.tensor(grad))
        for i in (0, 3, 4):
            args[i].requires_grad_(True)
        torch.sin(module.forward(*args)).sum().backward()
        step = [args[i].grad for i in (0, 3, 4)]
        return [out.numpy(), *(vjp[i].numpy() for i in (0, 3, 4)), *(g.numpy() for g in step)]
    args = [jnp.asarray(a) for a in arrays]  # jitted: one program, not op-by-op dispatch
    out = jax.jit(module.forward)(*args)
    vjp = jax.jit(module.vjp)(*args, jnp.asarray(grad))

    def loss(v, lo, at):
        return jnp.sum(jnp.sin(module.forward(v, args[1], args[2], lo, at)))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(args[0], args[3], args[4])
    return [np.asarray(x) for x in (out, vjp[0], vjp[3], vjp[4], *step)]


@pytest.mark.parametrize("target", TARGETS)
def test_tiled_ms_deform_attn_equals_untiled(target, tmp_path):
    arrays, grad = _inputs()
    module = _module(target, tmp_path)
    convert = {"tensorflow": tf.constant, "pytorch": torch.tensor, "jax": jnp.asarray}[target]
    module.MAX_TEMP_BYTES = 2**40
    assert module._tile_plan(*(convert(a) for a in arrays)) is None
    want = _run(target, module, arrays, grad)
    # JAX's plan takes chunks of whole positions that divide their count (a leftover
    # chunk, run outside the scan, held buffers of its own: tile_nest_jax.py.j2)
    _tile(module, [convert(a) for a in arrays], partial=target != "jax")
    got = _run(target, module, arrays, grad)
    names = ["forward", "vjp value", "vjp loc", "vjp attn", "step value", "step loc", "step attn"]
    for name, g, w in zip(names, got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=f"{target} {name}")


def _shadowing(tree):
    """(function, name) for each chunk closure (`_chunk`, `_inner`) or lambda whose
    parameter hides a parameter of a function around it."""
    found = []

    def visit(node, outer):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.Lambda)):
                names = {a.arg for a in child.args.args + child.args.kwonlyargs}
                where = getattr(child, "name", "lambda")
                if where in ("_chunk", "_inner", "lambda"):
                    found.extend((where, n) for n in sorted(names & outer))
                visit(child, outer | names)
            else:
                visit(child, outer)

    visit(tree, set())
    return found


def test_no_committed_tiled_module_hides_an_input_in_its_chunk_loop():
    """Every committed module with a chunk loop: no closure's parameter hides an input."""
    paths = [
        path
        for folder in ("generated", "generated_torch", "generated_jax", "benchmarks/generated")
        for path in sorted((ROOT / folder).glob("*.py"))
        if "def _chunk(" in path.read_text(encoding="utf-8")
    ]
    assert any(p.stem == "ms_deform_attn" for p in paths)
    for path in paths:
        assert not _shadowing(ast.parse(path.read_text(encoding="utf-8"))), path

"""What the tests of tiling below the first level share (tests/test_tiling_nested.py,
tests/test_tiling_nested_whole_input.py, tests/test_tiling_deeper.py): the repository
spec's ops, each compiled once for every target; a training step in each framework; the
plans a test puts in place of a module's own; and the check that a step in chunks equals
the untiled one."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest

from symgrad.pipeline import compile_op, module_text
from symgrad.spec import parse_spec

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp

REPO = Path(__file__).resolve().parent.parent
COMPILED = {}  # op -> `compile_op`'s module: each op compiled once, for every target


def spec_op(name: str):
    """The op `name` of the repository's symgrad.toml, or a test's variant of one
    (`GATHERED`)."""
    if name in GATHERED:
        base, formula = GATHERED[name]
        op = spec_op(base)
        attrs = (*op.attrs, ("s", "int"))
        return dataclasses.replace(op, name=name, formulas=(formula,), attrs=attrs)
    spec = parse_spec((REPO / "symgrad.toml").read_text(encoding="utf-8"), "symgrad.toml")
    return next(op for op in spec.ops if op.name == name)


# NATTEN's 1-D QK with its keys read at a step `s` (1 in the tests: the same op): a window
# whose offset has a coefficient other than 1 stays a gather (bands.py), so the tiling of
# a gathered window it exercises is the one NATTEN took before its clamped window was
# banded.
GATHERED = {
    "NattenQk1dGathered": (
        "NattenQk1d",
        (
            "attn[b,h,i,k] = sum(query[b,h,i,d] * key[b,h, max(min(i - ns, L - kernel_size), 0)"
            " + s*k, d], d)"
        ),
    )
}


def compiled(name: str):
    """`compile_op` of the repository's op `name`."""
    op = spec_op(name)
    if op not in COMPILED:
        COMPILED[op] = compile_op(op)
    return COMPILED[op]


@functools.cache
def spec_text(name: str, target: str) -> str:
    """The module text of the repository's op `name` for `target`."""
    return module_text(spec_op(name), "symgrad.toml", target, COMPILED)


def tf_step(module, arrays, attrs):
    """The output and the gradients of the sum of its sine for every float input."""
    xs = [tf.constant(a) for a in arrays]
    watched = [x for x in xs if x.dtype.is_floating]
    with tf.GradientTape() as tape:
        tape.watch(watched)
        y = module.forward(*xs, **attrs)
        loss = tf.reduce_sum(tf.sin(y))
    return [y.numpy(), *(g.numpy() for g in tape.gradient(loss, watched))]


def torch_step(module, arrays, attrs):
    xs = [torch.tensor(a, requires_grad=a.dtype != np.int32) for a in arrays]
    watched = [x for x in xs if x.requires_grad]
    y = module.forward(*xs, **attrs)
    grads = torch.autograd.grad(torch.sin(y).sum(), watched)
    return [y.detach().numpy(), *(g.numpy() for g in grads)]


def jax_step(module, arrays, attrs):
    xs = [jnp.asarray(a) for a in arrays]
    wrt = tuple(k for k, a in enumerate(arrays) if a.dtype != np.int32)

    def loss(*a):
        return jnp.sum(jnp.sin(module.forward(*a, **attrs)))

    grads = jax.jit(jax.grad(loss, argnums=wrt))(*xs)
    return [np.asarray(module.forward(*xs, **attrs)), *(np.asarray(g) for g in grads)]


STEPS = {"tensorflow": tf_step, "pytorch": torch_step, "jax": jax_step}
TENSORS = {"tensorflow": tf.constant, "pytorch": torch.tensor, "jax": jnp.asarray}


def budget_alone(plan2):
    """The two-level plan without the step's allowance (3 x the inputs and outputs): split
    wherever one position exceeds MAX_TEMP_BYTES, as at tiny sizes a test needs."""

    def plan(n, n2, volumes, itemsize, *allowance):
        return plan2(n, n2, volumes, itemsize)

    return plan


def one_position_a_chunk(plan2):
    """The two-level plan with one position of the outer index a chunk and the inner index
    whole: the one-level tiling of before."""

    def plan(*args):
        found = plan2(*args)
        return found and (found[0], 1, found[2], found[2])

    return plan


def chunked_equals_whole(target, module, arrays, attrs, monkeypatch, planned):
    """The step's output and gradients at a 1-byte budget under the plan `planned(_plan2)`
    equal the untiled step's (float64, to 1e-12); returns that plan."""
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 2**40)
    whole = STEPS[target](module, arrays, attrs)
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 1)
    monkeypatch.setattr(module, "_plan2", planned(module._plan2))
    plan = module._tile_plan(*(TENSORS[target](a) for a in arrays), **attrs)
    chunked = STEPS[target](module, arrays, attrs)
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)
    return plan

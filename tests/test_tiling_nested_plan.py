"""The nested plan (`_plan2`): one rule in the three targets, each with its own allowance.

While one position of the outer index is within the step's bound less the inputs and
outputs it holds anyway (MAX_TEMP_BYTES + 3 x (inputs + outputs)), a chunk takes as many
whole outer positions as the target's allowance for a chunk holds (MAX_TEMP_BYTES +
_ROOM_QUARTERS / 4 x (inputs + outputs)), at least one; else one, split along the inner
index in chunks of the same allowance (a chunk of roi_align_rotated's 7 x 7 bins at
256 KiB takes 2 bins in PyTorch where chunks of the budget take 1: 28 chunks, not 49;
DCNv2's row of 22 positions at 32 KiB, 8 channels of 24 x 24, runs in 2 chunks, not 22,
at 0.90x the bound). The volumes count bytes: a sampled read's int64 corner positions 8
bytes an item, the rest the values' itemsize. The rule is the same whether or not one
position fits the budget alone, so more budget never means more chunks (where chunks of the budget alone
were taken once one position fit it, MsDeformAttn's 300 queries ran in 300 chunks at
512 KiB, in 17 at 256 KiB). The allowance is what the bound, 4 x (inputs + outputs) + the
budget, leaves beside what a step holds besides its chunk, measured per target
(`QUARTERS`; the measurements in the templates' comments). Otherwise the plans agree for
the same sizes and the same count of temporaries (`_HELD`: 8 in TensorFlow and PyTorch,
4 in JAX, whose XLA fuses more).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp
from harness import load_module
from peaks import jax_step_bytes

REPO = Path(__file__).resolve().parent.parent
FOLDERS = {"tensorflow": "generated", "pytorch": "generated_torch", "jax": "generated_jax"}
# Each target's allowance beyond the budget, in quarters of the inputs' and outputs' bytes:
# what the bound leaves beside what a step holds besides its chunk (MsDeformAttn below,
# at two sizes; TensorFlow's peak jumps past 6 queries a chunk of 300).
QUARTERS = {"tensorflow": 3, "pytorch": 8, "jax": 3}


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """MsDeformAttn's committed module of each target."""
    folder = tmp_path_factory.mktemp("nested_plan")
    return {
        target: load_module(
            (REPO / sub / "ms_deform_attn.py").read_text(encoding="utf-8"),
            folder,
            f"nested_plan_{target}",
        )
        for target, sub in FOLDERS.items()
    }


def _ms_deform_attn_arrays(queries: int):
    """symgrad.toml's MsDeformAttn: value 2 x 3024 x 4 x 16 over levels 48x48, 24x24,
    12x12, `queries` queries, 5 points (as tests/test_tiling_tf_speed.py)."""
    rng = np.random.default_rng(5)
    levels = [(48, 48), (24, 24), (12, 12)]
    return [
        rng.standard_normal((2, sum(h * w for h, w in levels), 4, 16)).astype(np.float32),
        np.array(levels, np.float32),
        np.array([0, 2304, 2880], np.int64),
        rng.uniform(-0.05, 1.05, (2, queries, 4, 3, 5, 2)).astype(np.float32),
        rng.uniform(0, 1, (2, queries, 4, 3, 5)).astype(np.float32),
    ]


TENSORS = {"tensorflow": tf.constant, "pytorch": torch.from_numpy, "jax": jnp.asarray}


def _rule(n, n2, volumes, itemsize, inputs, outputs, budget, held, target):
    """The plan as the docstring of `_plan2` states it, written out once here (JAX's
    whole positions in chunks of one size)."""
    held = held * sum((v[0] or itemsize) * int(np.prod(v[1:])) for v in volumes)
    if held <= budget or n * n2 <= 1:
        return None
    io = inputs + itemsize * sum(int(np.prod(v)) for v in outputs)
    room = budget + QUARTERS[target] * io // 4  # what the target's allowance holds
    if held <= (budget + 3 * io) * n:  # one outer position within the bound: whole ones
        c = max(1, min(n, room * n // held))
        if target == "jax":
            c = max(d for d in range(1, c + 1) if n % d == 0)
        return n, c, n2, n2
    return n, 1, n2, max(1, min(n2, room * n * n2 // held))  # split along the inner index


def _chunks(plan) -> int:
    """The chunks a plan runs (one where it does not tile)."""
    if plan is None:
        return 1
    n, c, n2, c2 = (int(v) for v in plan)
    return -(-n // c) * -(-n2 // c2)


def test_each_target_states_its_measured_allowance(modules):
    assert {t: m._ROOM_QUARTERS for t, m in modules.items()} == QUARTERS


def test_every_target_takes_several_whole_positions_within_its_allowance(modules, monkeypatch):
    """MsDeformAttn at 128 KiB, 300 queries: one query exceeds the budget, within every
    target's allowance; each takes as many queries a chunk as its allowance holds (where
    PyTorch's and JAX's took one: 300 chunks)."""
    arrays = _ms_deform_attn_arrays(300)
    budget = 2**17
    io = sum(a.nbytes for a in arrays)
    for target, module in modules.items():
        monkeypatch.setattr(module, "MAX_TEMP_BYTES", budget)
        found = tuple(int(v) for v in module._tile_plan(*map(TENSORS[target], arrays)))
        # six temporaries [b, l, q, m, p, d] = [2, 3, 300, 4, 5, 16], two of them the int64
        # corner positions of its one floored (flat) coordinate; out [2, 300, 4, 16]
        volumes = ((0, 2, 3, 300, 4, 5, 16),) * 4 + ((8, 2, 3, 300, 4, 5, 16),) * 2
        want = _rule(300, 4, volumes, 4, io, ((2, 300, 4, 16),), budget, module._HELD, target)
        assert found == want, target
        assert 1 < found[1] < 300 and found[3] == 4, (target, found)


def test_jax_takes_several_positions_within_the_bound(modules, monkeypatch):
    """JAX's plan for the same step takes several queries a chunk (static under jit), and
    its step is within the bound 4 x (inputs + outputs) + the budget, where TensorFlow's
    allowance (3 x (inputs + outputs), as TensorFlow's plan took them) is not."""
    module = modules["jax"]
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 2**17)
    arrays = _ms_deform_attn_arrays(300)
    args = [jnp.asarray(a) for a in arrays]
    found = []

    def traced(*args):  # the plan of the jitted step: Python ints, known when tracing
        found.append(module._tile_plan(*args))
        return args[0]

    jax.jit(traced)(*args)
    assert len(found) == 1 and all(type(v) is int for v in found[0])
    assert 1 < found[0][1] < 300
    bound = 4 * (sum(a.nbytes for a in arrays) + 4 * 2 * 300 * 4 * 16) + 2**17  # out [2,300,64]
    wrt = (0, 3, 4)
    ours = jax_step_bytes(module, args, wrt=wrt)
    monkeypatch.setattr(module, "_ROOM_QUARTERS", 12)
    several = module._tile_plan(*args)
    assert several[1] > found[0][1]
    many = jax_step_bytes(module, args, wrt=wrt)
    print(
        f"jax: {found[0][1]} queries a chunk {ours / bound:.2f}x, {several[1]} {many / bound:.2f}x"
    )
    assert ours <= bound < many


# (n, n2, volumes, itemsize, inputs, outputs): each branch of the plan, and the edges
# between them (an outer position within the budget, within the allowance, beyond it).
SIZES = [
    (n, n2, ((0, n, n2, 5), (8, n, 3)), 4, inputs, ((n2, 2),))
    for n, n2, inputs in itertools.product((1, 2, 7, 300), (1, 3, 64), (0, 10, 1000, 10**6))
]
BUDGETS = (1, 64, 300, 4096, 2**16, 2**20)


@pytest.mark.parametrize("held", [4, 8])
def test_the_three_targets_plan_alike(modules, monkeypatch, held):
    """Every target's `_plan2` gives the plan its docstring states for the same sizes,
    budget and count of temporaries, with its own allowance (TensorFlow's in Python ints
    where the sizes are known, in tensors under a tf.function that does not know them);
    between them the plans take several whole positions a chunk, one, and split the
    inner index."""
    kinds = set()
    spec = [tf.TensorSpec([], tf.int32)] * 3
    for budget in BUDGETS:
        for module in modules.values():
            monkeypatch.setattr(module, "MAX_TEMP_BYTES", budget)
            monkeypatch.setattr(module, "_HELD", held)
        plan2 = modules["tensorflow"]._plan2
        unknown = tf.function(
            lambda n, n2, inputs, plan2=plan2: plan2(
                n, n2, ((0, n, n2, 5), (8, n, 3)), 4, inputs, ((n2, 2),)
            ),
            input_signature=spec,
        )
        for sizes in SIZES:
            for target, module in modules.items():
                want = _rule(*sizes, budget, held, target)
                assert module._plan2(*sizes) == want, (target, budget, sizes)
                if want is not None:
                    kinds.add("split" if want[3] < want[2] else "several" if want[1] > 1 else "one")
            want = _rule(*sizes, budget, held, "tensorflow")
            if want is not None:
                found = unknown(*(tf.constant(v, tf.int32) for v in (*sizes[:2], sizes[4])))
                assert tuple(int(v) for v in found) == want, (budget, sizes, found)
    assert kinds == {"split", "several", "one"}, kinds


def test_more_budget_never_means_more_chunks(modules, monkeypatch):
    """In every target, the chunks a plan runs do not increase as the budget grows: for
    the sizes above (TensorFlow's with unknown sizes too), and for MsDeformAttn's 300
    queries from 16 KiB to 8 MiB, across the budget where one query comes to fit it
    alone (under 512 KiB: where chunks of the budget alone took one query a chunk)."""
    spec = [tf.TensorSpec([], tf.int32)] * 3
    budgets = [2**k for k in range(25)]
    for target, module in modules.items():
        counts = {sizes: [] for sizes in SIZES}
        for budget in budgets:
            monkeypatch.setattr(module, "MAX_TEMP_BYTES", budget)
            for sizes in SIZES:
                counts[sizes].append(_chunks(module._plan2(*sizes)))
        for sizes, found in counts.items():
            assert found == sorted(found, reverse=True), (target, sizes, found)
    plan2 = modules["tensorflow"]._plan2
    for sizes in SIZES[1::12]:  # TensorFlow's plan in tensors, under a tf.function
        found = []
        for budget in budgets[::6]:
            monkeypatch.setattr(modules["tensorflow"], "MAX_TEMP_BYTES", budget)
            unknown = tf.function(
                lambda n, n2, inputs: plan2(
                    n, n2, ((0, n, n2, 5), (8, n, 3)), 4, inputs, ((n2, 2),)
                ),
                input_signature=spec,
            )
            found.append(
                _chunks(unknown(*(tf.constant(v, tf.int32) for v in (*sizes[:2], sizes[4]))))
            )
        assert found == sorted(found, reverse=True), (sizes, found)
    arrays = _ms_deform_attn_arrays(300)
    for target, module in modules.items():
        tensors = [TENSORS[target](a) for a in arrays]
        found = []
        for k in range(14, 24):
            monkeypatch.setattr(module, "MAX_TEMP_BYTES", 2**k)
            found.append(_chunks(module._tile_plan(*tensors)))
        print(target, found)
        assert found == sorted(found, reverse=True), (target, found)
        assert found[0] < 300, (target, found)  # several queries a chunk at 16 KiB

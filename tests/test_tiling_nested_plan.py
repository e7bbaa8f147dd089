"""The nested plan (`_plan2`): one rule in the three targets, but for whole positions.

Where one position of the outer index exceeds MAX_TEMP_BYTES but is within the step's
allowance (3 x (inputs + outputs) + the budget), TensorFlow's chunks take as many whole
outer positions as the allowance holds (one position a chunk ran MsDeformAttn's 300
queries at 256 KiB in 300 chunks). PyTorch's and JAX's take one: their steps hold more
than the inputs and outputs besides a chunk's temporaries, and the allowance's count of
positions exceeded the bound (PyTorch 1.02x in tests/test_memory_sampled_scatters.py,
JAX 1.54x below). Otherwise the plans agree for the same sizes and the same count of
temporaries (`_HELD`: 8 in TensorFlow and PyTorch, 4 in JAX, whose XLA fuses more).
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


def test_pytorch_runs_one_whole_position_a_chunk_where_tensorflow_takes_several(
    modules, monkeypatch
):
    """MsDeformAttn at 128 KiB, 300 queries: one query exceeds the budget, within the
    allowance. TensorFlow's plan takes 17 queries a chunk; PyTorch's one (its step over
    the allowance's count held 1.02x the bound at the size of the memory tests)."""
    arrays = _ms_deform_attn_arrays(300)
    plans = {}
    for target in ("tensorflow", "pytorch"):
        monkeypatch.setattr(modules[target], "MAX_TEMP_BYTES", 2**17)
        found = modules[target]._tile_plan(*map(TENSORS[target], arrays))
        plans[target] = tuple(int(v) for v in found)
    assert plans == {"tensorflow": (300, 17, 4, 4), "pytorch": (300, 1, 4, 4)}


def test_jax_runs_one_whole_position_a_chunk_within_the_bound(modules, monkeypatch):
    """JAX's plan for the same step: one query a chunk (static under jit), and its step is
    within the bound 4 x (inputs + outputs) + the budget, where the allowance's count of
    queries a chunk (as TensorFlow's plan takes them) is not."""
    module = modules["jax"]
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 2**17)
    arrays = _ms_deform_attn_arrays(300)
    args = [jnp.asarray(a) for a in arrays]
    found = []

    def traced(*args):  # the plan of the jitted step: Python ints, known when tracing
        found.append(module._tile_plan(*args))
        return args[0]

    jax.jit(traced)(*args)
    assert found == [(300, 1, 4, 4)] and all(type(v) is int for v in found[0])
    bound = 4 * (sum(a.nbytes for a in arrays) + 4 * 2 * 300 * 4 * 16) + 2**17  # out [2,300,64]
    wrt = (0, 3, 4)
    one = jax_step_bytes(module, args, wrt=wrt)
    # As many queries a chunk as the allowance holds: TensorFlow's plan, with JAX's count.
    monkeypatch.setattr(modules["tensorflow"], "MAX_TEMP_BYTES", 2**17)
    monkeypatch.setattr(modules["tensorflow"], "_HELD", module._HELD)
    several = modules["tensorflow"]._tile_plan(*map(tf.constant, arrays))
    assert several[1] > 1
    monkeypatch.setattr(module, "_plan2", lambda *a: several)
    many = jax_step_bytes(module, args, wrt=wrt)
    print(f"jax: one query a chunk {one / bound:.2f}x, {several[1]} {many / bound:.2f}x")
    assert one <= bound < many


# (n, n2, volumes, itemsize, inputs, outputs): each branch of the plan, and the edges
# between them (an outer position within the budget, within the allowance, beyond it).
SIZES = [
    (n, n2, ((n, n2, 5), (n, 3)), 4, inputs, ((n2, 2),))
    for n, n2, inputs in itertools.product((1, 2, 7, 300), (1, 3, 64), (0, 10, 1000, 10**6))
]
BUDGETS = (1, 64, 300, 4096, 2**16, 2**20)


def _rule(n, n2, volumes, itemsize, inputs, outputs, budget, held, several=True):
    """The plan as the docstring of `_plan2` states it, written out once here (PyTorch's
    and JAX's: not `several` whole positions a chunk)."""
    held = held * itemsize * sum(int(np.prod(v)) for v in volumes)
    if held <= budget or n * n2 <= 1:
        return None
    if held <= budget * n:  # one outer position fits the budget: as one level would take
        return n, max(1, budget * n // held), n2, n2
    room = budget + 3 * (inputs + itemsize * sum(int(np.prod(v)) for v in outputs))
    if held <= room * n:  # whole outer positions, as many as the step's allowance holds
        return n, min(n, room * n // held) if several else 1, n2, n2
    return n, 1, n2, max(1, budget * n * n2 // held)  # split along the inner index


@pytest.mark.parametrize("held", [4, 8])
def test_the_three_targets_plan_alike(modules, monkeypatch, held):
    """Every target's `_plan2` gives the plan its docstring states for the same sizes,
    budget and count of temporaries (PyTorch's and JAX's one whole position a chunk where
    TensorFlow's takes several) (TensorFlow's in Python ints where the sizes are
    known, in tensors under a tf.function that does not know them); between them the
    plans take several whole positions a chunk, one, and split the inner index."""
    kinds = set()
    spec = [tf.TensorSpec([], tf.int32)] * 3
    for budget in BUDGETS:
        for module in modules.values():
            monkeypatch.setattr(module, "MAX_TEMP_BYTES", budget)
            monkeypatch.setattr(module, "_HELD", held)
        plan2 = modules["tensorflow"]._plan2
        unknown = tf.function(
            lambda n, n2, inputs, plan2=plan2: plan2(
                n, n2, ((n, n2, 5), (n, 3)), 4, inputs, ((n2, 2),)
            ),
            input_signature=spec,
        )
        for sizes in SIZES:
            want = _rule(*sizes, budget, held)
            plans = {target: module._plan2(*sizes) for target, module in modules.items()}
            one = _rule(*sizes, budget, held, several=False)
            assert plans == {"tensorflow": want, "pytorch": one, "jax": one}, (budget, sizes)
            if want is not None:
                found = unknown(*(tf.constant(v, tf.int32) for v in (*sizes[:2], sizes[4])))
                assert tuple(int(v) for v in found) == want, (budget, sizes, found)
                kinds.add("split" if want[3] < want[2] else "several" if want[1] > 1 else "one")
    assert kinds == {"split", "several", "one"}, kinds

"""TensorFlow modules in chunks whose positions mix dtypes: the chunk's start is the
loop's int32 scalar, positions beside index tensors are int64, a sampled position is a
float of the values' dtype. TensorFlow adds none of these to another (PyTorch and JAX
promote), so a chunk that added the start or a size of the plan to the wrong one raised
a TypeError where the untiled call ran. Each op in chunks (float64, every index a
different size) against the reference evaluator and finite differences (harness.check),
and under tf.function with every size unknown against the module run eagerly.
"""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

from adversarial import unknown_sizes_equal_eager
from harness import Case, check, generate, make_tensors

BAND = "g[i] * x[ix[j]]"

CASES = {
    # a shift beside a number: `i + 1` in a chunk is (1 + start) + i, the start cast to
    # int64 (ix is an index tensor): `shift(1, start)` added the int32 start to the 1
    "below_sum": Case(
        f"y[i] = sum(where(j <= i + 1, {BAND}, 0), j)",
        {"g": (5,), "x": (7,)},
        inputs=("g", "x", "ix"),
        index_inputs={"ix": ((4,), 0, 7)},
    ),
    "below_max_int64": Case(
        f"y[i] = max(where(j <= i + 1, {BAND}, -inf), j)",
        {"g": (5,), "x": (7,)},
        inputs=("g", "x", "ix"),
        index_inputs={"ix": ((4,), 0, 7, tf.int64)},
    ),
    "band": Case(
        f"y[i] = sum(where(i - 1 <= j <= i + 1, {BAND}, 0), j)",
        {"g": (5,), "x": (7,)},
        inputs=("g", "x", "ix"),
        index_inputs={"ix": ((4,), 0, 7)},
    ),
    # a window read at 2i + j, its start 2 * start in a chunk: a size of the plan (the
    # loop's int32) subtracted from each row's int64 position (ln is an index tensor)
    "strided_window": Case(
        "y[b,i] = max(where(j < ln[b], sum(q[b,i,d] * k[b, 2*i + j, d], d), 0), j)",
        {"q": (2, 5, 1), "k": (2, 9, 1)},
        inputs=("q", "k", "ln"),
        ranges={"i": "5", "j": "4"},
        sizes={"i": 5, "j": 4},
        index_inputs={"ln": ((2,), 0, 5)},
    ),
    # a log-sum-exp over j in chunks combined by logaddexp: a chunk of a length known
    # in the loop alone lost b's size of 1, and the loop refused its sums back as [None, 6]
    "pairwise_logsumexp": Case(
        "y[b,i] = log(sum(exp(-sum((x[b,i,c] - z[b, ix[b,j], c])**2, c)), j))",
        {"x": (1, 6, 2), "z": (1, 4, 2)},
        inputs=("x", "z", "ix"),
        index_inputs={"ix": ((1, 5), 0, 4)},
    ),
    # `(i + 0.5)` in a sampled position: (0.5 + start) + i, the start a float
    "bilinear_resize": Case(
        "y[b,c,i,j] = x[b,c, min(max((i+0.5)*H/OH - 0.5, 0.0), H-1),"
        " min(max((j+0.5)*W/OW - 0.5, 0.0), W-1)]",
        {"x": (2, 3, 4, 6)},
        attrs={"OH": 7, "OW": 9},
        ranges={"i": "OH", "j": "OW"},
        sizes={"i": 7, "j": 9},
        lets={"H": "x.shape[2]", "W": "x.shape[3]"},
        let_values={"H": 4, "W": 6},
    ),
}

# (a budget of 1600 bytes: chunks of 3 of the 5 positions of j, the last one shorter)
BUDGETS = {"bilinear_resize": (4096, 1), "pairwise_logsumexp": (1600, 1)}


@pytest.mark.parametrize("name, budget", [(n, b) for n in CASES for b in BUDGETS.get(n, (1,))])
def test_in_chunks_equals_the_reference(name, budget, tmp_path):
    case = CASES[name]
    module = generate(case, tmp_path, prefix="TiledDtypes")
    module.MAX_TEMP_BYTES = budget
    plan = module._tile_plan(*make_tensors(case, module.INPUTS), **case.attrs)
    assert plan is not None and plan[1] < plan[0]  # several chunks
    check(case, module)


@pytest.mark.parametrize("name", CASES)
def test_unknown_sizes_equal_eager(name, tmp_path):
    case = CASES[name]
    module = generate(case, tmp_path, prefix="TiledDtypesUnknown")
    args = make_tensors(case, module.INPUTS)
    unknown_sizes_equal_eager(module, args, case.attrs, seed=5)

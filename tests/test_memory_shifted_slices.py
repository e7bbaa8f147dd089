"""A read at one index plus a shift (`w[o, C + c]`) under an explicit range no longer
takes away the tile plan, nor makes one where it must not.

DGCNN's EdgeConv (its published weight [O, 2C], the first half applied to the edge
`x_j - x_i`, the second to the centre `x_i`) reads `w[o, C + c]` with c ranged over
x's channels. The slice `w[o, C + c]` counts as a temporary that may be larger than
every input (sized by x's axis, not w's), and no output index runs through it and the
edge features [b,c,n,k] both, so no plan was made: a training step held 19.2x the bound.
A shifted slice is larger than its input only where its range runs past the input's end,
which only the sizes at call time tell: where no index (nor a summed one) serves every
large set, the op is cut along one that serves the rest (`tile.choose`, `loose`).

The slice still asks for a plan, and the index cut still runs through it where one does
(`test_a_slice_past_its_inputs_end_is_still_bounded`): `x[b, t + S]` with t over `w`'s
20,000 columns against x's 10 is 64 x 20,000, and a first version that never counted
slices held 27x the bound there.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from adversarial import chunks_equal_the_untiled_module, torch_step_peaks
from harness import Case, check, generate
from peaks import jax_step_peaks, tf_module_step_peaks

from symgrad.pipeline import compile_op
from symgrad.spec import parse_spec

EDGE_CONV = (
    "y[b,o,n] = max(sum(w[o,c] * (x[b,c,idx[b,n,k]] - x[b,c,n]) + w[o, C + c] * x[b,c,n], c), k)"
)
BUDGET = 2**18
# x [B, C, N], idx [B, N, K] (K neighbours), w [O, 2C]: every index its own size
B, C, N, K, O = 2, 16, 700, 20, 24


def _case() -> Case:
    return Case(
        EDGE_CONV,
        {"x": (2, 3, 7), "w": (5, 6)},
        attrs={"C": 3},
        ranges={"c": "x.shape[1]"},
        sizes={"c": 3},
        index_inputs={"idx": ((2, 7, 4), 0, 7)},
        inputs=("x", "idx", "w"),
    )


def test_edge_conv_is_planned_along_a_point():
    spec = parse_spec(
        f'[ops.EdgeConv]\nformula = "{EDGE_CONV}"\ninputs = ["x", "idx", "w"]\n'
        'attrs = {C = "int"}\nranges = {c = "x.shape[1]"}\n',
        "edge.toml",
    )
    tiling = compile_op(spec.ops[0]).tiling
    assert tiling is not None and tiling.index == "n"


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_edge_conv_in_chunks_equals_the_untiled_module(target, tmp_path):
    case = _case()
    if target == "tensorflow":
        check(case, generate(case, tmp_path, prefix="EdgeExact"))
    chunks_equal_the_untiled_module(case, target, tmp_path, "Edge")


def _arrays():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, C, N)).astype(np.float32)
    idx = rng.integers(0, N, (B, N, K)).astype(np.int32)
    w = rng.standard_normal((O, 2 * C)).astype(np.float32)
    return x, idx, w


def _check(target, untiled, tiled, bound):
    print(f"{target}: untiled {untiled / bound:.1f}x, tiled {tiled / bound:.2f}x")
    assert untiled > 4 * bound, f"{target}: the size does not test the bound"
    assert tiled <= bound, f"{target}: a tiled step peaks at {tiled} > {bound}"


def _case_module(target, folder):
    case = Case(
        EDGE_CONV,
        {"x": (B, C, N), "w": (O, 2 * C)},
        attrs={"C": C},
        ranges={"c": "x.shape[1]"},
        sizes={"c": C},
        index_inputs={"idx": ((B, N, K), 0, N)},
        inputs=("x", "idx", "w"),
    )
    return generate(case, folder, prefix="EdgeMemory", target=target)


def test_tensorflow_training_step_of_edge_conv_is_bounded(tmp_path):
    module = _case_module("tensorflow", tmp_path)
    arrays = "test_memory_shifted_slices._arrays"
    found = tf_module_step_peaks(module, arrays, BUDGET, {"C": C}, watched=(0, 2))
    _check("tensorflow", found["untiled"], found["tiled"], 4 * found["io"] + BUDGET)


def test_pytorch_training_step_of_edge_conv_is_bounded(tmp_path):
    torch = pytest.importorskip("torch")
    module = _case_module("pytorch", tmp_path)
    x, idx, w = _arrays()
    xs = [
        torch.tensor(x, requires_grad=True),
        torch.tensor(idx),
        torch.tensor(w, requires_grad=True),
    ]
    untiled, tiled, bound = torch_step_peaks(module, xs, {"C": C}, BUDGET)
    _check("pytorch", untiled, tiled, bound)


def test_jax_training_step_of_edge_conv_is_bounded(tmp_path):
    jax = pytest.importorskip("jax")
    module = _case_module("jax", tmp_path)
    args = [jax.numpy.asarray(a) for a in _arrays()]
    _check("jax", *jax_step_peaks(module, args, BUDGET, {"C": C}, wrt=(0, 2)))


PAST_THE_END = {  # formula -> attrs; x [64, 10], w [1, 20000], t over w's columns
    "y[b,o] = sum(x[b, t + S] * w[o,t], t)": {"S": 3},
    "y[b,o] = sum(exp(x[b, t + S]) * w[o,t], t)": {"S": 3},
    "y[b,o] = sum(exp(x[b, t]) * w[o,t], t)": {},
}


@pytest.mark.parametrize("formula", sorted(PAST_THE_END))
def test_a_slice_past_its_inputs_end_is_still_bounded(formula, tmp_path):
    torch = pytest.importorskip("torch")
    attrs = PAST_THE_END[formula]
    case = Case(formula, {"x": (64, 10), "w": (1, 20000)}, attrs=attrs, ranges={"t": "w.shape[1]"})
    module = generate(case, tmp_path, prefix="PastEnd", target="pytorch")
    rng = np.random.default_rng(0)
    xs = [
        torch.tensor(rng.uniform(-1, 1, case.shapes[n]).astype(np.float32), requires_grad=True)
        for n in module.INPUTS
    ]
    untiled, tiled, bound = torch_step_peaks(module, xs, attrs, 2**16)
    _check("pytorch", untiled, tiled, bound)

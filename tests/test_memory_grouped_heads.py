"""Grouped-query attention, `k[b, j, h // G, d]`: a second level cuts the rows.

Softmax attention whose keys and values serve G query heads each is cut along the heads
h (the only output index in every large temporary: the keys and values gathered to every
query head, [b,j,h,d], lack the rows i). One head still holds its scores [b,i,j] several
times over, and the level below had to be in every large temporary too, which left only
the batch: a PyTorch step at 1 MiB held 1.40x the bound. At one head the gathered keys
and values are a strict part of `k` and `v` (`tile.left_large`), so the level below cuts
the rows i: 0.53x (PyTorch), 0.55x (TensorFlow), 0.66x (JAX).
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from adversarial import chunks_equal_the_untiled_module, torch_step_peaks
from harness import Case, generate
from peaks import jax_step_peaks, tf_module_step_peaks

SCORES = "sum(q[b,i,h,d] * k[b,j,h // G,d], d)"
FORMULA = f"y[b,i,h,e] = sum(exp({SCORES}) * v[b,j,h // G,e], j) / sum(exp({SCORES}), j)"
BUDGET = 2**20
# q [B, N, H, D], k and v [B, M, H / G, D]: every index its own size
B, N, M, H, G, D = 1, 1024, 896, 8, 4, 32


def _case(b, n, m, h, g, d, e) -> Case:
    return Case(
        FORMULA,
        {"q": (b, n, h, d), "k": (b, m, h // g, d), "v": (b, m, h // g, e)},
        attrs={"G": g},
        inputs=("q", "k", "v"),
    )


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_grouped_query_attention_in_chunks_equals_the_untiled_module(target, tmp_path):
    case = _case(2, 5, 7, 6, 3, 4, 3)
    chunks_equal_the_untiled_module(case, target, tmp_path, "Gqa")


def _arrays():
    rng = np.random.default_rng(0)
    shapes = [(B, N, H, D), (B, M, H // G, D), (B, M, H // G, D)]
    return [(0.3 * rng.standard_normal(s)).astype(np.float32) for s in shapes]


def _module(target, folder):
    return generate(_case(B, N, M, H, G, D, D), folder, prefix="GqaMemory", target=target)


def _check(target, untiled, tiled, bound, plan):
    print(f"GQA {target}: untiled {untiled / bound:.2f}x, tiled {tiled / bound:.2f}x, {plan}")
    assert untiled > 4 * bound, f"{target}: the size does not test the bound"
    assert plan[1] == 1 and plan[3] < plan[2], f"{target}: not one head in chunks of rows"
    assert tiled <= bound, f"{target}: a tiled step peaks at {tiled} > {bound}"


def test_tensorflow_training_step_of_grouped_query_attention_is_bounded(tmp_path):
    module = _module("tensorflow", tmp_path)
    found = tf_module_step_peaks(module, "test_memory_grouped_heads._arrays", BUDGET, {"G": G})
    bound = 4 * found["io"] + BUDGET
    _check("tensorflow", found["untiled"], found["tiled"], bound, found["plan"])


def test_pytorch_training_step_of_grouped_query_attention_is_bounded(tmp_path):
    torch = pytest.importorskip("torch")
    module = _module("pytorch", tmp_path)
    xs = [torch.tensor(a, requires_grad=True) for a in _arrays()]
    untiled, tiled, bound = torch_step_peaks(module, xs, {"G": G}, BUDGET)
    _check("pytorch", untiled, tiled, bound, module._tile_plan(*xs, G=G))


def test_jax_training_step_of_grouped_query_attention_is_bounded(tmp_path, monkeypatch):
    jax = pytest.importorskip("jax")
    module = _module("jax", tmp_path)
    args = [jax.numpy.asarray(a) for a in _arrays()]
    untiled, tiled, bound = jax_step_peaks(module, args, BUDGET, {"G": G})
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", BUDGET)
    _check("jax", untiled, tiled, bound, module._tile_plan(*args, G=G))

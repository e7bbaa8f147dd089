"""Siblings of the recognised patterns (prefix sums, convolutions, gathers, extrema): the
variants next to each exact match, where a peephole could fire wrongly or a general
lowering could mix up an axis. Every one is checked against the reference evaluator
through the generated module (`harness.check`), float64, with a size per index."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from harness import Case, check, generate

L = "x.shape[1]"


def _x(n: int = 7, **kw) -> dict:
    return {"shapes": {"x": (3, n)}, **kw}


SIBLINGS = {
    # -- prefix sums ---------------------------------------------------------------------
    "cumsum_exclusive": Case(
        "y[b,i] = sum(where(k < i, x[b,k], 0), k)", {"x": (3, 7)}, ranges={"i": L}, sizes={"i": 7}
    ),
    "cumsum_offset": Case(
        "y[b,i] = sum(where(k <= i + 1, x[b,k], 0), k)",
        {"x": (3, 7)},
        ranges={"i": f"{L} - 2"},
        sizes={"i": 5},
    ),
    "cumsum_reverse_inclusive": Case(
        "y[b,i] = sum(where(k >= i, x[b,k], 0), k)", {"x": (3, 7)}, ranges={"i": L}, sizes={"i": 7}
    ),
    "sliding_sum": Case(
        "y[b,i] = sum(where(i - 2 <= k <= i, x[b,k], 0), k)",
        {"x": (3, 7)},
        ranges={"i": f"{L} - 1"},
        sizes={"i": 6},
    ),
    "cumsum_weighted": Case(
        "y[b,i] = sum(where(k <= i, x[b,k] * w[k], 0), k)",
        {"x": (3, 7), "w": (7,)},
        ranges={"i": "4"},
        sizes={"i": 4},
    ),
    "cumsum_past_the_end": Case(
        "y[b,i] = sum(where(k <= i, x[b,k], 0), k)",
        {"x": (3, 7)},
        ranges={"i": f"{L} + 2"},
        sizes={"i": 9},
    ),
    "cumsum_strided": Case(
        "y[b,i] = sum(where(k <= 2*i, x[b,k], 0), k)",
        {"x": (3, 9)},
        ranges={"i": f"{L} // 2"},
        sizes={"i": 4},
    ),
    "cumsum_of_exp": Case(
        "y[b,i] = sum(where(k <= i, exp(x[b,k]), 0), k)",
        {"x": (3, 7)},
        ranges={"i": L},
        sizes={"i": 7},
    ),
    "cumsum_middle_axis": Case(
        "y[b,i,j] = sum(where(k <= i, A[b,k,j], 0), k)",
        {"A": (2, 5, 4)},
        ranges={"i": "A.shape[1] + 1"},
        sizes={"i": 6},
    ),
    "cumsum_transposed_output": Case(
        "y[b,j,i] = sum(where(k <= i, A[b,k,j], 0), k)",
        {"A": (2, 5, 4)},
        ranges={"i": "A.shape[1] + 1"},
        sizes={"i": 6},
    ),
    "cumsum_nonzero_otherwise": Case(
        "y[b,i] = sum(where(k <= i, x[b,k], 1), k)",
        {"x": (3, 7)},
        ranges={"i": "5"},
        sizes={"i": 5},
    ),
    "cumsum_otherwise_value": Case(
        "y[b,i] = sum(where(k <= i, x[b,k], 2 * x[b,k]), k)",
        {"x": (3, 7)},
        ranges={"i": "5"},
        sizes={"i": 5},
    ),
    "cumsum_and_skip": Case(
        "y[b,i] = sum(where(k <= i and k != 2, x[b,k], 0), k)",
        {"x": (3, 7)},
        ranges={"i": "5"},
        sizes={"i": 5},
    ),
    "cumsum_not_greater": Case(
        "y[b,i] = sum(where(not (k > i), x[b,k], 0), k)",
        {"x": (3, 7)},
        ranges={"i": "5"},
        sizes={"i": 5},
    ),
    "cumsum_times_plain": Case("y[b,i] = sum(where(k <= i, x[b,k], 0), k) * x[b,i]", {"x": (3, 7)}),
    "cummean": Case(
        "y[b,i] = mean(where(k <= i, x[b,k], 0), k)",
        {"x": (3, 7)},
        ranges={"i": "5"},
        sizes={"i": 5},
    ),
    "cummax": Case(
        "y[b,i] = max(where(k <= i, x[b,k], -5), k)",
        {"x": (3, 7)},
        ranges={"i": "5"},
        sizes={"i": 5},
    ),
    "cumsum_two_inputs": Case(
        "y[b,i] = sum(where(k <= i, x[b,k] + z[b,k], 0), k)",
        {"x": (3, 7), "z": (3, 7)},
        ranges={"i": "5"},
        sizes={"i": 5},
    ),
    "cumsum_reversed_condition": Case(
        "y[b,i] = sum(where(i >= k, x[b,k], 0), k)",
        {"x": (3, 7)},
        ranges={"i": "5"},
        sizes={"i": 5},
    ),
    "cumsum_squared": Case(
        "y[b,i] = sum(where(k <= i, x[b,k] * x[b,k], 0), k)",
        {"x": (3, 7)},
        ranges={"i": "5"},
        sizes={"i": 5},
    ),
    "cumsum_implicit": Case(
        "y[b,i] = where(k <= i, x[b,k], 0)", {"x": (3, 7)}, ranges={"i": "5"}, sizes={"i": 5}
    ),
    # -- convolutions --------------------------------------------------------------------
    "conv_positive_offset": Case(
        "y[b,i,o] = sum(x[b, i + k + 2, c] * w[k,c,o], k, c)",
        {"x": (2, 11, 3), "w": (4, 3, 5)},
        sizes={"i": 6},
    ),
    "conv_wide_padding": Case(
        "y[b,i,o] = sum(x[b, i + k - 5, c] * w[k,c,o], k, c)",
        {"x": (2, 7, 3), "w": (4, 3, 5)},
        ranges={"i": "x.shape[1] + 3"},
        sizes={"i": 10},
    ),
    "conv_same_even": Case(
        "y[b,i,o] = sum(x[b, 2*i + k - 1, c] * w[k,c,o], k, c)",
        {"x": (2, 12, 3), "w": (4, 3, 5)},
        ranges={"i": "x.shape[1] // 2"},
        sizes={"i": 6},
    ),
    "conv_stride3_pad2": Case(
        "y[b,i,o] = sum(x[b, 3*i + k - 2, c] * w[k,c,o], k, c)",
        {"x": (2, 19, 3), "w": (4, 3, 5)},
        sizes={"i": 6},
    ),
    "conv_flipped_kernel": Case(
        "y[b,i,o] = sum(x[b, i - k, c] * w[k,c,o], k, c)",
        {"x": (2, 8, 3), "w": (4, 3, 5)},
        ranges={"i": "x.shape[1]"},
        sizes={"i": 8},
    ),
    "conv_bias_tanh": Case(
        "y[b,i,o] = tanh(sum(x[b, i+k, c] * w[k,c,o], k, c) + bias[o])",
        {"x": (2, 10, 3), "w": (4, 3, 5), "bias": (5,)},
        sizes={"i": 7},
    ),
    "conv_scaled": Case(
        "y[b,i,o] = 2 * sum(x[b, i+k, c] * w[k,c,o], k, c)",
        {"x": (2, 10, 3), "w": (4, 3, 5)},
        sizes={"i": 7},
    ),
    "conv_channels_first_output": Case(
        "y[b,o,i] = sum(x[b, i+k, c] * w[k,c,o], k, c)",
        {"x": (2, 10, 3), "w": (4, 3, 5)},
        sizes={"i": 7},
    ),
    "conv_ncw": Case(
        "y[b,o,i] = sum(x[b, c, i+k] * w[o,c,k], k, c)",
        {"x": (2, 3, 10), "w": (5, 3, 4)},
        sizes={"i": 7},
    ),
    "conv_filter_oik": Case(
        "y[b,i,o] = sum(x[b, i+k, c] * w[o,c,k], k, c)",
        {"x": (2, 10, 3), "w": (5, 3, 4)},
        sizes={"i": 7},
    ),
    "conv2d_mixed_strides": Case(
        "y[b,i,j,o] = sum(x[b, 2*i + u - 1, j + 2*v, c] * w[u,v,c,o], u, v, c)",
        {"x": (2, 9, 14, 3), "w": (4, 5, 3, 7)},
        ranges={"i": "(x.shape[1] + 1) // 2"},
        sizes={"i": 5, "j": 6},
    ),
    "conv2d_swapped_filter": Case(
        "y[b,i,j,o] = sum(x[b, i+u, j+v, c] * w[v,u,c,o], u, v, c)",
        {"x": (2, 10, 12, 3), "w": (5, 4, 3, 6)},
        sizes={"i": 7, "j": 8},
    ),
    "conv_no_batch": Case(
        "y[i,o] = sum(x[i + k, c] * w[k,c,o], k, c)", {"x": (10, 3), "w": (4, 3, 5)}, sizes={"i": 7}
    ),
    "conv_no_channels": Case(
        "y[b,i] = sum(x[b, i+k] * w[k], k)", {"x": (3, 10), "w": (4,)}, sizes={"i": 7}
    ),
    "conv_per_batch_filter": Case(
        "y[b,i] = sum(x[b, i+k] * w[b,k], k)", {"x": (3, 10), "w": (3, 4)}, sizes={"i": 7}
    ),
    "conv_squared_input": Case(
        "y[b,i,o] = sum(x[b, i+k, c] * x[b, i+k, c] * w[k,c,o], k, c)",
        {"x": (2, 10, 3), "w": (4, 3, 5)},
        sizes={"i": 7},
    ),
    "conv_cropped_range": Case(
        "y[b,i,o] = sum(x[b, i + k, c] * w[k,c,o], k, c)",
        {"x": (2, 12, 3), "w": (4, 3, 5)},
        ranges={"i": "2"},
        sizes={"i": 2},
    ),
    "conv_strided_past_the_end": Case(
        "y[b,i,o] = sum(x[b, 2*i + k, c] * w[k,c,o], k, c)",
        {"x": (2, 8, 3), "w": (4, 3, 5)},
        ranges={"i": "x.shape[1]"},
        sizes={"i": 8},
    ),
    "conv_int_attr_stride_and_pad": Case(
        "y[b,i,o] = sum(x[b, s*i + k - p, c] * w[k,c,o], k, c)",
        {"x": (2, 19, 3), "w": (4, 3, 5)},
        attrs={"s": 3, "p": 2},
        sizes={"i": 6},
    ),
    "conv_negative_pad_attr": Case(
        "y[b,i,o] = sum(x[b, i + k - p, c] * w[k,c,o], k, c)",
        {"x": (2, 13, 3), "w": (4, 3, 5)},
        attrs={"p": -2},
        sizes={"i": 8},
    ),
    "autocorrelation": Case(
        "y[b,u] = sum(x[b,i] * x[b, i + u], i)", {"x": (3, 7)}, ranges={"u": "4"}, sizes={"u": 4}
    ),
    "shifted_diagonal": Case("y[b,i] = sum(A[b, i+k, k], k)", {"A": (2, 9, 4)}, sizes={"i": 6}),
    "superdiagonal": Case("y[b,i] = A[b, i, i + 1]", {"A": (2, 5, 6)}),
    # -- gathers -------------------------------------------------------------------------
    "gather_two_index_tensors": Case(
        "y[b,n,c] = X[b, idx[b,n], jdx[b,n], c]",
        {"X": (2, 5, 6, 3)},
        index_inputs={"idx": ((2, 4), 0, 5), "jdx": ((2, 4), 0, 6)},
    ),
    "gather_apart": Case(
        "y[n,c] = X[idx[n], c, jdx[n]]",
        {"X": (5, 3, 6)},
        index_inputs={"idx": ((4,), 0, 5), "jdx": ((4,), 0, 6)},
    ),
    "gather_transposed_ids": Case(
        "y[n,b] = X[b, idx[n,b]]", {"X": (2, 7)}, index_inputs={"idx": ((4, 2), 0, 7)}
    ),
    "gather_affine_of_index": Case(
        "y[b,n,k,c] = X[b, 2*idx[b,n] + k - 1, c]",
        {"X": (2, 9, 4)},
        index_inputs={"idx": ((2, 5), 0, 5)},
        ranges={"k": "3"},
        sizes={"k": 3},
    ),
    "gather_squared": Case(
        "y[b,n] = sum(X[b, idx[b,n,k]] * X[b, idx[b,n,k]], k)",
        {"X": (2, 9)},
        index_inputs={"idx": ((2, 4, 5), 0, 9)},
    ),
    "gather_shared_ids": Case(
        "y[b,n] = X[b, idx[b,n]] * Y[b, idx[b,n]]",
        {"X": (2, 9), "Y": (2, 9)},
        index_inputs={"idx": ((2, 5), 0, 9)},
    ),
    "gather_sum_of_ids": Case(
        "y[b,n] = X[b, idx[b,n] + jdx[b,n]]",
        {"X": (2, 9)},
        index_inputs={"idx": ((2, 5), 0, 5), "jdx": ((2, 5), 0, 5)},
    ),
    "gather_contracted": Case(
        "y[b,t] = sum(W[ids[b,t], d] * q[b,d], d)",
        {"W": (11, 5), "q": (2, 5)},
        index_inputs={"ids": ((2, 3), 0, 11)},
    ),
    "gather_summed_ids": Case(
        "y[b] = sum(X[b, idx[k]], k)", {"X": (2, 9)}, index_inputs={"idx": ((5,), 0, 9)}
    ),
    "gather_max_neighbours": Case(
        "y[b,n,c] = max(X[b, idx[b,n,k], c], k)",
        {"X": (2, 9, 3)},
        index_inputs={"idx": ((2, 4, 5), -2, 11)},
    ),
    "gather_in_function": Case(
        "y[b,t,d] = tanh(W[ids[b,t], d]) * W[ids[b,t], d]",
        {"W": (11, 5)},
        index_inputs={"ids": ((2, 3), 0, 11)},
    ),
    "gather_then_where": Case(
        "y[b,t,d] = where(W[ids[b,t], d] > 0, W[ids[b,t], d], 0)",
        {"W": (11, 5)},
        index_inputs={"ids": ((2, 3), 0, 11)},
    ),
    "gather_int64_out_of_range": Case(
        "y[b,n,c] = sum(X[b, idx[b,n,k], c] * w[b,n,k], k)",
        {"X": (2, 9, 3), "w": (2, 4, 5)},
        index_inputs={"idx": ((2, 4, 5), -4, 13, tf.int64)},
    ),
    # -- conditions ----------------------------------------------------------------------
    "where_value_vs_value": Case(
        "y[b,i] = where(A[b,i] > B[b,i], A[b,i], 2 * B[b,i])", {"A": (3, 5), "B": (3, 5)}
    ),
    "where_chained_values": Case(
        "y[b,i] = where(-0.5 < x[b,i] <= 0.5, x[b,i] ** 2, x[b,i])", {"x": (3, 7)}
    ),
    "where_diagonal": Case("y[b,i,j] = where(i == j, A[b,i,j], 0)", {"A": (2, 4, 5)}),
    "where_off_diagonal": Case(
        "y[b,i,j] = where(i == j + 1, A[b,i,j], -A[b,i,j])", {"A": (2, 4, 5)}
    ),
    "where_inside_exp": Case("y[b,i] = exp(where(x[b,i] < 0, x[b,i], -x[b,i]))", {"x": (3, 7)}),
    "where_broadcast_branches": Case(
        "y[b,i] = where(i < 2, x[b,i], z[b])", {"x": (3, 7), "z": (3,)}
    ),
    "where_nested": Case(
        "y[b,i] = where(x[b,i] > 0, where(i >= 3, x[b,i], 2 * x[b,i]), 0.5 * x[b,i])",
        {"x": (3, 7)},
    ),
    "where_of_sums": Case(
        "y[b,i] = where(x[b,i] > 0, sum(A[b,i,k], k), sum(A[b,i,k] * A[b,i,k], k))",
        {"x": (2, 3), "A": (2, 3, 4)},
    ),
    "where_sum_inside_condition": Case(
        "y[b,i] = where(sum(A[b,i,k], k) > 0, x[b,i], 0)", {"x": (2, 3), "A": (2, 3, 4)}
    ),
    "where_max_inside_condition": Case(
        "y[b,i] = where(max(A[b,i,k], k) > 0, x[b,i], 0)", {"x": (2, 3), "A": (2, 3, 4)}
    ),
    "mean_over_window": Case(
        "y[b,i] = mean(x[b, i + k - 1], k)",
        {"x": (3, 7)},
        ranges={"i": L, "k": "4"},
        sizes={"i": 7, "k": 4},
    ),
    "max_two_indices_masked": Case(
        "y[b] = max(where(i <= j, A[b,i,j], -3), i, j)", {"A": (2, 3, 4)}
    ),
    "gather_two_lookups_one_table": Case(
        "y[b,t,d] = W[ids[b,t], d] * W[jds[b,t], d]",
        {"W": (11, 5)},
        index_inputs={"ids": ((2, 3), 0, 11), "jds": ((2, 3), 0, 11)},
    ),
    "gather_and_plain_read_of_one_table": Case(
        "y[b,t,d] = W[ids[b,t], d] + W[t, d]", {"W": (3, 5)}, index_inputs={"ids": ((2, 3), 0, 3)}
    ),
    "gather_squared_out_of_range": Case(
        "y[b,t,d] = W[ids[b,t], d] * W[ids[b,t], d]",
        {"W": (11, 5)},
        index_inputs={"ids": ((2, 3), -2, 13)},
    ),
    # -- non-overlapping windows (a slice and a reshape) ------------------------------------
    "pool_pairs": Case(
        "y[b,i,c] = max(x[b, 2*i + u, c], u)",
        {"x": (3, 11, 4)},
        ranges={"u": "2"},
        sizes={"u": 2, "i": 5},
    ),
    "pool_pairs_padded": Case(
        "y[b,i,c] = max(x[b, 2*i + u - 1, c], u)",
        {"x": (3, 11, 4)},
        ranges={"u": "2", "i": "(x.shape[1] + 1) // 2"},
        sizes={"u": 2, "i": 6},
    ),
    "pool_past_the_end": Case(
        "y[b,i,c] = max(x[b, 3*i + u, c], u)",
        {"x": (2, 13, 4)},
        ranges={"u": "3", "i": "x.shape[1] // 3 + 1"},
        sizes={"u": 3, "i": 5},
    ),
    "pool_sum": Case(
        "y[b,i,c] = sum(x[b, 3*i + u, c], u)",
        {"x": (2, 16, 4)},
        ranges={"u": "3"},
        sizes={"u": 3, "i": 5},
    ),
    "pool_mean_offset": Case(
        "y[b,i,c] = mean(x[b, 3*i + u + 1, c], u)",
        {"x": (2, 16, 4)},
        ranges={"u": "3"},
        sizes={"u": 3, "i": 5},
    ),
    "pool_attr_stride": Case(
        "y[b,i,c] = max(x[b, s*i + u, c], u)",
        {"x": (2, 16, 4)},
        attrs={"s": 3},
        ranges={"u": "3"},
        sizes={"u": 3, "i": 5},
    ),
    "pool_window_wider_than_stride": Case(
        "y[b,i,c] = max(x[b, 3*i + u, c], u)",
        {"x": (2, 16, 6)},
        ranges={"u": "4"},
        sizes={"u": 4, "i": 5},
    ),
    "pool_2d_channels_first_output": Case(
        "y[b,j,i] = max(x[b, 2*i + u, 3*j + v], u, v)",
        {"x": (2, 11, 13)},
        ranges={"u": "2", "v": "3"},
        sizes={"u": 2, "v": 3, "i": 5, "j": 4},
    ),
    # -- extrema -------------------------------------------------------------------------
    "max_weighted": Case("y[b,i] = max(x[b,i,j] * w[j], j)", {"x": (2, 3, 4), "w": (4,)}),
    "max_of_sum": Case("y[b] = max(sum(A[b,i,j], j), i)", {"A": (2, 3, 4)}),
    "max_of_mean": Case("y[b] = max(mean(A[b,i,j], j), i)", {"A": (2, 3, 4)}),
    "logsumexp_stable": Case(
        "y[b] = max(x[b,j], j) + log(sum(exp(x[b,j] - max(x[b,m], m)), j))", {"x": (2, 5)}
    ),
    "softmax_shifted": Case(
        "y[b,i] = exp(x[b,i] - max(x[b,m], m)) / sum(exp(x[b,j] - max(x[b,m], m)), j)",
        {"x": (2, 5)},
    ),
    "min_times_max": Case("y[b,j] = min(x[b,i,j], i) * max(x[b,i,j], i)", {"x": (2, 3, 4)}),
    "max_clamped": Case("y[b,i] = max(max(x[b,i,j], j), 0.25)", {"x": (2, 3, 4)}),
    "max_over_batchless": Case("y[i] = max(x[b,i], b)", {"x": (2, 5)}),
    "max_squared": Case("y[b] = max(x[b,i] * x[b,i], i)", {"x": (2, 5)}),
    "max_window_stride": Case(
        "y[b,i] = max(x[b, 3*i + k], k)", {"x": (2, 17)}, ranges={"k": "4"}, sizes={"k": 4, "i": 5}
    ),
}


# Known gaps in the implementation, reported with their numbers; strict, so a fix shows up
# as an unexpected pass and the mark goes.
GAPS: dict[str, str] = {}  # sibling -> why it is not supported yet (a strict xfail)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=GAPS[n])) if n in GAPS else n
        for n in sorted(SIBLINGS)
    ],
)
def test_sibling(name, tmp_path):
    case = replace(SIBLINGS[name], fd_directions=3)
    check(case, generate(case, tmp_path, prefix="Sibling"))


def test_conv3d_against_tensorflow(tmp_path):
    """Three spatial axes: the dense reference would need 9-d broadcasts, beyond TF's
    limit, so this one is compared with `tf.nn.conv3d` and its autodiff directly."""
    case = Case(
        "y[b,i,j,l,o] = sum(x[b, i+u, j+v, l+t, c] * w[u,v,t,c,o], u, v, t, c)",
        {"x": (2, 11, 13, 15, 3), "w": (4, 5, 6, 3, 7)},
    )
    module = generate(case, tmp_path, prefix="Conv3d")
    rng = np.random.default_rng(0)
    named = {n: tf.constant(rng.uniform(-1, 1, case.shapes[n])) for n in module.INPUTS}
    tensors = [named[n] for n in module.INPUTS]
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        want = tf.nn.conv3d(named["x"], named["w"], [1] * 5, "VALID")
    assert want.shape == (2, 8, 9, 10, 7)
    grad = tf.constant(rng.standard_normal(want.shape))
    expected = tape.gradient(want, tensors, output_gradients=grad)
    np.testing.assert_allclose(module.forward(*tensors).numpy(), want.numpy(), rtol=1e-10)
    for g, e in zip(module.vjp(*tensors, grad), expected, strict=True):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-10, atol=1e-10)


CONV = "y[b,i,q] = sum(x[b, s*i + u + 4, c] * w[u,c,q], u, c)"  # the convolution pattern


@pytest.mark.parametrize(
    ("formula", "stride"),
    [
        (CONV, 0),
        (CONV, -1),
        (CONV, 2),
        *[("y[b,i] = max(x[b, s*i + u + 4, c] * w[u,c], u, c)", s) for s in (0, -1, 2)],
    ],
)
def test_int_attr_stride_of_any_sign_with_explicit_range(formula, stride, tmp_path):
    """With `ranges` given, `s*i + u + 4` is well defined for s = 0 (every i reads the
    same window) and s < 0 (windows run backwards into the padding). The generated module
    computes it, or refuses at call time with an error that names the attr, never a
    kernel's internal message."""
    shapes = {"x": (2, 9, 3), "w": (4, 3, 5) if "q" in formula else (4, 3)}
    case = Case(
        formula,
        shapes,
        attrs={"s": stride},
        ranges={"i": "6"},
        sizes={"i": 6},
        finite_differences=False,
    )
    module = generate(case, tmp_path, prefix="Stride")
    try:
        check(case, module)
    except (ValueError, tf.errors.InvalidArgumentError) as error:
        assert re.search(r"\bs\b", str(error).splitlines()[0]), str(error)[:300]


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]


def test_a_range_below_zero_at_call_time_is_empty_or_named(tmp_path):
    """`ranges = { i = "x.shape[1] - 8" }` on a length-6 input: an empty output (like the
    default ranges, which are at least 0) or an error that names the index, not a
    kernel's internal message."""
    case = Case("y[b,i] = x[b, i - 1]", {"x": (2, 6)}, ranges={"i": "x.shape[1] - 8"})
    module = generate(case, tmp_path, prefix="Below")
    try:
        y = module.forward(tf.ones((2, 6), tf.float64))
    except (ValueError, tf.errors.InvalidArgumentError) as error:
        assert re.search(r"'i'|\bi\b", _first_line(error)), _first_line(error)
    else:
        assert y.shape == (2, 0)


def test_a_default_range_with_a_zero_stride_attr_is_named(tmp_path):
    """With s = 0 no largest in-bounds range exists (every i reads the same window): the
    call fails with an error that names the attr."""
    case = Case("y[b,i] = sum(x[b, s*i + k] * w[k], k)", {"x": (2, 9), "w": (4,)}, {"s": 2})
    module = generate(case, tmp_path, prefix="ZeroStride")
    x, w = tf.ones((2, 9), tf.float64), tf.ones((4,), tf.float64)
    assert module.forward(x, w, s=2).shape == (2, 3)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)) as info:
        module.forward(x, w, s=0)
    assert re.search(r"'s'|\bs\b", _first_line(info.value)), _first_line(info.value)

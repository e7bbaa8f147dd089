"""Every formula in the corpus: generated forward and gradients vs TF autodiff and finite
differences, in float64 (see harness.check)."""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

from harness import Case, check, generate

B, I, J, K = 2, 3, 4, 5

CORPUS = {
    # -- the core language (issue 2) ---------------------------------------------------
    "batched_matmul": Case("y[b,i,j] = A[b,i,k] * B[b,k,j]", {"A": (B, I, K), "B": (B, K, J)}),
    "kron": Case("y[b,(i,k),(j,l)] = A[b,i,j] * B[b,k,l]", {"A": (B, 2, 3), "B": (B, 3, 2)}),
    "sin_diag_outer": Case("y[b,i,j] = sin(A[b,i,i]) * B[b,j,j]", {"A": (B, I, I), "B": (B, J, J)}),
    "exp_of_sum": Case(
        "y[b,i,j] = exp(sum(A[b,i,k] * B[b,k,j], k))", {"A": (B, I, K), "B": (B, K, J)}
    ),
    "explicit_sum": Case("y[b,i] = sum(A[b,i,k] * A[b,i,k], k)", {"A": (B, I, K)}),
    "broadcast_weight": Case("y[b,i,j] = A[b,i,k] * W[k,j]", {"A": (B, I, K), "W": (K, J)}),
    "bias_no_batch": Case("y[b,i] = x[b,i] + c[i]", {"x": (B, I), "c": (I,)}),
    "same_input_twice": Case("y[b,i,j] = A[b,i,k] * A[b,j,k]", {"A": (B, I, K)}),
    "transpose_use": Case("y[b,i,j] = A[b,j,i] + A[b,i,j]", {"A": (B, I, I)}),
    "quotient": Case("y[b,i] = A[b,i] / (1 + B[b,i] * B[b,i])", {"A": (B, I), "B": (B, I)}),
    "power_const": Case("y[b,i] = A[b,i] ** 3 - 2 * A[b,i] ** 2", {"A": (B, I)}),
    "sqrt_log": Case("y[b,i] = sqrt(A[b,i]) * log(A[b,i])", {"A": (B, I)}, low=0.5, high=2.0),
    "tanh_sigmoid": Case(
        "y[b,i,j] = tanh(A[b,i,k]) * sigmoid(B[b,k,j])", {"A": (B, I, K), "B": (B, K, J)}
    ),
    "trace": Case("y[b] = A[b,i,i]", {"A": (B, I, I)}),
    "diagonal_part": Case("y[b,i] = A[b,i,i]", {"A": (B, I, I)}),
    "diag_times": Case("y[b,i] = A[b,i,i] * x[b,i]", {"A": (B, I, I), "x": (B, I)}),
    "three_factor_chain": Case(
        "y[b,i,l] = A[b,i,j] * B[b,j,k] * C[b,k,l]",
        {"A": (B, I, J), "B": (B, J, K), "C": (B, K, 2)},
    ),
    "outer_higher_rank": Case(
        "y[b,i,j,k] = x[b,i] * z[b,j] * w[b,k]", {"x": (B, I), "z": (B, J), "w": (B, K)}
    ),
    "scalar_per_batch": Case("y[b] = A[b,i,j] * B[b,j,i]", {"A": (B, I, J), "B": (B, J, I)}),
    "constant_term": Case("y[b,i] = A[b,i,k] + 1", {"A": (B, I, K)}),
    "sum_of_sums": Case("y[b] = sum(A[b,k], k) * sum(B[b,k], k)", {"A": (B, I), "B": (B, J)}),
    "nested_sum_in_fn": Case(
        "y[b,i] = cos(sum(A[b,i,k] * sum(B[b,k,l], l), k))", {"A": (B, I, K), "B": (B, K, J)}
    ),
    "division_by_sum": Case(
        "y[b,i] = A[b,i] / sum(A[b,k] * A[b,k], k)", {"A": (B, I)}, low=0.5, high=1.5
    ),
    # -- the complete language (issue 3) -------------------------------------------------
    "all_unary": Case(
        "y[b,i] = exp(A[b,i]) + log(P[b,i]) + sin(A[b,i]) + cos(A[b,i]) + tan(A[b,i])"
        " + tanh(A[b,i]) + sinh(A[b,i]) + cosh(A[b,i]) + sqrt(P[b,i]) + abs(A[b,i])"
        " + sigmoid(A[b,i]) + softplus(A[b,i]) + erf(A[b,i])",
        {"A": (B, I), "P": (B, I)},
        low=0.3,
        high=1.2,
    ),
    "abs_negative": Case("y[b,i] = abs(A[b,i]) * A[b,i]", {"A": (B, I)}),
    "max_min": Case(
        "y[b,i] = max(A[b,i], B[b,i]) + min(A[b,i], 0.25 * B[b,i])", {"A": (B, I), "B": (B, I)}
    ),
    "tensor_power": Case(
        "y[b,i] = A[b,i] ** C[b,i]", {"A": (B, I), "C": (B, I)}, low=0.5, high=2.0
    ),
    "pi_e": Case("y[b,i] = pi * A[b,i] + e ** A[b,i]", {"A": (B, I)}),
    "mean": Case("y[b,i] = A[b,i] - mean(A[b,k], k)", {"A": (B, I)}),
    "mean_two_indices": Case("y[b] = mean(A[b,i,j] ** 2, i, j)", {"A": (B, I, J)}),
    "layer_norm": Case(
        "y[b,i] = (x[b,i] - mean(x[b,k], k)) / sqrt(mean((x[b,k] - mean(x[b,l], l))**2, k) + eps)",
        {"x": (B, K)},
        attrs={"eps": 1e-3},
    ),
    "logsumexp": Case("y[b,i] = log(sum(exp(A[b,i,k]), k))", {"A": (B, I, K)}),
    "softmax": Case("y[b,i,j] = exp(A[b,i,j]) / sum(exp(A[b,i,m]), m)", {"A": (B, I, J)}),
    "attention_softmax": Case(
        "y[b,i,j] = exp(sum(Q[b,i,d]*K[b,j,d], d)) / sum(exp(sum(Q[b,i,d]*K[b,m,d], d)), m)",
        {"Q": (B, I, K), "K": (B, J, K)},
    ),
    "mean_of_exp": Case("y[b,i] = log(mean(exp(A[b,i,k]), k))", {"A": (B, I, K)}),
    "pairwise_sq_dist": Case("y[b,i,j] = sum((x[b,i,k] - x[b,j,k])**2, k)", {"x": (B, I, K)}),
    "attrs_all_kinds": Case(
        "y[b,i] = alpha * A[b,i] ** n + flag * B[b,i]",
        {"A": (B, I), "B": (B, I)},
        attrs={"alpha": 0.5, "n": 3, "flag": True},
    ),
    "scaled_add": Case(
        "y[b,i,j] = alpha * A[b,i,j] + B[b,i,j]",
        {"A": (B, I, J), "B": (B, I, J)},
        attrs={"alpha": 2.5},
    ),
    "two_outputs": Case(
        ("y[b,i,j] = A[b,i,k] * B[b,k,j]", "z[b,i] = A[b,i,k] * A[b,i,k]"),
        {"A": (B, I, K), "B": (B, K, J)},
    ),
    "two_outputs_shared": Case(
        ("y[b,i] = exp(sum(A[b,i,k], k))", "z[b,i] = log(sum(exp(A[b,i,k]), k))"), {"A": (B, I, K)}
    ),
    "no_gradient_mask": Case(
        "y[b,i,j] = A[b,i,j] * M[b,i,j]", {"A": (B, I, J), "M": (B, I, J)}, no_gradient=("M",)
    ),
    "declared_input_order": Case(
        "y[b,i,j] = A[b,i,k] * B[b,k,j]", {"A": (B, I, K), "B": (B, K, J)}, inputs=("B", "A")
    ),
    "output_more_axes": Case("y[b,i,j,k] = A[b,i,j] * v[b,k]", {"A": (B, I, J), "v": (B, K)}),
    "gradient_on_diagonal_nonlinear": Case(
        "y[b,i] = exp(A[b,i,i]) * x[b,i]", {"A": (B, I, I), "x": (B, I)}
    ),
    "gram_tanh": Case("y[b,i,j] = tanh(A[b,i,k]) * tanh(A[b,j,k])", {"A": (B, I, K)}),
    "sum_inside_sum_inside_fn": Case("y[b] = log(sum(exp(sum(A[b,i,k], k)), i))", {"A": (B, I, K)}),
    # -- formulas a new user might try ------------------------------------------------------
    "no_batch": Case("y[i] = x[i] * x[i] + x[i]", {"x": (I,)}),
    "double_sum": Case("y[b,i] = sum(sum(A[b,i,j,k], j), k)", {"A": (B, I, J, K)}),
    "outer_same_input": Case("y[b,i,j] = A[b,i] * A[b,j]", {"A": (B, I)}),
    "deep_chain": Case(
        "y[b] = log(sum(exp(tanh(sum(A[b,i,k] * w[k], k))), i))", {"A": (B, I, K), "w": (K,)}
    ),
    "diag_in_second": Case("y[b,i,j] = A[b,i] * B[b,j,j]", {"A": (B, I), "B": (B, J, J)}),
    "triple_diagonal": Case("y[b,i] = A[b,i,i,i]", {"A": (B, I, I, I)}),
    "cosine_normalized": Case(
        "y[b,i] = sum(A[b,i,k] * x[b,k], k) / sqrt(sum(x[b,k]**2, k))",
        {"A": (B, I, K), "x": (B, K)},
    ),
    "kron_three": Case(
        "y[b,(i,j,k)] = a[b,i] * c[b,j] * d[b,k]", {"a": (B, 2), "c": (B, 3), "d": (B, 2)}
    ),
    "mean_squared": Case("y[b,i] = mean(A[b,i,k], k) ** 2", {"A": (B, I, K)}),
    "composite_transposed": Case("y[b,(j,i)] = A[b,i,j]", {"A": (B, I, J)}),
    "relu_sum": Case("y[b,i] = max(A[b,i,k], 0)", {"A": (B, I, K)}),
    "swish": Case("y[b,i] = x[b,i] * sigmoid(x[b,i])", {"x": (B, I)}),
    "sum_inside_and_outside": Case(
        "y[b,i] = exp(sum(A[b,i,k], k)) * sum(C[b,i,k], k)", {"A": (B, I, K), "C": (B, I, K)}
    ),
    "attr_inside_lse": Case(
        "y[b,i] = log(sum(exp(alpha * A[b,i,k]), k)) / alpha",
        {"A": (B, I, K)},
        attrs={"alpha": 1.5},
    ),
    "fractional_power": Case(
        "y[b,i] = A[b,i] ** 0.5 + A[b,i] ** -1.5", {"A": (B, I)}, low=0.5, high=2.0
    ),
    "sub_then_sum": Case("y[b,i] = A[b,i,k] - B[b,k]", {"A": (B, I, K), "B": (B, K)}),
    "minus_sum_in_exp": Case(
        "y[b,i,j] = exp(-sum(A[b,i,k] * B[b,j,k], k))", {"A": (B, I, K), "B": (B, J, K)}
    ),
    "weighted_gram": Case("y[b,i,j] = A[b,i,k] * W[k,l] * A[b,j,l]", {"A": (B, I, K), "W": (K, K)}),
    "intermediate_twice": Case(
        "y[b,i] = sin(sum(A[b,i,k], k)) * cos(sum(A[b,i,l], l))", {"A": (B, I, K)}
    ),
    "batch_only_weight": Case("y[b,i] = s[b] * x[b,i]", {"s": (B,), "x": (B, I)}),
    "composite_output_reused": Case(
        "y[b,(i,j)] = exp(A[b,i,j] * x[b,i])", {"A": (B, I, J), "x": (B, I)}
    ),
    "bool_attr_mask": Case(
        "y[b,i] = A[b,i] * (1 - flag) + flag * A[b,i] ** 2", {"A": (B, I)}, attrs={"flag": False}
    ),
    # -- found in review: each once generated wrong code or nan ---------------------------
    "relu_gate": Case("y[b,i] = A[b,i] * max(B[b,i], 0)", {"A": (B, I), "B": (B, I)}),
    "unused_summed_index_size": Case(
        "y[b] = exp(sum(sum(B[b,m], m) + A[b,k], k)) + exp(sum(sum(B[b,m], m) + C[b,j], j))",
        {"A": (B, 3), "B": (B, 4), "C": (B, 5)},
        low=-0.3,
        high=0.3,
    ),
    "unused_summed_index_in_log": Case(
        "y[b] = log(sum(sum(exp(B[b,m]), m) + A[b,k], k))", {"A": (B, 3), "B": (B, 4)}
    ),
    "names_like_module_locals": Case(
        "y[b,i] = A[b,i] * outputs[b,i] * tensors + saved[b,i]",
        {"A": (B, I), "outputs": (B, I), "saved": (B, I)},
        attrs={"tensors": 0.5},
    ),
    "chain_plus_other_free_index": Case(
        "y[b,i] = A[b,j] * B[b,j,k] * C[b,k] + D[b,i]",
        {"A": (B, J), "B": (B, J, K), "C": (B, K), "D": (B, I)},
    ),
    "summed_name_is_other_output_index": Case(
        ("y[b,i] = A[b,i,k]", "z[b,k] = C[b,k]"), {"A": (B, I, K), "C": (B, J)}
    ),
    "attr_power_of_pairwise": Case(
        "y[b,i,j] = sum((x[b,i,k] - x[b,j,k])**n, k)", {"x": (B, I, K)}, attrs={"n": 2}
    ),
    "tiny_exponent": Case("y[b,i] = A[b,i] ** 0.001", {"A": (B, I)}, low=0.5, high=1.5),
    "constant_output": Case("y[b,i] = A[b,i] - A[b,i] + 2", {"A": (B, I)}),
    "constant_names_as_indices": Case(
        "y[b,i,e] = A[b,i,e] * e ** sum(W[e,pi], pi)", {"A": (B, I, J), "W": (J, K)}
    ),
    "cancelling_sum": Case(
        "y[b,i] = A[b,i] * sum(B[b,k] / B[b,k], k)", {"A": (B, I), "B": (B, K)}, low=0.5, high=1.5
    ),
    # -- sums of exponentials in log space (issue: never silently wrong, item 3) ---------
    "log_one_plus_sum_exp": Case("y[b] = log(sum(exp(A[b,k]), k) + 1)", {"A": (B, K)}),
    "softmax_with_extra_one": Case(
        "y[b,i] = exp(A[b,i]) / (1 + sum(exp(A[b,k]), k))", {"A": (B, K)}
    ),
    "reciprocal_of_sum_exp": Case("y[b] = 1 / sum(exp(A[b,k]), k)", {"A": (B, K)}),
    "softplus_written_out": Case("y[b] = log(1 + exp(A[b,k]))", {"A": (B, K)}),
    "sigmoid_written_out_nested": Case("y[b,i] = tanh(1 / (1 + exp(A[b,i])))", {"A": (B, I)}),
    "log_of_constants_and_mean_exp": Case(
        "y[b] = log(2 + 3 * mean(exp(A[b,k]), k))", {"A": (B, K)}
    ),
    # -- centered expansions of squared distances (item 4) --------------------------------
    "cross_sq_dist": Case(
        "y[b,i,j] = sum((x[b,i,k] - z[b,j,k])**2, k)", {"x": (B, I, K), "z": (B, J, K)}
    ),
    "rbf_kernel": Case(
        "y[b,i,j] = exp(-sum((x[b,i,k] - z[b,k,j])**2, k) / 2)",
        {"x": (B, I, K), "z": (B, K, J)},
        low=2.0,
        high=3.0,
    ),
    "sq_dist_times_weight": Case(
        "y[b,i,j] = sum((x[b,i,k] - x[b,j,k])**2 * w[k], k)", {"x": (B, I, K), "w": (K,)}
    ),
    # -- sums over every index inside a function: rank-0 intermediates (item 11) ---------
    "divide_by_total": Case("y[b,i] = A[b,i] / sum(w[k], k)", {"A": (B, I), "w": (K,)}, low=0.5),
    "unbatched_log_softmax": Case("y[i] = x[i] - log(sum(exp(x[k]), k))", {"x": (K,)}),
    "exp_of_total": Case("y[b] = A[b] * exp(sum(w[k], k))", {"A": (B,), "w": (K,)}),
    "total_over_batch_too": Case(
        "y[b,i] = A[b,i] * tanh(sum(A[c,k] * w[k], c, k))", {"A": (B, K), "w": (K,)}
    ),
    "two_totals": Case(
        "y[b] = sin(sum(w[k], k)) * A[b] + cos(sum(w[j] * w[j], j))", {"A": (B,), "w": (K,)}
    ),
    # -- nested nonlinearities, one intermediate per level (item 12) ---------------------
    "tanh_chain": Case(
        "y[b,i] = tanh(tanh(tanh(A[b,i]) * B1[b,i]) * B2[b,i]) * B3[b,i]",
        {"A": (B, I), "B1": (B, I), "B2": (B, I), "B3": (B, I)},
    ),
    "max_chain": Case(
        "y[b,i] = max(min(max(A[b,i], B1[b,i]), B2[b,i]), 0.5 * B3[b,i])",
        {"A": (B, I), "B1": (B, I), "B2": (B, I), "B3": (B, I)},
    ),
    "nested_in_a_sum": Case(
        "y[b,i] = sum(sin(cos(A[b,i,k]) * W[k,i]), k)", {"A": (B, I, K), "W": (K, I)}
    ),
    "nested_over_a_total": Case("y[b] = A[b] * exp(tanh(sum(w[k], k)))", {"A": (B,), "w": (K,)}),
    "nested_broadcast": Case(
        "y[b,i,j] = sigmoid(tanh(A[b,i]) * C[b,j])", {"A": (B, I), "C": (B, J)}
    ),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("numeric")


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus(name, folder):
    case = CORPUS[name]
    module = generate(case, folder)
    check(case, module)


ZEROS = {
    "relu_gate": "y[b,i] = A[b,i] * max(B[b,i], 0)",
    "tanh_gate": "y[b,i] = A[b,i] * tanh(B[b,i])",
    "sin_gate": "y[b,i] = A[b,i] * sin(B[b,i])",
    "square_gate": "y[b,i] = A[b,i] * B[b,i] * B[b,i]",
    "attr_power": "y[b,i] = max(A[b,i], 0) ** n + B[b,i]",
}


@pytest.mark.parametrize("name", sorted(ZEROS))
def test_no_nan_where_tensorflow_has_none(name, folder):
    """Reading the op's output back must never divide by something that can be zero."""
    import numpy as np

    case = Case(
        ZEROS[name], {"A": (B, I), "B": (B, I)}, attrs={"n": 2} if "** n" in ZEROS[name] else {}
    )
    module = generate(case, folder)
    A = tf.constant([[0.0, -1.0, 2.0], [0.5, 0.0, -0.5]], tf.float64)
    Bv = tf.constant([[0.0, 0.0, 1.0], [-2.0, 0.0, 0.3]], tf.float64)
    grads = module.vjp(A, Bv, tf.ones([2, 3], tf.float64), **case.attrs)
    assert all(np.isfinite(g.numpy()).all() for g in grads), grads

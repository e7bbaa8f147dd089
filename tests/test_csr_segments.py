"""Segments given by CSR offsets, `indptr[s] <= n < indptr[s + 1]` (PyTorch Geometric's
and torch_scatter's `segment_csr`): the max's level took the chunk's start, an int attr
read inside indptr's brackets, for an index of its own, and the op failed to generate
with an internal KeyError `_int_tile_start` (so did any int attr there). Exact in every
target, untiled and in chunks, against the reference (TF autodiff, float64): offsets
drawn at random, so segments are empty (offsets decreasing) or overlap, and the rows
past src's end read zero."""

from __future__ import annotations

import numpy as np
import pytest
from harness import Case
from target_harness import check_in_every_target, generate_for


def _case(formula, **extra):
    return Case(
        formula,
        {"src": (9, 3)},
        index_inputs={"indptr": ((6,), 0, 11)},
        ranges={"s": "indptr.shape[0] - 1"},
        sizes={"s": 5},
        low=-2.0,
        high=2.0,
        **extra,
    )


CASES = {
    # an empty segment's max is -inf, where finite differences are nan: checked against
    # TF autodiff of the reference alone
    "max": _case(
        "y[s,f] = max(where(indptr[s] <= n < indptr[s+1], src[n,f], -inf), n)",
        finite_differences=False,
    ),
    "min": _case(
        "y[s,f] = min(where(indptr[s] <= n < indptr[s+1], src[n,f], inf), n)",
        finite_differences=False,
    ),
    "sum": _case("y[s,f] = sum(where(indptr[s] <= n < indptr[s+1], src[n,f], 0), n)"),
    # an int attr in the offsets' brackets, as the chunk's start is
    "max_shifted": Case(
        "y[s,f] = max(where(indptr[s + o] <= n < indptr[s + o + 1], src[n,f], -inf), n)",
        {"src": (9, 3)},
        attrs={"o": 1},
        attr_types={"o": "int"},
        index_inputs={"indptr": ((7,), 0, 11)},
        ranges={"s": "indptr.shape[0] - 2"},
        sizes={"s": 5},
        finite_differences=False,
    ),
}


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_target_is_exact(name, target, budget, tmp_path):
    check_in_every_target(CASES[name], target, tmp_path, "Csr", budget)


# ------------------------------------------- against loops over the rows, with ties


def _loops(kind, indptr, src, grad):
    """Each segment s covers rows indptr[s] .. indptr[s+1] - 1: an empty one is -inf
    (+inf for min) with no gradient, and ties split the gradient equally."""
    segments = len(indptr) - 1
    y = np.full((segments, src.shape[1]), -np.inf if kind == "max" else np.inf)
    dx = np.zeros_like(src)
    for s in range(segments):
        rows = src[indptr[s] : indptr[s + 1]]
        if not len(rows):
            continue
        y[s] = rows.max(0) if kind == "max" else rows.min(0)
        hits = rows == y[s]
        dx[indptr[s] : indptr[s + 1]] += hits * grad[s] / hits.sum(0)
    return y, dx


def _tf_step(module, indptr, src, grad):
    import tensorflow as tf

    x = tf.constant(src)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = module.forward(tf.constant(indptr), x)
    return y.numpy(), tape.gradient(y, x, output_gradients=tf.constant(grad)).numpy()


def _torch_step(module, indptr, src, grad):
    import torch

    leaf = torch.tensor(src, requires_grad=True)
    y = module.forward(torch.tensor(indptr), leaf)
    (dx,) = torch.autograd.grad(y, leaf, torch.tensor(grad))
    return y.detach().numpy(), dx.numpy()


def _jax_step(module, indptr, src, grad):
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    y, pullback = jax.vjp(lambda u: module.forward(jnp.asarray(indptr), u), jnp.asarray(src))
    (dx,) = pullback(jnp.asarray(grad))
    return np.asarray(y), np.asarray(dx)


STEPS = {"tensorflow": _tf_step, "pytorch": _torch_step, "jax": _jax_step}


@pytest.mark.parametrize("budget", [None, 64])
@pytest.mark.parametrize("target", sorted(STEPS))
@pytest.mark.parametrize("kind", ["max", "min"])
def test_extrema_match_loops_with_ties_and_empty_segments(kind, target, budget, tmp_path):
    """11 rows, 3 features, 6 segments (1 and 3 empty), values in {0, 1, 2}: ties in most
    segments, through each framework's own backward."""
    pytest.importorskip({"pytorch": "torch", "jax": "jax"}.get(target, "tensorflow"))
    rng = np.random.default_rng(3)
    indptr = np.array([0, 3, 3, 7, 7, 10, 11], dtype=np.int64)
    src = rng.integers(0, 3, size=(11, 3)).astype(np.float64)
    grad = rng.standard_normal((6, 3))
    want_y, want_dx = _loops(kind, indptr, src, grad)
    assert np.isinf(want_y[[1, 3]]).all()
    assert 0 < np.abs(want_dx).min(initial=1, where=want_dx != 0) < np.abs(grad).max()
    module = generate_for(CASES[kind], target, tmp_path, "CsrLoops", budget)
    y, dx = STEPS[target](module, indptr, src, grad)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-12, atol=1e-12)


# A segment softmax over the offsets, its log-sum-exp an internal tensor: the gradient
# read indptr[s] whole, all S + 1 offsets for S segments, and failed in a broadcast in
# every target (found by an adversarial trial). Against a loop written with masks that
# keep an empty segment's gradient 0 (TF autodiff of the formula as written gives nan
# there: exp(a - Z) at Z = -inf in the branch the mask drops).
SOFTMAX = Case(
    (
        "Z[s] = log(sum(where(indptr[s] <= n < indptr[s + 1], exp(a[n]), 0), n))",
        "y[s,f] = sum(where(indptr[s] <= n < indptr[s + 1], exp(a[n] - Z[s]) * h[n,f], 0), n)",
    ),
    {"a": (8,), "h": (8, 3)},
    index_inputs={"indptr": ((5,), 0, 9)},
    ranges={"s": "indptr.shape[0] - 1"},
    outputs=("y",),
)


def _softmax_truth(a, h, indptr, grad):
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)

    def op(a, h):
        n = jnp.arange(a.shape[0])
        keep = (indptr[:-1, None] <= n[None]) & (n[None] < indptr[1:, None])
        z = jax.nn.logsumexp(jnp.where(keep, a[None], -jnp.inf), 1)
        z = jnp.where(jnp.isfinite(z), z, 0)[:, None]
        return jnp.where(keep, jnp.exp(jnp.where(keep, a[None] - z, 0.0)), 0.0) @ h

    y, pullback = jax.vjp(op, jnp.asarray(a), jnp.asarray(h))
    return np.asarray(y), [np.asarray(g) for g in pullback(jnp.asarray(grad))]


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_a_segment_softmax_over_offsets(target, budget, tmp_path):
    from target_harness import converters

    module = generate_for(SOFTMAX, target, tmp_path, "CsrSoftmax", budget)
    tensor, numpy = converters(target)
    rng = np.random.default_rng(29)
    a, h = rng.standard_normal(8) * 2, rng.standard_normal((8, 3))
    for offsets in ([0, 3, 3, 7, 8], [0, 2, 5, 4, 8], [1, 4, 6]):
        indptr = np.array(offsets)
        grad = rng.standard_normal((len(offsets) - 1, 3))
        want_y, want_grads = _softmax_truth(a, h, indptr, grad)
        named = {"a": tensor(a), "h": tensor(h), "indptr": tensor(indptr)}
        args = [named[n] for n in module.INPUTS]
        np.testing.assert_allclose(numpy(module.forward(*args)), want_y, rtol=1e-10, atol=1e-12)
        grads = dict(zip(module.INPUTS, module.vjp(*args, tensor(grad)), strict=True))
        for name, want in zip(("a", "h"), want_grads, strict=True):
            np.testing.assert_allclose(numpy(grads[name]), want, rtol=1e-10, atol=1e-12)


# A range of rows past x's (n = x.shape[0] + 1) over an x with no rows: under
# tf.function with every size unknown, the gradient of x, a row gather's slices, kept
# row 0 of a table without rows, and TF's densifying sum refused it ("segment_ids[0] = 0
# is out of range [0, 0)"; found by a random-formula trial). Eager and known shapes were
# right: those know the table is empty while tracing.
ROWS_PAST_X = Case(
    "y[s,f] = sum(where(indptr[s] <= n < indptr[s + 1], x[n,f] * g[f], 0), n)",
    {"x": (3, 2), "g": (2,)},
    index_inputs={"indptr": ((3,), 0, 4)},
    ranges={"s": "indptr.shape[0] - 1", "n": "x.shape[0] + 1"},
    sizes={"s": 2, "n": 4},
)


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("rows", [0, 3])
def test_rows_past_an_empty_x_under_unknown_sizes(rows, budget, tmp_path):
    import tensorflow as tf
    from target_harness import check_graphs_equal_eager

    module = generate_for(ROWS_PAST_X, "tensorflow", tmp_path, "CsrRowsPast", budget)
    rng = np.random.default_rng(5)
    x, g = tf.constant(rng.standard_normal((rows, 2))), tf.constant(rng.standard_normal(2))
    for offsets in ([0, 1, 1], [0, -1, 0], [0, 2, 4]):
        named = {"indptr": tf.constant(offsets, tf.int64), "x": x, "g": g}
        args = [named[n] for n in module.INPUTS]
        check_graphs_equal_eager(module, args)
        grads = module.vjp(*args, tf.ones([2, 2], tf.float64))
        if rows == 0:
            assert all(v is None or not np.any(v.numpy()) for v in grads)

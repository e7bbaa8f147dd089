"""Sums under a mask of indices, the indices the mask does not read summed inside it first
(`symgrad/lower/masked_sums.py`).

`sum(where(s <= l, q[n,h,l,e] * k[n,h,s,e] * v[n,h,s,m], 0), s, e)` is `Σ_s where(s <= l,
Σ_e q k v, 0)`: exact in IEEE arithmetic, inf and nan under the mask included, since the
mask does not read e. The references are TF float64 autodiff of the formula written with
`tf.where` at its full [n,h,l,s,e,m] size, its factors masked too: a masked term adds 0
and has no gradient. Sizes differ on every index (l = 6 queries, s
= 8 keys), every target, whole and in chunks.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from harness import Case, FakeOp, check, generate

jax.config.update("jax_enable_x64", True)  # float64, as the reference

ARRAY = {"tensorflow": tf.constant, "pytorch": torch.tensor, "jax": jnp.asarray}
SHAPES = {"q": (2, 3, 6, 4), "k": (2, 3, 8, 4), "v": (2, 3, 8, 5)}
CAUSAL_PRODUCT = Case(
    "y[n,h,l,m] = sum(where(s <= l, q[n,h,l,e] * k[n,h,s,e] * v[n,h,s,m], 0), s, e)",
    SHAPES,
)
# a factor outside the mask stays outside it (x[l] * where(..) is nan by the formula
# where x is inf), and what it reads is summed after the mask
OUTSIDE = Case(
    "y[b,l] = sum(x[b,l] * where(s < l, w[b,s,e] * u[b,s,e], 0), s, e)",
    {"x": (2, 5), "w": (2, 7, 3), "u": (2, 7, 3)},
)
# a band |s - l| <= 1 (two comparisons), the value's own index e summed inside
BAND = Case(
    "y[b,l,m] = sum(where(l - 1 <= s and s <= l + 1, a[b,l,e] * c[b,s,e] * d[b,s,m], 0), s, e)",
    {"a": (2, 6, 3), "c": (2, 5, 3), "d": (2, 5, 4)},
)


def _numpy(t):
    return None if t is None else np.asarray(t.numpy() if hasattr(t, "numpy") else t)


def _where_form(q, k, v):
    """The formula at its full size in TF, each factor masked too ("double where"): masked
    terms are exactly 0 and have no gradient. (With the product alone masked, TF's
    gradient of q multiplies a masked 0 by k * v, nan where k is inf.)"""
    keep = tf.range(SHAPES["k"][2])[None, :] <= tf.range(SHAPES["q"][2])[:, None]  # [l,s]
    shape = (2, 3, SHAPES["q"][2], SHAPES["k"][2], SHAPES["q"][3], SHAPES["v"][3])
    wide = tf.broadcast_to(keep[None, None, :, :, None, None], shape)

    def masked(x):
        return tf.where(wide, tf.broadcast_to(x, shape), tf.zeros(shape, x.dtype))

    terms = masked(q[:, :, :, None, :, None])
    terms *= masked(k[:, :, None, :, :, None]) * masked(v[:, :, None, :, None, :])
    return tf.reduce_sum(tf.where(wide, terms, tf.zeros_like(terms)), axis=[3, 4])


def _reference(q, k, v, cotangent):
    q, k, v = (tf.constant(a) for a in (q, k, v))
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        y = _where_form(q, k, v)
    grads = tape.gradient(y, [q, k, v], output_gradients=tf.constant(cotangent))
    return [y.numpy(), *(g.numpy() for g in grads)]


def _run(module, target, arrays, cotangent):
    arrays = [ARRAY[target](a) for a in arrays]
    results = [module.forward(*arrays), *module.vjp(*arrays, ARRAY[target](cotangent))]
    if target == "tensorflow":  # the registered gradient, from the op's outputs
        fake = FakeOp(arrays, [results[0]], {}, module)
        results += module.gradient(fake, tf.constant(cotangent))
    return [_numpy(t) for t in results]


def _same(got, want, what):
    """Finite where the reference is, and equal there; not finite where it is not (an inf
    or a nan, as the order of a sum over kept terms holding infs decides, in any einsum:
    inf * (q . k) where the reference sums inf * q_e * k_e of both signs)."""
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"not finite at {what}")
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-10, atol=1e-10, err_msg=what)


def _inputs(seed=3):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPES[n]) for n in "qkv"], rng.standard_normal((2, 3, 6, 5))


def _compare(module, target, arrays, cotangent, expected):
    for budget in (2**40, 1):
        module.MAX_TEMP_BYTES = budget
        got = _run(module, target, arrays, cotangent)
        names = ("y", *"qkv", *"qkv")[: len(got)]
        for position, (value, name) in enumerate(zip(got, names, strict=True)):
            want = expected[position if position < 4 else position - 3]
            _same(value, want, f"{name} ({'vjp' if position < 4 else 'gradient'}), {budget}")


@pytest.mark.parametrize("case", [CAUSAL_PRODUCT, OUTSIDE, BAND], ids=["causal", "outside", "band"])
def test_sums_under_a_mask_of_indices_equal_tf_autodiff_and_finite_differences(case, tmp_path):
    """The harness's check (float64): forward against the reference evaluator, every
    gradient against TF autodiff and finite differences."""
    check(case, generate(case, tmp_path, prefix="MaskedSum"))


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_inf_and_nan_keys_and_values_under_the_mask_add_nothing(target, tmp_path):
    """k[0,1,5,2] = inf (read by query 5 alone), v[1,0,4,3] = nan (queries 4 and 5),
    v[0,2,7,0] = -inf (a key of no query: 8 keys, 6 queries). The outputs and gradients
    are the where form's (finite at the same positions, and equal there), whole and in
    chunks; the queries before them are finite."""
    module = generate(CAUSAL_PRODUCT, tmp_path, prefix="MaskedNonFinite", target=target)
    (q, k, v), cotangent = _inputs()
    k[0, 1, 5, 2] = np.inf
    v[1, 0, 4, 3], v[0, 2, 7, 0] = np.nan, -np.inf
    expected = _reference(q, k, v, cotangent)
    assert np.isnan(expected[0]).any() and np.isinf(expected[0]).any()
    assert np.isfinite(expected[0][:, :, :4]).all() and np.isfinite(expected[0][0, 2]).all()
    _compare(module, target, (q, k, v), cotangent, expected)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_an_inf_incoming_gradient_adds_nothing_under_the_mask(target, tmp_path):
    """grad_y[0,1,2,3] = inf at query 2: as TensorFlow's gradient of a `where`, keys s > 2
    get nothing from it (the masked branch has no gradient), so grad_k and grad_v are
    finite there; they were nan (grad_y times a masked 0) before the incoming gradient
    moved inside the mask."""
    module = generate(CAUSAL_PRODUCT, tmp_path, prefix="MaskedInfGrad", target=target)
    (q, k, v), cotangent = _inputs(seed=4)
    cotangent[0, 1, 2, 3] = np.inf
    expected = _reference(q, k, v, cotangent)
    assert not np.isfinite(expected[2][0, 1, :3]).all()
    assert np.isfinite(expected[2][0, 1, 3:]).all() and np.isfinite(expected[3][0, 1, 3:]).all()
    _compare(module, target, (q, k, v), cotangent, expected)

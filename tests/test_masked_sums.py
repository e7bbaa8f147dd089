"""Sums under a mask of indices, the indices the mask does not read summed inside it first
(`symgrad/lower/masked_sums.py`).

`sum(where(s <= l, q[n,h,l,e] * k[n,h,s,e] * v[n,h,s,m], 0), s, e)` is `Σ_s where(s <= l,
Σ_e q k v, 0)`: exact in IEEE arithmetic, inf and nan under the mask included, since the
mask does not read e. The references are TF float64 autodiff of the formula written with
`tf.where` at its full [n,h,l,s,e,m] size, its factors masked too: a masked term adds 0
and has no gradient. Sizes differ on every index (l = 6 queries, s = 8 keys), every
target, whole and in chunks, vjp, the registered gradient and each framework's own
backward through forward.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from frameworks import FRAMEWORKS
from harness import Case, FakeOp, check, generate

jax.config.update("jax_enable_x64", True)  # float64, as the reference

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


def _run(module, target, arrays, cotangent) -> dict:
    """{how: [y, grad_q, grad_k, grad_v]}: forward and vjp; the registered gradient (TF,
    from the op's outputs); and the framework's own backward through forward (a TF tape,
    PyTorch autograd, jax.vjp under jax.jit)."""
    fw = FRAMEWORKS[target]
    args = [fw.tensor(a) for a in arrays]
    grad = fw.tensor(cotangent)
    y = module.forward(*args)
    found = {"vjp": [y, *module.vjp(*args, grad)]}
    if target == "tensorflow":
        found["registered gradient"] = [y, *module.gradient(FakeOp(args, [y], {}, module), grad)]
        with tf.GradientTape() as tape:
            tape.watch(args)
            y = module.forward(*args)
        found["tape over forward"] = [y, *tape.gradient(y, args, output_gradients=grad)]
    elif target == "pytorch":
        leaves = [a.clone().requires_grad_(True) for a in args]
        y = module.forward(*leaves)
        found["autograd through forward"] = [y, *torch.autograd.grad(y, leaves, grad)]
    else:
        y, pullback = jax.vjp(jax.jit(module.forward), *args)
        found["jax.vjp under jax.jit"] = [y, *pullback(grad)]
    return {how: [fw.numpy(t) for t in values] for how, values in found.items()}


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
        for how, got in _run(module, target, arrays, cotangent).items():
            for value, want, name in zip(got, expected, ("y", *"qkv"), strict=True):
                _same(value, want, f"{name} ({how}), budget {budget}")


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
    chunks, on every path; the queries before them are finite."""
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

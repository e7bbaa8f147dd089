"""A max's (min's) gradient goes to the entries equal to it: `[value == max]`. The test
must compare the value as the max was computed from it. A polynomial factor of the same
term (`2*x - 2*z`, the derivative of `(x - z)**2`) is expanded into monomials for the
contraction (`lower/contract.py`), and the expansion reached inside the tie test too:
`x**2 - 2*x*z + z**2 == min` almost never holds for the min of `(x - z)**2`, and every
gradient was 0 (all targets, untiled and in chunks)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from frameworks import FRAMEWORKS
from harness import Case, generate


def _nearest(x, z):
    """y[i] = min_j (x[i] - z[j])**2 and its arg-min j (random values: no ties)."""
    d = (x[:, None] - z[None, :]) ** 2
    j = d.argmin(1)
    return d.min(1), j


@pytest.mark.parametrize("budget", [2**40, 1], ids=["whole", "chunks"])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_the_min_of_a_square_sends_its_gradient_to_the_arg_min(target, budget, tmp_path):
    fw = FRAMEWORKS[target]
    if target == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
    case = Case("y[i] = min((x[i] - z[j])**2, j)", {"x": (5,), "z": (7,)}, inputs=("x", "z"))
    module = generate(case, tmp_path, prefix="NearestSquare", target=target)
    rng = np.random.default_rng(96)
    x, z, g = rng.standard_normal(5), rng.standard_normal(7), rng.standard_normal(5)
    y, j = _nearest(x, z)
    want_x = 2 * g * (x - z[j])
    want_z = np.zeros(7)
    np.add.at(want_z, j, -2 * g * (x - z[j]))
    module.MAX_TEMP_BYTES = budget
    args = [fw.tensor(a) for a in (x, z)]
    np.testing.assert_allclose(fw.numpy(module.forward(*args)), y, rtol=1e-12)
    got_x, got_z = (fw.numpy(t) for t in module.vjp(*args, fw.tensor(g)))
    np.testing.assert_allclose(got_x, want_x, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got_z, want_z, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "formula",
    ["y[i,l] = max((C[j,l] + P[i,l])**2, j)", "y[i,l] = max(log(1 + (C[j,l] + P[i,l])**2), j)"],
)
def test_the_max_of_a_polynomial_of_two_point_sets_is_exact(formula, tmp_path):
    """Other spellings of the same trap (a square of a sum of two point sets inside a
    max), against TF autodiff and finite differences."""
    from harness import check

    case = Case(formula, {"C": (7, 3), "P": (5, 3)}, inputs=("C", "P"))
    check(case, generate(case, tmp_path, prefix="PolyMax"))


def _min_of_products(B, D, u, gy):
    """y[i,k] = exp(tanh(min_j D[i,j] B[k,j] u[i-1]) / 2) (u[-1] reads 0: row 0 ties
    over every j) and the gradient of u, ties split equally, in NumPy."""
    g = np.concatenate([[0.0], u[:-1]])
    v = D[:, None, :] * B[None, :, :] * g[:, None, None]  # [i,k,j]
    m = v.min(2)
    y = np.exp(0.5 * np.tanh(m))
    tie = v == m[..., None]
    dm = gy * y * 0.5 * (1 - np.tanh(m) ** 2)
    dg = (dm[..., None] * tie / tie.sum(2, keepdims=True) * D[:, None, :] * B[None]).sum((1, 2))
    return y, np.concatenate([dg[1:], [0.0]])


@pytest.mark.parametrize("budget", [2**40, 1], ids=["whole", "chunks"])
def test_ties_of_a_min_of_three_factors_hold_under_tf_function(budget, tmp_path):
    """The min reduced `D[i,j] * B[k,j] * u[i-1]` over [i,k,j] and its ties compared the
    same product computed again over [k,j,i]: inside a graph (the user's tf.function, or
    the chunk loop), TF's arithmetic optimizer multiplied the two in different orders (the
    smaller operands first), 1 ulp apart, and no entry tied: nan in the gradient. The
    ties now compare the tensor the min reduced (`Pointwise.reduced_value`)."""
    import tensorflow as tf

    case = Case(
        "y[i,k] = exp(0.5 * (tanh(min(D[i, j] * B[k, j] * u[i - 1], j))))",
        {"B": (3, 7), "D": (5, 7), "u": (5,)},
        inputs=("B", "D", "u"),
    )
    module = generate(case, tmp_path, prefix="MinOfProducts")
    rng = np.random.default_rng(1163)
    B, D, u, gy = (
        rng.standard_normal((3, 7)),
        rng.standard_normal((5, 7)),
        *(rng.standard_normal(s) for s in (5, (5, 3))),
    )
    y, want_u = _min_of_products(B, D, u, gy)
    module.MAX_TEMP_BYTES = budget
    args = [tf.constant(a) for a in (B, D, u, gy)]
    for vjp in (module.vjp, tf.function(module.vjp)):
        got_u = vjp(*args)[2].numpy()
        np.testing.assert_allclose(got_u, want_u, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(module.forward(*args[:3]).numpy(), y, rtol=1e-12)


def _masked_max_of_products(A, B, P, gy):
    """y[j,k,i] = max_l where(k != l, A[i,k] B[k,j] P[i,l], 0) and its gradients, ties
    split equally, in NumPy."""
    K, L = A.shape[1], P.shape[1]
    keep = (np.arange(K)[:, None] != np.arange(L)[None, :])[None, :, None, :]
    v = np.where(keep, A[:, :, None, None] * B[None, :, :, None] * P[:, None, None, :], 0.0)
    m = v.max(3)
    tie = v == m[..., None]
    w = gy.transpose(2, 1, 0)[..., None] * tie / tie.sum(3, keepdims=True) * keep
    return (
        m.transpose(2, 1, 0),
        np.einsum("ikjl,kj,il->ik", w, B, P),
        np.einsum("ikjl,ik,il->kj", w, A, P),
        np.einsum("ikjl,ik,kj->il", w, A, B),
    )


@pytest.mark.parametrize("budget", [2**40, 1], ids=["whole", "chunks"])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_ties_of_a_masked_max_of_products_hold_in_chunks(target, budget, tmp_path):
    """A chunk's forward and gradient are one graph in TF's loop, and the gradient's
    copy of the product came out 1 ulp off the forward's: no entry tied, and the
    gradients were wrong by units (every seed, eagerly and under tf.function). The
    gradient now takes the max and its ties again from its own copy (`lower/ties.py`).
    Row i = 2 is all zeros: every l ties."""
    fw = FRAMEWORKS[target]
    if target == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
    case = Case(
        "y[j,k,i] = max(where(k != l, A[i,k]*B[k,j]*P[i,l], 0), l)",
        {"A": (7, 3), "B": (3, 5), "P": (7, 4)},
        inputs=("A", "B", "P"),
    )
    module = generate(case, tmp_path, prefix="MaskedMaxOfProducts", target=target)
    module.MAX_TEMP_BYTES = budget
    for seed in range(3):
        rng = np.random.default_rng(seed)
        A, B, P = (rng.standard_normal(s) for s in ((7, 3), (3, 5), (7, 4)))
        P[2] = 0.0
        gy = rng.standard_normal((5, 3, 7))
        y, *want = _masked_max_of_products(A, B, P, gy)
        args = [fw.tensor(a) for a in (A, B, P)]
        vjps = [module.vjp]
        if target == "tensorflow":
            import tensorflow as tf

            vjps.append(tf.function(module.vjp))
        for vjp in vjps:
            got = [fw.numpy(t) for t in vjp(*args, fw.tensor(gy))]
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(fw.numpy(module.forward(*args)), y, rtol=1e-12)


JIT_CASES = {
    # Chamfer at one coordinate: XLA contracts x² + z² - 2xz into FMAs in some fusions
    "nearest": (
        "y[b,i] = min(sum((x[b,i,c] - z[b,j,c])**2, c), j)",
        {"x": (1, 2, 1), "z": (1, 2, 1)},
        (),
    ),
    "masked_farthest": (
        "y[b,i] = max(where(m[b,j] > 0, sum((x[b,i,c] - z[b,j,c])**2, c), -inf), j)",
        {"x": (2, 3, 1), "z": (2, 4, 1), "m": (2, 4)},
        ("m",),
    ),
    "nearest_3d": (
        "y[b,i] = min(sum((x[b,i,c] - z[b,j,c])**2, c), j)",
        {"x": (2, 5, 3), "z": (2, 4, 3)},
        (),
    ),
}


@pytest.mark.parametrize("budget", [2**40, 1], ids=["whole", "chunks"])
@pytest.mark.parametrize("name", sorted(JIT_CASES))
def test_jit_sends_each_rows_gradient_to_its_extremum(name, budget, tmp_path):
    """Under `jax.jit`, XLA computes a max's operand again in every fusion that reads it,
    and with FMA a product-sum need not round alike in two of them: the entry that made
    the extremum failed its own test, and the row's gradient was lost (found by an
    adversarial trial: grad_z off by up to 1.2 in 7 of 40 draws of the Chamfer term).
    Over 40 draws, the jitted vjp and `jax.grad` of the forward equal the module run
    eagerly, and the eager gradient goes to the arg-extremum."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    formula, shapes, masks = JIT_CASES[name]
    case = Case(formula, shapes, inputs=tuple(shapes), no_gradient=masks)
    module = generate(
        case, tmp_path, prefix="JitTies" + name.title().replace("_", ""), target="jax"
    )
    module.MAX_TEMP_BYTES = budget
    vjp = jax.jit(module.vjp)

    def loss(x, z, rest, g):
        return jnp.sum(module.forward(x, z, *rest) * g)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for seed in range(40):
        rng = np.random.default_rng(seed)
        args = [jnp.asarray(rng.standard_normal(s)) for s in shapes.values()]
        y = module.forward(*args)
        g = jnp.asarray(rng.standard_normal(y.shape))
        eager = module.vjp(*args, g)
        for got in (vjp(*args, g)[:2], grad(*args[:2], tuple(args[2:]), g)):
            for a, b in zip(got, eager[:2], strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)
        if not masks:  # eagerly, each row's gradient goes to its arg-min (no ties)
            x, z, gg = (np.asarray(t) for t in (*args, g))
            d = ((x[:, :, None] - z[:, None]) ** 2).sum(-1)
            near = np.take_along_axis(z, d.argmin(-1)[..., None], axis=1)
            np.testing.assert_allclose(np.asarray(eager[0]), 2 * gg[..., None] * (x - near))

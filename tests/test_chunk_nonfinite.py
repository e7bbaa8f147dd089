"""A non-finite value in chunks takes the untiled module's branch: a nan term of a max
over every index but the batch (chunks of b) gives the gradients the untiled module and
TF autodiff give (nan in that batch: no term equals a nan max, 0 ties, a zero mask times
g over 0), in TF, PyTorch and JAX. JAX's chunks run under lax.scan, compiled, where XLA
rewrites a mask times a value as a select of the value: the gradient was written
`mask * (g / ties)`, which gave 0 there (and under jax.jit untiled too); it is now
`mask * g / ties`, 0 / 0 in every target."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("torch")
pytest.importorskip("jax")

from adversarial import TINY
from harness import Case, generate
from test_tiling_adversarial_8 import BIG, _run

MAX = Case("y[b] = max(A[b,i,k] * B[b,j,k], i, j, k)", {"A": (2, 3, 7), "B": (2, 4, 7)})


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_a_nan_term_of_a_max_gives_the_untiled_gradient_in_chunks(target, tmp_path):
    module = generate(MAX, tmp_path, prefix="NanMax", target=target)
    rng = np.random.default_rng(0)
    named = {n: rng.standard_normal(s) for n, s in MAX.shapes.items()}
    named["A"][0, 1, 2] = np.nan
    cotangent = np.ones(2)
    untiled = _run(module, target, named, cotangent, {}, np.float64, BIG)
    assert np.isnan(untiled[0][0]) and np.isnan(untiled[1][0]).all()
    chunks = _run(module, target, named, cotangent, {}, np.float64, TINY)
    for got, want in zip(chunks, untiled, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_nan_term_of_a_max_keeps_its_nan_gradient_under_jit(tmp_path):
    """Under jax.jit, untiled and in chunks, the module's gradient of a max with a nan term
    is what JAX's own gradient of jnp.max gives run eagerly (and TF autodiff): nan in that
    batch, the other batch's equal. (JAX's own under jit gives 0 there: its max's gradient
    is also a mask times a value, which XLA makes a select.)"""
    import jax
    import jax.numpy as jnp

    module = generate(MAX, tmp_path, prefix="NanMaxJit", target="jax")
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(MAX.shapes[n]) for n in ("A", "B"))
    a[1, 2, 5] = np.nan
    jax.config.update("jax_enable_x64", True)  # as every JAX test (frameworks.py)
    args = (jnp.asarray(a), jnp.asarray(b), jnp.ones(2))

    def own(a, b, g):
        _, pullback = jax.vjp(
            lambda a, b: jnp.max(a[:, :, None, :] * b[:, None, :, :], axis=(1, 2, 3)), a, b
        )
        return pullback(g)

    want = [np.asarray(w) for w in own(*args)]
    assert np.isnan(want[0][1]).all() and not np.isnan(want[0][0]).any()
    for budget in (BIG, TINY):
        module.MAX_TEMP_BYTES = budget
        got = jax.jit(module.vjp)(*args)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-12, atol=1e-12)

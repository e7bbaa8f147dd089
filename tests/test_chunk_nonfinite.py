"""A non-finite value in chunks takes the untiled module's branch: a nan term of a max
over every index but the batch (chunks of b) gives the gradients the untiled module and
TF autodiff give (nan in that batch: no term equals a nan max, 0 ties, g / 0 times a
zero mask), in TF and PyTorch. JAX's chunks run under lax.scan, compiled, where XLA
rewrites the zero mask times g / 0 as a select and gives 0: the same module gives 0
under jax.jit untiled too. Pinned as a known failure until the tie count is written so
XLA keeps the nan."""

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


@pytest.mark.parametrize(
    "target",
    [
        "tensorflow",
        "pytorch",
        pytest.param(
            "jax",
            marks=pytest.mark.xfail(
                strict=True, reason="XLA folds the zero mask times g / 0 to 0 in compiled chunks"
            ),
        ),
    ],
)
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

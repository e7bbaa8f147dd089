"""Windows read one axis at a time (symgrad/lower/separable.py) are the windows: strided,
dilated reads past the borders, and an output laid out in another order than the
source's axes, equal TF float64 autodiff of the reference evaluator and finite
differences (harness.check), and PyTorch and JAX equal TF on every path (forward, vjp,
autograd, jax.vjp and jit)."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("torch")
pytest.importorskip("jax")

from frameworks import FRAMEWORKS, run_everywhere
from harness import Case, check, generate, op_spec

from symgrad.pipeline import module_text

CASES = {
    # stride 2, dilation 2, padding 1 along rows (reads at -1 and 5 of 5); stride 3,
    # padding 2 along columns (reads at -2 and -1)
    "strided": Case(
        "y[b,c,p,q] = sum(x[b,c,2*p+2*u-1, 3*q+v-2] * w[u,v], u, v)",
        {"x": (1, 2, 5, 7), "w": (2, 3)},
        ranges={"p": "3", "q": "3"},
        sizes={"p": 3, "q": 3},
    ),
    # the output's window axes swapped against the source's (q before p)
    "swapped": Case(
        "y[b,c,q,p] = sum(x[b,c,p+u-1, q+v] * w[u,v], u, v)",
        {"x": (1, 2, 4, 5), "w": (3, 2)},
        ranges={"p": "x.shape[2]", "q": "x.shape[3]"},
        sizes={"p": 4, "q": 5},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_windows_read_one_axis_at_a_time_equal_tf_autodiff(name, tmp_path):
    case = CASES[name]
    text = module_text(op_spec(case, "Separable"), "test.toml")
    assert "_gather(_gather(x, " in text  # rows read first, then columns
    check(case, generate(case, tmp_path, prefix="Separable"))


@pytest.mark.parametrize("target", ["pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_windows_read_one_axis_at_a_time_equal_tf_in_every_target(name, target, tmp_path):
    case = CASES[name]
    want = run_everywhere(FRAMEWORKS["tensorflow"], generate(case, tmp_path, "SepTf"), case)
    got = run_everywhere(FRAMEWORKS[target], generate(case, tmp_path, "SepOther", target), case)
    for g, w in zip(got[0]["forward"], want[0]["forward"], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    for how, grads in got[1].items():
        for g, w in zip(grads, want[1]["vjp"], strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=how)

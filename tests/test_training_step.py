"""A training step through every op of every corpus, in every target: forward, a loss,
its gradient by the framework's own machinery through the generated module (TF: a tape
over tf.Variables; PyTorch: `loss.backward()` on inputs that require grad; JAX:
`jax.value_and_grad`), an SGD update, and the loss after it, each against the same step
over the independent reference evaluator with TF autodiff (float64).

What a user does first, and what found that every padded convolution crashed PyTorch's
`save_for_backward` while the corpus checks (vjp, autograd on plain tensors) passed.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from frameworks import FRAMEWORKS, reference_train_step, train_step
from harness import Case, load_module, op_spec
from test_indexing import KNOWN
from test_indexing_siblings import SIBLINGS
from test_numeric import CORPUS

from symgrad.pipeline import module_text

PROPERTY = {  # the fixed formulas of test_property.py (the rest are drawn at random)
    "rank_six_broadcast_inside_max": Case(
        "y[b,i,j] = max(B[b,j,k], T[b,i,j,r] * W[j,p])",
        {"B": (2, 4, 5), "T": (2, 3, 4, 6), "W": (4, 7)},
    ),
    "rank_six_broadcast_in_a_sum_of_terms": Case(
        "y[b,i,j] = min(B[b,j,k], T[b,i,j,r] * W[j,p]) + min(T[b,i,j,r], B[b,j,k] * W[j,p])",
        {"B": (2, 4, 5), "T": (2, 3, 4, 6), "W": (4, 7)},
    ),
    "padded_convolution": Case(
        "y[b,i,o] = sum(x[b, i + k - p, c] * w[k,c,o], k, c)",
        {"x": (2, 6, 3), "w": (3, 3, 4)},
        attrs={"p": 1},
        sizes={"i": 5},
    ),
}
CASES = {
    **{f"numeric_{n}": c for n, c in CORPUS.items()},
    **{f"indexing_{n}": k.case for n, k in KNOWN.items()},
    **{f"siblings_{n}": c for n, c in SIBLINGS.items()},
    **{f"property_{n}": c for n, c in PROPERTY.items()},
}


@pytest.fixture(scope="module")
def references():
    """The reference step of each case, computed once for the three targets."""
    return {}


@pytest.fixture(scope="module")
def compiled():
    """`module_text`'s `compiled`: each case's op compiled once for the three targets (the
    stages before render know no target), as `symgrad generate` does."""
    return {}


def _module(name: str, target: str, folder, compiled):
    """The case's module for `target`; the op's name is the case's, the same in each
    target."""
    op = op_spec(CASES[name], f"TrainStep{sorted(CASES).index(name)}")
    text = module_text(op, "test.toml", target, compiled)
    return load_module(text, folder, f"symgrad_{target}_{op.name.lower()}")


@pytest.mark.parametrize("target", sorted(FRAMEWORKS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_training_step(name, target, tmp_path, references, compiled):
    case = replace(CASES[name], finite_differences=False)
    module = _module(name, target, tmp_path, compiled)
    if name not in references:
        references[name] = reference_train_step(case, module.INPUTS)
    want = references[name]
    got = train_step(FRAMEWORKS[target], module, case)
    tolerance = {"rtol": max(case.rtol, 1e-9), "atol": 1e-9}
    np.testing.assert_allclose(got["loss"], want["loss"], **tolerance, err_msg="loss")
    assert len(got["grads"]) == len(want["grads"])
    for k, (g, w) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        np.testing.assert_allclose(g, w, **tolerance, err_msg=f"gradient {k}")
    np.testing.assert_allclose(got["after"], want["after"], **tolerance, err_msg="after")

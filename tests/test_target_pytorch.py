"""The PyTorch target: every formula of the corpora against the TF reference (forward,
vjp, torch autograd through `forward` and through the generated ops), in float64, and
against the TF module of the same formula."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("tensorflow")

from harness import Case, generate, make_tensors
from target_harness import Framework, check_target, generate_for
from test_indexing import KNOWN
from test_numeric import CORPUS

CASES = {**CORPUS, **{f"indexing_{name}": known.case for name, known in KNOWN.items()}}
ROOT = Path(__file__).resolve().parent.parent


def _autodiff(f, inputs, wrt, grads):
    """torch's own vector-Jacobian product of f(*inputs) with `grads`."""
    xs = [x.detach().clone().requires_grad_(k in wrt) for k, x in enumerate(inputs)]
    outs = f(*xs)
    pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
    if not pairs:  # no output depends on an input (`y = A - A + 2`)
        return [torch.zeros_like(xs[k]) for k in wrt]
    found = torch.autograd.grad(
        [o for o, _ in pairs],
        [xs[k] for k in wrt],
        grad_outputs=[g for _, g in pairs],
        allow_unused=True,
    )
    return [torch.zeros_like(xs[k]) if g is None else g for k, g in zip(wrt, found, strict=True)]


TORCH = Framework(
    target="pytorch",
    tensor=lambda a: torch.from_numpy(np.array(a)),
    numpy=lambda t: t.detach().numpy(),
    autodiff=_autodiff,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("torch_modules")


def _inputs(case: Case, module, seed: int = 0, requires_grad: bool = False) -> list:
    """Random float64 inputs (int index tensors) in the module's input order."""
    tensors = make_tensors(case, module.INPUTS, seed)
    out = [torch.from_numpy(t.numpy()) for t in tensors]
    if requires_grad:
        out = [t.requires_grad_() if t.is_floating_point() else t for t in out]
    return out


# -- every formula ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_corpus(name, folder):
    case = CASES[name]
    module = generate_for(case, "pytorch", folder)
    check_target(case, module, TORCH)


CROSS = [
    "attrs_all_kinds",
    "deep_chain",
    "two_outputs",
    "indexing_conv2d_same",
    "indexing_conv1d_same_stride2",
    "indexing_cumsum_reverse_exclusive",
    "indexing_embedding_plus_position",
    "indexing_gather_out_of_range",
    "indexing_pointnet_weighted",
    "indexing_max_pool_2x3",
]


@pytest.mark.parametrize("name", CROSS)
def test_same_numbers_as_the_tensorflow_module(name, folder):
    """The PyTorch and TF modules of one formula on the same inputs: forward and vjp."""
    case = CASES[name]
    torch_module = generate_for(case, "pytorch", folder)
    tf_module = generate(case, folder, prefix="CrossTf")
    tf_inputs = make_tensors(case, torch_module.INPUTS, seed=3)
    torch_inputs = [torch.from_numpy(t.numpy()) for t in tf_inputs]
    tf_out = tf_module.forward(*tf_inputs, **case.attrs)
    torch_out = torch_module.forward(*torch_inputs, **case.attrs)
    tf_out = tf_out if isinstance(tf_out, tuple) else (tf_out,)
    torch_out = torch_out if isinstance(torch_out, tuple) else (torch_out,)
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal(tuple(o.shape)) for o in torch_out]
    for t, w in zip(torch_out, tf_out, strict=True):
        np.testing.assert_allclose(t.detach().numpy(), w.numpy(), rtol=1e-12, atol=1e-12)
    got = torch_module.vjp(*torch_inputs, *map(torch.from_numpy, grads), **case.attrs)
    want = tf_module.vjp(*tf_inputs, *map(tf.constant, grads), **case.attrs)
    for input_name, g, w in zip(torch_module.INPUTS, got, want, strict=True):
        if w is None:
            assert g is None, input_name
            continue
        np.testing.assert_allclose(
            g.numpy(), tf.convert_to_tensor(w).numpy(), rtol=1e-12, atol=1e-12, err_msg=input_name
        )

"""Indices and infinities as values, internal tensors and `let` (issue 17, items 6, 7, 2):
each construct exact in float64 against the independent reference (and TF autodiff on it)
in TensorFlow, PyTorch and JAX; refusals with a caret; real ops written with them checked
against NumPy loop transcriptions of their kernels."""

from __future__ import annotations

import numpy as np
import pytest
from harness import Case, check, generate
from target_harness import Framework, check_target

from symgrad.errors import SymgradError
from symgrad.model import build

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp


def _torch_autodiff(f, inputs, wrt, grads):
    leaves = [inputs[k].detach().clone().requires_grad_(True) for k in wrt]
    args = list(inputs)
    for k, leaf in zip(wrt, leaves, strict=True):
        args[k] = leaf
    outs = f(*args)
    return list(torch.autograd.grad(outs, leaves, grads, allow_unused=True))


def _jax_autodiff(f, inputs, wrt, grads):
    def of_wrt(*xs):
        args = list(inputs)
        for k, x in zip(wrt, xs, strict=True):
            args[k] = x
        return f(*args)

    _, pullback = jax.vjp(of_wrt, *(inputs[k] for k in wrt))
    return list(pullback(tuple(grads)))


FRAMEWORKS = {
    "pytorch": Framework(
        "pytorch",
        tensor=torch.from_numpy,
        numpy=lambda t: t.detach().numpy(),
        autodiff=_torch_autodiff,
    ),
    "jax": Framework("jax", tensor=jnp.asarray, numpy=np.asarray, autodiff=_jax_autodiff),
}

# Every construct, with a different size for every index.
CASES = {
    # item 6: an index outside brackets is its value, in the inputs' float dtype
    "index_value_decay": Case(
        "y[b,t] = sum(where(i < t, exp((t - 1 - i) * w[b] + k[b,i]), 0), i)",
        {"w": (3,), "k": (3, 5)},
        ranges={"t": "k.shape[1]"},
        sizes={"t": 5},
    ),
    "index_value_times_a_tensor": Case(
        "y[b,i] = x[b,i] * i + sum(j * x[b,j], j) / 3", {"x": (2, 4)}
    ),
    "e_and_pi_stay_constants_beside_an_index_e": Case("y[b,e] = x[b,e] * e + pi", {"x": (3, 4)}),
    "minus_inf_in_a_segment_max": Case(
        "y[v,f] = max(where(seg[n] == v, x[n,f], -inf), n)",
        {"x": (9, 2)},
        index_inputs={"seg": ((9,), 0, 3)},
        ranges={"v": "3"},
        sizes={"v": 3},
    ),
    "plus_inf_in_a_segment_min": Case(
        "y[v,f] = min(where(seg[n] != v, inf, x[n,f]), n)",
        {"x": (9, 2)},
        index_inputs={"seg": ((9,), 0, 3)},
        ranges={"v": "3"},
        sizes={"v": 3},
    ),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("values_and_internals")


@pytest.mark.parametrize("name", sorted(CASES))
def test_tensorflow(name, folder):
    case = CASES[name]
    check(case, generate(case, folder, "Values"))


@pytest.mark.parametrize("target", sorted(FRAMEWORKS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_other_targets(name, target, folder):
    case = CASES[name]
    check_target(case, generate(case, folder, "Values", target), FRAMEWORKS[target])


def _refused(formula, attrs=(), **spec) -> SymgradError:
    from symgrad.spec import OpSpec

    op = OpSpec(
        "Refused",
        (formula,) if isinstance(formula, str) else tuple(formula),
        None,
        tuple(attrs),
        (),
        "test [ops.Refused]",
        **spec,
    )
    with pytest.raises(SymgradError) as info:
        build(op)
    return info.value


def _caret_at(error: SymgradError, text: str) -> None:
    rendered = str(error)
    formula_line, caret_line = rendered.splitlines()[-2:]
    assert caret_line.strip() == "^", rendered
    column = caret_line.index("^") - (len(formula_line) - len(formula_line.lstrip()))
    assert formula_line.strip()[column:].startswith(text), rendered


def test_inf_outside_a_branch_of_where_is_refused_with_a_caret():
    error = _refused("y[b,i] = x[b,i] + inf")
    assert "only allowed as a whole branch of where" in str(error)
    _caret_at(error, "inf")
    _caret_at(_refused("y[b,i] = where(x[b,i] > 0, x[b,i], 2 * -inf)"), "inf")


def test_an_index_value_no_tensor_sizes_is_refused_with_a_caret():
    error = _refused("y[b] = sum(x[b,k], k) + k")
    assert "no tensor in it reads it" in str(error)
    _caret_at(error, "k")


def test_a_name_that_is_no_index_stays_an_unknown_name():
    error = _refused("y[b,i] = x[b,i] * j")
    assert "unknown name 'j'" in str(error)
    _caret_at(error, "j")

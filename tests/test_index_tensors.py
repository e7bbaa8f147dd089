"""Index tensors anywhere in brackets and index clamps (issue 17, items 4 and 5): each
construct exact in float64 against the independent reference (and TF autodiff on it) in
TensorFlow, PyTorch and JAX, index tensors with values outside their axes (those reads
are zero), refusals with a caret, and real ops against NumPy loop transcriptions of their
kernels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from harness import Case, check, generate
from target_harness import check_target
from test_values_and_internals import FRAMEWORKS

jax = pytest.importorskip("jax")

# Every construct, with a different size for every index; index values run past both
# ends of the axes they index (reads there are zero).
CASES = {
    "lookup_at_a_constant": Case(
        "y[b,n,c] = x[b, idx[b,n,0], c]",
        {"x": (2, 5, 3)},
        index_inputs={"idx": ((2, 4, 6), -1, 6)},
    ),
    "lookup_shifted_in_a_condition": Case(
        "y[s,f] = sum(where(lo[s] <= n < lo[s + 1], x[n,f], 0), n)",
        {"x": (9, 2)},
        index_inputs={"lo": ((5,), -1, 11)},
        ranges={"s": "lo.shape[0] - 1"},
        sizes={"s": 4},
    ),
    "nested_lookup": Case(
        "y[p,c] = sum(w[p,v] * a[t[d[p] - 1, v], c], v)",
        {"w": (5, 3), "a": (6, 2)},
        index_inputs={"t": ((4, 3), -1, 7), "d": ((5,), 0, 6)},
    ),
    "data_dependent_stride": Case(
        "y[b,i,j,h] = sum(q[b,i,h,m] * k[b, i + D[h] * (j - w), h, m], m)",
        {"q": (2, 7, 3, 4), "k": (2, 7, 3, 4)},
        index_inputs={"D": ((3,), 1, 4)},
        attrs={"w": 1},
        ranges={"j": "2*w + 1"},
        sizes={"j": 3},
    ),
    "clamped_window_start": Case(
        "y[b,i,k] = sum(q[b,i,d] * kk[b, max(min(i - ns, L - K), 0) + k, d], d)",
        {"q": (2, 7, 4), "kk": (2, 7, 4)},
        attrs={"ns": 1, "K": 3},
        lets={"L": "q.shape[1]"},
        let_values={"L": 7},
        ranges={"k": "K"},
        sizes={"k": 3},
    ),
    "clamp_in_a_condition": Case(
        "y[b,i] = sum(where(max(i - 2, 0) <= j, x[b,j], 0), j)",
        {"x": (3, 6)},
        ranges={"i": "x.shape[1]"},
        sizes={"i": 6},
    ),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("index_tensors")


@pytest.mark.parametrize("name", sorted(CASES))
def test_index_tensors_and_clamps_in_tensorflow(name, folder):
    case = CASES[name]
    check(case, generate(case, folder, "Lookup"))


def _jitted(module):
    static = module.ATTRS
    return SimpleNamespace(
        OP_NAME=module.OP_NAME,
        forward=jax.jit(module.forward, static_argnames=static),
        vjp=jax.jit(module.vjp, static_argnames=static),
        _compute=jax.jit(module._compute, static_argnames=static),
    )


@pytest.mark.parametrize("target", sorted(FRAMEWORKS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_index_tensors_and_clamps_in_pytorch_and_jax(name, target, folder):
    case = CASES[name]
    module = generate(case, folder, "Lookup", target)
    check_target(case, _jitted(module) if target == "jax" else module, FRAMEWORKS[target])

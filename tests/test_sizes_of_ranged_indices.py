"""A spec's typical `sizes` (they only choose the contraction order) may name any index a
formula uses. An index sized by `ranges` rather than by a plain input axis (a segment
sum's `v`, a convolution's `i`) was refused as one "which no formula uses": the check
looked only at plainly read indices, so the internal segment sum
`h[n,f] = g[n,f] * x[n,f]`, `y[v,f] = sum(where(seg[n] == v, h[n,f], 0), n)` was refused
with a range for `v` and a typical size for it, while without the range the message asked
for one. The modules that generate now are exact in every target, untiled and in chunks."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from harness import Case, check, load_module, op_spec
from target_harness import check_target, frameworks

from symgrad.errors import SymgradError
from symgrad.model import build
from symgrad.pipeline import module_text

_counter = itertools.count()

SEGMENT_SUM = Case(
    ("h[n,f] = g[n,f] * x[n,f]", "y[v,f] = sum(where(seg[n] == v, h[n,f], 0), n)"),
    {"g": (7, 3), "x": (7, 3)},
    attrs={"V": 5},
    inputs=("g", "x", "seg"),
    outputs=("y",),
    # ids past either end: rows no segment takes
    index_inputs={"seg": ((7,), -1, 6)},
    ranges={"v": "V"},
    sizes={"v": 5},
)
CONV = Case(
    "y[i] = sum(x[i+u-1] * w[u], u)",
    {"x": (8,), "w": (3,)},
    ranges={"i": "x.shape[0]"},
    sizes={"i": 8},
)
CASES = {
    "segment_sum": (SEGMENT_SUM, {"v": 4, "n": 100, "f": 3}),
    "conv": (CONV, {"i": 100, "u": 3}),
}


def _module(name, target, folder, budget):
    case, sizes = CASES[name]
    op = f"Sized{next(_counter)}"
    spec = replace(op_spec(case, op), sizes=tuple(sizes.items()))
    text = module_text(spec, "test.toml", target)
    module = load_module(text, folder, f"symgrad_sized_{target}_{op.lower()}")
    if budget is not None:
        module.MAX_TEMP_BYTES = budget
    return module


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("name", sorted(CASES))
def test_tensorflow_is_exact(name, budget, tmp_path):
    check(CASES[name][0], _module(name, "tensorflow", tmp_path, budget))


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_pytorch_and_jax_are_exact(name, target, budget, tmp_path):
    module = _module(name, target, tmp_path, budget)
    check_target(CASES[name][0], module, frameworks()[target])


def test_without_the_range_the_message_asks_for_it():
    spec = replace(op_spec(SEGMENT_SUM, "Sized"), ranges=(), attrs=(), sizes=(("v", 4),))
    with pytest.raises(SymgradError, match="output index 'v' has no range"):
        build(spec)


def test_an_index_no_formula_uses_is_still_refused():
    spec = replace(op_spec(SEGMENT_SUM, "Sized"), sizes=(("q", 4),))
    with pytest.raises(SymgradError, match="`sizes` names index 'q', which no formula uses"):
        build(spec)

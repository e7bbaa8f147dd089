"""An internal tensor's axis whose size no input axis gives plainly, but a read infers
(k of `W[(h,k), c]`, W of [H*K, C]), summed in a later equation: fairseq's dynamicconv
weights, a linear layer's output split per head and softmaxed over the kernel,

    wl[t,h,k] = sum(x[t,c] * W[(h,k), c], c)
    Z[t,h] = sum(exp(wl[t,h,k]), k)
    ws[t,h,k] = exp(wl[t,h,k]) / Z[t,h]

The sum over k in Z was refused ("sum() over 'k', which no tensor in it uses"), and the
softmax written in one equation (`sum(exp(wl[t,h,m]), m)`) was refused with a suggestion
(read the axis with k) that was refused in turn (found by an adversarial trial). Now the
sum takes the axis's inferred size, and the refusal suggests the equation of its own."""

from __future__ import annotations

import pytest
from harness import Case
from target_harness import check_in_every_target
from test_recurrences import op_spec

from symgrad.errors import SymgradError
from symgrad.pipeline import module_text

SOFTMAX = Case(
    (
        "wl[t,h,k] = sum(x[t,c] * W[(h,k), c], c)",
        "Z[t,h] = sum(exp(wl[t,h,k]), k)",
        "ws[t,h,k] = exp(wl[t,h,k]) / Z[t,h]",
    ),
    {"x": (5, 2), "W": (12, 2)},  # H = 3 heads of K = 4 taps, 2 channels, 5 positions
    attrs={"H": 3},
    attr_types={"H": "int"},
    ranges={"h": "H"},
    sizes={"h": 3, "k": 4},
    outputs=("ws",),
)


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_a_sum_over_an_inferred_internal_axis_is_exact(target, budget, tmp_path):
    check_in_every_target(SOFTMAX, target, tmp_path, "DynWeights", budget)


def test_the_softmax_in_one_equation_suggests_an_equation_of_its_own():
    op = op_spec(
        "Dyn",
        (
            "wl[t,h,k] = sum(x[t,c] * W[(h,k), c], c)",
            "ws[t,h,k] = exp(wl[t,h,k]) / sum(exp(wl[t,h,m]), m)",
        ),
        outputs=("ws",),
        attrs=(("H", "int"),),
        ranges=(("h", "H"),),
    )
    with pytest.raises(SymgradError) as found:
        module_text(op, "test", "tensorflow")
    assert "Z[t, h] = sum(exp(wl[t, h, k]), k)" in found.value.message, found.value.message

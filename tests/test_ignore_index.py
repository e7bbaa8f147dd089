"""An index tensor compared with integers alone stays an index tensor: `t[n] != ig` (an
ignore_index loss, whose label also picks the target logit `x[n, t[n]]`) had made t a
value, and the op was refused as reading t both as an index and as a value. Exact in every
target, untiled and in chunks, against the reference (TF autodiff, float64), with labels
equal to the ignored one and, for ig = -1, labels that read outside x (which read zero,
and are masked)."""

from __future__ import annotations

import pytest
from harness import Case
from target_harness import check_in_every_target

from symgrad.errors import SymgradError
from symgrad.model import build

NLL = "y[n] = where(t[n] != ig, log(sum(exp(x[n,c]), c)) - x[n, t[n]], 0)"
MEAN = (
    "y[b] = sum(where(t[b,n] != ig, log(sum(exp(x[b,n,c]), c)) - x[b, n, t[b,n]], 0), n)"
    " / max(sum(where(t[b,n] != ig, 1, 0), n), 1)"
)

CASES = {
    # labels 0..4 of 5 classes, the ignored one 2
    "nll": Case(
        NLL,
        {"x": (9, 5)},
        attrs={"ig": 2},
        attr_types={"ig": "int"},
        index_inputs={"t": ((9,), 0, 5)},
        low=-3.0,
        high=3.0,
    ),
    # PyTorch's convention in miniature: the ignored label is outside the classes
    "nll_outside": Case(
        NLL,
        {"x": (11, 4)},
        attrs={"ig": -1},
        attr_types={"ig": "int"},
        index_inputs={"t": ((11,), -1, 4)},
    ),
    # the mean over the labels kept, per batch row, with a label compared in a sum
    "mean": Case(
        MEAN,
        {"x": (3, 7, 6)},
        attrs={"ig": 0},
        attr_types={"ig": "int"},
        index_inputs={"t": ((3, 7), 0, 6)},
    ),
    # two labels compared with each other and a literal
    "pair": Case(
        "y[n] = where(t[n] == u[n] + 1, x[n, t[n]], 0) + x[n, u[n]]",
        {"x": (8, 5)},
        index_inputs={"t": ((8,), 0, 5), "u": ((8,), -1, 4)},
    ),
}


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_target_is_exact(name, target, budget, tmp_path):
    check_in_every_target(CASES[name], target, tmp_path, "Ignore", budget)


@pytest.mark.parametrize(
    "formula",
    [
        "y[n] = where(m[n] == 1, x[n], 0)",  # read nowhere in brackets
        "y[n] = where(m[n] > 0, x[1.0 * m[n]], 0)",  # sampled reads at m's values
        "y[n] = where(m[n] > 0, x[m[n] / 2], 0)",
        "y[n] = where(m[n] != 2, x[m[n] * 0.5 + 1], 0)",
        "y[n] = where(m[n] > 0, x[n + m[n]], 0)",  # a displacement of n
    ],
)
def test_a_value_compared_with_an_integer_is_still_a_value(formula):
    """Only a tensor the op reads at integer positions inside brackets is an index
    tensor: compared with an integer, a tensor read nowhere in brackets, or read as a
    float position (a sampled read), is a value with a gradient."""
    from harness import op_spec

    program = build(op_spec(Case(formula, {"m": (3,), "x": (4,)}), "V"))
    assert set(program.inputs) == {"m", "x"}
    assert not program.index_inputs


def test_an_index_tensor_read_as_a_value_is_still_refused():
    """Arithmetic on the label (`t[n] * 2.0`) reads it as a float value: refused as before."""
    from harness import op_spec

    case = Case("y[n] = x[n, t[n]] * t[n]", {"x": (3, 4)}, index_inputs={"t": ((3,), 0, 4)})
    with pytest.raises(SymgradError, match="both as an index tensor"):
        build(op_spec(case, "V"))

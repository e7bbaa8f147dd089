"""A sub-formula written twice over different indices is shared only where a plain
tensor read sizes those indices (`model._canonical_key`). `sin(i*f) + sin(j*f)` had been
one level over i's size read at j (found by an adversarial trial): 0 for 0.64 where i
has one position, an output of the wrong shape where j has one, a broadcast error
otherwise, and the same for a sampled read at `i + 0.5` and `j + 0.5` under their own
ranges, in every target, whole and in chunks. Each case has a different size for every
index and is checked in float64 against the reference (forward, vjp, autodiff, and finite
differences in TensorFlow)."""

from __future__ import annotations

import numpy as np
import pytest
from harness import Case, check, generate
from target_harness import check_target, frameworks

CASES = {
    # a 2-D positional encoding, DETR's sine embedding in one formula
    "sine_rows_and_columns": Case(
        "y[b,i,j] = x[b,i,j] + sin(i*f) + sin(j*f)",
        {"x": (2, 3, 5)},
        attrs={"f": 0.7},
        attr_types={"f": "float"},
    ),
    "one_row": Case(
        "y[b,i,j] = x[b,i,j] + sin(i*f) + sin(j*f)",
        {"x": (2, 1, 4)},
        attrs={"f": 0.7},
        attr_types={"f": "float"},
    ),
    "per_channel_frequency": Case(
        "y[b,d,i,j] = x[b,d,i,j] + sin(i*w[d]) + cos(j*w[d]) + sin(j*w[d])",
        {"x": (2, 3, 4, 6), "w": (3,)},
        # compute_gradient's central differences of sin(i*w) summed over 48 positions
        # are 1.5e-5 off; the check against TF autodiff is at 1e-9
        fd_tol=1e-4,
    ),
    "half_pixel_shift": Case(
        "y[b,c,i,j] = x[b, c, i + 0.5, j + 0.5]",
        {"x": (2, 3, 4, 5)},
        ranges={"i": "x.shape[2]", "j": "x.shape[3]"},
        sizes={"i": 4, "j": 5},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("budget", [2**40, 1], ids=["whole", "chunks"])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_the_same_formula_over_indices_of_other_sizes_is_its_own(name, target, budget, tmp_path):
    case = CASES[name]
    module = generate(
        case, tmp_path, prefix="IndexValue" + name.title().replace("_", ""), target=target
    )
    module.MAX_TEMP_BYTES = budget
    if target == "tensorflow":
        check(case, module)
    else:
        check_target(case, module, frameworks()[target])


def test_a_formula_read_plainly_is_still_shared():
    """The sharing stays where a plain read sizes the index: `sin(x[b,i]) * sin(x[b,j])`
    (x read at i and at j: one size) computes the sine once."""
    from harness import op_spec

    from symgrad.model import build

    program = build(op_spec(Case("y[b,i,j] = exp(x[b,i]) * exp(x[b,j])", {"x": (2, 3)}), "P"))
    text = repr([level.terms for level in program.intermediates])
    assert text.count("exp") <= 1, text
    np.testing.assert_equal(len(program.outputs), 1)

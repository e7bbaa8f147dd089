"""Clamps inside a float position at their ties, in the spellings a kernel's index
arithmetic gets transcribed into: under a negation, subtracted from the far border,
scaled by a positive or a negative number, inside a where on indices, nested in further
clamps, as relu, its arguments swapped. Each spelling is FlowNet2's resample2d column
position clamp(j + flow, 0, W - 1), so the flow's gradient must be
kernel_resample2d_backward_input2's (the read's forward difference where the position is
not clamped, 0 included; zero where it is, W - 1 included), untiled and at a 1-byte
budget, in TF, PyTorch and JAX, and equal central differences away from the ties.

Measured before (TF, 120 flow-gradient elements, zero flow / integer flow): negated,
subtracted from W - 1 or scaled by -2, 20 / 8 wrong (the tie at W - 1 sent into the
difference with the zero outside the image, -x[W - 1], and the one at 0 dropped); inside
a where on indices 10 / 5 (the where was not walked); a negated nested clamp 10 / 3;
relu 10 / 3 (its tie at 0 to zero, where the kernel takes the forward difference). Now 0
everywhere: sampling._right_sided_clamps orients each clamp by how the position moves
as it grows.

Where that is unknown (a factor of unknown sign) a tie counts as clamped: zero, the
derivative from the clamped side, one-sided whichever way the position moves. Refused,
in one line: a `where` on tensor values inside a float position (its branch at equality
decides the derivative and the forward difference can take neither side), and `abs` of a
tensor expression where the position does not grow with it (reflection at the far
border).
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("torch")
pytest.importorskip("jax")

from adversarial import TINY
from harness import Case, generate
from test_tiling_adversarial_8 import BIG, REAL, _run, resample2d, resample2d_flow_grad

from symgrad.errors import SymgradError

ROW = "min(max(i + f[b,1,i,j], 0.0), H - 1)"
E = "(j + f[b,0,i,j])"
SPELLINGS = {
    "negated": f"-min(max(-{E}, 1.0 - W), 0.0)",
    "from_the_far_border": f"(W - 1) - min(max((W - 1) - {E}, 0.0), W - 1)",
    "scaled": f"2*min(max({E}/2, 0.0), (W - 1)/2)",
    "negatively_scaled": f"-2*min(max(-{E}/2, (1 - W)/2), 0.0)",
    "in_a_where_on_indices": f"where(i >= 0, min(max({E}, 0.0), W - 1), 0.0)",
    "nested": f"max(min(max(min({E}, W - 1.0), 0.0), W - 1), 0.0)",
    "negated_nested": f"-max(min(-max(min({E}, W - 1.0), 0.0), 0.0), 1.0 - W)",
    "relu": f"min(relu({E}), W - 1)",
    "swapped": f"max(0.0, min(W - 1, {E}))",
}
BASE = REAL["resample2d"]


def _case(column: str, **extra) -> Case:
    return Case(
        f"y[b,c,i,j] = x[b, c, {ROW}, {column}]",
        BASE.shapes,
        inputs=BASE.inputs,
        lets=BASE.lets,
        let_values=BASE.let_values,
        ranges=BASE.ranges,
        sizes=BASE.sizes,
        **extra,
    )


def _inputs(flow: str):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(BASE.shapes["x"])
    f = {
        "zero": np.zeros(BASE.shapes["f"]),  # every sample on a pixel, the borders on ties
        "integer": rng.integers(-7, 8, BASE.shapes["f"]).astype(float),
        "random": rng.uniform(-3, 3, BASE.shapes["f"]),
    }[flow]
    cotangent = rng.standard_normal(BASE.shapes["x"][:2] + BASE.shapes["f"][2:])
    return x, f, cotangent


def _one_sided(module, target, x, f, cotangent, attrs, side, h=2.0**-20):
    """The one-sided difference quotients of each flow element (side 1: to the right),
    from the module's forward: an output pixel reads only its own flow, so moving every
    flow element of a channel at once gives each element's quotient in its own pixel."""
    loss = []
    for step in (0.0, side * h):
        moved = f.copy()
        moved[:, 0] += step
        y = _run(module, target, {"x": x, "f": moved}, cotangent, attrs, np.float64, BIG)[0]
        loss.append((cotangent * y).sum(1))
    return (loss[1] - loss[0]) / (side * h)


CASES = [(s, "tensorflow") for s in SPELLINGS] + [
    ("negated", "pytorch"),
    ("in_a_where_on_indices", "pytorch"),
    ("negatively_scaled", "pytorch"),
    ("relu", "jax"),  # zero flow only: JAX's eager chunks are slow
]


@pytest.mark.parametrize(("spelling", "target"), CASES)
def test_every_spelling_of_the_clamp_has_flownet2s_gradient_at_ties(spelling, target, tmp_path):
    """At zero flow (the identity warp) and at integer flow past the borders (JAX: zero
    flow), the flow's
    gradient equals kernel_resample2d_backward_input2 and the forward the kernel's,
    untiled and at a 1-byte budget."""
    module = generate(_case(SPELLINGS[spelling]), tmp_path, prefix="Tie", target=target)
    for flow in ("zero",) if target == "jax" else ("zero", "integer"):
        x, f, cotangent = _inputs(flow)
        want = resample2d_flow_grad(x, f, cotangent)
        for budget in (BIG, TINY):
            y, _, gf = _run(module, target, {"x": x, "f": f}, cotangent, {}, np.float64, budget)
            np.testing.assert_allclose(y, resample2d(x, f), rtol=1e-13, atol=1e-13)
            np.testing.assert_allclose(gf, want, rtol=1e-12, atol=1e-13, err_msg=(flow, budget))


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_away_from_ties_the_gradient_is_the_central_difference(spelling, tmp_path):
    """At random flow (no sample on a pixel or a clamp) the column flow's gradient equals
    the central difference of the module's own forward, and the kernel's gradient."""
    module = generate(_case(SPELLINGS[spelling]), tmp_path, prefix="Away")
    x, f, cotangent = _inputs("random")
    gf = _run(module, "tensorflow", {"x": x, "f": f}, cotangent, {}, np.float64, BIG)[2]
    right = _one_sided(module, "tensorflow", x, f, cotangent, {}, 1, h=1e-6)
    left = _one_sided(module, "tensorflow", x, f, cotangent, {}, -1, h=1e-6)
    np.testing.assert_allclose(gf[:, 0], (right + left) / 2, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gf, resample2d_flow_grad(x, f, cotangent), rtol=1e-12, atol=1e-13)


def test_a_clamp_under_a_factor_of_unknown_sign_counts_a_tie_as_clamped(tmp_path):
    """`s * min(max(e / s, 0), (W - 1) / s)` with a float attr s: which way the position
    moves is not known when the module is written, so both ties go to the bound. At zero
    flow the first column's gradient is 0 (the left derivative, the position clamped
    there) and every other element the kernel's; every element is a one-sided
    derivative of the op, untiled and at a 1-byte budget."""
    column = f"s * min(max({E} / s, 0.0), (W - 1) / s)"
    module = generate(_case(column, attrs={"s": 2.0}), tmp_path, prefix="Unknown")
    x, f, cotangent = _inputs("zero")
    want = resample2d_flow_grad(x, f, cotangent)
    want[:, 0, :, 0] = 0.0
    right = _one_sided(module, "tensorflow", x, f, cotangent, {"s": 2.0}, 1)
    left = _one_sided(module, "tensorflow", x, f, cotangent, {"s": 2.0}, -1)
    for budget in (BIG, TINY):
        gf = _run(module, "tensorflow", {"x": x, "f": f}, cotangent, {"s": 2.0}, np.float64, budget)
        np.testing.assert_allclose(gf[2], want, rtol=1e-12, atol=1e-13)
        sided = np.isclose(gf[2][:, 0], right, atol=1e-9) | np.isclose(gf[2][:, 0], left, atol=1e-9)
        assert sided.all(), budget


def test_abs_where_the_position_grows_with_it_takes_the_right_derivative(tmp_path):
    """`x[.., abs(j + f)]`: at |e| = 0 (zero flow at the first column, integer flow
    landing on 0) the gradient is the right derivative (the forward difference), where
    abs's own derivative at 0 gave 0, neither one-sided derivative of the read; elsewhere
    it is the one-sided difference too, untiled and at a 1-byte budget (PyTorch)."""
    module = generate(_case(f"abs{E}"), tmp_path, prefix="Abs", target="pytorch")
    for flow in ("zero", "integer"):
        x, f, cotangent = _inputs(flow)
        tie = (np.arange(6) + f[:, 0]) == 0
        assert tie.any()
        right = _one_sided(module, "pytorch", x, f, cotangent, {}, 1)
        left = _one_sided(module, "pytorch", x, f, cotangent, {}, -1)
        for budget in (BIG, TINY):
            gf = _run(module, "pytorch", {"x": x, "f": f}, cotangent, {}, np.float64, budget)[2]
            np.testing.assert_allclose(gf[:, 0][tie], right[tie], rtol=1e-7, atol=1e-8)
            sided = np.isclose(gf[:, 0], right, atol=1e-8) | np.isclose(gf[:, 0], left, atol=1e-8)
            assert sided.all(), (flow, budget)


@pytest.mark.parametrize(
    ("column", "message"),
    [
        (f"where({E} > W - 1.0, W - 1.0, max({E}, 0.0))", "a where on tensor values inside"),
        (f"(W - 1) - abs((W - 1) - abs{E})", "abs of a tensor expression inside"),
        (f"-abs{E}", "abs of a tensor expression inside"),
    ],
)
def test_ties_no_order_can_make_one_sided_are_refused(column, message, tmp_path):
    """A clamp written as a where on values (its `e` branch at W - 1 took the forward
    difference with the zero outside the image, -x[W - 1]: 10 of 120 flow-gradient
    elements wrong at zero flow, 6 at integer flow, before) and a reflection (abs at its
    peak) are refused in one line, naming what to write instead."""
    with pytest.raises(SymgradError, match=message) as caught:
        generate(_case(column), tmp_path, prefix="Refused")
    assert "min/max" in str(caught.value)

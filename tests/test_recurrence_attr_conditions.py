"""A recurrence's condition on its scan index with an int attr in it: the attr may be
negative, so `t + n > 0` does not hold at every position after the first. It had been
taken as an index (never negative), decided true for every t >= 1, and with n = -2 the
module ran the recurrence from t = 1 where the op as written holds h0 until t = 3, in
every target, forward and gradient (found by an adversarial trial). It is refused now,
with the reason; a condition the attr cannot change stays accepted."""

from __future__ import annotations

import pytest

from symgrad.errors import SymgradError
from symgrad.scan_render import module_text
from symgrad.spec import OpSpec


def _op(formula: str) -> OpSpec:
    return OpSpec("AttrInit", (formula,), None, (("n", "int"),), (), "test [ops.AttrInit]")


@pytest.mark.parametrize(
    "formula",
    [
        "h[b,t] = where(t + n > 0, a[b,t] * h[b,t-1] + x[b,t], h0[b])",
        "h[b,t] = where(t > n, a[b,t] * h[b,t-1] + x[b,t], h0[b])",
    ],
)
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_a_condition_an_attrs_sign_decides_is_refused(formula, target):
    with pytest.raises(SymgradError, match="does not hold the same at every position"):
        module_text(_op(formula), "test", target)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_a_condition_the_attr_does_not_decide_later_is_kept(target):
    """`where(t == 0, h0, ...)` with an int attr elsewhere in the step still generates:
    only conditions on the scan index that the attr's sign decides are refused."""
    text = module_text(
        _op("h[b,t] = where(t == 0, h0[b], a[b,t] * h[b,t-1] + n * x[b,t])"), "test", target
    )
    assert "def forward" in text


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_a_condition_a_lets_sign_decides_is_refused(target):
    """A let is an integer of either sign too (`K = w.shape[0] - 8` is -3 for 5 taps)."""
    op = OpSpec(
        "LetInit",
        ("h[b,t] = where(t + K > 0, a[b,t] * h[b,t-1] + w[t] * x[b,t], h0[b])",),
        None,
        (),
        (),
        "test [ops.LetInit]",
        lets=(("K", "w.shape[0] - 8"),),
    )
    with pytest.raises(SymgradError, match="does not hold the same at every position"):
        module_text(op, "test", target)

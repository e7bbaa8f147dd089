"""Random well-formed formulas from the language's grammar: each one is either refused
with a clear error, or generates a gradient that matches TF autodiff over the reference
evaluator. (Finite differences are left to the corpus: random formulas reach regions of
high curvature, like `w**9` near -1, where a finite difference is the less exact side.)"""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

from harness import Case, check, generate, op_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from symgrad.errors import SymgradError
from symgrad.model import build

# Tensor name -> rank. Every non-batch axis has size 3 so any index fits any axis.
TENSORS = {"A": 3, "B": 3, "x": 2, "w": 1}
INDICES = ["i", "j", "k"]
SMOOTH = ["exp", "sin", "cos", "tanh", "sigmoid", "softplus", "erf"]


@st.composite
def access(draw):
    name = draw(st.sampled_from(sorted(TENSORS)))
    rank = TENSORS[name]
    if name == "w":
        return f"w[{draw(st.sampled_from(INDICES))}]"
    rest = [draw(st.sampled_from(INDICES)) for _ in range(rank - 1)]
    return f"{name}[{', '.join(['b', *rest])}]"


def expressions():
    leaves = st.one_of(
        access(),
        access(),
        st.sampled_from(["2", "0.5", "alpha", "pi"]),
    )

    def extend(inner):
        return st.one_of(
            st.tuples(inner, st.sampled_from(["+", "-", "*"]), inner).map(
                lambda t: f"({t[0]} {t[1]} {t[2]})"
            ),
            st.tuples(inner, inner).map(lambda t: f"({t[0]} / (1 + {t[1]} ** 2))"),
            st.tuples(inner, st.sampled_from(["2", "3"])).map(lambda t: f"({t[0]}) ** {t[1]}"),
            st.tuples(st.sampled_from(SMOOTH), inner).map(lambda t: f"{t[0]}({t[1]} / 4)"),
            st.tuples(st.sampled_from(["sum", "mean"]), inner, st.sampled_from(INDICES)).map(
                lambda t: f"{t[0]}({t[1]}, {t[2]})"
            ),
        )

    return st.recursive(leaves, extend, max_leaves=5)


# Output indices, and a term that uses all of them (so most formulas are well-formed).
OUTPUTS = {"b": "x[b, k]", "b, i": "x[b, i]", "b, i, j": "A[b, i, j]", "b, j": "w[j] * x[b, j]"}


@st.composite
def formulas(draw):
    out = draw(st.sampled_from(sorted(OUTPUTS)))
    rhs = draw(expressions())
    if draw(st.booleans()):
        rhs = f"{OUTPUTS[out]} {draw(st.sampled_from(['+', '*']))} {rhs}"
    return f"y[{out}] = {rhs}"


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(formula=formulas())
def test_random_formula_is_refused_or_correct(formula, tmp_path_factory):
    attrs = {"alpha": 0.75} if "alpha" in formula else {}
    shapes = {"A": (2, 3, 3), "B": (2, 3, 3), "x": (2, 3), "w": (3,)}
    case = Case(
        formula,
        shapes,
        attrs=attrs,
        attr_types={k: "float" for k in attrs},
        rtol=1e-8,
        finite_differences=False,
    )
    try:
        build(op_spec(case, "Probe"))
    except SymgradError as error:
        message = error.render().splitlines()[0]
        assert message.startswith("error: ") and len(message) < 300
        return
    module = generate(case, tmp_path_factory.mktemp("prop"), prefix="Prop")
    check(case, module)

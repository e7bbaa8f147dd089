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


# A second grammar with a different size for every index and tensors of ranks 1 to 4
# whose axes come in various orders: a transposition or a broadcast that puts an axis in
# the wrong place is a shape error or a wrong number here (size 3 everywhere hides both).
# Einstein sums over several indices inside `max`/`min` reach pointwise ranks of 6 and more.
SIZES = {"b": 2, "i": 3, "j": 4, "k": 5, "r": 6, "p": 7}
WIDE_TENSORS = {
    "B": "b,j,k",
    "T": "b,i,j,r",
    "W": "j,p",
    "C": "b,k,i",
    "v": "k",
    "D": "r,j",
    "x": "b,i",
}
WIDE_OUTPUTS = {
    "b, i, j": "T[b,i,j,r]",
    "b, j, i": "C[b,k,i] * B[b,j,k]",
    "b": "x[b,i]",
    "i, b": "x[b,i]",
    "b, k": "v[k] * x[b,i]",
}


def wide_expressions():
    leaves = st.sampled_from(
        [f"{name}[{indices}]" for name, indices in sorted(WIDE_TENSORS.items())] + ["0.5"]
    )

    def extend(inner):
        return st.one_of(
            st.tuples(inner, st.sampled_from(["+", "-", "*"]), inner).map(
                lambda t: f"({t[0]} {t[1]} {t[2]})"
            ),
            st.tuples(st.sampled_from(["max", "min"]), inner, inner).map(
                lambda t: f"{t[0]}({t[1]}, {t[2]})"
            ),
            st.tuples(st.sampled_from(SMOOTH), inner).map(lambda t: f"{t[0]}({t[1]} / 4)"),
            st.tuples(inner, st.sampled_from(sorted(SIZES))).map(lambda t: f"sum({t[0]}, {t[1]})"),
        )

    return st.recursive(leaves, extend, max_leaves=5)


@st.composite
def wide_formulas(draw):
    out = draw(st.sampled_from(sorted(WIDE_OUTPUTS)))
    rhs = draw(wide_expressions())
    if draw(st.booleans()):
        rhs = f"{WIDE_OUTPUTS[out]} {draw(st.sampled_from(['+', '*']))} {rhs}"
    return f"y[{out}] = {rhs}"


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(formula=wide_formulas())
def test_random_formula_with_distinct_sizes_is_refused_or_correct(formula, tmp_path_factory):
    shapes = {
        name: tuple(SIZES[i] for i in indices.split(",")) for name, indices in WIDE_TENSORS.items()
    }
    case = Case(formula, shapes, rtol=1e-8, finite_differences=False)
    try:
        build(op_spec(case, "Probe"))
    except SymgradError as error:
        message = error.render().splitlines()[0]
        assert message.startswith("error: ") and len(message) < 300
        return
    module = generate(case, tmp_path_factory.mktemp("wide"), prefix="Wide")
    check(case, module)


def test_rank_six_broadcast_inside_max(tmp_path):
    """TF's broadcasting refuses more than five alternating broadcast groups
    ("Broadcast between [2,1,4,1,5,1] and [2,3,4,6,1,7] is not supported yet")."""
    case = Case(
        "y[b,i,j] = max(B[b,j,k], T[b,i,j,r] * W[j,p])",
        {"B": (2, 4, 5), "T": (2, 3, 4, 6), "W": (4, 7)},
        finite_differences=False,  # sums of many max kinks: differences straddle ties
    )
    check(case, generate(case, tmp_path, prefix="Rank6"))


def test_rank_eight_broadcast(tmp_path):
    case = Case(
        "y[b,i,j,q] = max(B[b,j,k,s], T[b,i,j,r,q] * W[j,p])",
        {"B": (2, 4, 5, 9), "T": (2, 3, 4, 6, 8), "W": (4, 7)},
        finite_differences=False,
    )
    check(case, generate(case, tmp_path, prefix="Rank8"))


def test_rank_six_broadcast_in_a_sum_of_terms(tmp_path):
    case = Case(
        "y[b,i,j] = min(B[b,j,k], T[b,i,j,r] * W[j,p]) + min(T[b,i,j,r], B[b,j,k] * W[j,p])",
        {"B": (2, 4, 5), "T": (2, 3, 4, 6), "W": (4, 7)},
        finite_differences=False,
    )
    check(case, generate(case, tmp_path, prefix="Rank6Sum"))

"""Fuzzing the front end (issue 5): every input is a clean SymgradError or a valid result.

Random text (any unicode) and near-valid formulas (built from a small grammar, then
corrupted: tokens dropped, duplicated or swapped, operators and identifiers made up) go
through `parse_equation`, `model.build` and `spec.parse_spec`. Any other exception is a
bug; so is a hang (each example must finish well within a second).
"""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from symgrad.errors import SymgradError
from symgrad.model import Program, build
from symgrad.parse import Equation, parse_equation
from symgrad.spec import OpSpec, Spec, parse_spec

FUZZ = settings(
    max_examples=250,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
SLOW = 2.0  # seconds: far above what any example needs; a hang fails the test

ATTRS = (("alpha", "float"), ("n", "int"))


def op_spec(*formulas: str) -> OpSpec:
    """An op with the attrs its formulas mention (an unused attr is an error of its own)."""
    words = set(re.findall(r"[A-Za-z_]\w*", " ".join(formulas)))
    attrs = tuple(attr for attr in ATTRS if attr[0] in words)
    return OpSpec("Fuzz", tuple(formulas), None, attrs, (), "fuzz.toml [ops.Fuzz]")


def outcome(call, *args):
    """Run `call`; return its result or the SymgradError. Anything else propagates."""
    started = time.perf_counter()
    try:
        result = call(*args)
    except SymgradError as exc:
        result = exc
        rendered = exc.render()
        assert rendered.startswith("error: ")
        assert "Traceback" not in rendered
    assert time.perf_counter() - started < SLOW, f"{args!r} took too long"
    return result


# ----------------------------------------------------------------------------- grammar

INDEX = st.sampled_from(["b", "i", "j", "k", "l"])
TENSOR = st.sampled_from(["A", "B", "C", "W"])
FUNCTION = st.sampled_from(
    ["exp", "log", "sin", "cos", "tanh", "sqrt", "abs", "sigmoid", "softplus", "erf"]
)
NUMBER = st.one_of(
    st.integers(0, 12).map(str),
    st.sampled_from(
        [
            "0.5",
            "1e-3",
            "2.0",
            "0",
            "1e9",
            "3.25",
            "1e400",
            "1e-99999",
            "12345678901234567890",
            "0x1f",
            "1_000",
            "1j",
            ".5",
            "5.",
        ]
    ),
)


RANKS = {"A": 2, "B": 3, "C": 1, "W": 2}  # one rank per tensor, so most formulas are valid


@st.composite
def access(draw) -> str:
    name = draw(TENSOR)
    indices = draw(st.lists(INDEX, min_size=RANKS[name], max_size=RANKS[name]))
    return f"{name}[{', '.join(indices)}]"


def expression(depth: int = 3) -> st.SearchStrategy[str]:
    leaf = st.one_of(access(), NUMBER, st.sampled_from(["pi", "e", "alpha", "n"]))
    if depth == 0:
        return leaf
    sub = st.deferred(lambda: expression(depth - 1))
    return st.one_of(
        leaf,
        st.tuples(sub, st.sampled_from(["+", "-", "*", "/", "**"]), sub).map(" ".join),
        sub.map(lambda x: f"-{x}"),
        sub.map(lambda x: f"({x})"),
        st.tuples(FUNCTION, sub).map(lambda t: f"{t[0]}({t[1]})"),
        st.tuples(st.sampled_from(["max", "min"]), sub, sub).map(
            lambda t: f"{t[0]}({t[1]}, {t[2]})"
        ),
        st.tuples(
            st.sampled_from(["sum", "mean"]), sub, st.lists(INDEX, min_size=1, max_size=2)
        ).map(lambda t: f"{t[0]}({t[1]}, {', '.join(t[2])})"),
    )


@st.composite
def formula(draw) -> str:
    """`y[...] = expr`, its output indices mostly drawn from those the right side uses."""
    rhs = draw(expression())
    used = sorted(set(re.findall(r"\b[bijkl]\b", rhs))) or ["b"]
    if not draw(st.integers(0, 9)):
        used.append(draw(INDEX))  # sometimes an index the right side lacks, or a repeat
    indices = draw(st.permutations(used))[: draw(st.integers(1, len(used)))]
    groups = list(indices)
    if len(groups) >= 2 and draw(st.booleans()):
        groups[:2] = [f"({groups[0]}, {groups[1]})"]  # a composite output index
    return f"y[{', '.join(groups)}] = {rhs}"


JUNK_TOKENS = [
    "@",
    "%",
    "//",
    "**",
    ".",
    ",",
    "(",
    ")",
    "[",
    "]",
    "=",
    "==",
    ":",
    ";",
    "#",
    "'",
    '"',
    "\\",
    "lambda",
    "not",
    "and",
    "if",
    "else",
    "for",
    "in",
    ":=",
    "*",
    "**",
    "__import__",
    "__class__",
    ".real",
    "{",
    "}",
    "...",
    "\n",
    "\t",
    "\u202e",
    "\u200b",
    "Ä",
    "é",
    "𝔸",
    "\x00",
    "yield",
    "await",
    "f'",
    "b'",
]
IDENTIFIER = st.one_of(
    st.sampled_from(
        [
            "class",
            "print",
            "tf",
            "grad",
            "grad_A",
            "None",
            "True",
            "__dict__",
            "os",
            "sum",
            "mean",
            "exp",
            "max",
            "pi",
            "e",
            "alpha",
            "y",
            "OP_TYPE",
            "_",
            "A1",
            "x_y",
            "Ä",
            "ｘ",
            "i\u0307",
        ]
    ),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True),
)


@st.composite
def corrupted(draw) -> str:
    """A formula from the grammar with a few random edits to its tokens."""
    tokens = tokenize(draw(formula()))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["drop", "duplicate", "swap", "insert", "rename"]))
        if not tokens:
            break
        n = draw(st.integers(0, len(tokens) - 1))
        if action == "drop":
            del tokens[n]
        elif action == "duplicate":
            tokens.insert(n, tokens[n])
        elif action == "swap" and n + 1 < len(tokens):
            tokens[n], tokens[n + 1] = tokens[n + 1], tokens[n]
        elif action == "insert":
            tokens.insert(n, draw(st.sampled_from(JUNK_TOKENS)))
        elif action == "rename":
            tokens[n] = draw(IDENTIFIER)
    spaces = draw(st.sampled_from(["", " "]))
    return spaces.join(tokens)


def tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    word = ""
    for char in text:
        if char.isalnum() or char in "_.":
            word += char
            continue
        if word:
            tokens.append(word)
            word = ""
        if char != " ":
            if char == "*" and tokens and tokens[-1] == "*":
                tokens[-1] = "**"
            else:
                tokens.append(char)
    if word:
        tokens.append(word)
    return tokens


# ----------------------------------------------------------------------------- tests


@FUZZ
@given(st.text(max_size=300))
def test_random_text_parse(text: str) -> None:
    result = outcome(parse_equation, text, frozenset({"alpha"}))
    assert isinstance(result, Equation | SymgradError)


@FUZZ
@given(
    st.one_of(
        st.text(max_size=200), st.text(alphabet="yABbijk[](),+-*/= .0123456789e", max_size=80)
    )
)
def test_random_text_build(text: str) -> None:
    result = outcome(build, op_spec(text))
    assert isinstance(result, Program | SymgradError)


@FUZZ
@given(formula())
def test_grammar_formulas_build(text: str) -> None:
    """Formulas from the grammar: many are valid, the rest are clean errors."""
    result = outcome(build, op_spec(text))
    assert isinstance(result, Program | SymgradError)


@FUZZ
@given(corrupted())
def test_corrupted_formulas_build(text: str) -> None:
    result = outcome(build, op_spec(text))
    assert isinstance(result, Program | SymgradError)
    if isinstance(result, SymgradError) and result.column is not None:
        assert 0 <= result.column <= len(result.formula or "")


@FUZZ
@given(st.lists(st.one_of(formula(), corrupted()), min_size=2, max_size=3))
def test_several_outputs_build(texts: list[str]) -> None:
    result = outcome(build, op_spec(*texts))
    assert isinstance(result, Program | SymgradError)


VALID_SPEC = (
    'out = "generated"\n\n[ops.BatchedMatMul]\nformula = "y[b,i,j] = A[b,i,k] * B[b,k,j]"\n'
    'inputs = ["A", "B"]\nattrs = { alpha = "float" }\nno_gradient = ["B"]\n'
)


@st.composite
def mutated_spec(draw) -> str:
    text = list(VALID_SPEC)
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.integers(0, len(text) - 1))
        action = draw(st.sampled_from(["drop", "duplicate", "insert"]))
        if action == "drop":
            del text[n]
        elif action == "duplicate":
            text.insert(n, text[n])
        else:
            text.insert(
                n,
                draw(
                    st.sampled_from(
                        ['"', "'", "[", "]", "{", "}", "=", "\n", ".", ",", "x", "1", "#", "\u202e"]
                    )
                ),
            )
    return "".join(text)


@st.composite
def structured_spec(draw) -> str:
    """TOML built from random values in the places the schema cares about."""
    scalar = st.one_of(
        st.text(max_size=12),
        st.integers(),
        st.booleans(),
        st.floats(allow_nan=False, allow_infinity=False),
    )
    value = st.recursive(
        scalar,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(st.text(min_size=1, max_size=6), inner, max_size=3),
        ),
        max_leaves=6,
    )
    name = draw(
        st.one_of(
            st.sampled_from(["MatMul", "X", "x", "Op1", "If", "Tensorflow"]),
            st.text(min_size=1, max_size=12),
        )
    )
    table = draw(
        st.dictionaries(
            st.sampled_from(["formula", "inputs", "attrs", "no_gradient", "extra"]),
            st.one_of(value, formula(), st.lists(st.sampled_from(["A", "B", "y", "class"]))),
            max_size=4,
        )
    )
    lines = [f"[ops.{json.dumps(name, ensure_ascii=False)}]"]
    lines += [f"{key} = {toml_value(v)}" for key, v in table.items()]
    if draw(st.booleans()):
        lines.insert(0, f"out = {toml_value(draw(value))}")
    return "\n".join(lines) + "\n"


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


@FUZZ
@given(st.one_of(st.text(max_size=300), mutated_spec(), structured_spec()))
def test_random_specs(text: str) -> None:
    result = outcome(parse_spec, text, "fuzz.toml")
    assert isinstance(result, Spec | SymgradError)
    if isinstance(result, Spec):
        for op in result.ops:
            assert isinstance(outcome(build, op), Program | SymgradError)


@pytest.mark.parametrize(
    "text",
    [
        "y[b,i] = A[b,i] ** (9**9**9**9)",
        "y[b,i] = " + "(" * 1990,
        "y[b,i] = " + "-" * 1990 + "A[b,i]",
        "y[b,i] = " + "not " * 495,
        "y[b,i] = A[b,i]" + "**2" * 660,
        "y[b] = A[b] * 1e-99999999999999",
        "y[b] = A[b] * 0." + "0" * 1980 + "1",
        "y[b] = " + "exp(" * 39 + "A[b]" + ")" * 39,
    ],
)
def test_fails_fast(text: str) -> None:
    """Pathological inputs within the length limit are refused (or built) quickly."""
    assert isinstance(outcome(build, op_spec(text)), Program | SymgradError)

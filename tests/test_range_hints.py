"""An index without a range: the error's example names an input of the formula itself (never
a placeholder), the input and axis the index moves along, and, where one read decides it,
the range that keeps the reads inside the input; pasted into the spec, the example works."""

from __future__ import annotations

import re

import pytest

from symgrad.errors import SymgradError
from symgrad.model import build
from symgrad.spec import OpSpec

EXAMPLE = re.compile(r'e\.g\. ranges = \{ (\w+) = "([^"]*)" \}')


def missing_range(formula: str, attrs=(), ranges=()) -> tuple[str, str, str]:
    """The error for `formula`, and the index and range its example gives."""
    op = OpSpec("Probe", (formula,), None, tuple(attrs), (), "s.toml [ops.Probe]", (), ranges)
    with pytest.raises(SymgradError) as exc:
        build(op)
    message = exc.value.message
    match = EXAMPLE.search(message)
    assert match, message
    return message, match.group(1), match.group(2)


@pytest.mark.parametrize(
    ("formula", "attrs", "index", "example"),
    [
        ("y[b,i] = max(x[b, 2*i + u], u)", (), "u", "x.shape[1]"),  # the window
        ("y[b,i] = min(q[b, i + u], u)", (), "u", "q.shape[1]"),
        ("y[b,i,j] = max(img[b, i + u, 3*j + v], u, v)", (), "u", "img.shape[1]"),
        ("y[b,i] = max(x[b, s*i + u], u)", (("s", "int"),), "u", "x.shape[1]"),
        ("y[b] = max(tab[b, ids[b] + u], u)", (), "u", "tab.shape[1]"),
        ("y[b] = sum(x[b, u + 1], u)", (), "u", "x.shape[1] - 1"),  # one read decides it
        ("y[b] = sum(w[b, 5 - u], u)", (), "u", "6"),
        ("y[b] = sum(z[b, u + p], u)", (("p", "int"),), "u", "z.shape[1] - p"),
    ],
)
def test_a_missing_range_is_suggested_from_the_formulas_own_inputs(formula, attrs, index, example):
    message, named, suggested = missing_range(formula, attrs)
    assert (named, suggested) == (index, example), message
    assert "A.shape" not in message
    # The examples are ranges the formula accepts: with them, one index at a time, it builds.
    ranges = ((named, suggested),)
    for _ in range(3):
        try:
            build(OpSpec("Probe", (formula,), None, attrs, (), "s.toml [ops.Probe]", (), ranges))
            break
        except SymgradError as exc:
            match = EXAMPLE.search(exc.message)
            assert match, exc.message
            ranges = (*ranges, (match.group(1), match.group(2)))
    else:
        pytest.fail(f"still no range with {ranges}")


def test_the_window_example_says_which_axis_the_index_moves_along():
    message, _, _ = missing_range("y[b,i] = max(x[b, 2*i + u], u)")
    assert message.endswith(
        'e.g. ranges = { u = "x.shape[1]" } (u moves along axis 1 of x; for a window of '
        'fixed length, a number or an int attr: u = "3")'
    )


def test_an_int_attr_declared_and_unused_is_the_range_suggested():
    """`attrs = { V = "int" }` with no formula or range reading V: the range the user
    meant to write, ahead of the one the reads would give."""
    message, index, example = missing_range("y[b] = sum(x[b, u + 1], u)", (("V", "int"),))
    assert (index, example) == ("u", "V")
    assert "int attr 'V' is declared but nothing uses it" in message

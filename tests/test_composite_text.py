"""Composite output axes are read from the formula's text (issue "never silently wrong", 2).

`y[(b,i,j)]` and `y[b,i,j]` have the same Python syntax tree, so the parser looks at the
source: a subscript wrapped in its own parentheses is one composite axis. Each case checks
the parsed groups, the shape `forward` returns, and the gradients numerically (float64,
against the reference evaluator and finite differences).
"""

from __future__ import annotations

import pytest

from symgrad.errors import SymgradError
from symgrad.parse import parse_equation

B, I, J, K = 2, 3, 4, 5

GROUPS = [
    ("y[(b,i,j)] = A[b,i,j] ** 2", (("b", "i", "j"),)),
    ("y[(i,b)] = x[b,i] * w[i]", (("i", "b"),)),
    ("y[ ( b , i ) ] = A[b,i]", (("b", "i"),)),
    ("y[((b,i))] = A[b,i]", (("b", "i"),)),  # nested parentheses around the whole subscript
    ("y[((i,k)),j] = A[i,j] * B[k]", (("i", "k"), ("j",))),
    ("y[(b,i),j] = A[b,i,j]", (("b", "i"), ("j",))),
    ("y[(b,i),] = A[b,i]", (("b", "i"),)),  # a trailing comma: a tuple of one composite
    ("y[b,(i,k)] = A[b,i] * B[b,k]", (("b",), ("i", "k"))),
    # A parenthesised single name is a plain index.
    ("y[(i),j] = A[i,j]", (("i",), ("j",))),
    ("y[b,(i)] = A[b,i]", (("b",), ("i",))),
    ("y[(b)] = A[b]", (("b",),)),
    ("y[b,i,j] = A[b,i,j]", (("b",), ("i",), ("j",))),
]


@pytest.mark.parametrize(("formula", "groups"), GROUPS, ids=[f for f, _ in GROUPS])
def test_output_groups_follow_the_parentheses(formula, groups):
    assert parse_equation(formula).groups == groups


@pytest.mark.parametrize(
    ("formula", "message", "at"),
    [
        ("y[b,i] = A[(b,i) + 1]", "is a whole axis, on the left or of an input", "(b,i)"),
        ("y[b,i,j] = A[(b,2),j]", "an index must be a plain name", "2),j]"),
        ("y[((i,k),j)] = A[i,j] * B[k]", "an index must be a plain name", "(i,k),j)"),
    ],
)
def test_composites_that_cannot_be_read_are_refused(formula, message, at):
    with pytest.raises(SymgradError) as exc:
        parse_equation(formula)
    assert message in exc.value.message
    assert formula[exc.value.column :].startswith(at), exc.value.render()


NUMERIC = {
    "whole-batch-flattened": ("y[(b,i,j)] = A[b,i,j] ** 2", {"A": (B, I, J)}, (B * I * J,)),
    "transposed-flattened": ("y[(i,b)] = x[b,i] * w[i]", {"x": (B, I), "w": (I,)}, (I * B,)),
    "double-parentheses": (
        "y[((i,k)),j] = A[i,j] * C[k]",
        {"A": (I, J), "C": (K,)},
        (I * K, J),
    ),
}


@pytest.mark.parametrize("name", sorted(NUMERIC))
def test_parenthesised_outputs_have_the_flattened_shape_and_right_gradients(name, tmp_path):
    tf = pytest.importorskip("tensorflow")
    from harness import Case, check, generate

    formula, shapes, shape = NUMERIC[name]
    case = Case(formula, shapes)
    module = generate(case, tmp_path)
    tensors = [tf.ones(shapes[n], tf.float64) for n in module.INPUTS]
    y = module.forward(*tensors)
    assert tuple(y.shape) == shape
    grads = module.vjp(*tensors, tf.ones(shape, tf.float64))  # a correctly shaped grad_y
    assert [tuple(g.shape) for g in grads] == [shapes[n] for n in module.INPUTS]
    check(case, module)

"""Exact-string tests of the canonical form and the lowered code for small formulas."""

from __future__ import annotations

import pytest

from symgrad.errors import SymgradError
from symgrad.model import build
from symgrad.pipeline import compile_op
from symgrad.render import code
from symgrad.spec import OpSpec, parse_spec


def op(*formulas: str, sizes=(), attrs=()) -> OpSpec:
    return OpSpec("T", formulas, None, attrs, (), "t.toml [ops.T]", tuple(sizes))


def steps(block) -> list[str]:
    return [f"{s.target} = {code(s.value)}" for s in block.steps]


CHAIN = "y[b,i,l] = A[b,i,j] * B[b,j,k] * C[b,k,l]"


def test_chain_is_contracted_pairwise_and_its_gradient_shares_the_pair():
    module = compile_op(op(CHAIN))
    assert steps(module.forward) == [
        '_s1 = tf.einsum("bij,bjk->bik", A, B)',
        'y = tf.einsum("bik,bkl->bil", _s1, C)',
    ]
    assert module.saved == ("_s1",)
    assert len([s for s in module.backward.steps if "einsum" in code(s.value)]) == 4


def test_typical_sizes_choose_the_cheaper_chain_order():
    sizes = {"b": 32, "i": 128, "j": 64, "k": 256, "l": 32}
    module = compile_op(op(CHAIN, sizes=sizes.items()))
    assert steps(module.forward) == [
        '_s1 = tf.einsum("bjk,bkl->bjl", B, C)',
        'y = tf.einsum("bij,bjl->bil", A, _s1)',
    ]


def test_sizes_in_the_spec_are_validated():
    spec = parse_spec(f'[ops.T]\nformula = "{CHAIN}"\nsizes = {{ i = 128 }}\n', "s.toml")
    assert spec.ops[0].sizes == (("i", 128),)
    with pytest.raises(SymgradError, match="whole number"):
        parse_spec(f'[ops.T]\nformula = "{CHAIN}"\nsizes = {{ i = 0 }}\n', "s.toml")
    with pytest.raises(SymgradError, match="which no formula uses"):
        build(op(CHAIN, sizes=[("q", 8)]))


def test_softmax_lowers_to_one_fused_op_and_its_gradient_reads_the_output():
    module = compile_op(op("y[b,i] = exp(x[b,i]) / sum(exp(x[b,k]), k)"))
    assert any(line.endswith("= tf.nn.softmax(x, axis=-1)") for line in steps(module.forward))
    assert not any("reduce_logsumexp" in line for line in steps(module.forward))
    backward = "\n".join(steps(module.backward))
    assert "tf.exp(" not in backward and "softmax" not in backward
    assert "* y" in backward


def test_logsumexp_keeps_its_softmax_for_the_gradient():
    module = compile_op(op("y[b,i] = log(sum(exp(A[b,i,k]), k))"))
    assert steps(module.forward) == [
        "_f1 = tf.reduce_max(A, axis=-1, keepdims=True)",
        # a row that is all -inf: log 0 = -inf, like tf.reduce_logsumexp
        "_f2 = tf.where(tf.math.is_finite(_f1), _f1, tf.zeros_like(_f1))",
        "_f3 = tf.exp(A - _f2)",
        "_f4 = tf.reduce_sum(_f3, axis=-1, keepdims=True)",
        "_f5 = _f3 / _f4",
        "_lse1 = tf.squeeze(tf.math.log(_f4) + _f2, axis=-1)",
        "y = _lse1",
    ]
    assert module.saved == ("_f5",)
    assert steps(module.recompute) == ["_f5 = tf.nn.softmax(A, axis=-1)"]
    assert steps(module.backward) == ["grad_A = _f5 * tf.expand_dims(grad_y, -1)"]


def test_a_logsumexp_inside_the_formula_stays_one_fused_op():
    module = compile_op(op("y[b,i] = 2 * log(sum(exp(A[b,i,k]), k))"))
    assert steps(module.forward)[0] == "_lse1 = tf.reduce_logsumexp(A, axis=[2])"


def test_nothing_contracted_is_a_multiply_not_an_einsum():
    module = compile_op(op("y[b,i] = A[b,i] * B[b,i]"))
    assert steps(module.backward) == ["grad_A = B * grad_y", "grad_B = A * grad_y"]

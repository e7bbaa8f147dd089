"""Generated code grows linearly with the depth of nested nonlinearities: reverse mode
through a chain of n functions is O(n) work, and so must the module be."""

from __future__ import annotations

import time

from symgrad.pipeline import module_text
from symgrad.spec import OpSpec


def tanh_chain(depth: int) -> str:
    expr = "A[b,i]"
    for n in range(1, depth + 1):
        expr = f"tanh({expr}) * B{n}[b,i]"
    return f"y[b,i] = {expr}"


def max_chain(depth: int) -> str:
    expr = "A[b,i]"
    for n in range(1, depth + 1):
        expr = f"max({expr}, B{n}[b,i])"
    return f"y[b,i] = {expr}"


def module(formula: str) -> str:
    return module_text(OpSpec("Chain", (formula,), None, (), (), "t [ops.Chain]"), "t.toml")


def test_module_size_grows_linearly_with_depth():
    sizes = {depth: len(module(max_chain(depth))) for depth in (10, 20, 30)}
    first, second = sizes[20] - sizes[10], sizes[30] - sizes[20]
    # Linear: each ten levels add the same; quadratic growth would add 5/3 as much.
    assert 0.8 * first <= second <= 1.2 * first, sizes


def test_each_level_of_a_tanh_chain_adds_under_a_kilobyte():
    sizes = {depth: len(module(tanh_chain(depth))) for depth in (1, 10, 19)}
    # Was 39 KB at depth 10 and 459 KB at depth 20 (each level repeated every inner one).
    # The module's fixed part (call-time checks, registration) is the depth-1 size.
    assert sizes[19] - sizes[10] < 9 * 1000, sizes
    assert sizes[10] - sizes[1] < 9 * 1000, sizes


def test_max_chain_calls_maximum_once_per_level():
    text = module(max_chain(38))
    assert text.count("tf.maximum") == 38 * 2 - 1, text.count("tf.maximum")


def test_twenty_deep_chain_generates_quickly():
    start = time.perf_counter()
    module(tanh_chain(20))
    assert time.perf_counter() - start < 5.0  # was 16 s; about 0.5 s now

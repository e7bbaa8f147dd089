"""Segment sums and extrema under XLA with no segments: XLA cannot compile a scatter into
a table of no rows ("Scatter dimension 0 is of size zero"), and a `tf.cond` around it
compiles both branches, so a segment max over V = 0 segments, or a segment sum whose V is
the size of an empty input, failed to compile under `jit_compile=True` while the rows
were not empty (found by an adversarial trial). Forward and gradients under tf.function
with unknown sizes, XLA and XLA with unknown sizes equal eager, with V = 0 and V = 3."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from harness import load_module
from target_harness import check_graphs_equal_eager

from symgrad.pipeline import module_text
from symgrad.spec import OpSpec

FORMULAS = {
    # V an int attr
    "max_by_attr": "y[v,f] = max(where(seg[n] == v, x[n,f], -inf), n)",
    "min_by_attr": "y[v,f] = min(where(seg[n] == v, tanh(x[n,f]), inf), n)",
    "logsumexp_by_attr": "y[v,f] = log(sum(where(seg[n] == v, exp(x[n,f]), 0), n))",
    # V the size of an input (unknown while tracing with unknown sizes)
    "max_by_input": "y[v,f] = max(where(seg[n] == v, x[n,f], -inf), n) + z[v]",
    "sum_by_input": "y[v,f] = sum(where(seg[n] == v, x[n,f], 0), n) * z[v]",
}


def _module(name, folder):
    by_attr = name.endswith("by_attr")
    op = OpSpec(
        "".join(part.title() for part in name.split("_")),
        (FORMULAS[name],),
        None,
        (("V", "int"),) if by_attr else (),
        ("seg",),
        f"test [ops.{name}]",
        ranges=(("v", "V"),) if by_attr else (),
    )
    return load_module(module_text(op, "test"), folder, f"xla_segments_{name}")


@pytest.mark.parametrize("segments", [0, 3])
@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_segments_under_xla_equal_eager(name, segments, tmp_path):
    module = _module(name, tmp_path)
    rng = np.random.default_rng(segments)
    named = {
        "x": tf.constant(rng.uniform(-2, 2, (7, 4))),  # 7 rows, 4 features
        # ids past the segments and negative ones drop; every segment of 3 has a row
        "seg": tf.constant([0, 2, 1, 5, -1, 2, 0], tf.int32),
        "z": tf.constant(rng.uniform(0.5, 1.5, segments)),
    }
    attrs = {"V": segments} if name.endswith("by_attr") else {}
    y = module.forward(*(named[n] for n in module.INPUTS), **attrs)
    assert y.shape == (segments, 4)
    check_graphs_equal_eager(module, [named[n] for n in module.INPUTS], attrs)

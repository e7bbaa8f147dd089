"""`symgrad check` on ops that compare an input with `==`: segment ids kept as floats, as in
torch_scatter's scatter_softmax (`where(seg[m] == seg[n], ...)`). Random reals are never
equal, so the check drew every point into a segment of its own and passed kernels that get
segments wrong, e.g. one that, like CSR kernels, takes equal ids to be adjacent. Such inputs
are now drawn from a few integers and left out of the gradient check (their gradient is 0,
and a difference step would break the ties)."""

from __future__ import annotations

import json

import pytest
from test_check import symgrad

from symgrad.model import build
from symgrad.spec import parse_op

SPEC = """
[ops.ScatterSoftmax]
formula = "y[n,h] = exp(x[n,h]) / sum(where(seg[m] == seg[n], exp(x[m,h]), 0), m)"

[ops.SortedScatterSoftmax]
formula = "y[n,h] = exp(x[n,h]) / sum(where(seg[m] == seg[n], exp(x[m,h]), 0), m)"
"""

OPS = """
import jax.numpy as jnp


def _softmax_by(ids, x):
    same = (ids[:, None] == ids[None, :]).astype(x.dtype)
    e = jnp.exp(x - jnp.max(x, axis=0))
    return e / jnp.einsum("nm,mh->nh", same, e)


def scatter_softmax(x, seg):
    return _softmax_by(seg, x)


def sorted_scatter_softmax(x, seg):
    # a run of equal adjacent ids is a segment: right only when seg is sorted
    runs = jnp.concatenate([jnp.zeros(1), jnp.cumsum(seg[1:] != seg[:-1])])
    return _softmax_by(runs, x)
"""


def program(formula, **table):
    return build(parse_op("Op", {"formula": formula, **table}, "symgrad.toml"))


def test_inputs_read_only_in_equalities_are_found():
    assert program(SPEC.split('"')[1]).compared == ("seg",)
    # compared and also read as a value: random reals, as before
    assert program("y[n] = sum(where(x[m] == x[n], x[m], 0), m)").compared == ()
    # an order comparison is no tie hazard
    assert program("y[n] = sum(where(s[m] < s[n], x[m], 0), m)").compared == ()
    # compared with an index, seg is an integer index tensor: it keeps its own draw
    ids = program("y[v] = sum(where(seg[n] == v, x[n], 0), n)", ranges={"v": "4"})
    assert ids.index_inputs == ("seg",)
    assert ids.compared == ()


def test_a_kernel_that_takes_equal_ids_to_be_adjacent_fails(tmp_path):
    pytest.importorskip("jax")
    (tmp_path / "symgrad.toml").write_text('[targets]\njax = "gen"\n' + SPEC, encoding="utf-8")
    (tmp_path / "ops.py").write_text(OPS, encoding="utf-8")
    assert symgrad("generate", "symgrad.toml", cwd=tmp_path).returncode == 0
    result = symgrad(
        "check",
        "symgrad.toml",
        "--json",
        "--target",
        "jax",
        "--library",
        "ops.py",
        *("--size", "n=9", "--size", "m=9", "--size", "h=2"),
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    report = {e["op"]: e for e in json.loads(result.stdout)["ops"]}
    checks = {e: {c["check"]: c["passed"] for c in report[e]["checks"]} for e in report}
    assert checks["ScatterSoftmax"] == {"interface": True, "forward": True, "gradient": True}
    assert checks["SortedScatterSoftmax"]["forward"] is False
    assert any("seg drawn from 0..2" in n for n in report["ScatterSoftmax"]["notes"])

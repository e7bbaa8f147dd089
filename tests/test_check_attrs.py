"""`symgrad check` on ops it once misjudged: a float attr the op holds as float32, stride
and dilation swapped (hidden by attrs of 1), two inputs read at one position that the op
requires to have one length, an op without an attr of the spec, and an op that raises.

tests/custom_op/check_attr_ops.cc holds the ops, tests/custom_op/check_attr_ops.toml
their formulas. The CLI runs in a subprocess, as in tests/test_check.py.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from test_check import REPO, symgrad

from symgrad.check import (
    compare_forward,
    other_samples,
    parse_sizes,
    plan_sizes,
    sample_attrs,
)
from symgrad.errors import SymgradError
from symgrad.model import build
from symgrad.spec import OpSpec

SPEC = REPO / "tests" / "custom_op" / "check_attr_ops.toml"


@pytest.fixture(scope="module")
def library(op_library_path):
    return op_library_path("check_attr_ops")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("check_attr_project")
    shutil.copy(SPEC, folder / "check_attr_ops.toml")
    result = symgrad("generate", "check_attr_ops.toml", cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder


def check(project, library, *args):
    result = symgrad(
        "check", "check_attr_ops.toml", "--library", str(library), "--json", *args, cwd=project
    )
    report = json.loads(result.stdout) if result.stdout else None
    return result, report


def entries(report, op):
    return {o["setting"]: o for o in report["ops"] if o["op"] == op}


def found(entry):
    return {c["check"]: c for c in entry["checks"]}


def _program(formula, attrs=()):
    return build(OpSpec("T", (formula,), None, attrs, (), "t"))


# ----------------------------------------------------------------------------- item 11


def test_a_float_attr_is_compared_at_the_float32_value_the_op_holds(project, library):
    """TF float attrs are float32: the op computes with float32(0.7), so the generated
    forward must be given that value, not 0.7 (which differed by 2.3e-8: a failure)."""
    result, report = check(project, library, "--op", "CheckFloatScale", "--attr", "alpha=0.7")
    assert result.returncode == 0, result.stdout + result.stderr
    (entry,) = entries(report, "CheckFloatScale").values()
    assert found(entry)["forward"]["passed"] is True
    assert found(entry)["forward"]["error"] <= 1e-15
    (attr,) = entry["attrs"]
    assert attr["value"] == float(np.float32(0.7)) != 0.7
    assert attr["from"] == "--attr 0.7, as the op holds it"


def test_a_factor_of_one_is_never_the_explanation():
    """A forward off by a relative 3e-8 used to read `the op's values are 1 x the
    formula's`; it shows the differing values with enough digits to tell them apart."""
    program = _program("y[b,i] = alpha * x[b,i]", (("alpha", "float"),))
    want = np.arange(1.0, 7.0).reshape(2, 3) * 0.7
    got = want * float(np.float32(0.7)) / 0.7
    result = compare_forward(program, [got], [want], 1e-10)
    assert result.passed is False
    assert " 1 x " not in result.detail
    assert "e.g. at [0, 0]: op 0.699999988, formula 0.7" in result.detail


# ----------------------------------------------------------------------------- item 12


def test_sample_attrs_differ_from_each_other_and_from_0_and_1():
    attrs = (("s", "int"), ("d", "int"), ("p", "int"), ("a", "float"), ("b", "float"))
    assert sample_attrs(attrs, {}) == {"s": 2, "d": 3, "p": 5, "a": 0.75, "b": 1.5}
    # Given values are avoided too.
    assert sample_attrs(attrs, {"s": 3, "a": 0.75}) == {"d": 2, "p": 5, "b": 1.5}
    # The second set changes every attr and keeps them distinct.
    samples = sample_attrs(attrs, {})
    assert other_samples(attrs, {}, samples) == {"s": 3, "d": 5, "p": 2, "a": 1.5, "b": 0.75}
    assert other_samples((("s", "int"),), {"d": 3}, {"s": 2}) == {"s": 5}


def test_swapped_stride_and_dilation_fail_at_the_distinct_sample_setting(project, library):
    """The op's defaults (s = d = 1) cannot tell `d*i + s*k` from `s*i + d*k`; the sample
    setting (s = 2, d = 3) can. Both settings are reported."""
    result, report = check(project, library, "--op", "CheckSwappedConv")
    assert result.returncode == 1, result.stdout + result.stderr
    settings = entries(report, "CheckSwappedConv")
    assert set(settings) == {"defaults", "samples"}
    defaults, samples = settings["defaults"], settings["samples"]
    assert [(a["name"], a["value"], a["from"]) for a in defaults["attrs"]] == [
        ("s", 1, "op default"),
        ("d", 1, "op default"),
    ]
    assert [(a["name"], a["value"], a["from"]) for a in samples["attrs"]] == [
        ("s", 2, "sample"),
        ("d", 3, "sample"),
    ]
    assert all(c["passed"] is True for c in defaults["checks"])
    assert found(samples)["forward"]["passed"] is False
    assert found(samples)["gradient"]["passed"] is False
    text = symgrad(
        "check",
        "check_attr_ops.toml",
        "--library",
        str(library),
        "--op",
        "CheckSwappedConv",
        cwd=project,
    )
    rows = [line.split()[:2] + line.split()[4:5] for line in text.stdout.splitlines()]
    assert ["CheckSwappedConv[samples]", "forward", "FAIL"] in rows
    assert ["CheckSwappedConv[defaults]", "forward", "pass"] in rows
    assert "error: CheckSwappedConv[samples]: forward check failed" in text.stderr


# ----------------------------------------------------------------------------- item 13


def test_inputs_read_at_one_position_get_one_length():
    program = _program(
        "y[b,i,e] = sum(a[b,i,w] * k[b, i + w - r, c] * v[b, i + w - r, e], w, c)",
        (("r", "int"),),
    )
    sizes = plan_sizes(program, {"r": 2})
    assert sizes.shapes["k"][1] == sizes.shapes["v"][1]
    assert len({sizes.shapes["k"][2], sizes.shapes["v"][2], sizes.shapes["a"][1]}) == 3
    # --shape fixes an input (its tied axis follows), --size an index.
    sizes = plan_sizes(program, {"r": 2}, shapes={"k": (2, 9, 4)}, sizes={"i": 7})
    assert sizes.shapes["k"] == (2, 9, 4)
    assert sizes.shapes["v"][:2] == (2, 9)
    assert sizes.shapes["a"][1] == sizes.indices["i"] == 7
    assert sizes.indices["c"] == 4


def test_local_attention_passes_and_shape_and_size_set_the_inputs(project, library):
    result, report = check(project, library, "--op", "CheckLocalAttention")
    assert result.returncode == 0, result.stdout + result.stderr
    result, report = check(
        project, library, "--op", "CheckLocalAttention", "--shape", "k=2x9x4", "--size", "i=5"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # An op without attr defaults is checked at two distinct sample settings.
    settings = entries(report, "CheckLocalAttention")
    assert {s: e["attrs"][0]["value"] for s, e in settings.items()} == {
        "samples": 2,
        "samples-2": 3,
    }
    for entry in settings.values():
        assert entry["shapes"]["k"] == [2, 9, 4]
        assert entry["shapes"]["v"][:2] == [2, 9]
        assert entry["shapes"]["a"][:2] == [2, 5]
        assert entry["sizes"]["i"] == 5


def test_an_op_that_raises_is_reported_as_raising_not_as_an_infinite_error(project, library):
    result, report = check(
        project,
        library,
        "--op",
        "CheckLocalAttention",
        "--shape",
        "k=2x9x4",
        "--shape",
        "v=2x8x6",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    checks = found(entries(report, "CheckLocalAttention")["samples"])
    for name in ("forward", "gradient"):
        assert checks[name]["passed"] is False
        assert checks[name]["error"] is None
        assert checks[name]["detail"].startswith("the op raised InvalidArgumentError")
        assert "k and v must have the same length" in checks[name]["detail"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--shape", "k=2x9"), "--shape k=2x9: input k has rank 3, not 2"),
        (("--shape", "k=2xx9"), "expected NAME=SIZExSIZE"),
        (("--shape", "zz=2x3"), "--shape zz: no op checked has this input"),
        (("--size", "zz=3"), "--size zz: no op checked has this index"),
        (("--size", "i=0"), "expected INDEX=N with N >= 1"),
        (("--size", "c=3", "--shape", "k=2x9x4"), "contradicts"),
    ],
)
def test_bad_shapes_and_sizes_are_exit_2_with_one_line(project, args, message):
    result = symgrad(
        "check", "check_attr_ops.toml", "--op", "CheckLocalAttention", *args, cwd=project
    )
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert message in line


def test_the_size_of_an_index_that_follows_from_shapes_is_refused():
    program = _program(
        "y[b,i,o] = sum(x[b, s*i + d*k, c] * w[k,c,o], k, c)", (("s", "int"), ("d", "int"))
    )
    op = OpSpec(
        "T",
        ("y[b,i,o] = sum(x[b, s*i + d*k, c] * w[k,c,o], k, c)",),
        None,
        (("s", "int"), ("d", "int")),
        (),
        "t",
    )
    assert parse_sizes((op,), ["i=4"]) == {"T": {"i": 4}}
    with pytest.raises(SymgradError, match="index i is not the index of an input axis"):
        plan_sizes(program, {"s": 2, "d": 3}, sizes={"i": 4})


# ----------------------------------------------------------------------------- item 14


def test_a_missing_attr_is_what_the_interface_row_says(project, library):
    """The op's inputs match the spec by name; it lacks the attr beta. The interface row
    names the attr, nothing says the inputs were passed in the spec's order, and the op
    is still run (without the attr)."""
    result, report = check(project, library, "--op", "CheckNoAttr")
    assert result.returncode == 1
    entry = entries(report, "CheckNoAttr")["samples"]
    checks = found(entry)
    assert checks["interface"]["passed"] is False
    assert "has no attr 'beta'" in checks["interface"]["detail"]
    assert not any("names differ" in note for note in entry["notes"])
    assert "the op has no attr beta: checked without passing it" in entry["notes"]
    assert "the op's values are 2.66667 x the formula's" in checks["forward"]["detail"]
    result, report = check(project, library, "--op", "CheckNoAttr", "--attr", "beta=2")
    checks = found(entries(report, "CheckNoAttr")[""])
    assert checks["forward"]["passed"] is True
    assert checks["interface"]["passed"] is False

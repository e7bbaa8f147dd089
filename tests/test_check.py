"""`symgrad check` against real compiled ops: correct ones pass, each kind of wrong one
fails the right check with the right op named, and bad usage is exit 2 with one line.

tests/custom_op/check_ops.cc holds four ops that compute their formula in
tests/custom_op/check_ops.toml and four that do not (an off-by-one loop bound, a
transposed output, a missing factor 0.5, inputs declared as (rhs, lhs)). The CLI runs in a
subprocess, as a user runs it: importing a module registers its gradient process-wide, and
a module edited by hand must not leak into other tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from symgrad.check import plan_sizes
from symgrad.model import build
from symgrad.spec import OpSpec

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "tests" / "custom_op" / "check_ops.toml"
CORRECT = ("CheckGatherRows", "CheckMatMul", "CheckScaledTanh", "CheckStridedConv")
WRONG = ("CheckMissingScale", "CheckOffByOne", "CheckRenamed", "CheckTransposed")


def symgrad(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "symgrad", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def library(op_library_path) -> Path:
    return op_library_path("check_ops")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A folder with the test spec and its generated modules, as a user has it."""
    folder = tmp_path_factory.mktemp("check_project")
    shutil.copy(SPEC, folder / "check_ops.toml")
    result = symgrad("generate", "check_ops.toml", cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder


@pytest.fixture(scope="module")
def all_ops(project, library) -> tuple[subprocess.CompletedProcess, dict]:
    """One run over every op of the test spec, as JSON."""
    result = symgrad("check", "check_ops.toml", "--library", str(library), "--json", cwd=project)
    return result, json.loads(result.stdout)


def checks(report: dict, op: str, setting: str = "") -> dict:
    """The checks of one op at one attr setting ("" for an op checked at one setting)."""
    (entry,) = [o for o in report["ops"] if o["op"] == op and o["setting"] == setting]
    return {c["check"]: c for c in entry["checks"]}


def test_a_wrong_op_makes_the_run_fail_with_exit_1(all_ops):
    result, report = all_ops
    assert result.returncode == 1, result.stderr
    assert report["ok"] is False
    assert sorted({o["op"] for o in report["ops"]}) == sorted(CORRECT + WRONG)


@pytest.mark.parametrize("op", CORRECT)
def test_ops_that_compute_their_formula_pass_every_check(all_ops, op):
    _, report = all_ops
    entries = [o for o in report["ops"] if o["op"] == op]
    assert entries
    for entry in entries:
        found = {c["check"]: c for c in entry["checks"]}
        assert set(found) == {"interface", "forward", "gradient"}
        assert all(c["passed"] is True for c in found.values()), found
        assert found["forward"]["error"] <= 1e-10
        assert found["gradient"]["error"] <= 1e-6


def test_an_off_by_one_loop_bound_is_located(all_ops):
    """The kernel stops at i < I-1: the report says the outputs differ only at the last i,
    and the op's own differences disagree with the formula's gradient too."""
    _, report = all_ops
    found = checks(report, "CheckOffByOne")
    assert found["interface"]["passed"] is True
    assert found["forward"]["passed"] is False
    assert "y differs only where i = 2, the last of 0..2" in found["forward"]["detail"]
    assert "the op wrote 0 there" in found["forward"]["detail"]
    assert found["gradient"]["passed"] is False


def test_a_transposed_output_is_a_shape_failure(all_ops):
    _, report = all_ops
    found = checks(report, "CheckTransposed")
    assert found["forward"]["passed"] is False
    detail = found["forward"]["detail"]
    assert "(2, 5, 3), the formula gives (2, 3, 5)" in detail
    assert "transposed layout" in detail
    assert found["gradient"]["passed"] is False


def test_a_missing_scale_factor_is_named_as_a_factor(all_ops):
    _, report = all_ops
    found = checks(report, "CheckMissingScale")
    assert found["forward"]["passed"] is False
    assert "the op's values are 2 x the formula's" in found["forward"]["detail"]
    assert found["gradient"]["passed"] is False
    assert "= 0.5 " in found["gradient"]["detail"]  # <J^T u, v> / <u, J v>: half


def test_inputs_in_another_order_with_other_names_fail_the_interface_check(all_ops):
    _, report = all_ops
    found = checks(report, "CheckRenamed")
    assert found["interface"]["passed"] is False
    assert "('rhs', 'lhs')" in found["interface"]["detail"]
    assert "('A', 'B')" in found["interface"]["detail"]
    assert found["forward"]["passed"] is False
    assert found["gradient"]["passed"] is False


def test_the_text_report_has_a_row_per_op_and_check_and_names_failures(project, library):
    ops = [arg for op in ("CheckMatMul", "CheckOffByOne") for arg in ("--op", op)]
    result = symgrad("check", "check_ops.toml", "--library", str(library), *ops, cwd=project)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    rows = [line.split()[:2] + [line.split()[4]] for line in lines if line.startswith("Check")]
    assert ["CheckMatMul", "forward", "pass"] in rows
    assert ["CheckMatMul", "gradient", "pass"] in rows
    assert ["CheckOffByOne", "forward", "FAIL"] in rows
    assert "error: CheckOffByOne: forward check failed" in result.stderr.splitlines()
    assert "Traceback" not in result.stderr
    assert "CheckMatMul: inputs A 2x3x4, B 2x4x5 (b=2, i=3, k=4, j=5)" in lines


def test_a_module_edited_by_hand_is_checked_as_it_is_and_a_1_percent_gradient_error_fails(
    project, library, tmp_path
):
    folder = tmp_path / "edited"
    shutil.copytree(project, folder)
    module = folder / "generated_check" / "check_mat_mul.py"
    text = module.read_text()
    assert text.count("    return (grad_A, grad_B)") == 1
    module.write_text(
        text.replace("    return (grad_A, grad_B)", "    return (grad_A * 1.01, grad_B)")
    )
    result = symgrad(
        "check",
        "check_ops.toml",
        "--library",
        str(library),
        "--op",
        "CheckMatMul",
        "--json",
        cwd=folder,
    )
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert any("edited by hand" in w and "check_mat_mul.py" in w for w in report["warnings"])
    found = checks(report, "CheckMatMul")
    assert found["forward"]["passed"] is True
    assert found["gradient"]["passed"] is False
    assert "1.01" in found["gradient"]["detail"]
    # In float32 too: a 1% error scores above float32's tolerance.
    result = symgrad(
        "check",
        "check_ops.toml",
        "--library",
        str(library),
        "--op",
        "CheckMatMul",
        "--dtype",
        "float32",
        "--json",
        cwd=folder,
    )
    assert result.returncode == 1, result.stderr
    assert checks(json.loads(result.stdout), "CheckMatMul")["gradient"]["passed"] is False


def test_float32_passes_correct_ops_and_attrs_come_from_the_command_line(project, library):
    result = symgrad(
        "check",
        "check_ops.toml",
        "--library",
        str(library),
        "--dtype",
        "float32",
        "--op",
        "CheckStridedConv",
        "--op",
        "CheckScaledTanh",
        "--op",
        "CheckGatherRows",
        "--attr",
        "s=3",
        "--attr",
        "p=2",
        "--json",
        cwd=project,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["dtype"] == "float32"
    conv = {o["setting"]: o for o in report["ops"] if o["op"] == "CheckStridedConv"}
    attrs = {
        setting: {a["name"]: (a["value"], a["from"]) for a in entry["attrs"]}
        for setting, entry in conv.items()
    }
    # d is sampled apart from the given s and p (and from 0 and 1), at two values.
    assert attrs == {
        "samples": {"s": (3, "--attr"), "p": (2, "--attr"), "d": (5, "sample")},
        "samples-2": {"s": (3, "--attr"), "p": (2, "--attr"), "d": (7, "sample")},
    }
    tanh = [(o["setting"], o["attrs"]) for o in report["ops"] if o["op"] == "CheckScaledTanh"]
    assert tanh == [
        ("defaults", [{"name": "alpha", "value": 0.5, "from": "op default"}]),
        ("samples", [{"name": "alpha", "value": 0.75, "from": "sample"}]),
    ]


def test_a_stale_or_missing_module_is_exit_2_saying_to_generate(project, library, tmp_path):
    folder = tmp_path / "stale"
    shutil.copytree(project, folder)
    spec = folder / "check_ops.toml"
    spec.write_text(spec.read_text().replace("0.5 * x[b,i] * x[b,i]", "0.25 * x[b,i] * x[b,i]"))
    result = symgrad("check", "check_ops.toml", "--library", str(library), cwd=folder)
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "check_missing_scale.py is stale against the spec" in line
    assert "run `symgrad generate`" in line
    (folder / "generated_check" / "check_mat_mul.py").unlink()
    result = symgrad("check", "check_ops.toml", "--op", "CheckMatMul", cwd=folder)
    assert result.returncode == 2
    assert "no generated module" in result.stderr and "CheckMatMul" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--library", "missing.so"), "missing.so: library not found"),
        (("--op", "NoSuchOp"), "no op 'NoSuchOp' in the spec"),
        (("--attr", "zz=1"), "--attr zz: no op checked has this attr"),
        (("--attr", "s=two"), "--attr s=two: expected an integer"),
        (("--attr", "s"), "--attr 's': expected NAME=VALUE"),
        (("--dtype", "float16"), "invalid choice"),
    ],
)
def test_usage_errors_are_exit_2_with_one_line(project, args, message):
    result = symgrad("check", "check_ops.toml", *args, cwd=project)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_an_op_the_library_does_not_define_is_exit_2(library, op_library_path):
    """This repo's spec against the test library: it defines none of BatchedMatMul etc."""
    result = symgrad("check", "--library", str(library), "--op", "BatchedMatMul", cwd=REPO)
    assert result.returncode == 2
    assert "the library does not define BatchedMatMul (it defines: CheckGatherRows" in result.stderr
    result = symgrad("check", "--library", str(library), cwd=REPO)
    assert result.returncode == 2
    assert "the library defines none of the spec's ops" in result.stderr


def test_this_repos_spec_against_its_window_op_library(op_library_path):
    """The ops of tests/custom_op/window_ops.cc are in this repo's symgrad.toml: they are
    checked against generated/ (attrs sampled), the spec's other ops listed as skipped."""
    library = op_library_path("window_ops")
    result = symgrad("check", "--library", str(library), "--json", cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert sorted({o["op"] for o in report["ops"]}) == ["EmbeddingLookup", "StridedConv1d"]
    assert "BatchedMatMul" in report["skipped"]
    for op in report["ops"]:
        assert [c["passed"] for c in op["checks"]] == [True, True, True], op


def test_without_a_library_every_op_of_this_repo_passes(tmp_path):
    """No-library mode over generated/: the generated forward against the dense evaluation
    of each formula, and its tape against its own finite differences."""
    result = symgrad("check", "--json", cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert len({op["op"] for op in report["ops"]}) == 26
    for op in report["ops"]:
        found = {c["check"]: c["passed"] for c in op["checks"]}
        assert found == {"forward": True, "gradient": True}, op


def test_without_a_library_a_module_edited_by_hand_fails(tmp_path):
    """The no-library mode is a real check: a forward or a backward edited by hand fails."""
    shutil.copy(REPO / "symgrad.toml", tmp_path / "symgrad.toml")
    shutil.copytree(REPO / "generated", tmp_path / "generated")
    module = tmp_path / "generated" / "prefix_sum.py"
    text = module.read_text()
    assert "tf.cumsum(" in text
    module.write_text(text.replace("tf.cumsum(", "tf.cumsum(exclusive=True, x=", 1))
    layer = tmp_path / "generated" / "layer_norm.py"
    text = layer.read_text()
    assert text.count("    return (grad_x,)") == 1
    layer.write_text(text.replace("    return (grad_x,)", "    return (grad_x * 1.001,)"))
    result = symgrad("check", "--op", "PrefixSum", "--op", "LayerNorm", "--json", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert checks(report, "PrefixSum")["forward"]["passed"] is False
    layer = [o for o in report["ops"] if o["op"] == "LayerNorm"]
    assert layer
    for entry in layer:
        found = {c["check"]: c["passed"] for c in entry["checks"]}
        assert found == {"forward": True, "gradient": False}, entry


# ----------------------------------------------------------------------------- sizes


def _program(formula: str, **kwargs):
    return build(OpSpec("T", (formula,), None, kwargs.pop("attrs", ()), (), "t", **kwargs))


def test_sizes_differ_per_index_and_shared_axes_agree():
    sizes = plan_sizes(_program("y[b,i,j] = A[b,i,k] * B[b,k,j] + C[b,j,i]"), {})
    assert sizes.shapes == {"A": (2, 3, 4), "B": (2, 4, 5), "C": (2, 5, 3)}
    # j and m name the same axis of A, so they share its size.
    sizes = plan_sizes(_program("y[b,i,j] = A[b,i,j] / sum(A[b,i,m], m)"), {})
    assert sizes.indices["j"] == sizes.indices["m"] == sizes.shapes["A"][2]


def test_windowed_axes_grow_until_every_range_is_at_least_two():
    program = _program(
        "y[b,i,o] = sum(x[b, s*i + d*k - p, c] * w[k,c,o], k, c)",
        attrs=(("s", "int"), ("d", "int"), ("p", "int")),
    )
    sizes = plan_sizes(program, {"s": 3, "d": 4, "p": 0})
    length, taps = sizes.shapes["x"][1], sizes.shapes["w"][0]
    assert sizes.indices["i"] == (length - 1 - 4 * (taps - 1)) // 3 + 1 >= 2


def test_index_tensors_get_values_that_keep_reads_in_bounds():
    program = _program("y[b,i,k,c] = X[b, idx[b,i] + k, c]", ranges=(("k", "3"),))
    sizes = plan_sizes(program, {})
    low, high = sizes.index_values["idx"]
    assert (low, high) == (0, sizes.shapes["X"][1] - 2)


def test_readme_check_report_is_what_check_prints(project, library):
    """README's sample report, line for line; error figures of passing rows (which depend
    on the machine's arithmetic) are compared as numbers below the tolerance."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Checking your compiled op", 1)[1]
    block = section.split("```console\n", 1)[1].split("```", 1)[0]
    command, *shown = block.splitlines()
    args = command.removeprefix("$ symgrad ").split()
    args[args.index("--library") + 1] = str(library)
    result = symgrad(*args, cwd=project)
    assert result.returncode == 1
    printed = result.stdout.replace(str(library), "check_ops.so").splitlines()
    assert len(printed) == len(shown)
    figure = re.compile(r"\d\.\de[-+]\d\d")
    for got, want in zip(printed, shown, strict=True):
        if " pass " in want:
            assert figure.sub("E", got) == figure.sub("E", want)
            assert all(float(x) <= 1e-10 for x in figure.findall(got)[:1] if "forward" in got)
        else:
            assert got == want

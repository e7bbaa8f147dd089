"""`symgrad check --target pytorch|jax`: the same three checks, report and exit codes as for
TensorFlow, against PyTorch ops registered with torch.library
(tests/custom_op/check_torch_ops.py) and JAX primals (tests/custom_op/check_jax_ops.py),
three correct and two wrong (an off-by-one, a transposed output) in each, all declared in
tests/custom_op/check_py_ops.toml. The CLI runs in a subprocess, as in tests/test_check.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_check import REPO, symgrad

CUSTOM = REPO / "tests" / "custom_op"
CORRECT = ("PyMatMul", "PyScale", "PyStridedConv")
WRONG = ("PyOffByOne", "PyTransposed")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("check_frameworks")
    for name in ("check_py_ops.toml", "check_torch_ops.py", "check_jax_ops.py"):
        shutil.copy(CUSTOM / name, folder / name)
    result = symgrad("generate", "check_py_ops.toml", cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder


def run_check(project, *args):
    result = symgrad("check", "check_py_ops.toml", "--json", *args, cwd=project)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return result, json.loads(result.stdout)


def by_op(report):
    ops = {}
    for entry in report["ops"]:
        ops.setdefault(entry["op"], []).append(entry)
    return ops


def found(entry):
    return {c["check"]: c for c in entry["checks"]}


def assert_correct_pass_and_wrong_fail(result, report):
    assert result.returncode == 1
    assert report["ok"] is False
    ops = by_op(report)
    assert sorted(ops) == sorted(CORRECT + WRONG)
    for op in CORRECT:
        for entry in ops[op]:
            checks = found(entry)
            assert set(checks) == {"interface", "forward", "gradient"}
            assert all(c["passed"] is True for c in checks.values()), entry
            assert checks["gradient"]["error"] <= 1e-6
    # An op with attrs and defaults is checked at both settings.
    assert [e["setting"] for e in ops["PyStridedConv"]] == ["defaults", "samples"]
    (off,) = ops["PyOffByOne"]
    assert found(off)["interface"]["passed"] is True
    assert found(off)["forward"]["passed"] is False
    assert "y differs only where i = 2, the last of 0..2" in found(off)["forward"]["detail"]
    assert found(off)["gradient"]["passed"] is False
    (transposed,) = ops["PyTransposed"]
    detail = found(transposed)["forward"]["detail"]
    assert "(2, 5, 3), the formula gives (2, 3, 5)" in detail
    assert found(transposed)["gradient"]["passed"] is False


def test_pytorch_ops_registered_with_torch_library(project):
    pytest.importorskip("torch")
    result, report = run_check(project, "--target", "pytorch", "--library", "check_torch_ops.py")
    assert report["target"] == "pytorch"
    assert_correct_pass_and_wrong_fail(result, report)
    interface = found(by_op(report)["PyStridedConv"][0])["interface"]
    assert interface["detail"] == "schema checkpy::py_strided_conv(x, w, s, d)"


def test_jax_primals_of_a_python_module(project):
    pytest.importorskip("jax")
    result, report = run_check(project, "--target", "jax", "--library", "check_jax_ops.py")
    assert report["target"] == "jax"
    assert_correct_pass_and_wrong_fail(result, report)
    (matmul,) = by_op(report)["PyMatMul"]
    assert found(matmul)["interface"]["detail"] == "py_mat_mul(A, B)"


BAD_TORCH_OPS = """
import torch


@torch.library.custom_op("checkbad::py_mat_mul", mutates_args=())
def py_mat_mul(B: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    return A @ B


@torch.library.custom_op("checkbad::py_scale", mutates_args=())
def py_scale(x: torch.Tensor) -> torch.Tensor:
    return 0.75 * x
"""

BAD_JAX_OPS = """
def py_mat_mul(B, A):
    return A @ B


def py_scale(x):
    return 0.75 * x
"""


def test_the_interface_check_reads_the_schema_and_the_signature(project, tmp_path):
    """Inputs in another order than the backward needs, and a missing attr, are named
    (in a text report too); a missing attr is not passed, so the forward still runs."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    folder = tmp_path / "bad"
    shutil.copytree(project, folder)
    (folder / "bad_torch.py").write_text(BAD_TORCH_OPS)
    (folder / "bad_jax.py").write_text(BAD_JAX_OPS)
    ops = ("--op", "PyMatMul", "--op", "PyScale")
    for target, library, order, attr in (
        (
            "pytorch",
            "bad_torch.py",
            (
                "op checkbad::py_mat_mul takes (B, A); its backward needs the spec's inputs "
                "then attrs in this order: (A, B)"
            ),
            "op checkbad::py_scale has no argument 'alpha' (the spec's attr)",
        ),
        (
            "jax",
            "bad_jax.py",
            "py_mat_mul takes its inputs as (B, A); the spec's are (A, B), passed in this order",
            "py_scale has no keyword argument 'alpha' (the spec's attr)",
        ),
    ):
        result = symgrad(
            "check",
            "check_py_ops.toml",
            "--target",
            target,
            "--library",
            library,
            *ops,
            cwd=folder,
        )
        assert result.returncode == 1, result.stdout + result.stderr
        rows = {tuple(line.split()[:2]): line for line in result.stdout.splitlines()}
        assert "FAIL" in rows["PyMatMul", "interface"] and order in rows["PyMatMul", "interface"]
        # Without a default, alpha is checked at two sample settings.
        assert attr in rows["PyScale[samples]", "interface"]
        assert attr in rows["PyScale[samples-2]", "interface"]
        assert "names differ" not in result.stdout
        assert "PyScale[samples]: the op has no attr alpha: checked without passing it" in (
            result.stdout
        )
        assert "the op's values are 1 x" not in result.stdout
        assert "error: PyMatMul: interface check failed" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--target", "jax", "--library", "check_py_ops.toml"),
            "--target jax checks a Python module",
        ),
        (
            ("--target", "jax", "--library", "check_jax_ops.py", "--namespace", "x"),
            "--namespace is for --target pytorch",
        ),
        (
            ("--target", "tensorflow"),
            "symgrad check --target tensorflow runs the tensorflow modules",
        ),
        (
            ("--target", "pytorch", "--library", "check_torch_ops.py", "--namespace", "nosuch"),
            "the library defines none of the spec's ops",
        ),
    ],
)
def test_framework_usage_errors_are_exit_2_with_one_line(project, args, message):
    result = symgrad("check", "check_py_ops.toml", *args, cwd=project)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert message in line


def test_a_compiled_pytorch_cpp_op_library(project, torch_op_library):
    """A .so of TORCH_LIBRARY ops (tests/custom_op/check_torch_ops.cc, in the session's one
    compiled library), loaded with torch.ops.load_library; the spec's other ops are skipped."""
    library = torch_op_library
    result, report = run_check(project, "--target", "pytorch", "--library", str(library))
    assert result.returncode == 1, result.stdout + result.stderr
    assert sorted(report["skipped"]) == ["PyStridedConv", "PyTransposed"]
    ops = by_op(report)
    assert sorted(ops) == ["PyMatMul", "PyOffByOne", "PyScale"]
    for op in ("PyMatMul", "PyScale"):
        for entry in ops[op]:
            assert all(c["passed"] is True for c in entry["checks"]), entry
    assert ops["PyScale"][0]["attrs"] == [{"name": "alpha", "value": 0.5, "from": "op default"}]
    (off,) = ops["PyOffByOne"]
    assert found(off)["interface"]["detail"] == "schema checkcpp::py_off_by_one(x, w)"
    assert found(off)["forward"]["passed"] is False
    assert found(off)["gradient"]["passed"] is False

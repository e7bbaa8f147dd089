"""The README's examples are what symgrad really prints, writes and runs; its guarantees
name tests that exist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from symgrad.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)\n```", README, flags=re.DOTALL)


def chunks(block: str) -> list[str]:
    """The parts of an excerpt between its `...` lines."""
    return [c.strip("\n") for c in re.split(r"(?m)^\s*\.\.\.$", block) if c.strip()]


def assert_in_order(excerpt: str, text: str) -> None:
    """Every chunk of the excerpt is a run of whole lines of `text`, in order."""
    position = 0
    for chunk in chunks(excerpt):
        found = ("\n" + text).find("\n" + chunk + "\n", position)
        assert found >= 0, f"not in the output (in this order):\n{chunk}\n--- output:\n{text}"
        position = found + len(chunk)


def test_readme_opens_with_the_two_setup_commands():
    sh = blocks("sh")
    assert sh[0].endswith("symgrad generate")
    assert sh[1].endswith("python -m pytest -q -n 2 --dist loadfile")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert sh[1] in ci, "CI must run README's test command"


def test_readme_module_excerpt_is_the_generated_code():
    (excerpt,) = [b for b in blocks("python") if b.startswith("def _compute")]
    assert len(chunks(excerpt)) >= 2
    generated = (ROOT / "generated" / "batched_mat_mul.py").read_text(encoding="utf-8")
    assert_in_order(excerpt, generated)


def test_readme_explain_excerpt_is_what_explain_prints(capsys):
    (block,) = [b for b in blocks("console") if b.startswith("$ symgrad explain")]
    command, excerpt = block.split("\n", 1)
    formula = re.fullmatch(r'\$ symgrad explain "(.*)"', command).group(1)
    assert main(["explain", formula]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(chunks(excerpt)[0] + "\n"), "the excerpt starts where explain does"
    assert_in_order(excerpt, printed)


ERROR_BLOCK = re.compile(r"```\n(error: symgrad\.toml \[ops\.(\w+)\]: .*?)\n```", re.DOTALL)


def test_readme_error_examples_are_what_generate_prints(tmp_path, capsys, monkeypatch):
    examples = ERROR_BLOCK.findall(README)
    assert len(examples) >= 3
    monkeypatch.chdir(tmp_path)
    for message, op in examples:
        lines = message.splitlines()
        if len(lines) == 3:  # a formula and a caret
            # (the unknown name 'alpha' example is a spec without `attrs`)
            table = f"formula = {json.dumps(lines[1].strip())}\n"
        else:  # the misspelled key
            assert "unknown key 'input'" in message
            table = 'formula = "y[b,i,j] = A[b,i,k] * B[b,k,j]"\ninput = ["A", "B"]\n'
        (tmp_path / "symgrad.toml").write_text(f"[ops.{op}]\n{table}", encoding="utf-8")
        assert main(["generate"]) == 2
        assert capsys.readouterr().err == message + "\n"


def test_readme_check_claims_about_foreign_files(tmp_path, capsys, monkeypatch):
    """Exit 2 for a foreign file with a module's name; other foreign files are fine."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "symgrad.toml").write_text(
        '[ops.BatchedMatMul]\nformula = "y[b,i,j] = A[b,i,k] * B[b,k,j]"\n', encoding="utf-8"
    )
    assert main(["generate"]) == 0
    for name in ("helpers.py", "notes.txt"):
        (tmp_path / "generated" / name).write_text("mine\n", encoding="utf-8")
    assert main(["generate", "--check"]) == 0
    (tmp_path / "generated" / "batched_mat_mul.py").write_text("mine\n", encoding="utf-8")
    assert main(["generate", "--check"]) == 2
    assert "not written by symgrad" in capsys.readouterr().err


def test_readme_install_from_a_checkout(tmp_path):
    """`pip install path/to/symgrad` builds a wheel with the command and its data files."""
    assert "pip install path/to/symgrad && symgrad generate --check" in README
    pytest.importorskip("setuptools")
    source = tmp_path / "symgrad"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "*.egg-info", "build"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path / "wheel"), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "wheel").glob("symgrad-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for needed in (
        "symgrad/data/stdlib_modules.txt",
        "symgrad/data/tf_gradient_ops.txt",
        "symgrad/templates/module.py.j2",
        "symgrad/templates/pytorch.py.j2",
        "symgrad/templates/jax.py.j2",
        "symgrad/templates/scan_tensorflow.py.j2",
        "symgrad/templates/tf_registration.py.j2",
        "symgrad/targets/tensorflow.py",
        "symgrad/lower/lowerer.py",
    ):
        assert needed in names, needed
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "symgrad = symgrad.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_readme_custom_op_example_builds_and_runs(tmp_path):
    """The C++ op, the g++ line and the Python snippet of "Using a generated module",
    copied from the README as they are, in a fresh process (~10 s), in a shell where
    `.venv` is not activated."""
    pytest.importorskip("tensorflow")
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    (cpp,) = blocks("cpp")
    (build,) = [b for b in blocks("sh") if "g++" in b]
    (usage,) = [b for b in blocks("python") if "tf.load_op_library" in b]
    (tmp_path / "my_ops.cc").write_text(cpp + "\n", encoding="utf-8")
    shutil.copytree(ROOT / "generated", tmp_path / "generated")
    # The kernel sums in its own order and TF's einsum in another (oneDNN, FMA), so in
    # float32 they differ by rounding, up to K * 2**-24 of sum_k |A| |B| per element. A
    # relative tolerance fails where the sum cancels to near 0 (13% of the random draws);
    # bound each element's difference by 1e-5 of that sum instead (measured <= 2.3e-7).
    check = """
import numpy as np
difference = np.abs(my_ops.batched_mat_mul(a, b) - tf.einsum("bik,bkj->bij", a, b))
scale = tf.einsum("bik,bkj->bij", tf.abs(a), tf.abs(b)).numpy()
assert np.all(difference <= 1e-5 * scale), (difference / scale).max()
assert y.shape == [8, 3, 5]
with tf.GradientTape() as tape:
    tape.watch(a)
    loss = tf.reduce_sum(my_ops.batched_mat_mul(a, b))
np.testing.assert_allclose(tape.gradient(loss, a), grad_a, rtol=1e-5)
print("README example OK")
"""
    (tmp_path / "example.py").write_text(usage + "\n" + check, encoding="utf-8")
    # A user who has not activated `.venv`: its interpreter is not on PATH, only in the
    # project folder, as `.venv/bin/python`.
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    built = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", build],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    result = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "README example OK" in result.stdout


def test_readme_explain_commands_with_declarations_run(capsys):
    import shlex

    commands = [
        line
        for block in blocks("sh")
        for line in block.splitlines()
        if line.startswith("symgrad explain ")
    ]
    assert any("--attr" in c for c in commands) and any("--range" in c for c in commands)
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, command
        assert "Gradient of x:" in capsys.readouterr().out


def test_readme_guarantees_name_tests_that_exist():
    section = README.split("## What symgrad guarantees", 1)[1].split("\n## ", 1)[0]
    bullets = re.findall(r"(?ms)^- (.*?)(?=^- |\Z)", section)
    assert len(bullets) >= 10
    sources = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").glob("test_*.py"))
    for bullet in bullets:
        names = re.findall(r"`(test_\w+)`", bullet)
        assert names and bullet.rstrip().endswith("`."), f"no test named: {bullet}"
        for name in names:
            assert f"def {name}(" in sources, f"no test {name}"

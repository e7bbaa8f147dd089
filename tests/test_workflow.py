"""Living with generated code (issue 4): `symgrad generate` as users run it from a shell, CI
and pre-commit.

Exit codes and check mode, byte-identical output (runs, hash seeds, op order), writes only
on change, all-or-nothing generation and atomic files, hand-edited / foreign / orphaned
files, ruff-clean output, an importable package, `importlib.reload` of a module, and no
TensorFlow import during generation. Everything runs the real command line
(`symgrad.cli.main`) on a project folder in tmp_path; only the hash-seed and no-TensorFlow
tests start fresh `python -m symgrad` processes (three, shared: `fresh_generations`), and
only the reload tests import TF.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from symgrad import emit, pipeline
from symgrad.cli import main
from symgrad.folders import output_folder, spec_source
from symgrad.render import HEADER
from symgrad.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
REPO_SPEC = REPO / "symgrad.toml"
GOLDEN = Path(__file__).resolve().parent / "golden"

# Two quick ops; tests change, add and remove ops from this.
OPS = {
    "BatchedMatMul": 'formula = "y[b,i,j] = A[b,i,k] * B[b,k,j]"',
    "Scale": 'formula = "y[i] = alpha * x[i]"\nattrs = { alpha = "float" }',
}
MODULES = {"BatchedMatMul": "batched_mat_mul.py", "Scale": "scale.py"}
OLD_TIME = 1_000_000_000  # 2001: mtimes are set to this to see whether a file was rewritten


def write_spec(folder: Path, ops: dict[str, str], out: str = "generated") -> Path:
    tables = "\n\n".join(f"[ops.{name}]\n{body}" for name, body in ops.items())
    spec = folder / "symgrad.toml"
    spec.write_text(f'out = "{out}"\n\n{tables}\n', encoding="utf-8")
    return spec


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def snapshot(folder: Path) -> dict[str, tuple[bytes, int, int, int]]:
    """Every entry of a folder (hidden ones too): bytes, mtime, inode, mode."""
    if not folder.exists():
        return {}
    result = {}
    for path in sorted(folder.iterdir()):
        info = path.stat()
        data = b"<folder>" if path.is_dir() else path.read_bytes()
        result[path.name] = (data, info.st_mtime_ns, info.st_ino, info.st_mode)
    return result


def age(folder: Path) -> None:
    """Set every file's mtime far in the past, so a rewrite is visible."""
    for path in folder.iterdir():
        os.utime(path, (OLD_TIME, OLD_TIME))


@pytest.fixture
def project(tmp_path, capsys):
    """A spec with two ops, generated once: (spec path, output folder)."""
    spec = write_spec(tmp_path, OPS)
    code, _, err = run(capsys, "generate", spec)
    assert code == 0, err
    return spec, tmp_path / "generated"


# ------------------------------------------------------------------- exit codes, check


def test_generate_writes_every_module_then_is_up_to_date(project, capsys):
    spec, out = project
    assert sorted(p.name for p in out.iterdir()) == [
        "__init__.py",
        "batched_mat_mul.py",
        "scale.py",
    ]
    for path in out.iterdir():
        lines = path.read_text(encoding="utf-8").splitlines()
        assert lines[0] == HEADER
        assert lines[1].startswith("# source: ../symgrad.toml")
        assert re.fullmatch(r"# hash: sha256:[0-9a-f]{32}", lines[2])
        assert emit.intact(path.read_text(encoding="utf-8"))
    assert (
        "# source: ../symgrad.toml [ops.BatchedMatMul]" in (out / "batched_mat_mul.py").read_text()
    )

    code, stdout, _ = run(capsys, "generate", spec)
    assert code == 0 and "up to date" in stdout
    code, stdout, _ = run(capsys, "generate", spec, "--check")
    assert code == 0 and "up to date" in stdout


def test_check_names_stale_missing_and_orphaned_modules_and_writes_nothing(project, capsys):
    spec, out = project
    write_spec(
        spec.parent,
        {
            "BatchedMatMul": 'formula = "y[b,i,j] = A[b,i,k] * B[b,k,j] + A[b,i,j]"',  # stale
            "Squares": 'formula = "y[i] = x[i] * x[i]"',  # missing
        },  # Scale removed: orphaned
    )
    age(out)
    before = snapshot(out)

    code, stdout, stderr = run(capsys, "generate", spec, "--check")
    assert code == 1
    assert f"{out / 'batched_mat_mul.py'}: stale" in stdout
    assert f"{out / 'squares.py'}: missing" in stdout
    assert f"{out / 'scale.py'}: orphaned" in stdout
    assert f"{out / '__init__.py'}: stale" in stdout  # it lists the modules
    assert "4 file(s) out of date" in stderr and "symgrad generate" in stderr
    assert "---" not in stdout  # no diff without --diff
    assert snapshot(out) == before

    code, stdout, _ = run(capsys, "generate", spec, "--diff")
    assert code == 1
    assert f"--- a/{out / 'batched_mat_mul.py'}\n+++ b/{out / 'batched_mat_mul.py'}\n@@" in stdout
    assert "+    y[b,i,j] = A[b,i,k] * B[b,k,j] + A[b,i,j]" in stdout
    assert f"--- /dev/null\n+++ b/{out / 'squares.py'}" in stdout
    assert f"--- a/{out / 'scale.py'}\n+++ /dev/null" in stdout
    assert snapshot(out) == before

    code, _, _ = run(capsys, "generate", spec)
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "__init__.py",
        "batched_mat_mul.py",
        "squares.py",
    ]
    assert run(capsys, "generate", spec, "--check")[0] == 0


def test_check_on_a_missing_output_folder_creates_nothing(tmp_path, capsys):
    spec = write_spec(tmp_path, OPS)
    code, stdout, _ = run(capsys, "generate", spec, "--check")
    assert code == 1
    assert stdout.count(": missing") == 3
    assert not (tmp_path / "generated").exists()


@pytest.mark.parametrize(
    ("spec_text", "message"),
    [
        (None, "spec file not found"),
        ("out = [", "not valid TOML"),
        ('[ops.Bad]\nformula = "y[i] = x[i] +"', "[ops.Bad]"),
        ('[ops.Bad]\nformula = "y[i] = x[i]"\ncolour = 1', "unknown key 'colour'"),
    ],
)
def test_errors_exit_2(tmp_path, capsys, spec_text, message):
    spec = tmp_path / "symgrad.toml"
    if spec_text is not None:
        spec.write_text(spec_text, encoding="utf-8")
    for flags in ([], ["--check"], ["--diff"]):
        code, _, stderr = run(capsys, "generate", spec, *flags)
        assert code == 2
        assert stderr.startswith("error: ") and message in stderr
        assert "Traceback" not in stderr
    assert not (tmp_path / "generated").exists()


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--no-such-flag"])
    assert exc.value.code == 2


def test_out_flag_overrides_the_spec_and_spec_out_is_relative_to_the_spec(
    tmp_path, capsys, monkeypatch
):
    sub = tmp_path / "sub"
    sub.mkdir()
    spec = write_spec(sub, OPS, out="gen")
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "generate", "sub/symgrad.toml")[0] == 0
    assert (sub / "gen" / "batched_mat_mul.py").is_file()
    assert run(capsys, "generate", spec, "--out", tmp_path / "elsewhere")[0] == 0
    # The same module; its header names the spec by the path from its own folder.
    here = (sub / "gen" / "batched_mat_mul.py").read_text().splitlines()
    there = (tmp_path / "elsewhere" / "batched_mat_mul.py").read_text().splitlines()
    assert here[1] == "# source: ../symgrad.toml [ops.BatchedMatMul]"
    assert there[1] == "# source: ../sub/symgrad.toml [ops.BatchedMatMul]"
    assert here[3:] == there[3:]


@pytest.mark.parametrize(
    ("link", "out"),
    [("lnk", "lnk/gen"), ("gen", "gen"), ("generated", None)],
    ids=["link-in-the-path", "link-is-the-folder", "default-folder-is-a-link"],
)
def test_spec_out_through_a_symlink_to_outside_is_refused(tmp_path, capsys, link, out):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / link).symlink_to(elsewhere, target_is_directory=True)
    spec = write_spec(project, OPS, out=out) if out else project / "symgrad.toml"
    if out is None:
        spec.write_text("[ops.Scale]\n" + OPS["Scale"] + "\n", encoding="utf-8")
    for flags in ([], ["--check"], ["--force"]):
        code, _, stderr = run(capsys, "generate", spec, *flags)
        assert code == 2, stderr
        assert "leads outside the spec's folder through a symbolic link" in stderr
        assert str(elsewhere.resolve()) in stderr and "--out" in stderr
    assert list(elsewhere.iterdir()) == []
    # Asked for explicitly, the same folder is fine.
    assert run(capsys, "generate", spec, "--out", project / link)[0] == 0
    assert (elsewhere / "scale.py").is_file()


def test_spec_out_through_a_symlink_loop_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "lnk").symlink_to(tmp_path / "lnk")
    spec = write_spec(tmp_path, OPS, out="lnk/gen")
    code, _, stderr = run(capsys, "generate", spec)
    assert code == 2 and "cannot resolve `out`" in stderr and "internal error" not in stderr


def test_spec_out_through_a_symlink_that_stays_inside_is_fine(tmp_path, capsys):
    (tmp_path / "real").mkdir()
    (tmp_path / "lnk").symlink_to(tmp_path / "real", target_is_directory=True)
    spec = write_spec(tmp_path, OPS, out="lnk/gen")
    assert run(capsys, "generate", spec)[0] == 0
    assert (tmp_path / "real" / "gen" / "scale.py").is_file()


# ---------------------------------------------------------------------- determinism


def _permuted(text: str, order) -> str:
    """The spec text with its [ops.X] tables in another order."""
    head, *tables = re.split(r"(?m)^(?=\[ops\.)", text)
    return head + "".join(tables[i].rstrip("\n") + "\n\n" for i in order)


def test_output_is_identical_across_runs_and_the_order_of_ops(tmp_path, fresh_generations):
    """This process's TensorFlow package of the repo's spec with its ops in two other
    orders is the one a fresh process wrote from the spec as written (`fresh_generations`,
    seed 0): each is a second run as well (three fresh runs of the spec as written agree in
    `test_output_is_byte_identical_across_hash_seeds`)."""
    text = REPO_SPEC.read_text(encoding="utf-8")
    count = len(re.findall(r"(?m)^\[ops\.", text))
    assert count >= 4
    folder, process = fresh_generations["0"]
    assert process.returncode == 0, process.stderr
    reference = {
        p.name: p.read_bytes().decode("utf-8") for p in sorted((folder / "generated").iterdir())
    }
    for order in (list(reversed(range(count))), [*range(1, count), 0]):
        permuted = _permuted(text, order)
        assert permuted != text
        assert _generate(emit_spec(permuted, tmp_path, "c")) == reference


def _generate(spec) -> dict[str, str]:
    """The TensorFlow package of a spec, as `symgrad generate` would write it."""
    return pipeline.generate(spec, "tensorflow", spec_source(spec, output_folder(spec)))


def emit_spec(text: str, folder: Path, name: str):
    path = folder / name / "symgrad.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return load_spec(path)


@pytest.fixture(scope="module")
def fresh_generations(tmp_path_factory):
    """This repo's spec generated (all three targets) by three fresh processes at once, one
    per PYTHONHASHSEED of 0, 1 and 12345: seed 0's runs `NO_TENSORFLOW` (the command
    line's generate of its copy of the spec, --check of this repo's spec against the
    committed folders, and explain, with every framework's import refused), the others
    `python -m symgrad generate`. Seed -> (its folder, the finished process, with `stdout`
    and `stderr`). One generation serves the hash-seed, op-order, no-framework and
    up-to-date tests."""
    commands = {
        "0": [sys.executable, "-c", NO_TENSORFLOW, "symgrad.toml", str(REPO_SPEC)],
        "1": [sys.executable, "-m", "symgrad", "generate"],
        "12345": [sys.executable, "-m", "symgrad", "generate"],
    }
    runs = {}
    for seed, command in commands.items():
        folder = tmp_path_factory.mktemp(f"seed{seed}")
        shutil.copy(REPO_SPEC, folder / "symgrad.toml")
        env = {**os.environ, "PYTHONHASHSEED": seed}
        runs[seed] = (
            folder,
            subprocess.Popen(
                command,
                env=env,
                cwd=folder,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            ),
        )
    try:
        for _, process in runs.values():
            process.stdout, process.stderr = process.communicate(timeout=900)
    finally:
        for _, process in runs.values():
            process.kill()  # none is left running after a timeout (a no-op once finished)
    return runs


def test_output_is_byte_identical_across_hash_seeds(fresh_generations):
    """`symgrad generate` of this repo's spec (all three targets) under PYTHONHASHSEED 0, 1
    and 12345 (`fresh_generations`), and the committed folders: the same bytes."""
    outputs = {}
    for seed, (folder, process) in fresh_generations.items():
        assert process.returncode == 0, process.stderr
        outputs[seed] = {
            str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.py"))
        }
    assert outputs["0"] == outputs["1"] == outputs["12345"]
    ops = len(re.findall(r"(?m)^\[ops\.", REPO_SPEC.read_text()))
    assert len(outputs["0"]) == 3 * (ops + 1)
    for target in ("generated", "generated_torch", "generated_jax"):
        for name, text in outputs["0"].items():
            if name.startswith(f"{target}/"):
                assert text == (REPO / name).read_bytes(), name  # and the committed ones


def test_one_run_compiles_each_op_once_for_all_its_targets(tmp_path, capsys, monkeypatch):
    """The stages before render know no target: `generate` of three targets takes each op
    through them once, and writes what each target's generation alone would."""
    folders = {"tensorflow": "gen_tf", "pytorch": "gen_torch", "jax": "gen_jax"}
    targets = "".join(f'{t} = "{f}"\n' for t, f in folders.items())
    tables = "\n".join(f"[ops.{name}]\n{body}\n" for name, body in OPS.items())
    spec = tmp_path / "symgrad.toml"
    spec.write_text(f"[targets]\n{targets}\n{tables}", encoding="utf-8")
    compiled = []
    real = pipeline.compile_op
    monkeypatch.setattr(pipeline, "compile_op", lambda op: compiled.append(op.name) or real(op))
    assert run(capsys, "generate", spec)[0] == 0
    assert sorted(compiled) == sorted(OPS)
    monkeypatch.undo()
    for target, folder in folders.items():
        alone = pipeline.generate(load_spec(spec), target, "../symgrad.toml")
        written = {p.name: p.read_bytes().decode() for p in (tmp_path / folder).iterdir()}
        assert written == alone, target


# ------------------------------------------------------------ writing: only, all, atomic


def test_only_changed_files_are_rewritten(project, capsys):
    spec, out = project
    age(out)
    before = snapshot(out)
    assert run(capsys, "generate", spec)[0] == 0
    assert snapshot(out) == before  # nothing changed: nothing touched

    write_spec(
        spec.parent,
        {**OPS, "Scale": 'formula = "y[i] = alpha * x[i] * x[i]"\nattrs = { alpha = "float" }'},
    )
    code, stdout, _ = run(capsys, "generate", spec)
    assert code == 0 and stdout.split() == ["updated", str(out / "scale.py")]
    after = snapshot(out)
    assert after["batched_mat_mul.py"] == before["batched_mat_mul.py"]
    assert after["__init__.py"] == before["__init__.py"]
    assert after["scale.py"][0] != before["scale.py"][0]
    assert after["scale.py"][1] != OLD_TIME * 10**9


def test_a_failing_op_means_no_file_is_touched(project, capsys):
    spec, out = project
    (out / "helper.py").write_text("x = 1\n")  # foreign, to be left alone
    write_spec(
        spec.parent,
        {
            "BatchedMatMul": 'formula = "y[b,i,j] = A[b,i,k] * B[b,k,j] * 2"',  # would be updated
            "Added": 'formula = "y[i] = x[i]"',  # would be created
            "Broken": 'formula = "y[i] = x[i] * unknown_function(x[i])"',
        },
    )
    age(out)
    before = snapshot(out)
    code, _, stderr = run(capsys, "generate", spec)
    assert code == 2 and "[ops.Broken]" in stderr
    assert snapshot(out) == before


def _two_updates(project, capsys):
    """A project whose regeneration updates batched_mat_mul.py and scale.py (and nothing else)."""
    spec, out = project
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    write_spec(
        spec.parent,
        {
            "BatchedMatMul": 'formula = "y[b,i,j] = A[b,i,k] * B[b,k,j] * 3"',
            "Scale": 'formula = "y[i] = alpha * x[i] + x[i]"\nattrs = { alpha = "float" }',
        },
    )
    new = {name: text.encode() for name, text in _generate(load_spec(spec)).items()}
    assert {n for n in new if new[n] != old[n]} == {"batched_mat_mul.py", "scale.py"}
    return spec, out, old, new


def test_an_interrupted_write_leaves_every_file_old_or_new(project, capsys, monkeypatch):
    spec, out, old, new = _two_updates(project, capsys)
    real_replace = os.replace
    calls = []

    def replace_then_fail(source, target):
        calls.append(target)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace_then_fail)
    code, _, stderr = run(capsys, "generate", spec)
    monkeypatch.undo()

    assert code == 2 and "No space left on device" in stderr and "Traceback" not in stderr
    assert len(calls) == 2
    now = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(now) == set(old)  # no temporary file left behind, nothing extra
    for name, data in now.items():
        assert data in (old[name], new[name]), f"{name} is neither old nor new"
    assert sum(now[n] == new[n] != old[n] for n in now) == 1  # it did stop halfway

    assert run(capsys, "generate", spec)[0] == 0  # and the next run finishes the job
    assert {p.name: p.read_bytes() for p in out.iterdir()} == new


def test_a_failure_while_writing_a_temporary_file_leaves_nothing_behind(
    project, capsys, monkeypatch
):
    spec, out, old, _ = _two_updates(project, capsys)

    def fsync_fails(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync_fails)
    code, _, stderr = run(capsys, "generate", spec)
    monkeypatch.undo()
    assert code == 2 and "Input/output error" in stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old


def test_written_files_get_ordinary_permissions(tmp_path, capsys):
    umask = os.umask(0o022)
    try:
        spec = write_spec(tmp_path, OPS)
        assert run(capsys, "generate", spec)[0] == 0
    finally:
        os.umask(umask)
    for path in (tmp_path / "generated").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path.name


def test_a_crlf_checkout_counts_as_up_to_date(project, capsys):
    spec, out = project
    module = out / "batched_mat_mul.py"
    module.write_bytes(module.read_bytes().replace(b"\n", b"\r\n"))  # git autocrlf
    assert run(capsys, "generate", spec, "--check")[0] == 0


# ------------------------------------------------------- hand-edited, foreign, orphaned


def test_a_hand_edited_module_is_refused_unless_forced(project, capsys):
    spec, out = project
    module = out / "batched_mat_mul.py"
    edited = module.read_text().replace("def vjp(", "# tweaked\ndef vjp(")
    module.write_text(edited)
    before = snapshot(out)

    code, _, stderr = run(capsys, "generate", spec)
    assert code == 2
    assert str(module) in stderr and "by hand" in stderr and "--force" in stderr
    assert snapshot(out) == before

    code, stdout, _ = run(capsys, "generate", spec, "--check")
    assert code == 1 and f"{module}: stale and edited by hand" in stdout
    assert "(`symgrad generate --force` overwrites it)" in stdout
    assert snapshot(out) == before

    code, stdout, _ = run(capsys, "generate", spec, "--force")
    assert code == 0 and str(module) in stdout
    assert emit.intact(module.read_text()) and "# tweaked" not in module.read_text()


def test_an_edit_of_the_hash_line_alone_counts_as_a_hand_edit(project, capsys):
    spec, out = project
    module = out / "scale.py"
    module.write_text(re.sub(r"sha256:[0-9a-f]+", "sha256:" + "0" * 32, module.read_text()))
    assert not emit.intact(module.read_text())
    assert run(capsys, "generate", spec)[0] == 2
    assert run(capsys, "generate", spec, "--force")[0] == 0


def test_foreign_files_in_the_output_folder_are_never_touched(project, capsys):
    spec, out = project
    (out / "helpers.py").write_text("def helper():\n    return 1\n")
    (out / "notes.txt").write_text("not python\n")
    (out / "data.py").write_bytes(b"\xff\xfe not utf-8")
    (out / "sub.py").mkdir()
    age(out)
    foreign = {
        n: v for n, v in snapshot(out).items() if n in ("helpers.py", "notes.txt", "data.py")
    }

    write_spec(
        spec.parent, {"BatchedMatMul": OPS["BatchedMatMul"]}
    )  # Scale removed: scale.py deleted
    assert run(capsys, "generate", spec)[0] == 0
    after = snapshot(out)
    assert "scale.py" not in after
    assert {n: after[n] for n in foreign} == foreign
    assert (out / "sub.py").is_dir()


@pytest.mark.parametrize("flags", [[], ["--force"], ["--check"]])
def test_a_foreign_file_with_a_module_name_is_a_clear_error(tmp_path, capsys, flags):
    spec = write_spec(tmp_path, OPS)
    out = tmp_path / "generated"
    out.mkdir()
    (out / "scale.py").write_text("# my own scale module\n")
    before = snapshot(out)
    code, _, stderr = run(capsys, "generate", spec, *flags)
    assert code == 2
    assert str(out / "scale.py") in stderr and "not written by symgrad" in stderr
    assert snapshot(out) == before  # not even the other modules were written


@pytest.mark.parametrize("flags", [[], ["--force"], ["--check"], ["--diff"]])
def test_a_folder_generated_from_another_spec_is_refused_and_kept(tmp_path, capsys, flags):
    """`generate a.toml --out gen` then `generate b.toml --out gen` once deleted op_a.py."""
    out = tmp_path / "gen"
    (tmp_path / "a.toml").write_text('[ops.OpA]\nformula = "y[b] = A[b] * 2"\n')
    (tmp_path / "b.toml").write_text('[ops.OpB]\nformula = "y[b] = A[b] * 3"\n')
    assert run(capsys, "generate", tmp_path / "a.toml", "--out", out)[0] == 0
    before = snapshot(out)
    code, _, stderr = run(capsys, "generate", tmp_path / "b.toml", "--out", out, *flags)
    assert code == 2
    assert stderr.splitlines()[0] == (
        f"error: {out / '__init__.py'}: __init__.py was generated from ../a.toml, not from "
        "../b.toml (paths from this folder); refusing to overwrite it: give each spec its own "
        "output folder (`out` or --out), or, if ../a.toml was moved or renamed, delete the "
        "files generated from it"
    )
    assert snapshot(out) == before


def test_a_module_from_another_spec_is_never_overwritten_or_deleted(tmp_path, capsys):
    out = tmp_path / "gen"
    (tmp_path / "a.toml").write_text('[ops.OpA]\nformula = "y[b] = A[b] * 2"\n')
    assert run(capsys, "generate", tmp_path / "a.toml", "--out", out)[0] == 0
    (out / "__init__.py").unlink()  # without the package file, only the modules can tell
    op_a = (out / "op_a.py").read_bytes()

    # The same module name from another spec: refused, naming the file and its spec.
    (tmp_path / "b.toml").write_text('[ops.OpA]\nformula = "y[b] = A[b] * 3"\n')
    code, _, stderr = run(capsys, "generate", tmp_path / "b.toml", "--out", out, "--force")
    assert code == 2 and f"{out / 'op_a.py'}: op_a.py was generated from ../a.toml" in stderr
    assert sorted(p.name for p in out.iterdir()) == ["op_a.py"]

    # Another spec's module is not an orphan of this one: left alone.
    (tmp_path / "b.toml").write_text('[ops.OpB]\nformula = "y[b] = A[b] * 3"\n')
    code, stdout, _ = run(capsys, "generate", tmp_path / "b.toml", "--out", out)
    assert code == 0 and "deleted" not in stdout
    assert sorted(p.name for p in out.iterdir()) == ["__init__.py", "op_a.py", "op_b.py"]
    assert (out / "op_a.py").read_bytes() == op_a
    assert run(capsys, "generate", tmp_path / "b.toml", "--out", out, "--check")[0] == 0


@pytest.fixture
def nested(tmp_path, monkeypatch):
    """`sub/symgrad.toml` has written `sub/generated/inner.py`; `./symgrad.toml`, a spec with
    the same file name, writes into that folder too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    inner = write_spec(tmp_path / "sub", {"Inner": 'formula = "y[b] = A[b] * 2"'})
    assert main(["generate", str(inner)]) == 0
    (tmp_path / "symgrad.toml").write_text(
        '[targets]\ntensorflow = "sub/generated"\n\n[ops.Outer]\nformula = "y[b] = A[b] * 3"\n',
        encoding="utf-8",
    )
    return tmp_path / "sub" / "generated"


@pytest.mark.parametrize("flags", [[], ["--force"], ["--check"]])
def test_a_module_of_another_spec_with_the_same_file_name_is_kept(nested, capsys, flags):
    """Both specs are called symgrad.toml: ownership is the path to the spec file, so
    `./symgrad.toml` neither takes over the package nor deletes inner.py as its orphan."""
    out = nested
    inner = (out / "inner.py").read_bytes()
    assert inner.splitlines()[1] == b"# source: ../symgrad.toml [ops.Inner]"
    before = snapshot(out)
    code, _, stderr = run(capsys, "generate", "symgrad.toml", *flags)
    assert code == 2
    assert "__init__.py was generated from ../symgrad.toml, not from ../../symgrad.toml" in stderr
    assert snapshot(out) == before
    # Without the package file, only the modules can tell: inner.py is not an orphan.
    (out / "__init__.py").unlink()
    code, stdout, stderr = run(capsys, "generate", "symgrad.toml", *flags)
    assert (code, stderr) == ((1, stderr) if flags == ["--check"] else (0, ""))
    assert "inner.py" not in stdout
    assert (out / "inner.py").read_bytes() == inner


def test_a_module_of_another_spec_with_the_same_file_and_op_name_is_refused(nested, capsys):
    out = nested
    (out / "__init__.py").unlink()
    inner = (out / "inner.py").read_bytes()
    Path("symgrad.toml").write_text(
        '[targets]\ntensorflow = "sub/generated"\n\n[ops.Inner]\nformula = "y[b] = A[b] * 3"\n',
        encoding="utf-8",
    )
    code, _, stderr = run(capsys, "generate", "symgrad.toml", "--force")
    assert code == 2 and "inner.py was generated from ../symgrad.toml, not from" in stderr
    assert (out / "inner.py").read_bytes() == inner and not (out / "__init__.py").exists()


def _legacy(spec_path: Path) -> dict[str, str]:
    """The files an older symgrad wrote: `# source:` held the spec's file name alone."""
    return pipeline.generate(load_spec(spec_path), "tensorflow", spec_path.name)


def test_modules_from_before_source_paths_are_still_this_specs(project, capsys):
    """Modules whose header names the spec by file name are this spec's when it is the
    spec of that name beside their folder (the layout the old header implies): updated to
    the new header, and deleted as orphans, without --force."""
    spec, out = project
    for name, text in _legacy(spec).items():
        (out / name).write_text(text, encoding="utf-8")
        assert text.splitlines()[1].startswith("# source: symgrad.toml")
    code, stdout, _ = run(capsys, "generate", spec, "--check")
    assert code == 1 and "edited by hand" not in stdout
    write_spec(spec.parent, {"Scale": OPS["Scale"]})
    code, stdout, stderr = run(capsys, "generate", spec)
    assert (code, stderr) == (0, "")
    assert f"deleted {out / 'batched_mat_mul.py'}" in stdout
    assert f"updated {out / 'scale.py'}" in stdout
    assert (out / "scale.py").read_text().splitlines()[1] == "# source: ../symgrad.toml [ops.Scale]"


def test_modules_from_before_source_paths_of_another_spec_are_kept(nested, capsys):
    """Old headers of `sub/symgrad.toml`'s modules say `symgrad.toml`: that name vouches
    for the spec beside their folder only, never for `./symgrad.toml`."""
    out = nested
    for name, text in _legacy(out.parent / "symgrad.toml").items():
        (out / name).write_text(text, encoding="utf-8")
    before = snapshot(out)
    code, _, stderr = run(capsys, "generate", "symgrad.toml", "--force")
    assert code == 2 and "__init__.py was generated from symgrad.toml, not from" in stderr
    assert snapshot(out) == before
    (out / "__init__.py").unlink()
    inner = (out / "inner.py").read_bytes()
    code, stdout, _ = run(capsys, "generate", "symgrad.toml", "--force")
    assert code == 0 and "inner.py" not in stdout
    assert (out / "inner.py").read_bytes() == inner


def test_a_spec_reached_through_a_link_owns_its_modules_once(tmp_path, capsys):
    """The source path is between the real folder and the real spec: writing the same
    folder through a link to it, or from a link to the spec, is the same owner; a second
    spec reaching it through a link is not."""
    spec = write_spec(tmp_path, OPS)
    assert run(capsys, "generate", spec)[0] == 0
    (tmp_path / "alias").symlink_to(tmp_path / "generated", target_is_directory=True)
    (tmp_path / "link.toml").symlink_to(spec)
    assert run(capsys, "generate", spec, "--out", tmp_path / "alias", "--check")[0] == 0
    assert run(capsys, "generate", tmp_path / "link.toml", "--check")[0] == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "gen").symlink_to(tmp_path / "generated", target_is_directory=True)
    second = write_spec(other, {"Scale": OPS["Scale"]}, out="gen")
    before = snapshot(tmp_path / "generated")
    code, _, stderr = run(capsys, "generate", second, "--out", other / "gen")
    assert code == 2
    assert "was generated from ../symgrad.toml, not from ../other/symgrad.toml" in stderr
    assert snapshot(tmp_path / "generated") == before


def test_the_module_of_a_removed_op_is_deleted(project, capsys):
    spec, out = project
    write_spec(spec.parent, {"Scale": OPS["Scale"]})
    code, stdout, _ = run(capsys, "generate", spec)
    assert code == 0 and f"deleted {out / 'batched_mat_mul.py'}" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["__init__.py", "scale.py"]
    assert "batched_mat_mul" not in (out / "__init__.py").read_text()


def test_a_hand_edited_orphan_is_refused_unless_forced(project, capsys):
    spec, out = project
    module = out / "batched_mat_mul.py"
    module.write_text(module.read_text() + "\nEXTRA = 1\n")
    write_spec(spec.parent, {"Scale": OPS["Scale"]})
    before = snapshot(out)
    code, _, stderr = run(capsys, "generate", spec)
    assert code == 2 and str(module) in stderr and "--force" in stderr
    assert snapshot(out) == before
    code, stdout, _ = run(capsys, "generate", spec, "--check")
    assert code == 1 and f"{module}: orphaned" in stdout and "edited by hand" in stdout
    assert "(`symgrad generate --force` deletes it)" in stdout
    assert run(capsys, "generate", spec, "--force")[0] == 0
    assert not module.exists()


# ---------------------------------------------------------------- the generated package


def _ruff() -> str:
    return pipeline._ruff()


def _generated_folders() -> list[Path]:
    folders = [
        REPO / "generated",
        REPO / "generated_torch",
        REPO / "generated_jax",
        *sorted(GOLDEN.glob("*/expected")),
    ]
    assert len(folders) > 1, "no golden cases found"
    return folders


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_generated_code_passes_ruff_with_default_settings(command):
    folders = [str(f) for f in _generated_folders()]
    result = subprocess.run(
        [_ruff(), *command, "--isolated", "--no-cache", *folders],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_generated_package_lists_and_finds_its_modules():
    out = REPO / "generated"
    init = (out / "__init__.py").read_text(encoding="utf-8")
    assert init.startswith(HEADER)
    modules = sorted(p.stem for p in out.glob("*.py") if p.name != "__init__.py")
    listed = re.search(r"__all__ = \[(.*?)\]", init, re.DOTALL).group(1)
    assert sorted(re.findall(r'"(\w+)"', listed)) == modules
    sys.path.insert(0, str(REPO))
    try:
        for module in modules:  # found as package members, without running them (no TF)
            found = importlib.util.find_spec(f"generated.{module}")
            assert found is not None and Path(found.origin) == out / f"{module}.py"
    finally:
        sys.path.remove(str(REPO))


def test_the_committed_generated_modules_pass_ruff_check():
    """Every committed module passes `ruff check` with the project's rules, including the
    scan modules whose step is itself a scan (they embed another module's code: no
    repeated imports, no parentheses ast.unparse would add)."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or "ruff"
    folders = [str(REPO / f) for f in ("generated", "generated_torch", "generated_jax")]
    done = subprocess.run(
        [ruff, "check", *folders], capture_output=True, text=True, check=False, cwd=REPO
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_repo_generated_folder_is_up_to_date(fresh_generations):
    """This repo's CI fails when generated/ is stale: `symgrad generate --check` of this
    repo's spec (all three targets), run by seed 0's process of `fresh_generations`."""
    _, process = fresh_generations["0"]
    found = re.search(r"(?ms)^repo check:\n(.*)^repo check exit: (\d+)$", process.stdout)
    assert found, process.stdout + process.stderr
    stdout, code = found.groups()
    assert code == "0", (
        f"generated/ is stale:\n{stdout}\nrun `.venv/bin/python -m symgrad generate` in the repo "
        "root and commit the result"
    )


# -------------------------------------------------------------------------- TensorFlow


def _import_generated(tmp_path, package: str, op: str, formula: str, capsys):
    spec = write_spec(tmp_path, {op: f'formula = "{formula}"'}, out=package)
    assert run(capsys, "generate", spec)[0] == 0
    return spec


@pytest.fixture
def tf_importable(tmp_path, monkeypatch):
    """TensorFlow, with tmp_path importable and reloads reading source, not stale .pyc."""
    tf = pytest.importorskip("tensorflow")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    yield tf
    for name in [n for n in sys.modules if n.startswith("symgrad_probe_")]:
        del sys.modules[name]


def test_reloading_a_regenerated_module_replaces_its_gradient(tmp_path, capsys, tf_importable):
    tf = tf_importable
    from tensorflow.python.framework import ops as tf_ops

    registry = tf_ops._gradient_registry._registry
    op = "SymgradProbeReload"
    spec = _import_generated(tmp_path, "symgrad_probe_reload", op, "y[i] = 2 * x[i]", capsys)
    module = importlib.import_module("symgrad_probe_reload.symgrad_probe_reload")
    first = module.gradient
    assert registry[op]["type"] is first

    importlib.reload(module)  # importing again, unchanged: no duplicate-registration KeyError
    assert registry[op]["type"] is module.gradient

    write_spec(spec.parent, {op: 'formula = "y[i] = 5 * x[i] * x[i]"'}, out="symgrad_probe_reload")
    assert run(capsys, "generate", spec)[0] == 0
    importlib.reload(module)
    assert module.gradient is not first
    assert registry[op]["type"] is module.gradient
    (grad_x,) = module.vjp(tf.constant([1.0, 2.0]), tf.constant([1.0, 1.0]))
    assert grad_x.numpy().tolist() == [10.0, 20.0]  # d/dx 5x² = 10x: the new formula


def test_a_gradient_symgrad_did_not_register_is_not_replaced(tmp_path, capsys, tf_importable):
    tf = tf_importable
    op = "SymgradProbeForeign"
    tf.RegisterGradient(op)(lambda op_, grad: grad)
    _import_generated(tmp_path, "symgrad_probe_foreign", op, "y[i] = x[i]", capsys)
    with pytest.raises(KeyError, match="symgrad did not generate"):
        importlib.import_module("symgrad_probe_foreign.symgrad_probe_foreign")


NO_TENSORFLOW = textwrap.dedent(
    """
    import importlib.abc
    import sys

    class NoTensorFlow(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in FRAMEWORKS:
                raise ImportError(f"symgrad imported {name}")

    FRAMEWORKS = ("tensorflow", "keras", "tf_keras", "torch", "jax", "jaxlib")
    sys.meta_path.insert(0, NoTensorFlow())
    sys.modules["tensorflow"] = None

    from symgrad.cli import main

    spec, repo_spec = sys.argv[1:]
    code = main(["generate", spec])  # every target of the spec
    code |= main(["explain", "--op", "BatchedMatMul", "--spec", spec])
    # --check of this repo's spec against its committed folders (every target); whether
    # they are stale is test_repo_generated_folder_is_up_to_date's to say
    print("repo check:", flush=True)
    stale = main(["generate", repo_spec, "--check"])
    print(f"repo check exit: {stale}", flush=True)
    code |= stale not in (0, 1)
    loaded = sorted(m for m, v in sys.modules.items() if m.split(".")[0] in FRAMEWORKS and v)
    print("loaded:", loaded)
    sys.exit(code or bool(loaded))
    """
)


def test_generate_never_imports_tensorflow(fresh_generations):
    """Nor PyTorch or JAX: generating all three targets imports no framework (seed 0's
    process of `fresh_generations`)."""
    folder, result = fresh_generations["0"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loaded: []" in result.stdout
    for target in ("generated", "generated_torch", "generated_jax"):
        assert (folder / target / "batched_mat_mul.py").is_file()


# ------------------------------------------------------------------------- pre-commit


def _hooks() -> dict[str, dict[str, str]]:
    text = (REPO / ".pre-commit-hooks.yaml").read_text(encoding="utf-8")
    hooks = {}
    for block in re.split(r"(?m)^- ", text)[1:]:
        fields = dict(re.findall(r"(?m)^ {0,2}(\w+): (.+)$", block))
        hooks[fields["id"]] = fields
    return hooks


def test_the_pre_commit_hook_runs_check_mode_on_spec_changes():
    fields = _hooks()["symgrad-check"]
    assert fields["entry"] == "symgrad generate --check"
    assert fields["language"] == "python"
    assert fields["pass_filenames"] == "false"
    files = re.compile(fields["files"].strip("'\""))
    for path in ("symgrad.toml", "ops/symgrad.toml", "specs/layers.toml"):
        assert files.search(path), path
    for path in ("README.md", "src/model.py"):
        assert not files.search(path), path


def test_the_check_ops_hook_runs_symgrad_check_with_tensorflow():
    fields = _hooks()["symgrad-check-ops"]
    assert fields["entry"] == "symgrad check"
    assert fields["language"] == "python"
    assert "tensorflow" in fields["additional_dependencies"]
    files = re.compile(fields["files"].strip("'\""))
    for path in ("symgrad.toml", "generated/batched_mat_mul.py"):
        assert files.search(path), path
    assert not files.search("README.md")


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--check", "--diff"],  # stale: a diff to print
        ["generate", "--check"],
        ["generate"],  # writes, then names each file
        ["explain", "y[b,i,j] = A[b,i,k] * B[b,k,j]"],
        ["explain", "--op", "Scale", "--format", "markdown"],
        ["check", "--op", "Scale"],
    ],
)
def test_a_closed_output_pipe_is_a_quiet_exit(tmp_path, argv):
    """`symgrad generate --check --diff | head`: the reader closes the pipe early. Exit 141
    (128 + SIGPIPE, what the shell reports for `yes | head`), nothing on stderr."""
    spec = write_spec(tmp_path, OPS)
    if argv[0] == "check":
        assert main(["generate", str(spec)]) == 0
    read_end, write_end = os.pipe()
    os.close(read_end)  # closed before symgrad writes anything: every write fails
    try:
        result = subprocess.run(
            [sys.executable, "-m", "symgrad", *argv],
            cwd=tmp_path,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")
    if argv == ["generate"]:  # every file was written before anything was printed
        assert sorted(p.name for p in (tmp_path / "generated").iterdir()) == sorted(
            ["__init__.py", *MODULES.values()]
        )
    assert spec.exists()

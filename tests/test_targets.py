"""Targets: the spec's `[targets]` table, `--target`, and printers that cover the neutral IR.

Everything before rendering is shared by every framework; a target is a printer plus a
template. These tests pin the plumbing; each framework's numbers are in its own tests.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from symgrad import ir
from symgrad.cli import main
from symgrad.targets import TARGETS

FORMULA = 'formula = "y[b,i,j] = A[b,i,k] * B[b,k,j]"'


def write_spec(folder: Path, head: str) -> Path:
    spec = folder / "symgrad.toml"
    spec.write_text(textwrap.dedent(head) + f"\n[ops.MyMatMul]\n{FORMULA}\n", encoding="utf-8")
    return spec


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_printer_spells_every_neutral_op(name):
    printer = TARGETS[name].printer()
    for op in sorted(ir.OPS):
        args = (ir.Var("x"), ir.Var("y"), ir.Var("z"))[: 3 if op.endswith("_input") else 2]
        text = printer.code(ir.Call(op, args))
        compile(text, op, "eval")  # a Python expression
        assert "x" in text, (op, text)


def test_a_targets_table_names_the_folder(tmp_path, capsys):
    spec = write_spec(tmp_path, '[targets]\ntensorflow = "tf_modules"\n')
    code, _, err = run(capsys, "generate", str(spec))
    assert code == 0, err
    assert (tmp_path / "tf_modules" / "my_mat_mul.py").is_file()
    assert not (tmp_path / "generated").exists()
    code, out, _ = run(capsys, "generate", str(spec), "--check")
    assert code == 0 and "up to date" in out


@pytest.mark.parametrize(
    ("head", "message"),
    [
        ('[targets]\ntensorflw = "g"\n', "unknown target 'tensorflw' in `[targets]`"),
        ('out = "g"\n[targets]\ntensorflow = "g"\n', "`out` and `[targets]` both name"),
        ('[targets]\ntensorflow = "../g"\n', "`targets.tensorflow` '../g' must be a folder"),
        ("targets = 3\n", "`targets` must be a table"),
    ],
)
def test_a_bad_targets_table_is_one_line_and_exit_2(tmp_path, capsys, head, message):
    spec = write_spec(tmp_path, head)
    code, _, err = run(capsys, "generate", str(spec))
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert not any(tmp_path.glob("*/"))  # nothing written


def test_an_unknown_target_on_the_command_line_is_exit_2(tmp_path, capsys):
    spec = write_spec(tmp_path, "")
    code, _, err = run(capsys, "generate", str(spec), "--target", "mxnet")
    assert code == 2 and "unknown target 'mxnet'" in err
    assert not (tmp_path / "generated").exists()

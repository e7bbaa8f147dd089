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


# Ops a target may spell without their argument, and the one spelling each may take there:
# TF's and JAX's segment sums drop the id -1 whatever the row count (ir.OPS["dropped_id"]).
CONSTANT_IN = {("dropped_id", "tensorflow"): "-1", ("dropped_id", "jax"): "-1"}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_printer_spells_every_neutral_op(name):
    printer = TARGETS[name].printer()
    for op in sorted(ir.OPS):
        args = (ir.Var("x"), ir.Var("y"), ir.Var("z"))[: 3 if op.endswith("_input") else 2]
        text = printer.code(ir.Call(op, args))
        compile(text, op, "eval")  # a Python expression
        if (op, name) in CONSTANT_IN:
            assert text == CONSTANT_IN[op, name], (op, text)
        else:
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


FOLDERS = ["torch", "jax", "numpy", "tensorflow", "typing", "sub/torch", "conftest", "setup"]


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize("key", ["out", "targets.pytorch"])
def test_a_folder_that_shadows_a_package_is_refused(tmp_path, capsys, folder, key):
    """A target folder becomes a package of its name: `torch/__init__.py` beside a script
    replaces PyTorch for it, as an op named `Numpy` would replace NumPy."""
    head = f'out = "{folder}"\n' if key == "out" else f'[targets]\npytorch = "{folder}"\n'
    spec = write_spec(tmp_path, head)
    code, out, err = run(capsys, "generate", str(spec))
    name = folder.rsplit("/", 1)[-1]
    assert (code, out) == (2, "")
    assert f"`{key}` '{folder}' would make a package named {name}, which shadows" in err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["symgrad.toml"]


@pytest.mark.parametrize(
    ("folder", "message"),
    [
        (".", "`out` '.' is the spec's own folder"),
        ("./", "`out` './' is the spec's own folder"),
        ("gen/..", "must be a folder inside the spec's folder"),
        ("__pycache__", "`out` '__pycache__' is inside a `__pycache__` folder"),
        ("gen/__pycache__/x", "`out` 'gen/__pycache__/x' is inside a `__pycache__` folder"),
    ],
)
def test_the_specs_own_folder_and_pycache_are_refused(tmp_path, capsys, folder, message):
    spec = write_spec(tmp_path, f'out = "{folder}"\n')
    code, _, err = run(capsys, "generate", str(spec))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["symgrad.toml"]


def test_out_flag_refuses_the_specs_folder_and_shadowing_names(tmp_path, capsys, monkeypatch):
    spec = write_spec(tmp_path, "")
    monkeypatch.chdir(tmp_path)
    for out, message in [
        (".", "--out '.' is the spec's own folder"),
        (str(tmp_path), "is the spec's own folder"),
        ("numpy", "--out 'numpy' would make a package named numpy, which shadows a package"),
        ("x/typing", "would make a package named typing, which shadows a standard-library"),
    ]:
        code, _, err = run(capsys, "generate", str(spec), "--out", out)
        assert code == 2 and message in err, (out, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["symgrad.toml"]


def test_a_folder_that_is_a_link_to_a_shadowing_folder_is_refused(tmp_path, capsys):
    (tmp_path / "torch").mkdir()
    (tmp_path / "gen").symlink_to(tmp_path / "torch", target_is_directory=True)
    (tmp_path / "here").symlink_to(tmp_path, target_is_directory=True)
    for folder, message in [
        ("gen", "`out` 'gen', a link to 'torch', would make a package named torch"),
        ("here", "`out` 'here' is the spec's own folder (through a symbolic link)"),
    ]:
        spec = write_spec(tmp_path, f'out = "{folder}"\n')
        code, _, err = run(capsys, "generate", str(spec))
        assert code == 2 and message in err, err
    assert list((tmp_path / "torch").iterdir()) == []
    assert not (tmp_path / "__init__.py").exists()


@pytest.mark.parametrize(
    "flags", [[], ["--check"], ["--force"], ["--target", "tensorflow", "--target", "pytorch"]]
)
def test_two_targets_in_one_folder_through_a_link_are_refused(tmp_path, capsys, flags):
    """`pytorch = "alias"`, a link to the TensorFlow folder: the PyTorch module would replace
    the TensorFlow one. Folders are compared once links are resolved."""
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real", target_is_directory=True)
    spec = write_spec(tmp_path, '[targets]\ntensorflow = "real"\npytorch = "alias"\n')
    code, out, err = run(capsys, "generate", str(spec), *flags)
    assert (code, out) == (2, "")
    assert err.strip() == (
        f"error: {spec}: targets tensorflow ('real') and pytorch ('alias') are one folder, "
        f"'{(tmp_path / 'real').resolve()}', once "
        "symbolic links are resolved; give each target its own folder"
    )
    assert list((tmp_path / "real").iterdir()) == []


def test_two_targets_through_a_link_to_a_folder_not_yet_made_are_refused(tmp_path, capsys):
    (tmp_path / "alias").symlink_to(tmp_path / "later", target_is_directory=True)
    spec = write_spec(tmp_path, '[targets]\njax = "alias"\npytorch = "later"\n')
    code, _, err = run(capsys, "generate", str(spec))
    assert code == 2 and "targets jax" in err and "are one folder" in err
    assert not (tmp_path / "later").exists()


def test_an_unknown_target_on_the_command_line_is_exit_2(tmp_path, capsys):
    spec = write_spec(tmp_path, "")
    code, _, err = run(capsys, "generate", str(spec), "--target", "mxnet")
    assert code == 2 and "unknown target 'mxnet'" in err
    assert not (tmp_path / "generated").exists()


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_target_refuses_a_bool_or_float_int_attr(target, tmp_path):
    """The same call-time checks in every target: `s=True` is not a stride of 1, `s=2.5`
    not 2, and `s=0` is named as the attr that must be positive."""
    import importlib.util

    import numpy as np

    spec = tmp_path / "symgrad.toml"
    spec.write_text(
        "[ops.StridedRead]\n"
        'formula = "y[b,i] = x[b, s*i]"\n'
        'attrs = { s = "int" }\n'
        'ranges = { i = "x.shape[1] // s" }\n',
        encoding="utf-8",
    )
    assert main(["generate", str(spec), "--target", target, "--out", str(tmp_path / "out")]) == 0
    path = tmp_path / "out" / "strided_read.py"
    module_spec = importlib.util.spec_from_file_location(f"strided_read_{target}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    x = np.arange(12.0).reshape(2, 6)
    if target == "pytorch":
        import torch

        x = torch.tensor(x)
    for bad in (True, 2.5):
        with pytest.raises(TypeError, match=r"StridedRead: attr s "):
            module.forward(x, s=bad)
    with pytest.raises(ValueError, match=r"StridedRead: attr s is 0; .* must be positive"):
        module.forward(x, s=0)
    np.testing.assert_array_equal(np.asarray(module.forward(x, s=np.int64(2))), x[:, ::2])


THREE = """
[targets]
tensorflow = "gen_tf"
pytorch = "gen_torch"
jax = "gen_jax"
"""


def test_check_force_and_all_or_nothing_hold_across_targets(tmp_path, capsys):
    """One spec, three folders: a module edited by hand in one target stops the whole run
    (no target is written), `--check` names it, `--force` rewrites it; `--out` needs one
    target."""
    spec = write_spec(tmp_path, THREE)
    code, out, err = run(capsys, "generate", str(spec))
    assert code == 0, err
    for folder in ("gen_tf", "gen_torch", "gen_jax"):
        assert (tmp_path / folder / "my_mat_mul.py").is_file()
    edited = tmp_path / "gen_jax" / "my_mat_mul.py"
    edited.write_text(edited.read_text() + "# tweaked\n")
    text = spec.read_text().replace("A[b,i,k] * B[b,k,j]", "A[b,i,k] * B[b,k,j] * 2")
    spec.write_text(text)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*.py")}
    code, _, err = run(capsys, "generate", str(spec))
    assert code == 2 and "gen_jax/my_mat_mul.py" in err and "changed by hand" in err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.py")} == before  # nothing written
    code, out, _ = run(capsys, "generate", str(spec), "--check")
    assert code == 1
    assert "gen_jax/my_mat_mul.py: stale and edited by hand" in out
    assert "gen_torch/my_mat_mul.py: stale" in out and "gen_tf/my_mat_mul.py: stale" in out
    code, _, err = run(capsys, "generate", str(spec), "--force")
    assert code == 0, err
    assert run(capsys, "generate", str(spec), "--check")[0] == 0
    code, _, err = run(capsys, "generate", str(spec), "--out", str(tmp_path / "x"))
    assert code == 2 and "--out names one folder, and 3 targets are selected" in err
    code, _, err = run(
        capsys, "generate", str(spec), "--target", "jax", "--out", str(tmp_path / "x")
    )
    assert code == 0, err
    assert (tmp_path / "x" / "my_mat_mul.py").read_bytes() == edited.read_bytes()


def _conds(block: ir.Block) -> list[ir.Cond]:
    found = []

    def collect(e):
        if isinstance(e, ir.Cond):
            found.append(e)

    for step in block.steps:
        ir.rewrite(step.value, collect)
    return found


def test_targets_without_branches_get_the_otherwise_branch_and_no_predicate():
    """A lookup's masked read is `Cond(all ids in bounds, fast read, masked read)`; for
    PyTorch and JAX (`branches = False`) render takes `ir.without_conds`: the masked read
    alone, equal to the fast one whenever the predicate holds, and no `reduce_all` step."""
    from symgrad.pipeline import compile_op
    from symgrad.spec import OpSpec

    op = OpSpec("Lookup", ("y[b,t,d] = W[ids[b,t], d]",), None, (), (), "t")
    module = compile_op(op)
    (cond,) = _conds(module.forward)
    stripped = ir.without_conds(module)
    assert not _conds(stripped.forward) and not _conds(stripped.backward)
    assert cond.otherwise in {s.value for s in stripped.forward.steps}
    for block in (stripped.forward, stripped.backward):
        assert not any(
            isinstance(s.value, ir.Call) and s.value.function == "reduce_all" for s in block.steps
        )
    assert stripped.forward.returns == module.forward.returns
    assert {n for n, t in TARGETS.items() if not t.printer.branches} == {"pytorch", "jax"}

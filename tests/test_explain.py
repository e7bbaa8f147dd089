"""`symgrad explain`: the partials with their deltas, the contraction with grad, the einsum.

Exact lines for the batched matmul in each format, the special shapes (diagonal, composite,
several outputs, no_gradient, intermediates), errors, and LaTeX that compiles (structural
checks always; a real `pdflatex` run where one is installed).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from symgrad.cli import main

TESTS = Path(__file__).resolve().parent
REPO_SPEC = TESTS.parent / "symgrad.toml"
GOLDEN = TESTS / "golden"
MATMUL = "y[b,i,j] = A[b,i,k] * B[b,k,j]"


def einsum_of(text: str, target: str) -> tuple:
    """`target = tf.einsum(...)` in `text`, up to operand order and letter names."""
    match = re.search(rf'^\s*{target} = tf\.einsum\("([^"]+)", ([^)]+)\)$', text, re.MULTILINE)
    assert match, f"no einsum for {target} in:\n{text}"
    inputs, output = match.group(1).split("->")
    pairs = sorted(zip(match.group(2).split(", "), inputs.split(","), strict=True))
    letters: dict[str, str] = {}
    for char in output + "".join(subscripts for _, subscripts in pairs):
        letters.setdefault(char, chr(ord("a") + len(letters)))
    relabel = str.maketrans(letters)
    return output.translate(relabel), tuple((n, s.translate(relabel)) for n, s in pairs)


GRAD_A = einsum_of('grad_A = tf.einsum("bkj,bij->bik", B, grad_y)', "grad_A")
GRAD_B = einsum_of('grad_B = tf.einsum("bik,bij->bkj", A, grad_y)', "grad_B")


def explain(capsys, *argv) -> str:
    code = main(["explain", *map(str, argv)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_matmul_text(capsys):
    text = explain(capsys, MATMUL)
    lines = [line.strip() for line in text.splitlines()]
    assert "gradient(op, grad_y) returns (grad_A, grad_B), the vector-Jacobian product:" in lines
    # A: the partial with its deltas, the contraction, the eliminated form, the einsum.
    a = lines.index("Gradient of A:")
    assert lines[a + 1 : a + 8] == [
        "partial derivatives (δ is the Kronecker delta):",
        "∂y[b,i,j]/∂A[b',i',k'] = Σ_k B[b,k,j] · δ(b,b')δ(i,i')δ(k,k')",
        "contracted with the incoming gradient:",
        "grad_A[b',i',k'] = Σ_b,i,j grad_y[b,i,j] · ∂y[b,i,j]/∂A[b',i',k']",
        "deltas eliminated:",
        "grad_A[b,i,k] = Σ_j grad_y[b,i,j]*B[b,k,j]",
        "TensorFlow:",
    ]
    assert einsum_of(lines[a + 8], "grad_A") == GRAD_A
    b = lines.index("Gradient of B:")
    assert "∂y[b,i,j]/∂B[b',k',j'] = Σ_k A[b,i,k] · δ(b,b')δ(k,k')δ(j,j')" in lines[b:]
    assert "grad_B[b,k,j] = Σ_i grad_y[b,i,j]*A[b,i,k]" in lines[b:]
    assert einsum_of("\n".join(lines[b:]), "grad_B") == GRAD_B


def test_op_from_a_spec_explains_the_same(capsys, monkeypatch):
    spec = GOLDEN / "matmul" / "symgrad.toml"
    from_formula = explain(capsys, MATMUL)
    assert explain(capsys, "--op", "BatchedMatMul", "--spec", spec) == from_formula
    assert explain(capsys, "--op", "BatchedMatMul", spec) == from_formula  # SPEC positional
    monkeypatch.chdir(spec.parent)
    assert explain(capsys, "--op", "BatchedMatMul") == from_formula  # ./symgrad.toml


def test_the_eliminated_form_is_the_generated_docstring_line(capsys):
    text = explain(capsys, "--op", "BatchedMatMul", GOLDEN / "matmul" / "symgrad.toml")
    module = (GOLDEN / "matmul" / "expected" / "batched_mat_mul.py").read_text(encoding="utf-8")
    for line in (
        "grad_A[b,i,k] = Σ_j grad_y[b,i,j]*B[b,k,j]",
        "grad_B[b,k,j] = Σ_i grad_y[b,i,j]*A[b,i,k]",
    ):
        assert f"    {line}\n" in text and f"    {line}\n" in module


def test_matmul_markdown(capsys):
    text = explain(capsys, MATMUL, "--format", "markdown")
    assert text.startswith("# Gradient\n")
    assert "`gradient(op, grad_y) returns (grad_A, grad_B)`" in text
    assert "## Gradient of A\n" in text and "## Gradient of B\n" in text
    assert "```text\n∂y[b,i,j]/∂A[b',i',k'] = Σ_k B[b,k,j] · δ(b,b')δ(i,i')δ(k,k')\n```" in text
    assert "```text\ngrad_A[b,i,k] = Σ_j grad_y[b,i,j]*B[b,k,j]\n```" in text
    assert "TensorFlow:\n\n```python\ngrad_A = tf.einsum(" in text
    assert einsum_of(text, "grad_A") == GRAD_A
    assert text.count("```") % 2 == 0


def test_matmul_latex(capsys):
    text = explain(capsys, MATMUL, "--format", "latex")
    assert (
        r"\frac{\partial y_{b,i,j}}{\partial A_{b',i',k'}} &= "
        r"\sum_{k} B_{b,k,j} \, \delta_{b,b'} \delta_{i,i'} \delta_{k,k'}" in text
    )
    assert (
        r"\bar{A}_{b',i',k'} &= \sum_{b,i,j} \bar{y}_{b,i,j} \, "
        r"\frac{\partial y_{b,i,j}}{\partial A_{b',i',k'}}" in text
    )
    assert r"\bar{A}_{b,i,k} &= \sum_{j} \bar{y}_{b,i,j} B_{b,k,j}" in text
    assert "\\begin{verbatim}\ngrad_A = tf.einsum(" in text
    assert einsum_of(text, "grad_A") == GRAD_A
    assert r"\paragraph{Gradient of $A$}" in text


def test_diagonal_gradients_keep_a_delta_and_use_eye(capsys):
    text = explain(capsys, "--op", "SinDiagOuter", GOLDEN / "diagonal" / "symgrad.toml")
    assert "∂y[b,i,j]/∂A[b',i',i''] = cos(A[b,i,i])*B[b,j,j] · δ(b,b')δ(i,i')δ(i,i'')" in text
    assert "grad_A[b,i,i'] = Σ_j δ(i,i')*grad_y[b,i,j]*cos(A[b,i,i])*B[b,j,j]" in text
    assert "tf.eye(" in text


def test_composite_indices_show_the_split_grad(capsys):
    text = explain(capsys, "--op", "BatchKron", GOLDEN / "kron" / "symgrad.toml")
    assert "∂y[b,(i,k),(j,l)]/∂A[b',i',j'] = B[b,k,l] · δ(b,b')δ(i,i')δ(j,j')" in text
    assert "grad_A[b,i,j] = Σ_k,l grad_y[b,i,k,j,l]*B[b,k,l]" in text
    assert "grad_y[b,i,k,j,l] is grad_y with its composite axes split" in text
    assert "grad_y = tf.reshape(grad_y, [_n_b, _n_i, _n_k, _n_j, _n_l])" in text


def test_several_outputs_and_no_gradient(capsys):
    text = explain(capsys, "--op", "MatMulAndSquares", GOLDEN / "multi_output" / "symgrad.toml")
    assert "gradient(op, grad_y, grad_z) returns (grad_A, grad_B)" in text
    a = text.split("Gradient of A:")[1].split("Gradient of B:")[0]
    assert "∂y[b,i,j]/∂A[" in a and "∂z[b,i]/∂A[" in a
    assert "grad_A[b,i,k] = Σ_j grad_y[b,i,j]*B[b,k,j] + grad_z[b,i]*2*A[b,i,k]" in a

    text = explain(capsys, "--op", "Masked", GOLDEN / "no_gradient" / "symgrad.toml")
    assert "gradient(op, grad_y) returns (grad_A, None)" in text
    assert "grad_M[b,i,j] = None (no_gradient)" in text


def test_intermediates_are_explained_first(capsys):
    text = explain(capsys, "y[b,i] = exp(sum(A[b,i,k]*B[b,k], k))")
    assert "_s1[b,i] = Σ_k A[b,i,k]*B[b,k]" in text
    assert text.index("Gradient of _s1 (intermediate):") < text.index("Gradient of A:")
    assert "∂y[b,i]/∂_s1[b',i'] = exp(_s1[b,i]) · δ(b,b')δ(i,i')" in text
    assert "grad_A[b,i,k] = _grad_s1[b,i]*B[b,k]" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "explain needs a FORMULA or --op NAME"),
        (["--op", "Nope", "--spec", GOLDEN / "matmul" / "symgrad.toml"], "no op 'Nope'"),
        (["y[i] = x[i] +"], "formula"),
        ([MATMUL, "--spec", "symgrad.toml"], "--spec goes with --op"),
        (["--op", "X", "a.toml", "--spec", "b.toml"], "give the spec file once"),
        (["--op", "X", "--spec", "/no/such/spec.toml"], "spec file not found"),
    ],
)
def test_errors_exit_2(capsys, argv, message):
    code = main(["explain", *map(str, argv)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


# ------------------------------------------------------------------------------ LaTeX


# Beyond the repo's ops: constants, every kind of function, masks, means, broadcasting.
LATEX_FORMULAS = (
    "y[b,i] = pi * A[b,i] + e ** A[b,i]",
    "y[b,i] = max(A[b,i], B[b,i]) + min(A[b,i], 0.25 * B[b,i])",
    "y[b,i] = abs(A[b,i]) * erf(A[b,i]) + softplus(A[b,i]) / sigmoid(A[b,i])",
    "y[b,i] = A[b,i] - mean(A[b,k], k)",
    "y[batch,i] = weights[i,k] * x1[batch,k]",
)


def _latex_samples(capsys) -> dict[str, str]:
    """LaTeX of every op of the repo's spec and of LATEX_FORMULAS."""
    ops = re.findall(r"(?m)^\[ops\.(\w+)\]", REPO_SPEC.read_text(encoding="utf-8"))
    samples = {op: explain(capsys, "--op", op, REPO_SPEC, "--format", "latex") for op in ops}
    for formula in LATEX_FORMULAS:
        samples[formula] = explain(capsys, formula, "--format", "latex")
    return samples


def test_latex_is_well_formed(capsys):
    for op, text in _latex_samples(capsys).items():
        body = "\n".join(line for line in text.splitlines() if not line.startswith("%"))
        math = re.findall(r"\\begin\{align\*\}\n(.*?)\n\\end\{align\*\}", body, re.DOTALL)
        assert math, op
        outside = re.sub(r"\\begin\{(align\*|verbatim)\}.*?\\end\{\1\}", "", body, flags=re.DOTALL)
        assert body.isascii(), f"{op}: non-ASCII outside comments"
        assert body.count(r"\begin{") == body.count(r"\end{"), op
        for block in math:
            assert block.count("{") == block.count("}"), f"{op}: unbalanced braces"
            assert block.count(r"\left") == block.count(r"\right"), op
            assert not re.search(r"_\{[^{}]*\}_", block), f"{op}: double subscript"
            assert "*" not in block and "[" not in block.replace(r"\left[", ""), op
        assert not re.search(r"(?<!\\)[_#&]", outside.replace("$", "")), f"{op}: bare _#&"


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex not installed")
def test_latex_compiles(capsys, tmp_path):
    fragments = _latex_samples(capsys)
    document = "\n".join(
        [
            r"\documentclass{article}",
            r"\usepackage{amsmath}",
            r"\begin{document}",
            *fragments.values(),
            r"\end{document}",
            "",
        ]
    )
    (tmp_path / "explain.tex").write_text(document, encoding="utf-8")
    result = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "explain.tex"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Missing character" not in (tmp_path / "explain.log").read_text(errors="replace")


def test_explain_formula_takes_bare_names_as_float_attrs(capsys):
    from symgrad.cli import main

    assert main(["explain", "y[b,i] = alpha * A[b,i] ** 2"]) == 0
    out = capsys.readouterr().out
    assert "∂y[b,i]/∂A[b',i'] = 2*alpha*A[b,i] · δ(b,b')δ(i,i')" in out
    assert main(["explain", "y[b,i] = A[b,i] + nope(A[b,i])"]) == 2


# ------------------------------------------------------------------- the forward code


def _assignments(source: str) -> list[str]:
    """The assignments of Python source, normalised by the syntax tree (formatting aside)."""
    return [ast.dump(s) for s in ast.parse(source).body if isinstance(s, ast.Assign)]


def _forward_lines(text: str) -> list[str]:
    block = text.split("the body of the generated _compute):\n", 1)[1].split("\n\n", 1)[0]
    return [line.strip() for line in block.splitlines()]


# Module helpers and the TF op `explain` shows for each: the helpers check sizes (a
# kernel on an empty axis, an output too large to allocate) around the same call.
_HELPERS = {
    "_convolution": "tf.nn.convolution",
    "_depthwise_conv2d": "tf.nn.depthwise_conv2d",
    "_einsum": "tf.einsum",  # a product where every summed axis has one position
    "_gather": "tf.gather",
    "_segment_sum": "tf.math.unsorted_segment_sum",
}


class _Explained(ast.NodeTransformer):
    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name is not None:  # a recurrence step's copy of a helper: `_step_step_gather`
            name = re.sub(r"^(?:_step)+(?=_)", "", name)
        if name in ("_size_limit", "_shift"):  # _shift(positions, start): at start 0, positions
            return node.args[0]
        if name == "_whole":  # x itself, behind an EnsureShape only in graph mode
            return node.args[0]
        if name == "_segment_extremum":  # (kernel, data, ids, n): -inf for an empty one
            return ast.Call(func=node.args[0], args=node.args[1:], keywords=[])
        if name in _HELPERS:
            node.func = ast.parse(_HELPERS[name], mode="eval").body
        return node

    def visit_IfExp(self, node: ast.IfExp):
        # A tiled op's one program (`tile_once`) takes a chunk's length, else the op's own
        # size: explain shows the whole op, the branch taken when no length is given.
        self.generic_visit(node)
        test = node.test
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id.endswith("tile_length")
            and isinstance(test.ops[0], ast.Is)
        ):
            return node.body
        return node


def _as_explained(tree: ast.Module) -> ast.Module:
    """A module's code as explain shows it: the TF ops its helpers call, and a tiled op's
    one program at its defaults (tile_start 0, no tile_length: the whole op)."""
    return ast.fix_missing_locations(_Explained().visit(tree))


@pytest.mark.parametrize(
    "op", re.findall(r"(?m)^\[ops\.(\w+)\]", REPO_SPEC.read_text(encoding="utf-8"))
)
def test_the_forward_code_shown_is_the_generated_compute(op, capsys):
    from symgrad.spec import snake_case

    text = explain(capsys, "--op", op, REPO_SPEC)
    module = (REPO_SPEC.parent / "generated" / f"{snake_case(op)}.py").read_text("utf-8")
    # explain prints sizes self-contained; modules read them through their `_dim` helper
    # (a recurrence's step through its prefixed copy, `_step_dim` or `_step_step_dim`).
    module = re.sub(r"\b(?:_step)*_dim\((\w+), (\d+)\)", r"tf.shape(\1)[\2]", module)
    # A max or min of sizes is the module's `_int_max` / `_int_min` (a Python int for
    # Python ints), tf.maximum / tf.minimum in explain.
    module = re.sub(r"(?<!def )\b_int_(max|min)\(", r"tf.\1imum(", module)
    # A recurrence's module computes its step in `_step_compute`, which explain shows; a
    # recurrence whose step is a recurrence (soft-DTW's rows) in `_step_step_compute`; a
    # coupled recurrence (RWKV's scan) in `_step_coupled_compute`, around which
    # `_step_compute` stacks the states.
    names = ("_step_step_compute", "_step_coupled_compute", "_step_compute", "_compute")
    name = next(n for n in names if f"def {n}(" in module)
    functions = {
        node.name: node
        for node in _as_explained(ast.parse(module)).body
        if isinstance(node, ast.FunctionDef)
    }
    compute = functions[name]
    # The template's own lines: attrs cast to the dtype, int attrs kept for index arithmetic.
    attrs = {a.arg for a in compute.args.kwonlyargs}
    attrs |= {f"_int_{a}" for a in attrs}

    def steps(function):
        return [
            s
            for s in function.body
            if isinstance(s, ast.Assign)
            and isinstance(s.targets[0], ast.Name)  # not the unpacking of `_once`
            and not (attrs & {t.id for t in s.targets})
        ]

    want = [ast.dump(s) for s in steps(compute)]
    assert want, op
    got = _assignments("\n".join(_forward_lines(text)))
    tiers = [f for f in ("_compute_once", "_compute_outer_once") if f in functions]
    if name != "_compute" or not tiers:
        assert got == want
        return
    # Chunk-invariant steps computed before a chunk loop (`tile_hoist`, and its second
    # tier for a loop in two levels): the program is `_compute_once`'s steps,
    # `_compute_outer_once`'s and `_compute`'s, each in its order, with the parts taken
    # out of later steps (`_once1`, `_shared1`, ...) back in their place.
    found = {f: steps(functions[f]) for f in tiers}
    parts = {
        s.targets[0].id: s.value
        for f in tiers
        for s in found[f]
        if s.targets[0].id.startswith(("_once", "_shared"))
    }

    class Inline(ast.NodeTransformer):
        def visit_Name(self, node):  # a part may hold an earlier tier's parts
            if node.id not in parts:
                return node
            return self.visit(ast.parse(ast.unparse(parts[node.id]), mode="eval").body)

    def inlined(s):
        return ast.dump(Inline().visit(ast.parse(ast.unparse(s)).body[0]))

    hoisted = []
    for f in tiers:
        tier = [inlined(s) for s in found[f] if s.targets[0].id not in parts]
        assert [a for a in got if a in tier] == tier, f
        hoisted += tier
    rest = [inlined(s) for s in steps(compute)]
    assert [a for a in got if a not in hoisted] == rest


def test_the_forward_of_pairwise_distances_shows_the_expansion(capsys):
    """`sum((x_i - x_j)**2, k)` is computed as x² sums and a Gram matrix: say so."""
    lines = _forward_lines(explain(capsys, "y[b,i,j] = sum((x[b,i,k] - x[b,j,k])**2, k)"))
    # A Gram matrix of the points (centred first, for float32 accuracy), never x_i - x_j.
    assert any(re.search(r'tf\.einsum\("(\w+),(\w+)->\w+", (\w+), \3\)', line) for line in lines)
    assert not any(re.search(r"x\[[^\]]*\] - x\[", line) for line in lines), lines


def test_the_forward_is_in_every_format(capsys):
    markdown = explain(capsys, MATMUL, "--format", "markdown")
    assert "Forward, in TensorFlow (the body of the generated _compute):" in markdown
    assert einsum_of(markdown, "y")[0] == einsum_of('y = tf.einsum("bik,bkj->bij", A, B)', "y")[0]
    latex = explain(capsys, MATMUL, "--format", "latex")
    assert "Forward, in TensorFlow (the body of the generated \\_compute):" in latex
    assert "\\begin{verbatim}\ny = tf.einsum(" in latex


# ------------------------------------------------------------------------ command line


def test_version(capsys):
    import tomllib

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    version = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out == f"symgrad {version}\n"


def test_explain_help_has_one_usage_line_and_explains_each_option(capsys):
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    text = capsys.readouterr().out
    assert text.startswith(
        "usage: symgrad explain (FORMULA [--attr NAME=TYPE]... [--range INDEX=SIZE]... "
        "[--inputs A,B,...] [--no-gradient NAME]... [--float NAME]... | "
        "--op NAME [--spec SPEC]) [--format FORMAT]\n"
    )
    for option in (
        "FORMULA",
        "--attr NAME=TYPE",
        "--range INDEX=SIZE",
        "--inputs A,B,...",
        "--no-gradient NAME",
        "--float NAME",
        "--op NAME",
        "--spec SPEC",
        "--format FORMAT",
    ):
        line = next(line for line in text.splitlines() if line.strip().startswith(option))
        assert len(line.strip()) > len(option) + 10, f"no help for {option}: {line!r}"
    assert "markdown" in text and "latex" in text


def test_explain_takes_a_formula_or_an_op_not_both(capsys):
    spec = GOLDEN / "matmul" / "symgrad.toml"
    code = main(["explain", MATMUL, "--op", "BatchedMatMul", "--spec", str(spec)])
    err = capsys.readouterr().err
    assert code == 2 and "explain takes a FORMULA or --op NAME, not both" in err


# ------------------------------------------------------- declarations of a bare formula

DECLARED = [
    # (formula, flags, the same declarations in a spec's op table)
    (
        "y[b,i,o] = sum(x[b, s*i + k, c] * w[k,c,o], k, c)",
        ["--attr", "s=int"],
        'attrs = { s = "int" }',
    ),
    ("y[b,i] = max(x[b, 2*i + u], u)", ["--range", "u=2"], 'ranges = { u = "2" }'),
    (
        "y[b,i] = max(x[b, s*i + d*u], u)",
        ["--attr", "s=int", "--attr", "d=int", "--range", "u=3"],
        'attrs = { s = "int", d = "int" }\nranges = { u = "3" }',
    ),
    (
        "y[b,i] = sum(x[b, i + k - p] * w[k], k) * alpha",
        ["--attr", "p=int", "--attr", "alpha=float", "--range", "i=x.shape[1] - 2"],
        'attrs = { p = "int", alpha = "float" }\nranges = { i = "x.shape[1] - 2" }',
    ),
    (
        "y[b,i] = x[b,i] * m[b,i]",
        ["--inputs", "m,x", "--no-gradient", "m"],
        'inputs = ["m", "x"]\nno_gradient = ["m"]',
    ),
]


@pytest.mark.parametrize(("formula", "flags", "table"), DECLARED)
def test_explain_declares_attrs_ranges_and_inputs_of_a_formula(
    capsys, tmp_path, formula, flags, table
):
    """Strided and windowed formulas are explained with their int attrs and ranges
    declared by flags, exactly as the op of a spec with those declarations."""
    assert main(["explain", formula, *flags]) == 0
    text = capsys.readouterr().out
    spec = tmp_path / "s.toml"
    spec.write_text(f'[ops.Probe]\nformula = "{formula}"\n{table}\n', encoding="utf-8")
    assert main(["explain", "--op", "Probe", "--spec", str(spec)]) == 0
    assert text == capsys.readouterr().out
    assert text.startswith(f"Formula:\n  {formula}\n") and "Gradient of" in text


def test_a_strided_formula_is_explained_once_its_stride_is_an_int_attr(capsys):
    formula = "y[b,i,o] = sum(x[b, s*i + k, c] * w[k,c,o], k, c)"
    assert main(["explain", formula]) == 2
    assert "a product of indices" in capsys.readouterr().err
    assert main(["explain", formula, "--attr", "s=int"]) == 0
    text = capsys.readouterr().out
    assert "_g1[b,i,k,c] = x[b,s*i + k,c] (0 outside x)" in text
    assert "grad_w[k,c,o] = Σ_b,i grad_y[b,i,o]*_g1[b,i,k,c]" in text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--attr", "s=integer"], "error: formula: attr 's' has type 'integer'; known types"),
        (["--attr", "s"], "error: --attr 's': expected NAME=TYPE"),
        (["--range", "u="], "error: --range 'u=': expected INDEX=SIZE"),
        (["--range", "q=3"], "`ranges` names index 'q', which no formula uses"),
        (["--range", "u=x.shape[9]"], "reads x.shape[9], but 'x' has rank 2"),
        (["--attr", "2s=int"], "error: formula: attr name '2s' must be a plain ASCII"),
        (["--no-gradient", "zz"], "error: formula: `no_gradient` names 'zz', which is not an"),
    ],
)
def test_bad_declarations_are_one_line_and_exit_2(capsys, flags, message):
    code = main(["explain", "y[b,i] = max(x[b, s*i + u], u)", "--attr", "s=int", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3


def test_declarations_go_with_a_formula_not_with_an_op(capsys):
    spec = GOLDEN / "matmul" / "symgrad.toml"
    code = main(["explain", "--op", "BatchedMatMul", "--spec", str(spec), "--attr", "s=int"])
    err = capsys.readouterr().err
    assert code == 2 and "--attr declares a FORMULA's names" in err


def test_latex_writes_the_gather_note_as_text_not_math(capsys):
    """`(0 outside points, ...)` after a gather sat in align* as math: LaTeX set it as
    one italic run of letters without spaces. It is \\text, its underscores escaped."""
    text = explain(
        capsys,
        "out[b,c,n] = sum(points_xyz[b, c, idx[b,n,k]] * weight[b,n,k], k)",
        "--format",
        "latex",
    )
    (block,) = re.findall(r"\\begin\{align\*\}\n(.*?)\n\\end\{align\*\}", text, re.DOTALL)[:1]
    notes = re.findall(r"\\text\{([^{}]*)\}", block)
    assert r"(0 outside points\_xyz, or where idx is read outside)" in notes
    assert "outside" not in re.sub(r"\\text\{[^{}]*\}", "", block)

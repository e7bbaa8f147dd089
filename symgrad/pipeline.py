"""The pipeline, in one place: each op of a spec through every stage, to module texts.

    spec op -> parse + model (`model.build`) -> derive -> lower -> render (a target's
    printer and template) -> format (ruff, through a pipe) -> validate -> stamp

Every stage is a pure function of the one before; nothing here touches the disk (`emit`
compares with the output folder and writes). The stages know no framework until render.
"""

from __future__ import annotations

import ast
import subprocess
from dataclasses import replace

from . import (
    ir,
    polyphase,
    recurrence,
    scan_render,
    tile,
    tile_logsumexp,
    tile_once,
    tile_parts,
    tile_stages,
    tile_sum,
)
from .derive import derive
from .errors import SymgradError
from .lower import lower
from .model import build
from .render import HEADER, content_hash, render
from .spec import OpSpec, Spec, snake_case
from .tile_nest import nest

PLACEHOLDER = "{content_hash}"
INIT = "__init__.py"


def compile_op(op: OpSpec) -> ir.Module:
    """An op through the framework-neutral stages: parse and model, derive, lower; and,
    when its temporaries can outgrow its inputs and outputs, its chunk the same way
    (`tile`). A polyphase sum is rewritten first (`polyphase`); the docstring keeps the
    formula as written and says what was substituted."""
    written = op
    op, rewrites = polyphase.rewrite(op)
    program = build(op)
    backward = derive(program)
    module = replace(
        lower(program, backward),
        max_temp_bytes=op.max_temp_bytes,
        formulas=written.formulas,
        rewrites=polyphase.doc_lines(op, rewrites),
    )
    choice = tile_sum.choose(op, program, tile.choose(op, program))
    choice = tile_logsumexp.choose(op, program, choice)
    if choice is None:  # shifted slices no index runs through (EdgeConv's `w[o, C + c]`)
        choice = tile.choose(op, program, loose=True)
    parts = tile_parts.split(op, program, choice)
    if parts is not None:  # no one index serves the whole op: each part its own
        tiling = tile_parts.tiling(op, program, parts, _tiling)
        separate = "in parts: each part's chunk is an op of its own, not the whole op's"
        return replace(module, tiling=replace(tiling, separate=separate))
    stages = tile_stages.split(op, program, choice)
    if stages is not None:  # dependent equations: each its own stage, in order
        tiling = tile_stages.tiling(op, program, stages, _tiling)
        separate = "in stages: each stage's chunk is an op of its own, not the whole op's"
        return replace(module, tiling=replace(tiling, separate=separate))
    if choice is None:
        return module
    tiling = _tiling(choice, program, backward)
    if not tiling.summed:
        reason = tile_sum.why_not(op, program, choice)
        tiling = replace(tiling, untiled_reason=reason) if reason else tiling
    nested = nest(module, program, choice, tiling)
    if nested is not None:  # one position of the index too large: a second level
        return nested
    # One program for the op and its chunks, where the chunk's at start 0 is the op's.
    merged, why = tile_once.merge(replace(module, tiling=tiling))
    if merged.tiling.program is None:
        return replace(module, tiling=replace(tiling, separate=why))
    return merged


def _tiling(choice, program, backward=None) -> ir.Tiling:
    """The tiling of a program along its choice: the chunk through every stage."""
    chunk_program = build(choice.chunk)
    chunk = lower(chunk_program, derive(chunk_program))
    summed = choice.index not in {i.name for i in program.outputs[0].level.indices}
    backward = derive(program) if backward is None else backward
    return tile.tiling(choice, program, backward, chunk, summed=summed)


def _ruff() -> str:
    try:
        from ruff.__main__ import find_ruff_bin

        return str(find_ruff_bin())
    except (ImportError, FileNotFoundError):  # pragma: no cover - ruff is a dependency
        return "ruff"


def format_source(source: str, name: str) -> str:
    """Format with ruff's default style, so generated code looks hand-written."""
    try:
        result = subprocess.run(
            [_ruff(), "format", "--isolated", "--stdin-filename", name, "-"],
            input=source,
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError as exc:
        raise SymgradError(f"cannot run ruff to format {name}: {exc.strerror}") from None
    if result.returncode != 0:
        raise SymgradError(f"ruff could not format {name}: {result.stderr.strip()}")
    return result.stdout


def stamp(text: str) -> str:
    """Fill in the hash line of a module whose hash line holds the placeholder."""
    return text.replace(f"# hash: {PLACEHOLDER}", f"# hash: {content_hash(text)}", 1)


def module_text(
    op: OpSpec, source_name: str, target: str = "tensorflow", compiled: dict | None = None
) -> str:
    """One op's module for a target: compile, render, format, validate, stamp. `compiled`
    (op -> `compile_op`'s module), where given, is read and filled: the stages before
    render know no target, so the targets of one run compile each op once."""
    if recurrence.is_recurrence(op):  # a scan around its steps (`scan_render`)
        return scan_render.module_text(op, source_name, target)
    module = _compiled(op, compiled)
    name = f"{snake_case(op.name)}.py"
    source = render(module, target)
    source = source.replace(f"# source: {op.source}", f"# source: {_source_line(op, source_name)}")
    formatted = format_source(source, name)
    try:
        compile(formatted, name, "exec")
    except SyntaxError as exc:  # pragma: no cover - would be a symgrad bug
        raise SymgradError(f"generated code for {op.name} does not compile: {exc}") from None
    _check_structure(formatted, op.name)
    return stamp(formatted)


def _compiled(op: OpSpec, compiled: dict | None) -> ir.Module:
    if compiled is None:
        return compile_op(op)
    if op not in compiled:
        compiled[op] = compile_op(op)
    return compiled[op]


def _check_structure(source: str, op_name: str) -> None:
    """A second line of defence behind the parser: the module is a docstring, imports,
    assignments and definitions, and one `_register()` call -- nothing else runs."""
    body = ast.parse(source).body
    allowed = (ast.Import, ast.ImportFrom, ast.Assign, ast.FunctionDef)
    docstring = body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    for statement in body[1 if docstring else 0 :]:
        is_register = (
            isinstance(statement, ast.Expr)
            and isinstance(statement.value, ast.Call)
            and isinstance(statement.value.func, ast.Name)
            and statement.value.func.id == "_register"
            and not statement.value.args
        )
        if not isinstance(statement, allowed) and not is_register:
            raise SymgradError(  # pragma: no cover - would be a symgrad bug
                f"generated code for {op_name} has an unexpected top-level statement "
                f"(line {statement.lineno}); refusing to write it"
            )


def _source_line(op, source_name: str) -> str:
    return f"{source_name} [ops.{op.name}]"


PACKAGE_DOCS = {
    "tensorflow": "Gradient modules generated by symgrad; importing one registers its gradient.",
    "pytorch": "PyTorch gradient modules generated by symgrad; `register(op)` gives an op one.",
    "jax": "JAX gradient modules generated by symgrad; `wrap(primal)` gives a primitive one.",
}


def package_init(spec: Spec, source_name: str, target: str = "tensorflow") -> str:
    modules = [(snake_case(op.name), op.name) for op in spec.ops]
    lines = [
        HEADER,
        f"# source: {source_name}",
        f"# hash: {PLACEHOLDER}",
        f'"""{PACKAGE_DOCS[target]}',
        "",
        *(f"    {module}: {op}" for module, op in modules),
        '"""',
        "",
        f"__all__ = {[m for m, _ in modules]!r}",
        "",
    ]
    text = format_source("\n".join(lines), "__init__.py")
    return stamp(text)


def generate(
    spec: Spec, target: str, source_name: str, compiled: dict | None = None
) -> dict[str, str]:
    """Every file of a target's output package, in memory. SymgradError on bad input.
    `source_name` is how the files name the spec (`folders.spec_source`); `compiled` is
    `module_text`'s, one dict for every target of a run."""
    files = {
        f"{snake_case(op.name)}.py": module_text(op, source_name, target, compiled)
        for op in spec.ops
    }
    files[INIT] = package_init(spec, source_name, target)
    return dict(sorted(files.items()))


__all__ = ["compile_op", "format_source", "generate", "module_text", "stamp"]

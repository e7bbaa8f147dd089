"""The command line: `symgrad generate`, `symgrad explain` and `symgrad check`. I/O only.

Exit codes: 0 written, up to date, or every check passed; 1 stale under --check/--diff, or
a check failed; 2 on any error; 141 (128 + SIGPIPE, as for a program the signal ends),
quietly, when the reader of the output closes it early (`symgrad generate --diff | head`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import traceback
from dataclasses import replace
from pathlib import Path

from . import __version__, polyphase, recurrence
from .emit import diff, plan, write
from .errors import SymgradError, counted
from .explain import FORMATS, explain
from .folders import distinct_folders, flag_folder, output_folder, spec_source
from .model import build
from .pipeline import generate
from .spec import load_spec, parse_op, spec_targets
from .targets import TARGETS

EXIT_OK, EXIT_STALE, EXIT_ERROR = 0, 1, 2
EXIT_FAILED = 1  # symgrad check: a check failed
EXIT_CLOSED_PIPE = 128 + signal.SIGPIPE  # the shell's status for a program SIGPIPE ends


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="symgrad",
        description="Generate TensorFlow gradient modules from elementwise formulas.",
    )
    parser.add_argument("--version", action="version", version=f"symgrad {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate",
        help="write one gradient module per op in the spec",
        description="Write one gradient module per op (only files whose content changes; "
        "nothing at all if any op fails). Files symgrad did not write are never touched.",
        epilog="exit status: 0 written or up to date; 1 out of date (--check/--diff); 2 error",
    )
    gen.add_argument(
        "spec", nargs="?", default="symgrad.toml", metavar="SPEC", help="spec file (symgrad.toml)"
    )
    gen.add_argument(
        "--target",
        dest="targets",
        action="append",
        default=[],
        metavar="NAME",
        help=f"generate for this framework only (repeatable; {', '.join(TARGETS)}); default: "
        "every target of the spec's [targets], else tensorflow",
    )
    gen.add_argument(
        "--out",
        metavar="DIR",
        help="output folder (overrides the spec's; only with one target selected)",
    )
    gen.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 naming each stale file"
    )
    gen.add_argument("--diff", action="store_true", help="like --check, and print a unified diff")
    gen.add_argument(
        "--force", action="store_true", help="overwrite or delete modules edited by hand"
    )
    gen.add_argument("--debug", action="store_true", help="show tracebacks")
    exp = commands.add_parser(
        "explain",
        help="show what the gradient function must return, and why",
        usage="symgrad explain (FORMULA [--attr NAME=TYPE]... [--range INDEX=SIZE]... "
        "[--inputs A,B,...] [--no-gradient NAME]... [--float NAME]... | "
        "--op NAME [--spec SPEC]) "
        "[--format FORMAT]",
        description="Explain a FORMULA, or the op NAME of a spec: the forward code, then for "
        "each input the partial derivatives (with Kronecker deltas), the contraction with "
        "grad once the deltas are eliminated, and the TensorFlow code.",
    )
    exp.add_argument(
        "formula",
        nargs="?",
        metavar="FORMULA",
        help='the formula, e.g. "y[b,i,j] = A[b,i,k] * B[b,k,j]" (names without indices '
        "are taken as float attrs)",
    )
    exp.add_argument(
        "--attr",
        dest="attrs",
        action="append",
        default=[],
        metavar="NAME=TYPE",
        help="declare a scalar attr of FORMULA, as `attrs` in a spec: float, int or bool "
        "(repeatable; e.g. --attr s=int for a stride s*i)",
    )
    exp.add_argument(
        "--range",
        dest="ranges",
        action="append",
        default=[],
        metavar="INDEX=SIZE",
        help="the range of an index of FORMULA that no input axis reads plainly, as "
        "`ranges` in a spec (repeatable; e.g. --range u=3, --range 'i=x.shape[1] - 2')",
    )
    exp.add_argument(
        "--inputs",
        metavar="A,B,...",
        help="the op's inputs in order, as `inputs` in a spec (default: first appearance)",
    )
    exp.add_argument(
        "--no-gradient",
        dest="no_gradient",
        action="append",
        default=[],
        metavar="NAME",
        help="an input that gets no gradient, as `no_gradient` in a spec (repeatable)",
    )
    exp.add_argument(
        "--float",
        dest="float_positions",
        action="append",
        default=[],
        metavar="NAME",
        help="a tensor of float positions read inside brackets (interpolated), as "
        "`float_positions` in a spec (repeatable)",
    )
    exp.add_argument("--op", metavar="NAME", help="explain the op NAME of a spec instead")
    exp.add_argument(
        "--spec",
        dest="spec_file",
        metavar="SPEC",
        help="the spec file of --op (default: symgrad.toml)",
    )
    exp.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        metavar="FORMAT",
        help="text (the default), markdown, or latex (a fragment for a document that "
        "loads amsmath)",
    )
    exp.add_argument("--debug", action="store_true", help="show tracebacks")
    chk = commands.add_parser(
        "check",
        help="check a compiled op against its formula and its gradient",
        usage="symgrad check [SPEC] [--target tensorflow|pytorch|jax] [--library FILE] "
        "[--namespace NS] [--op NAME]... [--attr NAME=VALUE]... [--shape INPUT=AxBxC]... "
        "[--size INDEX=N]... [--dtype float64|float32] [--seed N] [--json]",
        description="For each op of the spec that the library defines: (1) its outputs equal "
        "the generated forward's on random inputs of distinct sizes per index; (2) the "
        "gradient the framework runs for it (the generated module, as it is on disk) passes "
        "a dot-product test against central differences of the op itself; (3) its names, "
        "attrs and dtypes fit the spec. Each op with attrs is checked at its own defaults "
        "and at distinct sample values. Without --library, checks the generated forward "
        "against a dense evaluation of the formula, and its gradient the same way.",
        epilog="exit status: 0 every check passed; 1 a check failed; 2 error (spec, library, "
        "usage, or a module missing or stale: run `symgrad generate`)",
    )
    chk.add_argument(
        "spec", nargs="?", default="symgrad.toml", metavar="SPEC", help="spec file (symgrad.toml)"
    )
    chk.add_argument(
        "--target",
        choices=("tensorflow", "pytorch", "jax"),
        default="tensorflow",
        help="the framework of the library and of the generated modules (tensorflow)",
    )
    chk.add_argument(
        "--library",
        metavar="FILE",
        help="the op library to check: a .so for TensorFlow (tf.load_op_library) or PyTorch "
        "(torch.ops.load_library); a .py that registers ops with torch.library, or (jax) a "
        "module with a function snake_case(op) per op",
    )
    chk.add_argument(
        "--namespace",
        metavar="NS",
        help="PyTorch: the ops' namespace (each spec op is NS::snake_case(name)); default: "
        "the namespace the library registers them in",
    )
    chk.add_argument(
        "--op",
        dest="ops",
        action="append",
        default=[],
        metavar="NAME",
        help="check only this op (repeatable)",
    )
    chk.add_argument(
        "--attr",
        dest="attrs",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an attr value (repeatable); otherwise the op's default and distinct samples",
    )
    chk.add_argument(
        "--shape",
        dest="shapes",
        action="append",
        default=[],
        metavar="INPUT=AxBxC",
        help="an input's shape (repeatable), e.g. --shape k=2x9x4",
    )
    chk.add_argument(
        "--size",
        dest="sizes",
        action="append",
        default=[],
        metavar="INDEX=N",
        help="the size of an index that names an input axis (repeatable)",
    )
    chk.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    chk.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (0)")
    chk.add_argument("--json", action="store_true", help="print the report as one JSON document")
    chk.add_argument("--out", metavar="DIR", help="the generated modules' folder (as generate)")
    chk.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def _generate(args) -> int:
    spec = load_spec(args.spec)
    targets = _selected_targets(spec, args.targets)
    if args.out and len(targets) > 1:
        raise SymgradError(
            f"--out names one folder, and {len(targets)} targets are selected "
            f"({', '.join(targets)}); pick one with --target",
            where=spec.path,
        )
    if args.out:
        folders = [(targets[0], flag_folder(spec, args.out))]
    else:
        folders = [(target, output_folder(spec, target)) for target in targets]
    distinct_folders(spec, folders)
    # Everything is generated and planned before the first write: all or nothing.
    work = []
    compiled = {}  # each op through the stages before render once, for every target
    for target, out in folders:
        files = generate(spec, target, spec_source(spec, out), compiled)
        work.append((out, files, plan(files, out, Path(spec.path))))
    if args.check or args.diff:
        codes = [_report(c, out, len(files), show_diff=args.diff) for out, files, c in work]
        return max(codes)
    edited = [str(out / name) for out, _, changes in work for name in changes.edited]
    if edited and not args.force:
        raise SymgradError(
            f"{', '.join(edited)}: changed by hand since symgrad generated it (its hash no "
            "longer matches); edit the spec instead, or pass --force to overwrite"
        )
    for out, _, changes in work:
        write(changes, out)
    # Only then report, so that a reader closing the output early cannot stop a write.
    for out, files, changes in work:
        for change in changes.changes:
            print(f"{ACTIONS[change.action]:>7} {out / change.name}")
        if not changes.changes:
            print(f"{out}: up to date ({counted(len(files), 'file')})")
    return EXIT_OK


def _selected_targets(spec, named: list[str]) -> tuple[str, ...]:
    """--target NAME..., else every target of the spec's `[targets]` (else TensorFlow)."""
    if not named:
        return spec_targets(spec)
    for name in named:
        if name not in TARGETS:
            raise SymgradError(f"unknown target {name!r} (known: {', '.join(TARGETS)})")
    if spec.targets and (missing := [n for n in named if n not in spec_targets(spec)]):
        raise SymgradError(
            f"target {missing[0]} is not in the spec's [targets] ({', '.join(spec_targets(spec))})",
            where=spec.path,
        )
    return tuple(dict.fromkeys(named))


ACTIONS = {"create": "created", "update": "updated", "delete": "deleted"}
STATES = {"create": "missing", "update": "stale", "delete": "orphaned (op no longer in the spec)"}


def _report(changes, out: Path, count: int, *, show_diff: bool) -> int:
    """Check mode: name every file that is not as symgrad would write it; write nothing."""
    for change in changes.changes:
        edited = ""
        if change.name in changes.edited:
            verb = "deletes" if change.action == "delete" else "overwrites"
            edited = f" and edited by hand (`symgrad generate --force` {verb} it)"
        print(f"{out / change.name}: {STATES[change.action]}{edited}")
        if show_diff:
            sys.stdout.write(diff(change, out))
    if changes.changes:
        print(
            f"{len(changes.changes)} file(s) out of date; run `symgrad generate`", file=sys.stderr
        )
        return EXIT_STALE
    print(f"{out}: up to date ({counted(count, 'file')})")
    return EXIT_OK


def _explain(args) -> int:
    if args.op:
        if args.formula and "=" in args.formula:
            raise SymgradError("explain takes a FORMULA or --op NAME, not both")
        declared = [flag for key, flag in DECLARATION_FLAGS.items() if getattr(args, key)]
        if declared:
            flag = declared[0]
            raise SymgradError(
                f"{flag} declares a FORMULA's names; the op's are in its spec (--op NAME)"
            )
        # `explain --op NAME SPEC` (the spec as the positional argument) still works.
        if args.formula and args.spec_file:
            raise SymgradError("give the spec file once: as SPEC or as --spec")
        spec_file = args.spec_file or args.formula or "symgrad.toml"
        spec = load_spec(spec_file)
        ops = {op.name: op for op in spec.ops}
        if args.op not in ops:
            known = ", ".join(ops)
            raise SymgradError(f"no op {args.op!r} in the spec (ops: {known})", where=spec_file)
        op = ops[args.op]
    elif args.formula:
        if args.spec_file:
            raise SymgradError("--spec goes with --op NAME, not with a FORMULA")
        program, rewritten = _formula_program(args.formula, _declarations(args), args.format)
        sys.stdout.write(rewritten + explain(program, args.format))
        return EXIT_OK
    else:
        raise SymgradError("explain needs a FORMULA or --op NAME")
    if recurrence.is_recurrence(op):  # the recurrence, its step, and its adjoint
        from .explain_recurrence import explain_recurrence

        sys.stdout.write(explain_recurrence(op, args.format))
        return EXIT_OK
    op, rewrites = polyphase.rewrite(op)  # a polyphase sum, said first
    sys.stdout.write(
        polyphase.explained(op, rewrites, args.format) + explain(build(op), args.format)
    )
    return EXIT_OK


# `explain FORMULA`'s declarations: the key of a spec's op table -> the flag.
DECLARATION_FLAGS = {
    "attrs": "--attr",
    "ranges": "--range",
    "inputs": "--inputs",
    "no_gradient": "--no-gradient",
    "float_positions": "--float",
}


def _declarations(args) -> dict:
    """`explain FORMULA`'s flags as the keys of a spec's op table (`attrs`, `ranges`,
    `inputs`, `no_gradient`), validated as a spec's are."""
    table: dict = {}
    if args.attrs:
        table["attrs"] = dict(_name_value(text, "--attr", "NAME=TYPE") for text in args.attrs)
    if args.ranges:
        table["ranges"] = dict(_name_value(t, "--range", "INDEX=SIZE") for t in args.ranges)
    if args.inputs:
        table["inputs"] = [name.strip() for name in args.inputs.split(",")]
    if args.no_gradient:
        table["no_gradient"] = list(args.no_gradient)
    if args.float_positions:
        table["float_positions"] = list(args.float_positions)
    return table


def _name_value(text: str, flag: str, form: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name.strip() or not value.strip():
        raise SymgradError(f"{flag} {text!r}: expected {form}")
    return name.strip(), value.strip()


def _formula_program(formula: str, declared: dict | None = None, fmt: str = "text"):
    """A bare formula to explain, with the declarations of `explain`'s flags; scalar names
    it does not declare (`alpha`) are taken as float attrs. With what a polyphase rewrite
    did to it (`polyphase.explained`, "" when nothing)."""
    declared = declared or {}
    attrs = dict(declared.get("attrs", {}))
    while True:
        table = {**declared, "formula": formula, "attrs": attrs}
        try:
            op = replace(parse_op("Formula", table, "formula"), source="formula")
        except SymgradError as exc:  # a bad declaration: say where, as a formula's errors
            raise SymgradError(exc.message, where="formula") from None
        try:
            op, rewrites = polyphase.rewrite(op)
            return build(op), polyphase.explained(op, rewrites, fmt)
        except SymgradError as exc:
            match = re.match(r"unknown name '([A-Za-z][A-Za-z0-9_]*)'", exc.message)
            if not match or match.group(1) in attrs or len(attrs) >= 16:
                raise
            attrs[match.group(1)] = "float"


def _check(args) -> int:
    from .check import as_json, render_table, run  # imports the framework when it runs

    spec = load_spec(args.spec)
    if args.target not in spec_targets(spec):
        raise SymgradError(
            f"symgrad check --target {args.target} runs the {args.target} modules; add "
            f"{args.target} to `[targets]`",
            where=spec.path,
        )
    out = Path(args.out) if args.out else output_folder(spec, args.target)
    report = run(
        spec,
        out,
        target=args.target,
        library=args.library,
        namespace=args.namespace,
        op_names=tuple(args.ops),
        attr_args=tuple(args.attrs),
        shape_args=tuple(args.shapes),
        size_args=tuple(args.sizes),
        dtype=args.dtype,
        seed=args.seed,
    )
    if args.json:
        print(json.dumps(as_json(report), indent=2))
    else:
        sys.stdout.write(render_table(report))
        for op in report.ops:
            for check in op.failed:
                print(f"error: {op.label}: {check} check failed", file=sys.stderr)
    return EXIT_OK if report.ok else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Run a command; a reader that closes the output early (`| head`) ends it quietly."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # inside the try: buffered output fails here, not at exit
    except BrokenPipeError:
        _silence_closed_pipes()
        return EXIT_CLOSED_PIPE


def _silence_closed_pipes() -> None:
    """Point stdout and stderr at the null device, so that Python's flush at exit does not
    fail (and print a warning) on the pipe that was closed."""
    null = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(null, stream.fileno())
        except (OSError, ValueError, AttributeError):  # not a real file (captured output)
            pass
    os.close(null)


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "check":
            return _check(args)
        return _explain(args)
    except SymgradError as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        raise  # the reader closed the output: not a bug (see `main`)
    except Exception as exc:  # noqa: BLE001 - a bug in symgrad, not the user's input
        if args.debug:
            traceback.print_exc()
        else:
            print(
                f"error: internal error in symgrad ({type(exc).__name__}: {exc}); "
                "rerun with --debug for a traceback",
                file=sys.stderr,
            )
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

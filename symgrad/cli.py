"""The command line: `symgrad generate` and `symgrad explain`. I/O only.

Exit codes: 0 written or up to date; 1 stale under --check/--diff; 2 on any error.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from .emit import diff, generate, plan, write
from .errors import SymgradError
from .explain import FORMATS, explain
from .model import build
from .spec import OpSpec, load_spec

EXIT_OK, EXIT_STALE, EXIT_ERROR = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="symgrad",
        description="Generate TensorFlow gradient modules from elementwise formulas.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="write one gradient module per op in the spec")
    gen.add_argument("spec", nargs="?", default="symgrad.toml", help="spec file (symgrad.toml)")
    gen.add_argument("--out", help="output folder (overrides `out` in the spec)")
    gen.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    gen.add_argument("--diff", action="store_true", help="like --check, and print a diff")
    gen.add_argument("--force", action="store_true", help="overwrite hand-edited modules")
    gen.add_argument("--debug", action="store_true", help="show tracebacks")
    exp = commands.add_parser("explain", help="show the derivation of a gradient")
    exp.add_argument("formula", nargs="?", help='e.g. "y[b,i,j] = A[b,i,k] * B[b,k,j]"')
    exp.add_argument("--op", help="explain this op from the spec instead of a formula")
    exp.add_argument("--spec", dest="spec_file", default="symgrad.toml",
                     help="spec file for --op (symgrad.toml)")
    exp.add_argument("--format", choices=FORMATS, default="text")
    exp.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def _generate(args) -> int:
    spec = load_spec(args.spec)
    if args.out:
        out = Path(args.out)
    else:
        out = Path(args.spec).parent / (spec.out or "generated")
    files = generate(spec)
    changes = plan(files, out)
    if args.check or args.diff:
        for change in changes.changes:
            state = {"create": "missing", "update": "stale", "delete": "orphaned"}[change.action]
            edited = " (edited by hand)" if change.name in changes.edited else ""
            print(f"{out / change.name}: {state}{edited}")
            if args.diff:
                sys.stdout.write(diff(change, out))
        if changes.changes:
            print(f"{len(changes.changes)} file(s) out of date; run `symgrad generate`",
                  file=sys.stderr)
            return EXIT_STALE
        print(f"{out}: up to date ({len(files)} files)")
        return EXIT_OK
    if changes.edited and not args.force:
        names = ", ".join(changes.edited)
        raise SymgradError(
            f"{names} changed by hand since generation; edit the spec instead, "
            "or use --force to overwrite", where=str(out)
        )
    write(changes, out)
    for change in changes.changes:
        print(f"{change.action:>6} {out / change.name}")
    if not changes.changes:
        print(f"{out}: up to date ({len(files)} files)")
    return EXIT_OK


def _explain(args) -> int:
    if args.op:
        spec = load_spec(args.spec_file)
        ops = {op.name: op for op in spec.ops}
        if args.op not in ops:
            raise SymgradError(f"no op {args.op!r} in the spec", where=args.spec_file)
        op = ops[args.op]
    elif args.formula:
        op = OpSpec("Formula", (args.formula,), None, (), (), "formula")
    else:
        raise SymgradError("explain needs a FORMULA or --op NAME")
    sys.stdout.write(explain(build(op), args.format))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        return _explain(args)
    except SymgradError as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # a bug in symgrad, not the user's input
        if args.debug:
            traceback.print_exc()
        else:
            print(f"error: internal error in symgrad ({type(exc).__name__}: {exc}); "
                  "rerun with --debug for a traceback", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

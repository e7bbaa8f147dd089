"""Golden end-to-end cases: tests/golden/<case>/symgrad.toml -> expected/, byte for byte.

Each case is a small spec whose `out` is `expected`, so it is also a runnable project:
`symgrad generate tests/golden/<case>/symgrad.toml --diff` shows what changed. When a change
to lowering or the templates is intended, refresh every case on purpose with

    .venv/bin/pytest tests/test_golden.py --update-golden

and review `git diff tests/golden` before committing it.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from symgrad.folders import spec_source
from symgrad.pipeline import generate
from symgrad.spec import load_spec

GOLDEN = Path(__file__).resolve().parent / "golden"
CASES = sorted(p.parent.name for p in GOLDEN.glob("*/symgrad.toml"))
REFRESH = "if the change is intended, run `.venv/bin/pytest tests/test_golden.py --update-golden`"


def test_there_are_golden_cases():
    assert len(CASES) >= 4, CASES


@pytest.mark.parametrize("case", CASES)
def test_golden(case, request):
    folder = GOLDEN / case
    spec = load_spec(folder / "symgrad.toml")
    assert spec.out == "expected", f'{case}: `out` must be "expected"'
    expected = folder / "expected"
    wanted = generate(spec, "tensorflow", spec_source(spec, expected))

    if request.config.getoption("--update-golden"):
        expected.mkdir(exist_ok=True)
        for path in expected.iterdir():
            if path.name not in wanted:
                path.unlink()
        for name, text in wanted.items():
            path = expected / name
            if not path.is_file() or path.read_bytes() != text.encode("utf-8"):
                path.write_bytes(text.encode("utf-8"))
        return

    present = (
        {p.name: p.read_bytes() for p in sorted(expected.glob("*"))} if expected.is_dir() else {}
    )
    problems = []
    for name in sorted(set(present) | set(wanted)):
        old = present.get(name)
        new = wanted[name].encode("utf-8") if name in wanted else None
        if old == new:
            continue
        if old is None:
            problems.append(f"{name}: generated but not in expected/")
        elif new is None:
            problems.append(f"{name}: in expected/ but no longer generated")
        else:
            problems.append(
                "".join(
                    difflib.unified_diff(
                        old.decode("utf-8", "replace").splitlines(keepends=True),
                        new.decode("utf-8").splitlines(keepends=True),
                        fromfile=f"expected/{name}",
                        tofile=f"generated/{name}",
                    )
                )
            )
    if problems:
        pytest.fail(
            f"golden case {case!r} differs from tests/golden/{case}/expected/;\n{REFRESH} "
            "and review `git diff tests/golden`.\n\n" + "\n".join(problems),
            pytrace=False,
        )

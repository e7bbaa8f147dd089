"""The README's examples are what symgrad really prints and writes."""

from __future__ import annotations

import re
from pathlib import Path

from symgrad.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_opens_with_the_two_setup_commands():
    blocks = re.findall(r"```sh\n(.*?)\n```", README, flags=re.DOTALL)
    assert blocks[0].endswith("symgrad generate")
    assert blocks[1].endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert blocks[1] in ci, "CI must run README's test command"


def test_readme_module_excerpt_is_the_generated_code():
    excerpt = re.search(r"```python\n(def _compute.*?)\n\.\.\.", README, flags=re.DOTALL).group(1)
    generated = (ROOT / "generated" / "batched_mat_mul.py").read_text(encoding="utf-8")
    assert excerpt in generated
    rest = re.search(r"\n\.\.\.\n(def gradient.*?)\n```", README, flags=re.DOTALL).group(1)
    lines = generated.splitlines()
    for line in rest.splitlines():  # in order, `...` standing for lines left out
        if line.strip() != "...":
            assert line in lines, line
            lines = lines[lines.index(line) + 1 :]


def test_readme_explain_excerpt_is_what_explain_prints(capsys):
    block = re.search(
        r"```console\n\$ symgrad explain \"(.*?)\"\n(.*?)\n```", README, flags=re.DOTALL
    )
    assert main(["explain", block.group(1)]) == 0
    printed = capsys.readouterr().out
    for line in block.group(2).splitlines():
        if line.strip() != "...":
            assert line in printed, line

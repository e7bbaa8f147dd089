"""Stage 7: module texts (from `pipeline.generate`) -> the output folder.

`plan` compares the texts with the folder and decides, before anything is written, what
would change; `write` is the only function in symgrad that touches the disk. Generation is
all-or-nothing: every op of every target is generated and every conflict found before the
first write, and each file is replaced atomically (temporary file in the same folder +
`os.replace`).
"""

from __future__ import annotations

import difflib
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import SymgradError
from .pipeline import INIT, PLACEHOLDER
from .render import HEADER, content_hash

HASH_LINE = re.compile(r"^# hash: (sha256:[0-9a-f]+)$", re.MULTILINE)
# The spec a generated file came from: `# source: ../a.toml [ops.X]`, or `# source: ../a.toml`
# (the path from the output folder to the spec, `folders.spec_source`; before that path,
# the spec's file name alone, `# source: a.toml`).
SOURCE_LINE = re.compile(r"^# source: (.*?)(?: \[ops\.[A-Za-z0-9_]+\])?$", re.MULTILINE)


def intact(text: str) -> bool:
    """Whether a generated file still has the content its hash line promises."""
    match = HASH_LINE.search(text)
    if not match:
        return False
    unstamped = text.replace(f"# hash: {match.group(1)}", f"# hash: {PLACEHOLDER}", 1)
    return content_hash(unstamped) == match.group(1)


# ----------------------------------------------------------------------------- the folder


@dataclass(frozen=True)
class Change:
    """What writing would do to one file."""

    name: str
    action: str  # "create" | "update" | "delete"
    old: str | None
    new: str | None


@dataclass(frozen=True)
class Plan:
    """Everything writing would do, decided before the first write."""

    changes: tuple[Change, ...]
    edited: tuple[str, ...]  # generated files whose content no longer matches their hash


def source_spec(text: str) -> str | None:
    """The spec a generated file says it came from (its `# source:` line)."""
    match = SOURCE_LINE.search(text.split("\n", 3)[1] if text.count("\n") >= 2 else "")
    return match.group(1) if match else None


def _legacy_owner(source: str | None, out: Path, spec_file: Path | None) -> bool:
    """Whether a module from before `# source:` held a path (it names the spec by file name
    alone, no `/`) is this spec's. The name vouches for one file only: the spec of that name
    beside the output folder, the usual layout. Any other spec of that name leaves it be."""
    if source is None or "/" in source or spec_file is None:
        return False
    try:
        return (out.resolve().parent / source).samefile(spec_file)
    except (OSError, ValueError):
        return False


def plan(files: dict[str, str], out: Path, spec_file: Path | None = None) -> Plan:
    """Compare the wanted files with the folder; refuse to clobber files symgrad did not write,
    or wrote from another spec (those are never deleted either: only this spec's orphans).
    A file is this spec's when its `# source:` line is the files' own (the path to the spec
    file), or an older header that `_legacy_owner` recognises for `spec_file`."""
    this_spec = source_spec(files[INIT]) if INIT in files else None

    def ours(text: str) -> bool:
        source = source_spec(text)
        return source == this_spec or _legacy_owner(source, out, spec_file)

    changes: list[Change] = []
    edited: list[str] = []
    existing: dict[str, str] = {}
    if out.exists() and not out.is_dir():
        raise SymgradError("output path exists and is not a folder", where=str(out))
    if out.is_dir():
        for path in sorted(out.glob("*.py")):
            if not path.is_file():
                existing[path.name] = ""  # a folder or dangling link: not ours either
                continue
            try:
                # Text mode on purpose: a CRLF checkout (git autocrlf) reads as the LF text
                # symgrad writes, so it is neither stale nor "edited by hand".
                existing[path.name] = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                existing[path.name] = ""  # unreadable: treated as a file symgrad did not write
    for name, text in files.items():
        old = existing.get(name)
        if old is None:
            changes.append(Change(name, "create", None, text))
            continue
        if not old.startswith(HEADER):
            raise SymgradError(
                f"{name} exists but was not written by symgrad (no `{HEADER}` header); "
                "refusing to overwrite it: move it away, rename the op, or choose another --out",
                where=str(out / name),
            )
        if this_spec is not None and not ours(old):
            other = source_spec(old) or "another spec"
            raise SymgradError(
                f"{name} was generated from {other}, not from {this_spec} (paths from "
                "this folder); refusing to overwrite it: give each spec its own output folder "
                f"(`out` or --out), or, if {other} was moved or renamed, delete the files "
                "generated from it",
                where=str(out / name),
            )
        if old != text:
            if not intact(old):
                edited.append(name)
            changes.append(Change(name, "update", old, text))
    for name, old in existing.items():
        if name not in files and old.startswith(HEADER) and ours(old):
            if not intact(old):
                edited.append(name)
            changes.append(Change(name, "delete", old, None))
    return Plan(tuple(changes), tuple(sorted(edited)))


def diff(change: Change, out: Path) -> str:
    """A unified diff from the file on disk to the file symgrad would write."""
    path = str(out / change.name)
    return "".join(
        difflib.unified_diff(
            (change.old or "").splitlines(keepends=True),
            (change.new or "").splitlines(keepends=True),
            fromfile=f"a/{path}" if change.old is not None else "/dev/null",
            tofile=f"b/{path}" if change.new is not None else "/dev/null",
        )
    )


def write(plan_: Plan, out: Path) -> None:
    """Apply a plan. Each file is replaced atomically, so an interruption leaves every file
    either old or new. Modules first, then `__init__.py` (so the package never lists a
    module that is not there yet), deletions last. OS errors become SymgradErrors."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SymgradError(
            f"cannot create the output folder: {exc.strerror}", where=str(out)
        ) from None
    writes = [c for c in plan_.changes if c.action != "delete"]
    writes.sort(key=lambda c: c.name == INIT)
    for change in writes:
        _atomic_write(out / change.name, change.new or "")
    for change in plan_.changes:
        if change.action == "delete":
            try:
                (out / change.name).unlink(missing_ok=True)
            except OSError as exc:
                raise SymgradError(
                    f"cannot delete {change.name}: {exc.strerror}", where=str(out)
                ) from None


def _atomic_write(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then `os.replace` it into place."""
    try:
        mode = _file_mode(path)
        handle, temporary = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
        )
    except OSError as exc:
        raise SymgradError(
            f"cannot write {path.name}: {exc.strerror}", where=str(path.parent)
        ) from None
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="\n") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, mode)  # mkstemp makes 0600 files; keep the usual permissions
        os.replace(temporary, path)
    except BaseException as exc:
        Path(temporary).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise SymgradError(
                f"cannot write {path.name}: {exc.strerror or exc}", where=str(path.parent)
            ) from None
        raise


def _file_mode(path: Path) -> int:
    """The permissions of the file being replaced, or what `open()` would give a new one."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


__all__ = ["Change", "Plan", "diff", "intact", "plan", "write"]

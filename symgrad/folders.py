"""Where a spec's modules go: each target's output folder, checked on the file system.

The spec's own checks (`spec._check_out`) look at the folder names as written; these look
at the folders as they are, symbolic links resolved: a folder must stay inside the spec's
folder, must not be that folder itself or shadow a module under another name, and no two
targets may write into one folder.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath

from .errors import SymgradError
from .spec import TARGET_FOLDERS, Spec, check_package_name
from .spec import show as _show


def output_folder(spec: Spec, target: str = "tensorflow") -> Path:
    """A target's folder (`[targets]`, else `out` for TensorFlow, else the target's
    default), relative to the spec's folder; it must stay inside that folder once
    symbolic links are resolved (`out = "link/gen"`), and not be that folder itself."""
    base = Path(spec.path).parent
    named = dict(spec.targets).get(target)
    key = f"`targets.{target}`" if named is not None else "`out`"
    if named is None and target == "tensorflow" and not spec.targets:
        named = spec.out
    folder = base / (named or TARGET_FOLDERS[target])
    resolved = _resolve(folder, key, spec.path)
    default = f"{_show(TARGET_FOLDERS[target])} (the default)"
    shown = _show(named) if named is not None else default
    if not resolved.is_relative_to(base.resolve()):
        raise SymgradError(
            f"{key} {shown} leads outside the spec's folder through a symbolic link "
            # whole (repr: one line): the path to pass as --out, however deep it lies
            f"(to {str(resolved)!r}); use --out to write there",
            where=spec.path,
        )
    inside = PurePath(resolved.relative_to(base.resolve()))
    if inside == PurePath("."):
        raise SymgradError(
            f"{key} {shown} is the spec's own folder (through a symbolic link); name a "
            "folder inside it for the generated package",
            where=spec.path,
        )
    # The real folder's name counts too: a link `gen` to `torch` makes a package `torch`.
    if inside != PurePath(os.path.normpath(named or TARGET_FOLDERS[target])):
        check_package_name(inside, f"{key} {shown}, a link to {_show(str(inside))},", spec.path)
    return folder


def flag_folder(spec: Spec, out: str) -> Path:
    """The folder of `--out`: anywhere, but not the spec's own folder, and not named (as
    given or once links are resolved) like a module it would shadow."""
    folder = Path(out)
    resolved = _resolve(folder, "--out", spec.path)
    if resolved == Path(spec.path).parent.resolve():
        raise SymgradError(
            f"--out {_show(out)} is the spec's own folder; name a folder for the generated "
            "package (e.g. 'generated')",
            where=spec.path,
        )
    for name in dict.fromkeys((Path(os.path.abspath(out)).name, resolved.name)):
        check_package_name(PurePath(name), f"--out {_show(out)}", spec.path)
    return folder


def distinct_folders(spec: Spec, folders: list[tuple[str, Path]]) -> None:
    """No two targets write into one folder, symbolic links resolved (`pytorch = "alias"`
    with `alias` a link to the TensorFlow folder would replace its modules)."""
    base = Path(spec.path).parent

    def shown(folder: Path) -> str:
        return _show(os.path.relpath(folder, base), 60)

    seen: list[tuple[str, Path]] = []
    for target, folder in folders:
        for other, other_folder in seen:
            if _same_folder(folder, other_folder):
                raise SymgradError(
                    f"targets {other} ({shown(other_folder)}) and {target} "
                    f"({shown(folder)}) are one folder, "
                    f"{_show(str(folder.resolve()), 80)}, once symbolic links are resolved; "
                    "give each target its own folder",
                    where=spec.path,
                )
        seen.append((target, folder))


def spec_source(spec: Spec, out: Path) -> str:
    """How the modules in `out` name the spec they come from (their `# source:` line): the
    path from the real output folder to the real spec file, links resolved, with `/`
    (`../symgrad.toml`). Two spec files never get the same one for one folder, even with
    the same file name, so ownership of a module is never decided by a name alone. It
    always holds a `/`, since the output folder is never the spec's own folder."""
    folder, file = out.resolve(), Path(spec.path).resolve()
    try:
        source = Path(os.path.relpath(file, folder)).as_posix()
    except ValueError:  # another drive (Windows): no relative path
        source = file.as_posix()
    if not source.isprintable():
        raise SymgradError(
            f"the path from the output folder to the spec, {_show(source, 80)}, contains "
            "control or invisible characters; it goes into every module's header",
            where=spec.path,
        )
    return source


def _same_folder(a: Path, b: Path) -> bool:
    """One folder under two names: links resolved, or (existing folders) one file-system
    object, which also catches case-insensitive file systems."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def _resolve(folder: Path, key: str, where: str) -> Path:
    try:
        return folder.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        raise SymgradError(f"cannot resolve {key}: {exc}", where=where) from None


__all__ = ["distinct_folders", "flag_folder", "output_folder", "spec_source"]

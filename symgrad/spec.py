"""Stage 1: load and validate a spec file (`symgrad.toml`).

The schema is strict: unknown keys, wrong types and bad names are errors that name the
file and the op. Nothing here looks at formulas beyond their type; `model` does that.
"""

from __future__ import annotations

import difflib
import functools
import importlib.resources
import keyword
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePath

from .errors import SymgradError
from .parse import CONSTANTS, check_name
from .targets import TARGETS

OP_NAME = re.compile(r"[A-Z][A-Za-z0-9_]*\Z")
ATTR_TYPES = ("float", "int", "bool")
DEFAULT_MAX_TEMP_BYTES = 16 * 2**20  # 16 MiB of temporaries before tiling
TOP_KEYS = ("out", "targets", "max_temp_bytes", "ops")
# The frameworks a spec may write modules for, and each one's folder when none is named.
TARGET_FOLDERS = {name: target.default_out for name, target in TARGETS.items()}
OP_KEYS = (
    "formula",
    "inputs",
    "attrs",
    "no_gradient",
    "sizes",
    "ranges",
    "max_temp_bytes",
    "outputs",
    "let",
    "float_positions",
)
MAX_SIZE = 2**31
MAX_OPS = 500
MAX_FORMULAS = 16
MAX_OP_NAME = 100  # the module file name must stay well below the usual 255-byte limit
MAX_SPEC_BYTES = 1_000_000
# Packages that generated code and the programs using it import: a module of that name next
# to them would shadow the real one. A fixed list (with the standard library's names, shipped
# in data/), so that what is refused does not depend on what a machine has installed.
PACKAGES = frozenset(
    {
        "tensorflow",
        "tf",
        "keras",
        "tf_keras",
        "tensorboard",
        "numpy",
        "np",
        "scipy",
        "pandas",
        "jax",
        "jaxlib",
        "torch",
        "sympy",
        "mpmath",
        "jinja2",
        "markupsafe",
        "opt_einsum",
        "ruff",
        "absl",
        "google",
        "protobuf",
        "h5py",
        "ml_dtypes",
        "typing_extensions",
        "packaging",
        "six",
        "wrapt",
        "matplotlib",
        "pytest",
        "hypothesis",
        "setuptools",
        "pkg_resources",
        "pip",
        "symgrad",
    }
)


# Modules that Python or common tools import by their name alone, from wherever they are
# found: `site` imports sitecustomize and usercustomize at startup, pytest every conftest,
# and pip/setuptools run setup.py. A generated module or package of that name runs there.
IMPORTED_BY_NAME = frozenset({"sitecustomize", "usercustomize", "conftest", "setup"})


def shadows(module: str) -> str | None:
    """What a module or package of this name would shadow (a phrase), or None."""
    if module in stdlib_modules():
        return "a standard-library module of that name"
    if module in PACKAGES:
        return "a package of that name"
    if module in IMPORTED_BY_NAME:
        return "the module that Python or its tools import by that name"
    return None


@dataclass(frozen=True)
class OpSpec:
    """One `[ops.Name]` table, validated for shape and names."""

    name: str  # the TF op type the gradient is registered for
    formulas: tuple[str, ...]  # one equation per output, in output order
    inputs: tuple[str, ...] | None  # declared op input order, or None for first appearance
    attrs: tuple[tuple[str, str], ...]  # (attr name, "float" | "int" | "bool"), spec order
    no_gradient: tuple[str, ...]  # inputs whose gradient is None
    source: str  # where it came from, for messages and headers: "symgrad.toml [ops.Name]"
    # Typical sizes of indices (index name -> size), used only to choose the order of
    # contractions; unnamed indices count as 64. Generated code works for any size.
    sizes: tuple[tuple[str, int], ...] = ()
    # The range of an index that is not a plain index of some input axis (index name ->
    # integer expression over int literals, int attrs and `X.shape[n]`), in spec order.
    ranges: tuple[tuple[str, str], ...] = ()
    # The default of the module's MAX_TEMP_BYTES: above it, large temporaries are tiled.
    max_temp_bytes: int = DEFAULT_MAX_TEMP_BYTES
    # The op's outputs, in order, when not every left-hand tensor is one: the others are
    # internal (computed, read by later equations, never returned). None: all of them.
    outputs: tuple[str, ...] | None = None
    # Derived integers (name -> integer expression with the grammar of `ranges` over int
    # literals, int attrs, `X.shape[n]` and other lets), usable wherever an int attr is.
    lets: tuple[tuple[str, str], ...] = ()
    # Inputs that hold float positions (deformable conv's offsets): read inside brackets
    # they are values, and the read interpolates (sampling.py). Other tensors inside
    # brackets are integer index tensors unless the position divides or has a float.
    float_positions: tuple[str, ...] = ()


@dataclass(frozen=True)
class Spec:
    """A whole spec file."""

    path: str  # as given by the user (used in messages and generated headers)
    out: str | None  # output folder from the file, relative to the spec's folder
    ops: tuple[OpSpec, ...]  # sorted by name, so spec order never changes the output
    # `[targets]`: (framework, output folder) in spec order; empty: TensorFlow into `out`
    targets: tuple[tuple[str, str], ...] = ()


def _type_name(value: object) -> str:
    return {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "a boolean",
        list: "an array",
        dict: "a table",
    }.get(type(value), type(value).__name__)


def _show(value: object, limit: int = 40) -> str:
    """`repr(value)`, shortened: user text in messages stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 4]}...{text[-1]}"


def _hint(key: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _string_list(value: object, what: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SymgradError(
            f"`{what}` must be an array of strings, not {_type_name(value)}", where=where
        )
    if len(set(value)) != len(value):
        raise SymgradError(f"`{what}` names the same tensor twice", where=where)
    return tuple(value)


def _op_spec(
    name: str, table: object, path: str, default_budget: int = DEFAULT_MAX_TEMP_BYTES
) -> OpSpec:
    where = f"{path} [ops.{name}]"
    if not OP_NAME.match(name):
        raise SymgradError(
            f"op name {_show(name)} is not a TensorFlow op name ([A-Z][A-Za-z0-9_]*)",
            where=f"{path} [ops]",
        )
    if len(name) > MAX_OP_NAME:
        raise SymgradError(
            f"op name {_show(name)} is longer than {MAX_OP_NAME} characters",
            where=f"{path} [ops]",
        )
    if keyword.iskeyword(name):  # None, True, False: the PyTorch module's class name
        raise SymgradError(
            f"op name {name!r} is a Python keyword, which the generated code cannot use as "
            "a name; choose another name",
            where=where,
        )
    module = snake_case(name)
    if keyword.iskeyword(module):
        raise SymgradError(
            f"op name {name!r} would write {module}.py, which `import` cannot name "
            "(a Python keyword); choose another name",
            where=where,
        )
    if kind := shadows(module):
        raise SymgradError(
            f"op name {name!r} would write {module}.py, which shadows {kind} "
            "wherever its folder is on the import path; choose another name",
            where=where,
        )
    if name in tf_gradient_ops():
        raise SymgradError(
            f"op name {name!r} is a TensorFlow op that already has a gradient (registering "
            f"another fails on import); name your op differently, e.g. 'My{name}'",
            where=where,
        )
    if not isinstance(table, dict):
        raise SymgradError(f"must be a table, not {_type_name(table)}", where=where)
    for key in table:
        if key not in OP_KEYS:
            raise SymgradError(
                f"unknown key {_show(key)} (known: {', '.join(OP_KEYS)}){_hint(key, OP_KEYS)}",
                where=where,
            )
    if "formula" not in table:
        raise SymgradError("missing `formula`", where=where)
    formula = table["formula"]
    if isinstance(formula, str):
        formulas: tuple[str, ...] = (formula,)
    elif isinstance(formula, list) and formula and all(isinstance(f, str) for f in formula):
        formulas = tuple(formula)
    else:
        raise SymgradError(
            f"`formula` must be a string or a non-empty array of strings, "
            f"not {_type_name(formula)}",
            where=where,
        )
    if len(formulas) > MAX_FORMULAS:
        raise SymgradError(f"more than {MAX_FORMULAS} formulas", where=where)
    inputs = _string_list(table["inputs"], "inputs", where) if "inputs" in table else None
    no_gradient = (
        _string_list(table["no_gradient"], "no_gradient", where) if "no_gradient" in table else ()
    )
    attrs_table = table.get("attrs", {})
    if not isinstance(attrs_table, dict):
        raise SymgradError(f"`attrs` must be a table, not {_type_name(attrs_table)}", where=where)
    attrs = []
    for attr, kind in attrs_table.items():
        problem = check_name(attr, "attr")
        if problem:
            raise SymgradError(problem, where=where)
        if not isinstance(kind, str):
            raise SymgradError(
                f"the type of attr {attr!r} must be a string ({', '.join(ATTR_TYPES)}), "
                f"not {_type_name(kind)}",
                where=where,
            )
        if kind not in ATTR_TYPES:
            raise SymgradError(
                f"attr {attr!r} has type {_show(kind)}; known types: {', '.join(ATTR_TYPES)}",
                where=where,
            )
        attrs.append((attr, kind))
    for tensor in (*(inputs or ()), *no_gradient):
        problem = check_name(tensor, "tensor")
        if problem:
            raise SymgradError(problem, where=where)
    sizes_table = table.get("sizes", {})
    if not isinstance(sizes_table, dict):
        raise SymgradError(f"`sizes` must be a table, not {_type_name(sizes_table)}", where=where)
    sizes = []
    for index, size in sizes_table.items():
        problem = _index_problem(index)
        if problem:
            raise SymgradError(problem, where=where)
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_SIZE:
            raise SymgradError(
                f"size of index {index!r} must be a whole number from 1 to {MAX_SIZE}",
                where=where,
            )
        sizes.append((index, size))
    ranges = _int_expressions(
        table,
        "ranges",
        lambda index: f"range of index {index!r}",
        '(input sizes `X.shape[n]`, int attrs and numbers, e.g. "X.shape[1] - 2")',
        where,
    )
    budget = default_budget
    if "max_temp_bytes" in table:
        budget = _budget(table["max_temp_bytes"], where)
    outputs = _string_list(table["outputs"], "outputs", where) if "outputs" in table else None
    for tensor in outputs or ():
        problem = check_name(tensor, "output")
        if problem:
            raise SymgradError(problem, where=where)
    if outputs is not None and not outputs:
        raise SymgradError("`outputs` lists no output", where=where)
    lets = _int_expressions(
        table, "let", lambda let: f"let {let!r}", 'such as "(k - 1) // 2"', where
    )
    float_positions = ()
    if "float_positions" in table:
        float_positions = _string_list(table["float_positions"], "float_positions", where)
    return OpSpec(
        name,
        formulas,
        inputs,
        tuple(attrs),
        no_gradient,
        where,
        tuple(sizes),
        tuple(ranges),
        budget,
        outputs,
        tuple(lets),
        float_positions,
    )


def _index_problem(name: str) -> str | None:
    """Why `name` cannot be an index of the `ranges` or `sizes` table: as inside a
    formula's brackets, the constants' names are indices there (`y[b,i,e]`)."""
    return None if name in CONSTANTS else check_name(name, "index")


def _int_expressions(table: dict, key: str, title, example: str, where: str):
    """The `ranges` or `let` table: names to integer expressions (strings or whole
    numbers), as (name, text) pairs in the spec's order."""
    entries = table.get(key, {})
    if not isinstance(entries, dict):
        raise SymgradError(f"`{key}` must be a table, not {_type_name(entries)}", where=where)
    pairs = []
    for name, value in entries.items():
        problem = _index_problem(name) if key == "ranges" else check_name(name, key)
        if problem:
            raise SymgradError(problem, where=where)
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise SymgradError(
                f"{title(name)} must be a string {example} or a whole number, not "
                f"{_type_name(value)}",
                where=where,
            )
        pairs.append((name, str(value)))
    return pairs


def parse_op(name: str, table: object, path: str) -> OpSpec:
    """One op table, validated as `[ops.<name>]` of the spec file `path` (also the
    declarations `explain FORMULA` takes as flags)."""
    return _op_spec(name, table, path)


def show(value: object, limit: int = 40) -> str:
    """User text quoted in a message: `repr`, shortened to one readable line."""
    return _show(value, limit)


def _budget(value: object, where: str) -> int:
    """`max_temp_bytes`: a whole number of bytes, at least 1 KiB."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1024 <= value <= 2**62:
        raise SymgradError(
            f"`max_temp_bytes` must be a whole number of bytes from 1024 to 2**62, not {value!r}",
            where=where,
        )
    return value


def parse_spec(text: str, path: str) -> Spec:
    """Validate the TOML text of a spec file (pure: no file access)."""
    _check_path(path)
    text = text.removeprefix("\ufeff")  # a byte-order mark, as some editors write it
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SymgradError(f"not valid TOML: {exc}", where=path) from None
    except RecursionError:
        raise SymgradError("not valid TOML: nested too deeply", where=path) from None
    for key in data:
        if key not in TOP_KEYS:
            raise SymgradError(
                f"unknown top-level key {_show(key)} (known: {', '.join(TOP_KEYS)})"
                f"{_hint(key, TOP_KEYS)}",
                where=path,
            )
    out = data.get("out")
    if out is not None:
        _check_out(out, path)
    targets = _targets(data.get("targets"), out, path)
    ops_table = data.get("ops")
    if ops_table is None:
        raise SymgradError("no `[ops.<Name>]` tables: nothing to generate", where=path)
    if not isinstance(ops_table, dict):
        raise SymgradError("`ops` must be a table of `[ops.<Name>]` tables", where=path)
    if not ops_table:
        raise SymgradError("`ops` is empty: nothing to generate", where=path)
    if len(ops_table) > MAX_OPS:
        raise SymgradError(f"more than {MAX_OPS} ops", where=path)
    budget = DEFAULT_MAX_TEMP_BYTES
    if "max_temp_bytes" in data:
        budget = _budget(data["max_temp_bytes"], path)
    ops = [_op_spec(name, table, path, budget) for name, table in ops_table.items()]
    modules: dict[str, str] = {}
    for op in ops:
        module = snake_case(op.name)
        if module in modules:
            raise SymgradError(
                f"ops {modules[module]!r} and {op.name!r} would both write {module}.py",
                where=path,
            )
        modules[module] = op.name
    return Spec(path, out, tuple(sorted(ops, key=lambda op: op.name)), targets)


def _targets(table: object, out: object, path: str) -> tuple[tuple[str, str], ...]:
    """`[targets]`: framework name -> output folder, each like `out`, no two the same."""
    if table is None:
        return ()
    if not isinstance(table, dict) or not table:
        raise SymgradError(
            '`targets` must be a table of framework = "folder" (e.g. tensorflow = '
            '"generated", pytorch = "generated_torch", jax = "generated_jax")',
            where=path,
        )
    if out is not None:
        raise SymgradError(
            "`out` and `[targets]` both name output folders; give each target's folder in "
            "`[targets]` only",
            where=path,
        )
    folders: dict[str, str] = {}
    for name, folder in table.items():
        if name not in TARGET_FOLDERS:
            raise SymgradError(
                f"unknown target {_show(name)} in `[targets]` (known: "
                f"{', '.join(TARGET_FOLDERS)}){_hint(name, tuple(TARGET_FOLDERS))}",
                where=path,
            )
        _check_out(folder, path, f"`targets.{name}`")
        normal = os.path.normpath(folder)
        if normal in folders.values():
            other = next(n for n, f in folders.items() if f == normal)
            raise SymgradError(
                f"targets {other} and {name} both write to {_show(folder)}; give each its own "
                "folder",
                where=path,
            )
        folders[name] = normal
    return tuple((name, table[name]) for name in table)


def _check_path(path: str) -> None:
    """The spec's path is quoted in messages and its name in generated headers."""
    if not str(path).isprintable():
        raise SymgradError(
            f"spec file name {_show(str(path), 60)} contains control or invisible characters"
        )


def _check_out(out: object, path: str, key: str = "`out`") -> None:
    if not isinstance(out, str) or not out.strip():
        raise SymgradError(f"{key} must be a non-empty string (a folder)", where=path)
    if not out.isprintable():
        raise SymgradError(
            f"{key} {_show(out)} contains control or invisible characters", where=path
        )
    folder = PurePath(out)
    if folder.is_absolute() or folder.drive or ".." in folder.parts:
        raise SymgradError(
            f"{key} {_show(out)} must be a folder inside the spec's folder (relative, no "
            "'..'); use --out to write elsewhere",
            where=path,
        )
    if os.path.normpath(out) == ".":
        raise SymgradError(
            f"{key} {_show(out)} is the spec's own folder; name a folder inside it for the "
            "generated package (e.g. 'generated')",
            where=path,
        )
    check_package_name(PurePath(os.path.normpath(out)), f"{key} {_show(out)}", path)


def check_package_name(folder: PurePath, what: str, where: str) -> None:
    """An output folder becomes a package named after its last part: refuse a name that
    shadows a module (`torch`, `typing`, `conftest`), and Python's `__pycache__`."""
    if "__pycache__" in folder.parts:
        raise SymgradError(
            f"{what} is inside a `__pycache__` folder, which Python owns and clears; "
            "choose another folder",
            where=where,
        )
    if kind := shadows(folder.name):
        raise SymgradError(
            f"{what} would make a package named {folder.name}, which shadows {kind} "
            "wherever its parent folder is on the import path; choose another folder",
            where=where,
        )


def spec_targets(spec: Spec) -> tuple[str, ...]:
    """The targets a spec writes: those of `[targets]`, else TensorFlow alone."""
    return tuple(name for name, _ in spec.targets) or ("tensorflow",)


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file."""
    _check_path(str(path))
    try:
        with open(path, "rb") as stream:
            raw = stream.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise SymgradError("spec file not found", where=str(path)) from None
    except OSError as exc:
        raise SymgradError(f"cannot read spec file: {exc.strerror}", where=str(path)) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SymgradError(f"spec file is larger than {MAX_SPEC_BYTES} bytes", where=str(path))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SymgradError("spec file is not UTF-8", where=str(path)) from None
    return parse_spec(text, str(path))


@functools.cache
def stdlib_modules() -> frozenset[str]:
    """The standard library's top-level module names, frozen: Python 3.11's
    `sys.stdlib_module_names` plus the public modules added since (`annotationlib`,
    `compression`), since the running Python's own set varies by version."""
    return _data_names("stdlib_modules.txt")


@functools.cache
def tf_gradient_ops() -> frozenset[str]:
    """The op types TensorFlow registers a gradient for, frozen, so that generation never
    imports TensorFlow and refuses the same names on every machine."""
    return _data_names("tf_gradient_ops.txt")


def _data_names(file: str) -> frozenset[str]:
    text = importlib.resources.files("symgrad").joinpath("data", file).read_text("utf-8")
    return frozenset(text.split())


def snake_case(name: str) -> str:
    """The module name of an op: TensorFlow's own name for the op's Python function
    (`BatchMatMul` -> `batch_mat_mul`, `MaxPool1dK3S2` -> `max_pool1d_k3s2`), so that
    `from generated import X` and `my_ops.X` (from `tf.load_op_library`) match.

    An exact copy, without importing TensorFlow, of `GenerateLowerCaseOpName` in
    tensorflow/python/framework/python_op_gen_internal.cc, which `tf.load_op_library`
    runs through `_pywrap_python_op_gen.GetPythonWrappers`: an upper-case letter after
    the first is lowered and preceded by `_` when the character before it is lower-case
    or the one after it is (ASCII, as C's `isupper`/`islower`); nothing else changes.
    """
    last = len(name) - 1
    out = []
    for i, char in enumerate(name):
        if _upper(char) and i > 0 and (_lower(name[i - 1]) or (i < last and _lower(name[i + 1]))):
            out.append("_")
        out.append(char.lower() if _upper(char) else char)
    return "".join(out)


def _upper(char: str) -> bool:
    return "A" <= char <= "Z"


def _lower(char: str) -> bool:
    return "a" <= char <= "z"

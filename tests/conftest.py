"""Shared pytest options and fixtures: `--update-golden` (see tests/test_golden.py), and the
test custom-op libraries of tests/custom_op/, compiled once per session."""

from __future__ import annotations

import ctypes
import gc
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

CUSTOM_OPS = Path(__file__).resolve().parent / "custom_op"
COMPILE_TIMEOUT_S = 600


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/<case>/expected/ from the current generator instead of "
        "comparing against it (review the result with `git diff tests/golden`)",
    )


@pytest.fixture(scope="session")
def op_library_path(tmp_path_factory):
    """`op_library_path("window_ops")`: tests/custom_op/window_ops.cc compiled with g++ into
    a shared library (once per session), its path; skips when there is no g++."""
    tf = pytest.importorskip("tensorflow")
    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name in built:
            return built[name]
        compiler = shutil.which("g++")
        if compiler is None:
            pytest.skip("g++ not found on PATH; cannot build a TensorFlow custom-op library")
        source = CUSTOM_OPS / f"{name}.cc"
        library = tmp_path_factory.mktemp(name) / f"{name}.so"
        command = [
            compiler,
            "-shared",
            "-fPIC",
            "-O2",
            "-Wno-deprecated-declarations",
            # TF's bundled Eigen uses std::hardware_destructive_interference_size, which
            # makes GCC >= 12 print a page of -Winterference-size warnings.
            "-Wno-interference-size",
            *tf.sysconfig.get_compile_flags(),
            str(source),
            "-o",
            str(library),
            *tf.sysconfig.get_link_flags(),
        ]
        try:
            proc = subprocess.run(
                command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"compiling {source.name} timed out after {COMPILE_TIMEOUT_S} s")
        if proc.returncode != 0:
            pytest.fail(
                f"compiling {source.name} failed (exit {proc.returncode})\n"
                f"command: {' '.join(command)}\nstderr:\n{proc.stderr}",
                pytrace=False,
            )
        built[name] = library
        return library

    return build


# The test PyTorch C++ ops: `symgrad check`'s (namespace checkcpp) and a custom op the
# generated backward is registered for (symgrad_cpp_test), one library: a build is about
# 35 s on two cores, most of it reading PyTorch's headers, whatever the ops.
TORCH_CPP_SOURCES = ("check_torch_ops.cc", "scaled_mat_mul.cc")


@pytest.fixture(scope="session")
def torch_op_library(tmp_path_factory) -> Path:
    """tests/custom_op's PyTorch C++ ops (`TORCH_CPP_SOURCES`) built once per session with
    torch.utils.cpp_extension and loaded into this process; the library's path. Skips
    without PyTorch or g++."""
    pytest.importorskip("torch")
    if shutil.which("g++") is None:
        pytest.skip("g++ not found; cannot build a C++ op")
    from torch.utils.cpp_extension import load_inline

    folder = tmp_path_factory.mktemp("torch_ops")
    load_inline(
        name="symgrad_torch_test_ops",
        cpp_sources=[(CUSTOM_OPS / name).read_text() for name in TORCH_CPP_SOURCES],
        is_python_module=False,
        build_directory=str(folder),
        extra_cflags=["-O1"],
    )
    library = folder / "symgrad_torch_test_ops.so"
    assert library.is_file()
    return library


def _generated(module) -> bool:
    """Whether a module was imported from a generated file under a test's temporary folder."""
    path = getattr(module, "__file__", None) or ""
    return path.startswith(tempfile.gettempdir()) and isinstance(module, types.ModuleType)


@pytest.fixture(autouse=True, scope="module")
def _release_generated_modules(request):
    """After each test file: its generated modules dropped (from sys.modules, the shared
    cache of `harness.generated_once` and the file's own caches of them), the frameworks'
    caches of traced and compiled functions cleared, and freed heap given back to the
    system. A worker runs some 150 files; keeping all of that, each worker held 12 GB at
    the end of a run on a 23 GB machine, and the last C++ build crawled out of memory."""
    yield
    for name in [n for n, m in sys.modules.items() if m is not None and _generated(m)]:
        del sys.modules[name]
    harness = sys.modules.get("harness")
    if harness is not None:
        harness._ONCE.clear()
    for value in vars(request.module).values():
        if isinstance(value, dict) and any(
            isinstance(v, types.ModuleType) and _generated(v) for v in value.values()
        ):
            value.clear()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass

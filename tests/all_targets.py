"""What the tests of tiling in stages, parts and along a summed index share: the three
frameworks (each test module is skipped where one is missing; JAX in float64), the
repository's root and the tiny budget their small cases run in chunks under."""

from __future__ import annotations

from pathlib import Path

import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp

REPO = Path(__file__).resolve().parent.parent
TINY = 1024  # far below any chunk at these sizes: one or two positions per chunk

__all__ = ["REPO", "TINY", "jax", "jnp", "module_cache", "modules_fixture", "tf", "torch"]


def module_cache(cases: dict, prefix: str, folder: Path):
    """`get(name, target)`: the module of `cases[name]` for `target` (TensorFlow by
    default), generated into `folder` once and then handed out again at its own
    MAX_TEMP_BYTES (each test sets its budget; every module reads it when called). For a
    module-scoped fixture: generating is most of a small test's time."""
    from harness import generate

    made = {}

    def get(name, target="tensorflow"):
        if (name, target) not in made:
            module = generate(cases[name], folder, prefix=prefix, target=target)
            made[name, target] = module, module.MAX_TEMP_BYTES
        module, default = made[name, target]
        module.MAX_TEMP_BYTES = default
        return module

    return get


def modules_fixture(cases: dict, prefix: str):
    """A module-scoped fixture, `modules(name, target)`: `module_cache` of `cases`, for a
    test module to take as its own (`modules = modules_fixture(CASES, "Prefix")`)."""

    @pytest.fixture(scope="module")
    def modules(tmp_path_factory):
        return module_cache(cases, prefix, tmp_path_factory.mktemp(prefix.lower()))

    return modules

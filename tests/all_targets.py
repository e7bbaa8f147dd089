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

__all__ = ["REPO", "TINY", "jax", "jnp", "tf", "torch"]

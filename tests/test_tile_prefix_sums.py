"""Tiling counts a prefix sum's mask exactly where lowering builds it: both ask one
predicate (`lower.kernels.prefix_sum_form`). `Σ_k where(k <= i, x[b,k], 0)` is a cumsum
when i and k have one size; when i runs past x's axis (or stops short of it) the sizes
differ, lowering builds the mask over [b,k,i], and tiling must count it (it took it for a
cumsum before and left the op untiled: quadratic in the length).
"""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

from harness import Case, op_spec
from peaks import run_tensorflow

from symgrad import tile
from symgrad.model import build
from symgrad.pipeline import module_text

CUMSUM = "y[b,i] = sum(where(k <= i, x[b,k], 0), k)"
BUDGET = 2**20


@pytest.mark.parametrize(
    "extent, built",
    [
        ("x.shape[1]", False),  # one size: tf.cumsum, no mask
        ("x.shape[1] + 2", True),  # past the end
        ("x.shape[1] - 2", True),  # short of it
        ("4", True),  # a fixed length
    ],
)
def test_tiling_counts_the_mask_lowering_builds(extent, built):
    spec = op_spec(Case(CUMSUM, {"x": (3, 7)}, ranges={"i": extent}), "Probe")
    text = module_text(spec, "probe.toml", "tensorflow")
    assert ("cumsum" not in text) == built
    assert [{i.name for i in s} for s in tile.big_sets(build(spec))] == (
        [{"b", "k", "i"}] if built else []
    )
    assert ("_tile_plan" in text) == built


PEAKS = """
import json, sys
sys.path.insert(0, {tests!r})
import numpy as np
import tensorflow as tf
from pathlib import Path
from harness import Case, load_module, op_spec
from peaks import tf_step_peaks
from symgrad.pipeline import module_text

spec = op_spec(Case({formula!r}, {{}}, ranges={{"i": "x.shape[1] + 2"}}), "PastTheEnd")
module = load_module(module_text(spec, "t.toml", "tensorflow"), Path({folder!r}), "past_end")
x = tf.constant(np.random.default_rng(0).uniform(-1, 1, (2, 1500)).astype(np.float32))
print(json.dumps(tf_step_peaks(module, [x], {budget})))
"""


def test_a_cumsum_past_the_end_is_tiled_within_the_bound(tmp_path):
    """At x of 2 x 1500 (the untiled mask alone is 18 MB), the tiled training step holds
    at most 4x its input and output plus the budget."""
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    script = PEAKS.format(tests=tests, formula=CUMSUM, folder=str(tmp_path), budget=BUDGET)
    found = run_tensorflow(script)
    assert found["untiled"] > 4 * found["io"] + BUDGET  # the size needs tiling
    assert found["tiled"] <= 4 * found["io"] + BUDGET, found

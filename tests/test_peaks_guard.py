"""The TensorFlow peak measurements (tests/peaks.py) refuse a figure that cannot be a
step's: 0, or below the bytes of the outputs and gradients the step itself makes and
holds at once. A peak read after the step's work was done (its result computed before
`reset_memory_stats`) reads exactly 0, and a bound test would pass on it."""

from __future__ import annotations

import importlib.util

import pytest
from peaks import real_peak, run_tensorflow

STEP_DONE_BEFORE = """
import json, sys
sys.path.insert(0, {tests!r})
import numpy as np
import tensorflow as tf
from peaks import peak

x = tf.constant(np.random.default_rng(0).uniform(-1, 1, (256, 256)).astype(np.float32))

def step():
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.matmul(x, x)
        loss = tf.reduce_sum(tf.sin(y))
    return y, tape.gradient(loss, x)

found = dict(step=peak(step))
done = step()  # the result computed before the statistics are reset
try:
    found["done before"] = peak(lambda: done)
except AssertionError as refused:
    found["refused"] = str(refused)
print(json.dumps(found))
"""


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="no TensorFlow")
def test_a_peak_of_a_step_done_before_the_reset_is_refused():
    """A step measured as tests/peaks.py does (`peak`) reads at least its output and
    gradient (2 x 256 KiB); the same step whose result was computed before the reset
    reads 0 bytes, and `peak` refuses it with an error naming the bytes it should hold."""
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    found = run_tensorflow(STEP_DONE_BEFORE.format(tests=tests), timeout=120)
    assert found["step"] >= 2 * 256 * 256 * 4, found
    assert "done before" not in found, found
    assert "reads 0 bytes, below the 524288 bytes" in found["refused"], found


@pytest.mark.parametrize(("measured", "held"), [(0, 0), (0, 4096), (-8, 0), (4095, 4096)])
def test_a_peak_of_zero_or_below_the_steps_own_bytes_is_refused(measured, held):
    with pytest.raises(AssertionError, match="not a measurement of the step"):
        real_peak(measured, held)


def test_a_peak_at_or_above_the_steps_own_bytes_is_kept():
    assert real_peak(4096, 4096) == 4096
    assert real_peak(5000, 0) == 5000

"""A segment max or min is nan where its segment holds a nan, as the dense max over the
mask (and TF's reduce_max) is: TF's unsorted_segment_max keeps a nan only when it is its
segment's last row (a later, smaller row replaces it), so the TensorFlow module gave a
finite number there, silently."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jnp = pytest.importorskip("jax.numpy")

from harness import Case, generate, reference

ARRAY = {"tensorflow": tf.constant, "pytorch": torch.tensor, "jax": jnp.asarray}


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("kind", ["max", "min"])
def test_segment_extremum_is_nan_where_its_segment_holds_a_nan(kind, target, tmp_path):
    """Rows 0-1, 2-3, 4-6 in segments 0, 1, 2 of 4 (segment 3 empty): a nan first in
    segment 0 and in the middle of segment 2, each followed by a row that the kernel
    keeps instead; whole and in chunks."""
    fill = "-inf" if kind == "max" else "inf"
    case = Case(
        f"y[v,f] = {kind}(where(seg[n] == v, x[n,f], {fill}), n)",
        {"x": (7, 3)},
        index_inputs={"seg": ((7,), 0, 4)},
        ranges={"v": "4"},
        sizes={"v": 4},
    )
    module = generate(case, tmp_path, prefix=f"SegmentNan{kind}", target=target)
    sign = 1.0 if kind == "max" else -1.0
    x = np.arange(21.0).reshape(7, 3) * sign
    x[0, 0] = x[5, 1] = x[4, 2] = np.nan
    x[6, 2] = -50.0 * sign
    seg = np.array([0, 0, 1, 1, 2, 2, 2], np.int32)
    (expected,) = reference(case, {"x": tf.constant(x), "seg": tf.constant(seg)})
    expected = expected.numpy()
    assert np.isnan(expected).sum() == 3 and np.isinf(expected).sum() == 3
    arrays = {"x": x, "seg": seg}
    for budget in (2**40, 1):
        module.MAX_TEMP_BYTES = budget
        got = np.asarray(module.forward(*(ARRAY[target](arrays[n]) for n in module.INPUTS)))
        np.testing.assert_array_equal(got, expected)

"""Tiled modules as a new user would push them: empty axes with a budget that forces
tiling, unknown sizes, float32 far from the origin and logits in the hundreds, ties at a
chunk boundary, training steps, and real ops in their published layouts that are not in
symgrad.toml. Every case compares the chunks with the untiled module (float64, or float32
against a float64 run) in every target it names.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from harness import Case, generate

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp

TINY = 1  # every temporary is over the budget: as many chunks as positions
DISTANCE = "sum((x[b,n,c] - z[b,m,c])**2, c)"
CHAMFER = Case(f"y[b,n] = min({DISTANCE}, m)", {"x": (2, 7, 3), "z": (2, 5, 3)})
RBF = Case(f"y[b] = sum(exp(-{DISTANCE}), n, m)", {"x": (2, 7, 3), "z": (2, 5, 3)})
CHAMFER_BOTH = Case(
    (f"d1[b,n] = min({DISTANCE}, m)", f"d2[b,m] = min({DISTANCE}, n)"),
    {"x": (2, 7, 3), "z": (2, 5, 3)},
)
ARRAY = {"tensorflow": tf.constant, "pytorch": torch.tensor, "jax": jnp.asarray}


def _numpy(t):
    return None if t is None else t.detach().numpy() if torch.is_tensor(t) else np.asarray(t)


# ------------------------------------------------------------------------- empty axes


EMPTY = {  # name -> (x's shape, z's shape): b = 2, n = 7, m = 5, c = 3 where not empty
    "no_batch": ((0, 7, 3), (0, 5, 3)),
    "no_points_in_x": ((2, 0, 3), (2, 5, 3)),
    "no_points_in_z": ((2, 7, 3), (2, 0, 3)),
}


@pytest.mark.parametrize("case", [CHAMFER, RBF, CHAMFER_BOTH], ids=["chamfer", "rbf", "parts"])
@pytest.mark.parametrize("empty", sorted(EMPTY))
def test_tensorflow_unknown_sizes_with_an_empty_axis_and_a_tiny_budget(case, empty, tmp_path):
    """Under tf.function with unknown sizes the module always runs its loop; with an empty
    axis the estimated temporaries are 0 bytes, and the chunk length was divided by them
    (`Integer division by zero`)."""
    if empty != "no_batch" and case is not RBF:
        pytest.skip("a min over no points is its own case (below)")
    module = generate(case, tmp_path, prefix="EmptyUnknown")
    rng = np.random.default_rng(0)
    x, z = (tf.constant(rng.standard_normal(shape)) for shape in EMPTY[empty])
    outputs = module.forward(x, z)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [tf.constant(rng.standard_normal(o.shape)) for o in outputs]
    want = module.vjp(x, z, *grads)
    module.MAX_TEMP_BYTES = TINY
    spec = [tf.TensorSpec([None] * 3, tf.float64)] * 2
    got = tf.function(lambda a, b: module.vjp(a, b, *grads), input_signature=spec)(x, z)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_array_equal(g.numpy(), w.numpy())

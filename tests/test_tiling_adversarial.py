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


# ------------------------------------------------------- float32 far from the origin


def _float32_against_float64(case, arrays, target, tmp_path, budget=TINY):
    """(relative error of the tiled float32 forward and vjp, of the untiled float32 ones)
    against the untiled module in float64, each as the largest error over the largest
    value of every result; the plan of the tiled call."""
    module = generate(case, tmp_path, prefix="Float32", target=target)

    def run(dtype, budget):
        module.MAX_TEMP_BYTES = budget
        rng = np.random.default_rng(5)  # the same cotangents in every run
        args = [ARRAY[target](a.astype(dtype)) for a in arrays]
        outputs = module.forward(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        cotangents = [rng.standard_normal(tuple(o.shape)) for o in outputs]
        grads = module.vjp(*args, *(ARRAY[target](c.astype(dtype)) for c in cotangents))
        return module._tile_plan(*args), [_numpy(t) for t in (*outputs, *grads)]

    _, want = run(np.float64, 2**40)

    def error(budget):
        plan, got = run(np.float32, budget)
        return plan, max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want))

    plan, tiled = error(budget)
    _, untiled = error(2**40)
    return tiled, untiled, plan


CAUSAL_ATTENTION = Case(
    "y[b,i,e] = sum(where(j <= i, exp(sum(q[b,i,d] * k[b,j,d], d)) * v[b,j,e], 0), j)"
    " / sum(where(j <= i, exp(sum(q[b,i,d] * k[b,j,d], d)), 0), j)",
    {"q": (2, 9, 4), "k": (2, 9, 4), "v": (2, 9, 3)},
)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_causal_attention_with_values_inside_the_mask_at_logits_in_the_hundreds(target, tmp_path):
    """`where(j <= i, exp(s) * v, 0)` over its sum: exp(s) alone was formed (inf in
    float32 beyond 88) and multiplied by exp(-L) = 0 (nan), tiled and untiled; now the
    mask moves into the exponent and the product is exp(s - L) * v."""
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((2, 2, 9, 4)) * 6
    v = rng.standard_normal((2, 9, 3))
    logits = np.einsum("bid,bjd->bij", q, k)
    assert np.tril(logits).max() > 150 and np.tril(logits).min() < -100
    tiled, untiled, plan = _float32_against_float64(CAUSAL_ATTENTION, [q, k, v], target, tmp_path)
    assert plan == (9, 1)
    print(f"{target}: relative error {tiled:.1e} tiled, {untiled:.1e} untiled")
    assert tiled < 1e-4 and untiled < 1e-3, (tiled, untiled)

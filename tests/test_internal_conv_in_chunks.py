"""A convolution computing an internal tensor that a segment sum reads, in chunks of its
output positions: in JAX the chunk's start is traced under lax.scan, and the window the
kernel reads (x at start - 1 ...) was cut by Python slicing and `if offset == 0`, which
raised TracerBoolConversionError. The window is cut by lax.dynamic_slice from x padded by
its length (`_window_at`), and its gradient placed back by dynamic_update_slice. Exact in
every target, untiled and in chunks, against the reference (TF autodiff, float64)."""

from __future__ import annotations

import pytest
from harness import Case
from target_harness import check_in_every_target

CASES = {
    # the op of the report: a 3-tap convolution centred on n, then a sum over the n
    # whose (float) segment value equals n's
    "same_segment": Case(
        (
            "h[n] = g[n] * sum(x[n+k-1] * w[k], k)",
            "y[n] = sum(where(sg[m] == sg[n], h[m], 0), m)",
        ),
        {"g": (9,), "x": (11,), "w": (3,), "sg": (9,)},
        outputs=("y",),
        no_gradient=("sg",),
    ),
    # a segment sum by an index tensor, channels, a window reaching past both ends
    "segment_ids": Case(
        (
            "h[n,c] = g[n,c] * sum(x[n+k-2, c] * w[k, c], k)",
            "y[v,c] = sum(where(seg[n] == v, h[n,c], 0), n)",
        ),
        {"g": (9, 2), "x": (10, 2), "w": (4, 2)},
        index_inputs={"seg": ((9,), 0, 4)},
        ranges={"v": "4"},
        sizes={"v": 4},
        outputs=("y",),
    ),
}


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_target_is_exact(name, target, budget, tmp_path):
    check_in_every_target(CASES[name], target, tmp_path, "ConvSeg", budget)


# An internal tensor's output index without a plain read needs a range, and a later
# equation's sum over the same name (another index, primed) is sized by its own plain
# read: the range had been applied to both and refused for the second ("n is a plain
# index of seg ... remove it from `ranges`"), while leaving it out was refused for the
# first ("index 'n' has no range").
RANGED = Case(
    (
        "h[n,c] = sum(x[n+k-2, c] * w[k, c], k)",
        "y[v,c] = sum(where(seg[n] == v, h[n,c], 0), n)",
    ),
    {"x": (10, 2), "w": (4, 2)},
    index_inputs={"seg": ((8,), 0, 4)},
    ranges={"n": "x.shape[0] - w.shape[0] + 2", "v": "4"},
    sizes={"n": 8, "v": 4},
    outputs=("y",),
)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_a_range_sizes_the_internal_index_its_name_leaves_unsized(target, tmp_path):
    check_in_every_target(RANGED, target, tmp_path, "Ranged", budget=1)


# The budget of the report: 64 bytes, so that stage 1 runs in several chunks of n and
# stage 0 (the convolution) in one, its start still the loop's (traced in JAX).
BUDGET = 64


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_training_steps_in_chunks_equal_untiled(target, tmp_path):
    """Two SGD steps of g, x and w on sum(sin(y)) (JAX under jit and grad, PyTorch
    eagerly, TensorFlow with a tape over its registered gradient) in chunks equal the
    untiled module's."""
    from types import SimpleNamespace

    import numpy as np
    import sgd
    from harness import generate, make_tensors

    pytest.importorskip({"tensorflow": "tensorflow", "pytorch": "torch", "jax": "jax"}[target])
    case = CASES["same_segment"]
    module = generate(case, tmp_path, prefix="ConvSegSteps", target=target)
    assert module.INPUTS == ("g", "x", "w", "sg")
    arrays = [t.numpy() for t in make_tensors(case, module.INPUTS)]
    tensors = [_tensor(target)(a) for a in arrays]
    # sg, the segment values, takes no gradient (TensorFlow gives None): held fixed
    trained = SimpleNamespace(forward=lambda g, x, w: module.forward(g, x, w, tensors[3]))

    def loss_of(y, lib):
        return sgd.total(lib.sin(y), lib)

    want = sgd.two_steps(target, trained, arrays[:3], loss_of, lr=0.05)
    module.MAX_TEMP_BYTES = BUDGET
    plan = module._tile_plan(*tensors)
    assert plan is not None and plan[3] < plan[2]  # stage 1: several chunks of n
    got = sgd.two_steps(target, trained, arrays[:3], loss_of, lr=0.05)
    moved = [np.abs(g - a).max() for g, a in zip(got, arrays, strict=False)]
    assert min(moved) > 1e-3, moved  # the steps moved g, x and w
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12, err_msg=target)


def _tensor(target):
    """A NumPy array as `target`'s tensor (float64 JAX)."""
    if target == "tensorflow":
        import tensorflow as tf

        return tf.constant
    from target_harness import frameworks

    return frameworks()[target].tensor


@pytest.mark.parametrize("name", sorted(CASES))
def test_unknown_sizes_equal_eager(name, tmp_path):
    """TensorFlow under tf.function with every size unknown, in chunks (the chunk's start
    and the window's bounds tensors), equals the untiled module run eagerly."""
    pytest.importorskip("tensorflow")
    from adversarial import unknown_sizes_equal_eager
    from harness import generate, make_tensors

    case = CASES[name]
    module = generate(case, tmp_path, prefix="ConvSegUnknown")
    unknown_sizes_equal_eager(module, make_tensors(case, module.INPUTS), case.attrs, seed=2)

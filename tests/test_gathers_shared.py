"""One gather per distinct read: the same window read under other index names (a sum
written twice binds `k`, then `k'`, and `c`, `c'` inside it) is gathered once, while
reads whose indices could differ in size keep their own gathers (symgrad/gather_key.py).
Exactness: TF float64 autodiff and finite differences (harness.check); PyTorch and JAX
equal TF's gradients untiled and their own untiled modules in chunks.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("torch")
pytest.importorskip("jax")

from adversarial import chunks_equal_the_untiled_module
from frameworks import FRAMEWORKS, run_everywhere
from harness import Case, check, generate, op_spec

from symgrad.model import build

# A window read in two sums (the numerator and the denominator of a local softmax-like
# ratio), past both borders (w = 1 at 4 positions), with a plain summed channel.
WINDOW_TWICE = Case(
    (
        "y[b,i] = sum(exp(sum(x[b,i+k-w,c] * z[b,i,c], c)) * u[b,i+k-w], k)"
        " / (1 + sum(exp(sum(x[b,i+k-w,c] * z[b,i,c], c)), k))"
    ),
    {"x": (1, 4, 2), "z": (1, 4, 2), "u": (1, 4)},
    attrs={"w": 1},
    ranges={"k": "2*w + 1"},
    sizes={"k": 3},
)

# Two windows of other ranges (k: 2, j: 3) at the same positions up to names.
OTHER_RANGES = Case(
    "y[b,i] = z[b,i] * sum(x[b,i+k], k) + sum(x[b,i+j] * x[b,i+j], j)",
    {"x": (2, 6), "z": (2, 6)},
    ranges={"k": "2", "j": "3"},
    sizes={"k": 2, "j": 3},
)

# The same name bound twice, sized by plain reads of tensors of other lengths (u: 2, s: 3).
OTHER_SIZES = Case(
    "y[b,i] = z[b,i] * sum(x[b,i+k] * u[k], k) + sum(x[b,i+k] * s[k], k)",
    {"x": (2, 6), "z": (2, 6), "u": (2,), "s": (3,)},
)


def _gathers(case: Case, name: str) -> dict[str, int]:
    program = build(op_spec(case, name))
    found: dict[str, int] = {}
    for level in program.intermediates:
        if level.gather is not None:
            found[level.gather.source] = found.get(level.gather.source, 0) + 1
    return found


def test_a_window_read_twice_is_gathered_once():
    """x at i + k - w and at i + k' - w (c and c' inside): one gather; u: one."""
    assert _gathers(WINDOW_TWICE, "Twice") == {"x": 1, "u": 1}


def test_longformer_gathers_each_window_once():
    """Longformer's numerator and denominator read kk and g at i + k - w (then k'): one
    gather of each, as of v."""
    from test_tiling_adversarial_7 import REAL

    assert _gathers(REAL["longformer_global"], "Long") == {"g": 1, "kk": 1, "v": 1}


def test_windows_of_other_ranges_keep_their_gathers(tmp_path):
    """Indices of other names (and ranges) at the same positions: two gathers, and the
    module equals TF float64 autodiff and finite differences."""
    assert _gathers(OTHER_RANGES, "Apart") == {"x": 2}
    check(OTHER_RANGES, generate(OTHER_RANGES, tmp_path, prefix="Apart"))


def _other_sizes(x, z, u, s):
    """OTHER_SIZES in TF ops, position by position (reads past the end are 0)."""
    rows = []
    for i in range(x.shape[1]):
        a = sum(x[:, i + k] * u[k] for k in range(u.shape[0]) if i + k < x.shape[1])
        c = sum(x[:, i + k] * s[k] for k in range(s.shape[0]) if i + k < x.shape[1])
        rows.append(z[:, i] * a + c)
    return tf.stack(rows, axis=1)


def test_one_name_of_other_sizes_keeps_its_gathers(tmp_path):
    """`k` bound twice, sized by plain reads of u (2) and s (3): two gathers, and forward
    and vjp equal TF float64 autodiff of the formula written position by position."""
    assert _gathers(OTHER_SIZES, "Apart") == {"x": 2}
    module = generate(OTHER_SIZES, tmp_path, prefix="Apart")
    rng = np.random.default_rng(0)
    args = [tf.constant(rng.uniform(-1, 1, OTHER_SIZES.shapes[n])) for n in module.INPUTS]
    cotangent = tf.constant(rng.standard_normal((2, 6)))
    with tf.GradientTape() as tape:
        tape.watch(args)
        want = _other_sizes(**dict(zip(module.INPUTS, args, strict=True)))
    grads = tape.gradient(want, args, output_gradients=cotangent)
    np.testing.assert_allclose(module.forward(*args).numpy(), want.numpy(), rtol=1e-12)
    for got, expected in zip(module.vjp(*args, cotangent), grads, strict=True):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-12, atol=1e-13)


def test_a_shared_gather_equals_tf_autodiff(tmp_path):
    check(WINDOW_TWICE, generate(WINDOW_TWICE, tmp_path, prefix="Shared"))


@pytest.mark.parametrize("target", ["pytorch", "jax"])
def test_a_shared_gather_equals_tf_in_every_target(target, tmp_path):
    """Untiled: the vjp equals TF's (itself checked against autodiff above); PyTorch in
    chunks (a budget of 1 byte): every path equals the untiled module (JAX's eager chunks
    take 40 s here: not run)."""
    want = run_everywhere(
        FRAMEWORKS["tensorflow"], generate(WINDOW_TWICE, tmp_path, "SharedTf"), WINDOW_TWICE
    )
    module = generate(WINDOW_TWICE, tmp_path, prefix="SharedOther", target=target)
    module.MAX_TEMP_BYTES = 2**40
    got = run_everywhere(FRAMEWORKS[target], module, WINDOW_TWICE)
    for g, w in zip(got[1]["vjp"], want[1]["vjp"], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    if target == "pytorch":
        chunks_equal_the_untiled_module(WINDOW_TWICE, target, tmp_path, "SharedChunks")

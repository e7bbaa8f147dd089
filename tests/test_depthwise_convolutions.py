"""A depthwise window, the channel read by the filter and kept in the output (fairseq's
lightconv, a depthwise conv layer), is the frameworks' depthwise kernels: TF's
depthwise_conv2d and its backprops, torch's grouped convolution, and in JAX a sum of the
taps' shifted slices; never a gathered window. Exact in float64 in every target, untiled
and in chunks, against the reference (TF autodiff, finite differences)."""

from __future__ import annotations

import numpy as np
import pytest
from harness import Case, op_spec
from target_harness import check_in_every_target
from test_segment_extrema import _bodies

from symgrad.pipeline import module_text

CASES = {
    # fairseq's lightconv in its [B, C, T] layout, padding_l = (K - 1) // 2 by a let
    "lightconv": Case(
        "y[b,c,t] = sum(w[c,k] * x[b, c, t + k - P], k)",
        {"w": (3, 5), "x": (2, 3, 11)},
        lets={"P": "(w.shape[1] - 1) // 2"},
        let_values={"P": 2},
        ranges={"t": "x.shape[2]"},
        sizes={"t": 11},
    ),
    # fairseq's lightconv with H filters shared by G channels each (its LightweightConv):
    # the filter gathered at c // G, [C, K], then the kernel
    "lightconv_heads": Case(
        "y[b,c,t] = sum(w[c // G, k] * x[b, c, t + k - P], k)",
        {"w": (2, 5), "x": (2, 6, 11)},
        lets={"H": "w.shape[0]", "G": "x.shape[1] // H", "P": "(w.shape[1] - 1) // 2"},
        let_values={"H": 2, "G": 3, "P": 2},
        ranges={"t": "x.shape[2]"},
        sizes={"t": 11},
    ),
    # a causal window (padding on the left only) in [T, B, C]
    "causal_tbc": Case(
        "y[t,b,c] = sum(w[k,c] * x[t + k - 3, b, c], k)",
        {"w": (4, 5), "x": (9, 2, 5)},
        ranges={"t": "x.shape[0]"},
        sizes={"t": 9},
    ),
    # NCHW, VALID, a filter [c, u, v]
    "nchw_valid": Case(
        "y[b,c,i,j] = sum(w[c,u,v] * x[b,c,i+u,j+v], u, v)",
        {"x": (2, 3, 6, 5), "w": (3, 2, 3)},
        ranges={"i": "x.shape[2] - 1", "j": "x.shape[3] - 2"},
        sizes={"i": 5, "j": 3},
    ),
    # NHWC, SAME (3 x 3 centred), a filter [u, v, c]
    "nhwc_same": Case(
        "y[b,i,j,c] = sum(w[u,v,c] * x[b,i+u-1,j+v-1,c], u, v)",
        {"x": (2, 7, 6, 4), "w": (3, 3, 4)},
        ranges={"i": "x.shape[1]", "j": "x.shape[2]"},
        sizes={"i": 7, "j": 6},
    ),
    # no batch axis, a window reaching past both ends unevenly
    "no_batch": Case(
        "y[c,t] = sum(w[c,k] * x[c, t + k - 2], k)",
        {"w": (3, 4), "x": (3, 8)},
        ranges={"t": "x.shape[1] + 1"},
        sizes={"t": 9},
    ),
}

# Not the depthwise kernels: a stride (TF's take one stride for both axes of a 2-D
# window, a 1-D one runs with a unit height), and a channel multiplier (an output
# channel beside the depthwise one). (A filter gathered at computed channels is read by
# the kernel: "lightconv_heads" above.)
GATHERS = {
    "strided": Case(
        "y[b,c,i] = sum(w[c,k] * x[b,c,2*i+k], k)",
        {"x": (2, 3, 11), "w": (3, 3)},
        ranges={"i": "(x.shape[2] - 3) // 2 + 1"},
        sizes={"i": 5},
    ),
    "multiplier": Case(
        "y[b,c,m,i] = sum(w[c,m,k] * x[b,c,i+k], k)",
        {"x": (2, 3, 9), "w": (3, 2, 3)},
        ranges={"i": "x.shape[2] - 2"},
        sizes={"i": 7},
    ),
}


KERNELS = {
    "tensorflow": (
        "tf.nn.depthwise_conv2d(",
        "tf.nn.depthwise_conv2d_backprop_filter",
        "tf.nn.depthwise_conv2d_backprop_input",
    ),
    "pytorch": ("groups=", "_depthwise_backprop_filter(", "_depthwise_backprop_input("),
    "jax": ("_depthwise_conv2d(", "_depthwise_backprop_filter(", "_depthwise_backprop_input("),
}


def _text(case: Case, target: str) -> str:
    return module_text(op_spec(case, "Depthwise"), "test.toml", target)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_depthwise_window_is_the_kernel(name, target):
    text = _text(CASES[name], target)
    kernels = KERNELS[target]
    assert all(k in text for k in kernels), [k for k in kernels if k not in text]
    compute, backward = _bodies(text)
    assert "gather(x" not in compute + backward  # no window of x (lightconv_heads: of w)


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_target_is_exact(name, target, budget, tmp_path):
    check_in_every_target(CASES[name], target, tmp_path, "Depthwise", budget)


@pytest.mark.parametrize("name", sorted(GATHERS))
def test_a_strided_or_multiplied_window_stays_a_gather(name, tmp_path):
    text = _text(GATHERS[name], "tensorflow")
    assert "_depthwise" not in text and "_gather(" in text
    check_in_every_target(GATHERS[name], "tensorflow", tmp_path, "DepthwiseNot", None)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_empty_axes(target, tmp_path):
    """No positions, no channels, no batch: the output has its shape (zeros), every
    gradient is zero and shaped like its input."""
    from harness import generate
    from target_harness import converters

    tensor, numpy = converters(target)
    module = generate(CASES["lightconv"], tmp_path, prefix="DepthwiseEmpty", target=target)
    for w_shape, x_shape in (((3, 5), (2, 3, 0)), ((0, 5), (2, 0, 11)), ((3, 5), (0, 3, 11))):
        w, x = tensor(np.ones(w_shape)), tensor(np.ones(x_shape))
        y = numpy(module.forward(w, x))
        assert y.shape == x_shape and not y.any()
        grads = module.vjp(w, x, tensor(np.ones(x_shape)))
        for g, shape in zip(grads, (w_shape, x_shape), strict=True):
            assert numpy(g).shape == shape and not numpy(g).any()


@pytest.mark.parametrize("name", ["lightconv", "nhwc_same"])
def test_tf_function_with_unknown_sizes_and_xla_equal_eager(name, tmp_path):
    """Every size unknown while tracing (the window padded and cut by tensors), and
    under XLA: forward and gradients equal the module run eagerly."""
    from harness import generate, make_tensors
    from target_harness import check_graphs_equal_eager

    case = CASES[name]
    module = generate(case, tmp_path, prefix="DepthwiseGraph")
    check_graphs_equal_eager(module, make_tensors(case, module.INPUTS))


def test_jax_jit_vmap_and_grad_equal_eager(tmp_path):
    """The taps' shifted slices under jax.jit, vmap over a batch of filters, and
    jax.grad through `forward`, against the module run eagerly."""
    import jax
    import jax.numpy as jnp
    from harness import generate

    jax.config.update("jax_enable_x64", True)
    module = generate(CASES["nchw_valid"], tmp_path, prefix="DepthwiseJit", target="jax")
    rng = np.random.default_rng(2)
    x, w = (
        jnp.asarray(rng.standard_normal((2, 3, 6, 5))),
        jnp.asarray(rng.standard_normal((3, 2, 3))),
    )
    order = module.INPUTS
    args = [x if n == "x" else w for n in order]

    def loss(*a):
        return jnp.sum(jnp.sin(module.forward(*a)))

    eager = jax.grad(loss, argnums=(0, 1))(*args)
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
    for g, e in zip(jitted, eager, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-12, atol=1e-12)
    ws = jnp.stack([w, 2 * w])
    batched = jax.vmap(lambda f: module.forward(*[x if n == "x" else f for n in order]))(ws)
    for k in range(2):
        one = module.forward(*[x if n == "x" else ws[k] for n in order])
        np.testing.assert_allclose(np.asarray(batched[k]), np.asarray(one), rtol=1e-12, atol=1e-12)


def _second_order(target: str, module, w0: np.ndarray, x0: np.ndarray) -> list[np.ndarray]:
    """∇ of |∇_w L|² + Σ (∇_x L)³ for L = Σ sin(y), through each framework's autodiff of
    the module's `forward` (its generated backward, differentiated once more)."""
    if target == "pytorch":
        import torch

        w, x = torch.tensor(w0, requires_grad=True), torch.tensor(x0, requires_grad=True)
        gw, gx = torch.autograd.grad(
            torch.sin(module.forward(w, x)).sum(), [w, x], create_graph=True
        )
        return [h.numpy() for h in torch.autograd.grad((gw**2).sum() + (gx**3).sum(), [w, x])]
    if target == "jax":
        import jax
        import jax.numpy as jnp

        jax.config.update("jax_enable_x64", True)

        def inner(w, x):
            gw, gx = jax.grad(lambda a, b: jnp.sum(jnp.sin(module.forward(a, b))), (0, 1))(w, x)
            return jnp.sum(gw**2) + jnp.sum(gx**3)

        return [np.asarray(h) for h in jax.grad(inner, (0, 1))(jnp.asarray(w0), jnp.asarray(x0))]
    import tensorflow as tf

    w, x = tf.constant(w0), tf.constant(x0)
    with tf.GradientTape() as outer:
        outer.watch([w, x])
        with tf.GradientTape() as tape:
            tape.watch([w, x])
            loss = tf.reduce_sum(tf.sin(module.forward(w, x)))
        gw, gx = tape.gradient(loss, [w, x])
        second = tf.reduce_sum(gw**2) + tf.reduce_sum(gx**3)
    return [h.numpy() for h in outer.gradient(second, [w, x])]


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_second_derivatives_equal_torchs_grouped_convolution(target, tmp_path):
    """The gradient of a gradient through the depthwise kernels (lightconv, K = 5) equals
    PyTorch's autodiff of its own grouped conv1d, twice."""
    torch = pytest.importorskip("torch")
    from harness import generate

    module = generate(CASES["lightconv"], tmp_path, prefix="DepthwiseTwice", target=target)
    assert module.INPUTS == ("w", "x")
    rng = np.random.default_rng(0)
    w0, x0 = rng.standard_normal((3, 5)), rng.standard_normal((2, 3, 11))

    class Grouped:
        @staticmethod
        def forward(w, x):
            return torch.nn.functional.conv1d(x, w[:, None, :], padding=2, groups=3)

    want = _second_order("pytorch", Grouped, w0, x0)
    got = _second_order(target, module, w0, x0)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-10)

"""Recurrences (issue 18): an equation that reads its own tensor at earlier positions is a
scan; its gradient is the adjoint scan derived from the step. Each op is checked in every
target against a NumPy loop written from the formula, and its gradient against central
finite differences of that loop (a directional derivative per input), in float64, with a
different size for every index."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from frameworks import FRAMEWORKS
from harness import generated_once, load_module

from symgrad.errors import SymgradError
from symgrad.pipeline import module_text
from symgrad.spec import OpSpec

TARGETS = ("tensorflow", "pytorch", "jax")


def op_spec(name, formulas, **extra) -> OpSpec:
    formulas = (formulas,) if isinstance(formulas, str) else tuple(formulas)
    return OpSpec(
        name=name,
        formulas=formulas,
        inputs=extra.pop("inputs", None),
        attrs=extra.pop("attrs", ()),
        no_gradient=extra.pop("no_gradient", ()),
        source=f"test [ops.{name}]",
        **extra,
    )


# ----------------------------------------------------------------------------- references


def linear_ref(a, x):
    h = np.zeros_like(x)
    for t in range(x.shape[1]):
        h[:, t] = x[:, t] + (a[:, t] * h[:, t - 1] if t > 0 else 0)
    return (h,)


def linear_init_ref(h0, a, x):
    h = np.zeros_like(x)
    for t in range(x.shape[1]):
        h[:, t] = h0 if t == 0 else a[:, t] * h[:, t - 1] + x[:, t]
    return (h,)


def lfilter_ref(x, a, bb):
    """torchaudio's lfilter with a[0] = 1 normalised out: the feed-forward part reads x at
    lags 0 .. len(bb) - 1, the feedback part y at lags 1 .. len(a)."""
    y = np.zeros_like(x)
    for t in range(x.shape[1]):
        for k in range(bb.shape[0]):
            if t - k >= 0:
                y[:, t] += bb[k] * x[:, t - k]
        for q in range(a.shape[0]):
            if t - 1 - q >= 0:
                y[:, t] -= a[q] * y[:, t - 1 - q]
    return (y,)


def feedback_ref(x, a):
    """lfilter's feedback part alone (bb = [1])."""
    y = np.zeros_like(x)
    for t in range(x.shape[1]):
        y[:, t] = x[:, t]
        for k in range(a.shape[0]):
            if t - 1 - k >= 0:
                y[:, t] -= a[k] * y[:, t - 1 - k]
    return (y,)


def lagged_input_ref(a, x):
    """A linear recurrence whose input is read one position back (zero at the start)."""
    h = np.zeros_like(x)
    for t in range(x.shape[1]):
        h[:, t] = (a[:, t] * h[:, t - 1] + x[:, t - 1]) if t > 0 else 0
    return (h,)


def two_back_ref(c, x):
    """An input read at the scan position and two positions back."""
    h = np.zeros_like(x)
    for t in range(x.shape[1]):
        past = h[:, t - 1] if t > 0 else 0
        h[:, t] = c[:, t] * past + x[:, t] - (0.5 * x[:, t - 2] if t > 1 else 0)
    return (h,)


def init_lag_ref(x, a):
    """An initial state, then the input read one position back."""
    h = np.zeros_like(x)
    for t in range(x.shape[1]):
        h[:, t] = x[:, t] if t == 0 else a[:, t] * h[:, t - 1] + x[:, t - 1]
    return (h,)


def reverse_lagged_ref(r, g):
    """A discounted return: G[t] = r[t+1] + g G[t+1], reads past the end zero."""
    G = np.zeros_like(r)
    n = r.shape[1]
    for t in reversed(range(n)):
        if t + 1 < n:
            G[:, t] = r[:, t + 1] + g[:, t] * G[:, t + 1]
    return (G,)


def reverse_ref(x, c):
    h = np.zeros_like(x)
    for t in reversed(range(x.shape[1])):
        nxt = h[:, t + 1] if t + 1 < x.shape[1] else 0
        h[:, t] = x[:, t] + c[:, t] * nxt
    return (h,)


def selective_scan_ref(delta, A, B, x, C, D):
    """state-spaces/mamba's selective_scan_ref (mamba_ssm/ops/selective_scan_interface.py)
    for real A, B and C shaped [b, n, t], no z, no delta bias or softplus."""
    b, d, t = x.shape
    n = A.shape[1]
    h = np.zeros((b, d, n))
    y = np.zeros((b, d, t))
    for s in range(t):
        h = np.exp(delta[:, :, s, None] * A) * h + (
            delta[:, :, s, None] * B[:, None, :, s] * x[:, :, s, None]
        )
        y[:, :, s] = np.einsum("bdn,bn->bd", h, C[:, :, s]) + D * x[:, :, s]
    return (y,)


def rnn_ref(W, x):
    h = np.zeros_like(x)
    for t in range(x.shape[1]):
        past = h[:, t - 1] if t > 0 else np.zeros_like(x[:, 0])
        h[:, t] = np.tanh(np.einsum("de,be->bd", W, past) + x[:, t])
    return (h,)


def two_lags_ref(x):
    h = np.zeros_like(x)
    for t in range(x.shape[1]):
        h[:, t] = (
            x[:, t] + (0.5 * h[:, t - 1] if t > 0 else 0) - (0.25 * h[:, t - 2] if t > 1 else 0)
        )
    return (h,)


def init_inline_ref(h0, a, x):
    h = np.zeros_like(x)
    for t in range(x.shape[1]):
        h[:, t] = x[:, t] + (a[:, t] * h[:, t - 1] if t > 0 else h0)
    return (h,)


def _lerp(row, q):
    """A linear read of `row` at the float position q; zero past either end."""
    low = int(np.floor(q))
    found = 0.0
    for at, weight in ((low, 1 - (q - low)), (low + 1, q - low)):
        if 0 <= at < row.shape[-1]:
            found = found + weight * row[..., at]
    return found


def sampled_read_ref(a, x, p):
    h = np.zeros_like(a)
    for t in range(a.shape[1]):
        for b in range(a.shape[0]):
            for c in range(a.shape[2]):
                past = h[b, t - 1, c] if t > 0 else 0.0
                h[b, t, c] = a[b, t, c] * past + _lerp(x[b, t], p[b, c])
    return (h,)


def floor_read_ref(a, x):
    return linear_ref(np.repeat(a, 2, axis=2)[:, :, : x.shape[2]], x)


def composite_read_ref(a, x):
    return linear_ref(a.reshape(x.shape), x)


def mamba_grouped_ref(u, delta, A, Bm, Cm, Dv, delta_bias):
    """mamba_ssm's selective_scan_ref for real A and B, C of shape [b, g, n, l] (each group
    of dim // g channels shares one), with delta_bias and delta_softplus."""
    dt = np.logaddexp(0, delta + delta_bias[None, :, None])
    repeat = u.shape[1] // Bm.shape[1]
    B, C = np.repeat(Bm, repeat, axis=1), np.repeat(Cm, repeat, axis=1)
    h = np.zeros((u.shape[0], u.shape[1], A.shape[1]))
    y = np.zeros_like(u)
    for t in range(u.shape[2]):
        h = np.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * u[:, :, t])[..., None] * B[..., t]
        y[:, :, t] = np.sum(C[..., t] * h, axis=-1) + Dv * u[:, :, t]
    return (y,)


CASES = {
    # reads at a float position, at d // 2, at a composite (g, j) (the step is written back
    # as formula text: these were internal errors)
    "sampled_read": (
        op_spec("SampledRead", "h[b,t,c] = a[b,t,c] * h[b,t-1,c] + x[b,t,1.0 * p[b,c]]"),
        {"a": (2, 5, 3), "x": (2, 5, 7), "p": (2, 3)},
        sampled_read_ref,
    ),
    "floor_read": (
        op_spec("FloorRead", "h[b,t,d] = a[b,t,d // 2] * h[b,t-1,d] + x[b,t,d]"),
        {"a": (2, 6, 2), "x": (2, 6, 3)},
        floor_read_ref,
    ),
    "composite_read": (
        op_spec("CompositeRead", "h[b,t,g,j] = a[b,t,(g,j)] * h[b,t-1,g,j] + x[b,t,g,j]"),
        {"a": (2, 5, 12), "x": (2, 5, 3, 4)},
        composite_read_ref,
    ),
    # Mamba's selective scan in its own layout: B and C per group of channels, the group
    # size a let that reads B's group axis (B is cut along its last axis, l)
    "mamba_grouped": (
        op_spec(
            "MambaGrouped",
            [
                (
                    "h[b,d,n,l] = exp(softplus(delta[b,d,l] + delta_bias[d]) * A[d,n])"
                    " * h[b,d,n,l-1]"
                    " + softplus(delta[b,d,l] + delta_bias[d]) * Bm[b,d // R,n,l] * u[b,d,l]"
                ),
                "y[b,d,l] = sum(Cm[b,d // R,n,l] * h[b,d,n,l], n) + Dv[d] * u[b,d,l]",
            ],
            inputs=("u", "delta", "A", "Bm", "Cm", "Dv", "delta_bias"),
            outputs=("y",),
            lets=(("R", "u.shape[1] // Bm.shape[1]"),),
        ),
        {
            "u": (2, 6, 5),
            "delta": (2, 6, 5),
            "A": (6, 4),
            "Bm": (2, 2, 4, 5),
            "Cm": (2, 2, 4, 5),
            "Dv": (6,),
            "delta_bias": (6,),
        },
        mamba_grouped_ref,
    ),
    # a condition on the scan index inside the formula: the first position is its own step
    "init_inline": (
        op_spec(
            "InitInline",
            "h[b,t,d] = x[b,t,d] + where(t > 0, a[b,t,d] * h[b,t-1,d], h0[b,d])",
            inputs=("h0", "a", "x"),
        ),
        {"h0": (2, 3), "a": (2, 5, 3), "x": (2, 5, 3)},
        init_inline_ref,
    ),
    # the past state read along another index (summed against a matrix): regression for
    # a refusal as "two indices"
    "rnn": (
        op_spec("Rnn", "h[b,t,d] = tanh(sum(W[d,e] * h[b,t-1,e], e) + x[b,t,d])"),
        {"W": (3, 3), "x": (2, 6, 3)},
        rnn_ref,
    ),
    "two_lags": (
        op_spec("TwoLags", "h[b,t] = x[b,t] + 0.5 * h[b,t-1] - 0.25 * h[b,t-2]"),
        {"x": (3, 7)},
        two_lags_ref,
    ),
    "linear": (
        op_spec("LinearRec", "h[b,t,d] = a[b,t,d] * h[b,t-1,d] + x[b,t,d]"),
        {"a": (2, 7, 3), "x": (2, 7, 3)},
        linear_ref,
    ),
    "init": (
        op_spec(
            "LinearInit",
            "h[b,t,d] = where(t == 0, h0[b,d], a[b,t,d] * h[b,t-1,d] + x[b,t,d])",
        ),
        {"h0": (2, 3), "a": (2, 5, 3), "x": (2, 5, 3)},
        linear_init_ref,
    ),
    "lfilter": (
        op_spec(
            "Lfilter",
            "y[b,t] = sum(bb[k] * x[b,t-k], k) - sum(a[q] * y[b,t-1-q], q)",
            inputs=("x", "a", "bb"),
        ),
        {"x": (3, 9), "a": (4,), "bb": (5,)},
        lfilter_ref,
    ),
    "feedback": (
        op_spec("Feedback", "y[b,t] = x[b,t] - sum(a[k] * y[b,t-1-k], k)"),
        {"x": (3, 9), "a": (4,)},
        feedback_ref,
    ),
    # inputs read at lags: a constant lag, the scan position and two back, and a reverse
    # recurrence reading a later position
    "lagged_input": (
        op_spec("LaggedInput", "h[b,t,d] = a[b,t,d] * h[b,t-1,d] + x[b,t-1,d]"),
        {"a": (2, 7, 3), "x": (2, 7, 3)},
        lagged_input_ref,
    ),
    "two_back": (
        op_spec("TwoBack", "h[b,t] = c[b,t] * h[b,t-1] + x[b,t] - 0.5 * x[b,t-2]"),
        {"x": (3, 8), "c": (3, 8)},
        two_back_ref,
    ),
    "init_lag": (
        op_spec("InitLag", "h[b,t] = where(t == 0, x[b,t], a[b,t] * h[b,t-1] + x[b,t-1])"),
        {"x": (3, 6), "a": (3, 6)},
        init_lag_ref,
    ),
    "reverse_lagged": (
        op_spec("DiscountedReturn", "G[b,t] = r[b,t+1] + g[b,t] * G[b,t+1]"),
        {"r": (2, 7), "g": (2, 7)},
        reverse_lagged_ref,
    ),
    "reverse": (
        op_spec("ReverseRec", "h[b,t] = x[b,t] + c[b,t] * h[b,t+1]"),
        {"x": (2, 6), "c": (2, 6)},
        reverse_ref,
    ),
    "selective_scan": (
        op_spec(
            "SelectiveScan",
            [
                (
                    "h[b,d,n,t] = exp(delta[b,d,t] * A[d,n]) * h[b,d,n,t-1]"
                    " + delta[b,d,t] * B[b,n,t] * x[b,d,t]"
                ),
                "y[b,d,t] = sum(C[b,n,t] * h[b,d,n,t], n) + D[d] * x[b,d,t]",
            ],
            outputs=("y",),
        ),
        {
            "delta": (2, 3, 6),
            "A": (3, 4),
            "B": (2, 4, 6),
            "x": (2, 3, 6),
            "C": (2, 4, 6),
            "D": (3,),
        },
        selective_scan_ref,
    ),
}


def inputs_for(shapes, seed=0):
    rng = np.random.default_rng(seed)
    found = {}
    for name, shape in shapes.items():
        value = rng.standard_normal(shape)
        if name in ("delta",):
            value = np.abs(value) * 0.5
        if name in ("A",):
            value = -np.abs(value)
        if name in ("a", "c", "g"):
            value = 0.4 * np.tanh(value)
        if name == "p":  # float positions on both sides of x's last axis (0 .. 6)
            value = 3 + 3 * value
        found[name] = value
    return found


def module_for(case, target, folder):
    return generated_once(f"rec_{case}_{target}", CASES[case][0], target, folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("recurrences")


def _directional(ref, values, names, grads_out, k, rng, eps=1e-6):
    v = rng.standard_normal(values[names[k]].shape)
    plus = dict(values)
    minus = dict(values)
    plus[names[k]] = values[names[k]] + eps * v
    minus[names[k]] = values[names[k]] - eps * v
    outs_p = ref(*[plus[n] for n in names])
    outs_m = ref(*[minus[n] for n in names])
    fd = sum(np.sum(g * (p - m)) / (2 * eps) for g, p, m in zip(grads_out, outs_p, outs_m))
    return v, fd


# The ops of symgrad.toml in every target; each other spelling in one target, taking
# turns (each module costs a generation: the file stays fast).
EVERYWHERE = (
    "linear",
    "lfilter",
    "selective_scan",
    "lagged_input",
    "reverse_lagged",
    "sampled_read",
    "mamba_grouped",
)
OTHERS = sorted(c for c in CASES if c not in EVERYWHERE)
PAIRS = [(c, t) for c in EVERYWHERE for t in TARGETS] + [
    (c, TARGETS[k % len(TARGETS)]) for k, c in enumerate(OTHERS)
]


@pytest.mark.parametrize(("case", "target"), PAIRS)
def test_forward_and_gradient_match_loop(case, target, folder):
    _, shapes, ref = CASES[case]
    module = module_for(case, target, folder)
    names = module.INPUTS
    values = inputs_for(shapes)
    fw = FRAMEWORKS[target]
    args = [fw.tensor(values[n]) for n in names]
    want = ref(*[values[n] for n in names])
    got = module.forward(*args)
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(fw.numpy(g), w, rtol=1e-10, atol=1e-12)
    rng = np.random.default_rng(5)
    grads_out = [rng.standard_normal(w.shape) for w in want]
    found = module.vjp(*args, *[fw.tensor(g) for g in grads_out])
    for k, name in enumerate(names):
        v, fd = _directional(ref, values, names, grads_out, k, rng)
        mine = np.sum(fw.numpy(found[k]) * v)
        np.testing.assert_allclose(mine, fd, rtol=1e-6, atol=1e-8, err_msg=name)


def _loss_and_grads(fw, module, args, targets):
    """A training step's loss `Σ ½(y - target)²` and its gradients through the framework's
    own machinery (TF tape, torch autograd, jax.jit(value_and_grad)), then the loss after
    one SGD step."""
    if fw.name == "tensorflow":
        import tensorflow as tf

        variables = [tf.Variable(a) for a in args]

        def loss_of():
            ys = module.forward(*variables)
            ys = ys if isinstance(ys, tuple) else (ys,)
            return tf.add_n([0.5 * tf.reduce_sum((y - t) ** 2) for y, t in zip(ys, targets)])

        with tf.GradientTape() as tape:
            loss = loss_of()
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads, strict=True):
            v.assign_sub(0.002 * g)
        return float(loss), [g.numpy() for g in grads], float(loss_of())
    if fw.name == "pytorch":
        import torch

        leaves = [a.clone().requires_grad_(True) for a in args]

        def loss_of(xs):
            ys = module.forward(*xs)
            ys = ys if isinstance(ys, tuple) else (ys,)
            return sum(0.5 * ((y - t) ** 2).sum() for y, t in zip(ys, targets))

        loss = loss_of(leaves)
        loss.backward()
        grads = [x.grad.numpy().copy() for x in leaves]
        with torch.no_grad():
            for x in leaves:
                x -= 0.002 * x.grad
            after = loss_of(leaves)
        return loss.item(), grads, after.item()
    import jax

    def loss_of(*xs):
        ys = module.forward(*xs)
        ys = ys if isinstance(ys, tuple) else (ys,)
        return sum(0.5 * ((y - t) ** 2).sum() for y, t in zip(ys, targets))

    step = jax.jit(jax.value_and_grad(loss_of, argnums=tuple(range(len(args)))))
    loss, grads = step(*args)
    after = step(*[a - 0.002 * g for a, g in zip(args, grads, strict=True)])[0]
    return float(loss), [np.asarray(g) for g in grads], float(after)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", ["lfilter", "selective_scan", "lagged_input", "reverse_lagged"])
def test_training_step(case, target, folder):
    """One SGD step through the generated module: the framework's gradient of the loss is
    the generated vjp of (y - target), and the loss goes down."""
    _, shapes, ref = CASES[case]
    module = module_for(case, target, folder)
    fw = FRAMEWORKS[target]
    values = inputs_for(shapes, seed=3)
    args = [fw.tensor(values[n]) for n in module.INPUTS]
    want = ref(*[values[n] for n in module.INPUTS])
    rng = np.random.default_rng(4)
    targets_np = [w + rng.standard_normal(w.shape) for w in want]
    loss, grads, after = _loss_and_grads(fw, module, args, [fw.tensor(t) for t in targets_np])
    expected = module.vjp(*args, *[fw.tensor(w - t) for w, t in zip(want, targets_np)])
    for g, e in zip(grads, expected, strict=True):
        np.testing.assert_allclose(g, fw.numpy(e), rtol=1e-9, atol=1e-12)
    assert after < loss


@pytest.mark.parametrize("case", ["selective_scan", "lfilter"])
def test_tensorflow_unknown_dims_and_xla(case, folder):
    """Under tf.function with every dim unknown the scan is a tf.while_loop whose length
    is read when the graph runs; under jit_compile=True it compiles with XLA (lfilter:
    with an input read at lags, whose window's depth is read from bb's shape)."""
    import tensorflow as tf

    module = module_for(case, "tensorflow", folder)
    _, shapes, ref = CASES[case]
    values = inputs_for(shapes, seed=7)
    args = [tf.constant(values[n]) for n in module.INPUTS]
    want = ref(*[values[n] for n in module.INPUTS])[0]
    g_y = np.random.default_rng(8).standard_normal(want.shape)
    expected = module.vjp(*args, tf.constant(g_y))

    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = module.forward(*xs)
        return y, tape.gradient(y, xs, output_gradients=tf.constant(g_y))

    signature = [
        tf.TensorSpec([None] * len(s), tf.float64) for s in (shapes[n] for n in module.INPUTS)
    ]
    for compiled in (
        tf.function(step, input_signature=signature),
        tf.function(step, jit_compile=True),
    ):
        y, grads = compiled(*args)
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-10)
        for g, e in zip(grads, expected, strict=True):
            np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-10, atol=1e-12)


def test_pytorch_compile_fullgraph(folder):
    """torch.compile(fullgraph=True) takes the forward and the generated backward loop."""
    import torch

    module = module_for("lfilter", "pytorch", folder)
    _, shapes, ref = CASES["lfilter"]
    values = inputs_for(shapes, seed=9)
    leaves = [torch.tensor(values[n], requires_grad=True) for n in module.INPUTS]
    g_y = torch.tensor(np.random.default_rng(2).standard_normal(values["x"].shape))

    def loss(*xs):
        return (module.forward(*xs) * g_y).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    value = compiled(*leaves)
    value.backward()
    expected = module.vjp(*[x.detach() for x in leaves], g_y)
    np.testing.assert_allclose(
        value.item(),
        float((ref(*[values[n] for n in module.INPUTS])[0] * g_y.numpy()).sum()),
        rtol=1e-10,
    )
    for x, e in zip(leaves, expected, strict=True):
        np.testing.assert_allclose(x.grad.numpy(), e.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["linear", "lagged_input"])
def test_jax_jit_vmap_and_grad_of_the_backward(case, folder):
    """The JAX module works under jit and vmap, and the generated adjoint scan is itself
    differentiable: a second derivative matches finite differences of the first (also
    with its input read one position back)."""
    import jax
    import jax.numpy as jnp

    module = module_for(case, "jax", folder)
    _, shapes, ref = CASES[case]
    values = inputs_for(shapes, seed=11)
    a, x = (jnp.asarray(values[n]) for n in module.INPUTS)
    batched = jax.jit(jax.vmap(module.forward))(jnp.stack([a, 0.5 * a]), jnp.stack([x, x]))
    np.testing.assert_allclose(batched[1], ref(0.5 * values["a"], values["x"])[0], rtol=1e-10)

    def first(a):  # d/da of sum(h^2), through the generated backward
        return jax.grad(lambda a: (module.forward(a, x) ** 2).sum())(a)

    v = jnp.asarray(np.random.default_rng(3).standard_normal(a.shape))
    hvp = jax.jvp(jax.jit(first), (a,), (v,))[1]
    eps = 1e-6
    fd = (first(a + eps * v) - first(a - eps * v)) / (2 * eps)
    np.testing.assert_allclose(hvp, fd, rtol=1e-5, atol=1e-8)


def test_selective_scan_training_step_memory_is_bounded(folder):
    """Mamba's internal state h[b,d,n,t] is N times the inputs. The associative scan runs
    in chunks of as many positions as fit MAX_TEMP_BYTES (read at call time) and keeps
    only the state before each chunk; a training step's peak allocation (torch.profiler's
    memory events) stays under 4x the inputs and outputs plus the budget. At a budget of
    a few positions the chunking bites: the forward keeps one state per chunk, not h over
    the whole sequence, which a single chunk (the default budget, everything fits) holds several
    times over, and the peak falls to a fraction of the single chunk's."""
    import torch
    from test_tiling import _torch_memory

    module = module_for("selective_scan", "pytorch", folder)
    b, d, n, length = 1, 8, 32, 144
    shapes = {
        "delta": (b, d, length),
        "A": (d, n),
        "B": (b, n, length),
        "x": (b, d, length),
        "C": (b, n, length),
        "D": (d,),
    }
    values = inputs_for(shapes)
    xs = [torch.tensor(values[k], dtype=torch.float32, requires_grad=True) for k in module.INPUTS]
    inputs = sum(x.numel() for x in xs) * 4
    outputs = b * d * length * 4
    state = b * d * n * 4
    default = module.MAX_TEMP_BYTES
    _, whole = _torch_memory(module, xs, {})
    assert whole < 4 * (inputs + outputs) + default
    assert whole > 4 * state * length  # one chunk: several tensors of h's size
    budget = 4 * 16 * state  # four positions' temporaries
    try:
        module.MAX_TEMP_BYTES = budget
        chunk = module._chunk_length(length, (b, d, n), torch.float32)
        assert chunk == 4
        kept, peak = _torch_memory(module, xs, {})
    finally:
        module.MAX_TEMP_BYTES = default
    assert kept <= inputs + (length // chunk + 1) * state  # one state per chunk
    assert peak < 4 * (inputs + outputs) + budget
    assert peak < whole / 4  # the chunking bites


def test_lfilter_training_step_holds_no_copy_per_tap(folder):
    """lfilter with 16 feed-forward taps: the step reads a window of 16 slices of x, and
    the PyTorch backward adds each window's gradient in place, so a training step peaks
    under 4x the inputs and outputs, where a copy of x per tap would be 16x x."""
    import torch
    from test_tiling import _torch_memory

    module = module_for("lfilter", "pytorch", folder)
    values = inputs_for({"x": (8, 160), "a": (3,), "bb": (16,)}, seed=6)
    xs = [torch.tensor(values[k], dtype=torch.float32, requires_grad=True) for k in module.INPUTS]
    inputs = sum(x.numel() for x in xs) * 4
    outputs = values["x"].size * 4
    _, peak = _torch_memory(module, xs, {})
    assert peak < 4 * (inputs + outputs)
    assert peak < 16 * values["x"].size * 4


@pytest.mark.parametrize(
    ("formula", "message", "caret"),
    [
        ("h[b,t] = x[b,t] * h[b,t]", "reads itself at the same position", "h[b,t]"),
        (
            "R[i,j,k] = D[i,j,k] + R[i-1,j-1,k-1]",
            "cannot be ordered",
            "R[i-1,j-1,k-1]",
        ),
        (
            "R[i,j] = D[i,j] + R[i-1,j+1] + R[i+1,j-1]",
            "cannot be ordered",
            "R[i-1,j+1]",
        ),
        ("h[t] = x[t] + h[t-1] + h[t+1]", "both before and after", "h[t-1]"),
        ("h[t] = x[t] + h[t-1-k] * a[k] + h[k]", "at no shift of its own", "h[k]"),
        ("h[b,t] = x[b,t+1] + h[b,t-1]", "read at later positions", "x[b,t+1]"),
        ("G[b,t] = r[b,t-1] + G[b,t+1]", "read at earlier positions", "r[b,t-1]"),
        ("h[b,t] = x[b,2*t] + h[b,t-1]", "plus or minus a lag", "x[b,2*t]"),
        ("h[b,t] = x[b,t-1] + x[b,0] + h[b,t-1]", "and here not along it", "x[b,0]"),
        ("h[b,t] = t * h[b,t-1] + x[b,t]", "used as a value", "t * h"),
        # an input along the scan index alone (its step would read `a[]`; this had been a
        # syntax error in that step formula, shown as the user's)
        ("h[b,t] = a[t] * h[b,t-1] + x[b,t]", "at the scan index 't' alone", "a[t]"),
    ],
)
def test_refusals_point_at_the_read(formula, message, caret):
    with pytest.raises(SymgradError) as found:
        module_text(op_spec("Bad", formula), "test", "tensorflow")
    error = found.value
    assert message in error.message
    assert error.column == formula.rindex(caret), error.render()


def test_explain_shows_the_recurrence_its_step_and_the_adjoint(capsys):
    from symgrad.cli import main

    spec = Path(__file__).resolve().parents[1] / "symgrad.toml"
    assert main(["explain", "--op", "Lfilter", "--spec", str(spec)]) == 0
    text = capsys.readouterr().out
    assert "Recurrence along t (from the first position on" in text
    assert "y_past[j, ...] is y at t - 1 - j (zero before the start)" in text
    assert "x_recent[e, ...] is x at t - e along its axis 1 (zero before the start)" in text
    assert "Adjoint recurrence" in text
    # the step's derived gradient of the past states: what the adjoint passes back
    assert "grad_y_past[q,b] = -grad_y[b]*a[q]" in text
    # and of the input's recent slices: what the adjoint adds at the earlier positions
    assert "grad_x_recent[k,b] = grad_y[b]*bb[k]" in text


def test_check_runs_the_recurrences_against_a_loop(tmp_path):
    """`symgrad check` checks a recurrence's generated forward against a loop of dense
    step evaluations and its gradient against finite differences, in every target."""
    from symgrad.check import run
    from symgrad.spec import load_spec

    spec_path = tmp_path / "symgrad.toml"
    spec_path.write_text(
        "[ops.Lfilter]\n"
        'formula = "y[b,t] = x[b,t] - sum(a[k] * y[b,t-1-k], k)"\n'
        "[ops.Rev]\n"
        'formula = "h[b,t] = x[b,t] + c[b,t] * h[b,t+1]"\n'
        "[ops.FullLfilter]\n"
        'formula = "y[b,t] = sum(bb[k] * x[b,t-k], k) - sum(a[q] * y[b,t-1-q], q)"\n'
        "[ops.DiscountedReturn]\n"
        'formula = "G[b,t] = r[b,t+1] + g[b,t] * G[b,t+1]"\n'
        # an input only the initial step reads (h0): an internal KeyError before
        "[ops.InitialState]\n"
        'formula = "h[b,t] = where(t == 0, h0[b], 0.5 * h[b,t-1] + x[b,t])"\n',
        encoding="utf-8",
    )
    from symgrad.cli import main

    spec = load_spec(str(spec_path))
    assert main(["generate", str(spec_path)]) == 0
    report = run(spec, tmp_path / "generated")
    for op in report.ops:
        assert [r.passed for r in op.results] == [True, True], op


@pytest.mark.parametrize("target", TARGETS)
def test_lfilter_matches_scipy(target, folder):
    """The spec's Lfilter is scipy.signal.lfilter(bb, [1, *a], x) along the last axis
    (torchaudio's lfilter with a[0] = 1), forward and every gradient (against central
    differences of SciPy's filter)."""
    signal = pytest.importorskip("scipy.signal")
    module = load_module(
        module_text(_spec_op("Lfilter"), "test", target), folder, f"spec_lfilter_{target}"
    )
    fw = FRAMEWORKS[target]
    rng = np.random.default_rng(12)
    values = {
        "x": rng.standard_normal((3, 11)),
        "a": np.array([-0.5, 0.2, 0.1]),
        "bb": np.array([0.4, -0.3, 0.2, 0.1, -0.05]),
    }

    def scipy_ref(x, a, bb):
        return (signal.lfilter(bb, np.r_[1.0, a], x, axis=-1),)

    names = module.INPUTS
    assert names == ("x", "a", "bb")
    args = [fw.tensor(values[n]) for n in names]
    want = scipy_ref(*[values[n] for n in names])
    np.testing.assert_allclose(fw.numpy(module.forward(*args)), want[0], rtol=1e-12, atol=1e-14)
    g = rng.standard_normal(want[0].shape)
    found = module.vjp(*args, fw.tensor(g))
    for k, name in enumerate(names):
        v, fd = _directional(scipy_ref, values, names, [g], k, rng)
        np.testing.assert_allclose(np.sum(fw.numpy(found[k]) * v), fd, rtol=1e-7, err_msg=name)


def _spec_op(name):
    from symgrad.spec import load_spec

    spec = load_spec(str(Path(__file__).resolve().parents[1] / "symgrad.toml"))
    return next(op for op in spec.ops if op.name == name)


@pytest.mark.parametrize("case", ["lfilter", "selective_scan"])
def test_tensorflow_registered_gradient_of_a_recurrence(case, folder):
    """`gradient(op, *grads)` is registered for the op type and matches the op's inputs to
    the formula's by name: an op that declares them in another order gets its gradients
    in its own order, equal to the adjoint scan's (`vjp`), for a real op of that type as
    TensorFlow hands it over (here a stand-in with the op's definition)."""
    import tensorflow as tf
    from harness import FakeOp
    from tensorflow.python.framework import ops

    module = module_for(case, "tensorflow", folder)
    # Other tests import modules of the same op type (`check` imports symgrad.toml's):
    # the last import registers its gradient, as importing this one again would.
    module._register()
    assert ops._gradient_registry.lookup(module.OP_TYPE) is module.gradient
    _, shapes, ref = CASES[case]
    values = inputs_for(shapes, seed=11)
    ours = [tf.constant(values[n]) for n in module.INPUTS]
    want = ref(*[values[n] for n in module.INPUTS])[0]
    g_y = tf.constant(np.random.default_rng(12).standard_normal(want.shape))
    expected = module.vjp(*ours, g_y)
    theirs_order = list(reversed(module.INPUTS))
    op = FakeOp(
        [tf.constant(values[n]) for n in theirs_order],
        [tf.constant(want)],
        {},
        module,
        input_names=[n.upper() for n in theirs_order],  # C++ names differ in case
    )
    got = module.gradient(op, g_y)
    assert len(got) == len(module.INPUTS)
    for name, grad in zip(theirs_order, got, strict=True):
        np.testing.assert_allclose(
            grad.numpy(), expected[module.INPUTS.index(name)].numpy(), rtol=1e-12, atol=1e-14
        )


def test_check_takes_shapes_and_sizes_of_a_recurrence(tmp_path, capsys):
    """`symgrad check --shape/--size` on a recurrence: the step sees each input without
    its cut axis, whose size is the scan's length (it stopped with "output 'h' cannot be
    used on the right side"); Mamba's grouped B at 2 groups of 3 channels; lengths that
    disagree are a one-line error."""
    from symgrad.cli import main

    spec_path = tmp_path / "symgrad.toml"
    spec = _spec_op("SelectiveScan")
    formulas = ",\n".join(f'  "{f}"' for f in spec.formulas)
    spec_path.write_text(
        f'[ops.SelectiveScan]\nformula = [\n{formulas}\n]\noutputs = ["y"]\n', encoding="utf-8"
    )
    assert main(["generate", str(spec_path)]) == 0
    capsys.readouterr()
    argv = ["check", str(spec_path), "--shape", "x=2x3x7", "--size", "n=5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "B 2x5x7" in out and "(b=2, d=3, n=5, t=7)" in out, out
    assert main([*argv, "--size", "t=6"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "the scan length ('t') differs: --shape x (axis 2) = 7, --size t = 6" in err, err


def test_a_let_that_reads_the_scan_length_of_a_cut_input_is_refused():
    spec = op_spec(
        "LetOfLength",
        "h[b,t,d] = a[b,t,d] * h[b,t-1,d] + x[b,t,d] / T",
        lets=(("T", "x.shape[1]"),),
    )
    with pytest.raises(SymgradError) as found:
        module_text(spec, "test", "tensorflow")
    assert found.value.message == (
        "'T' reads x.shape[1], the length of the scan along 't', which a step does not see; "
        "read another input's shape"
    )

"""Split and composite reads of inputs (issue 17, item 1) and ranges past an input axis
(item 3): each construct exact in float64 in TensorFlow, PyTorch and JAX against the
independent reference; real ops (fairseq's multi-head lightconv, CCNet's criss-cross
attention) against NumPy loop transcriptions of their CUDA kernels, forward and gradient
(central differences of the loop itself); refusals with a caret and exit code 2."""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf
from harness import Case, check, generate, op_spec
from target_harness import check_target, frameworks

from symgrad.errors import SymgradError
from symgrad.explain import explain
from symgrad.model import build
from symgrad.spec import OpSpec

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp

FRAMEWORKS = frameworks()


LIGHTCONV_HEADS = Case(
    "y[b,c,t] = sum(w[c // G, k] * x[b, c, t + k - P], k)",
    {"w": (3, 5), "x": (2, 6, 7)},
    lets={"H": "w.shape[0]", "G": "x.shape[1] // H", "P": "(w.shape[1] - 1) // 2"},
    let_values={"H": 3, "G": 2, "P": 2},
    ranges={"t": "x.shape[2]"},
    sizes={"t": 7},
)

# CCNet's criss-cross attention (speedinghzl/CCNet, cc_attention/src/ca.cu) in its own
# layouts: t, f, g [B, C, H, W]; the scores a [B, H+W-1, H, W], z over the row (z < W),
# then the column without the position itself.
CCNET_SCORES = Case(
    "a[b,z,i,j] = sum(t[b,c,i,j] * where(z < W, f[b,c,i,z], "
    "where(z - W < i, f[b,c,z - W,j], f[b,c,z - W + 1,j])), c)",
    {"t": (2, 3, 4, 5), "f": (2, 3, 4, 5)},
    lets={"W": "t.shape[3]"},
    let_values={"W": 5},
    ranges={"z": "t.shape[2] + t.shape[3] - 1"},
    sizes={"z": 8},
    fd_directions=3,
)
CCNET_AGGREGATION = Case(
    "o[b,c,i,j] = sum(g[b,c,i,u] * a[b,u,i,j], u) + sum(where(v < i, g[b,c,v,j] * "
    "a[b, W + v, i, j], where(v > i, g[b,c,v,j] * a[b, W + v - 1, i, j], 0)), v)",
    {"a": (2, 8, 4, 5), "g": (2, 3, 4, 5)},
    inputs=("a", "g"),
    lets={"W": "g.shape[3]"},
    let_values={"W": 5},
    ranges={"u": "W"},
    sizes={"u": 5},
    fd_directions=3,
)

# Every construct, with a different size for every index.
CASES = {
    # x[b, (h, r), t]: axis 1 of size H*R, row-major; R from v, H = 12 / 4 inferred
    "composite_with_an_inferred_member": Case(
        "y[b,h,t] = sum(x[b, (h, r), t] * v[r], r)", {"x": (2, 12, 5), "v": (4,)}, sizes={"h": 3}
    ),
    # both members sized elsewhere: the whole axis
    "composite_of_two_known_indices": Case(
        "y[b,h,r] = x[(b, h, r)] * a[b,h] + z[h,r]",
        {"x": (2 * 3 * 4,), "a": (2, 3), "z": (3, 4)},
    ),
    "floor_division_by_a_literal": Case("y[b,c] = x[b,c] * w[c // 3]", {"x": (2, 7), "w": (3,)}),
    # c's size only from w[c // G]: C = 4 * G
    "floor_division_sizes_the_index": Case(
        "y[b,c] = w[c // G] * s[b]", {"w": (4,), "s": (2,)}, attrs={"G": 3}, sizes={"c": 12}
    ),
    "remainder_by_an_int_attr": Case(
        "y[b,c,t] = x[b, c % G, t] * z[b,c,t]", {"x": (2, 3, 4), "z": (2, 7, 4)}, attrs={"G": 3}
    ),
    "remainder_and_quotient_together": Case(
        "y[b,c] = x[b, c % 4] * w[c // 4, b]",
        {"x": (2, 4), "w": (3, 2)},
        sizes={"c": 12},
        ranges={"c": "12"},
    ),
    "lightconv_heads": LIGHTCONV_HEADS,
    # item 3: an explicit range wins over the size of an axis read plainly
    "a_range_past_the_axis_reads_zero": Case(
        "y[b,i] = x[b,i] * w[b]",
        {"x": (2, 5), "w": (2,)},
        ranges={"i": "x.shape[1] + 2"},
        sizes={"i": 7},
    ),
    "a_range_short_of_the_axis_reads_part_of_it": Case(
        "y[b,i] = sum(x[b,i,k] * z[b,k], k) + x[b,i,0]",
        {"x": (2, 5, 3), "z": (2, 3)},
        ranges={"i": "x.shape[1] - 2"},
        sizes={"i": 3},
    ),
    "ccnet_criss_cross_scores": CCNET_SCORES,
    "ccnet_criss_cross_aggregation": CCNET_AGGREGATION,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("split_reads")


@pytest.mark.parametrize("name", sorted(CASES))
def test_split_reads_in_tensorflow(name, folder):
    case = CASES[name]
    check(case, generate(case, folder, "Split"))


def _jitted(module):
    static = module.ATTRS
    return SimpleNamespace(
        OP_NAME=module.OP_NAME,
        forward=jax.jit(module.forward, static_argnames=static),
        vjp=jax.jit(module.vjp, static_argnames=static),
        _compute=jax.jit(module._compute, static_argnames=static),
    )


# CCNet's ops are checked in every target against their kernels' loops (below).
@pytest.mark.parametrize("target", sorted(FRAMEWORKS))
@pytest.mark.parametrize("name", sorted(n for n in CASES if not n.startswith("ccnet")))
def test_split_reads_in_pytorch_and_jax(name, target, folder):
    case = CASES[name]
    module = generate(case, folder, "Split", target)
    check_target(case, _jitted(module) if target == "jax" else module, FRAMEWORKS[target])


# ----------------------------------------------------------------------------- kernels


def _lightconv_kernel(w, x):
    """fairseq's lightconv_forward_kernel (lightconv_cuda_kernel.cu), one block per
    (batch, feature): filterIdx = featureIdx / numFiltersInBlock, the input read at
    t + j - padding_l with zeros outside, padding_l = (K - 1) // 2."""
    batch, features, steps = x.shape
    heads, taps = w.shape
    in_block = features // heads
    padding_l = (taps - 1) // 2
    y = np.zeros_like(x)
    for b in range(batch):
        for feature in range(features):
            filt = w[feature // in_block]
            for t in range(steps):
                out = 0.0
                for j in range(taps):
                    at = t + j - padding_l
                    if 0 <= at < steps:
                        out += filt[j] * x[b, feature, at]
                y[b, feature, t] = out
    return y


def _differences(kernel, inputs, k, direction, step=1e-6):
    """The kernel's central difference along `direction` in input k."""
    plus, minus = list(inputs), list(inputs)
    plus[k] = inputs[k] + step * direction
    minus[k] = inputs[k] - step * direction
    return (kernel(*plus) - kernel(*minus)) / (2 * step)


def _check_against_kernel(module, kernel, inputs, to_tensor, to_numpy, vjp, seed=0):
    """forward equals the kernel loop; <vjp(u), v> equals <u, d kernel along v>."""
    rng = np.random.default_rng(seed)
    got = to_numpy(module.forward(*(to_tensor(a) for a in inputs)))
    want = kernel(*inputs)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    u = rng.standard_normal(want.shape)
    grads = vjp(*(to_tensor(a) for a in inputs), to_tensor(u))
    for k, grad in enumerate(grads):
        direction = rng.standard_normal(inputs[k].shape)
        numerical = np.sum(u * _differences(kernel, inputs, k, direction))
        got_dot = np.sum(to_numpy(grad) * direction)
        np.testing.assert_allclose(got_dot, numerical, rtol=1e-7, atol=1e-8)


TO = {
    "tensorflow": (tf.constant, lambda t: np.asarray(tf.convert_to_tensor(t))),
    "pytorch": (torch.from_numpy, lambda t: t.detach().numpy()),
    "jax": (jnp.asarray, np.asarray),
}


@pytest.mark.parametrize("target", sorted(TO))
def test_lightconv_heads_is_fairseqs_kernel(target, folder):
    module = generate(LIGHTCONV_HEADS, folder, "Lightconv", target)
    rng = np.random.default_rng(2)
    w, x = rng.standard_normal((3, 5)), rng.standard_normal((2, 6, 7))  # H=3, G=2, K=5, T=7
    to_tensor, to_numpy = TO[target]
    _check_against_kernel(module, _lightconv_kernel, (w, x), to_tensor, to_numpy, module.vjp)


def test_lightconv_heads_gradient_sums_over_the_channels_sharing_a_filter(folder):
    module = generate(LIGHTCONV_HEADS, folder, "Shared")
    rng = np.random.default_rng(4)
    w, x = rng.standard_normal((2, 3)), rng.standard_normal((1, 6, 4))  # H=2, G=3, K=3
    grad_w, _ = module.vjp(tf.constant(w), tf.constant(x), tf.ones((1, 6, 4), tf.float64))
    one_head = generate(
        Case(
            "y[b,c,t] = sum(w[c,k] * x[b, c, t + k - 1], k)",
            {"w": (6, 3), "x": (1, 6, 4)},
            ranges={"t": "x.shape[2]"},
        ),
        folder,
        "PerChannel",
    )
    per_channel, _ = one_head.vjp(
        tf.constant(np.repeat(w, 3, axis=0)), tf.constant(x), tf.ones((1, 6, 4), tf.float64)
    )
    want = per_channel.numpy().reshape(2, 3, 3).sum(axis=1)
    np.testing.assert_allclose(tf.convert_to_tensor(grad_w).numpy(), want, rtol=1e-12)


def _ca_forward_kernel(t, f):
    """CCNet's ca_forward_kernel (cc_attention/src/ca.cu), thread (x, y, z) for z < H+W-1:
    the row for z < W, else the column at j = i < y ? i : i + 1 with i = z - W."""
    num, chn, height, width = t.shape
    weight = np.zeros((num, height + width - 1, height, width))
    for x in range(width):
        for y in range(height):
            for z in range(height + width - 1):
                for batch in range(num):
                    for plane in range(chn):
                        _t = t[batch, plane, y, x]
                        if z < width:
                            weight[batch, z, y, x] += _t * f[batch, plane, y, z]
                        else:
                            i = z - width
                            j = i if i < y else i + 1
                            weight[batch, width + i, y, x] += _t * f[batch, plane, j, x]
    return weight


def _ca_map_forward_kernel(weight, g):
    """CCNet's ca_map_forward_kernel (cc_attention/src/ca.cu): the row, then the column
    without the position itself, its score at width + (i < y ? i : i - 1)."""
    num, chn, height, width = g.shape
    out = np.zeros_like(g)
    for x in range(width):
        for y in range(height):
            for plane in range(chn):
                for batch in range(num):
                    for i in range(width):
                        out[batch, plane, y, x] += g[batch, plane, y, i] * weight[batch, i, y, x]
                    for i in range(height):
                        if i == y:
                            continue
                        j = i if i < y else i - 1
                        _w = weight[batch, width + j, y, x]
                        out[batch, plane, y, x] += g[batch, plane, i, x] * _w
    return out


@pytest.mark.parametrize("target", sorted(TO))
def test_ccnet_criss_cross_attention_is_its_cuda_kernels(target, folder):
    rng = np.random.default_rng(5)
    to_tensor, to_numpy = TO[target]
    t, f, g = (rng.standard_normal((2, 3, 4, 5)) for _ in range(3))  # B, C, H, W
    scores = generate(CCNET_SCORES, folder, "CaScores", target)
    _check_against_kernel(scores, _ca_forward_kernel, (t, f), to_tensor, to_numpy, scores.vjp)
    a = rng.standard_normal((2, 8, 4, 5))  # [B, H+W-1, H, W]
    aggregation = generate(CCNET_AGGREGATION, folder, "CaMap", target)
    _check_against_kernel(
        aggregation, _ca_map_forward_kernel, (a, g), to_tensor, to_numpy, aggregation.vjp
    )


def test_reads_past_an_axis_are_zero_and_send_no_gradient(folder):
    case = CASES["a_range_past_the_axis_reads_zero"]
    module = generate(case, folder, "Past")
    x, w = tf.constant(np.arange(10.0).reshape(2, 5) + 1), tf.constant([2.0, 3.0], tf.float64)
    y = module.forward(x, w).numpy()
    assert y.shape == (2, 7) and np.all(y[:, 5:] == 0)
    np.testing.assert_allclose(y[:, :5], x.numpy() * [[2.0], [3.0]])
    grad_x, grad_w = module.vjp(x, w, tf.ones((2, 7), tf.float64))
    np.testing.assert_allclose(grad_x.numpy(), np.tile([[2.0], [3.0]], (1, 5)))
    np.testing.assert_allclose(grad_w.numpy(), x.numpy().sum(axis=1))


# ----------------------------------------------------------------------------- refusals


def _refused(formula, attrs=(), **spec) -> SymgradError:
    op = OpSpec("Refused", (formula,), None, tuple(attrs), (), "test [ops.Refused]", **spec)
    with pytest.raises(SymgradError) as info:
        build(op)
    return info.value


def _caret_at(error: SymgradError, text: str) -> None:
    rendered = str(error)
    formula_line, caret_line = rendered.splitlines()[-2:]
    assert caret_line.strip() == "^", rendered
    column = caret_line.index("^") - (len(formula_line) - len(formula_line.lstrip()))
    assert formula_line.strip()[column:].startswith(text), rendered


def test_split_reads_that_cannot_be_lowered_are_refused_with_a_caret():
    by_float = _refused("y[b,c] = x[b, c // a]", (("a", "float"),))
    assert "split by `//` with a positive int literal, an int attr or a let" in str(by_float)
    _caret_at(by_float, "// a]")  # a float attr makes a float position: no split there
    by_zero = _refused("y[b,c] = x[b, c % 0]")
    _caret_at(by_zero, "0]")
    by_index = _refused("y[b,c,k] = x[b, c // k] * z[k]")
    assert "split by `//`" in str(by_index)
    _caret_at(by_index, "k]")
    unknown = _refused("y[b,h,r] = x[b, (h, r)]")  # neither member has a size
    assert "output index 'h' has no range" in str(unknown)
    assert "size all but one of (h, r) elsewhere: axis 1 of x is their product" in str(unknown)
    _caret_at(unknown, "h, r)")
    remainder = _refused("y[b,c] = x[b, c % 3]")  # c's size cannot come from c % 3
    assert "output index 'c' has no range" in str(remainder)
    assert "c % 3 says only which row of x (axis 1) it reads" in str(remainder)
    _caret_at(remainder, "c % 3")
    inside = _refused("y[b,i] = x[b, (b, i) + 1]")
    assert "a composite index `(i, k)` is a whole axis" in str(inside)
    _caret_at(inside, "(b, i)")


def test_a_refused_split_read_is_one_line_and_exit_code_2():
    done = subprocess.run(
        [sys.executable, "-m", "symgrad", "explain", "y[b,c] = x[b, c // 2.5]"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert lines[0].startswith("error: formula: "), done.stderr
    assert "an index is split by `//` with a positive int literal" in lines[0], done.stderr
    assert len(lines) == 3 and lines[2].strip() == "^", done.stderr


# ----------------------------------------------------------------------------- explain


def test_explain_shows_the_solved_index_equations_of_split_reads():
    def explained(case: Case) -> str:
        return explain(build(op_spec(case, "Explained")))

    heads = explained(LIGHTCONV_HEADS)
    assert "_g1[c,k] = w[c // G,k] (0 outside w)" in heads
    assert "grad_w[p,k] = Σ_{c: c // G = p, so c = G*p + g with 0 <= g < G} _grad_g1[c,k]" in heads
    composite = explained(CASES["composite_with_an_inferred_member"])
    assert "x[b,(h, r),t]" in composite
    assert "(h, r) = p, so h = p // |r|, r = p % |r|" in composite
    remainder = explained(CASES["remainder_by_an_int_attr"])
    assert "c % G = p, so c = G*m + p with m >= 0" in remainder


@pytest.mark.parametrize("target", sorted(TO))
def test_a_composite_axis_that_does_not_split_is_refused_when_called(target, folder):
    case = CASES["composite_with_an_inferred_member"]
    module = generate(case, folder, "Indivisible", target)
    to_tensor, _ = TO[target]
    x, v = to_tensor(np.ones((2, 13, 5))), to_tensor(np.ones(4))
    with pytest.raises(ValueError, match=r"x.shape\[1\] = 13 does not split into parts of 4"):
        module.forward(x, v)


def test_a_composite_read_is_a_reshape_and_its_gradient_one_too():
    text = explain(build(op_spec(CASES["composite_with_an_inferred_member"], "Reshaped")))
    assert "_g1 = tf.reshape(x, [_n_b, _n_h, _n_r, _n_t])" in text
    assert "grad_x = tf.reshape(_grad_g1, [_n_x_0, _n_x_1, _n_x_2])" in text
    assert "tf.gather" not in text and "segment_sum" not in text


# ----------------------------------------------------------------------------- tiling

LET_OPS = {  # ops of symgrad.toml with lets: module -> input shapes
    "cc_attention_scores": [(2, 3, 4, 5), (2, 3, 4, 5)],
    "cc_attention_map": [(2, 8, 4, 5), (2, 3, 4, 5)],
}
PACKAGES = {"tensorflow": "generated", "pytorch": "generated_torch", "jax": "generated_jax"}


def _counted(function, calls: list):
    def counting(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return counting


@pytest.mark.parametrize("target", sorted(PACKAGES))
def test_ops_with_lets_are_tiled_and_equal_the_untiled(target, monkeypatch):
    to_tensor, to_numpy = TO[target]
    rng = np.random.default_rng(8)
    for name, shapes in LET_OPS.items():
        module = importlib.import_module(f"{PACKAGES[target]}.{name}")
        assert "_tiled_compute" in module.__doc__, name
        inputs = [to_tensor(rng.standard_normal(s)) for s in shapes]
        y = to_numpy(module.forward(*inputs))
        grad = to_tensor(rng.standard_normal(y.shape))
        grads = [to_numpy(g) for g in module.vjp(*inputs, grad)]
        chunks = []
        if target == "pytorch":  # a Python loop: count its chunks
            program = "_chunk_compute" if hasattr(module, "_chunk_compute") else "_compute"
            monkeypatch.setattr(module, program, _counted(getattr(module, program), chunks))
        monkeypatch.setattr(module, "MAX_TEMP_BYTES", 64)
        np.testing.assert_allclose(to_numpy(module.forward(*inputs)), y, rtol=1e-12, atol=1e-12)
        for got, want in zip(module.vjp(*inputs, grad), grads, strict=True):
            np.testing.assert_allclose(to_numpy(got), want, rtol=1e-12, atol=1e-12)
        if target == "pytorch":
            assert len(chunks) > 2, name


@pytest.mark.parametrize("target", sorted(TO))
def test_a_range_past_the_axis_of_the_tiled_index_is_never_cut(target, folder, monkeypatch):
    """z runs past x's axis 1 and is tiled: x is read at shifted positions, never cut to a
    chunk that would lie beyond it."""
    case = Case(
        "y[b,z] = sum(exp(x[b,z] * v[b,k]), k)",
        {"x": (2, 5), "v": (2, 3)},
        ranges={"z": "9"},
        sizes={"z": 9},
    )
    module = generate(case, folder, "PastTiled", target)
    to_tensor, to_numpy = TO[target]
    rng = np.random.default_rng(9)
    x, v = rng.standard_normal((2, 5)), rng.standard_normal((2, 3))
    padded = np.concatenate([x, np.zeros((2, 4))], axis=1)
    want = np.exp(padded[:, :, None] * v[:, None, :]).sum(axis=2)
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", 64)
    np.testing.assert_allclose(to_numpy(module.forward(to_tensor(x), to_tensor(v))), want)
    grad_x, _ = module.vjp(to_tensor(x), to_tensor(v), to_tensor(np.ones((2, 9))))
    want_x = (np.exp(x[:, :, None] * v[:, None, :]) * v[:, None, :]).sum(axis=2)
    np.testing.assert_allclose(to_numpy(grad_x), want_x, rtol=1e-12)

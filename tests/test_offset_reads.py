"""Offset reads (issue 18, sampled reads): which tensors inside a position are float.

A spec has no dtypes. A tensor read that displaces an index expression at the position
it moves (deformable conv's `s*i - p + u + off[b, k, i, j]`, a flow warp's
`h + flow[b, 1, h, w]`) makes a sampled read, with no `float_positions` key: float
offsets interpolate, integer ones are cast and read exactly, with no gradient. A bare read
(`x[b, p[b, n]]`), a window start (`X[b, idx[b, i] + k]`) and a shift that shares no
index with the rest (mmcv's TIN shift, `t - shift[n, c // G]`) stay integer gathers; a
float tensor there is refused at the call in one line that says what to write, and
`float_positions` makes it interpolate.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import tensorflow as tf
from test_sampled_reads import (
    DEFORM_CONV,
    TARGETS,
    bilinear,
    deform_conv_loop,
    module,
    numpy,
    numpy_vjp,
    to,
)

from symgrad.model import build
from symgrad.spec import parse_op

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp

# mmcv's tin_shift (mmcv/ops/csrc/common/cuda/tin_shift_cuda_kernel.cuh) on (N, T, C, HW):
# output[n, t + shift[n, g]] = input[n, t] for channel c of group g = c // G, so
# y[n, t] = x[n, t - shift]; a frame shifted in from outside is 0.
TIN_SHIFT = {
    "formula": "y[n,t,c,h] = x[n, t - shift[n, c // G], c, h]",
    "attrs": {"G": "int"},
    "ranges": {"t": "x.shape[1]"},
}
TIN_SHIFT_FLOAT = {**TIN_SHIFT, "float_positions": ["shift"]}
AT_POSITIONS = {"formula": "y[b,n] = x[b, p[b,n]]"}  # 1-D linear interpolation at p
AT_POSITIONS_FLOAT = {**AT_POSITIONS, "float_positions": ["p"]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("offsets")


@pytest.mark.parametrize(
    ("table", "positions", "indices"),
    [
        (DEFORM_CONV, ("off",), ()),
        ({"formula": "y[b,c,h,w] = x[b, c, h + flow[b,1,h,w], w + flow[b,0,h,w]]"}, ("flow",), ()),
        ({"formula": "y[b,i] = x[b, i - d[b,i]] * d[b,i]"}, (), ()),  # d is also a value
        ({"formula": "y[b,i,k,c] = X[b, idx[b,i] + k, c]", "ranges": {"k": "3"}}, (), ("idx",)),
        ({"formula": "y[b,n] = X[b, idx[b,n] + jdx[b,n]]"}, (), ("idx", "jdx")),
        (TIN_SHIFT, (), ("shift",)),
        (TIN_SHIFT_FLOAT, ("shift",), ()),
        (AT_POSITIONS, (), ("p",)),
        (AT_POSITIONS_FLOAT, ("p",), ()),
        ({"formula": "y[n,c] = a[tri[tid[n] - 1, 0], c]"}, (), ("tri", "tid")),
    ],
)
def test_a_tensor_displacing_the_position_it_is_read_at_makes_a_sampled_read(
    table, positions, indices
):
    program = build(parse_op("Offsets", table, "test.toml"))
    assert program.position_inputs == positions
    assert set(program.index_inputs) == set(indices)


# -- deformable convolution without `float_positions` ---------------------------------------


def deform_inputs(seed):
    """b=1, c=6, 13x8 image, o=4, 3x2 taps, stride 2, padding 1: i=7, j=5."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 6, 13, 8))
    w = rng.standard_normal((4, 6, 3, 2))
    off = rng.uniform(-2.5, 2.5, (1, 12, 7, 5))
    return x, w, off, {"s": 2, "p": 1}


def _step(target, m, x, w, off, attrs, lr):
    """loss = Σ y², its gradient by the framework's own machinery through `forward`, one
    SGD step on x, w and off, and the loss after."""
    if target == "pytorch":
        args = [torch.tensor(a, requires_grad=True) for a in (x, w, off)]
        loss = m.forward(*args, **attrs).square().sum()
        loss.backward()
        with torch.no_grad():
            after = m.forward(*(a - lr * a.grad for a in args), **attrs).square().sum()
        return float(loss.detach()), [a.grad.numpy() for a in args], float(after)
    if target == "tensorflow":
        args = [tf.Variable(a) for a in (x, w, off)]
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(m.forward(*args, **attrs)))
        grads = tape.gradient(loss, args)
        for a, g in zip(args, grads, strict=True):
            a.assign_sub(lr * g)
        after = tf.reduce_sum(tf.square(m.forward(*args, **attrs)))
        return float(loss), [g.numpy() for g in grads], float(after)

    def jax_loss(*a):
        return jnp.sum(jnp.square(m.forward(*a, **attrs)))

    args = [jnp.asarray(a) for a in (x, w, off)]
    value, grads = jax.jit(jax.value_and_grad(jax_loss, argnums=(0, 1, 2)))(*args)
    after = jax.jit(jax_loss)(*(a - lr * g for a, g in zip(args, grads, strict=True)))
    return float(value), [np.asarray(g) for g in grads], float(after)


@functools.cache
def _loop_step(lr):
    """The loop's output, central differences of Σ y², and Σ y² after one SGD step."""
    x, w, off, attrs = deform_inputs(seed=11)

    def loop(x, w, off):
        return deform_conv_loop(x, w, off, **attrs)

    y = loop(x, w, off)
    want = numpy_vjp(loop, [x, w, off], 2 * y, [0, 1, 2])
    after = np.sum(loop(*(a - lr * g for a, g in zip((x, w, off), want, strict=True))) ** 2)
    return y, want, after


@pytest.mark.parametrize("target", TARGETS)
def test_deformable_conv_without_the_key_trains_like_the_loop(folder, target):
    """The issue's spelling, no `float_positions`: float offsets interpolate. A training
    step (loss Σ y², the framework's own gradient through the module, one SGD step) is the
    loop's: its loss, central differences of its loss, and its loss after the step."""
    x, w, off, attrs = deform_inputs(seed=11)
    lr = 0.01
    y, want, after = _loop_step(lr)
    loss, grads, got_after = _step(
        target, module(DEFORM_CONV, target, folder), x, w, off, attrs, lr
    )
    np.testing.assert_allclose(loss, np.sum(y**2), rtol=1e-12)
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    np.testing.assert_allclose(got_after, after, rtol=1e-7)


@pytest.mark.parametrize("target", TARGETS)
def test_integer_offsets_read_exactly_and_get_no_gradient(folder, target):
    """Integer offsets (both signs, some far outside the image) through the same module:
    cast, they read exactly the elements an integer gather reads, `vjp` gives None for
    them, and the gradients of x and w are those of the same offsets given as floats."""
    x, w, _, attrs = deform_inputs(seed=12)
    off = np.random.default_rng(12).integers(-4, 5, (1, 12, 7, 5))
    off[0, 0, 0, :3] = (-20, 9, 30)
    grad = np.random.default_rng(13).standard_normal((1, 4, 7, 5))
    m = module(DEFORM_CONV, target, folder)
    args = [to(target, x), to(target, w), to(target, off)]
    assert "int64" in str(args[2].dtype)
    y = numpy(m.forward(*args, **attrs))
    np.testing.assert_allclose(y, deform_conv_loop(x, w, off.astype(float), **attrs), atol=1e-12)
    gx, gw, goff = m.vjp(*args, to(target, grad), **attrs)
    assert goff is None
    as_float = m.vjp(to(target, x), to(target, w), to(target, off * 1.0), to(target, grad), **attrs)
    np.testing.assert_allclose(numpy(gx), numpy(as_float[0]), atol=1e-12)
    np.testing.assert_allclose(numpy(gw), numpy(as_float[1]), atol=1e-12)


# -- TIN shift: an integer gather; with the key, a sampled read ------------------------------


def tin_shift_loop(x, shift, group):
    """mmcv's tin_shift forward kernel, transcribed: each frame t of channel c moves to
    t + shift[n, c // group]; frames moved outside are dropped, frames not filled are 0."""
    n_size, t_size, c_size, _ = x.shape
    y = np.zeros_like(x)
    for n in range(n_size):
        for c in range(c_size):
            s = shift[n, c // group]
            for t in range(t_size):
                if 0 <= t + s < t_size:
                    y[n, t + s, c] = x[n, t, c]
    return y


def tin_inputs(seed):
    """n=2, t=5, c=6 in groups of G=2 (3 groups), h=4; shifts of both signs, 0, and
    beyond the clip (|shift| >= 5)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 5, 6, 4))
    shift = np.array([[2, -1, 0], [-7, 6, 1]])
    grad = rng.standard_normal((2, 5, 6, 4))
    return x, shift, grad, {"G": 2}


@pytest.mark.parametrize("table", [TIN_SHIFT, TIN_SHIFT_FLOAT], ids=["gather", "sampled"])
@pytest.mark.parametrize("target", TARGETS)
def test_tin_shift_with_integer_shifts_is_mmcvs_kernel_either_way(folder, target, table):
    """Integer shifts read exactly, as an integer gather and as a sampled read; the
    gradient into x is the adjoint (central differences of the linear loop), none into
    the shifts."""
    x, shift, grad, attrs = tin_inputs(seed=14)
    m = module(table, target, folder, "TinShift")
    args = [to(target, x), to(target, shift)]
    y = numpy(m.forward(*args, **attrs))
    np.testing.assert_array_equal(y, tin_shift_loop(x, shift, 2))
    gx, gshift = m.vjp(*args, to(target, grad), **attrs)
    (want,) = numpy_vjp(lambda a, s: tin_shift_loop(a, s, 2), [x, shift], grad, [0])
    np.testing.assert_allclose(numpy(gx), want, atol=1e-8)
    assert gshift is None


def linear_at(x, position):
    """x[b] at float positions along its last axis: (1 - f)·x[⌊p⌋] + f·x[⌊p⌋ + 1], each
    neighbour outside reading 0."""
    low = np.floor(position).astype(int)
    f = position - low
    total = 0.0
    for step, weight in ((0, 1 - f), (1, f)):
        at = low + step
        inside = (0 <= at) & (at < x.shape[-1])
        total = total + weight * np.where(
            inside, np.take_along_axis(x, np.clip(at, 0, x.shape[-1] - 1), -1), 0.0
        )
    return total


@pytest.mark.parametrize("target", TARGETS)
def test_a_float_tensor_where_an_index_tensor_is_read_is_refused_in_one_line(folder, target):
    """A bare read and a shift that shares no index stay integer gathers: float values
    there are refused when the op is called, with the key to write."""
    x, shift, _, attrs = tin_inputs(seed=15)
    cases = [
        (TIN_SHIFT, [x, shift + 0.5], attrs, "shift"),
        (AT_POSITIONS, [x[:, :, 0, 0], np.full((2, 3), 1.5)], {}, "p"),
    ]
    for table, inputs, given, name in cases:
        m = module(table, target, folder, "Refused")
        with pytest.raises(TypeError) as error:
            m.forward(*(to(target, a) for a in inputs), **given)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"Refused: index tensor {name}"), message
        assert f'`float_positions = ["{name}"]`' in message


@pytest.mark.parametrize("target", TARGETS)
def test_with_the_key_float_positions_interpolate_and_get_their_gradient(folder, target):
    """`float_positions` is the explicit override: 1-D linear interpolation at data
    positions p (`y[b,n] = x[b, p[b,n]]`, zero outside) and a fractional TIN shift, each
    against a NumPy loop and central differences, both gradients."""
    rng = np.random.default_rng(16)
    x = rng.standard_normal((2, 7))
    p = rng.uniform(-1.5, 7.5, (2, 4))
    grad = rng.standard_normal((2, 4))
    m = module(AT_POSITIONS_FLOAT, target, folder, "AtPositions")
    y = numpy(m.forward(to(target, x), to(target, p)))
    np.testing.assert_allclose(y, linear_at(x, p), atol=1e-12)
    got = m.vjp(to(target, x), to(target, p), to(target, grad))
    want = numpy_vjp(linear_at, [x, p], grad, [0, 1])
    for g, expected in zip(got, want, strict=True):
        np.testing.assert_allclose(numpy(g), expected, atol=1e-6)

    x, _, grad, attrs = tin_inputs(seed=17)
    shift = rng.uniform(-5.5, 5.5, (2, 3))

    def shifted(x, shift):
        at = np.arange(5)[None, :, None] - np.repeat(shift, 2, axis=1)[:, None, :]  # (n, t, c)
        moved = np.moveaxis(x, 1, -1)  # (n, c, h, t)
        at = np.broadcast_to(np.moveaxis(at, 1, -1)[:, :, None, :], moved.shape)
        return np.moveaxis(linear_at(moved, at), -1, 1)

    m = module(TIN_SHIFT_FLOAT, target, folder, "TinShift")
    y = numpy(m.forward(to(target, x), to(target, shift), **attrs))
    np.testing.assert_allclose(y, shifted(x, shift), atol=1e-12)
    got = m.vjp(to(target, x), to(target, shift), to(target, grad), **attrs)
    want = numpy_vjp(shifted, [x, shift], grad, [0, 1])
    for g, expected in zip(got, want, strict=True):
        np.testing.assert_allclose(numpy(g), expected, atol=1e-6)


# -- deformable convolution v2 (modulated) ------------------------------------------------------

MODULATED = {
    "formula": "y[b,o,i,j] = sum(w[o,c,u,v] * mask[b, u*KW + v, i, j] * x[b, c, s*i - p + u "
    "+ off[b, 2*(u*KW + v), i, j], s*j - p + v + off[b, 2*(u*KW + v) + 1, i, j]], c, u, v)",
    "attrs": {"s": "int", "p": "int"},
    "let": {"KW": "w.shape[3]"},
    "inputs": ["x", "w", "off", "mask"],
}


def modulated_loop(x, w, off, mask, s, p):
    """torchvision.ops.deform_conv2d with a mask (deform_conv2d_kernel.cpp, one offset and
    mask group): each tap's bilinear sample times mask[b, u*KW + v, i, j], one point at a
    time."""
    batch, in_c, height, width = x.shape
    out_c, _, kh, kw = w.shape
    out_h, out_w = off.shape[2], off.shape[3]
    y = np.zeros((batch, out_c, out_h, out_w))
    for b, i, j, u, v in np.ndindex(batch, out_h, out_w, kh, kw):
        h = s * i - p + u + off[b, 2 * (u * kw + v), i, j]
        ww = s * j - p + v + off[b, 2 * (u * kw + v) + 1, i, j]
        h0, w0 = int(np.floor(h)), int(np.floor(ww))
        sample = np.zeros(in_c)
        for dy, dx in itertools.product((0, 1), (0, 1)):
            weight = (h - h0 if dy else 1 - (h - h0)) * (ww - w0 if dx else 1 - (ww - w0))
            if 0 <= h0 + dy < height and 0 <= w0 + dx < width:
                sample += weight * x[b, :, h0 + dy, w0 + dx]
        y[b, :, i, j] += mask[b, u * kw + v, i, j] * (w[:, :, u, v] @ sample)
    return y


def modulated_vectorized(x, w, off, mask, s, p):
    """The same over all points at once: deform_conv_loop's columns times the mask."""
    _, _, kh, kw = w.shape
    b, u, v, i, j = np.meshgrid(
        *(range(n) for n in (x.shape[0], kh, kw, *off.shape[2:])), indexing="ij"
    )
    h = s * i - p + u + off[b, 2 * (u * kw + v), i, j]
    ww = s * j - p + v + off[b, 2 * (u * kw + v) + 1, i, j]
    columns = bilinear(x, b, h, ww) * mask[b, u * kw + v, i, j][..., None]
    return np.einsum("ocuv,buvijc->boij", w, columns)


@pytest.mark.parametrize("target", TARGETS)
def test_modulated_deformable_conv_is_torchvisions_loop(folder, target):
    """Deformable conv v2 (symgrad.toml's ModulatedDeformConv2d): the forward against a
    point-by-point loop, and each of the four gradients along a random direction against
    central differences of the loop (b=2, c=4, o=6, 3x5 taps, stride 2, padding 1: i=7,
    j=8)."""
    rng = np.random.default_rng(18)
    inputs = [
        rng.standard_normal((2, 4, 13, 18)),
        rng.standard_normal((6, 4, 3, 5)),
        rng.uniform(-2.5, 2.5, (2, 30, 7, 8)),
        rng.uniform(0, 1, (2, 15, 7, 8)),
    ]
    grad = rng.standard_normal((2, 6, 7, 8))
    m = module(MODULATED, target, folder, "Modulated")
    args = [to(target, a) for a in inputs]
    forward, vjp = functools.partial(m.forward, s=2, p=1), functools.partial(m.vjp, s=2, p=1)
    if target == "jax":  # one compiled program instead of op-by-op dispatch
        forward, vjp = jax.jit(forward), jax.jit(vjp)
    y = numpy(forward(*args))
    np.testing.assert_allclose(y, modulated_loop(*inputs, s=2, p=1), atol=1e-12)
    got = vjp(*args, to(target, grad))
    step = 1e-6
    for k, g in enumerate(got):
        direction = rng.standard_normal(inputs[k].shape)
        plus = [a + step * direction if n == k else a for n, a in enumerate(inputs)]
        minus = [a - step * direction if n == k else a for n, a in enumerate(inputs)]
        change = modulated_vectorized(*plus, s=2, p=1) - modulated_vectorized(*minus, s=2, p=1)
        want = np.sum(grad * change) / (2 * step)
        np.testing.assert_allclose(np.sum(numpy(g) * direction), want, rtol=1e-6, err_msg=str(k))


def test_the_repos_modulated_deformable_conv_is_the_one_tested_here():
    from dataclasses import replace
    from pathlib import Path

    from symgrad.spec import load_spec

    root = Path(__file__).resolve().parent.parent
    (op,) = [
        op for op in load_spec(root / "symgrad.toml").ops if op.name == "ModulatedDeformConv2d"
    ]
    here = replace(parse_op(op.name, MODULATED, "symgrad.toml"), source=op.source)
    assert here == op


# -- multi-scale deformable attention, in Deformable DETR's layout ----------------------------


def msda_corner(dy, dx):
    """One corner of the bilinear sample at pixel (Y, X) of level l, masked by its bounds."""
    fy, fx = "(Y[b,q,m,l,p] - floor(Y[b,q,m,l,p]))", "(X[b,q,m,l,p] - floor(X[b,q,m,l,p]))"
    wy, wx = (fy if dy else f"(1 - {fy})"), (fx if dx else f"(1 - {fx})")
    r = "floor(Y[b,q,m,l,p])" + (" + 1" if dy else "")
    c = "floor(X[b,q,m,l,p])" + (" + 1" if dx else "")
    cond = f"{r} >= 0 and {r} < shapes[l,0] and {c} >= 0 and {c} < shapes[l,1]"
    row = f"({r})" if dy else r
    read = f"value[b, start[l] + {row} * shapes[l,1] + {c}, m, d]"
    return f"where({cond}, {wy} * {wx} * {read}, 0)"


MS_DEFORM_ATTN = {
    "formula": [
        "Y[b,q,m,l,p] = loc[b,q,m,l,p,1] * shapes[l,0] - 0.5",
        "X[b,q,m,l,p] = loc[b,q,m,l,p,0] * shapes[l,1] - 0.5",
        "out[b,q,m,d] = sum(attn[b,q,m,l,p] * ("
        + " + ".join(msda_corner(dy, dx) for dy in (0, 1) for dx in (0, 1))
        + "), l, p)",
    ],
    "outputs": ["out"],
    "inputs": ["value", "shapes", "start", "loc", "attn"],
    "no_gradient": ["shapes", "start"],
}


def ms_deform_attn_pytorch(value, shapes, loc, attn):
    """Deformable DETR's `ms_deform_attn_core_pytorch` (models/ops/functions/
    ms_deform_attn_func.py): each level split off the flattened value and sampled with
    torch's grid_sample (bilinear, zeros, align_corners=False) at 2*loc - 1."""
    n, _, heads, dims = value.shape
    _, queries, _, levels, points, _ = loc.shape
    per_level = value.split([int(h * w) for h, w in shapes], dim=1)
    grids = 2 * loc - 1
    sampled = []
    for level, (h, w) in enumerate(shapes):
        v = per_level[level].flatten(2).transpose(1, 2).reshape(n * heads, dims, int(h), int(w))
        g = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
        sampled.append(
            torch.nn.functional.grid_sample(v, g, "bilinear", "zeros", align_corners=False)
        )
    a = attn.transpose(1, 2).reshape(n * heads, 1, queries, levels * points)
    out = (torch.stack(sampled, dim=-2).flatten(-2) * a).sum(-1).view(n, heads * dims, queries)
    return out.transpose(1, 2).reshape(n, queries, heads, dims)


@pytest.mark.parametrize("target", TARGETS)
def test_multi_scale_deformable_attention_is_deformable_detrs(folder, target):
    """MsDeformAttn in the kernel's layout (levels 4x5, 2x3, 1x2 flattened into s=28,
    start = level_start_index given as integers) against Deformable DETR's PyTorch core and
    its autograd: the output and the gradients of value, loc (samples past every border
    too) and attn."""
    rng = np.random.default_rng(19)
    shapes = np.array([[4, 5], [2, 3], [1, 2]])
    start = np.concatenate([[0], np.cumsum(shapes[:, 0] * shapes[:, 1])[:-1]])
    value = rng.standard_normal((2, 28, 3, 7))  # b=2, s=28, m=3, d=7
    loc = rng.uniform(-0.2, 1.2, (2, 6, 3, 3, 4, 2))  # q=6, l=3, p=4
    attn = rng.uniform(0, 1, (2, 6, 3, 3, 4))
    grad = rng.standard_normal((2, 6, 3, 7))
    tensors = [torch.tensor(a, requires_grad=True) for a in (value, loc, attn)]
    want = ms_deform_attn_pytorch(tensors[0], shapes, *tensors[1:])
    want.backward(torch.tensor(grad))
    m = module(MS_DEFORM_ATTN, target, folder, "MsDeformAttn")
    args = [to(target, a) for a in (value, shapes * 1.0, start, loc, attn)]
    forward, vjp = m.forward, m.vjp
    if target == "jax":  # one compiled program instead of op-by-op dispatch
        forward, vjp = jax.jit(forward), jax.jit(vjp)
    np.testing.assert_allclose(numpy(forward(*args)), want.detach().numpy(), atol=1e-12)
    gv, gshapes, gstart, gloc, gattn = vjp(*args, to(target, grad))
    assert gshapes is None and gstart is None
    for got, t in zip((gv, gloc, gattn), tensors, strict=True):
        np.testing.assert_allclose(numpy(got), t.grad.numpy(), atol=1e-12)


def test_the_repos_multi_scale_deformable_attention_is_the_one_tested_here():
    from dataclasses import replace
    from pathlib import Path

    from symgrad.spec import load_spec

    root = Path(__file__).resolve().parent.parent
    (op,) = [op for op in load_spec(root / "symgrad.toml").ops if op.name == "MsDeformAttn"]
    here = replace(parse_op(op.name, MS_DEFORM_ATTN, "symgrad.toml"), source=op.source)
    assert here == op


@torch.library.custom_op("symgrad_test::deform_conv_int_offsets", mutates_args=())
def deform_conv_op(
    x: torch.Tensor, w: torch.Tensor, off: torch.Tensor, s: int, p: int
) -> torch.Tensor:
    """Opaque to autograd: deformable conv computed by the NumPy loop."""
    arrays = [a.detach().numpy() for a in (x, w, off)]
    return torch.from_numpy(deform_conv_loop(*arrays[:2], arrays[2].astype(float), s, p))


@deform_conv_op.register_fake
def _(x, w, off, s, p):
    return x.new_empty(x.shape[0], w.shape[0], off.shape[2], off.shape[3])


def test_a_registered_op_given_integer_offsets_gets_the_generated_gradient(folder):
    """PyTorch's `register`: the op's backward casts integer offsets and gives them no
    gradient; x and w get `vjp`'s gradients."""
    m = module(DEFORM_CONV, "pytorch", folder)
    m.register(deform_conv_op)
    x, w, _, attrs = deform_inputs(seed=20)
    off = torch.tensor(np.random.default_rng(20).integers(-3, 4, (1, 12, 7, 5)))
    x, w = (torch.tensor(a, requires_grad=True) for a in (x, w))
    grad = torch.tensor(np.random.default_rng(21).standard_normal((1, 4, 7, 5)))
    got = torch.autograd.grad(deform_conv_op(x, w, off, attrs["s"], attrs["p"]), (x, w), grad)
    want = m.vjp(x.detach(), w.detach(), off, grad, **attrs)
    assert want[2] is None
    for g, expected in zip(got, want[:2], strict=True):
        torch.testing.assert_close(g, expected, atol=1e-12, rtol=0)

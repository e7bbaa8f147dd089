"""StyleGAN2's upfirdn2d (`Upfirdn2d` in symgrad.toml) through the polyphase rewrite
(symgrad/polyphase.py): exact against a NumPy loop transcription of `upfirdn2d_native` and
against `upfirdn2d_native` itself (PyTorch), forward and both gradients, in every target;
a training step per target; the rewrite's rule; and the memory of a training step.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
import numpy as np
import pytest
import tensorflow as tf
import torch
import torch.nn.functional as F
from harness import Case, check, generate, load_module, op_spec
from peaks import run_tensorflow
from target_harness import check_target, frameworks

from symgrad import polyphase
from symgrad.pipeline import module_text
from symgrad.spec import OpSpec, parse_spec

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parent.parent
ATTRS = ("up_x", "up_y", "down_x", "down_y", "pad_x0", "pad_x1", "pad_y0", "pad_y1")
_counter = itertools.count()

# (up_x, up_y, down_x, down_y, pad_x0, pad_x1, pad_y0, pad_y1): StyleGAN2's upsampling
# (up 2, pads from the filter), a downsampling (up 1, down 2), negative pads (crops), and
# different factors per axis.
SETTINGS = [
    (2, 2, 1, 1, 2, 1, 2, 1),
    (1, 1, 2, 2, 1, 1, 1, 1),
    (3, 2, 2, 1, -1, 2, 1, -2),
    (2, 3, 1, 2, 0, -1, -2, 3),
]


def _repo_op(name: str) -> OpSpec:
    spec = parse_spec((ROOT / "symgrad.toml").read_text(encoding="utf-8"), "symgrad.toml")
    return next(op for op in spec.ops if op.name == name)


def upfirdn2d_loops(x, f, up_x, up_y, down_x, down_y, pad_x0, pad_x1, pad_y0, pad_y1):
    """rosinality's `upfirdn2d_native`, step by step in NumPy loops: zero-stuff, pad or
    crop, correlate with the flipped filter tap by tap, keep every down-th output."""
    b, c, in_h, in_w = x.shape
    kh, kw = f.shape
    up = np.zeros((b, c, in_h * up_y, in_w * up_x), x.dtype)
    for n in range(in_h):
        for m in range(in_w):
            up[:, :, n * up_y, m * up_x] = x[:, :, n, m]
    padded = np.pad(
        up, ((0, 0), (0, 0), (max(pad_y0, 0), max(pad_y1, 0)), (max(pad_x0, 0), max(pad_x1, 0)))
    )
    padded = padded[
        :,
        :,
        max(-pad_y0, 0) : padded.shape[2] - max(-pad_y1, 0),
        max(-pad_x0, 0) : padded.shape[3] - max(-pad_x1, 0),
    ]
    w = f[::-1, ::-1]
    out_h, out_w = padded.shape[2] - kh + 1, padded.shape[3] - kw + 1
    out = np.zeros((b, c, max(out_h, 0), max(out_w, 0)), x.dtype)
    for t in range(out_h):
        for s in range(out_w):
            for u in range(kh):
                for v in range(kw):
                    out[:, :, t, s] += padded[:, :, t + u, s + v] * w[u, v]
    return out[:, :, ::down_y, ::down_x]


def upfirdn2d_native(input, kernel, up_x, up_y, down_x, down_y, pad_x0, pad_x1, pad_y0, pad_y1):
    """rosinality/stylegan2-pytorch op/upfirdn2d.py, verbatim (F.pad and conv2d)."""
    _, channel, in_h, in_w = input.shape
    input = input.reshape(-1, in_h, in_w, 1)
    _, in_h, in_w, minor = input.shape
    kernel_h, kernel_w = kernel.shape
    out = input.view(-1, in_h, 1, in_w, 1, minor)
    out = F.pad(out, [0, 0, 0, up_x - 1, 0, 0, 0, up_y - 1])
    out = out.view(-1, in_h * up_y, in_w * up_x, minor)
    out = F.pad(out, [0, 0, max(pad_x0, 0), max(pad_x1, 0), max(pad_y0, 0), max(pad_y1, 0)])
    out = out[
        :,
        max(-pad_y0, 0) : out.shape[1] - max(-pad_y1, 0),
        max(-pad_x0, 0) : out.shape[2] - max(-pad_x1, 0),
        :,
    ]
    out = out.permute(0, 3, 1, 2)
    out = out.reshape([-1, 1, in_h * up_y + pad_y0 + pad_y1, in_w * up_x + pad_x0 + pad_x1])
    w = torch.flip(kernel, [0, 1]).view(1, 1, kernel_h, kernel_w)
    out = F.conv2d(out, w)
    out = out.reshape(
        -1,
        minor,
        in_h * up_y + pad_y0 + pad_y1 - kernel_h + 1,
        in_w * up_x + pad_x0 + pad_x1 - kernel_w + 1,
    )
    out = out.permute(0, 2, 3, 1)
    out = out[:, ::down_y, ::down_x, :]
    out_h = (in_h * up_y + pad_y0 + pad_y1 - kernel_h + down_y) // down_y
    out_w = (in_w * up_x + pad_x0 + pad_x1 - kernel_w + down_x) // down_x
    return out.view(-1, channel, out_h, out_w)


def _loop_gradients(x, f, g, setting):
    """The gradients of sum(g * y) from the loops: y is linear in x and in f, so each
    gradient entry is the loops' output at a unit input, against g (the loops run on all
    unit x's at once, as batch positions: every (b, c) is filtered alike)."""
    h, w = x.shape[2:]
    units = np.eye(h * w).reshape(h * w, 1, h, w)
    grad_x = np.einsum("bcij,pij->bcp", g, upfirdn2d_loops(units, f, *setting)[:, 0])
    grad_f = np.zeros_like(f)
    for position in np.ndindex(f.shape):
        unit = np.zeros_like(f)
        unit[position] = 1.0
        grad_f[position] = np.sum(g * upfirdn2d_loops(x, unit, *setting))
    return [grad_x.reshape(x.shape), grad_f]


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("upfirdn2d")
    op = _repo_op("Upfirdn2d")
    found = {}
    for target in ("tensorflow", "pytorch", "jax"):
        stem = f"symgrad_{target}_upfirdn2d_{next(_counter)}"
        found[target] = load_module(module_text(op, "symgrad.toml", target), folder, stem)
    return found


def _case(setting, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 5, 7))  # b, c, n, m: a different size for each
    f = rng.standard_normal((4, 3))  # KH = 4, KW = 3: not a multiple of up
    y = upfirdn2d_loops(x, f, *setting)
    g = rng.standard_normal(y.shape)
    return x, f, y, g


def _run(target, module, x, f, g, attrs):
    """forward, vjp, and autodiff through forward, as NumPy arrays."""
    if target == "tensorflow":
        xs = [tf.constant(x), tf.constant(f)]
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = module.forward(*xs, **attrs)
        through = tape.gradient(y, xs, output_gradients=tf.constant(g))
        vjp = module.vjp(*xs, tf.constant(g), **attrs)
        return y.numpy(), [t.numpy() for t in vjp], [t.numpy() for t in through]
    if target == "pytorch":
        xs = [torch.tensor(v, requires_grad=True) for v in (x, f)]
        y = module.forward(*xs, **attrs)
        through = torch.autograd.grad(y, xs, torch.tensor(g))
        vjp = module.vjp(*(v.detach() for v in xs), torch.tensor(g), **attrs)
        return y.detach().numpy(), [t.numpy() for t in vjp], [t.numpy() for t in through]
    xs = [jnp.asarray(x), jnp.asarray(f)]  # under jit: eager JAX compiles op by op

    def through(a, b, cotangent):
        y, pullback = jax.vjp(lambda a, b: module.forward(a, b, **attrs), a, b)
        return y, pullback(cotangent)

    y, grads = jax.jit(through)(*xs, jnp.asarray(g))
    vjp = jax.jit(lambda a, b, c: module.vjp(a, b, c, **attrs))(*xs, jnp.asarray(g))
    return np.asarray(y), [np.asarray(t) for t in vjp], [np.asarray(t) for t in grads]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "_".join(map(str, s)))
def test_upfirdn2d_is_the_loop_transcription_in_every_target(setting, modules):
    """forward and the gradients of x and f (vjp and autodiff through forward), float64,
    against the loops, and the loops against upfirdn2d_native."""
    x, f, want, g = _case(setting, seed=sum(setting) + 40)
    native = upfirdn2d_native(torch.tensor(x), torch.tensor(f), *setting).numpy()
    np.testing.assert_allclose(native, want, rtol=1e-12, atol=1e-12)
    grads = _loop_gradients(x, f, g, setting)
    attrs = dict(zip(ATTRS, setting, strict=True))
    for target, module in modules.items():
        y, vjp, through = _run(target, module, x, f, g, attrs)
        np.testing.assert_allclose(y, want, rtol=1e-10, atol=1e-12, err_msg=target)
        for how, found in (("vjp", vjp), ("autodiff", through)):
            for name, got, expected in zip("xf", found, grads, strict=True):
                np.testing.assert_allclose(
                    got, expected, rtol=1e-10, atol=1e-12, err_msg=f"{target} {how} grad {name}"
                )


def test_upfirdn2d_gradients_equal_upfirdn2d_natives_autograd(modules):
    """PyTorch's module against torch autograd through upfirdn2d_native (F.pad, conv2d)."""
    setting = SETTINGS[0]
    x, f, _, g = _case(setting, seed=3)
    attrs = dict(zip(ATTRS, setting, strict=True))
    xs = [torch.tensor(v, requires_grad=True) for v in (x, f)]
    want = torch.autograd.grad(upfirdn2d_native(*xs, *setting), xs, torch.tensor(g))
    got = torch.autograd.grad(modules["pytorch"].forward(*xs, **attrs), xs, torch.tensor(g))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_upfirdn2d_training_step_in_every_target(target, modules):
    """One SGD step on x and f through `forward` equals the step from the loops' gradients."""
    setting = SETTINGS[2]
    x, f, y, _ = _case(setting, seed=11)
    want_grads = _loop_gradients(x, f, np.ones_like(y), setting)  # of sum(y)
    attrs = dict(zip(ATTRS, setting, strict=True))
    module = modules[target]
    lr = 0.1
    if target == "tensorflow":
        xs = [tf.Variable(x), tf.Variable(f)]
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(module.forward(*xs, **attrs))
        for v, grad in zip(xs, tape.gradient(loss, xs), strict=True):
            v.assign_sub(lr * grad)
        stepped = [v.numpy() for v in xs]
    elif target == "pytorch":
        xs = [torch.tensor(v, requires_grad=True) for v in (x, f)]
        optimizer = torch.optim.SGD(xs, lr=lr)
        module.forward(*xs, **attrs).sum().backward()
        optimizer.step()
        stepped = [v.detach().numpy() for v in xs]
    else:

        def loss(a, b):
            return jnp.sum(module.forward(a, b, **attrs))

        grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x), jnp.asarray(f))
        stepped = [np.asarray(v - lr * d) for v, d in zip((x, f), grads, strict=True)]
    for got, v, d in zip(stepped, (x, f), want_grads, strict=True):
        np.testing.assert_allclose(got, v - lr * d, rtol=1e-10, atol=1e-12)


def _op(formula: str, **table) -> OpSpec:
    attrs = tuple((name, "int") for name in table.pop("attrs", ()))
    attrs += (("alpha", "float"),) if "alpha" in formula else ()
    return OpSpec("Probe", (formula,), None, attrs, (), "test [ops.Probe]", **table)


def test_upfirdn2d_sums_over_the_filter_taps_only():
    """Both summed indices of upfirdn2d are replaced by their phase index, whose range is
    the filter's size over up (rounded up): the rewrite the docstring and README state."""
    op, rewrites = polyphase.rewrite(_repo_op("Upfirdn2d"))
    assert [(r.index, r.fresh, r.tensor, r.axis) for r in rewrites] == [
        ("n", "kn", "f", 0),
        ("m", "km", "f", 1),
    ]
    assert dict(op.ranges)["kn"] == "(f.shape[0] + up_y - 1) // up_y"
    assert dict(op.ranges)["km"] == "(f.shape[1] + up_x - 1) // up_x"
    assert rewrites[0].substitute == "(KH - 1 + down_y * i - pad_y0) // up_y - kn"
    assert rewrites[0].new_position == "up_y*kn + (KH - 1 + down_y * i - pad_y0) % up_y"
    assert "sum(x[b, c, (KH - 1 + down_y * i - pad_y0) // up_y - kn, " in op.formulas[0]
    # a literal stride and a positive coefficient: n = kn - E // 2
    _, (literal,) = polyphase.rewrite(
        _op("y[b,i] = sum(x[b,n] * f[2*n - 3*i + 1], n)", ranges=(("i", "x.shape[1]"),))
    )
    # a stride of 1 (a downsampling filter): a plain window of x, f read at the tap
    _, (unit,) = polyphase.rewrite(
        _op("y[b,i] = sum(x[b,n] * f[3 + 2*i - n], n)", ranges=(("i", "x.shape[1] // 2"),))
    )
    assert (unit.substitute, unit.new_position, unit.range) == (
        "(3 + 2 * i) - kn",
        "kn",
        "f.shape[0]",
    )
    assert (literal.substitute, literal.range) == (
        "kn - (-(3 * i) + 1) // 2",
        "(f.shape[0] + 1) // 2",
    )


@pytest.mark.parametrize(
    "formula, attrs, ranges",
    [
        # a convolution with its window on the data: x has a batch index w lacks
        ("y[b,i,o] = sum(x[b, s*i + d*k - p, c] * w[k,c,o], k, c)", ("s", "d", "p"), ()),
        # without a batch axis: x reads the channel c plainly, so it is data, not a filter
        # (rewritten, the sum ran over x's length and i was sized 1 from w)
        ("y[i,o] = sum(x[i + k, c] * w[k,c,o], k, c)", (), ()),
        ("y[i,o] = sum(x[2*i + k, c] * w[k,c,o], k, c)", (), ()),
        # a single-channel signal, x[i + k]: i is sized by this read (no range of its own)
        ("y[i,o] = sum(x[i + k] * w[k,o], k)", (), ()),
        # an FIR filter, window on the data
        ("y[b,t] = sum(w[k] * x[b, t - k], k)", (), (("t", "x.shape[1]"),)),
        # no output index tells the filter from the data: left alone
        ("y[i] = sum(w[k] * x[2*i + 3*k], k)", (), ()),
        # n in a condition, and n as a value
        ("y[b,i] = sum(where(n < i, x[b,n], 0) * f[2*n - i], n)", (), (("i", "x.shape[1]"),)),
        ("y[b,i] = sum(n * x[b,n] * f[2*n - i], n)", (), (("i", "x.shape[1]"),)),
        # a float attr in the position: a sampled read (interpolation), not a stride
        ("y[b,i] = sum(x[b,n] * f[2*n - i + alpha], n)", (), (("i", "x.shape[1]"),)),
        # n at two computed positions, or times an index
        ("y[b,i] = sum(x[b,n] * f[2*n - i] * f[n + i], n)", (), (("i", "x.shape[1]"),)),
        ("y[b,i] = sum(x[b,n] * f[i*n], n)", (), (("i", "x.shape[1]"),)),
        # f not a factor: the reads past f do not zero the body (rewritten, exp(0) = 1 was
        # added for the taps past the filter's end)
        ("y[b,i] = sum(x[b,n] * exp(f[i - 2*n]), n)", (), (("i", "2*x.shape[1]"),)),
        ("y[b,i] = sum(x[b,n] / f[i - 2*n], n)", (), (("i", "2*x.shape[1]"),)),
    ],
)
def test_other_reads_at_strided_positions_are_not_rewritten(formula, attrs, ranges):
    op = _op(formula, attrs=attrs, ranges=ranges)
    assert polyphase.rewrite(op) == (op, ())


def test_a_bias_added_before_the_filter_reads_zero_past_the_input(tmp_path):
    """`y[b,i] = sum((x[b,n] + c[b]) * f[i - n], n)`, the full convolution of x plus a bias
    (StyleGAN3's filtered_lrelu adds its bias before it upsamples): only the n inside x
    add anything. Rewritten as a polyphase sum without a condition, the bias was added
    for every tap of the filter at the borders (0.71 off at i = 0 on these inputs); the
    rewrite keeps n's own range, 0 <= i - kn < x.shape[1], in every target."""
    rng = np.random.default_rng(21)
    x, c, f = rng.standard_normal((2, 5)), rng.standard_normal(2), rng.standard_normal(3)
    want = np.stack([np.convolve(x[b] + c[b], f) for b in range(2)])
    op = _op(
        "y[b,i] = sum((x[b,n] + c[b]) * f[i - n], n)",
        ranges=(("i", "x.shape[1] + f.shape[0] - 1"),),
    )
    rewritten, (rewrite,) = polyphase.rewrite(op)
    assert (rewrite.size, rewrite.let) == ("size_n", ("size_n", "x.shape[1]"))
    assert "where(0 <= i - kn and i - kn < size_n, " in rewritten.formulas[0]
    for target, tensor in (
        ("tensorflow", tf.constant),
        ("pytorch", torch.tensor),
        ("jax", jnp.asarray),
    ):
        stem = f"symgrad_bias_first_{target}"
        text = module_text(op, "test.toml", target)
        assert "one per kn; f is then read at kn, kept where 0 <= (i) - kn < size_n" in text
        module = load_module(text, tmp_path, stem)
        got = module.forward(tensor(x), tensor(c), tensor(f))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


# Sums whose index keeps its own range through the rewrite (a condition on its substitute)
# or needs not (an internal tensor computed along it reads zero past its axis), each with
# that range: (the case, the size the condition keeps or None, the target besides
# TensorFlow it runs in; each target is run by some case, one per case keeps the suite fast).
KEPT = {
    # a bias added before upsampling by 2 (StyleGAN3's filtered_lrelu), odd padding
    "bias_up": (
        Case(
            "y[b,i] = sum((x[b,n] + c[b]) * f[i + 1 - 2*n], n)",
            {"x": (2, 5), "c": (2,), "f": (4,)},
            ranges={"i": "2*x.shape[1] + 1"},
            sizes={"i": 11},
        ),
        "x.shape[1]",
        "pytorch",
    ),
    # a range shorter than x's axis: only its first positions, as the sum written reads
    "short_range": (
        Case(
            "y[b,i] = sum(x[b,n] * f[i - 2*n], n)",
            {"x": (2, 6), "f": (3,)},
            ranges={"n": "x.shape[1] - 2", "i": "2*x.shape[1]"},
            sizes={"n": 4, "i": 12},
        ),
        "x.shape[1] - 2",
        "jax",
    ),
    # downsampling an internal tensor computed along p, 1 past x (h = 1 there): read
    # zero past its own axis, so nothing is kept
    "internal": (
        Case(
            ("h[b,p] = x[b,p] * x[b,p] + 1", "y[b,i] = sum(h[b,p] * f[2*i + 2 - p], p)"),
            {"x": (2, 7), "f": (3,)},
            ranges={"p": "x.shape[1] + 1", "i": "(x.shape[1] + 3) // 2"},
            sizes={"p": 8, "i": 5},
            outputs=("y",),
        ),
        None,
        "pytorch",
    ),
}


@pytest.mark.parametrize("name", sorted(KEPT))
def test_a_summed_index_keeps_its_own_range(name, tmp_path):
    """Rewritten, with n's own range kept where the body is not zero past it, and equal
    in float64 to TF autodiff over the reference evaluator of the sum as written (and
    finite differences): forward, vjp, the registered gradient and autodiff, in
    TensorFlow and the case's other target."""
    case, size, target = KEPT[name]
    _, (rewrite,) = polyphase.rewrite(op_spec(case, "Kept"))
    assert (rewrite.let[1] if rewrite.let else None) == size
    assert (rewrite.size is None) == (size is None)
    check(case, generate(case, tmp_path, prefix="Kept"))
    module = generate(case, tmp_path, prefix="Kept", target=target)
    check_target(case, module, frameworks()[target])


def test_no_other_op_of_the_repo_is_rewritten():
    spec = parse_spec((ROOT / "symgrad.toml").read_text(encoding="utf-8"), "symgrad.toml")
    rewritten = [op.name for op in spec.ops if polyphase.rewrite(op)[1]]
    assert rewritten == ["Upfirdn2d"]


def test_explain_and_the_docstring_show_the_substitution(capsys, modules):
    from symgrad.cli import main

    assert main(["explain", "--op", "Upfirdn2d", "--spec", str(ROOT / "symgrad.toml")]) == 0
    text = capsys.readouterr().out
    line = "n = (KH - 1 + down_y * i - pad_y0) // up_y - kn, kn in [0, (f.shape[0] + up_y - 1)"
    assert text.startswith("Polyphase (symgrad/polyphase.py)")
    assert line in text
    for module in modules.values():
        doc = module.__doc__
        assert "y[b,c,i,j] = sum(x[b,c,n,m] * f[KH - 1 + down_y*i - up_y*n - pad_y0" in doc
        assert line in doc and "so the formula lowered is" in doc


# ----------------------------------------------------------------------------- memory

# x 2x3x24x20, f 4x3, up 2: y 2x3x47x41. The lowering without the rewrite gathers f over
# [i, n, j, m] (47*24*41*20 floats, 3.7 MB); io is 0.07 MB, the bound 4 io + 256 KiB.
MEMORY_SHAPES = {"x": (2, 3, 24, 20), "f": (4, 3)}
MEMORY_ATTRS = dict(zip(ATTRS, (2, 2, 1, 1, 2, 1, 2, 1), strict=True))
BUDGET = 2**18


@pytest.fixture(scope="module")
def before(tmp_path_factory):
    """The modules generated without the polyphase rewrite (the lowering before it)."""
    folder = tmp_path_factory.mktemp("before")
    op = _repo_op("Upfirdn2d")
    found = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(polyphase, "rewrite", lambda op: (op, ()))
        for target in ("tensorflow", "pytorch", "jax"):
            stem = f"symgrad_{target}_upfirdn2d_before_{next(_counter)}"
            found[target] = load_module(module_text(op, "symgrad.toml", target), folder, stem)
    return found


def _memory_arrays():
    rng = np.random.default_rng(8)
    return [rng.standard_normal(MEMORY_SHAPES[n]).astype(np.float32) for n in ("x", "f")]


def _bound(arrays, y_bytes):
    return 4 * (sum(a.nbytes for a in arrays) + y_bytes) + BUDGET


def test_pytorch_upfirdn2d_training_step_memory_is_bounded(modules, before, monkeypatch):
    from test_tiling import _torch_memory

    arrays = _memory_arrays()
    peaks = {}
    for name, module in (("polyphase", modules["pytorch"]), ("before", before["pytorch"])):
        monkeypatch.setattr(module, "MAX_TEMP_BYTES", BUDGET if name == "polyphase" else 2**40)
        xs = [torch.tensor(a, requires_grad=True) for a in arrays]
        _, peaks[name] = _torch_memory(module, xs, MEMORY_ATTRS)
        with torch.no_grad():
            y_bytes = module.forward(*xs, **MEMORY_ATTRS).nbytes
    bound = _bound(arrays, y_bytes)
    print(f"pytorch peaks {peaks}, bound {bound}")
    assert peaks["polyphase"] <= bound, (peaks, bound)
    assert peaks["before"] > 4 * bound, (peaks, bound)


def test_jax_upfirdn2d_gradient_memory_is_bounded(modules, before, monkeypatch):
    arrays = [jnp.asarray(a) for a in _memory_arrays()]
    found = {}
    for name, module in (("polyphase", modules["jax"]), ("before", before["jax"])):
        monkeypatch.setattr(module, "MAX_TEMP_BYTES", BUDGET if name == "polyphase" else 2**40)

        def loss(x, f, module=module):
            return jnp.sum(jnp.sin(module.forward(x, f, **MEMORY_ATTRS)))

        stats = jax.jit(jax.grad(loss, (0, 1))).lower(*arrays).compile().memory_analysis()
        found[name] = stats.temp_size_in_bytes
    y_bytes = np.asarray(modules["jax"].forward(*arrays, **MEMORY_ATTRS)).nbytes
    bound = _bound([np.asarray(a) for a in arrays], y_bytes)
    print(f"jax gradient temporaries {found}, bound {bound}")
    assert found["polyphase"] <= bound, (found, bound)
    assert found["before"] > 4 * bound, (found, bound)


TF_MEASURE = """
import json, sys
import numpy as np
import tensorflow as tf
sys.path.insert(0, {folder!r})
attrs = {attrs!r}
rng = np.random.default_rng(8)
arrays = [rng.standard_normal(s).astype(np.float32) for s in {shapes!r}]
found = {{}}
for name, budget in (({new!r}, {budget}), ({old!r}, 2**40)):
    module = __import__(name)
    module.MAX_TEMP_BYTES = budget
    args = [tf.constant(a) for a in arrays]
    def run():
        with tf.GradientTape() as tape:
            tape.watch(args)
            y = module.forward(*args, **attrs)
            loss = tf.reduce_sum(y * y)
        return [g.numpy() for g in tape.gradient(loss, args)], y.numpy().nbytes
    _, y_bytes = run()
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    run()
    found[name] = tf.config.experimental.get_memory_info("CPU:0")["peak"] - start
found["y_bytes"] = y_bytes
print(json.dumps(found))
"""


def test_tensorflow_upfirdn2d_training_step_memory_is_bounded(modules, before, tmp_path):
    import inspect
    import shutil

    for name, module in (("new_upfirdn2d", modules), ("old_upfirdn2d", before)):
        shutil.copy(inspect.getfile(module["tensorflow"]), tmp_path / f"{name}.py")
    code = TF_MEASURE.format(
        folder=str(tmp_path),
        attrs=MEMORY_ATTRS,
        shapes=[MEMORY_SHAPES["x"], MEMORY_SHAPES["f"]],
        new="new_upfirdn2d",
        old="old_upfirdn2d",
        budget=BUDGET,
    )
    found = run_tensorflow(code)
    bound = _bound(_memory_arrays(), found["y_bytes"])
    print(f"tensorflow peaks {found}, bound {bound}")
    assert found["new_upfirdn2d"] <= bound, (found, bound)
    assert found["old_upfirdn2d"] > 4 * bound, (found, bound)

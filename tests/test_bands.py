"""Banded windows (symgrad/bands.py): a 1-D sliding window multiplied with one other tensor
runs as chunked matrix products over the source's rows, never as the gathered window; its
gradient is the transpose of the same products. Exact against the reference in every
target, with the budget large (one group of chunks) and tiny (a group per chunk), at
windows reaching outside the source on both sides and wider than it."""

from __future__ import annotations

import ast
import dataclasses
import functools

import numpy as np
import pytest
import tensorflow as tf
from harness import Case, check, check_second_derivatives, generate, op_spec
from target_harness import check_graphs_equal_eager, check_target, frameworks, generate_for

from symgrad import bands
from symgrad.model import build
from symgrad.pipeline import module_text

CASES = {
    # local attention's scores (Longformer's layout): q·kᵀ over a window of 2w + 1 keys
    "scores": Case(
        "y[b,h,i,u] = sum(q[b,i,h,d] * k[b, i + u - w, h, d], d)",
        {"q": (2, 23, 3, 4), "k": (2, 19, 3, 4)},
        attrs={"w": 3},
        attr_types={"w": "int"},
        ranges={"u": "2*w + 1"},
        sizes={"u": 7},
    ),
    # scaled by an attr (attention's 1/sqrt(d)), the window's offset written first
    "scaled": Case(
        "y[b,i,u] = sum(q[b,i,d] * k[b, u + i - w, d], d) / s",
        {"q": (2, 11, 3), "k": (2, 9, 3)},
        attrs={"w": 2, "s": 1.7},
        attr_types={"w": "int", "s": "float"},
        ranges={"u": "2*w + 1"},
        sizes={"u": 5},
    ),
    # its weighted sum of values: p·v
    "apply": Case(
        "y[b,i,h,d] = sum(p[b,h,i,u] * v[b, i + u - 4, h, d], u)",
        {"p": (2, 3, 17, 6), "v": (2, 21, 3, 5)},
    ),
    # multi-query: keys shared by the heads (the window's gradient sums over them)
    "shared_keys": Case(
        "y[b,h,i,u] = sum(q[b,h,i,d] * k[b, i + u - 2, d], d)",
        {"q": (2, 3, 13, 4), "k": (2, 11, 4)},
        ranges={"u": "5"},
        sizes={"u": 5},
    ),
    # fairseq's dynamic convolution: a filter per position, no column axis
    "per_position_filter": Case(
        "y[b,i,c] = sum(p[b,i,u,c] * x[b, i + u - 2, c], u)",
        {"p": (2, 15, 5, 3), "x": (2, 15, 3)},
    ),
    # no batch axis, nothing summed: an outer product on a band
    "outer": Case(
        "y[i,u] = q[i] * k[i + u]", {"q": (9,), "k": (6,)}, ranges={"u": "4"}, sizes={"u": 4}
    ),
    # a window wider than its source and its rows
    "wide": Case(
        "y[i,u] = sum(q[i,d] * k[i + u - 9, d], d)",
        {"q": (4, 3), "k": (5, 3)},
        ranges={"u": "19"},
        sizes={"u": 19},
    ),
    # NATTEN's 1-D neighbourhood (its [B, heads, L, D] layout): the window's start clamped
    # so that it stays inside the sequence (a band of 2K - 1, each row's K cut out)
    "clamped": Case(
        "y[b,h,i,u] = sum(q[b,h,i,d] * k[b,h, max(min(i - ns, L - K), 0) + u, d], d)",
        {"q": (2, 3, 13, 4), "k": (2, 3, 13, 4)},
        attrs={"K": 5},
        attr_types={"K": "int"},
        ranges={"u": "K"},
        sizes={"u": 5},
        lets={"ns": "K // 2", "L": "q.shape[2]"},
        let_values={"ns": 2, "L": 13},
    ),
    # its weighted sum of values, an even window clamped by the values' own length
    "clamped_apply": Case(
        "y[b,i,d] = sum(p[b,i,u] * v[b, max(min(i - 3, L - 6), 0) + u, d], u)",
        {"p": (2, 11, 6), "v": (2, 11, 3)},
        lets={"L": "v.shape[1]"},
        let_values={"L": 11},
    ),
    # a dilated window (Longformer's dilation, one for every head): keys i + 2(u - w)
    "dilated": Case(
        "y[b,h,i,u] = sum(q[b,i,h,d] * k[b, i + 2*(u - w), h, d], d)",
        {"q": (2, 23, 3, 4), "k": (2, 19, 3, 4)},
        attrs={"w": 3},
        attr_types={"w": "int"},
        ranges={"u": "2*w + 1"},
        sizes={"u": 7},
    ),
    # the dilation an int attr (here 3), the window's weighted sum of values
    "dilated_apply": Case(
        "y[b,i,h,d] = sum(p[b,h,i,u] * v[b, i + D*u - 4, h, d], u)",
        {"p": (2, 3, 17, 4), "v": (2, 21, 3, 5)},
        attrs={"D": 3},
        attr_types={"D": "int"},
    ),
    # a window read backwards (keys i, i - 1, .., i - 3): a dilation of -1
    "reversed": Case(
        "y[i,u,c] = q[i,c] * k[i - u, c]",
        {"q": (9, 2), "k": (7, 2)},
        ranges={"u": "4"},
        sizes={"u": 4},
    ),
    # a centred window written as such: keys i - K // 2 .. i + K - 1 - K // 2 (an even K),
    # moved by K's remainder mod 3 (an offset printed with // and %)
    "centred": Case(
        "y[b,i,u] = sum(q[b,i,d] * k[b, i + u - K // 2 + K % 3, d], d)",
        {"q": (2, 11, 3), "k": (2, 9, 3)},
        attrs={"K": 4},
        attr_types={"K": "int"},
        ranges={"u": "K"},
        sizes={"u": 4},
    ),
    # a dilated window whose offset holds a power of the dilation (D·D: printed D * D),
    # its dilation a product of powers of attrs
    "squared_offset": Case(
        "y[b,i,h,d] = sum(p[b,h,i,u] * v[b, i + D*D*E*(u - 1) - D*D, h, d], u)",
        {"p": (2, 3, 13, 4), "v": (2, 15, 3, 5)},
        attrs={"D": -2, "E": -1},
        attr_types={"D": "int", "E": "int"},
    ),
    # clamped on one side only (a causal window: keys i - 3 .. i, kept from before 0),
    # the rows longer than the keys
    "clamped_causal": Case(
        "y[i,u,c] = q[i,c] * k[max(i - 3, 0) + u, c]",
        {"q": (9, 2), "k": (7, 2)},
        ranges={"u": "4"},
        sizes={"u": 4},
    ),
}


def _program(case: Case):
    return build(op_spec(case, "Band"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_case_is_banded_and_never_gathers_its_window(name):
    """Each case's window is recognised, and the module neither gathers nor scatters:
    the band kernels read the source's rows."""
    case = CASES[name]
    assert list(bands.bands(_program(case)).values())
    text = module_text(op_spec(case, "Band"), "test.toml")
    tree = ast.parse(text)
    bodies = [
        ast.get_source_segment(text, node)
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in ("_compute", "_backward")
    ]
    assert len(bodies) == 2
    for body in bodies:
        assert "_band_" in body
        assert "gather(" not in body and "segment_sum(" not in body


@pytest.mark.parametrize(
    "formula",
    [
        "y[b,i,u] = sum(q[b,i,d] * k[b, 2*i + u, d], d)",  # a stride: no band
        "y[b,i,u] = sum(q[b,i,d] * k[b, i + u, d] * k[b, i + u, d], d)",  # a square
        "y[b,i,u] = sum(exp(q[b,i,d] * k[b, i + u, d]), d)",  # not a product
        "y[b,i,u] = sum(q[b,i,u,d] * k[b, i + u, d], d)",  # u on both sides, nothing summed
        "y[b,i,u] = sum(d * q[b,i,d] * k[b, i + u, d], d)",  # an index as a value
        # a start clamped at a constant: its band could be as wide as the source
        "y[b,i,u] = sum(q[b,i,d] * k[b, min(i, 4) + u, d], d)",
        # a start clamped at two positions, not moving with i
        "y[b,i,u] = sum(q[b,i,d] * k[b, max(min(2*i, 3), 0) + u, d], d)",
        # a clamped start and a dilation
        "y[b,i,u] = sum(q[b,i,d] * k[b, max(i - 2, 0) + 2*u, d], d)",
        # a dilation over a size (a tensor in a TensorFlow graph) or a sum of attrs
        "y[b,i,u] = sum(q[b,i,d] * k[b, i + S*u, d], d)",
        "y[b,i,u] = sum(q[b,i,d] * k[b, i + (D + 1)*u, d], d)",
    ],
)
def test_other_reads_of_a_window_stay_gathers(formula):
    case = Case(formula, {"q": (2, 5, 3), "k": (2, 6, 3)}, ranges={"u": "3"}, sizes={"u": 3})
    if "S*u" in formula:
        case = dataclasses.replace(case, lets={"S": "q.shape[2]"}, let_values={"S": 3})
    if "D + 1" in formula:
        case = dataclasses.replace(case, attrs={"D": 1}, attr_types={"D": "int"})
    if "q[b,i,u,d]" in formula:
        case = Case(formula, {"q": (2, 5, 3, 2), "k": (2, 6, 2)})
    assert bands.bands(_program(case)) == {}


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("name", sorted(CASES))
def test_tensorflow_is_exact(name, budget, tmp_path):
    """forward, vjp, the registered gradient and a tape, against the reference and finite
    differences; budget 1: every chunk its own group (a call per chunk in eager mode, so
    finite differences along random directions instead of the whole Jacobian)."""
    case = CASES[name]
    module = generate(case, tmp_path, prefix="Band")
    if budget is not None:
        module.MAX_TEMP_BYTES = budget
        case = dataclasses.replace(case, fd_directions=3)
    check(case, module)


@pytest.mark.parametrize("budget", [1])
@pytest.mark.parametrize("target", ["pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_pytorch_and_jax_are_exact(name, target, budget, tmp_path):
    pytest.importorskip("torch" if target == "pytorch" else "jax")
    module = generate_for(CASES[name], target, tmp_path, prefix="Band")
    if budget is not None:
        module.MAX_TEMP_BYTES = budget
    check_target(CASES[name], module, frameworks()[target])


# Clamped windows in an op tiled along their centre for another temporary (exp of the
# scores): in the chunk the window is centred at i + tile_start inside the clamp, and its
# spread would be a tensor in TensorFlow's loop and traced in JAX's (both raised).
IN_A_LOOP = {
    # NATTEN's attention in one formula: clamped keys and values
    "natten_attention": Case(
        (
            "s[b,i,u] = sum(q[b,i,d] * k[b, max(min(i - ns, L - K), 0) + u, d], d)",
            "y[b,i,e] = sum(exp(s[b,i,u]) * v[b, max(min(i - ns, L - K), 0) + u, e], u)",
        ),
        {"q": (2, 11, 3), "k": (2, 11, 3), "v": (2, 11, 4)},
        attrs={"K": 5},
        attr_types={"K": "int"},
        ranges={"u": "K"},
        sizes={"u": 5},
        lets={"ns": "K // 2", "L": "k.shape[1]"},
        let_values={"ns": 2, "L": 11},
        outputs=("y",),
    ),
    # clamped keys, plain values
    "clamped_then_plain": Case(
        (
            "s[b,i,u] = sum(q[b,i,d] * k[b, max(min(i - 2, L - 5), 0) + u, d], d)",
            "y[b,i,e] = sum(exp(s[b,i,u]) * v[b, i + u - 2, e], u)",
        ),
        {"q": (2, 11, 3), "k": (2, 11, 3), "v": (2, 11, 4)},
        ranges={"u": "5"},
        sizes={"u": 5},
        lets={"L": "k.shape[1]"},
        let_values={"L": 11},
        outputs=("y",),
    ),
    # a sum of exp over the clamped scores (more rows in k)
    "clamped_logits": Case(
        (
            "s[b,i,u] = sum(q[b,i,d] * k[b, max(min(i - 2, L - 5), 0) + u, d], d)",
            "y[b,i] = sum(exp(s[b,i,u]), u)",
        ),
        {"q": (2, 10, 3), "k": (2, 12, 3)},
        ranges={"u": "5"},
        sizes={"u": 5},
        lets={"L": "k.shape[1]"},
        let_values={"L": 12},
        outputs=("y",),
    ),
}


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(IN_A_LOOP))
def test_a_clamped_window_in_an_op_tiled_along_its_centre(name, target, tmp_path):
    """Untiled the window is a band; in the chunk loop it stays a gather: exact in every
    target at the default budget, in chunks of one row and in a few chunks."""
    if target != "tensorflow":
        pytest.importorskip("torch" if target == "pytorch" else "jax")
    case = IN_A_LOOP[name]
    assert bands.bands(_program(case))
    for budget in (None, 1, 3000):
        module = generate_for(case, target, tmp_path, prefix="BandInLoop")
        if budget is not None:
            module.MAX_TEMP_BYTES = budget
        if target == "tensorflow":
            check(dataclasses.replace(case, fd_directions=3), module)
        else:
            check_target(case, module, frameworks()[target])


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("dilation", [-3, -2, 0, 1, 5])
def test_a_dilation_attr_of_any_sign_is_exact(dilation, target, tmp_path):
    """A dilation is an int attr, a Python int when the op is called: |d| plain windows,
    one per residue of the rows mod |d| (17 rows: residues of 6 and 5 rows at d = 3, of 4
    and 3 at d = 5), the offsets reversed for d < 0, one row at d = 0 (every offset reads
    it), the plain band at d = 1; in every target, at one group, at a group per chunk and
    at a few chunks a group."""
    if target != "tensorflow":
        pytest.importorskip("torch" if target == "pytorch" else "jax")
    case = dataclasses.replace(CASES["dilated_apply"], attrs={"D": dilation})
    assert bands.bands(_program(case))
    for budget in (None, 1, 2000):
        module = generate_for(case, target, tmp_path, prefix="BandDilation")
        if budget is not None:
            module.MAX_TEMP_BYTES = budget
        if target == "tensorflow":
            check(dataclasses.replace(case, fd_directions=3), module)
        else:
            check_target(case, module, frameworks()[target])


@pytest.mark.parametrize("name", ["scores", "apply"])
def test_tensorflow_gradient_of_the_gradient(name, tmp_path):
    """The forward runs on inputs cut from the tape (the chunks' values are not kept);
    under a tape or a forward accumulator of the gradient, the backward runs the forward
    again from the inputs it watches, so second derivatives hold: forward-over-reverse and
    reverse-over-reverse Hessian-vector products of sum(y²) equal central differences of
    its gradient, at the default budget and at a group per chunk."""
    case = CASES[name]
    module = generate(case, tmp_path, prefix="BandSecond")
    rng = np.random.default_rng(4)
    args = [tf.constant(rng.standard_normal(case.shapes[n])) for n in module.INPUTS]
    v = [tf.constant(rng.standard_normal(a.shape)) for a in args]

    for budget in (module.MAX_TEMP_BYTES, 1):
        module.MAX_TEMP_BYTES = budget
        check_second_derivatives(lambda *xs: module.forward(*xs, **case.attrs), args, v)


# the axis of each case's inputs that holds its rows (centre i, or the source's rows)
ROWS = {
    "scores": {"q": 1, "k": 1},
    "clamped": {"q": 2, "k": 2},
    "clamped_apply": {"p": 1, "v": 1},
    "dilated": {"q": 1, "k": 1},
}


def _float_inputs(case: Case, module, rng, dtype=np.float64, centre=0.0):
    shapes = [case.shapes[name] for name in module.INPUTS]
    return [(centre + rng.standard_normal(shape)).astype(dtype) for shape in shapes]


@pytest.mark.parametrize("budget", [None, 1, 2000])
@pytest.mark.parametrize("name", ["scores", "clamped", "clamped_apply", "dilated", "dilated_apply"])
def test_unknown_sizes_under_tf_function(name, budget, tmp_path):
    """Every size known only when the graph runs: the kernels' plan (and a clamped start's
    shifts and spread) is computed in the graph, and the groups of chunks run in a
    tf.while_loop (one group at the default budget; a chunk a group at 1 byte; a few
    chunks a group at 2000), the values the same as eagerly at the default budget."""
    case = CASES[name]
    module = generate(case, tmp_path, prefix="BandGraph")
    rng = np.random.default_rng(1)
    args = [tf.constant(x) for x in _float_inputs(case, module, rng)]
    y = module.forward(*args, **case.attrs)
    g = tf.constant(rng.standard_normal(y.shape))
    want = module.vjp(*args, g, **case.attrs)
    specs = [tf.TensorSpec([None] * len(x.shape), tf.float64) for x in (*args, g)]
    module.MAX_TEMP_BYTES = budget or module.MAX_TEMP_BYTES

    @tf.function(input_signature=specs)
    def graph(*xs):
        return module.forward(*xs[:-1], **case.attrs), module.vjp(*xs, **case.attrs)

    got_y, grads = graph(*args, g)
    loops = [
        op for op in graph.get_concrete_function().graph.get_operations() if "While" in op.type
    ]
    assert loops, "the groups of chunks run in a tf.while_loop"
    np.testing.assert_allclose(got_y.numpy(), y.numpy(), rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-12, atol=1e-12)


TILED_BANDS = {
    # a window applied to values, its offsets a literal range (tiled along i)
    "literal": Case(
        "y[b,i,d] = sum(a[b,i,u] * v[b, i + u - 2, d], u)",
        {"a": (2, 11, 5), "v": (2, 11, 4)},
        ranges={"u": "5"},
    ),
    # Longformer's AV with a dilation attr, heads between
    "dilated": Case(
        "y[b,i,h,d] = sum(a[b,i,h,u] * v[b, i + D*(u - w), h, d], u)",
        {"a": (2, 13, 3, 5), "v": (2, 13, 3, 4)},
        attrs={"w": 2, "D": 3},
        attr_types={"w": "int", "D": "int"},
        ranges={"u": "2*w + 1"},
        sizes={"u": 5},
    ),
}


@pytest.mark.parametrize("budget", [1, 2000])
@pytest.mark.parametrize("name", sorted(TILED_BANDS))
def test_a_training_step_under_xla_in_chunks(name, budget, tmp_path):
    """A training step of an op tiled around its band kernel, compiled by XLA
    (`jit_compile=True`), its sizes known or traced unknown, equals the step run eagerly.
    XLA refused the kernel's rows inside the chunk loop ("Pad must be a compile-time
    constant": a pad and a slice sized by the loop's start), at the default budget too
    at Longformer-like sizes (found by an adversarial trial); the rows are now a slice
    of static length."""
    case = TILED_BANDS[name]
    module = generate(case, tmp_path, prefix="BandXla")
    module.MAX_TEMP_BYTES = budget
    rng = np.random.default_rng(3)
    args = [tf.constant(x) for x in _float_inputs(case, module, rng)]
    assert module._tile_plan(*args, **case.attrs) is not None
    check_graphs_equal_eager(module, args, case.attrs)


@pytest.mark.parametrize("name", ["scores", "clamped", "dilated"])
def test_unknown_sizes_over_an_empty_batch_in_chunks(name, tmp_path):
    """Sizes known only when the graph runs, no batch, a chunk a group: the scatter's loop
    adds nothing (TensorScatterAdd refused indices into its empty rows)."""
    case = CASES[name]
    module = generate(case, tmp_path, prefix="BandEmpty")
    rng = np.random.default_rng(3)
    args = [tf.constant(x[:0]) for x in _float_inputs(case, module, rng)]
    y = module.forward(*args, **case.attrs)
    g = tf.zeros_like(y)
    specs = [tf.TensorSpec([None] * len(x.shape), tf.float64) for x in (*args, g)]
    module.MAX_TEMP_BYTES = 1
    grads = tf.function(lambda *xs: module.vjp(*xs, **case.attrs), input_signature=specs)(*args, g)
    for x, grad in zip(args, grads, strict=True):
        assert grad.shape == x.shape
        np.testing.assert_array_equal(grad.numpy(), np.zeros(x.shape))


@pytest.mark.parametrize("name", ["apply", "dilated_apply"])
def test_jax_jit_vmap_and_grad_of_the_backward(name, tmp_path):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    case = CASES[name]
    module = generate_for(case, "jax", tmp_path, prefix="BandJax")
    module.MAX_TEMP_BYTES = 1
    vjp = functools.partial(module.vjp, **case.attrs)
    rng = np.random.default_rng(2)
    p, v = (jnp.asarray(rng.standard_normal((4, *case.shapes[n]))) for n in module.INPUTS)
    g = jnp.asarray(rng.standard_normal((4, *module.forward(p[0], v[0], **case.attrs).shape)))
    batched = jax.jit(jax.vmap(vjp))(p, v, g)
    for n in range(4):
        one = vjp(p[n], v[n], g[n])
        for got, want in zip(batched, one, strict=True):
            np.testing.assert_allclose(np.asarray(got[n]), np.asarray(want), rtol=1e-12)

    def loss(p, v):  # the backward is linear in g: its gradient is exact by autodiff
        grad_p, grad_v = vjp(p, v, g[0])
        return jnp.sum(grad_p**2) + jnp.sum(grad_v**2)

    ours = jax.grad(loss, argnums=(0, 1))(p[0], v[0])
    direction = [jnp.asarray(rng.standard_normal(x.shape)) for x in (p[0], v[0])]
    step = 1e-6
    plus = loss(p[0] + step * direction[0], v[0] + step * direction[1])
    minus = loss(p[0] - step * direction[0], v[0] - step * direction[1])
    slope = sum(float(jnp.sum(a * b)) for a, b in zip(ours, direction, strict=True))
    assert abs((plus - minus) / (2 * step) - slope) < 1e-5 * max(1.0, abs(slope))


@pytest.mark.parametrize("name", ["scores", "dilated"])
def test_pytorch_compile_fullgraph_of_the_band_kernels(name, tmp_path):
    """torch.compile(fullgraph=True) takes the groups of chunks, forward and backward."""
    torch = pytest.importorskip("torch")
    case = CASES[name]
    module = generate_for(case, "pytorch", tmp_path, prefix="BandCompile")
    rng = np.random.default_rng(3)
    q, k = (torch.tensor(rng.standard_normal(case.shapes[n]), requires_grad=True) for n in "qk")
    g = torch.tensor(rng.standard_normal(module.forward(q, k, **case.attrs).shape))

    def loss(q, k):
        return (module.forward(q, k, **case.attrs) * g).sum()

    default = module.MAX_TEMP_BYTES
    try:
        module.MAX_TEMP_BYTES = 1  # a group per chunk
        value = torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k)
        value.backward()
        expected = module.vjp(q.detach(), k.detach(), g, **case.attrs)
    finally:
        module.MAX_TEMP_BYTES = default
    want = (module.forward(q.detach(), k.detach(), **case.attrs) * g).sum()
    np.testing.assert_allclose(value.item(), want.item(), rtol=1e-12)
    for x, e in zip((q, k), expected, strict=True):
        np.testing.assert_allclose(x.grad.numpy(), e.numpy(), rtol=1e-10, atol=1e-12)


def _step(module, target, arrays, attrs):
    """One training step, loss sum(y) (or the given weights' sum(y * weights)): the
    outputs and the gradients of every input, as numpy, through the target's own
    autodiff."""
    if target == "tensorflow":
        args = [tf.constant(a) for a in arrays]
        with tf.GradientTape() as tape:
            tape.watch(args)
            y = module.forward(*args, **attrs)
            loss = tf.reduce_sum(y)
        return [y.numpy(), *(g.numpy() for g in tape.gradient(loss, args))]
    if target == "pytorch":
        torch = pytest.importorskip("torch")
        args = [torch.tensor(a, requires_grad=True) for a in arrays]
        y = module.forward(*args, **attrs)
        y.sum().backward()
        return [y.detach().numpy(), *(a.grad.numpy() for a in args)]
    jax = pytest.importorskip("jax")

    def loss(*xs):
        return module.forward(*xs, **attrs).sum()

    args = [jax.numpy.asarray(a) for a in arrays]
    grads = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
    return [np.asarray(module.forward(*args, **attrs)), *map(np.asarray, grads)]


# the output's shape with no rows in an input (a clamped start's L is q's or v's rows)
EMPTY_OUTPUT = {
    ("scores", "q"): (2, 3, 0, 7),
    ("scores", "k"): (2, 3, 23, 7),
    ("clamped", "q"): (2, 3, 0, 5),
    ("clamped", "k"): (2, 3, 13, 5),
    ("clamped_apply", "p"): (2, 0, 3),
    ("clamped_apply", "v"): (2, 11, 3),
    ("dilated", "q"): (2, 3, 0, 7),
    ("dilated", "k"): (2, 3, 23, 7),
}


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", ["scores", "clamped", "clamped_apply", "dilated"])
def test_a_training_step_over_no_rows(name, target, tmp_path):
    """No rows in one input, then in the other (query rows or key rows; a clamped start's
    length then 0 or not), in float32 at values of 300: the step's outputs and gradients
    are shaped like their tensors and zero (nothing is read), in every target."""
    case = CASES[name]
    module = generate_for(case, target, tmp_path, prefix="BandEmpty")
    for empty in module.INPUTS:
        shapes = {n: list(case.shapes[n]) for n in module.INPUTS}
        shapes[empty][ROWS[name][empty]] = 0
        arrays = [np.full(shapes[n], 300.0, np.float32) for n in module.INPUTS]
        found = _step(module, target, arrays, case.attrs)
        assert [g.shape for g in found] == [EMPTY_OUTPUT[name, empty], *(a.shape for a in arrays)]
        for got in found:
            np.testing.assert_array_equal(got, np.zeros(got.shape, np.float32))


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", ["scores", "clamped", "clamped_apply", "dilated"])
def test_float32_far_from_the_origin(name, target, tmp_path):
    """Inputs of 100 ± 1 in float32 (products of 10^4 and sums of them; gradients of
    sum(y): sums of a window of values of 100), a group per chunk:
    the step's outputs and gradients agree with the same step in float64 to float32's
    precision, relative to the largest value of each (a band misplaced by one row is off
    by about 1%)."""
    case = CASES[name]
    module = generate_for(case, target, tmp_path, prefix="BandFar")
    module.MAX_TEMP_BYTES = 1
    if target == "jax":
        pytest.importorskip("jax").config.update("jax_enable_x64", True)
    rng = np.random.default_rng(5)
    narrow = _float_inputs(case, module, rng, np.float32, centre=100.0)
    exact = _step(module, target, [x.astype(np.float64) for x in narrow], case.attrs)
    found = _step(module, target, narrow, case.attrs)
    for got, want in zip(found, exact, strict=True):
        assert got.dtype == np.float32 and want.dtype == np.float64
        assert got.shape == want.shape
        scale = np.abs(want).max()
        assert scale > 100
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_a_wide_window_at_a_tiny_budget_keeps_chunks_that_shrink_it(target, tmp_path):
    """A chunk's slab of source rows (about the window's width) does not shrink with the
    chunk's rows, its bands do: at a budget of 1 byte the plan halves c only while the bands
    outweigh the slab (K = 201 keys of 32 columns: a plain window stops at 25 rows, a
    clamped one, its band of 401 counted twice, at 12), not down to one row a chunk (600
    chunks, each adding its slab in 401 parts: a graph of 10^5 ops)."""
    if target != "tensorflow":
        pytest.importorskip("torch" if target == "pytorch" else "jax")
    module = generate_for(CASES["scores"], target, tmp_path, prefix="BandPlan")
    module.MAX_TEMP_BYTES = 1
    rng = np.random.default_rng(6)
    make = {
        "tensorflow": tf.constant,
        "pytorch": lambda x: pytest.importorskip("torch").tensor(x),
        "jax": lambda x: pytest.importorskip("jax.numpy").asarray(x),
    }[target]
    q, k = (make(rng.standard_normal((1, 4, 600, 32)).astype(np.float32)) for _ in "qk")
    for clamped, (band, rows) in {False: (201, 25), True: (401, 12)}.items():
        c, chunks, width, per_chunk = module._band_plan(600, band, q, k, clamped)
        assert (c, chunks) == (rows, -(-600 // rows))
        assert width // c <= 35 and per_chunk <= 400_000


@pytest.mark.parametrize("keys", [(1, 4, 3), (1, 2, 3)])
def test_a_strided_window_tiled_over_a_batch_of_one(keys, tmp_path):
    """A window that stays a gather (q lacks the batch axis the keys have), tiled at 2000
    bytes over keys of batch 1: a chunk's
    sum of q's gradient came back from TensorFlow's loop as [None, 4, 3] against its
    [1, 4, 3] (the loop raised); exact, keys shorter than the window's reach or not."""
    case = Case(
        "y[b,h,i,u] = sum(q[h,i,c] * k[b, i + 3*u - 3, c], c)",
        {"q": (2, 5, 3), "k": keys},
        ranges={"u": "3"},
        sizes={"u": 3},
        fd_directions=3,
    )
    module = generate(case, tmp_path, prefix="StridedOne")
    module.MAX_TEMP_BYTES = 2000
    check(case, module)

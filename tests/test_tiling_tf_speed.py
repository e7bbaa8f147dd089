"""TensorFlow's tiled steps spend their time on the op, not on how a chunk is spelled.

A chunk of one position of a tiled index leaves an einsum summing an axis of one
position (a dilated local attention's `grad_q` sums u, its chunks are of one u). TF's einsum
transposes the larger operand into a batch of 1 x 1 matrix products for it, 6x slower
than the product it is; the module's `_einsum` computes that product instead. These
tests pin the structure (which ops the traced step runs) and the values, not a time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from harness import Case, FakeOp, check, generate, load_module, make_tensors

REPO = Path(__file__).resolve().parent.parent

# Longformer's sliding-window scores with its per-head dilation D[h], each index its own
# size (a dilation shared by the heads, an int, is a band: chunked matrix products, no
# gather and no tiling, tests/test_bands.py; a tensor's stays a gather).
LOCAL_ATTENTION = Case(
    "y[b,h,i,u] = sum(q[b,i,h,d] * k[b, i + D[h]*(u - w), h, d], d)",
    {"q": (2, 7, 3, 5), "k": (2, 7, 3, 5)},
    attrs={"w": 2},
    ranges={"u": "2*w + 1"},
    sizes={"u": 5},
    inputs=("q", "k", "D"),
    index_inputs={"D": ((3,), 1, 3)},
    fd_directions=2,
)


@pytest.fixture(scope="module")
def local_attention(tmp_path_factory):
    return generate(LOCAL_ATTENTION, tmp_path_factory.mktemp("speed"), "Speed")


def _einsum_equations(function) -> set[str]:
    """The equations of every Einsum op a traced function runs, loop bodies included."""
    graph = function.graph.as_graph_def()
    nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    return {n.attr["equation"].s.decode() for n in nodes if n.op == "Einsum"}


def test_a_chunk_of_one_position_sums_by_a_product_not_a_matrix_product(local_attention):
    module = local_attention
    module.MAX_TEMP_BYTES = 512  # chunks of one position of u
    tensors = make_tensors(LOCAL_ATTENTION, module.INPUTS)
    plan = module._tile_plan(*tensors, w=2)
    assert plan is not None and plan[1] == 1  # one u a chunk
    grad_y = tf.ones_like(module.forward(*tensors, w=2))
    traced = module._tiled_backward.get_concrete_function(*tensors, grad_y, *plan, w=2)
    # The forward's einsum sums d (5 positions): a contraction; grad_q's sums u (one).
    assert _einsum_equations(traced) == {"bihud,bihd->bhiu"}  # the window gathered per head


def test_chunks_of_one_position_are_exact(local_attention):
    local_attention.MAX_TEMP_BYTES = 512
    check(LOCAL_ATTENTION, local_attention)


SUBSCRIPTS = [
    # (subscripts, shape of a, shape of b): every summed axis of one position
    ("biuhd,bhiu->bihd", (2, 7, 1, 3, 5), (2, 3, 7, 1)),  # b's axes within a's
    ("bju,biu->bij", (2, 4, 1), (2, 6, 1)),  # an outer product: neither within the other
    ("buv,bvu->b", (3, 1, 1), (3, 1, 1)),  # two summed axes
    ("ub,ui->ib", (1, 4), (1, 6)),  # output in neither operand's order
]


@pytest.mark.parametrize("subscripts, left, right", SUBSCRIPTS)
def test_einsum_helper_equals_tf_einsum(local_attention, subscripts, left, right):
    rng = np.random.default_rng(3)
    a = tf.constant(rng.standard_normal(left))
    b = tf.constant(rng.standard_normal(right))
    want = tf.einsum(subscripts, a, b)
    got = local_attention._einsum(subscripts, a, b)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=0)


def test_einsum_helper_contracts_longer_and_unknown_axes(local_attention):
    rng = np.random.default_rng(4)
    a = tf.constant(rng.standard_normal((2, 7, 4, 3, 5)))
    b = tf.constant(rng.standard_normal((2, 3, 7, 4)))
    want = tf.einsum("biuhd,bhiu->bihd", a, b)
    np.testing.assert_allclose(
        local_attention._einsum("biuhd,bhiu->bihd", a, b).numpy(), want.numpy(), rtol=1e-12
    )
    spec = tf.TensorSpec([None] * 5, tf.float64), tf.TensorSpec([None] * 4, tf.float64)
    unknown = tf.function(lambda x, y: local_attention._einsum("biuhd,bhiu->bihd", x, y))
    traced = unknown.get_concrete_function(*spec)
    assert _einsum_equations(traced) == {"biuhd,bhiu->bihd"}  # u may be long: a contraction
    a1, b1 = a[:, :, :1], b[..., :1]
    np.testing.assert_allclose(
        traced(a1, b1).numpy(), tf.einsum("biuhd,bhiu->bihd", a1, b1).numpy(), rtol=1e-12
    )


# A log-sum-exp over two clouds (`tile_logsumexp`): tiled along n, combined by logaddexp.
LOG_SUM_EXP = Case(
    "y[b] = log(sum(exp(-sum((x[b,n,c] - z[b,m,c])**2, c)), n, m))",
    {"x": (2, 9, 3), "z": (2, 7, 3)},
    low=-0.8,
    high=0.8,
)


def _tape_gradients(module, xs, order):
    """The gradient of sum(sin(y)) (order 1, one tape), or of the squared norm of that
    gradient (order 2: a gradient of the gradient, under a second tape), as arrays."""

    def first():
        with tf.GradientTape() as tape:
            tape.watch(xs)
            loss = tf.reduce_sum(tf.sin(module.forward(*xs)))
        return tape.gradient(loss, xs)

    if order == 1:
        return [g.numpy() for g in first()]
    with tf.GradientTape() as outer:
        outer.watch(xs)
        total = tf.add_n([tf.reduce_sum(g**2) for g in first()])
    return [g.numpy() for g in outer.gradient(total, xs)]


def test_a_tiled_log_sum_exp_gradient_reads_its_totals_from_the_outputs(tmp_path):
    """The chunks' shares exp(L_k - L) need the whole L: the forward's outputs (a training
    step) and the op's (the registered gradient) are L, so the backward runs no forward
    pass of its own over the chunks; under a second tape it does, so that L's dependence
    on the inputs is recorded. Every path equals the untiled module."""
    module = generate(LOG_SUM_EXP, tmp_path, "Totals")
    xs = make_tensors(LOG_SUM_EXP, module.INPUTS)
    grad_y = tf.constant([0.7, -1.3], tf.float64)
    module.MAX_TEMP_BYTES = 2**40
    want = [_tape_gradients(module, xs, order) for order in (1, 2)]
    want_vjp = [g.numpy() for g in module.vjp(*xs, grad_y)]
    module.MAX_TEMP_BYTES = 2000  # chunks of 2 positions of n
    assert module._tile_plan(*xs)[1] < 9
    calls = []
    passes = module._tiled_compute
    module._tiled_compute = lambda *a, **k: calls.append(1) or passes(*a, **k)

    got = _tape_gradients(module, xs, 1)
    assert len(calls) == 1, calls  # the forward's pass only
    for g, w in zip(got, want[0], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)

    y = module.forward(*xs)
    del calls[:]
    fake = FakeOp(xs, [y], {}, module)
    got = [g.numpy() for g in module.gradient(fake, grad_y)]
    assert not calls, calls
    for g, w in zip(got, want_vjp, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)

    got = _tape_gradients(module, xs, 2)
    assert len(calls) > 1, calls  # the gradient of the gradient computes L again
    for g, w in zip(got, want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def _ms_deform_attn_inputs(queries: int):
    """Multi-scale deformable attention (symgrad.toml's MsDeformAttn): value 2 x 3024 x 4
    x 16 over levels 48x48, 24x24, 12x12, `queries` queries, 5 points."""
    rng = np.random.default_rng(5)
    levels = [(48, 48), (24, 24), (12, 12)]
    value = rng.standard_normal((2, sum(h * w for h, w in levels), 4, 16))
    loc = rng.uniform(-0.05, 1.05, (2, queries, 4, 3, 5, 2))
    attn = rng.uniform(0, 1, (2, queries, 4, 3, 5))
    return [
        tf.constant(value, tf.float32),
        tf.constant(levels, tf.float32),
        tf.constant([0, 2304, 2880], tf.int64),
        tf.constant(loc, tf.float32),
        tf.constant(attn, tf.float32),
    ]


def test_whole_positions_within_the_bound_run_as_many_a_chunk_as_it_allows(tmp_path):
    """MsDeformAttn at 256 KiB: one query exceeds the budget but is within the step's
    allowance, so the plan keeps whole positions of m; it now takes as many queries a
    chunk as the allowance holds (5 of 300: 60 chunks; 18, as an allowance of 3 x the
    inputs and outputs took, held 1.03-1.18x the bound) where it took one (300 chunks,
    each costing about what a small chunk does: the step was 1.6x the untiled one), with
    the same plan under unknown sizes."""
    text = (REPO / "generated" / "ms_deform_attn.py").read_text(encoding="utf-8")
    module = load_module(text, tmp_path, "symgrad_speed_ms_deform_attn")
    module.MAX_TEMP_BYTES = 2**18
    tensors = _ms_deform_attn_inputs(300)
    n, c, n2, c2 = module._tile_plan(*tensors)
    assert (n, n2, c2) == (300, 4, 4)  # whole positions of m
    assert 1 < c < n
    unknown = [tf.TensorSpec([None] * t.shape.rank, t.dtype) for t in tensors]
    traced = tf.function(module._tile_plan).get_concrete_function(*unknown)
    assert [int(v) for v in traced(*tensors)] == [n, c, n2, c2]

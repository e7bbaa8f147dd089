"""A softmax over segments of gathered rows (GAT's aggregation) is segment sums, not a
dense mask over every (edge, node) pair.

    y[v,h,f] = sum(where(dst[n] == v, exp(s[n,h]) * x[src[n],h,f], 0), n)
               / sum(where(dst[n] == v, exp(s[n,h]), 0), n)

The masked exponential's stable form, `exp(where(dst[n] == v, s[n,h], -inf) - L[h,v])`
with L the segment log-sum-exp, was lowered as a dense softmax over [h,v,n]: E x V x H,
10^4 times the inputs at a small graph's size, in the forward and the gradient alike. It is
`where(dst[n] == v, exp(s[n,h] - L[h, dst[n]]), 0)` (`segment_forms.eq_form`): a segment
sum reading L at each edge's row, and the planner sees the gathered rows [n,h,f] as the
only large temporary. At a node with no incoming edge the formula is 0 / 0; the segment
sums give 0 there, as GAT's kernels do (`test_a_node_without_edges_gets_zero`).
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from adversarial import chunks_equal_the_untiled_module, torch_step_peaks
from frameworks import FRAMEWORKS
from harness import Case, check, generate
from peaks import jax_step_peaks, tf_module_step_peaks

FORMULA = (
    "y[v,h,f] = sum(where(dst[n] == v, exp(s[n,h]) * x[src[n],h,f], 0), n)"
    " / sum(where(dst[n] == v, exp(s[n,h]), 0), n)"
)
# The same softmax with -inf inside the exponential, as PyG and DGL's docs write a masked
# softmax: the masked logits must not become a dense [n,h,v] level of their own
# (`segment_forms.is_segment_mask`).
INF_INSIDE = (
    "y[v,h,f] = sum(exp(where(dst[n] == v, s[n,h], -inf)) * x[src[n],h,f], n)"
    " / sum(exp(where(dst[n] != v, -inf, s[n,h])), n)"
)
SPELLINGS = [FORMULA, INF_INSIDE]
BUDGET = 2**18
# s [E, H] edge logits, x [V, H, F] node features, src and dst [E]
E, V, H, F = 40000, 3000, 4, 16


def _case(e, v, h, f, low=-1.0, high=1.0, formula=FORMULA) -> Case:
    return Case(
        formula,
        {"s": (e, h), "x": (v, h, f)},
        ranges={"v": "x.shape[0]"},
        sizes={"v": v},
        index_inputs={"src": ((e,), 0, v), "dst": ((e,), 0, v)},
        inputs=("s", "x", "src", "dst"),
        low=low,
        high=high,
    )


# 40 edges into 5 nodes (seeded: every node has one), 3 heads, 2 features
SMALL = _case(40, 5, 3, 2)


@pytest.mark.parametrize("formula", SPELLINGS)
def test_no_dense_edge_by_node_tensor_is_planned(formula, tmp_path):
    module = generate(_case(40, 5, 3, 2, formula=formula), tmp_path, prefix="GatPlan")
    doc = module.__doc__
    assert "temporaries over [n,h,f] outgrow" in doc, doc


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_segment_softmax_in_chunks_equals_the_untiled_module(target, tmp_path):
    if target == "tensorflow":
        check(SMALL, generate(SMALL, tmp_path, prefix="GatExact"))
    chunks_equal_the_untiled_module(SMALL, target, tmp_path, "Gat")


def test_logits_in_the_hundreds_in_float32(tmp_path):
    """Logits about 300 (exp overflows float32 past 88): the segment log-sum-exp keeps
    the weights finite; float32 against float64 on the same (float32) values, within
    float32's rounding of a logit near 300 (3e-5 relative to a weight)."""
    case = _case(40, 5, 3, 2, low=290.0, high=310.0)
    module = generate(case, tmp_path, prefix="GatLarge")
    rng = np.random.default_rng(2)
    # float32 values, so that float64 sees the same inputs
    s = rng.uniform(290, 310, (40, 3)).astype(np.float32).astype(np.float64)
    x = rng.standard_normal((5, 3, 2)).astype(np.float32).astype(np.float64)
    src, dst = rng.integers(0, 5, 40), np.arange(40) % 5
    want = module.forward(tf.constant(s), tf.constant(x), tf.constant(src), tf.constant(dst))
    got = module.forward(
        tf.constant(s, tf.float32), tf.constant(x, tf.float32), tf.constant(src), tf.constant(dst)
    )
    assert np.all(np.isfinite(got.numpy()))
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("formula", SPELLINGS)
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_a_node_without_edges_gets_zero(target, formula, tmp_path):
    """Node 3 has no incoming edge: its output is 0 (the written ratio is 0 / 0), and
    the others and every gradient are those of the graph without it, whether the mask
    is written around the exponential or -inf inside it."""
    fw = FRAMEWORKS[target]
    if target == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
    module = generate(
        _case(40, 5, 3, 2, formula=formula), tmp_path, prefix="GatEmpty", target=target
    )
    rng = np.random.default_rng(4)
    s, x = rng.standard_normal((6, 2)), rng.standard_normal((5, 2, 3))
    src, dst = np.array([0, 1, 2, 3, 4, 0]), np.array([0, 1, 2, 4, 4, 1])
    args = [fw.tensor(a) for a in (s, x, src, dst)]
    y = fw.numpy(module.forward(*args))
    np.testing.assert_array_equal(y[3], 0.0)
    weights = np.exp(s) / np.array([np.exp(s[dst == d]).sum(0) for d in dst])
    want = np.zeros((5, 2, 3))
    np.add.at(want, dst, weights[:, :, None] * x[src])
    np.testing.assert_allclose(y, want, rtol=1e-12)
    grads = module.vjp(*args, fw.tensor(np.ones((5, 2, 3))))
    assert all(np.all(np.isfinite(fw.numpy(g))) for g in grads[:2])


def _arrays():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((E, H)).astype(np.float32)
    x = rng.standard_normal((V, H, F)).astype(np.float32)
    src = rng.integers(0, V, E).astype(np.int32)
    dst = rng.integers(0, V, E).astype(np.int32)
    return s, x, src, dst


def _check(target, untiled, tiled, bound):
    print(f"GAT {target}: untiled {untiled / bound:.2f}x, tiled {tiled / bound:.2f}x")
    assert untiled > 2 * bound, f"{target}: the size does not test the bound"
    assert tiled <= bound, f"{target}: a tiled step peaks at {tiled} > {bound}"


def _module(target, folder):
    return generate(_case(E, V, H, F), folder, prefix="GatMemory", target=target)


def test_tensorflow_training_step_of_a_segment_softmax_is_bounded(tmp_path):
    module = _module("tensorflow", tmp_path)
    arrays = "test_memory_segment_softmax._arrays"
    found = tf_module_step_peaks(module, arrays, BUDGET, watched=(0, 1))
    _check("tensorflow", found["untiled"], found["tiled"], 4 * found["io"] + BUDGET)


def test_pytorch_training_step_of_a_segment_softmax_is_bounded(tmp_path):
    torch = pytest.importorskip("torch")
    module = _module("pytorch", tmp_path)
    s, x, src, dst = _arrays()
    xs = [
        torch.tensor(s, requires_grad=True),
        torch.tensor(x, requires_grad=True),
        torch.tensor(src),
        torch.tensor(dst),
    ]
    untiled, tiled, bound = torch_step_peaks(module, xs, {}, BUDGET)
    _check("pytorch", untiled, tiled, bound)


def test_jax_training_step_of_a_segment_softmax_is_bounded(tmp_path):
    jax = pytest.importorskip("jax")
    module = _module("jax", tmp_path)
    args = [jax.numpy.asarray(a) for a in _arrays()]
    _check("jax", *jax_step_peaks(module, args, BUDGET, wrt=(0, 1)))


MASKED_LSE = "log(sum(exp(where(dst[n] != v, -inf, s[n,h])), n))"


@pytest.mark.parametrize("formula", [f"y[v,h] = {MASKED_LSE} * w[v,h]", f"y[v,h] = {MASKED_LSE}"])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_masked_logits_of_their_own_weigh_an_empty_node_nothing(target, formula, tmp_path):
    """`exp(where(dst[n] != v, -inf, s[n,h]))` made the masked logits a dense [n,h,v]
    level of their own: the softmax that is the log-sum-exp's gradient was not known to
    be masked, and a node with no edges (all -inf: 0 / 0) sent nan to every edge once
    chunks of v read its rows through a dense mask. The mask now stays inside the
    exponential (`segment_forms.is_segment_mask`): a segment log-sum-exp, nothing to cut
    into chunks, and every edge's gradient its softmax weight at its own node. The
    log-sum-exp as the output itself, over its axes in another order (`y[v,h]` of
    `L[h,v]`), is known as one: its gradient was `exp(s - y)`."""
    fw = FRAMEWORKS[target]
    if target == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
    weighted = "w[" in formula
    attrs = {} if weighted else {"V": 4}
    case = Case(
        formula,
        {"s": (12, 2), "w": (4, 2)} if weighted else {"s": (12, 2)},
        attrs=attrs,
        attr_types={"V": "int"} if attrs else {},
        ranges={"v": "w.shape[0]" if weighted else "V"},
        sizes={"v": 4},
        index_inputs={"dst": ((12,), 0, 4)},
        inputs=("s", "w", "dst") if weighted else ("s", "dst"),
    )
    module = generate(case, tmp_path, prefix="MaskedLse", target=target)
    assert not hasattr(module, "_tile_plan"), "a segment log-sum-exp holds no dense mask"
    rng = np.random.default_rng(5)
    s, w = rng.standard_normal((12, 2)), rng.standard_normal((4, 2))
    dst = np.array([0, 2, 3] * 4)  # node 1 has no edge
    named = {"s": s, "w": w, "dst": dst}
    args = [fw.tensor(named[n]) for n in module.INPUTS]
    g = rng.standard_normal((4, 2))
    with np.errstate(divide="ignore"):
        lse = np.log(np.array([np.exp(s[dst == v]).sum(0) for v in range(4)]))
    factor = g * w if weighted else g
    want = [factor[dst] * np.exp(s - lse[dst])] + ([lse * g] if weighted else [])
    got = [fw.numpy(x) for x in module.vjp(*args, fw.tensor(g), **attrs) if x is not None]
    assert np.all(np.isfinite(got[0]))  # grad_w at node 1 is its log-sum-exp, -inf
    for x, wanted in zip(got, want, strict=True):
        np.testing.assert_allclose(x, wanted, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_masked_logits_of_their_own_weigh_an_empty_row_nothing_in_chunks(target, tmp_path):
    """The same guard where the mask is not a segment's and the masked logits stay a
    level of their own: a strictly causal log-sum-exp, whose first row has no term (all
    -inf: 0 / 0). Untiled and in chunks of rows, every gradient is finite and equal."""
    fw = FRAMEWORKS[target]
    if target == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
    case = Case(
        "y[i,h] = log(sum(exp(where(j >= i, -inf, s[j,h])), j)) * w[i,h]",
        {"s": (7, 3), "w": (7, 3)},
    )
    module = generate(case, tmp_path, prefix="CausalLse", target=target)
    rng = np.random.default_rng(6)
    s, w, g = (rng.standard_normal((7, 3)) for _ in range(3))
    args = [fw.tensor(s), fw.tensor(w)]
    with np.errstate(divide="ignore"):
        lse = np.log(np.stack([np.exp(s[:i]).sum(0) for i in range(7)]))
    weights = np.array(
        [[np.exp(s[j] - lse[i]) if j < i else 0 * s[j] for j in range(7)] for i in range(7)]
    )
    want = [np.einsum("ih,ijh->jh", g * w, weights), lse * g]
    module.MAX_TEMP_BYTES = 2**40
    untiled = [fw.numpy(x) for x in module.vjp(*args, fw.tensor(g))]
    module.MAX_TEMP_BYTES = 1
    assert module._tile_plan(*args) is not None
    tiled = [fw.numpy(x) for x in module.vjp(*args, fw.tensor(g))]
    assert np.all(np.isfinite(tiled[0])) and np.all(np.isfinite(untiled[0]))
    for got in (untiled, tiled):
        for x, wanted in zip(got, want, strict=True):
            np.testing.assert_allclose(x, wanted, rtol=1e-12, atol=1e-12)


def _reachable(function) -> set[str]:
    """The nodes of a FunctionDef that its results and control results depend on: what
    a call of it runs (TensorFlow prunes the rest of a function's body)."""
    inputs = {n.name: [i.lstrip("^").split(":")[0] for i in n.input] for n in function.node_def}
    stack = [r.split(":")[0] for r in (*function.ret.values(), *function.control_ret.values())]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen or name not in inputs:
            continue
        seen.add(name)
        stack.extend(inputs[name])
    return seen


def test_tensorflow_chunks_of_the_gradient_compute_no_output(tmp_path, monkeypatch):
    """A chunk's gradient that reads none of the chunk's outputs waits for its
    intermediates alone (`_after`), so its loop never computes the outputs: here the
    segment sum of every edge's gathered row, once per chunk of the backward (GAT's step
    in chunks of its features took 3.1x its untiled time, 2.8x without that sum). The
    chunk's outputs are marked, and no result of the backward's loop body reaches them."""
    module = generate(SMALL, tmp_path, prefix="GatPruned")
    compute = module._compute

    def marked(*args, **kwargs):
        outputs, saved = compute(*args, **kwargs)
        return tuple(tf.identity(o, name="chunk_output") for o in outputs), saved

    monkeypatch.setattr(module, "_compute", marked)
    rng = np.random.default_rng(3)
    s, x = rng.standard_normal((40, 3)), rng.standard_normal((5, 3, 2))
    src, dst = rng.integers(0, 5, 40), np.arange(40) % 5
    args = [tf.constant(a) for a in (s, x, src, dst)]
    module.MAX_TEMP_BYTES = 1
    plan = module._tile_plan(*args)
    grad_y = tf.ones((5, 3, 2), tf.float64)
    traced = module._tiled_backward.get_concrete_function(*args, grad_y, *plan)
    bodies = [f for f in traced.graph.as_graph_def().library.function if f.node_def]
    marks = [(f, n.name) for f in bodies for n in f.node_def if "chunk_output" in n.name]
    assert marks, "the chunk's outputs were not traced into the loop"
    for function, name in marks:
        assert name not in _reachable(function), f"{function.signature.name} computes {name}"
    got = module.vjp(*args, grad_y)
    module.MAX_TEMP_BYTES = 2**40
    for g, want in zip(got[:2], module.vjp(*args, grad_y)[:2], strict=True):
        np.testing.assert_allclose(tf.convert_to_tensor(g), tf.convert_to_tensor(want), rtol=1e-12)


def _ops_in_loops(traced) -> set[str]:
    """The op types inside the loop bodies of a traced TensorFlow function."""
    library = traced.graph.as_graph_def().library.function
    return {n.op for f in library if "body" in f.signature.name for n in f.node_def}


@pytest.mark.parametrize("loop", ["_tiled_compute", "_tiled_backward"])
def test_tensorflow_chunks_of_the_features_share_one_segment_log_sum_exp(
    loop, tmp_path, monkeypatch
):
    """Cut along the features, with the heads its inner level, every chunk computed the
    segment log-sum-exp over the heads again: it reads s, which only the inner level cuts.
    Where the plan gives the inner level one chunk, the loop computes it once
    (`_compute_outer_once`, `tile_hoist.WHOLE`): no segment max runs in the loop, and every
    output and gradient is bit for bit that of chunks that compute it themselves."""
    module = generate(_case(40, 5, 3, 6), tmp_path, prefix="GatWhole")
    rng = np.random.default_rng(8)
    s, x = rng.standard_normal((40, 3)), rng.standard_normal((5, 3, 6))
    src, dst = rng.integers(0, 5, 40), np.arange(40) % 5
    args = [tf.constant(a) for a in (s, x, src, dst)]
    # a budget that holds the shared values (an eighth of it, `_kept_once`): 3 chunks
    module.MAX_TEMP_BYTES = 16384
    n, c, n2, c2 = plan = module._tile_plan(*args)
    assert c < n and c2 >= n2, plan  # chunks of f, one chunk of h
    grad_y = tf.constant(rng.standard_normal((5, 3, 6)))
    extra = (grad_y,) if loop == "_tiled_backward" else ()
    traced = getattr(module, loop).get_concrete_function(*args, *extra, *plan)
    assert "UnsortedSegmentMax" not in _ops_in_loops(traced)
    assert "UnsortedSegmentSum" in _ops_in_loops(traced)  # the chunk's own sums

    def step():
        return [tf.convert_to_tensor(g).numpy() for g in (module.forward(*args),)] + [
            tf.convert_to_tensor(g).numpy() for g in module.vjp(*args, grad_y)[:2]
        ]

    shared = step()
    monkeypatch.setattr(module, "_one_chunk", lambda n, c: False)
    alone = step()
    module.MAX_TEMP_BYTES = 2**40
    whole = step()
    for got, fallback, want in zip(shared, alone, whole, strict=True):
        np.testing.assert_array_equal(got, fallback)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


NODE_LOGITS = (
    "y[v,h] = sum(where(dst[n] == v, exp(a[src[n],h] * b[v,h]) * w[n,h], 0), n)"
    " / sum(where(dst[n] == v, exp(a[src[n],h] * b[v,h]), 0), n)"
)


@pytest.mark.parametrize("budget", [2**40, 1], ids=["whole", "chunks"])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_logits_of_a_node_and_an_edge_weigh_an_empty_node_nothing(target, budget, tmp_path):
    """Logits that read the node (`a[src[n],h] * b[v,h]`) are no segment's: the softmax
    stays dense, and its gradient reads `a[src[n]]` as n and as n', two names the fused,
    guarded softmax did not match. At a node with no edge its log-sum-exp is -inf, and
    the bare `exp(u - L)` was exp(nan): every entry of grad_a was nan. It weighs that row
    nothing now (`Pointwise.masked_weights`); the gradients, whole and in chunks, equal
    central differences of the forward in one piece, which is 0 at the empty node. The
    forward in chunks is dense (its shifted ids are no segment's) and was nan there; it
    weighs the row nothing too (`Pointwise.segment_masked`) and equals the op's."""
    fw = FRAMEWORKS[target]
    if target == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
    case = Case(
        NODE_LOGITS,
        {"a": (4, 2), "b": (5, 2), "w": (6, 2)},
        ranges={"v": "b.shape[0]"},
        sizes={"v": 5},
        index_inputs={"src": ((6,), 0, 4), "dst": ((6,), 0, 5)},
        inputs=("a", "b", "w", "src", "dst"),
    )
    module = generate(case, tmp_path, prefix="NodeLogits", target=target)
    rng = np.random.default_rng(11)
    a, b, w, g = (rng.standard_normal(s) for s in ((4, 2), (5, 2), (6, 2), (5, 2)))
    src, dst = np.array([0, 1, 2, 3, 1, 2]), np.array([1, 0, 0, 2, 2, 4])  # node 3: none

    def loss(a, b, w):  # the forward in one piece
        module.MAX_TEMP_BYTES = 2**40
        y = fw.numpy(module.forward(*(fw.tensor(t) for t in (a, b, w, src, dst))))
        return float(np.sum(y * g))

    whole = fw.numpy(module.forward(*(fw.tensor(t) for t in (a, b, w, src, dst))))
    np.testing.assert_array_equal(whole[3], 0.0)
    module.MAX_TEMP_BYTES = budget
    # in chunks too (its dense forward was exp(-inf + inf) = nan at node 3)
    y = fw.numpy(module.forward(*(fw.tensor(t) for t in (a, b, w, src, dst))))
    np.testing.assert_allclose(y, whole, rtol=1e-12, atol=0)
    got = module.vjp(*(fw.tensor(t) for t in (a, b, w, src, dst)), fw.tensor(g))
    values = [a, b, w]
    for k, grad in enumerate(got[:3]):
        want = np.zeros_like(values[k])
        for at in np.ndindex(values[k].shape):
            up, down = ([v.copy() for v in values] for _ in range(2))
            up[k][at] += 1e-6
            down[k][at] -= 1e-6
            want[at] = (loss(*up) - loss(*down)) / 2e-6
        np.testing.assert_allclose(fw.numpy(grad), want, rtol=1e-6, atol=1e-8)

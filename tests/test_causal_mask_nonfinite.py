"""A causal mask over values that are inf or nan: exact, whole and in chunks.

`where(j <= i, exp(s[b,i,j]) * v[b,j,e], 0)` summed over j is computed as the contraction
`softmax(where(j <= i, s, -inf)) @ v` (stable at logits in the hundreds, and no [b,i,j,e]
product). A masked position multiplies 0 by v[b,j,e]: where that value is inf or nan, the
output (and the gradients) were nan at every query, where the formula's masked branch
gives 0. Now one reduction checks the values are all finite; when not, the exact sum runs
(`symgrad/masked_values.py`), and the backward sets the masked positions' gradient to 0.
The reference is TF autodiff (float64) of the "double where" form, the values masked too,
written out at the [b,i,j,e] size.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from harness import Case, FakeOp, generate

jax.config.update("jax_enable_x64", True)  # float64, as the reference

ARRAY = {"tensorflow": tf.constant, "pytorch": torch.tensor, "jax": jnp.asarray}
SHAPES = {"q": (2, 8, 4), "k": (2, 9, 4), "v": (2, 9, 3)}
CAUSAL = Case(
    "y[b,i,e] = sum(where(j <= i, exp(sum(q[b,i,d] * k[b,j,d], d)) * v[b,j,e], 0), j)"
    " / sum(where(j <= i, exp(sum(q[b,i,d] * k[b,j,d], d)), 0), j)",
    SHAPES,
)
FIRST_BAD = 5  # the first key whose value is not finite: queries i < 5 never read it


def _numpy(t):
    return None if t is None else np.asarray(t.numpy() if hasattr(t, "numpy") else t)


def _double_where(q, k, v):
    """The formula with the values masked too, in TF: masked terms are exactly 0."""
    keep = tf.range(SHAPES["k"][1])[None, :] <= tf.range(SHAPES["q"][1])[:, None]  # [i,j]
    e = tf.exp(tf.einsum("bid,bjd->bij", q, k))
    wide = tf.broadcast_to(keep[None, :, :, None], (2, 8, 9, 3))
    values = tf.where(wide, tf.broadcast_to(v[:, None], wide.shape), tf.zeros_like(wide, v.dtype))
    terms = tf.where(wide, e[..., None] * values, tf.zeros_like(values))
    total = tf.reduce_sum(tf.where(keep[None], e, tf.zeros_like(e)), axis=2)
    return tf.reduce_sum(terms, axis=2) / total[..., None]


def _reference(q, k, v, cotangent):
    q, k, v = (tf.constant(a) for a in (q, k, v))
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        y = _double_where(q, k, v)
    grads = tape.gradient(y, [q, k, v], output_gradients=tf.constant(cotangent))
    return [y.numpy(), *(g.numpy() for g in grads)]


def _inputs(seed=5):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal(SHAPES[n]) * 6 for n in "qk")
    assert np.abs(np.einsum("bid,bjd->bij", q, k)).max() > 100  # logits in the hundreds
    v = rng.standard_normal(SHAPES["v"])
    bad, clean = v.copy(), v.copy()
    bad[0, FIRST_BAD, 1], bad[1, 7, 2] = np.inf, np.nan
    bad[0, 8, 0] = -np.inf
    clean[0, FIRST_BAD, 1] = clean[1, 7, 2] = clean[0, 8, 0] = 0.0
    return q, k, bad, clean, rng.standard_normal((2, 8, 3))


def _same(got, want, what):
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"nan at {what}")
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=what)


def _run(module, target, q, k, v, cotangent):
    arrays = [ARRAY[target](a) for a in (q, k, v)]
    results = [module.forward(*arrays), *module.vjp(*arrays, ARRAY[target](cotangent))]
    if target == "tensorflow":  # the registered gradient, from the op's outputs
        fake = FakeOp(arrays, [results[0]], {}, module)
        results += module.gradient(fake, tf.constant(cotangent))
    return [_numpy(t) for t in results]


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_causal_attention_ignores_inf_and_nan_values_under_the_mask(target, tmp_path):
    """Logits in the hundreds; v[0,5,1] = inf, v[0,8,0] = -inf and v[1,7,2] = nan: the
    outputs and the gradients of q, k and v are the double-where reference's (the same nan
    positions, the same values and infs), whole and in chunks; the queries before the
    first bad key give exactly the outputs and grad_q rows they give with zeros there."""
    module = generate(CAUSAL, tmp_path, prefix="CausalNonFinite", target=target)
    q, k, bad, clean, cotangent = _inputs()
    expected = _reference(q, k, bad, cotangent)
    assert np.isnan(expected[0]).any() and np.isinf(expected[0]).any()
    assert np.isfinite(expected[0][:, :FIRST_BAD]).all()
    for budget in (2**40, 1):
        module.MAX_TEMP_BYTES = budget
        got, want = (_run(module, target, q, k, values, cotangent) for values in (bad, clean))
        for position, name in zip(range(len(got)), ("y", *"qkv", *"qkv"), strict=False):
            if position < 4:
                _same(got[position], expected[position], f"{name} (vjp), budget {budget}")
            else:  # the registered gradient
                _same(got[position], expected[position - 3], f"gradient {name}, {budget}")
        np.testing.assert_array_equal(got[0][:, :FIRST_BAD], want[0][:, :FIRST_BAD])
        np.testing.assert_array_equal(got[1][:, :FIRST_BAD], want[1][:, :FIRST_BAD])


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_finite_values_whose_sum_overflows_take_the_exact_branch_and_equal_the_reference(
    target, tmp_path
):
    """The check is whether the values' sum is finite (one pass, no tensor of bools): two
    values of 1e308 make it inf though every value is finite, so the exact branch runs; it
    gives the double-where reference's outputs and gradients, whole and in chunks."""
    module = generate(CAUSAL, tmp_path, prefix="CausalBigValues", target=target)
    q, k, _, clean, cotangent = _inputs()
    # logits near 0 and a small cotangent: no product of 1e308 overflows, either way
    q, cotangent = q / 600, cotangent / 100
    big = clean.copy()
    big[0, 2, 0] = big[1, 3, 1] = 1e308
    with np.errstate(over="ignore"):
        assert np.isfinite(big).all() and not np.isfinite(big.sum())
    expected = _reference(q, k, big, cotangent)
    assert np.isfinite(expected[0]).all()
    for budget in (2**40, 1):
        module.MAX_TEMP_BYTES = budget
        got = _run(module, target, q, k, big, cotangent)
        for position, name in zip(range(4), ("y", *"qkv"), strict=True):
            _same(got[position], expected[position], f"{name}, budget {budget}")


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_an_inf_in_the_incoming_gradient_alone_takes_the_exact_backward(target, tmp_path):
    """Finite values, an inf in the incoming gradient at query 6: the forward takes the
    plain contraction (TF: the loop whose chunks build no branch), the backward the exact
    one, in chunks as whole. Keys 7 and 8 are masked for query 6: their gradient is
    finite (the plain branch gives 0 * inf there, nan); in chunks every result equals
    the untiled module's, nan and inf at the same places."""
    module = generate(CAUSAL, tmp_path, prefix="CausalBadGrad", target=target)
    q, k, _, clean, cotangent = _inputs()
    cotangent[0, 6, 1] = np.inf
    results = {}
    for budget in (2**40, 1):
        module.MAX_TEMP_BYTES = budget
        results[budget] = got = _run(module, target, q, k, clean, cotangent)
        assert np.isfinite(got[0]).all() and not np.isfinite(got[3]).all()
        for position in (2, 5) if len(got) > 4 else (2,):  # grad_k: vjp, registered
            assert np.isfinite(got[position][0, 7:]).all(), (position, budget)
    for position, (whole, chunks) in enumerate(zip(*results.values(), strict=True)):
        _same(chunks, whole, f"result {position} in chunks")


def test_tf_chunk_loop_over_finite_values_builds_no_branch_per_chunk(tmp_path):
    """A tiled TF module checks the values once for all its chunks (`finite_once`): the
    forward's and the backward's graphs each hold two chunk loops under one tf.cond, the
    plain one with no If in its body (a tf.cond in every chunk cost the training step
    23-40%), the exact one with the per-chunk branches."""
    module = generate(CAUSAL, tmp_path, prefix="CausalLoops", target="tensorflow")
    q, k, _, clean, cotangent = _inputs()
    arrays = [tf.constant(a) for a in (q, k, clean)]
    plan = (8, 3)  # chunks of 3 queries
    graphs = {
        "forward": module._tiled_compute.get_concrete_function(*arrays, *plan).graph,
        "backward": module._tiled_backward.get_concrete_function(
            *arrays, tf.constant(cotangent), *plan
        ).graph,
    }
    for kind, graph in graphs.items():
        library = {f.signature.name: f for f in graph.as_graph_def().library.function}
        top = [n.op for n in graph.as_graph_def().node]
        assert top.count("If") + top.count("StatelessIf") == 1, kind
        bodies = [
            library[n.attr["body"].func.name]
            for f in library.values()
            for n in f.node_def
            if n.op in ("While", "StatelessWhile")
        ]
        assert len(bodies) == 2, kind
        branches = sorted(_calls_if(library, body, set()) for body in bodies)
        assert branches[0] == 0 and branches[1] > 0, (kind, branches)


def _calls_if(library, function, seen) -> int:
    """The If ops a graph function holds that branch over a contraction (the masked
    values' branches), in the functions it calls too; not the loop's choice of its result
    buffer at the first chunk (`_tiled_into`), whose branches hold no product."""
    count = 0
    for node in function.node_def:
        if node.op in ("If", "StatelessIf") and any(
            _holds_product(library, library[node.attr[b].func.name], set())
            for b in ("then_branch", "else_branch")
        ):
            count += 1
        for value in node.attr.values():
            name = value.func.name
            if name in library and name not in seen:
                seen.add(name)
                count += _calls_if(library, library[name], seen)
    return count


def _holds_product(library, function, seen) -> bool:
    for node in function.node_def:
        if node.op in ("Einsum", "BatchMatMulV2", "MatMul"):
            return True
        for value in node.attr.values():
            name = value.func.name
            if name in library and name not in seen:
                seen.add(name)
                if _holds_product(library, library[name], seen):
                    return True
    return False


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_causal_attention_float32_at_large_logits_stays_on_the_finite_path(target, tmp_path):
    """Finite values, float32, logits in the hundreds (exp overflows float32 past 88):
    the outputs and gradients are finite and match the float64 reference."""
    module = generate(CAUSAL, tmp_path, prefix="CausalFinite32", target=target)
    q, k, _, clean, cotangent = _inputs(seed=6)
    expected = _reference(q, k, clean, cotangent)
    single = [a.astype(np.float32) for a in (q, k, clean, cotangent)]
    for budget in (2**40, 1):
        module.MAX_TEMP_BYTES = budget
        got = _run(module, target, *single)
        for g, e in zip(got, [*expected, *expected[1:]], strict=False):
            assert np.isfinite(g).all()
            scale = np.abs(e).max()
            np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-4 * scale)


def test_pytorch_compile_fullgraph_training_step_over_non_finite_values(tmp_path):
    """torch.compile(fullgraph=True) takes the branch (torch.cond) and the masked
    backward: the loss and gradients match the eager vjp, nan positions included."""
    module = generate(CAUSAL, tmp_path, prefix="CausalCompiled", target="pytorch")
    q, k, bad, _, cotangent = _inputs()
    leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, bad)]
    g_y = torch.tensor(cotangent)

    def loss(*xs):
        return (module.forward(*xs)[:, :FIRST_BAD] * g_y[:, :FIRST_BAD]).sum()

    value = torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves)
    value.backward()
    zeroed = cotangent.copy()
    zeroed[:, FIRST_BAD:] = 0.0
    expected = _reference(q, k, bad, zeroed)
    y = expected[0][:, :FIRST_BAD]
    np.testing.assert_allclose(value.item(), (y * cotangent[:, :FIRST_BAD]).sum(), rtol=1e-9)
    for leaf, e, name in zip(leaves, expected[1:], "qkv", strict=True):
        _same(leaf.grad.numpy(), e, f"compiled grad_{name}")


def test_jax_jit_vmap_and_grad_over_non_finite_values(tmp_path):
    """jax.jit of the forward (the branch is jax.lax.cond), jax.grad of it under jit (the
    generated backward) and jax.vmap over the batch: the reference's values."""
    module = generate(CAUSAL, tmp_path, prefix="CausalJax", target="jax")
    q, k, bad, _, cotangent = _inputs()
    expected = _reference(q, k, bad, cotangent)
    arrays = [jnp.asarray(a) for a in (q, k, bad)]
    _same(np.asarray(jax.jit(module.forward)(*arrays)), expected[0], "jit forward")

    def loss(*xs):
        return jnp.sum(module.forward(*xs) * cotangent)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*arrays)
    for g, e, name in zip(grads, expected[1:], "qkv", strict=True):
        _same(np.asarray(g), e, f"jit grad_{name}")
    single = jax.vmap(lambda *xs: module.forward(*(x[None] for x in xs))[0])(*arrays)
    _same(np.asarray(single), expected[0], "vmap forward")


def test_the_exact_branch_is_kept_by_targets_without_tf_cond():
    """The branches on finite values are `kept` Conds: `ir.without_conds` (PyTorch, JAX)
    leaves them, and their predicate's step, where it replaces the others by their
    `otherwise`; the modules spell them `_cond` (torch.cond when compiled) and
    `jax.lax.cond`."""
    from harness import op_spec

    from symgrad import ir
    from symgrad.pipeline import compile_op, module_text

    module = compile_op(op_spec(CAUSAL, "Causal"))
    stripped = ir.without_conds(module)
    for block, count in ((module.forward, 1), (module.backward, 2)):
        conds = [s.value for s in block.steps if isinstance(s.value, ir.Cond)]
        assert len(conds) == count and all(c.kept for c in conds)
    assert stripped.forward == module.forward and stripped.backward == module.backward
    spec = op_spec(CAUSAL, "Causal")
    assert module_text(spec, "test.toml", "pytorch").count(" = _cond(") == 3
    assert module_text(spec, "test.toml", "jax").count("jax.lax.cond(") == 3
    # TF's `_cond` is tf.cond, or the one branch where a chunk loop checked the values
    tf_text = module_text(spec, "test.toml", "tensorflow")
    assert tf_text.count(" = _cond(") == 3 and "return tf.cond(predicate" in tf_text


RWKV = (
    "a[b,t,c] = sum(where(i < t, exp((t - 1 - i) * w[c] + k[b,i,c]) * {v}, 0), i)",
    "d[b,t,c] = sum(where(i < t, exp((t - 1 - i) * w[c] + k[b,i,c]), 0), i)",
    "y[b,t,c] = (a[b,t,c] + exp(u[c] + k[b,t,c]) * v[b,t,c]) / (d[b,t,c] + exp(u[c] + k[b,t,c]))",
)
RWKV_SHAPES = {"w": (3,), "u": (3,), "k": (2, 9, 3), "v": (2, 9, 3)}


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_rwkv_wkv_ignores_inf_and_nan_values_of_later_steps(target, tmp_path):
    """RWKV-4's WKV (this repo's `RwkvWkv`): `where(i < t, exp(..) * v[b,i,c], 0)` is
    `exp(where(i < t, .., -inf)) * v`; the exponential is [b,t,i,c] already, so the values
    are masked too (no larger tensor). Before, an inf or nan value at step 5 made every
    earlier step's output nan. Now outputs and gradients equal the reference evaluator
    and TF autodiff of the double-where form (values masked inside the where), nan where
    they are nan, whole and in chunks; the steps before 5 equal those with zeros there."""
    from harness import make_tensors, reference

    formula = tuple(f.format(v="v[b,i,c]") for f in RWKV)
    double = tuple(f.format(v="where(i < t, v[b,i,c], 0)") for f in RWKV)
    case = Case(formula, RWKV_SHAPES, inputs=("w", "u", "k", "v"), outputs=("y",))
    module = generate(case, tmp_path, prefix="RwkvNonFinite", target=target)
    w, u, k, v = (t.numpy() for t in make_tensors(case, module.INPUTS))
    w = -np.abs(w) - 0.1  # the kernel's -exp(time_decay): a decay
    bad, clean = v.copy(), v.copy()
    bad[0, FIRST_BAD, 1], bad[1, 7, 2] = np.inf, np.nan
    clean[0, FIRST_BAD, 1] = clean[1, 7, 2] = 0.0
    cotangent = np.random.default_rng(2).standard_normal((2, 9, 3))
    named = {"w": w, "u": u, "k": k}
    tensors = {n: tf.constant(a) for n, a in {**named, "v": bad}.items()}
    with tf.GradientTape() as tape:
        tape.watch(list(tensors.values()))
        (want_y,) = reference(Case(double, RWKV_SHAPES, outputs=("y",), sizes={"t": 9}), tensors)
    want = [want_y.numpy()] + [
        g.numpy() for g in tape.gradient(want_y, list(tensors.values()), output_gradients=cotangent)
    ]
    assert np.isnan(want_y.numpy()[0, FIRST_BAD:, 1]).all() or np.isinf(want_y[0, FIRST_BAD, 1])
    assert np.isfinite(want_y.numpy()[:, :FIRST_BAD]).all()
    for budget in (2**40, 1):
        module.MAX_TEMP_BYTES = budget
        got, zeros = (
            [
                _numpy(t)
                for t in (
                    module.forward(*(ARRAY[target](a) for a in (w, u, k, values))),
                    *module.vjp(*(ARRAY[target](a) for a in (w, u, k, values, cotangent))),
                )
            ]
            for values in (bad, clean)
        )
        np.testing.assert_array_equal(got[0][:, :FIRST_BAD], zeros[0][:, :FIRST_BAD])
        _same(got[0], want[0], f"y at budget {budget}")
        # Where later steps' infinities meet (inf - inf), nan or inf depends on the order
        # of the additions: the gradients are finite exactly where the reference's are.
        for g, e, what in zip(got[1:], want[1:], ("w", "u", "k", "v"), strict=True):
            finite = np.isfinite(e)
            np.testing.assert_array_equal(np.isfinite(g), finite, err_msg=what)
            np.testing.assert_allclose(g[finite], e[finite], rtol=1e-9, atol=1e-9, err_msg=what)

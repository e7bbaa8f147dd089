"""Memory-bounded TensorFlow modules: with MAX_TEMP_BYTES set below what an op's
temporaries need, the module runs its chunk in a loop, and every result is still exact.

The numerical checks are `harness.check` (forward, vjp, the registered gradient, a tape,
finite differences, float64, against the independent reference) with the budget forced
tiny, over every formula of both corpora that gets a tiling. The memory bound is measured
in a subprocess with TensorFlow's BFC allocator statistics, at sizes where today's
untiled code needs many times the bound.
"""

from __future__ import annotations

import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from harness import Case, FakeOp, check, generate, make_inputs, op_spec
from peaks import run_tensorflow
from test_indexing import KNOWN
from test_numeric import CORPUS

from symgrad.model import build
from symgrad.pipeline import compile_op

REPO = Path(__file__).resolve().parent.parent

# Real-world shapes of windowed and pairwise ops, each index its own size.
TILED = {
    "chamfer": Case(
        "y[b,i] = min(sum((x[b,i,c] - z[b,j,c])**2, c), j)", {"x": (2, 13, 3), "z": (2, 11, 3)}
    ),
    "rbf_sum": Case(
        "y[b,i] = sum(exp(-sum((x[b,i,c] - z[b,j,c])**2, c)), j)",
        {"x": (2, 9, 3), "z": (2, 7, 3)},
    ),
    "correlation": Case(
        "y[b,i,j,u,v] = mean(f1[b,i,j,c] * f2[b, i+u-r, j+v-r, c], c)",
        {"f1": (2, 5, 6, 3), "f2": (2, 5, 6, 3)},
        attrs={"r": 1},
        ranges={"u": "2*r + 1", "v": "2*r + 1"},
        sizes={"u": 3, "v": 3},
        fd_directions=3,
    ),
    "lightconv_own_layout": Case(
        # fairseq's lightconv in its own [B, C, T] layout: a filter per channel, its taps
        # dilated (undilated it is the depthwise kernel, never tiled).
        "y[b,c,t] = sum(w[c,k] * x[b, c, t + 2*k - p], k)",
        {"x": (2, 3, 11), "w": (3, 4)},
        attrs={"p": 1},
        ranges={"t": "x.shape[2]"},
        sizes={"t": 11},
    ),
    "lightconv_with_a_let": Case(
        # fairseq's lightconv with its padding derived from the filter by a let (dilated).
        "y[b,c,t] = sum(w[c,k] * x[b, c, t + 2*k - P], k)",
        {"x": (2, 3, 11), "w": (3, 4)},
        lets={"P": "(w.shape[1] - 1) // 2"},
        let_values={"P": 1},
        ranges={"t": "x.shape[2]"},
        sizes={"t": 11},
    ),
    "lightconv_same": Case(
        # symgrad.toml's LightconvSame, dilated: the padding a let of the filter's width
        "y[b,c,t] = sum(w[c,k] * x[b, c, t + 2*k - P], k)",
        {"x": (2, 3, 11), "w": (3, 5)},
        lets={"P": "(w.shape[1] - 1) // 2"},
        let_values={"P": 2},
        ranges={"t": "x.shape[2]"},
        sizes={"t": 11},
    ),
    "rwkv": Case(
        # RWKV-4's WKV: internal tensors a, d over [b,t,c], each a causal sum over i
        [
            "a[b,t,c] = sum(where(i < t, exp((t - 1 - i) * w[c] + k[b,i,c]) * v[b,i,c], 0), i)",
            "d[b,t,c] = sum(where(i < t, exp((t - 1 - i) * w[c] + k[b,i,c]), 0), i)",
            (
                "y[b,t,c] = (a[b,t,c] + exp(u[c] + k[b,t,c]) * v[b,t,c]) / "
                "(d[b,t,c] + exp(u[c] + k[b,t,c]))"
            ),
        ],
        {"w": (3,), "u": (3,), "k": (2, 7, 3), "v": (2, 7, 3)},
        inputs=("w", "u", "k", "v"),
        outputs=("y",),
        sizes={"t": 7},
    ),
    "dilated_conv": Case(
        "y[b,i,o] = sum(x[b, s*i + d*k - p, c] * w[k,c,o], k, c)",
        {"x": (2, 14, 3), "w": (3, 3, 4)},
        attrs={"s": 2, "d": 3, "p": 2},
        ranges={"i": "(x.shape[1] + 2*p - d*(w.shape[0] - 1) - 1) // s + 1"},
        sizes={"i": 6},
    ),
    "causal_scores": Case(
        "y[b,i] = sum(where(j <= i, exp(q[b,i,d] * k[b,j,d]), 0), j, d)",
        {"q": (2, 7, 3), "k": (2, 7, 3)},
    ),
    "two_outputs": Case(
        [
            "y[b,i] = min(sum((x[b,i,c] - z[b,j,c])**2, c), j)",
            "s[b,i] = sum(tanh(x[b,i,c] * z[b,j,c]), j, c)",
        ],
        {"x": (2, 6, 3), "z": (2, 5, 3)},
    ),
}


def _tiled(case: Case) -> bool:
    return compile_op(op_spec(case, "Probe")).tiling is not None


@pytest.mark.parametrize("name", sorted(TILED))
def test_a_tiled_module_is_exact_everywhere(name, tmp_path):
    case = TILED[name]
    assert _tiled(case), f"{name} has large temporaries and must get a tiling"
    module = generate(case, tmp_path, prefix="Tiled")
    module.MAX_TEMP_BYTES = 512  # far below any chunk: one position per chunk
    tensors = make_inputs(case, build(op_spec(case, module.OP_TYPE)))
    assert module._tile_plan(*tensors, **case.attrs) is not None
    check(replace(case, fd_directions=case.fd_directions or 4), module)


def test_a_let_that_reads_an_axis_of_the_tiled_index_keeps_its_value(tmp_path):
    """`N = x.shape[1]` with x cut along axis 1 (the tiled index i) would be the chunk's
    length inside the chunk: x is not cut but read at the chunk's shifted positions, so N
    keeps its value, and the op is exact at any budget."""
    case = Case(
        "y[b,i] = min(sum((x[b,i,c] - z[b,j,c])**2, c), j) / N",
        {"x": (2, 13, 3), "z": (2, 11, 3)},
        lets={"N": "x.shape[1]"},
        let_values={"N": 13},
    )
    assert _tiled(case)
    module = generate(case, tmp_path, prefix="LetCut")
    module.MAX_TEMP_BYTES = 512
    tensors = make_inputs(case, build(op_spec(case, module.OP_TYPE)))
    assert module._tile_plan(*tensors) is not None
    check(case, module)


CORPORA = {
    **{f"corpus_{k}": v for k, v in CORPUS.items()},
    **{f"indexing_{k}": v.case for k, v in KNOWN.items()},
}
CORPUS_TILED = sorted(name for name, case in CORPORA.items() if _tiled(case))


def test_the_corpora_have_tiled_formulas():
    assert len(CORPUS_TILED) >= 5, CORPUS_TILED


def _all_paths(module, case, tensors, grads):
    """forward, vjp, the registered gradient and a tape over forward, as arrays."""
    outs = module.forward(*tensors, **case.attrs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    found = [o.numpy() for o in outs]
    found += [
        np.asarray(tf.convert_to_tensor(g))
        for g in module.vjp(*tensors, *grads, **case.attrs)
        if g is not None
    ]
    fake = FakeOp(tensors, outs, case.attrs, module)
    found += [
        np.asarray(tf.convert_to_tensor(g)) for g in module.gradient(fake, *grads) if g is not None
    ]
    floats = [t for t in tensors if t.dtype.is_floating]
    with tf.GradientTape() as tape:
        tape.watch(floats)
        outs = module.forward(*tensors, **case.attrs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        loss = tf.add_n([tf.reduce_sum(o * g) for o, g in zip(outs, grads, strict=True)])
    found += [
        np.asarray(tf.convert_to_tensor(g)) for g in tape.gradient(loss, floats) if g is not None
    ]
    return found


@pytest.mark.parametrize("name", CORPUS_TILED)
def test_every_tiled_corpus_formula_gives_todays_numbers_in_chunks(name, tmp_path):
    """Chunked and whole, every path agrees to rounding (the whole path is checked
    against the reference and finite differences by the corpus tests)."""
    case = CORPORA[name]
    module = generate(case, tmp_path, prefix="TiledCorpus")
    tensors = make_inputs(case, build(op_spec(case, module.OP_TYPE)))
    outs = module.forward(*tensors, **case.attrs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    rng = np.random.default_rng(5)
    grads = [tf.constant(rng.standard_normal(o.shape.as_list())) for o in outs]
    whole = _all_paths(module, case, tensors, grads)
    module.MAX_TEMP_BYTES = 512
    assert module._tile_plan(*tensors, **case.attrs) is not None
    chunked = _all_paths(module, case, tensors, grads)
    assert len(chunked) == len(whole)
    for got, want in zip(chunked, whole, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


def test_below_the_budget_the_module_runs_todays_code(tmp_path):
    case = TILED["chamfer"]
    module = generate(case, tmp_path, prefix="Untiled")
    tensors = make_inputs(case, build(op_spec(case, module.OP_TYPE)))
    assert module.MAX_TEMP_BYTES == 16 * 2**20
    assert module._tile_plan(*tensors) is None


def test_tiled_chamfer_splits_ties_equally(tmp_path):
    """Every point of x is equally near two copies of a point of z: in chunks, through
    vjp and the registered gradient, the copies get equal gradients that add up to the
    single point's (the tie mask is per chunk and still splits)."""
    module = generate(TILED["chamfer"], tmp_path, prefix="Ties")
    rng = np.random.default_rng(4)
    x, p = rng.standard_normal((2, 13, 3)), rng.standard_normal((2, 5, 3))
    z = np.concatenate([p, p], axis=1)  # j = 10: j and j + 5 tie for every i
    cotangent = tf.constant(rng.standard_normal((2, 13)))
    single_x, single = module.vjp(tf.constant(x), tf.constant(p), cotangent)
    module.MAX_TEMP_BYTES = 512
    xs = [tf.constant(x), tf.constant(z)]
    n, c = module._tile_plan(*xs)
    assert c < n == 13
    with tf.GradientTape() as tape:
        tape.watch(xs)
        y = module.forward(*xs)
    for grad_x, grad_z in (module.vjp(*xs, cotangent), tape.gradient(y, xs, cotangent)):
        np.testing.assert_allclose(grad_x, single_x, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(grad_z[:, :5], grad_z[:, 5:])
        np.testing.assert_allclose(grad_z[:, :5] + grad_z[:, 5:], single, rtol=0, atol=1e-12)
    assert np.abs(single).max() > 0.1


@pytest.mark.parametrize("name", ["correlation", "rwkv", "lightconv_same"])
def test_unknown_sizes_and_xla_tile_too(name, tmp_path):
    """In chunks, under tf.function with unknown sizes and under XLA: windows, internal
    tensors (RWKV) and lets (lightconv's padding)."""
    case = TILED[name]
    module = generate(case, tmp_path, prefix="TiledGraph")
    tensors = make_inputs(case, build(op_spec(case, module.OP_TYPE)))
    module.MAX_TEMP_BYTES = 2**40
    shape = module.forward(*tensors, **case.attrs).shape
    grad = tf.constant(np.random.default_rng(3).standard_normal(shape))
    want = module.vjp(*tensors, grad, **case.attrs)
    module.MAX_TEMP_BYTES = 512
    assert module._tile_plan(*tensors, **case.attrs) is not None
    spec = [tf.TensorSpec([None] * len(t.shape), t.dtype) for t in tensors]

    def vjp(*a):
        return module.vjp(*a, grad, **case.attrs)

    unknown = tf.function(vjp, input_signature=spec)
    compiled = tf.function(vjp, jit_compile=True)
    for run in (unknown, compiled):
        for got, expected in zip(run(*tensors), want, strict=True):
            np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-12, atol=1e-12)


def test_the_spec_sets_the_budget_per_op_and_at_the_top(tmp_path):
    from symgrad.pipeline import generate as generate_texts
    from symgrad.spec import parse_spec

    spec = parse_spec(
        textwrap.dedent(
            """
            max_temp_bytes = 4096
            [ops.Near]
            formula = "y[b,i] = min(sum((x[b,i,c] - z[b,j,c])**2, c), j)"
            [ops.Far]
            formula = "y[b,i] = min(sum((x[b,i,c] - z[b,j,c])**2, c), j)"
            max_temp_bytes = 67108864
            """
        ),
        "symgrad.toml",
    )
    files = generate_texts(spec, "tensorflow", "symgrad.toml")
    assert "\nMAX_TEMP_BYTES = 4096\n" in files["near.py"]
    assert "\nMAX_TEMP_BYTES = 67108864\n" in files["far.py"]


MEASURE = """
import json, sys
import numpy as np
import tensorflow as tf
sys.path.insert(0, {repo!r})
sys.path.insert(0, {repo!r} + "/tests")
from generated import chamfer_distance, correlation, dynamic_conv, rwkv_wkv, strided_conv1d

rng = np.random.default_rng(0)
f = lambda *s: tf.constant(rng.normal(size=s).astype(np.float32))

from peaks import peak

def step(module, args, attrs):
    def run():
        with tf.GradientTape() as tape:
            tape.watch(args)
            y = module.forward(*args, **attrs)
            loss = tf.reduce_sum(y * y)
        return [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, args)]
    return run

found = {{}}
for module, args, attrs in [
    (correlation, [f(2, 24, 32, 16), f(2, 24, 32, 16)], {{"r": 4}}),
    (chamfer_distance, [f(2, 1024, 3), f(2, 1536, 3)], {{}}),
    (strided_conv1d, [f(2, 2048, 16), f(9, 16, 16)], {{"s": 1, "d": 2, "p": 8}}),
    (rwkv_wkv, [f(32), f(32), f(2, 512, 32), f(2, 512, 32)], {{}}),
    (dynamic_conv, [f(2, 32, 2048), f(2, 4, 31, 2048)], {{}}),
]:
    y = module.forward(*args, **attrs)
    io = sum(a.numpy().nbytes for a in args) + y.numpy().nbytes
    module.MAX_TEMP_BYTES = 2**40
    untiled = peak(step(module, args, attrs))
    module.MAX_TEMP_BYTES = 2**20
    tiled = peak(step(module, args, attrs))
    found[module.OP_TYPE] = dict(io=io, untiled=untiled, tiled=tiled)
print(json.dumps(found))
"""


def test_a_training_step_holds_at_most_4x_its_inputs_and_outputs_plus_the_budget():
    found = run_tensorflow(MEASURE.format(repo=str(REPO)))
    budget = 2**20
    for op, m in found.items():
        bound = 4 * m["io"] + budget
        assert m["untiled"] > 2 * bound, f"{op}: the size does not test the bound: {m}"
        assert m["tiled"] <= bound, f"{op}: a tiled step peaks at {m['tiled']} > {bound}: {m}"

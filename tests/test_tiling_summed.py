"""Tiling along a summed index (`symgrad/tile_sum.py`): ops whose outputs keep only a batch
index -- an RBF (MMD) energy per cloud, a kernel-weighted loss -- where one batch position
still holds the whole pairwise matrix. Their modules run in chunks of the outer sum's
index, the chunks' partial sums added; every result is exact in float64 in all three
targets (forward, vjp, the registered gradient / autodiff through `forward`, a training
step; unknown sizes under tf.function, XLA, jax.jit), and a training step at a size where
today's code needs many times the bound stays within 4x the inputs and outputs plus the
budget.
"""

from __future__ import annotations

import numpy as np
import pytest
from all_targets import REPO, TINY, jax, jnp, modules_fixture, tf, torch
from harness import Case, check, generate, make_inputs, op_spec
from peaks import jax_step_memory, tf_formula_peaks
from target_harness import check_target, frameworks
from test_tiling import _torch_memory

from symgrad.model import build
from symgrad.pipeline import compile_op
from symgrad.spec import parse_spec

# Each index its own size: b = 2, n = 9, m = 7, c = 3.
SUMMED = {
    # An RBF / MMD energy per cloud: both point sets summed, tiled along n (x cut)
    "rbf_energy": Case(
        "y[b] = sum(exp(-sum((x[b,n,c] - z[b,m,c])**2, c)), n, m)",
        {"x": (2, 9, 3), "z": (2, 7, 3)},
        low=-0.6,
        high=0.6,
    ),
    # A kernel-weighted loss: a per-n log-sum over m, weighted and summed over n (w, x cut)
    "kernel_loss": Case(
        "y[b] = sum(w[b,n] * log(sum(exp(-sum((x[b,n,c]-z[b,m,c])**2, c)), m)), n)",
        {"w": (2, 9), "x": (2, 9, 3), "z": (2, 7, 3)},
        low=-0.6,
        high=0.6,
    ),
    # One direction of a Chamfer loss per cloud: a per-n min over m, summed over n
    "chamfer_one_way": Case(
        "y[b] = sum(min(sum((x[b,n,c] - z[b,m,c])**2, c), m), n)",
        {"x": (2, 9, 3), "z": (2, 7, 3)},
    ),
    # A mean over both point sets (MMD's cross term): each chunk's mean scaled by its
    # share, length / total, of n; nothing is cut (the total reads x.shape[1])
    "mean_energy": Case(
        "y[b] = mean(exp(-sum((x[b,n,c] - z[b,m,c])**2, c)), n, m)",
        {"x": (2, 9, 3), "z": (2, 7, 3)},
        low=-0.6,
        high=0.6,
    ),
    # The outer sum negated and divided by an attr: a chunk's output is its share
    "scaled_loss": Case(
        "y[b] = -sum(w[b,n] * log(sum(exp(-sum((x[b,n,c]-z[b,m,c])**2, c)), m)), n) / T",
        {"w": (2, 9), "x": (2, 9, 3), "z": (2, 7, 3)},
        attrs={"T": 3.0},
        low=-0.6,
        high=0.6,
    ),
    # The summed index read at a moved position by an input that is not cut: the chunk
    # reads x at n + tile_start and sizes n by tile_length
    "moved_read": Case(
        "y[b] = sum(tanh(x[b,n] * x[b,n+1] * z[b,m]), n, m)",
        {"x": (2, 9), "z": (2, 7)},
        ranges={"n": "x.shape[1]"},
        sizes={"n": 9},
    ),
}


modules = modules_fixture(SUMMED, "Summed")  # each module generated once


@pytest.mark.parametrize("name", sorted(SUMMED))
def test_outputs_that_keep_only_a_batch_index_are_tiled_along_the_summed_index(name):
    tiling = compile_op(op_spec(SUMMED[name], "Probe")).tiling
    assert tiling is not None and tiling.summed and tiling.index == "n", tiling


def test_an_output_index_that_bounds_the_temporaries_is_still_preferred():
    """`y[b,i]`: one position of i is [b,j], no larger than z; i is kept."""
    case = Case("y[b,i] = sum(exp(-sum((x[b,i,c]-z[b,j,c])**2, c)), j)", {})
    tiling = compile_op(op_spec(case, "Probe")).tiling
    assert (tiling.index, tiling.summed) == ("i", False)


def test_terms_summing_different_indices_are_tiled_in_parts(tmp_path):
    """A Chamfer loss per cloud: its first term sums n, its second m; neither can be cut
    in both, so each term is a part tiled along its own summed index (`tile_parts`, tested
    in tests/test_tiling_parts.py), and the docstring says so."""
    case = Case(
        "y[b] = sum(min(sum((p[b,n,c] - q[b,m,c])**2, c), m), n)"
        " + sum(min(sum((p[b,n,c] - q[b,m,c])**2, c), n), m)",
        {"p": (2, 9, 3), "q": (2, 7, 3)},
    )
    tiling = compile_op(op_spec(case, "Probe")).tiling
    assert [(p.tiling.index, p.tiling.summed) for p in tiling.parts] == [("n", True), ("m", True)]
    module = _module_of(case, tmp_path)
    assert "its terms sum different indices" in " ".join(module.__doc__.split())


def test_subtracted_terms_summing_different_indices_are_parts_with_their_sign(tmp_path):
    """A difference of such terms is split too: the subtracted term is a part of its own
    with its sign, `-sum(..)`, tiled along its summed index (tests/test_tiling_parts.py
    checks the values), and the docstring names each part."""
    case = Case(
        "y[b] = sum(min(sum((p[b,n,c] - q[b,m,c])**2, c), m), n)"
        " - sum(min(sum((p[b,n,c] - q[b,m,c])**2, c), n), m)",
        {"p": (2, 9, 3), "q": (2, 7, 3)},
    )
    tiling = compile_op(op_spec(case, "Probe")).tiling
    assert [(p.tiling.index, p.tiling.summed) for p in tiling.parts] == [("n", True), ("m", True)]
    assert tiling.parts[1].formula.startswith("y[b] = -sum(")
    module = _module_of(case, tmp_path)
    assert "part 1: y[b] = -sum(" in module.__doc__


def _module_of(case, tmp_path):
    return generate(case, tmp_path, prefix="Chamfer")


@pytest.mark.parametrize("name", sorted(SUMMED))
def test_tensorflow_summed_tiling_is_exact_everywhere(name, modules):
    """forward, vjp, the registered gradient, a tape, finite differences, against the
    reference, in chunks of one position."""
    case = SUMMED[name]
    module = modules(name)
    module.MAX_TEMP_BYTES = TINY
    tensors = make_inputs(case, build(op_spec(case, module.OP_TYPE)))
    n, c = module._tile_plan(*tensors, **case.attrs)
    assert c < n == 9
    check(case, module)


@pytest.mark.parametrize("name", ["rbf_energy", "moved_read", "mean_energy"])
def test_tensorflow_summed_tiling_under_unknown_sizes_and_xla(name, modules):
    case = SUMMED[name]
    module = modules(name)
    tensors = make_inputs(case, build(op_spec(case, module.OP_TYPE)))
    grad = tf.constant(np.random.default_rng(3).standard_normal(2))
    want = module.vjp(*tensors, grad)
    module.MAX_TEMP_BYTES = TINY
    spec = [tf.TensorSpec([None] * len(t.shape), t.dtype) for t in tensors]

    def vjp(*a):
        return module.vjp(*a, grad)

    for run in (tf.function(vjp, input_signature=spec), tf.function(vjp, jit_compile=True)):
        for got, expected in zip(run(*tensors), want, strict=True):
            np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("name", "target"),
    [
        *((name, "pytorch") for name in sorted(SUMMED)),
        ("kernel_loss", "jax"),
        ("mean_energy", "jax"),
        ("rbf_energy", "jax"),
        ("scaled_loss", "jax"),
    ],
)
def test_pytorch_and_jax_summed_tiling_is_exact(name, target, modules):
    """forward, vjp, autodiff through `forward` and the framework's own autodiff, against
    the reference, in chunks."""
    case = SUMMED[name]
    fw = frameworks()[target]
    module = modules(name, target)
    module.MAX_TEMP_BYTES = TINY
    tensors = make_inputs(case, build(op_spec(case, module.OP_NAME)))
    n, c = module._tile_plan(*(fw.tensor(t.numpy()) for t in tensors), **case.attrs)
    assert c < n == 9
    check_target(case, module, fw)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_summed_tiling_splits_ties_equally(target, modules):
    """One-way Chamfer per cloud, every point of x equally near two copies of a point of
    z: in chunks of n, the copies get equal gradients that add up to the single point's."""
    module = modules("chamfer_one_way", target)
    array = {"tensorflow": tf.constant, "pytorch": torch.tensor, "jax": jnp.asarray}[target]
    rng = np.random.default_rng(4)
    x, p = rng.standard_normal((2, 9, 3)), rng.standard_normal((2, 4, 3))
    z = np.concatenate([p, p], axis=1)  # m = 8: m and m + 4 tie for every n
    cotangent = rng.standard_normal(2)

    def vjp(*arrays):
        return [np.asarray(g) for g in module.vjp(*(array(a) for a in arrays))]

    single_x, single = vjp(x, p, cotangent)
    module.MAX_TEMP_BYTES = TINY
    n, c = module._tile_plan(array(x), array(z))
    assert c < n == 9
    grad_x, grad_z = vjp(x, z, cotangent)
    np.testing.assert_allclose(grad_x, single_x, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(grad_z[:, :4], grad_z[:, 4:])
    np.testing.assert_allclose(grad_z[:, :4] + grad_z[:, 4:], single, rtol=0, atol=1e-12)
    assert np.abs(single).max() > 0.1


def _arrays(case, names, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-0.6, 0.6, case.shapes[n]) for n in names]


@pytest.mark.parametrize("name", ["kernel_loss"])
def test_training_steps_in_chunks_equal_todays(name, modules):
    """Two SGD steps on loss = sum(forward(...)**2): PyTorch eagerly, JAX under jit,
    TensorFlow with a tape; tiled and untiled agree to rounding."""
    case = SUMMED[name]

    def torch_steps(module):
        params = [torch.nn.Parameter(torch.tensor(a)) for a in _arrays(case, module.INPUTS)]
        optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
        for _ in range(2):
            optimizer.zero_grad()
            (module.forward(*params) ** 2).sum().backward()
            optimizer.step()
        return [p.detach().numpy() for p in params]

    def jax_steps(module):
        def loss(params):
            return jnp.sum(module.forward(*params) ** 2)

        def step(params):
            grads = jax.grad(loss)(params)
            return tuple(p - 0.01 * g for p, g in zip(params, grads, strict=True))

        # a new function per call: traced afresh, with the current budget
        run = jax.jit(lambda params: step(step(params)))
        return [np.asarray(p) for p in run(tuple(map(jnp.asarray, _arrays(case, module.INPUTS))))]

    def tf_steps(module):
        params = [tf.Variable(a) for a in _arrays(case, module.INPUTS)]
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(module.forward(*params) ** 2)
            for p, g in zip(params, tape.gradient(loss, params), strict=True):
                p.assign_sub(0.01 * g)
        return [p.numpy() for p in params]

    for target, steps in (("pytorch", torch_steps), ("jax", jax_steps), ("tensorflow", tf_steps)):
        module = modules(name, target)
        want = steps(module)
        module.MAX_TEMP_BYTES = TINY
        got = steps(module)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-12, err_msg=target)


# ----------------------------------------------------------------------------- memory

# b = 2, n = 1200, m = 1000, c = 3: a [2, 1200, 1000] matrix (9.2 MiB in float32) per temporary
MEMORY = {
    "rbf_energy": {"x": (2, 1200, 3), "z": (2, 1000, 3)},
    "kernel_loss": {"w": (2, 1200), "x": (2, 1200, 3), "z": (2, 1000, 3)},
}
BUDGET = 2**18  # TensorFlow and JAX
TORCH_BUDGET = 2**20  # fewer chunks: the profiler's events make each one slow


@pytest.mark.parametrize("name", sorted(MEMORY))
def test_pytorch_summed_tiled_step_memory_is_bounded(name, modules):
    """The tiled forward keeps only the inputs for the backward; a training step's peak
    allocation (torch.profiler) stays within 4x the inputs and outputs plus the budget."""
    module = modules(name, "pytorch")
    rng = np.random.default_rng(6)
    xs = [
        torch.tensor(rng.uniform(-1, 1, MEMORY[name][n]), dtype=torch.float32, requires_grad=True)
        for n in module.INPUTS
    ]
    module.MAX_TEMP_BYTES = 2**40
    kept_untiled, untiled = _torch_memory(module, xs, {})
    module.MAX_TEMP_BYTES = TORCH_BUDGET
    assert module._tile_plan(*xs) is not None
    kept, tiled = _torch_memory(module, xs, {})
    io = sum(x.nbytes for x in xs) + 2 * 4
    bound = TORCH_BUDGET + 4 * io
    print(f"{name}: PyTorch step peak {untiled} -> {tiled} bytes, bound {bound}")
    assert kept == io - 8, (kept, io)  # the inputs alone
    assert kept_untiled > 10 * io, (kept_untiled, io)
    assert untiled > 10 * bound, (untiled, bound)
    assert tiled <= bound, (tiled, untiled)


@pytest.mark.parametrize("name", sorted(MEMORY))
def test_jax_summed_tiled_gradient_memory_is_bounded(name, modules):
    """The jitted gradient's temporaries (XLA's memory_analysis) stay within the bound
    tiled, where untiled they are many times it."""
    module = modules(name, "jax")
    rng = np.random.default_rng(6)
    xs = [jnp.asarray(rng.uniform(-1, 1, MEMORY[name][n]), jnp.float32) for n in module.INPUTS]

    module.MAX_TEMP_BYTES = 2**40
    untiled = jax_step_memory(module, xs).temp_size_in_bytes
    module.MAX_TEMP_BYTES = BUDGET
    assert module._tile_plan(*xs) is not None
    tiled = jax_step_memory(module, xs).temp_size_in_bytes
    bound = BUDGET + 4 * (sum(x.nbytes for x in xs) + 2 * 4)
    print(f"{name}: JAX gradient temporaries {untiled} -> {tiled} bytes, bound {bound}")
    assert untiled > 10 * bound, (untiled, bound)
    assert tiled <= bound, (tiled, untiled)


def test_tensorflow_summed_tiled_step_memory_is_bounded(tmp_path):
    """TensorFlow's allocator statistics (BFC), in a fresh process: a training step."""
    cases = {name: (SUMMED[name].formulas, MEMORY[name]) for name in MEMORY}
    found = tf_formula_peaks(cases, BUDGET, tmp_path)
    for name, m in found.items():
        bound = 4 * m["io"] + BUDGET
        print(f"{name}: TensorFlow step peak {m['untiled']} -> {m['tiled']} bytes, bound {bound}")
        assert m["untiled"] > 10 * bound, (name, m)
        assert m["tiled"] <= bound, (name, m)


def test_an_outer_extremum_of_a_reduction_runs_in_stages(tmp_path):
    """Hausdorff's `max(min(d, m), n)`: no outer sum, but its inner reduction is hoisted
    into an internal tensor and the op runs in stages (tests/test_tiling_stages.py). An
    MMD of three mean terms over different index pairs (one subtracted) runs in parts and
    says why."""
    hausdorff = Case("h[b] = max(min(sum((x[b,c,n] - z[b,c,m])**2, c), m), n)", {})
    tiling = compile_op(op_spec(hausdorff, "Probe")).tiling
    assert tiling.stages == ("inner",) and tiling.index == "n"
    doc = " ".join(_module_of(hausdorff, tmp_path).__doc__.split())
    assert "the op runs in stages, one per equation" in doc, doc
    mmd = Case(
        "y[b] = mean(exp(-sum((x[b,n,c] - x[b,k,c])**2, c)), n, k)"
        " + mean(exp(-sum((z[b,m,c] - z[b,l,c])**2, c)), m, l)"
        " - 2 * mean(exp(-sum((x[b,n,c] - z[b,m,c])**2, c)), n, m)",
        {},
    )
    doc = " ".join(_module_of(mmd, tmp_path).__doc__.split())
    assert "its terms sum different indices, so no index can be cut in every term" in doc, doc
    assert "part 2: y[b] = -(2 * mean(" in doc, doc


def test_an_outer_mean_none_of_whose_indices_bounds_keeps_the_output_tiling():
    """ROI Align's `mean(.., a, q)`: each summed index is tried on a fresh copy of the
    formula (trying `a` once rewrote the tree `q` was then tried on)."""
    spec = parse_spec((REPO / "symgrad.toml").read_text(encoding="utf-8"), "symgrad.toml")
    op = next(op for op in spec.ops if op.name == "RoiAlign")
    tiling = compile_op(op).tiling
    assert tiling is not None and not tiling.summed

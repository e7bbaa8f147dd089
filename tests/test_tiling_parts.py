"""Tiling in parts (`symgrad/tile_parts.py`): ops with no one index that bounds their
temporaries -- Chamfer distance in its published layout (two outputs, `d1[b,n]` and
`d2[b,m]`, sharing only `b`) and a two-way Chamfer loss per cloud (two terms summing
different indices). Each part is tiled along its own index; every result is exact in
float64 in all three targets (forward, vjp, the registered gradient / autodiff through
`forward`, a training step; unknown sizes under tf.function, XLA, jax.jit and grad; ties
split equally), and a training step at a size where today's (batch-tiled) code needs many
times the bound stays within 4x the inputs and outputs plus the budget.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import sgd
from all_targets import TINY, jax, jnp, modules_fixture, tf, torch
from harness import Case, check, generate, make_inputs, op_spec
from peaks import io_bytes, jax_step_memory, memory_inputs, tf_formula_peaks, torch_peak
from target_harness import check_target, frameworks

from symgrad.model import build
from symgrad.pipeline import compile_op

DISTANCE = "sum((x[b,n,c] - z[b,m,c])**2, c)"
# Each index its own size: b = 2, n = 9, m = 7, c = 3.
PARTS = {
    # ChamferDistancePytorch's chamfer_distance(xyz1, xyz2) -> dist1 [B,N], dist2 [B,M]
    "chamfer_two_outputs": Case(
        (f"d1[b,n] = min({DISTANCE}, m)", f"d2[b,m] = min({DISTANCE}, n)"),
        {"x": (2, 9, 3), "z": (2, 7, 3)},
        low=-3.0,
        high=3.0,
    ),
    # A two-way Chamfer loss per cloud: its terms sum n and m
    "chamfer_loss": Case(
        f"y[b] = sum(min({DISTANCE}, m), n) + sum(min({DISTANCE}, n), m)",
        {"x": (2, 9, 3), "z": (2, 7, 3)},
        low=-3.0,
        high=3.0,
    ),
}
# Inputs whose nearest and second-nearest distances differ by far more than a finite
# difference's step, in both directions (seed 0 of the loss has a gap of 0.02)
SEEDS = {"chamfer_two_outputs": 1, "chamfer_loss": 1}


modules = modules_fixture(PARTS, "Parts")  # each module generated once


@pytest.mark.parametrize("name", sorted(PARTS))
def test_each_part_is_tiled_along_its_own_index(name):
    tiling = compile_op(op_spec(PARTS[name], "Probe")).tiling
    assert [(p.tiling.index, p.tiling.summed) for p in tiling.parts] == (
        [("n", False), ("m", False)]
        if name == "chamfer_two_outputs"
        else [("n", True), ("m", True)]
    )
    assert [p.tiling.sliced for p in tiling.parts] == [(("x", 1),), (("z", 1),)]


def test_the_docstring_says_what_each_part_is_tiled_along_and_why(modules):
    module = modules("chamfer_two_outputs")
    doc = " ".join(module.__doc__.split())
    assert "the outputs share only b, one position of which still holds them" in doc
    assert "part 0: d1[b, n] = min(" in doc and "part 1: d2[b, m] = min(" in doc
    assert "in chunks of n (an output index: one n leaves temporaries no larger" in doc
    assert "in chunks of m (an output index" in doc


def test_ops_with_internal_tensors_are_not_split():
    """A part would need the other part's internal values: the op keeps today's tiling."""
    case = Case(
        (f"s[b,n,m] = {DISTANCE}", "d1[b,n] = min(s[b,n,m], m)", "d2[b,m] = min(s[b,n,m], n)"),
        {"x": (2, 9, 3), "z": (2, 7, 3)},
        outputs=("d1", "d2"),
    )
    tiling = compile_op(op_spec(case, "Probe")).tiling
    assert tiling is not None and tiling.parts == () and tiling.index == "b"


def test_ops_that_one_index_bounds_are_not_split():
    """A two-output op whose outputs share the index that bounds it keeps one tiling."""
    case = Case(
        (
            "u[b,n] = min(sum((x[b,n,c] - z[b,m,c])**2, c), m)",
            "v[b,n] = max(x[b,n,c] * z[b,m,c], m, c)",
        ),
        {"x": (2, 9, 3), "z": (2, 7, 3)},
    )
    tiling = compile_op(op_spec(case, "Probe")).tiling
    assert tiling.parts == () and tiling.index == "n"


@pytest.mark.parametrize("name", sorted(PARTS))
def test_tensorflow_tiling_in_parts_is_exact_everywhere(name, modules):
    """forward, vjp, the registered gradient, a tape, finite differences, against the
    reference, every part in chunks of one or two positions."""
    case = PARTS[name]
    module = modules(name)
    module.MAX_TEMP_BYTES = TINY
    tensors = make_inputs(case, build(op_spec(case, module.OP_TYPE)))
    n0, c0, n1, c1 = module._tile_plan(*tensors)
    assert (n0, n1) == (9, 7) and c0 < n0 and c1 < n1
    check(case, module, seed=SEEDS[name])


@pytest.mark.parametrize("name", sorted(PARTS))
@pytest.mark.parametrize("target", ["pytorch", "jax"])
def test_pytorch_and_jax_tiling_in_parts_is_exact(name, target, modules):
    """forward, vjp, autodiff through `forward` and the framework's own autodiff, against
    the reference, every part in chunks."""
    case = PARTS[name]
    fw = frameworks()[target]
    module = modules(name, target)
    module.MAX_TEMP_BYTES = TINY
    tensors = make_inputs(case, build(op_spec(case, module.OP_NAME)))
    n0, c0, n1, c1 = module._tile_plan(*(fw.tensor(t.numpy()) for t in tensors))
    assert (n0, n1) == (9, 7) and c0 < n0 and c1 < n1
    check_target(case, module, fw, seed=SEEDS[name])


def _arrays(names, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"x": (2, 9, 3), "z": (2, 7, 3)}
    return [rng.uniform(-1, 1, shapes[n]) for n in names]


@pytest.mark.parametrize("name", sorted(PARTS))
def test_tensorflow_tiling_in_parts_under_unknown_sizes_and_xla(name, modules):
    module = modules(name)
    tensors = [tf.constant(a) for a in _arrays(module.INPUTS)]
    outputs = module.forward(*tensors)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    rng = np.random.default_rng(3)
    grads = [tf.constant(rng.standard_normal(o.shape)) for o in outputs]
    want = module.vjp(*tensors, *grads)
    module.MAX_TEMP_BYTES = TINY
    spec = [tf.TensorSpec([None] * len(t.shape), t.dtype) for t in tensors]
    spec += [tf.TensorSpec([None] * len(g.shape), g.dtype) for g in grads]

    def vjp(*a):
        return module.vjp(*a)

    for run in (tf.function(vjp, input_signature=spec), tf.function(vjp, jit_compile=True)):
        for got, expected in zip(run(*tensors, *grads), want, strict=True):
            np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(PARTS))
def test_tiling_in_parts_splits_ties_equally(name, target, modules):
    """Every point of x equally near two copies of a point of z (and each copy's nearest
    points of x the same): in parts, the copies get equal gradients that add up to the
    single point's, as untiled."""
    module = modules(name, target)
    array = {"tensorflow": tf.constant, "pytorch": torch.tensor, "jax": jnp.asarray}[target]
    rng = np.random.default_rng(4)
    x, p = rng.standard_normal((2, 9, 3)), rng.standard_normal((2, 4, 3))
    z = np.concatenate([p, p], axis=1)  # m = 8: m and m + 4 tie for every n

    def vjp(*arrays, cotangents):
        got = module.vjp(*(array(a) for a in arrays), *(array(c) for c in cotangents))
        return [np.asarray(g) for g in got]

    def cotangents(m):
        if name == "chamfer_loss":
            return [rng.standard_normal(2)]
        return [rng.standard_normal((2, 9)), rng.standard_normal((2, m))]

    single_c = cotangents(4)
    both_c = (
        single_c if name == "chamfer_loss" else [single_c[0], np.concatenate([single_c[1]] * 2, 1)]
    )
    want_x, _ = vjp(x, z, cotangents=both_c)
    module.MAX_TEMP_BYTES = TINY
    plan = module._tile_plan(array(x), array(z))
    assert plan is not None and plan[1] < plan[0] == 9 and plan[3] < plan[2] == 8
    grad_x, grad_z = vjp(x, z, cotangents=both_c)
    np.testing.assert_allclose(grad_x, want_x, rtol=0, atol=1e-12)
    np.testing.assert_allclose(grad_z[:, :4], grad_z[:, 4:], rtol=0, atol=1e-12)
    # The d1 half ties; the d2 half's copies each get their own (equal) gradient.
    module.MAX_TEMP_BYTES = 2**40
    _, untiled_z = vjp(x, z, cotangents=both_c)
    np.testing.assert_allclose(grad_z, untiled_z, rtol=0, atol=1e-12)
    assert np.abs(grad_z).max() > 0.1


def test_training_steps_in_parts_equal_todays(modules):
    """Two SGD steps on loss = sum(sin(d1)) + sum(d2**2) of the two-output Chamfer
    distance: PyTorch eagerly, JAX under jit and grad, TensorFlow with a tape; in parts
    and untiled they agree to rounding."""

    def loss_of(outputs, lib):
        d1, d2 = outputs
        return sgd.total(lib.sin(d1), lib) + sgd.total(d2**2, lib)

    for target in ("pytorch", "jax", "tensorflow"):
        module = modules("chamfer_two_outputs", target)
        arrays = _arrays(module.INPUTS)
        want = sgd.two_steps(target, module, arrays, loss_of, lr=0.01)
        module.MAX_TEMP_BYTES = TINY
        got = sgd.two_steps(target, module, arrays, loss_of, lr=0.01)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-12, err_msg=target)


# ----------------------------------------------------------------------------- memory

# b = 2, n = 1200, m = 1000, c = 3: a [2, 1200, 1000] matrix (9.2 MiB in float32) per
# temporary, which today's modules (tiled along b) hold whole for each b
MEMORY = {"x": (2, 1200, 3), "z": (2, 1000, 3)}
BUDGET = 2**18  # TensorFlow and JAX
TORCH_BUDGET = 2**20  # fewer chunks: the profiler's events make each one slow


def _torch_step_peak(module, xs):
    """Peak bytes allocated by a training step's forward and backward (tests/peaks.py)."""

    def step():
        outputs = module.forward(*xs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        loss = sum(torch.sin(o).sum() for o in outputs)
        torch.autograd.grad(loss, xs)

    return torch_peak(step)


@pytest.mark.parametrize("name", sorted(PARTS))
def test_pytorch_tiled_in_parts_step_memory_is_bounded(name, modules):
    module = modules(name, "pytorch")
    xs = memory_inputs(module.INPUTS, MEMORY, lambda a: torch.tensor(a, requires_grad=True))
    module.MAX_TEMP_BYTES = 2**40
    untiled = _torch_step_peak(module, xs)
    module.MAX_TEMP_BYTES = TORCH_BUDGET
    assert module._tile_plan(*xs) is not None
    tiled = _torch_step_peak(module, xs)
    outputs = module.forward(*xs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    bound = TORCH_BUDGET + 4 * io_bytes([x.detach() for x in xs], [o.detach() for o in outputs])
    print(f"{name}: PyTorch step peak {untiled} -> {tiled} bytes, bound {bound}")
    assert untiled > 10 * bound, (untiled, bound)
    assert tiled <= bound, (tiled, untiled)


@pytest.mark.parametrize("name", sorted(PARTS))
def test_jax_tiled_in_parts_gradient_memory_is_bounded(name, modules):
    """The jitted gradient's temporaries (XLA's memory_analysis)."""
    module = modules(name, "jax")
    xs = memory_inputs(module.INPUTS, MEMORY, jnp.asarray)

    module.MAX_TEMP_BYTES = 2**40
    untiled = jax_step_memory(module, xs).temp_size_in_bytes
    module.MAX_TEMP_BYTES = BUDGET
    assert module._tile_plan(*xs) is not None
    tiled = jax_step_memory(module, xs).temp_size_in_bytes
    outputs = module.forward(*xs)
    bound = BUDGET + 4 * io_bytes(xs, outputs if isinstance(outputs, tuple) else (outputs,))
    print(f"{name}: JAX gradient temporaries {untiled} -> {tiled} bytes, bound {bound}")
    assert untiled > 10 * bound, (untiled, bound)
    assert tiled <= bound, (tiled, untiled)


def test_tensorflow_tiled_in_parts_step_memory_is_bounded(tmp_path):
    """TensorFlow's allocator statistics (BFC), in a fresh process: a training step."""
    cases = {name: (PARTS[name].formulas, MEMORY) for name in PARTS}
    found = tf_formula_peaks(cases, BUDGET, tmp_path)
    assert sorted(found) == sorted(PARTS)
    for name, m in found.items():
        bound = 4 * m["io"] + BUDGET
        print(f"{name}: TensorFlow step peak {m['untiled']} -> {m['tiled']} bytes, bound {bound}")
        assert m["untiled"] > 10 * bound, (name, m)
        assert m["tiled"] <= bound, (name, m)


def test_pytorch_compile_fullgraph_takes_the_parts(modules):
    """torch.compile(fullgraph=True) takes every part's loop, forward and backward, and
    gives the untiled module's values and gradients."""
    module = modules("chamfer_two_outputs", "pytorch")
    x, z = _arrays(module.INPUTS)
    rng = np.random.default_rng(2)
    g1, g2 = torch.tensor(rng.standard_normal((2, 9))), torch.tensor(rng.standard_normal((2, 7)))

    def loss(x, z):
        d1, d2 = module.forward(x, z)
        return (d1 * g1).sum() + (d2 * g2).sum()

    want = module.vjp(torch.tensor(x), torch.tensor(z), g1, g2)
    # torch.compile unrolls the chunk loops, tracing every chunk anew: a budget with a few
    # chunks per part, the last one shorter, takes the loops as TINY's chunks of one
    # position do, in a fraction of the time
    module.MAX_TEMP_BYTES = 4096
    leaves = [torch.tensor(a, requires_grad=True) for a in (x, z)]
    assert module._tile_plan(*leaves) == (9, 4, 7, 3)  # chunks of n: 4, 4, 1; of m: 3, 3, 1
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    compiled(*leaves).backward()
    for leaf, w in zip(leaves, want, strict=True):
        np.testing.assert_allclose(leaf.grad.numpy(), w.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(PARTS))
def test_pytorch_parts_skip_a_gradient_that_is_not_needed(name, modules, monkeypatch):
    """A step that needs x's gradient only (z is a constant): torch's needs_input_grad
    reaches every part's chunks, which return None for z instead of computing it, as the
    one-part tiled backward does; x's gradient is the untiled one."""
    module = modules(name, "pytorch")
    x, z = (torch.tensor(a) for a in _arrays(module.INPUTS))
    leaf = x.clone().requires_grad_(True)

    def gradient():
        outputs = module.forward(leaf, z)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return torch.autograd.grad(sum((o**2).sum() for o in outputs), [leaf])[0]

    want = gradient()
    module.MAX_TEMP_BYTES = TINY
    n0, c0, n1, c1 = module._tile_plan(x, z)
    returned = {0: [], 1: []}
    params = {
        k: list(inspect.signature(getattr(module, f"_part{k}_chunk_backward")).parameters)
        for k in returned
    }
    for k, calls in returned.items():
        chunk = getattr(module, f"_part{k}_chunk_backward")

        def recording(*args, _chunk=chunk, _calls=calls, **kwargs):
            _calls.append(_chunk(*args, **kwargs))
            return _calls[-1]

        monkeypatch.setattr(module, f"_part{k}_chunk_backward", recording)
    got = gradient()
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)
    assert [len(returned[0]), len(returned[1])] == [-(-n0 // c0), -(-n1 // c1)]
    for k, calls in returned.items():
        at_x, at_z = params[k].index("x"), params[k].index("z")  # the chunk's inputs come first
        for grads in calls:
            assert grads[at_z] is None, f"part {k} computed z's gradient, which is not needed"
            assert grads[at_x] is not None


@pytest.mark.parametrize("name", sorted(PARTS))
def test_jax_vmap_of_forward_and_grad_in_parts(name, modules):
    """jax.vmap over an extra leading axis, of forward and of its gradient, under jit: in
    parts (a scan per part) as in one piece."""
    module = modules(name, "jax")
    stacked = [
        jnp.stack([_arrays(module.INPUTS, seed)[k] for seed in range(3)])
        for k in range(len(module.INPUTS))
    ]

    def loss(*xs):
        outputs = module.forward(*xs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return sum(jnp.sum(jnp.sin(o)) for o in outputs)

    def both(*xs):
        return module.forward(*xs), jax.grad(loss, argnums=tuple(range(len(xs))))(*xs)

    want = jax.jit(jax.vmap(both))(*stacked)
    module.MAX_TEMP_BYTES = TINY
    batched = jax.vmap(both)  # a new function: traced afresh, with the budget above
    assert str(jax.make_jaxpr(batched)(*stacked)).count("scan") >= 2
    got = jax.jit(batched)(*stacked)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12, atol=1e-12)


# The full MMD of two clouds (a kernel two-sample statistic): three terms over three index
# pairs, the cross term subtracted and scaled; and a difference of Chamfer's directions.
KERNEL = "exp(-sum(({a}[b,{i},c] - {c}[b,{j},c])**2, c))"
SIGNED = {
    "mmd": Case(
        f"y[b] = mean({KERNEL.format(a='x', i='n', c='x', j='k')}, n, k)"
        f" + mean({KERNEL.format(a='z', i='m', c='z', j='l')}, m, l)"
        f" - 2 * mean({KERNEL.format(a='x', i='n', c='z', j='m')}, n, m)",
        {"x": (2, 9, 3), "z": (2, 7, 3)},
    ),
    "chamfer_difference": Case(
        f"y[b] = sum(min({DISTANCE}, m), n) - sum(min({DISTANCE}, n), m)",
        {"x": (2, 9, 3), "z": (2, 7, 3)},
        low=-3.0,
        high=3.0,
    ),
}


def test_a_subtracted_term_is_a_part_with_its_sign():
    tiling = compile_op(op_spec(SIGNED["mmd"], "Probe")).tiling
    assert [(p.tiling.index, p.tiling.summed) for p in tiling.parts] == [
        ("n", True),
        ("m", True),
        ("n", True),
    ]
    assert tiling.parts[2].formula.startswith("y[b] = -(2 * mean(")


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(SIGNED))
def test_signed_parts_are_exact(name, target, tmp_path):
    """forward, vjp and autodiff against the reference (TensorFlow: also the registered
    gradient and finite differences), every part in chunks."""
    case = SIGNED[name]
    module = generate(case, tmp_path, prefix="Signed", target=target)
    module.MAX_TEMP_BYTES = TINY
    tensors = make_inputs(case, build(op_spec(case, "Probe")))
    if target == "tensorflow":
        plan = module._tile_plan(*tensors)
        assert plan is not None and all(c < n for n, c in zip(plan[::2], plan[1::2], strict=True))
        check(case, module, seed=1)
        return
    fw = frameworks()[target]
    plan = module._tile_plan(*(fw.tensor(t.numpy()) for t in tensors))
    assert plan is not None and all(c < n for n, c in zip(plan[::2], plan[1::2], strict=True))
    check_target(case, module, fw, seed=1)


def test_pytorch_full_mmd_in_parts_is_bounded(tmp_path):
    """The full MMD's step, batch-tiled before (each b held three [n,m] matrices), within
    4x its inputs and outputs plus the budget in parts."""
    module = generate(SIGNED["mmd"], tmp_path, prefix="Signed", target="pytorch")
    xs = memory_inputs(module.INPUTS, MEMORY, lambda a: torch.tensor(a, requires_grad=True))
    module.MAX_TEMP_BYTES = 2**40
    untiled = _torch_step_peak(module, xs)
    module.MAX_TEMP_BYTES = TORCH_BUDGET
    assert module._tile_plan(*xs) is not None
    tiled = _torch_step_peak(module, xs)
    outputs = (module.forward(*xs),)
    bound = TORCH_BUDGET + 4 * io_bytes([x.detach() for x in xs], [o.detach() for o in outputs])
    print(f"mmd: PyTorch step peak {untiled} -> {tiled} bytes, bound {bound}")
    assert untiled > 10 * bound, (untiled, bound)
    assert tiled <= bound, (tiled, untiled)

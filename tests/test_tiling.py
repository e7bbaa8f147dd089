"""Tiling in the PyTorch and JAX targets (issue 16): with MAX_TEMP_BYTES set tiny, a tiled
module runs its chunk in a loop (a Python loop in PyTorch, jax.lax.scan in JAX), and its
forward and gradients -- vjp, autodiff through `forward`, the registered backward / `wrap`,
a training step -- equal the untiled module's in float64. For the windowed and pairwise
ops of this repo's symgrad.toml and three formulas of our own, each size different.

The TensorFlow target's tiling is tested in tests/test_tiling_tf.py.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from harness import load_module
from peaks import jax_step_memory
from window_ops import dilated_lightconv

from symgrad.pipeline import module_text
from symgrad.spec import OpSpec, parse_spec

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-12
_counter = itertools.count()


def _repo_op(name: str) -> OpSpec:
    spec = parse_spec((ROOT / "symgrad.toml").read_text(encoding="utf-8"), "symgrad.toml")
    return next(op for op in spec.ops if op.name == name)


@dataclass(frozen=True)
class Tiled:
    """An op, its input shapes (one size per index, all different) and attrs."""

    op: OpSpec
    shapes: dict[str, tuple[int, ...]]
    attrs: dict[str, int] = field(default_factory=dict)


CASES = {
    # x (b=2, i=11, c=3), z (b=2, j=7, c=3): tiled along i
    "chamfer": Tiled(_repo_op("ChamferDistance"), {"x": (2, 11, 3), "z": (2, 7, 3)}),
    # f1, f2 (b=2, i=5, j=4, c=6), r=1 (u = v = 3): tiled along i, positions i + tile_start
    "correlation": Tiled(
        _repo_op("Correlation"), {"f1": (2, 5, 4, 6), "f2": (2, 5, 4, 6)}, {"r": 1}
    ),
    # x (b=5, 13, c=3), w (k=2, c=3, o=4), i = 6: tiled along b
    "strided_conv1d": Tiled(
        _repo_op("StridedConv1d"), {"x": (5, 13, 3), "w": (2, 3, 4)}, {"s": 2, "d": 2, "p": 1}
    ),
    # A dilated depthwise 1-D window in its own layout (batch, channel, time): tiled along
    # c (undilated it is the frameworks' depthwise kernel, never tiled)
    "local_window": Tiled(
        OpSpec(
            "LocalWindow",
            ("y[b,c,t] = sum(w[c,k] * x[b,c,t+2*k-p], k)",),
            None,
            (("p", "int"),),
            (),
            "test [ops.LocalWindow]",
        ),
        {"w": (5, 3), "x": (2, 5, 11)},
        {"p": 1},
    ),
    # A sliding max, x (13), w (k=3), i = 11: no input is cut, so the chunk reads x at
    # i + tile_start and sizes i by tile_length
    "sliding_max": Tiled(
        OpSpec(
            "SlidingMax",
            ("y[i] = max(x[i+k] * w[k], k)",),
            None,
            (),
            (),
            "test [ops.SlidingMax]",
        ),
        {"x": (13,), "w": (3,)},
    ),
    # RWKV-4's WKV, its internal numerator and denominator [B, T, C] built from a
    # [B, T, T, C] sum: w, u (c=3), k, v (b=2, t=7, c=3); tiled along t, and each chunk
    # computes the internal tensors over its own positions of t
    "rwkv": Tiled(
        _repo_op("RwkvWkv"),
        {"w": (3,), "u": (3,), "k": (2, 7, 3), "v": (2, 7, 3)},
    ),
    # fairseq's lightconv, its taps dilated (`window_ops`), with its padding a let of the
    # filter's width: w (c=3, k=5), x (b=2, c=3, t=11); tiled along t, positions
    # t + tile_start, the let read unchanged
    "dilated_lightconv": Tiled(dilated_lightconv(), {"w": (3, 5), "x": (2, 3, 11)}),
    # A Gaussian (RBF) kernel sum over a second point set: tiled along i
    "rbf_sum": Tiled(
        OpSpec(
            "RbfSum",
            ("y[b,i] = sum(exp(-sum((x[b,i,c]-z[b,j,c])**2, c)), j)",),
            None,
            (),
            (),
            "test [ops.RbfSum]",
        ),
        {"x": (2, 9, 3), "z": (2, 7, 3)},
    ),
}


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """`modules(name, target)`: the case's module for a target, generated once."""
    folder = tmp_path_factory.mktemp("tiling")
    made = {}

    def module(name: str, target: str):
        if (name, target) not in made:
            text = module_text(CASES[name].op, "test.toml", target)
            stem = f"symgrad_tiling_{target}_{name}_{next(_counter)}"
            made[name, target] = load_module(text, folder, stem)
        return made[name, target]

    return module


def _arrays(name: str, module, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(CASES[name].shapes[n]) for n in module.INPUTS]


def budgets(module, arrays, attrs) -> list[int]:
    """Values of MAX_TEMP_BYTES that tile: the least a spec allows (1 KiB: at these sizes,
    one position per chunk or a few), and the least whose chunks hold several positions
    with a shorter last chunk, if the sizes allow."""
    found = [1024]
    default = module.MAX_TEMP_BYTES
    try:
        budget = 1024
        while budget < 2**26:
            module.MAX_TEMP_BYTES = budget
            plan = module._tile_plan(*arrays, **attrs)
            if plan is None:
                break
            n, c = plan[:2]  # a nested tiling's plan adds the inner level's (tile_nest)
            if 1 < c < n and n % c:
                found.append(budget)
                break
            budget = budget * 9 // 8
    finally:
        module.MAX_TEMP_BYTES = default
    return list(dict.fromkeys(found))


def _chunks(plan) -> int:
    """The chunks a plan runs: (n, c), or (n, c, n2, c2) for two levels (`tile_nest`), then
    the deeper levels' ((n3, c3), ...)."""
    levels = [*zip(plan[:4:2], plan[1:4:2], strict=True), *(plan[4] if len(plan) > 4 else ())]
    count = 1
    for n, c in levels:
        count *= -(-n // c)
    return count


@pytest.fixture
def budget_of(monkeypatch):
    """`budget_of(module, budget)`: set the module's MAX_TEMP_BYTES for this test."""

    def set_budget(module, budget):
        monkeypatch.setattr(module, "MAX_TEMP_BYTES", budget)

    return set_budget


def chunk_program(module) -> str:
    """The name of the function a tiled module runs per chunk: its one program `_compute`,
    or `_chunk_compute` where it keeps the op's and the chunk's apart (`tile_once`)."""
    return "_chunk_compute" if hasattr(module, "_chunk_compute") else "_compute"


def _counting(monkeypatch, module) -> list[int]:
    """Count the chunks the module computes (the chunk program's calls: `_compute`, or
    `_chunk_compute` where the module keeps two programs; and where the chunk's gradient
    reads no output, the backward's calls of what recomputes the chunk's intermediates:
    `_chunk_saved`, or `_recompute` where the one program serves it too)."""
    calls = []
    names = [chunk_program(module), "_chunk_saved"]
    if hasattr(module, "_tiled_backward") and "_recompute(" in inspect.getsource(
        module._tiled_backward
    ):
        names.append("_recompute")

    def counting(chunk):
        def counted(*args, **kwargs):
            calls.append(1)
            return chunk(*args, **kwargs)

        return counted

    for name in names:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, counting(getattr(module, name)))
    return calls


def _close(got, want, what):
    got, want = (np.asarray(x.detach() if isinstance(x, torch.Tensor) else x) for x in (got, want))
    assert got.shape == want.shape, what
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL, err_msg=what)


# ----------------------------------------------------------------------------- PyTorch


def _torch(arrays, requires_grad=True):
    return [torch.tensor(a, dtype=torch.float64, requires_grad=requires_grad) for a in arrays]


def _torch_reference(module, xs, attrs, grad):
    """Untiled forward, vjp and autograd through forward (the default budget)."""
    assert module._tile_plan(*xs, **attrs) is None, "the test sizes must fit the default"
    y = module.forward(*xs, **attrs)
    return y, module.vjp(*xs, grad, **attrs), torch.autograd.grad(y, xs, grad)


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_tiled_forward_and_gradients_equal_the_untiled(name, modules, monkeypatch, budget_of):
    module = modules(name, "pytorch")
    attrs = CASES[name].attrs
    xs = _torch(_arrays(name, module))
    y = module.forward(*xs, **attrs)
    grad = torch.tensor(np.random.default_rng(1).standard_normal(tuple(y.shape)))
    want_y, want_vjp, want_autograd = _torch_reference(module, xs, attrs, grad)
    calls = _counting(monkeypatch, module)
    for budget in budgets(module, xs, attrs):
        budget_of(module, budget)
        plan = module._tile_plan(*xs, **attrs)
        del calls[:]
        got_y = module.forward(*xs, **attrs)
        assert len(calls) == _chunks(plan), f"{name}: {len(calls)} chunks for {plan}"
        _close(got_y.detach(), want_y.detach(), f"{name} forward, budget {budget}")
        for got, want in zip(module.vjp(*xs, grad, **attrs), want_vjp, strict=True):
            _close(got, want, f"{name} vjp, budget {budget}")
        got_autograd = torch.autograd.grad(got_y, xs, grad)
        for got, want in zip(got_autograd, want_autograd, strict=True):
            _close(got, want, f"{name} autograd, budget {budget}")


def _sgd_steps(module, arrays, attrs, steps=2):
    """Two SGD steps on every input of loss = sum(forward(...)**2); the inputs after them."""
    params = [torch.nn.Parameter(torch.tensor(a)) for a in arrays]
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (module.forward(*params, **attrs) ** 2).sum()
        loss.backward()
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_training_step_tiled_equals_untiled(name, modules, budget_of):
    module = modules(name, "pytorch")
    attrs = CASES[name].attrs
    arrays = _arrays(name, module)
    want = _sgd_steps(module, arrays, attrs)
    budget_of(module, budgets(module, _torch(arrays), attrs)[-1])
    assert module._tile_plan(*_torch(arrays), **attrs) is not None
    for got, expected in zip(_sgd_steps(module, arrays, attrs), want, strict=True):
        _close(got, expected, f"{name} after two SGD steps")


@pytest.mark.parametrize("name", ["correlation", "rbf_sum"])
def test_torch_registered_op_backward_is_tiled(name, modules, monkeypatch, budget_of):
    """`register(op)` on a custom op: its backward runs in chunks when the plan says so."""
    module = modules(name, "pytorch")
    case = CASES[name]
    qualified = f"symgrad_tiling::{name}_{next(_counter)}"
    params = ", ".join([*(f"Tensor {n}" for n in module.INPUTS), *(f"int {a}" for a in case.attrs)])
    lib = torch.library.Library(qualified.split("::")[0], "FRAGMENT")
    lib.define(f"{qualified.split('::')[1]}({params}) -> Tensor")

    def kernel(*args):
        inputs, values = args[: len(module.INPUTS)], args[len(module.INPUTS) :]
        with torch.no_grad():
            return module._compute(*inputs, **dict(zip(module.ATTRS, values)))[0][0].clone()

    lib.impl(qualified.split("::")[1], kernel, "CompositeExplicitAutograd")
    module.register(qualified)
    namespace, _, short = qualified.partition("::")
    op = getattr(getattr(torch.ops, namespace), short)
    xs = _torch(_arrays(name, module))
    values = [case.attrs[a] for a in module.ATTRS]
    y = op(*xs, *values)
    grad = torch.tensor(np.random.default_rng(2).standard_normal(tuple(y.shape)))
    want = torch.autograd.grad(y, xs, grad)
    budget_of(module, budgets(module, xs, case.attrs)[-1])
    y = op(*xs, *values)
    calls = _counting(monkeypatch, module)
    got = torch.autograd.grad(y, xs, grad)
    plan = module._tile_plan(*xs, **case.attrs)
    assert len(calls) == _chunks(plan), f"the registered backward ran {len(calls)} chunks, {plan}"
    for g, w in zip(got, want, strict=True):
        _close(g, w, f"{name} registered backward")


@pytest.mark.parametrize("name", ["dilated_lightconv", "correlation"])
def test_torch_tiled_backward_recomputes_no_output(name, modules, monkeypatch, budget_of):
    """A chunk's gradient that reads no output of the chunk recomputes only the
    intermediates it reads (`_chunk_saved`, or the one program's `_recompute`), never the
    outputs' contraction: the backward calls the chunk's `_compute` not once."""
    module = modules(name, "pytorch")
    attrs = CASES[name].attrs
    xs = _torch(_arrays(name, module))
    grad = torch.ones_like(module.forward(*xs, **attrs))
    want = _torch_reference(module, xs, attrs, grad)[2]
    budget_of(module, budgets(module, xs, attrs)[-1])
    y = module.forward(*xs, **attrs)
    computed = []
    chunk = getattr(module, chunk_program(module))

    def counted(*args, **kwargs):
        computed.append(1)
        return chunk(*args, **kwargs)

    monkeypatch.setattr(module, chunk_program(module), counted)
    plan = module._tile_plan(*xs, **attrs)
    got = torch.autograd.grad(y, xs, grad)
    assert not computed, f"{name}: the backward recomputed {len(computed)} chunks' outputs"
    for g, w in zip(got, want, strict=True):
        _close(g, w, f"{name} tiled backward, {_chunks(plan)} chunks")


def test_torch_tiled_backward_is_twice_differentiable(modules, budget_of):
    """gradcheck and gradgradcheck through the tiled forward (a chunk loop of torch ops)."""
    module = modules("rbf_sum", "pytorch")
    rng = np.random.default_rng(5)
    xs = _torch([rng.standard_normal((1, 4, 2)), rng.standard_normal((1, 3, 2))])
    budget_of(module, 100)  # 384 bytes of temporaries: chunks of one position
    assert module._tile_plan(*xs) == (4, 1)
    assert torch.autograd.gradcheck(module.forward, xs)
    assert torch.autograd.gradgradcheck(module.forward, xs)


def test_torch_compile_fullgraph_of_a_tiled_module(modules, budget_of):
    """torch.compile(fullgraph=True) captures the tiled forward in one graph (the chunk
    loop unrolled, a shorter last chunk) and its backward through AOTAutograd. Traced
    without code generation: Inductor compiles it too, but takes 1.5-2.5 minutes on a
    busy two-core machine."""
    name = "correlation"
    module = modules(name, "pytorch")
    attrs = CASES[name].attrs
    xs = _torch(_arrays(name, module))
    grad = torch.tensor(np.random.default_rng(3).standard_normal((2, 5, 4, 3, 3)))
    want_y, want_vjp, _ = _torch_reference(module, xs, attrs, grad)
    budget = budgets(module, xs, attrs)[-1]
    budget_of(module, budget)
    n, c = module._tile_plan(*xs, **attrs)[:2]
    assert 1 < c < n and n % c, (n, c)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *a: module.forward(*a, **attrs), fullgraph=True, backend="aot_eager"
    )
    y = compiled(*xs)
    _close(y.detach(), want_y.detach(), "compiled forward")
    for got, want in zip(torch.autograd.grad(y, xs, grad), want_vjp, strict=True):
        _close(got, want, "compiled backward")


MEMORY_CASES = {
    # a [2, 700, 500] distance matrix
    "chamfer": ({"x": (2, 700, 3), "z": (2, 500, 3)}, {}),
    # a [2, 20, 7, 24, 7, 8] gathered window (r = 3)
    "correlation": ({"f1": (2, 20, 24, 8), "f2": (2, 20, 24, 8)}, {"r": 3}),
    # [2, 300, 300, 16] causal sums behind the internal tensors a and d
    "rwkv": ({"w": (16,), "u": (16,), "k": (2, 300, 16), "v": (2, 300, 16)}, {}),
    # a [3, 16, 500, 31] gathered window (K = 31 dilated, padding a let)
    "dilated_lightconv": ({"w": (16, 31), "x": (3, 16, 500)}, {}),
}


def _torch_memory(module, xs, attrs, args=None):
    """(bytes the forward keeps for the backward, peak bytes allocated by a training
    step's forward and backward, differentiating `xs` of the op's `args` (default: `xs`,
    every input). The peak is the running sum of the allocations and frees that
    torch.profiler records (profile_memory: its "[memory]" events), in the order they
    happen."""
    args = xs if args is None else args
    kept = []

    def pack(tensor):
        kept.append(tensor.untyped_storage().nbytes())
        return tensor

    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profile:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            y = module.forward(*args, **attrs)
        grads = torch.autograd.grad(torch.sin(y).sum(), xs)
        del y, grads
    events = [e for e in profile.profiler.kineto_results.events() if e.name() == "[memory]"]
    total = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        total += event.nbytes()
        peak = max(peak, total)
    return sum(kept), peak


@pytest.mark.parametrize("name", sorted(MEMORY_CASES))
def test_torch_tiled_training_step_memory_is_bounded(name, modules, budget_of):
    """A tiled forward keeps only its inputs for the backward, and a training step's peak
    allocation stays near the budget, where the untiled step holds several times more."""
    module = modules(name, "pytorch")
    shapes, attrs = MEMORY_CASES[name]
    rng = np.random.default_rng(6)
    xs = [
        torch.tensor(rng.standard_normal(shapes[n]), dtype=torch.float32, requires_grad=True)
        for n in module.INPUTS
    ]
    budget_of(module, 2**40)
    assert module._tile_plan(*xs, **attrs) is None
    kept_untiled, untiled = _torch_memory(module, xs, attrs)
    budget = 2**18
    budget_of(module, budget)
    assert module._tile_plan(*xs, **attrs) is not None
    kept, tiled = _torch_memory(module, xs, attrs)
    inputs = sum(x.nbytes for x in xs)
    with torch.no_grad():
        outputs = module.forward(*xs, **attrs).nbytes
    print(f"{name}: kept {kept_untiled} / {kept}, peak {untiled} / {tiled} (untiled / tiled)")
    assert kept == inputs, (kept, inputs)
    assert kept_untiled > 10 * inputs
    # The plan assumes a chunk holds 8 temporaries of the largest size (a Chamfer chunk
    # holds 5.5): the step stays within the budget plus 4x its inputs and outputs.
    assert tiled <= budget + 4 * (inputs + outputs), (tiled, untiled)
    assert untiled >= 4 * tiled, (tiled, untiled)


# ----------------------------------------------------------------------------- JAX


def _jax_grad(module, attrs, cotangent):
    def loss(*xs):
        return jnp.sum(module.forward(*xs, **attrs) * cotangent)

    return jax.grad(loss, argnums=tuple(range(len(module.INPUTS))))


def _jax_everything(module, attrs, cotangent):
    """forward, vjp and jax.grad through forward, as one new function (one XLA compile
    under jit; the plan is read when the function is traced)."""
    grad = _jax_grad(module, attrs, cotangent)

    def everything(*xs):
        return module.forward(*xs, **attrs), module.vjp(*xs, cotangent, **attrs), grad(*xs)

    return everything


@pytest.mark.parametrize("name", sorted(CASES))
def test_jax_tiled_forward_and_gradients_equal_the_untiled(name, modules, budget_of):
    """Under jax.jit: forward, vjp and jax.grad through forward, with chunks of several
    positions and a shorter last one."""
    module = modules(name, "jax")
    attrs = CASES[name].attrs
    xs = [jnp.asarray(a) for a in _arrays(name, module)]
    assert module._tile_plan(*xs, **attrs) is None, "the test sizes must fit the default"
    shape = jax.eval_shape(lambda *a: module.forward(*a, **attrs), *xs).shape
    cotangent = jnp.asarray(np.random.default_rng(1).standard_normal(shape))
    everything = _jax_everything(module, attrs, cotangent)
    assert "scan" not in str(jax.make_jaxpr(everything)(*xs))
    want = jax.jit(everything)(*xs)
    budget = budgets(module, xs, attrs)[-1]
    budget_of(module, budget)
    assert module._tile_plan(*xs, **attrs) is not None
    # JAX caches a function's trace: the budget is read when a new function is traced.
    everything = _jax_everything(module, attrs, cotangent)
    assert "scan" in str(jax.make_jaxpr(everything)(*xs))
    got = jax.jit(everything)(*xs)
    for what, g, w in zip(("forward", "vjp", "jax.grad"), got, want, strict=True):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
            _close(a, b, f"{name} {what}, budget {budget}")


def test_jax_tiled_eager_one_position_per_chunk(modules, monkeypatch, budget_of):
    """Eagerly, with the least budget (chunks of one position): forward and vjp."""
    name = "correlation"
    module = modules(name, "jax")
    attrs = CASES[name].attrs
    xs = [jnp.asarray(a) for a in _arrays(name, module)]
    want_y = module.forward(*xs, **attrs)
    cotangent = jnp.asarray(np.random.default_rng(1).standard_normal(want_y.shape))
    want_vjp = module.vjp(*xs, cotangent, **attrs)
    budget_of(module, 1024)
    # one row exceeds 1 KiB: one position of i, and of j, per chunk (tile_nest), and below
    # them one displacement u and two of v per chunk (the levels below the second)
    assert module._tile_plan(*xs, **attrs) == (5, 1, 4, 1, ((3, 1), (3, 2)))
    calls = _counting(monkeypatch, module)
    _close(module.forward(*xs, **attrs), want_y, f"{name} forward")
    assert calls, "the forward did not run in chunks"
    for got, want in zip(module.vjp(*xs, cotangent, **attrs), want_vjp, strict=True):
        _close(got, want, f"{name} vjp")


@pytest.mark.parametrize("name", ["correlation", "rbf_sum"])
def test_jax_vmap_of_tiled_forward_and_grad(name, modules, budget_of):
    """jax.vmap over an extra leading axis, of forward and of its gradient, under jit."""
    module = modules(name, "jax")
    attrs = CASES[name].attrs
    seeds = [_arrays(name, module, seed) for seed in range(3)]
    stacked = [jnp.stack([arrays[k] for arrays in seeds]) for k in range(len(module.INPUTS))]

    def loss(*xs):
        return jnp.sum(jnp.sin(module.forward(*xs, **attrs)))

    def both(*xs):
        return module.forward(*xs, **attrs), jax.grad(loss, argnums=tuple(range(len(xs))))(*xs)

    want = jax.jit(jax.vmap(both))(*stacked)
    budget_of(module, 1024)
    batched = jax.vmap(both)  # a new function: traced afresh, with the budget above
    assert "scan" in str(jax.make_jaxpr(batched)(*stacked))
    got = jax.jit(batched)(*stacked)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        _close(g, w, f"{name} vmap")


def _training(module, attrs):
    """Two SGD steps on loss = sum(forward(...)**2), and a Hessian-vector product, as
    one new function (traced afresh, so it reads the current budget)."""

    def loss(params):
        return jnp.sum(module.forward(*params, **attrs) ** 2)

    def step(params):
        grads = jax.grad(loss)(params)
        return tuple(p - 0.01 * g for p, g in zip(params, grads, strict=True))

    def both(params):
        return step(step(params)), jax.jvp(jax.grad(loss), (params,), (params,))[1]

    return both


@pytest.mark.parametrize("name", ["correlation", "strided_conv1d"])
def test_jax_training_step_and_second_order_tiled_equal_untiled(name, modules, budget_of):
    """Jitted: two SGD steps, and a Hessian-vector product (the tiled backward's own
    gradient, through its scan)."""
    module = modules(name, "jax")
    attrs = CASES[name].attrs
    xs = tuple(jnp.asarray(a) for a in _arrays(name, module))
    want = jax.jit(_training(module, attrs))(xs)
    budget_of(module, budgets(module, xs, attrs)[-1])
    assert module._tile_plan(*xs, **attrs) is not None
    training = _training(module, attrs)
    assert "scan" in str(jax.make_jaxpr(training)(xs))
    got = jax.jit(training)(xs)
    for what, g, w in zip(("two SGD steps", "Hessian-vector product"), got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            _close(a, b, f"{name} {what}")


def test_jax_wrap_uses_the_tiled_gradient(modules, monkeypatch, budget_of):
    """A primal of one's own through `wrap` gets the tiled gradient."""
    name = "correlation"
    module = modules(name, "jax")
    attrs = CASES[name].attrs
    xs = [jnp.asarray(a) for a in _arrays(name, module)]

    def primal(*arrays, **named):
        return module._compute(*arrays, **named)[0][0]

    wrapped = module.wrap(primal)
    cotangent = jnp.asarray(np.random.default_rng(4).standard_normal((2, 5, 4, 3, 3)))

    def grad(*arrays):
        return jax.vjp(lambda *a: wrapped(*a, **attrs), *arrays)[1](cotangent)

    want = grad(*xs)
    budget_of(module, 1024)
    calls = _counting(monkeypatch, module)
    got = grad(*xs)
    assert calls, "the gradient of a wrapped primal did not run in chunks"
    for g, w in zip(got, want, strict=True):
        _close(g, w, f"{name} wrap")


@pytest.mark.parametrize("target", ["pytorch", "jax"])
def test_tiled_chamfer_splits_ties_equally(target, modules, budget_of):
    """Every point of x is equally near two copies of a point of z: in chunks of one
    position, the two copies get equal gradients, which add up to the gradient of the
    single point without its copy (the tie mask is per chunk, and still splits)."""
    module = modules("chamfer", target)
    rng = np.random.default_rng(4)
    x, p = rng.standard_normal((2, 11, 3)), rng.standard_normal((2, 4, 3))
    z = np.concatenate([p, p], axis=1)  # j = 8: j and j + 4 tie for every i
    cotangent = rng.standard_normal((2, 11))
    array = torch.tensor if target == "pytorch" else jnp.asarray

    def vjp(*arrays):
        return [np.asarray(g) for g in module.vjp(*(array(a) for a in arrays))]

    single_x, single = vjp(x, p, cotangent)
    budget_of(module, 1024)
    n, c = module._tile_plan(array(x), array(z))
    assert c < n == 11
    grad_x, grad_z = vjp(x, z, cotangent)
    np.testing.assert_allclose(grad_x, single_x, rtol=0, atol=TOL)
    np.testing.assert_array_equal(grad_z[:, :4], grad_z[:, 4:])
    np.testing.assert_allclose(grad_z[:, :4] + grad_z[:, 4:], single, rtol=0, atol=TOL)
    assert np.abs(single).max() > 0.1


@pytest.mark.parametrize("target", ["pytorch", "jax"])
def test_every_module_exposes_max_temp_bytes(target, modules):
    """MAX_TEMP_BYTES is in every module (the spec's default: 16 MiB), tiled or not."""
    for name in ("chamfer", "rbf_sum"):
        assert modules(name, target).MAX_TEMP_BYTES == 16 * 2**20
    for path in (ROOT / {"pytorch": "generated_torch", "jax": "generated_jax"}[target]).glob(
        "[a-z]*.py"
    ):
        assert "\nMAX_TEMP_BYTES = 16777216\n" in path.read_text(encoding="utf-8"), path


@pytest.mark.parametrize("name", sorted(MEMORY_CASES))
def test_jax_tiled_training_step_memory_is_bounded(name, modules, budget_of):
    """The compiled gradient's temporaries (XLA's memory_analysis) stay near the budget
    when tiled, at sizes whose untiled gradient holds many times more."""
    module = modules(name, "jax")
    rng = np.random.default_rng(6)
    shapes, attrs = MEMORY_CASES[name]
    xs = [jnp.asarray(rng.standard_normal(shapes[n]), jnp.float32) for n in module.INPUTS]

    budget_of(module, 2**40)
    assert module._tile_plan(*xs, **attrs) is None
    untiled = jax_step_memory(module, xs, attrs).temp_size_in_bytes
    budget = 2**18
    budget_of(module, budget)
    assert module._tile_plan(*xs, **attrs) is not None
    tiled = jax_step_memory(module, xs, attrs).temp_size_in_bytes
    inputs_and_outputs = sum(x.nbytes for x in xs) * 2
    print(f"{name}: gradient temporaries {untiled} bytes untiled, {tiled} tiled at {budget}")
    assert tiled <= budget + 2 * inputs_and_outputs, (tiled, untiled)
    assert untiled >= 8 * tiled, (tiled, untiled)

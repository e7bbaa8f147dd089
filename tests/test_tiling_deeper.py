"""Tiling below the second level (`symgrad/tile_nest.py`): FlowNet's correlation, cut along
the row i, then the column j, still gathers the window [b, c, u, v] at one position; a third
level cuts the displacement u, a fourth v. Exact in every target on every path, and a
training step stays under its bound where two levels do not.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from harness import Case, check, generate
from peaks import jax_step_bytes, tf_swapped_plan_peaks
from tiling_steps import compiled

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp

FORMULA = "y[b,u,v,i,j] = sum(x1[b,c,i,j] * x2[b, c, i + u - r, j + v - r], c)"
RANGES = {"u": "2*r + 1", "v": "2*r + 1"}
# b = 2, c = 5, i = 3, j = 4, u = v = 3: every level has more than one position
SMALL = Case(
    FORMULA,
    {"x1": (2, 5, 3, 4), "x2": (2, 5, 3, 4)},
    attrs={"r": 1},
    ranges=RANGES,
    sizes={"u": 3, "v": 3},
)
TINY = 1  # every level runs in chunks of one position


def test_correlations_are_cut_along_their_displacements_below_the_position():
    for name in ("Correlation", "MmcvCorrelation"):
        tiling = compiled(name).tiling
        levels = (tiling.index, tiling.inner.index, *(d.index for d in tiling.deeper))
        assert levels == ("i", "j", "u", "v"), name


@pytest.mark.parametrize("name", ["NattenAv2d", "NattenQk2d", "CcAttentionMap", "DeformConv2d"])
def test_ops_whose_position_is_a_window_or_has_no_displacement_keep_two_levels(name):
    """NATTEN's position holds one window about (i, j); CCNet's map and the deformable
    convolution have no output index a read moves by, below the second level."""
    tiling = compiled(name).tiling
    assert tiling.inner is not None and tiling.deeper == (), name


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("deeper")


@pytest.fixture(scope="module")
def modules(folder):
    return {
        t: generate(SMALL, folder, prefix="Deeper", target=t)
        for t in ("tensorflow", "pytorch", "jax")
    }


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_four_levels_equal_the_untiled_module_on_every_path(target, modules):
    """forward, vjp, the registered gradient and a tape (TF), autograd (PyTorch), jax.vjp
    and jit (JAX), and a training step: in chunks of one position of every level, equal
    to the untiled module in float64."""
    from frameworks import FRAMEWORKS, inputs, run_everywhere, train_step

    module, fw = modules[target], FRAMEWORKS[target]
    module.MAX_TEMP_BYTES = 2**40
    want = run_everywhere(fw, module, SMALL), train_step(fw, module, SMALL)
    module.MAX_TEMP_BYTES = TINY
    plan = module._tile_plan(*inputs(SMALL, module, fw), **SMALL.attrs)
    assert plan == (3, 1, 4, 1, ((3, 1), (3, 1))), plan
    try:
        (outputs, grads), step = run_everywhere(fw, module, SMALL), train_step(fw, module, SMALL)
    finally:
        module.MAX_TEMP_BYTES = 2**40
    for how, got in outputs.items():
        for g, w in zip(got, want[0][0][how], strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=how)
    for how, got in grads.items():
        for g, w in zip(got, want[0][1][how], strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=how)
    for g, w in zip(step["grads"], want[1]["grads"], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg="training step")


def test_tensorflow_four_levels_match_tf_autodiff_also_with_unknown_sizes(modules):
    """Against TF's own autodiff of the formula (`check`), in chunks of one position; and
    under tf.function with unknown sizes, where the plan is computed in the graph."""
    module = modules["tensorflow"]
    module.MAX_TEMP_BYTES = TINY
    try:
        check(SMALL, module)
        rng = np.random.default_rng(3)
        xs = [tf.constant(rng.standard_normal((2, 5, 3, 4))) for _ in range(2)]
        spec = [tf.TensorSpec([None] * 4, tf.float64)] * 2

        @tf.function(input_signature=spec)
        def step(x1, x2):
            with tf.GradientTape() as tape:
                tape.watch([x1, x2])
                loss = tf.reduce_sum(tf.sin(module.forward(x1, x2, r=1)))
            return tape.gradient(loss, [x1, x2])

        got = step(*xs)
        module.MAX_TEMP_BYTES = 2**40
        want = step(*xs)
    finally:
        module.MAX_TEMP_BYTES = 2**40
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-12, atol=1e-12)


def test_pytorch_four_levels_compile_with_fullgraph(modules):
    """torch.compile(fullgraph=True) unrolls every level's Python loop (a budget that cuts
    u in two chunks: few chunks to unroll); backward through AOTAutograd, without Inductor's
    code generation (as the other tiled modules' compile tests; the unrolled graph is what
    is asserted, and Inductor spent most of this test's time compiling C++)."""
    module = modules["pytorch"]
    rng = np.random.default_rng(5)
    # i = 2, j = 2 (the module takes any size): 2 x 2 x 2 chunk calls to unroll, not 24
    xs = [torch.tensor(rng.standard_normal((2, 5, 2, 2)), requires_grad=True) for _ in range(2)]

    def loss(x1, x2):
        return torch.sin(module.forward(x1, x2, r=1)).sum()

    def step(f):
        return torch.autograd.grad(f(*xs), xs)

    want = step(loss)
    # one position of (i, j) holds 2*5*3*3 floats (8 bytes, 8 held): 2 of 3 u fit
    module.MAX_TEMP_BYTES = 2 * 5 * 3 * 2 * 8 * 8
    try:
        assert module._tile_plan(*xs, r=1) == (2, 1, 2, 1, ((3, 2), (3, 3)))
        got = step(torch.compile(loss, fullgraph=True, backend="aot_eager"))
    finally:
        module.MAX_TEMP_BYTES = 2**40
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.detach().numpy(), w.detach().numpy(), rtol=1e-12)


def test_jax_four_levels_under_jit_vmap_and_grad(modules):
    module = modules["jax"]
    rng = np.random.default_rng(6)
    xs = [jnp.asarray(rng.standard_normal((2, 5, 3, 4))) for _ in range(2)]

    def loss(x1, x2):
        return jnp.sum(jnp.sin(module.forward(x1, x2, r=1)))

    def grads():  # traced anew: under the current budget
        direct = jax.jit(jax.grad(loss, argnums=(0, 1)))(*xs)
        mapped = jax.vmap(jax.grad(loss, argnums=(0, 1)))(*(x[None] for x in xs))
        return [*direct, *(m[0] for m in mapped)]

    want = grads()
    module.MAX_TEMP_BYTES = TINY
    try:
        got = grads()
    finally:
        module.MAX_TEMP_BYTES = 2**40
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ peaks

# FlowNet's 21 x 21 displacements at 64 channels over 6 x 4 positions: one position's
# window [c, u, v] is 2.1x the inputs and outputs, so holding a few at once (two levels)
# exceeds the bound, 4x the inputs and outputs plus the budget.
PEAK = {"shape": (1, 64, 6, 4), "r": 10, "budget": 2**14}


def _peak_arrays():
    rng = np.random.default_rng(9)
    return [rng.standard_normal(PEAK["shape"]).astype(np.float32) for _ in range(2)]


def _bound():
    io = sum(a.nbytes for a in _peak_arrays()) + 21 * 21 * 6 * 4 * 4
    return 4 * io + PEAK["budget"]


def two_levels(plan_deeper):
    """In place of the plan of the levels below the second: every one of them whole (two
    levels, as before)."""

    def plan(counts, volumes, itemsize):
        return tuple((n, n) for n in counts[2:])

    return plan


def _check(target, deeper, two):
    bound = _bound()
    print(f"{target}: two levels {two / bound:.2f}x the bound, four levels {deeper / bound:.2f}x")
    assert two > bound, "the size does not test the bound"
    assert deeper <= bound


@pytest.fixture(scope="module")
def peak_module(folder):
    case = Case(FORMULA, {"x1": PEAK["shape"], "x2": PEAK["shape"]}, attrs={"r": 10}, ranges=RANGES)
    return {t: generate(case, folder, prefix="DeeperPeak", target=t) for t in ("tensorflow", "jax")}


def test_tensorflow_step_is_bounded_where_two_levels_are_not(folder, peak_module):
    found = tf_swapped_plan_peaks(
        folder,
        peak_module["tensorflow"].__name__,
        "test_tiling_deeper:_peak_arrays",
        {"r": 10},
        PEAK["budget"],
        "_plan_deeper",
        "test_tiling_deeper:two_levels",
    )
    _check("tensorflow", found["planned"], found["swapped"])


def test_jax_step_is_bounded_where_two_levels_are_not(peak_module, monkeypatch):
    module = peak_module["jax"]
    args = [jnp.asarray(a) for a in _peak_arrays()]
    monkeypatch.setattr(module, "MAX_TEMP_BYTES", PEAK["budget"])
    deeper = jax_step_bytes(module, args, {"r": 10})
    monkeypatch.setattr(module, "_plan_deeper", two_levels(module._plan_deeper))
    _check("jax", deeper, jax_step_bytes(module, args, {"r": 10}))

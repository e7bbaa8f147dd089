"""Linear first-order recurrences lower to an associative scan (symgrad/assoc_scan.py),
run in chunks of as many positions as fit MAX_TEMP_BYTES. Here the budget is set to a few
positions so that the chunks, the carry between them and an uneven last chunk are all
exercised; forward and gradient still match the loops of tests/test_recurrences.py
exactly (float64, a different size per index)."""

from __future__ import annotations

import numpy as np
import pytest
from frameworks import FRAMEWORKS
from test_recurrences import CASES, _directional, inputs_for

from symgrad.assoc_scan import BY_DEFAULT, PER_POSITION, linear


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("assoc")


_MODULES: dict = {}


def module_for(case, target, folder):
    """The case's module with the associative scan, in every target (TensorFlow's is not
    its default; see `assoc_scan.BY_DEFAULT`)."""
    from frameworks import _enable_x64
    from harness import load_module

    from symgrad.scan_render import module_text

    if target == "jax":
        _enable_x64()
    if (case, target) not in _MODULES:
        text = module_text(CASES[case][0], "test", target, associative=True)
        _MODULES[case, target] = load_module(text, folder, f"assoc_{case}_{target}")
    return _MODULES[case, target]


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_each_target_takes_its_default_scan(target):
    """PyTorch and JAX generate the associative scan for a linear recurrence; TensorFlow
    the sequential scan (its associative scan went over the memory bound at L = 8192)."""
    from symgrad.scan_render import module_text

    text = module_text(CASES["selective_scan"][0], "test", target)
    assert ("associative" in text.split('"""')[1].lower()) == (target in BY_DEFAULT), target


def test_only_linear_first_order_recurrences_take_the_associative_scan():
    """Recognised from the derived step: its partial in the previous state does not read
    the state. lfilter (order k), two lags and tanh/matrix RNNs keep the sequential scan."""
    linear_cases = {c for c, (spec, _, _) in CASES.items() if linear(spec) is not None}
    assert linear_cases == {"linear", "init", "init_inline", "reverse", "selective_scan"}
    found = linear(CASES["selective_scan"][0])
    assert found.a_text == "exp(A[d,n]*delta[b,d,t])"
    assert found.coef.formulas[1] == "coefb[b, d, n, t] = B[b,n,t]*delta[b,d,t]*x[b,d,t]"


def _budget(case, shapes, positions, target):
    """MAX_TEMP_BYTES for chunks of `positions` positions (float64)."""
    spec = CASES[case][0]
    found = linear(spec)
    state = 1
    for name, axis in found.plan.scan.state_axes:
        state *= shapes[name][axis]
    return positions * PER_POSITION[target] * state * 8


# Each case in one target, taking turns, plus the selective scan everywhere.
CHUNKED = [
    ("selective_scan", "tensorflow"),
    ("selective_scan", "pytorch"),
    ("selective_scan", "jax"),
    ("init", "jax"),
    ("init_inline", "tensorflow"),
    ("reverse", "pytorch"),
    ("linear", "tensorflow"),
]


@pytest.mark.parametrize(("case", "target"), CHUNKED)
def test_chunked_forward_and_gradient_match_loop(case, target, folder):
    """Chunks of 2 positions over a length of 7 (or 6, 5): the state carried between
    chunks, the adjoint's pending part carried back, the initial step in the first chunk
    only, the last chunk short."""
    _, shapes, ref = CASES[case]
    module = module_for(case, target, folder)
    names = module.INPUTS
    values = inputs_for(shapes, seed=21)
    fw = FRAMEWORKS[target]
    args = [fw.tensor(values[n]) for n in names]
    want = ref(*[values[n] for n in names])
    rng = np.random.default_rng(22)
    grads_out = [rng.standard_normal(w.shape) for w in want]
    default = module.MAX_TEMP_BYTES
    try:
        module.MAX_TEMP_BYTES = _budget(case, shapes, 2, target)
        got = module.forward(*args)
        found = module.vjp(*args, *[fw.tensor(g) for g in grads_out])
    finally:
        module.MAX_TEMP_BYTES = default
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(fw.numpy(g), w, rtol=1e-10, atol=1e-12)
    for k, name in enumerate(names):
        v, fd = _directional(ref, values, names, grads_out, k, rng)
        mine = np.sum(fw.numpy(found[k]) * v)
        np.testing.assert_allclose(mine, fd, rtol=1e-6, atol=1e-8, err_msg=name)


def test_tensorflow_chunks_with_unknown_dims_and_xla(folder):
    """Under tf.function with every dim unknown the chunk length is computed when the
    graph runs (the budget read at call time) and the log-depth scan is a tf.while_loop;
    under jit_compile=True it compiles with XLA. Chunks of 2 positions."""
    import tensorflow as tf

    module = module_for("selective_scan", "tensorflow", folder)
    _, shapes, ref = CASES["selective_scan"]
    values = inputs_for(shapes, seed=7)
    args = [tf.constant(values[n]) for n in module.INPUTS]
    want = ref(*[values[n] for n in module.INPUTS])[0]
    g_y = np.random.default_rng(8).standard_normal(want.shape)
    expected = module.vjp(*args, tf.constant(g_y))

    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = module.forward(*xs)
        return y, tape.gradient(y, xs, output_gradients=tf.constant(g_y))

    signature = [
        tf.TensorSpec([None] * len(s), tf.float64) for s in (shapes[n] for n in module.INPUTS)
    ]
    default = module.MAX_TEMP_BYTES
    try:
        module.MAX_TEMP_BYTES = _budget("selective_scan", shapes, 2, "tensorflow")
        for compiled in (
            tf.function(step, input_signature=signature),
            tf.function(step, jit_compile=True),
        ):
            y, grads = compiled(*args)
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-10)
            for g, e in zip(grads, expected, strict=True):
                np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-10, atol=1e-12)
    finally:
        module.MAX_TEMP_BYTES = default


def _check_compiled_step(case, positions, folder, seed):
    """A training step of `case`'s PyTorch module in chunks of `positions` positions under
    torch.compile(fullgraph=True, aot_eager): its loss equals the loop's, its gradients
    the module's eager vjp."""
    import torch

    module = module_for(case, "pytorch", folder)
    _, shapes, ref = CASES[case]
    values = inputs_for(shapes, seed=seed)
    leaves = [torch.tensor(values[n], requires_grad=True) for n in module.INPUTS]
    want = ref(*[values[n] for n in module.INPUTS])[0]
    g_y = torch.tensor(np.random.default_rng(seed + 1).standard_normal(want.shape))
    default = module.MAX_TEMP_BYTES
    try:
        module.MAX_TEMP_BYTES = _budget(case, shapes, positions, "pytorch")
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda *xs: (module.forward(*xs) * g_y).sum(), fullgraph=True, backend="aot_eager"
        )
        value = compiled(*leaves)
        value.backward()
        expected = module.vjp(*[x.detach() for x in leaves], g_y)
    finally:
        module.MAX_TEMP_BYTES = default
    np.testing.assert_allclose(value.item(), float((want * g_y.numpy()).sum()), rtol=1e-10)
    for x, e in zip(leaves, expected, strict=True):
        np.testing.assert_allclose(x.grad.numpy(), e.numpy(), rtol=1e-10, atol=1e-12)


def test_pytorch_compile_fullgraph_of_the_associative_scan(folder):
    """torch.compile(fullgraph=True) takes the chunked forward and backward."""
    _check_compiled_step("selective_scan", 4, folder, seed=9)


@pytest.mark.parametrize("positions", [1, 2])
def test_pytorch_compile_fullgraph_of_chunks_of_one_position(positions, folder):
    """Chunks of one position (every chunk, or the last of 7 positions in chunks of 2):
    torch.compile(fullgraph=True) failed on the cond around the log-depth scan there (an
    assertion on its branches' strides; found by an adversarial trial). One position is
    the loop's own step, with no cond."""
    _check_compiled_step("linear", positions, folder, seed=5)

"""A sequential scan's gradient keeps levels of checkpoints chosen from MAX_TEMP_BYTES at
call time (`_chunk_lengths` in templates/scan_plan.py.j2): one level of about sqrt(n)
chunks when its windows of states fit, more when they do not. Every plan computes the
same values: forward and gradient under a budget that forces several levels equal the
module's under the default budget and the NumPy loops of tests/test_recurrences.py, in
float64, at lengths that no level divides."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from frameworks import FRAMEWORKS, _enable_x64
from harness import check_second_derivatives, load_module, op_spec
from test_recurrences import CASES, inputs_for
from test_tiling_adversarial_4 import RWKV5

from symgrad import scan_render

# (case, time axis of each input with one, length): at budget 0, 23 and 19 take two
# levels of 9 and 3, 26 two of 9 and 3 (the last chunk short), 29 four of 16, 8, 4, 2
SEQUENCES = {
    "rnn": ({"x": 1}, 23),
    "lfilter": ({"x": 1}, 19),
    "reverse_lagged": ({"r": 1, "g": 1}, 29),
    "init_inline": ({"a": 1, "x": 1}, 26),
    "lagged_input": ({"a": 1, "x": 1}, 17),
    "two_lags": ({"x": 1}, 1),
}


def _module(spec, target, folder, stem):
    if target == "jax":
        _enable_x64()
    text = scan_render.module_text(spec, "test", target, associative=False)
    return load_module(text, folder, stem)


def _run(module, fw, values, cotangents):
    args = [fw.tensor(values[n]) for n in module.INPUTS]
    got = module.forward(*args)
    got = got if isinstance(got, tuple) else (got,)
    found = module.vjp(*args, *[fw.tensor(c) for c in cotangents])
    return [fw.numpy(g) for g in got], [fw.numpy(f) for f in found]


def test_chunk_lengths_follow_the_budget(tmp_path):
    """One level of ceil(sqrt(n)) when 2 sqrt(n) windows fit the budget; below, the fewest
    levels (each length a multiple of the next, covering n) whose windows fit; below any
    plan, the one holding the fewest windows."""
    module = _module(CASES["rnn"][0], "pytorch", tmp_path, "levels_plan")
    window = 1000
    for n in (1, 2, 17, 64, 1000, 4096):
        module.MAX_TEMP_BYTES = 2**40
        assert module._chunk_lengths(n, window) == (math.isqrt(n - 1) + 1,)
        for budget in (0, 12 * window, 40 * window, 100 * window):
            module.MAX_TEMP_BYTES = budget
            lengths = module._chunk_lengths(n, window)
            c = lengths[-1]
            assert all(a == c * b for a, b in itertools.pairwise(lengths))
            assert c ** (len(lengths) + 1) >= n
            held = (len(lengths) + 1) * c
            plans = []
            for levels in range(1, n.bit_length() + 2):
                k = next(k for k in range(1, n + 2) if k ** (levels + 1) >= n)
                plans.append(((levels + 1) * k, levels))
            fitting = [levels for h, levels in plans if h * window <= budget]
            if fitting:
                assert len(lengths) == min(fitting) and held * window <= budget
            else:
                assert held == min(h for h, _ in plans)
    module.MAX_TEMP_BYTES = 12 * window
    assert module._chunk_lengths(64, window) == (16, 4)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("case", sorted(SEQUENCES))
def test_levels_of_checkpoints_compute_the_same_values(case, target, tmp_path):
    spec, shapes, ref = CASES[case]
    axes, n = SEQUENCES[case]
    shapes = {
        name: tuple(n if k == axes.get(name) else d for k, d in enumerate(shape))
        for name, shape in shapes.items()
    }
    module = _module(spec, target, tmp_path, f"levels_{case}_{target}")
    fw = FRAMEWORKS[target]
    values = inputs_for(shapes, seed=7)
    want = ref(*[values[name] for name in module.INPUTS])
    rng = np.random.default_rng(8)
    cotangents = [rng.standard_normal(w.shape) for w in want]
    plain = _run(module, fw, values, cotangents)
    for g, w in zip(plain[0], want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    module.MAX_TEMP_BYTES = 0
    if n > 1:
        window = module._window_bytes(*[fw.tensor(values[m]) for m in module.INPUTS])
        assert len(module._chunk_lengths(n, window)) > 1
    outputs, grads = _run(module, fw, values, cotangents)
    for g, w in zip(outputs, plain[0], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13)
    for name, g, w in zip(module.INPUTS, grads, plain[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13, err_msg=name)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_rwkv5_under_levels_of_checkpoints(target, tmp_path):
    """RWKV-5's matrix state (a coupled recurrence, its state internal) through four levels: the same forward and gradient as under the default budget."""
    shapes = dict(RWKV5.shapes, r=(2, 29, 2, 3), k=(2, 29, 2, 3), v=(2, 29, 2, 3))
    module = _module(op_spec(RWKV5, "Rwkv5Levels"), target, tmp_path, f"levels_rwkv5_{target}")
    fw = FRAMEWORKS[target]
    values = inputs_for(shapes, seed=9)
    values["w"] = np.random.default_rng(10).uniform(0.3, 0.95, shapes["w"])
    cotangents = [np.random.default_rng(11).standard_normal((2, 29, 2, 3))]
    plain = _run(module, fw, values, cotangents)
    module.MAX_TEMP_BYTES = 0
    window = module._window_bytes(*[fw.tensor(values[m]) for m in module.INPUTS])
    assert len(module._chunk_lengths(29, window)) == 4
    outputs, grads = _run(module, fw, values, cotangents)
    np.testing.assert_allclose(outputs[0], plain[0][0], rtol=1e-12, atol=1e-13)
    for name, g, w in zip(module.INPUTS, grads, plain[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13, err_msg=name)


def test_jax_levels_under_jit_vmap_and_grad(tmp_path):
    """At budget 0 (two levels of checkpoints for 23 positions) the JAX module works under
    jit, vmap and grad: a batch equals its members one by one, and the jitted gradient of
    a loss equals the vjp under the default budget."""
    import jax
    import jax.numpy as jnp

    spec, _, ref = CASES["rnn"]
    module = _module(spec, "jax", tmp_path, "levels_rnn_jit")
    values = inputs_for({"W": (3, 3), "x": (2, 23, 3)}, seed=12)
    w, x = (jnp.asarray(values[n]) for n in module.INPUTS)
    cotangent = jnp.asarray(np.random.default_rng(13).standard_normal(x.shape))
    plain = module.vjp(w, x, cotangent)
    module.MAX_TEMP_BYTES = 0
    assert len(module._chunk_lengths(23, module._window_bytes(w, x))) == 2
    batched = jax.jit(jax.vmap(module.forward, in_axes=(None, 0)))(w, jnp.stack([x, 0.5 * x]))
    np.testing.assert_allclose(batched[1], ref(values["W"], 0.5 * values["x"])[0], rtol=1e-10)
    grads = jax.jit(jax.grad(lambda w, x: (module.forward(w, x) * cotangent).sum(), (0, 1)))(w, x)
    for g, want in zip(grads, plain, strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-13)


def test_tensorflow_plans_levels_when_the_graph_runs(tmp_path):
    """Where the length is known only when the graph runs, TensorFlow plans the levels then
    (`_runtime_chunk_lengths`): the plan `_chunk_lengths` makes where it has at most
    `_RUNTIME_LEVELS` levels (the last length repeated), else a covering plan of that many
    levels holding the fewest windows; and under tf.function with every dim unknown, RWKV-5
    over 81 positions in three levels (27, 9, 3: twelve windows against the budget) gives
    the forward and gradient of the default budget."""
    import tensorflow as tf

    module = _module(op_spec(RWKV5, "Rwkv5Runtime"), "tensorflow", tmp_path, "runtime_rwkv5")
    most = module._RUNTIME_LEVELS
    window = 1000
    for n in (1, 2, 3, 17, 29, 64, 100, 1000, 4096):
        for budget in (0, 6 * window, 12 * window, 40 * window, 2**40):
            module.MAX_TEMP_BYTES = budget
            static = module._chunk_lengths(n, window)
            found = tuple(int(x) for x in module._runtime_chunk_lengths(tf.constant(n), window))
            if len(static) <= most:
                assert found == static + static[-1:] * (most - len(static)), (n, budget)
            else:
                c = found[-1]
                levels = [a // b for a, b in itertools.pairwise(found)].count(c) + 1
                assert c ** (levels + 1) >= n and found[0] == c**levels, (n, budget, found)
                held = min(
                    (k + 1) * next(c for c in range(1, n + 1) if c ** (k + 1) >= n)
                    for k in range(1, most + 1)
                )
                assert (levels + 1) * c == held, (n, budget, found)

    shapes = dict(RWKV5.shapes, r=(2, 81, 2, 3), k=(2, 81, 2, 3), v=(2, 81, 2, 3))
    values = inputs_for(shapes, seed=9)
    values["w"] = np.random.default_rng(10).uniform(0.3, 0.95, shapes["w"])
    cotangent = np.random.default_rng(11).standard_normal((2, 81, 2, 3))
    args = [tf.constant(values[m]) for m in module.INPUTS]
    module.MAX_TEMP_BYTES = 2**40
    plain = [module.forward(*args), *module.vjp(*args, tf.constant(cotangent))]
    module.MAX_TEMP_BYTES = 12 * module._window_bytes(*args)
    assert module._chunk_lengths(81, module._window_bytes(*args)) == (27, 9, 3)
    spec = [tf.TensorSpec([None] * len(values[m].shape), tf.float64) for m in module.INPUTS]

    @tf.function(input_signature=[*spec, tf.TensorSpec([None] * 4, tf.float64)])
    def unknown(*xs):
        lengths = module._lengths_of(tf.shape(xs[1])[1], *xs[:-1])
        return [module.forward(*xs[:-1]), *module.vjp(*xs), tf.stack(lengths)]

    *got, lengths = unknown(*args, tf.constant(cotangent))
    assert [int(x) for x in lengths] == [27, 9, 3]
    for name, g, w in zip(("y", *module.INPUTS), got, plain, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-12, atol=1e-13, err_msg=name)


@pytest.mark.parametrize(("case", "associative"), [("rnn", False), ("linear", True)])
def test_tensorflow_gradient_of_the_gradient(case, associative, tmp_path):
    """The forward runs on inputs cut from the tape and, eagerly, as one graph; under a
    tape or a forward accumulator (a gradient of the gradient) the backward recomputes the
    checkpoints from the inputs op by op, so second derivatives hold: forward-over-reverse
    and reverse-over-reverse Hessian-vector products equal central differences of the
    gradient, under the default budget and at budget 0 (two levels; the associative scan:
    chunks of one position)."""
    import tensorflow as tf

    spec, shapes, _ = CASES[case]
    text = scan_render.module_text(spec, "test", "tensorflow", associative=associative)
    module = load_module(text, tmp_path, f"second_{case}")
    values = inputs_for({n: (2, 23, 3) if len(s) == 3 else s for n, s in shapes.items()}, seed=12)
    args = [tf.constant(values[n]) for n in module.INPUTS]
    rng = np.random.default_rng(3)
    v = [tf.constant(rng.standard_normal(a.shape)) for a in args]

    for budget in (2**40, 0):
        module.MAX_TEMP_BYTES = budget
        check_second_derivatives(module.forward, args, v)


def test_tensorflow_windows_deeper_than_the_last_level(tmp_path):
    """lfilter reads its output 4 positions back; at budget 0 its 19 positions take levels
    of 9 and 3, so the last level's windows reach past its 3 states into the window before
    them. Under XLA (jit_compile=True), under tf.function with every dim unknown, and under
    a tape of the gradient (reverse over reverse, against central differences of the
    gradient) the values equal those of the default budget (one level of 5)."""
    import tensorflow as tf

    spec, shapes, _ = CASES["lfilter"]
    module = _module(spec, "tensorflow", tmp_path, "deep_lfilter")
    values = inputs_for(dict(shapes, x=(3, 19)), seed=21)
    args = [tf.constant(values[n]) for n in module.INPUTS]
    cotangent = tf.constant(np.random.default_rng(22).standard_normal((3, 19)))
    plain = module.vjp(*args, cotangent)
    module.MAX_TEMP_BYTES = 0
    window = module._window_bytes(*args)
    assert module._window_shape(*args) == [4, 3]  # depth 4, 3 rows
    assert module._chunk_lengths(19, window) == (9, 3)

    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = module.forward(*xs)
        return tape.gradient(y, xs, output_gradients=cotangent)

    signature = [tf.TensorSpec([None] * a.shape.rank, tf.float64) for a in args]
    for run in (tf.function(step, jit_compile=True), tf.function(step, input_signature=signature)):
        for name, g, w in zip(module.INPUTS, run(*args), plain, strict=True):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-12, atol=1e-13, err_msg=name)

    v = [
        tf.constant(d)
        for d in inputs_for({n: a.shape for n, a in zip(module.INPUTS, args)}, 23).values()
    ]

    def first(xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            loss = tf.reduce_sum(module.forward(*xs) ** 2)
        return tape.gradient(loss, xs)

    eps = 1e-6
    ahead = first([a + eps * d for a, d in zip(args, v, strict=True)])
    behind = first([a - eps * d for a, d in zip(args, v, strict=True)])
    with tf.GradientTape() as outer:
        outer.watch(args)
        along = tf.add_n([tf.reduce_sum(g * d) for g, d in zip(first(args), v, strict=True)])
    for g, a, b in zip(outer.gradient(along, args), ahead, behind, strict=True):
        np.testing.assert_allclose(g.numpy(), ((a - b) / (2 * eps)).numpy(), rtol=1e-6, atol=1e-8)

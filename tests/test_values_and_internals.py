"""Indices and infinities as values, internal tensors and `let` (issue 17, items 6, 7, 2):
each construct exact in float64 against the independent reference (and TF autodiff on it)
in TensorFlow, PyTorch and JAX; refusals with a caret; real ops written with them checked
against NumPy loop transcriptions of their kernels."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf
from harness import Case, check, generate, op_spec
from target_harness import check_target, frameworks

from symgrad.errors import SymgradError
from symgrad.explain import explain
from symgrad.model import build

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)

FRAMEWORKS = frameworks()


# Every construct, with a different size for every index.
CASES = {
    # item 6: an index outside brackets is its value, in the inputs' float dtype
    "index_value_decay": Case(
        "y[b,t] = sum(where(i < t, exp((t - 1 - i) * w[b] + k[b,i]), 0), i)",
        {"w": (3,), "k": (3, 5)},
        ranges={"t": "k.shape[1]"},
        sizes={"t": 5},
    ),
    "index_value_times_a_tensor": Case(
        "y[b,i] = x[b,i] * i + sum(j * x[b,j], j) / 3", {"x": (2, 4)}
    ),
    "e_and_pi_stay_constants_beside_an_index_e": Case("y[b,e] = x[b,e] * e + pi", {"x": (3, 4)}),
    "minus_inf_in_a_segment_max": Case(
        "y[v,f] = max(where(seg[n] == v, x[n,f], -inf), n)",
        {"x": (9, 2)},
        index_inputs={"seg": ((9,), 0, 3)},
        ranges={"v": "3"},
        sizes={"v": 3},
    ),
    "plus_inf_in_a_segment_min": Case(
        "y[v,f] = min(where(seg[n] != v, inf, x[n,f]), n)",
        {"x": (9, 2)},
        index_inputs={"seg": ((9,), 0, 3)},
        ranges={"v": "3"},
        sizes={"v": 3},
    ),
    # item 7: internal tensors, read by later equations, never returned
    "internal_read_plainly_twice": Case(
        ["h[b,i] = tanh(x[b,i] * w[i])", "y[b] = sum(h[b,i] * h[b,i], i)"],
        {"x": (3, 4), "w": (4,)},
        outputs=("y",),
    ),
    "internal_summed_into_an_output": Case(
        ["h[b,i] = exp(x[b,i])", "y[b,j] = sum(h[b,i], i) * x[b,j]"],
        {"x": (3, 4)},
        outputs=("y",),
    ),
    "internal_read_at_computed_positions": Case(
        ["h[b,t] = x[b,t] * x[b,t] + 1", "y[b,t] = h[b, t - 1] + 2 * h[b, t]"],
        {"x": (3, 5)},
        outputs=("y",),
    ),
    "internal_read_through_an_index_tensor": Case(
        ["h[n,f] = sigmoid(x[n,f])", "y[m,f] = h[ids[m], f] * x[m,f]"],
        {"x": (6, 2)},
        index_inputs={"ids": ((6,), -1, 7)},
        outputs=("y",),
    ),
    "internals_chained_with_two_outputs": Case(
        [
            "h[b,i] = x[b,i] * w[i]",
            "g[b] = log(sum(exp(h[b,i]), i))",
            "y[b,i] = exp(h[b,i] - g[b])",
            "z[b] = g[b] * g[b]",
        ],
        {"x": (3, 4), "w": (4,)},
        outputs=("y", "z"),
    ),
    # a real op: RWKV-4's WKV (the recurrence of wkv_cuda.cu, summed out) with internal
    # numerator and denominator and the decay written with index values
    "rwkv4_wkv": Case(
        [
            "a[b,t,c] = sum(where(i < t, exp((t - 1 - i) * w[c] + k[b,i,c]) * v[b,i,c], 0), i)",
            "d[b,t,c] = sum(where(i < t, exp((t - 1 - i) * w[c] + k[b,i,c]), 0), i)",
            (
                "y[b,t,c] = (a[b,t,c] + exp(u[c] + k[b,t,c]) * v[b,t,c]) / "
                "(d[b,t,c] + exp(u[c] + k[b,t,c]))"
            ),
        ],
        {"w": (3,), "u": (3,), "k": (2, 5, 3), "v": (2, 5, 3)},
        inputs=("w", "u", "k", "v"),
        outputs=("y",),
        sizes={"t": 5},  # for the reference, which reads `a` alone: t is k's axis 1
    ),
    # item 2: `let`, derived integers usable wherever an int attr is
    "let_in_a_position_and_as_a_value": Case(
        "y[b,i] = x[b,i] * R + x[b, i + h]",
        {"x": (3, 7)},
        lets={"R": "x.shape[1] // 2", "h": "R - 1"},
        let_values={"R": 3, "h": 2},
    ),
    "let_from_a_filter_size_as_a_centred_padding": Case(
        "y[b,i,o] = sum(x[b, s*i + k - kr, c] * w[k,c,o], k, c)",
        {"x": (2, 9, 3), "w": (5, 3, 4)},
        attrs={"s": 2},
        lets={"kr": "(K - 1) // 2", "K": "w.shape[0]"},
        let_values={"kr": 2, "K": 5},
        ranges={"i": "(x.shape[1] + s - 1) // s"},
        sizes={"i": 5},
    ),
    "let_in_ranges_and_a_stride": Case(
        "y[b,(h,r)] = sum(x[b, h*R + q] * where(q == r, 1, 0), q)",
        {"x": (2, 12)},
        attrs={"H": 3},
        lets={"R": "x.shape[1] // H"},
        let_values={"R": 4},
        ranges={"h": "H", "r": "R", "q": "R"},
        sizes={"h": 3, "r": 4, "q": 4},
    ),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("values_and_internals")


@pytest.mark.parametrize("name", sorted(CASES))
def test_values_internals_and_lets_in_tensorflow(name, folder):
    case = CASES[name]
    check(case, generate(case, folder, "Values"))


@pytest.mark.parametrize("target", sorted(FRAMEWORKS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_values_internals_and_lets_in_pytorch_and_jax(name, target, folder):
    case = CASES[name]
    module = generate(case, folder, "Values", target)
    if target == "jax":  # one XLA compile per function instead of one per op
        static = module.ATTRS
        module = SimpleNamespace(
            OP_NAME=module.OP_NAME,
            forward=jax.jit(module.forward, static_argnames=static),
            vjp=jax.jit(module.vjp, static_argnames=static),
            _compute=jax.jit(module._compute, static_argnames=static),
        )
    check_target(case, module, FRAMEWORKS[target])


def _refused(formula, attrs=(), **spec) -> SymgradError:
    from symgrad.spec import OpSpec

    op = OpSpec(
        "Refused",
        (formula,) if isinstance(formula, str) else tuple(formula),
        None,
        tuple(attrs),
        (),
        "test [ops.Refused]",
        **spec,
    )
    with pytest.raises(SymgradError) as info:
        build(op)
    return info.value


def _caret_at(error: SymgradError, text: str) -> None:
    rendered = str(error)
    formula_line, caret_line = rendered.splitlines()[-2:]
    assert caret_line.strip() == "^", rendered
    column = caret_line.index("^") - (len(formula_line) - len(formula_line.lstrip()))
    assert formula_line.strip()[column:].startswith(text), rendered


def test_inf_outside_a_branch_of_where_is_refused_with_a_caret():
    error = _refused("y[b,i] = x[b,i] + inf")
    assert "only allowed as a whole branch of where" in str(error)
    _caret_at(error, "inf")
    _caret_at(_refused("y[b,i] = where(x[b,i] > 0, x[b,i], 2 * -inf)"), "inf")


def test_an_index_value_no_tensor_sizes_is_refused_with_a_caret():
    error = _refused("y[b] = sum(x[b,k], k) + k")
    assert "no tensor in it reads it" in str(error)
    _caret_at(error, "k")


def test_a_name_that_is_no_index_stays_an_unknown_name():
    error = _refused("y[b,i] = x[b,i] * j")
    assert "unknown name 'j'" in str(error)
    _caret_at(error, "j")


def test_internal_tensors_are_refused_where_they_cannot_be_read():
    composite = _refused(["h[(b,i)] = x[b,i]", "y[b,i] = h[b,i]"], outputs=("y",))
    assert "composite axis" in str(composite)
    _caret_at(composite, "h[")
    twice = _refused(["h[b,i] = x[b,i]", "h[b,i] = x[b,i] * 2"], outputs=("h",))
    assert "computed by two equations" in str(twice)
    _caret_at(twice, "h[")
    early = _refused(["y[b,i] = h[b,i]", "h[b,i] = x[b,i]"], outputs=("y",))
    assert "read before the equation that computes it" in str(early)
    unused = _refused(["h[b,i] = x[b,i]", "y[b,i] = x[b,i]"], outputs=("y",))
    assert "no later equation reads it" in str(unused)
    named = _refused(["n[b,i] = x[b,i]", "y[b,i] = n[b,i]"], (("n", "int"),), outputs=("y",))
    assert "internal tensor 'n' has the name of an attr" in str(named)
    missing = _refused(["h[b,i] = x[b,i]", "y[b,i] = h[b,i]"], outputs=("y", "z"))
    assert "`outputs` names 'z', which no equation computes" in str(missing)
    output = _refused(["y[b,i] = x[b,i]", "z[b,i] = y[b,i]"], outputs=("y", "z"))
    assert "output 'y' is also used as an input" in str(output)
    rank = _refused(["h[b,i] = x[b,i]", "y[b] = h[b]"], outputs=("y",))
    assert "has 2 axes but is read with 1 index" in str(rank)
    _caret_at(rank, "h[b]")


def test_an_internal_axis_sized_by_a_range_is_read_with_its_own_index():
    error = _refused(
        ["h[b,t] = x[b, t - 1]", "y[b,j] = h[b,j] * x[b,j]"],
        outputs=("y",),
        ranges=(("t", "x.shape[1] + 1"),),
    )
    assert "sized by a range of 't'" in str(error)
    _caret_at(error, "h[b,j]")


def _wkv_kernel(w, u, k, v):
    """RWKV-4's `kernel_forward` (BlinkDL/RWKV-LM, RWKV-v4/cuda/wkv_cuda.cu), one thread
    per (b, c), transcribed loop for loop: running sums p, q scaled by exp(-o)."""
    batch, steps, channels = k.shape
    y = np.zeros_like(k)
    for b in range(batch):
        for c in range(channels):
            p, q, o = 0.0, 0.0, -1e38
            for i in range(steps):
                no = max(o, u[c] + k[b, i, c])
                a, e = np.exp(o - no), np.exp(u[c] + k[b, i, c] - no)
                y[b, i, c] = (a * p + e * v[b, i, c]) / (a * q + e)
                no = max(w[c] + o, k[b, i, c])
                a, e = np.exp(w[c] + o - no), np.exp(k[b, i, c] - no)
                p, q, o = a * p + e * v[b, i, c], a * q + e, no
    return y


def test_rwkv4_wkv_is_the_cuda_kernels_loop(folder):
    case = CASES["rwkv4_wkv"]
    module = generate(case, folder, "Wkv")
    rng = np.random.default_rng(3)
    w = -np.exp(rng.uniform(-1, 1, 3))  # the kernel takes w = -exp(time_decay)
    u, k, v = rng.uniform(-1, 1, 3), rng.uniform(-2, 2, (2, 5, 3)), rng.standard_normal((2, 5, 3))
    got = module.forward(*(tf.constant(a) for a in (w, u, k, v))).numpy()
    np.testing.assert_allclose(got, _wkv_kernel(w, u, k, v), rtol=1e-12, atol=1e-12)


def test_a_let_is_evaluated_when_the_op_is_called_with_unknown_dims(folder):
    case = CASES["let_in_a_position_and_as_a_value"]
    module = generate(case, folder, "LetDims")
    spec = tf.TensorSpec([None, None], tf.float64)
    forward = tf.function(module.forward, input_signature=[spec])
    for shape, r in (((3, 7), 3), ((2, 10), 5)):
        x = np.random.default_rng(0).standard_normal(shape)
        h = r - 1
        shifted = np.concatenate([x[:, h:], np.zeros((shape[0], h))], axis=1)
        np.testing.assert_allclose(forward(tf.constant(x)).numpy(), x * r + shifted, rtol=1e-12)


def test_let_mistakes_are_refused_with_a_caret():
    cycle = _refused("y[b,i] = x[b, i + A]", lets=(("A", "B + 1"), ("B", "2 * A")))
    assert "the lets form a cycle (A -> B -> A)" in str(cycle)
    _caret_at(cycle, "A")
    itself = _refused("y[b,i] = x[b, i + A]", lets=(("A", "A + 1"),))
    assert "cycle (A -> A)" in str(itself)
    unknown = _refused("y[b,i] = x[b, i + A]", lets=(("A", "n + 1"),))
    assert "let 'A': unknown name 'n'" in str(unknown)
    _caret_at(unknown, "n")
    fraction = _refused("y[b,i] = x[b, i + A]", lets=(("A", "x.shape[1] / 2"),))
    assert "is not allowed in a let" in str(fraction)
    _caret_at(fraction, "x.shape")
    shape = _refused("y[b,i] = x[b, i + A]", lets=(("A", "z.shape[0]"),))
    assert "no formula uses a tensor 'z'" in str(shape)
    clash = _refused("y[b,i] = x[b, i] * n", attrs=(("n", "int"),), lets=(("n", "2"),))
    assert "let 'n' has the name of an attr" in str(clash)
    tensor = _refused("y[b,i] = x[b, i] * A[i]", lets=(("A", "2"),))
    assert "'A' is a let, not a tensor" in str(tensor)


def test_explain_shows_values_internal_tensors_and_lets():
    def explained(name: str, fmt: str = "text") -> str:
        return explain(build(op_spec(CASES[name], "Explained")), fmt)

    decay = explained("index_value_decay")
    assert "(-i + t - 1)*w[b] + k[b,i]" in decay  # the index values, as indices
    assert "tf.cast(" in decay and "tf.range(_n_t)" in decay
    assert "-inf" in explained("minus_inf_in_a_segment_max")
    internal = explained("internal_read_at_computed_positions")
    assert "    h[b,t] = x[b,t]**2 + 1" in internal  # computed once, by its own name
    assert "_g2[b,t] = h[b,t - 1] (0 outside h)" in internal  # the read it solves for
    assert "Gradient of h (intermediate):" in internal
    lets = explained("let_from_a_filter_size_as_a_centred_padding")
    assert "let (integers computed when the op is called):\n    K = w.shape[0]\n" in lets
    assert "    kr = (K - 1) // 2\n" in lets
    assert "_int_kr = (_int_K - 1) // 2" in lets
    assert "kr = (K - 1) // 2" in explained(
        "let_from_a_filter_size_as_a_centred_padding", "markdown"
    )


def test_an_empty_segment_is_minus_inf_and_sends_no_gradient(folder):
    module = generate(CASES["minus_inf_in_a_segment_max"], folder, "Empty")
    seg = tf.constant([0, 2, 0, 2, 2, 0, 0, 2, 0], tf.int32)  # segment 1 is empty
    x = tf.constant(np.random.default_rng(5).permutation(18).reshape(9, 2) * 0.1)
    y = module.forward(seg, x).numpy()
    assert np.all(y[1] == -np.inf) and np.all(np.isfinite(y[[0, 2]]))
    g = np.random.default_rng(6).standard_normal((3, 2))
    _, grad_x = module.vjp(seg, x, tf.constant(g))
    assert np.all(np.isfinite(grad_x.numpy()))
    np.testing.assert_allclose(grad_x.numpy().sum(axis=0), g[[0, 2]].sum(axis=0), rtol=1e-12)


def test_a_let_stride_works_with_unknown_dims(folder):
    """A let is a tensor when dims are unknown: as a stride it lowers as a general gather,
    never as a kernel that needs a Python int."""
    case = Case(
        "y[b,i,o] = sum(x[b, R*i + k, c] * w[k,c,o], k, c)",
        {"x": (2, 9, 3), "w": (2, 3, 4)},
        lets={"R": "w.shape[0]"},
        let_values={"R": 2},
        ranges={"i": "x.shape[1] // R"},
        sizes={"i": 4},
    )
    module = generate(case, folder, "LetStride")
    check(case, module)
    spec = [tf.TensorSpec([None, None, 3], tf.float64), tf.TensorSpec([None, 3, 4], tf.float64)]
    rng = np.random.default_rng(1)
    x, w = tf.constant(rng.standard_normal((2, 9, 3))), tf.constant(rng.standard_normal((2, 3, 4)))
    traced = tf.function(module.forward, input_signature=spec)
    np.testing.assert_allclose(traced(x, w).numpy(), module.forward(x, w).numpy(), rtol=1e-12)

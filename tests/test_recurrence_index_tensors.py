"""Index tensors inside a recurrence: CTC's and RNN-T's labels, read where the step
gathers (`x[b,t,lab[b,t]]`; `x[b,t,u,lab[b,u]]`). They were refused ("a recurrence reads
no index tensors"), so the full RNN-T forward variables from logits and labels could not
be one op. The step reads an index tensor as an input of its own, cut along the scan
index or whole, or as a window of its recent positions (the inner scan of RNN-T reads
lab[b,u-1]); it gets no gradient, and a label outside the axis reads zero as everywhere.
Checked against NumPy loops in float64 (forward, and the gradient against central
differences of the loop), and a training step through each framework's own machinery,
in every target."""

from __future__ import annotations

import numpy as np
import pytest
from frameworks import FRAMEWORKS
from harness import generated_once
from test_recurrences import op_spec

from symgrad.pipeline import module_text

TARGETS = ("tensorflow", "pytorch", "jax")
B, T, U, V = 2, 6, 4, 5


def _taken(x, lab):
    """x[..., lab] along the last axis, zero where lab is outside it."""
    inside = (lab >= 0) & (lab < x.shape[-1])
    picked = np.take_along_axis(x, np.where(inside, lab, 0)[..., None], -1)[..., 0]
    return np.where(inside, picked, 0.0)


def labelled_scan_loop(a, x, lab):
    h = np.zeros(a.shape)
    for t in range(a.shape[1]):
        h[:, t] = (a[:, t] * h[:, t - 1] if t else 0) + _taken(x[:, t], lab[:, t])
    return h


def label_one_back_loop(a, x, lab):
    h = np.zeros(a.shape)
    for t in range(a.shape[1]):
        h[:, t] = a[:, t] * h[:, t - 1] + _taken(x[:, t], lab[:, t - 1]) if t else a[:, 0]
    return h


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def rnnt_loop(x, lab):
    """torchaudio's compute_alphas from logits [B, T, U, V] and labels [B, U]: blank is
    class 0, the label at u is lab[b,u]."""
    lp = _log_softmax(x)
    blank = lp[..., 0]
    emit = _taken(lp, np.broadcast_to(lab[:, None, :], lp.shape[:-1]))
    alpha = np.zeros(blank.shape)
    for t in range(blank.shape[1]):
        for u in range(blank.shape[2]):
            if t == 0 and u == 0:
                continue
            terms = []
            if t > 0:
                terms.append(alpha[:, t - 1, u] + blank[:, t - 1, u])
            if u > 0:
                terms.append(alpha[:, t, u - 1] + emit[:, t, u - 1])
            alpha[:, t, u] = np.log(sum(np.exp(v) for v in terms))
    return alpha


# name -> (formulas, outputs, value shapes, (label shape, low, high), loop)
CASES = {
    # labels cut along t, some outside x's last axis (-1 and V): those read zero
    "labelled_scan": (
        ("h[b,t] = a[b,t] * h[b,t-1] + x[b,t,lab[b,t]]",),
        None,
        {"a": (B, T), "x": (B, T, V)},
        ((B, T), -1, V + 1),
        labelled_scan_loop,
    ),
    # the labels read one position back, the first position written apart: a window of
    # the index tensor, read only where it has a value
    "label_one_back": (
        ("h[b,t] = where(t == 0, a[b,t], a[b,t] * h[b,t-1] + x[b,t,lab[b,t-1]])",),
        None,
        {"a": (B, T), "x": (B, T, V)},
        ((B, T), 0, V),
        label_one_back_loop,
    ),
    # the full RNN-T forward variables: log-softmax, labels, then alpha along t and u
    "rnnt_from_logits_and_labels": (
        (
            "bl[b,t,u] = x[b,t,u,0] - log(sum(exp(x[b,t,u,v]), v))",
            "em[b,t,u] = x[b,t,u,lab[b,u]] - log(sum(exp(x[b,t,u,v]), v))",
            (
                "alpha[b,t,u] = log(where(t == 0 and u == 0, 1, 0)"
                " + where(t == 0, 0, exp(alpha[b,t-1,u] + bl[b,t-1,u]))"
                " + where(u == 0, 0, exp(alpha[b,t,u-1] + em[b,t,u-1])))"
            ),
        ),
        ("alpha",),
        {"x": (B, T, U, V)},
        ((B, U), 1, V),
        rnnt_loop,
    ),
}


def module_for(name, target, folder):
    formulas, outputs, *_ = CASES[name]
    op = op_spec("Labelled", formulas, outputs=outputs)
    return generated_once(f"labelled_{name}_{target}", op, target, folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("labelled")


def _values(name, seed=0):
    rng = np.random.default_rng(seed)
    _, _, shapes, (label_shape, low, high), _ = CASES[name]
    values = {n: rng.standard_normal(s) * (0.5 if n == "a" else 2.0) for n, s in shapes.items()}
    return values, rng.integers(low, high, label_shape)


def _call(name, values, lab):
    loop = CASES[name][4]
    return loop(**values, lab=lab)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_index_tensors_in_a_recurrence_match_the_loop(name, target, folder):
    module = module_for(name, target, folder)
    fw = FRAMEWORKS[target]
    values, lab = _values(name)
    named = {**values, "lab": lab}
    args = [fw.tensor(named[n]) if n != "lab" else _labels(target, lab) for n in module.INPUTS]
    want = _call(name, values, lab)
    np.testing.assert_allclose(fw.numpy(module.forward(*args)), want, rtol=1e-10, atol=1e-12)
    rng = np.random.default_rng(5)
    grad = rng.standard_normal(want.shape)
    found = dict(zip(module.INPUTS, module.vjp(*args, fw.tensor(grad)), strict=True))
    assert found["lab"] is None
    for input_name in values:
        v = rng.standard_normal(values[input_name].shape)
        plus, minus = dict(values), dict(values)
        plus[input_name] = values[input_name] + 1e-6 * v
        minus[input_name] = values[input_name] - 1e-6 * v
        fd = np.sum(grad * (_call(name, plus, lab) - _call(name, minus, lab))) / 2e-6
        mine = np.sum(fw.numpy(found[input_name]) * v)
        np.testing.assert_allclose(mine, fd, rtol=1e-6, atol=1e-8, err_msg=input_name)


def _labels(target, lab):
    if target == "tensorflow":
        import tensorflow as tf

        return tf.constant(lab)
    if target == "pytorch":
        import torch

        return torch.tensor(lab)
    import jax.numpy as jnp

    return jnp.asarray(lab)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", ["labelled_scan", "rnnt_from_logits_and_labels"])
def test_a_training_step_through_forward(name, target, folder):
    """The gradient of Σ grad·y through `forward` by the framework's own machinery (a TF
    tape, torch autograd, jax.jit(jax.grad)) is the generated vjp; the labels are
    integers throughout."""
    module = module_for(name, target, folder)
    fw = FRAMEWORKS[target]
    values, lab = _values(name, seed=3)
    names = [n for n in module.INPUTS if n != "lab"]
    grad = np.random.default_rng(4).standard_normal(_call(name, values, lab).shape)
    labels = _labels(target, lab)

    def call(*floats):
        named = dict(zip(names, floats, strict=True))
        return module.forward(*[labels if n == "lab" else named[n] for n in module.INPUTS])

    if target == "tensorflow":
        import tensorflow as tf

        variables = [tf.Variable(values[n]) for n in names]
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(call(*variables) * grad)
        got = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, variables)]
    elif target == "pytorch":
        import torch

        leaves = [torch.tensor(values[n], requires_grad=True) for n in names]
        (call(*leaves) * torch.tensor(grad)).sum().backward()
        got = [leaf.grad.numpy() for leaf in leaves]
    else:
        import jax
        import jax.numpy as jnp

        step = jax.jit(
            jax.grad(lambda *f: jnp.sum(call(*f) * grad), argnums=tuple(range(len(names))))
        )
        got = [np.asarray(g) for g in step(*[jnp.asarray(values[n]) for n in names])]
    named = {**{n: fw.tensor(values[n]) for n in names}, "lab": labels}
    want = dict(zip(module.INPUTS, module.vjp(*[named[n] for n in module.INPUTS], fw.tensor(grad))))
    for n, g in zip(names, got, strict=True):
        np.testing.assert_allclose(g, fw.numpy(want[n]), rtol=1e-10, atol=1e-12, err_msg=n)


def test_tensorflow_unknown_sizes(folder):
    """Under tf.function with every size unknown, as eagerly."""
    import tensorflow as tf

    module = module_for("rnnt_from_logits_and_labels", "tensorflow", folder)
    values, lab = _values("rnnt_from_logits_and_labels", seed=7)
    specs = [tf.TensorSpec([None] * 4, tf.float64), tf.TensorSpec([None, None], tf.int64)]
    graph = tf.function(module.forward, input_signature=specs)
    np.testing.assert_allclose(
        graph(values["x"], lab).numpy(), module.forward(values["x"], lab).numpy(), rtol=1e-12
    )


@pytest.mark.parametrize("target", TARGETS)
def test_float_labels_are_refused_naming_the_tensor(target, folder):
    module = module_for("labelled_scan", target, folder)
    fw = FRAMEWORKS[target]
    values, lab = _values("labelled_scan")
    named = {**values, "lab": lab.astype(np.float64)}
    with pytest.raises(TypeError, match="index tensor lab has dtype"):
        module.forward(*[fw.tensor(named[n]) for n in module.INPUTS])


def test_labels_read_back_at_the_start_are_refused():
    """At t = 0 there is no lab[b,t-1]: an op reads zero there, the scan's window would
    hold label 0 and read x at it. Refused with a caret and the way out."""
    from symgrad.errors import SymgradError

    formula = "h[b,t] = a[b,t] * h[b,t-1] + x[b,t,lab[b,t-1]]"
    with pytest.raises(SymgradError) as found:
        module_text(op_spec("Back", (formula,)), "test", "tensorflow")
    assert "where(t == 0, ..., ...)" in found.value.message, found.value.message
    assert found.value.column == formula.index("lab[")

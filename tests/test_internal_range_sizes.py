"""An internal tensor's axis sized by a range, read plainly at an index another input
sizes: the two sizes must agree, and where they do not the call is refused with the
index, both axes and both sizes. Before, the read failed inside a reshape with the
framework's own message ("Input to reshape is a tensor with 18 values, but the requested
shape has 16"), untiled and in chunks, in every target."""

from __future__ import annotations

import numpy as np
import pytest
from harness import Case
from target_harness import check_in_every_target, converters, generate_for

# h's n runs over x.shape[0] - w.shape[0] + 2 positions (its range); the segment sum
# reads h at the n that seg sizes
CASE = Case(
    (
        "h[n,c] = sum(x[n+k-2, c] * w[k, c], k)",
        "y[v,c] = sum(where(seg[n] == v, h[n,c], 0), n)",
    ),
    {"x": (11, 2), "w": (4, 2)},
    index_inputs={"seg": ((9,), 0, 4)},
    ranges={"n": "x.shape[0] - w.shape[0] + 2", "v": "4"},
    sizes={"n": 9, "v": 4},
    outputs=("y",),
)
MESSAGE = "index n has different sizes: h[axis 0] (the range of n) = 9, seg[axis 0] = 8"


def _arrays():
    rng = np.random.default_rng(0)
    return rng.standard_normal((11, 2)), rng.standard_normal((4, 2)), np.arange(8) % 4


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_equal_sizes_are_exact(target, budget, tmp_path):
    check_in_every_target(CASE, target, tmp_path, "ConvRange", budget)


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_other_sizes_are_refused_naming_both(target, budget, tmp_path):
    module = generate_for(CASE, target, tmp_path, "ConvRange", budget)
    tensor, _ = converters(target)
    x, w, seg = (tensor(a) for a in _arrays())
    with pytest.raises(ValueError) as forward:
        module.forward(x, w, seg)
    name = getattr(module, "OP_NAME", None) or module.OP_TYPE
    assert str(forward.value) == f"{name}: {MESSAGE}"
    with pytest.raises(ValueError) as vjp:
        module.vjp(x, w, seg, tensor(np.ones((4, 2))))
    assert str(vjp.value) == f"{name}: {MESSAGE}"


def test_tf_function_with_unknown_sizes_checks_them_when_the_graph_runs(tmp_path):
    import tensorflow as tf

    module = generate_for(CASE, "tensorflow", tmp_path, prefix="ConvRange")
    unknown = [
        tf.TensorSpec([None, None], tf.float64),
        tf.TensorSpec([None, None], tf.float64),
        tf.TensorSpec([None], tf.int64),
    ]
    forward = tf.function(module.forward, input_signature=unknown)
    x, w, seg = _arrays()
    with pytest.raises(tf.errors.InvalidArgumentError, match="index n has different sizes"):
        forward(tf.constant(x), tf.constant(w), tf.constant(seg))
    # and equal sizes run (9 rows of seg)
    got = forward(tf.constant(x), tf.constant(w), tf.constant(np.arange(9) % 4))
    assert got.shape == (4, 2)


# A range names an index that a plain read sizes elsewhere (an internal tensor's n, and
# the later sum's n sized by seg), or an index tensor read whole at a ranged index (the
# segment ids of `where(seg[n] == v, ..)`): the sizes must agree. Before, the first summed
# every id of a longer seg (silently: [14, 8, 2] for [14, 7, 1]) and the second failed
# inside a reshape (found by a random-formula trial).
NAMESAKES = {
    "internal_shifted": Case(
        ("h[n] = x[n] * 2", "y[v] = sum(where(seg[n] == v, h[n+1] + 1, 0), n)"),
        {"x": (4,)},
        index_inputs={"seg": ((4,), 0, 3)},
        ranges={"n": "x.shape[0]", "v": "3"},
        sizes={"n": 4, "v": 3},
        outputs=("y",),
    ),
    # in chunks, each chunk knew its own length alone: the whole op refused, the chunks
    # computed (ids past the range unread, zero past seg's end)
    "input_shifted": Case(
        "y[v] = sum(where(seg[n] == v, x[n + 1] + 1, 0), n)",
        {"x": (4,)},
        index_inputs={"seg": ((4,), 0, 3)},
        ranges={"n": "x.shape[0]", "v": "3"},
        sizes={"n": 4, "v": 3},
    ),
    "segment_ids": Case(
        "y[v] = sum(where(seg[n] == v, x[n], 0), n)",
        {"x": (4,)},
        index_inputs={"seg": ((4,), 0, 3)},
        ranges={"n": "x.shape[0]", "v": "3"},
        sizes={"n": 4, "v": 3},
    ),
}


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(NAMESAKES))
def test_a_range_and_a_plain_axis_of_one_name_agree_or_are_refused(name, target, budget, tmp_path):
    check_in_every_target(NAMESAKES[name], target, tmp_path, "Namesake", budget)
    module = generate_for(NAMESAKES[name], target, tmp_path, "Namesake", budget)
    tensor, _ = converters(target)
    x = tensor(np.array([1.0, 2.0, 3.0, 4.0]))
    for ids in ([0, 1, 0, 2, 2, 1], [0, 1]):
        named = {"x": x, "seg": tensor(np.array(ids))}
        args = [named[n] for n in module.INPUTS]
        sizes = f"the range of n = 4, seg[axis 0] = {len(ids)}"
        for call in (module.forward, lambda *a: module.vjp(*a, tensor(np.ones(3)))):
            with pytest.raises(ValueError) as refused:
                call(*args)
            assert str(refused.value).endswith(f"index n has different sizes: {sizes}")


# The check of an index that two input axes size named the model's primed index, which the
# user never wrote ("index n' has different sizes"; found by an adversarial trial): a sum
# over n of an internal tensor computed over n.
PRIMED = Case(
    ("h[n,f] = tanh(x[n,f])", "y[v,f] = sum(where(seg[n] == v, h[n,f], 0), n)"),
    {"x": (7, 2)},
    index_inputs={"seg": ((7,), 0, 3)},
    ranges={"v": "3"},
    sizes={"v": 3},
    outputs=("y",),
)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_a_summed_index_is_named_as_written(target, tmp_path):
    module = generate_for(PRIMED, target, tmp_path, "Primed")
    tensor, _ = converters(target)
    named = {"x": tensor(np.ones((7, 2))), "seg": tensor(np.arange(5) % 3)}
    with pytest.raises(ValueError) as refused:
        module.forward(*[named[n] for n in module.INPUTS])
    assert "index n has different sizes: seg[axis 0] = 5, x[axis 0] = 7" in str(refused.value)

"""Empty axes in every target: an output with no elements (an input shorter than its
filter, a range of 0), a table with no rows, no channels, no batch. Every output and
every gradient is zeros of the right shape through forward, vjp, the registered gradient
(TF) and the framework's own autodiff through `forward`; no kernel runs on an empty axis
(TF's filter backprop read garbage there, a 2-D one crashed the process; PyTorch's and
XLA's convolutions refused them). Also positions that simplify to a plain index."""

from __future__ import annotations

import numpy as np
import pytest
from adversarial import unknown_sizes_equal_eager
from frameworks import FRAMEWORKS, reference_train_step, run_everywhere, train_step
from harness import Case, generate, make_tensors, reference

CONV1D = "y[b,i,o] = sum(x[b, i + k, c] * w[k,c,o], k, c)"
STRIDED = "y[b,i,o] = sum(x[b, 2*i + k, c] * w[k,c,o], k, c)"
LINEAR = "h[b,t,d] = a[b,t,d] * h[b,t-1,d] + x[b,t,d]"
IIR = "y[b,t] = sum(bb[k] * x[b,t-k], k) - sum(a[q] * y[b,t-1-q], q)"

# name -> (case, the shape of each output)
EMPTY = {
    "input_shorter_than_filter": (Case(CONV1D, {"x": (2, 2, 3), "w": (3, 3, 4)}), [(2, 0, 4)]),
    "input_shorter_than_filter_2d": (
        Case(
            "y[b,i,j,o] = sum(x[b, i + u, 3*j + v + 2, c] * w[u,v,c,o], u, v, c)",
            {"x": (2, 6, 3, 2), "w": (2, 2, 2, 3)},
        ),
        [(2, 5, 0, 3)],
    ),
    "no_channels": (Case(CONV1D, {"x": (2, 5, 0), "w": (3, 0, 4)}), [(2, 3, 4)]),
    "no_output_channels": (Case(CONV1D, {"x": (2, 5, 3), "w": (3, 3, 0)}), [(2, 3, 0)]),
    "no_batch": (Case(CONV1D, {"x": (0, 5, 3), "w": (3, 3, 4)}), [(0, 3, 4)]),
    "no_taps": (Case(CONV1D, {"x": (2, 5, 3), "w": (0, 3, 4)}), [(2, 6, 4)]),
    "range_of_zero": (
        Case(STRIDED, {"x": (2, 6, 3), "w": (1, 3, 4)}, ranges={"i": "x.shape[1] - 6"}),
        [(2, 0, 4)],
    ),
    "literal_range_of_zero": (
        Case(STRIDED, {"x": (2, 6, 3), "w": (1, 3, 4)}, ranges={"i": "0"}),
        [(2, 0, 4)],
    ),
    "negative_range": (
        Case(STRIDED, {"x": (2, 6, 3), "w": (2, 3, 4)}, ranges={"i": "x.shape[1] - 9"}),
        [(2, 0, 4)],
    ),
    "table_without_rows": (
        Case("y[b,t,d] = W[ids[b,t], d]", {"W": (0, 3)}, index_inputs={"ids": ((2, 4), 0, 2)}),
        [(2, 4, 3)],
    ),
    "window_gather_of_an_empty_axis": (
        Case(
            "y[b,i,o] = sum(x[b, 2*i + 3*k - 1, c] * w[k,c,o], k, c)",
            {"x": (2, 0, 3), "w": (2, 3, 4)},
            ranges={"i": "3"},
        ),
        [(2, 3, 4)],
    ),
    # a reshape to [-1, 0] (the rows merged beside no features) is refused by PyTorch and
    # JAX: the merged axis is spelled out
    "segment_max_without_features": (
        Case(
            "y[v,f] = max(where(seg[n] == v, x[n,f], -inf), n)",
            {"x": (6, 0)},
            attrs={"V": 4},
            attr_types={"V": "int"},
            ranges={"v": "V"},
            index_inputs={"seg": ((6,), 0, 4)},
        ),
        [(4, 0)],
    ),
    "gathered_segment_sum_without_features": (
        Case(
            "y[v,f] = sum(where(dst[n] == v, x[src[n],f], 0), n)",
            {"x": (6, 0)},
            ranges={"v": "x.shape[0]"},
            index_inputs={"src": ((5,), 0, 6), "dst": ((5,), 0, 6)},
        ),
        [(6, 0)],
    ),
    # a recurrence over no positions, or over positions of no state: PyTorch's and JAX's
    # chunked scans had no chunk to join (one position of zeros is scanned, none kept);
    # TF's gradient of an input read at lags gathered from an empty batch
    "linear_recurrence_over_no_steps": (
        Case(LINEAR, {"a": (2, 0, 3), "x": (2, 0, 3)}, low=0.5, high=0.9),
        [(2, 0, 3)],
    ),
    "linear_recurrence_without_batch": (
        Case(LINEAR, {"a": (0, 4, 3), "x": (0, 4, 3)}),
        [(0, 4, 3)],
    ),
    "linear_recurrence_without_features": (
        Case(LINEAR, {"a": (2, 4, 0), "x": (2, 4, 0)}),
        [(2, 4, 0)],
    ),
    "lagged_recurrence_over_no_steps": (Case(IIR, {"bb": (3,), "a": (2,), "x": (2, 0)}), [(2, 0)]),
    "lagged_recurrence_without_batch": (Case(IIR, {"bb": (3,), "a": (2,), "x": (0, 5)}), [(0, 5)]),
    "pooling_to_nothing": (
        Case("y[b,i,c] = max(x[b, 2*i+u, c], u)", {"x": (2, 1, 3)}, ranges={"u": "2"}),
        [(2, 0, 3)],
    ),
}


@pytest.mark.parametrize("target", sorted(FRAMEWORKS))
@pytest.mark.parametrize("name", sorted(EMPTY))
def test_empty_axes_give_zeros_of_the_right_shapes(name, target, tmp_path):
    case, shapes = EMPTY[name]
    module = generate(case, tmp_path, "Empty", target)
    outputs, gradients = run_everywhere(FRAMEWORKS[target], module, case)
    for how, found in outputs.items():
        assert [o.shape for o in found] == shapes, how
        for o in found:
            np.testing.assert_array_equal(o, np.zeros(o.shape), err_msg=how)
    for how, found in gradients.items():
        for input_name, g in zip(module.INPUTS, found, strict=True):
            if input_name in case.index_inputs:
                assert g is None, how
                continue
            assert g.shape == case.shapes[input_name], f"{how}: {input_name}"
            np.testing.assert_array_equal(g, np.zeros(g.shape), err_msg=f"{how}: {input_name}")


# Positions that simplify to a plain index, as templated formulas write them.
PLAIN = ["x[b, i + 0]", "x[b, 1*i]", "x[b, 2*i - i]", "x[b, i + k - k]"]


@pytest.mark.parametrize("target", sorted(FRAMEWORKS))
@pytest.mark.parametrize("read", PLAIN)
def test_positions_that_simplify_to_a_plain_index(read, target, tmp_path):
    case = Case(f"y[b,i] = 3 * {read}", {"x": (2, 5)}, sizes={"k": 4})
    if "k" in read:
        case = Case(f"y[b,i] = sum(3 * {read}, k)", {"x": (2, 5)}, ranges={"k": "4"})
    module = generate(case, tmp_path, "Plain", target)
    fw = FRAMEWORKS[target]
    x = np.arange(10.0).reshape(2, 5)
    scale = 12 if "k" in read else 3
    np.testing.assert_allclose(fw.numpy(module.forward(fw.tensor(x))), scale * x)
    (grad,) = module.vjp(fw.tensor(x), fw.tensor(np.ones((2, 5))))
    np.testing.assert_allclose(fw.numpy(grad), np.full((2, 5), float(scale)))


@pytest.mark.parametrize("target", sorted(FRAMEWORKS))
@pytest.mark.parametrize("scale", ["1000000000", "100000000"])
def test_an_absurdly_large_output_is_refused_before_allocating(scale, target, tmp_path):
    """A range of x.shape[1] * 10**9 (or 10**8) would allocate until the process is
    killed: one line naming the op, the output and its number of elements instead."""
    case = Case(STRIDED, {"x": (2, 6, 3), "w": (1, 3, 4)}, ranges={"i": f"x.shape[1] * {scale}"})
    module = generate(case, tmp_path, "Huge", target)
    fw = FRAMEWORKS[target]
    x, w = (fw.tensor(np.ones(case.shapes[n])) for n in module.INPUTS)
    elements = 2 * 6 * int(scale) * 4
    expected = rf"^Huge\d+: output y\[i\] would have {elements} elements"
    for call in (
        lambda: module.forward(x, w),
        lambda: module.vjp(x, w, fw.tensor(np.ones((2, 1, 4)))),
    ):
        with pytest.raises(ValueError, match=expected) as error:
            call()
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("target", sorted(FRAMEWORKS))
def test_a_recurrence_without_feedback_is_its_feedforward_part(target, tmp_path):
    """An IIR filter given no feedback coefficients (`a` of shape (0,): lfilter's a[1:]
    of a pure FIR filter) carries a window of no past outputs: every step had pushed its
    output into that window, which then grew by one (JAX's scan refused the carry, TF and
    PyTorch indexed past its end in the gradient; TF's gradient under unknown sizes
    gathered no lags from a TensorArray of unknown element shape). Its forward and a
    training step equal the reference evaluator's of the FIR filter alone (bb and x
    drawn alike: `a` draws nothing), and `a` gets a gradient of shape (0,)."""
    case = Case(IIR, {"bb": (3,), "a": (0,), "x": (2, 5)})
    fir = Case("y[b,t] = sum(bb[k] * x[b,t-k], k)", {"bb": (3,), "x": (2, 5)}, sizes={"t": 5})
    module = generate(case, tmp_path, "NoFeedback", target)
    fw = FRAMEWORKS[target]
    outputs, gradients = run_everywhere(fw, module, case)
    named = dict(zip(("bb", "x"), make_tensors(fir, ("bb", "x")), strict=True))
    (expected,) = reference(fir, named)
    for how, (found,) in outputs.items():
        np.testing.assert_allclose(found, expected.numpy(), rtol=1e-12, err_msg=how)
    step, want = train_step(fw, module, case), reference_train_step(fir, ("bb", "x"))
    grads = dict(zip(module.INPUTS, step["grads"], strict=True))
    assert grads.pop("a").shape == (0,)
    for got, wanted in zip(grads.values(), want["grads"], strict=True):
        np.testing.assert_allclose(got, wanted, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose([step["loss"], step["after"]], [want["loss"], want["after"]])
    for how, found in gradients.items():
        for name, g in zip(module.INPUTS, found, strict=True):
            assert g.shape == case.shapes[name], f"{how}: {name}"
    if target == "tensorflow":  # a TensorArray of unknown element shape gathered no lags
        unknown_sizes_equal_eager(module, make_tensors(case, module.INPUTS), {}, seed=3)

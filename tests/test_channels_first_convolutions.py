"""Convolutions in any layout of x and w (symgrad/patterns.py): PyTorch's NCHW and OIHW,
`y[b,o,i,j] = Σ x[b,c,i+u-1,j+v-1] · w[o,c,u,v]`, as much as TF's NHWC and HWIO, are the
frameworks' convolution kernels (x and w transposed into the kernels' layout, the
gradients back), never the gathered window (9x x for a 3 x 3 filter) tiled in chunks."""

from __future__ import annotations

import re

import numpy as np
import pytest
from harness import Case, check, generate, op_spec
from target_harness import check_graphs_equal_eager, check_in_target
from test_segment_extrema import _bodies

from symgrad.pipeline import module_text

CASES = {
    # a SAME 3 x 2 filter over NCHW (PyTorch's Conv2d with padding (1, 0))
    "nchw": Case(
        "y[b,o,i,j] = sum(w[o,c,u,v] * x[b,c,i+u-1,j+v-1], c, u, v)",
        {"x": (2, 3, 7, 6), "w": (4, 3, 3, 2)},
        ranges={"i": "x.shape[2]", "j": "x.shape[3] - 1"},
        sizes={"i": 7, "j": 5},
        fd_directions=4,
    ),
    # a stride along the rows, a bias per output channel
    "nchw_stride_bias": Case(
        "y[b,o,i,j] = sum(w[o,c,u,v] * x[b,c,2*i+u-1,j+v], c, u, v) + bias[o]",
        {"x": (2, 3, 9, 6), "w": (4, 3, 3, 2), "bias": (4,)},
        ranges={"i": "4", "j": "5"},
        sizes={"i": 4, "j": 5},
        fd_directions=4,
    ),
    # mmcv's masked_conv2d: a SAME 3 x 3 convolution kept where the mask is set
    "masked_conv2d": Case(
        "y[b,o,i,j] = where(mask[b,i,j] > 0, "
        "sum(w[o,c,u,v] * x[b,c,i+u-1,j+v-1], c, u, v) + bias[o], 0)",
        {"x": (2, 3, 5, 6), "w": (4, 3, 3, 3), "bias": (4,), "mask": (2, 5, 6)},
        no_gradient=("mask",),
        ranges={"i": "x.shape[2]", "j": "x.shape[3]"},
        fd_directions=4,
    ),
    # Conv1d over (batch, channels, length)
    "ncl": Case(
        "y[b,o,t] = sum(w[o,c,k] * x[b,c,t+k], c, k)",
        {"x": (2, 3, 9), "w": (5, 3, 4)},
        ranges={"t": "x.shape[2] - w.shape[2] + 1"},
        sizes={"t": 6},
    ),
    # axes in no framework's order: x[c,i,b,j], w[v,o,u,c], y[o,i,b,j]
    "shuffled": Case(
        "y[o,i,b,j] = sum(w[v,o,u,c] * x[c,i+u,b,j+v], c, u, v)",
        {"x": (3, 6, 2, 5), "w": (2, 4, 3, 3)},
        ranges={"i": "x.shape[1] - w.shape[2] + 1", "j": "x.shape[3] - w.shape[0] + 1"},
        sizes={"i": 4, "j": 4},
        fd_directions=4,
    ),
    # Conv3d over NCDHW
    "ncdhw": Case(
        "y[b,o,i,j,k] = sum(w[o,c,u,v,s] * x[b,c,i+u,j+v,k+s], c, u, v, s)",
        {"x": (1, 2, 4, 5, 3), "w": (3, 2, 2, 2, 2)},
        ranges={"i": "x.shape[2] - 1", "j": "x.shape[3] - 1", "k": "x.shape[4] - 1"},
        sizes={"i": 3, "j": 4, "k": 2},
        fd_directions=4,
    ),
}

# Not a convolution of the kernels: a dilated one (TF's CPU backprop kernels refuse
# dilations): a gather, exact (a depthwise filter, c read by w and kept in y, is the
# depthwise kernels: test_depthwise_convolutions)
GATHERS = {
    "dilated": Case(
        "y[b,o,i] = sum(w[o,c,k] * x[b,c,i+2*k], c, k)",
        {"x": (2, 3, 9), "w": (4, 3, 3)},
        ranges={"i": "x.shape[2] - 4"},
        sizes={"i": 5},
    ),
}


def _text_and_bodies(case: Case, target: str = "tensorflow") -> tuple[str, str, str]:
    """The module's text, its `_compute` and its `_backward`."""
    text = module_text(op_spec(case, "ChannelsFirst"), "test.toml", target)
    return (text, *_bodies(text))


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_convolution_in_any_layout_is_the_kernel(name, tmp_path):
    """TF: tf.nn.convolution forward, the backprop kernels backward, no gather and no
    chunks; forward and every gradient path against TF autodiff over the reference
    evaluator and finite differences."""
    case = CASES[name]
    text, compute, backward = _text_and_bodies(case)
    assert "_convolution(" in compute and "Backprop" in backward
    assert "_tile_plan" not in text
    for body in (compute, backward):  # x is never gathered (masked_conv2d's mask is)
        assert not re.search(r"gather\(x\b", body) and "segment_sum" not in body
    check(case, generate(case, tmp_path, prefix="ChannelsFirst"))


@pytest.mark.parametrize("target", ["pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_convolution_in_any_layout_in_every_target(name, target, tmp_path):
    case = CASES[name]
    _, compute, _ = _text_and_bodies(case, target)
    assert "_convolution(" in compute and not re.search(r"gather\(x\b", compute)
    check_in_target(case, target, tmp_path)


@pytest.mark.parametrize("name", sorted(GATHERS))
def test_a_dilated_window_stays_an_exact_gather(name, tmp_path):
    case = GATHERS[name]
    _, compute, _ = _text_and_bodies(case)
    assert "_convolution(" not in compute and "gather(" in compute
    check(case, generate(case, tmp_path, prefix="NotAKernel"))


def test_an_nchw_convolution_under_tf_function_with_unknown_dims_and_under_xla(tmp_path):
    """Every size unknown while tracing, and under XLA: forward and gradients equal the
    eager module."""
    import tensorflow as tf

    module = generate(CASES["nchw_stride_bias"], tmp_path, prefix="Unknown")
    rng = np.random.default_rng(0)
    named = {"x": (2, 3, 9, 6), "w": (4, 3, 3, 2), "bias": (4,)}
    args = [tf.constant(rng.standard_normal(named[n])) for n in module.INPUTS]
    check_graphs_equal_eager(module, args)


def test_pytorch_nchw_step_holds_no_window(tmp_path):
    """A 3 x 3 SAME convolution, float32, 2 x 16 x 32 x 32 into 16 channels: the step
    (forward and every gradient) holds at most 4x its inputs and outputs plus a 64 KiB
    budget, one piece, with no plan; its gathered window alone would be 9x x (1.18 MB,
    the bound 1.15 MB), and the step equals torch's own conv2d's."""
    torch = pytest.importorskip("torch")
    from peaks import torch_peak

    case = CASES["masked_conv2d"]
    formula = case.equations[0].replace("where(mask[b,i,j] > 0, ", "").replace(", 0)", "")
    module = generate(
        Case(formula, {}, ranges={"i": "x.shape[2]", "j": "x.shape[3]"}),
        tmp_path,
        prefix="TorchStep",
        target="pytorch",
    )
    assert not hasattr(module, "_tile_plan")
    rng = np.random.default_rng(3)
    shapes = {"x": (2, 16, 32, 32), "w": (16, 16, 3, 3), "bias": (16,)}
    named = {
        n: torch.tensor(rng.standard_normal(s), dtype=torch.float32, requires_grad=True)
        for n, s in shapes.items()
    }
    xs = [named[n] for n in module.INPUTS]
    module.MAX_TEMP_BYTES = 2**16

    def step():
        return torch.autograd.grad(torch.sin(module.forward(*xs)).sum(), xs)

    y_bytes = 2 * 16 * 32 * 32 * 4
    bound = 4 * (sum(x.nbytes for x in xs) + y_bytes) + 2**16
    held = torch_peak(step)
    assert held <= bound, (held, bound)
    doubles = [x.detach().double().requires_grad_() for x in xs]
    x, w, bias = (doubles[module.INPUTS.index(n)] for n in ("x", "w", "bias"))
    want = torch.autograd.grad(
        torch.sin(torch.nn.functional.conv2d(x, w, bias, padding=1)).sum(), doubles
    )
    got = torch.autograd.grad(torch.sin(module.forward(*doubles)).sum(), doubles)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)

"""Sampled reads in float32 far from the origin: image values around 1e4 whose neighbours
differ by about 1, grid points and boxes away from the origin. The gradient of a position
is a difference of neighbours; subtracting them before weighting (interpolation.py) keeps
it as accurate as PyTorch's own grid_sampler, where the weighted sum of the corners'
products lost three digits. The truth is the same op in float64 on the same
(float32-representable) inputs."""

from __future__ import annotations

import numpy as np
import pytest
from frameworks import FRAMEWORKS
from harness import load_module
from test_sampled_reads import GRID_SAMPLE, ROI_ALIGN, grid_sample_torch

from symgrad.pipeline import module_text
from symgrad.spec import parse_op

torch = pytest.importorskip("torch")

TARGETS = ("tensorflow", "pytorch", "jax")


def generated(table: dict, name: str, target: str, folder):
    text = module_text(parse_op(name, table, "test.toml"), "test.toml", target)
    return load_module(text, folder, f"f32_{name.lower()}_{target}")


def as_float32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32).astype(np.float64)


def relative_errors(got, want) -> list[float]:
    return [float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want, strict=True)]


def run(module, target: str, inputs, grad, dtype, **attrs):
    fw = FRAMEWORKS[target]
    tensors = [fw.tensor(a.astype(dtype) if a.dtype.kind == "f" else a) for a in (*inputs, grad)]
    out = module.forward(*tensors[:-1], **attrs)
    grads = module.vjp(*tensors, **attrs)
    return [fw.numpy(t).astype(np.float64) for t in (out, *grads) if t is not None]


@pytest.mark.parametrize("target", TARGETS)
def test_grid_sample_in_float32_far_from_the_origin_is_as_accurate_as_torch(target, tmp_path):
    rng = np.random.default_rng(0)
    x = as_float32(1e4 + rng.standard_normal((2, 3, 40, 50)))
    g = as_float32(rng.uniform(-0.95, 0.95, (2, 6, 7, 2)))
    grad = rng.standard_normal((2, 3, 6, 7))
    want = grid_sample_torch(x, g, grad)  # float64
    xt, gt = (torch.tensor(a, dtype=torch.float32, requires_grad=True) for a in (x, g))
    yt = torch.nn.functional.grid_sample(
        xt, gt, mode="bilinear", padding_mode="zeros", align_corners=True
    )
    yt.backward(torch.tensor(grad, dtype=torch.float32))
    torchs = relative_errors([t.detach().double().numpy() for t in (yt, xt.grad, gt.grad)], want)
    module = generated(GRID_SAMPLE, "GridSample", target, tmp_path)
    ours = relative_errors(run(module, target, (x, g), grad, np.float32), want)
    # y, the image's and the grid's gradient: within twice torch's own float32 error (the
    # grid's was 200x torch's when the corners' products were subtracted)
    for what, mine, theirs in zip(("y", "grad x", "grad grid"), ours, torchs, strict=True):
        assert mine <= 2 * theirs + 1e-7, (what, mine, theirs)


def test_roi_align_in_float32_far_from_the_origin(tmp_path):
    """Boxes 30-70 pixels from the origin on an image around 1e4: every gradient within
    1e-5 of the float64 truth relative to its largest entry (the boxes' were 3e-4)."""
    rng = np.random.default_rng(1)
    x = as_float32(1e4 + rng.standard_normal((2, 3, 80, 90)))
    bi = rng.integers(0, 2, (5,))
    boxes = [
        as_float32(rng.uniform(low, high, (5,)))
        for low, high in ((30, 60), (30, 70), (1, 4), (1, 4))
    ]
    grad = rng.standard_normal((5, 3, 3, 4))
    attrs = {"S": 2, "PH": 3, "PW": 4}
    module = generated(ROI_ALIGN, "RoiAlign", "pytorch", tmp_path)
    inputs = (x, bi, *boxes)
    want = run(module, "pytorch", inputs, grad, np.float64, **attrs)
    got = run(module, "pytorch", inputs, grad, np.float32, **attrs)
    errors = relative_errors(got, want)
    assert max(errors) <= 1e-5, errors

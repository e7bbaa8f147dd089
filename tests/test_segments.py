"""Segment reductions written with a mask, `where(seg[n] == v, .., 0)`: a segment sum
forward and a read at the ids backward, in every target, never an N x V mask."""

from __future__ import annotations

import ast

import pytest
from harness import Case, check, generate, op_spec

from symgrad.pipeline import module_text

CASES = {
    # mmcv / torch_scatter style: features of points summed per voxel (ids out of range:
    # -1 and 6 >= V add nothing).
    "segment_sum": Case(
        "y[v,f] = sum(where(seg[n] == v, x[n,f], 0), n)",
        {"x": (7, 3)},
        attrs={"V": 4},
        ranges={"v": "V"},
        sizes={"v": 4},
        index_inputs={"seg": ((7,), -1, 6)},
    ),
    # a segment mean of a nonlinearity: two segment sums, one of them a count
    "segment_mean_tanh": Case(
        "y[v,f] = sum(where(seg[n] == v, tanh(x[n,f]), 0), n) / sum(where(seg[m] == v, 1, 0), m)",
        {"x": (9, 5)},
        attrs={"V": 4},
        ranges={"v": "V"},
        sizes={"v": 4},
        index_inputs={"seg": ((9,), 0, 4)},
    ),
    # ids over two axes, a weight read per feature
    "segment_sum_2d_ids": Case(
        "y[v,f] = sum(where(seg[a,n] == v, x[a,n,f] * w[f], 0), a, n)",
        {"x": (2, 5, 3), "w": (3,)},
        attrs={"V": 6},
        ranges={"v": "V"},
        sizes={"v": 6},
        index_inputs={"seg": ((2, 5), -2, 8)},
    ),
    # ids per batch (torch_scatter's batched scatter over dim 1): segments are (b, v)
    # pairs; ids out of range (-1, 5 >= V) add nothing
    "batched_segment_sum": Case(
        "y[b,v,f] = sum(where(seg[b,n] == v, x[b,n,f], 0), n)",
        {"x": (2, 7, 3)},
        attrs={"V": 4},
        ranges={"v": "V"},
        sizes={"v": 4},
        index_inputs={"seg": ((2, 7), -1, 6)},
    ),
    # batched ids on their second axis, a nonlinearity, V from an attr
    "batched_segment_sum_tanh": Case(
        "y[b,v,f] = sum(where(seg[n,b] == v, tanh(x[b,n,f]), 0), n)",
        {"x": (3, 6, 2)},
        attrs={"V": 5},
        ranges={"v": "V"},
        sizes={"v": 5},
        index_inputs={"seg": ((6, 3), 0, 6)},
    ),
    # batched ids over values without the batch index (mmcv's roiaware_pool3d: a voxel
    # per roi r and point n, the points' features shared by the rois): the gradient of f
    # is summed over r, read at row r*V + vox[r,n] first (it was an [r,n,v] mask)
    "batched_ids_shared_values": Case(
        "y[r,v,c] = sum(where(vox[r,n] == v, f[n,c], 0), n)",
        {"f": (7, 3)},
        attrs={"V": 4},
        ranges={"v": "V"},
        sizes={"v": 4},
        index_inputs={"vox": ((3, 7), -1, 6)},
    ),
    # a weight's gradient summed over the batch index of the ids
    "batched_segment_sum_weight": Case(
        "y[b,v,f] = sum(where(seg[b,n] == v, x[b,n,f] * w[f], 0), n)",
        {"x": (2, 7, 3), "w": (3,)},
        attrs={"V": 4},
        ranges={"v": "V"},
        sizes={"v": 4},
        index_inputs={"seg": ((2, 7), -1, 6)},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_segment_sums_are_exact_and_never_a_dense_mask(name, tmp_path):
    case = CASES[name]
    text = module_text(op_spec(case, "Segments"), "test.toml")
    tree = ast.parse(text)
    compute, backward = (
        ast.get_source_segment(text, node)
        for name in ("_compute", "_backward")
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == name
    )
    assert "segment_sum(" in compute
    assert "gather(" in backward  # the gradient reads grad_y at the ids
    for body in (compute, backward):
        assert "==" not in body and "tf.equal" not in body  # no N x V mask
    check(case, generate(case, tmp_path, prefix="Segments"))


@pytest.mark.parametrize("target", ["pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_segment_sums_in_every_target(name, target, tmp_path):
    from target_harness import check_in_target

    check_in_target(CASES[name], target, tmp_path)


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
def test_an_empty_feature_axis_sums_to_an_empty_result(target, tmp_path):
    """Features of size 0: the segment sum's rows are counted, not -1 (PyTorch refuses a
    reshape to [-1, 0]: 'the unspecified dimension size -1 can be any value'). The
    output and the gradient are empty, shaped like y and x."""
    import numpy as np
    from frameworks import FRAMEWORKS

    fw = FRAMEWORKS[target]
    module = generate(CASES["batched_segment_sum"], tmp_path, prefix="EmptyF", target=target)
    seg = np.array([[0, 3, -1], [2, 2, 5]], np.int32)
    args = {"seg": fw.tensor(seg), "x": fw.tensor(np.zeros((2, 3, 0)))}
    xs = [args[n] for n in module.INPUTS]
    y = fw.numpy(module.forward(*xs, V=4))
    assert y.shape == (2, 4, 0)
    grads = module.vjp(*xs, fw.tensor(np.zeros((2, 4, 0))), V=4)
    assert fw.numpy(grads[module.INPUTS.index("x")]).shape == (2, 3, 0)

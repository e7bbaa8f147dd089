"""A segment id compared with a row-major composite of indices, `where(ids.. == i*W + j,
..)` (symgrad/segment_cells.py, `composite`): a segment sum (or max) over the cell
(i, j) with the id as its row, in every target, never the dense mask over the ids' and
the composite's indices together. Ids outside [0, I·W) belong to no cell; a stride that
is not provably the size inside (an attr that is not the range) keeps the dense mask,
exact as written."""

from __future__ import annotations

import numpy as np
import pytest
from harness import Case, check, generate, op_spec
from target_harness import check_in_target
from test_segment_extrema import _bodies

from symgrad.pipeline import module_text

CASES = {
    # SegNet's max_unpool2d: each input value written at its flat position idx (i*W + j)
    # of an H x W plane; ids outside the plane (negative, or past H*W) write nothing
    "max_unpool2d": Case(
        "y[b,c,i,j] = sum(where(idx[b,c,p,q] == i*W + j, x[b,c,p,q], 0), p, q)",
        {"x": (2, 3, 4, 5)},
        attrs={"H": 6, "W": 7},
        ranges={"i": "H", "j": "W"},
        sizes={"i": 6, "j": 7},
        index_inputs={"idx": ((2, 3, 4, 5), -3, 45)},
        fd_directions=4,
    ),
    # mmcv's active_rotated_filter with the weight's three entry axes, a table of 1-based
    # positions drawn past both ends (0 and below, beyond O*H*W)
    "active_rotated_filter_out_of_range": Case(
        "y[(i,k),(j,o),h,w] = sum(where(ind[o2,h2,w2,k] - 1 == (o*H + h)*W + w, "
        "wt[i,j,o2,h2,w2], 0), o2, h2, w2)",
        {"wt": (2, 3, 4, 3, 3)},
        attrs={"H": 3, "W": 3},
        ranges={"k": "ind.shape[3]", "o": "wt.shape[2]", "h": "H", "w": "W"},
        sizes={"k": 4, "o": 4, "h": 3, "w": 3},
        index_inputs={"ind": ((4, 3, 3, 4), -40, 80)},
        fd_directions=4,
    ),
    # the plane written transposed (y[b,j,i]), a weight, a literal stride equal to the
    # range
    "transposed_with_a_weight": Case(
        "y[b,j,i,f] = sum(where(pos[b,n] == i*3 + j, x[b,n,f] * w[f], 0), n)",
        {"x": (2, 9, 2), "w": (2,)},
        ranges={"i": "2", "j": "3"},
        sizes={"i": 2, "j": 3},
        index_inputs={"pos": ((2, 9), -1, 8)},
    ),
    # mmdet3d's PointPillarsScatter: each pillar's features written at its flat canvas
    # position cy*NX + cx (the id itself an expression of two index tensors; a cx past
    # NX lands in the next row, as the flat index the kernel computes does)
    "pointpillars_scatter": Case(
        "y[b,c,i,j] = sum(where(cy[b,p]*NX + cx[b,p] == i*NX + j, v[b,p,c], 0), p)",
        {"v": (2, 7, 3)},
        attrs={"NX": 4, "NY": 3},
        ranges={"i": "NY", "j": "NX"},
        sizes={"i": 3, "j": 4},
        index_inputs={"cy": ((2, 7), -1, 4), "cx": ((2, 7), -1, 5)},
        fd_directions=4,
    ),
    # a scatter max into a grid (PointPillars' pillar max); empty cells are -inf, so no
    # finite differences through them (TF autodiff still checks every gradient)
    "scatter_max_into_a_grid": Case(
        "y[b,i,j,f] = max(where(pos[b,n] == i*W + j, x[b,n,f], -inf), n)",
        {"x": (2, 9, 3)},
        attrs={"H": 2, "W": 3},
        ranges={"i": "H", "j": "W"},
        sizes={"i": 2, "j": 3},
        index_inputs={"pos": ((2, 9), -1, 7)},
        finite_differences=False,
    ),
}

# The composite summed: a read of the plane at each flat id (CenterNet's
# _transpose_and_gather_feat: the features at the top-K centres, ind = y*W + x), its
# gradient a segment sum into the plane
READS = {
    "centernet_gather_feat": Case(
        "y[b,k,c] = sum(where(ind[b,k] == i*W + j, feat[b,c,i,j], 0), i, j)",
        {"feat": (2, 3, 4, 5)},
        attrs={"W": 5},
        ranges={"j": "W"},
        index_inputs={"ind": ((2, 6), -2, 23)},
    ),
}


@pytest.mark.parametrize("target", ["tensorflow", "pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(READS))
def test_a_composite_id_summed_is_a_read_of_the_plane(name, target, tmp_path):
    """A gather forward and a segment sum backward, no `==` mask; TF against autodiff
    and finite differences, PyTorch and JAX against their harness."""
    case = READS[name]
    if target == "tensorflow":
        compute, backward = _case_bodies(case, "CompositeRead")
        assert "_gather(" in compute and "segment_sum(" in backward
        assert "==" not in compute and "==" not in backward
        check(case, generate(case, tmp_path, prefix="CompositeRead"))
        return
    check_in_target(case, target, tmp_path)


# Strides that are not the sizes inside: the composite may alias (W = 2 < |j| = 3 sends
# (0, 2) and (1, 0) to one id), so these keep the dense mask, exact as written.
DENSE = {
    "stride_not_the_range": Case(
        "y[b,i,j] = sum(where(pos[b,n] == i*W + j, x[b,n], 0), n)",
        {"x": (2, 9)},
        attrs={"W": 2},
        ranges={"i": "2", "j": "3"},
        sizes={"i": 2, "j": 3},
        index_inputs={"pos": ((2, 9), -1, 7)},
    ),
    "outer_stride_not_the_product": Case(
        "y[o,h,w] = sum(where(pos[n] == (o*H + h)*W + w, x[n], 0), n)",
        {"x": (11,)},
        attrs={"H": 2, "W": 2},
        ranges={"o": "2", "h": "H + 1", "w": "W"},
        sizes={"o": 2, "h": 3, "w": 2},
        index_inputs={"pos": ((11,), -1, 13)},
    ),
}


def _case_bodies(case: Case, name: str):
    """The TF module's `_compute` and `_backward`."""
    return _bodies(module_text(op_spec(case, name), "test.toml"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_composite_id_is_a_segment_and_exact(name, tmp_path):
    """TF: a segment reduction forward, a read at the ids backward, no `==` mask; forward
    and every gradient path against TF autodiff over the reference evaluator (and finite
    differences where the outputs are finite)."""
    case = CASES[name]
    compute, backward = _case_bodies(case, "Composite")
    assert "segment_sum(" in compute or "segment_max(" in compute
    assert "gather(" in backward
    for body in (compute, backward):
        # a max's ties compare each value with the max read at its id, nothing else
        compared = [line for line in body.splitlines() if "==" in line or "tf.equal" in line]
        assert all("_gather(" in line for line in compared), compared
    check(case, generate(case, tmp_path, prefix="Composite"))


@pytest.mark.parametrize("target", ["pytorch", "jax"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_composite_id_in_every_target(name, target, tmp_path):
    check_in_target(CASES[name], target, tmp_path)


@pytest.mark.parametrize("name", sorted(DENSE))
def test_a_stride_that_may_alias_keeps_the_dense_mask(name, tmp_path):
    case = DENSE[name]
    compute, _ = _case_bodies(case, "Aliased")
    assert "segment_sum(" not in compute and "==" in compute
    check(case, generate(case, tmp_path, prefix="Aliased"))


def test_ids_past_either_end_add_nothing(tmp_path):
    """max_unpool2d at ids -1, H*W and beyond, and 0: only the in-plane ones land (summed
    where two share a position); their gradients read the plane there, the others 0."""
    case = CASES["max_unpool2d"]
    module = generate(case, tmp_path, prefix="Unpool")
    x = np.arange(1.0, 5.0).reshape(1, 1, 2, 2)
    idx = np.array([[[[-1, 0], [42, 0]]]], np.int32)  # H*W = 42: one past the plane
    y = module.forward(idx, x, H=6, W=7).numpy()
    want = np.zeros((1, 1, 6, 7))
    want[0, 0, 0, 0] = 2.0 + 4.0
    np.testing.assert_array_equal(y, want)
    g = np.arange(42.0).reshape(1, 1, 6, 7) + 1
    (_, gx) = module.vjp(idx, x, g, H=6, W=7)
    np.testing.assert_array_equal(gx.numpy(), [[[[0.0, 1.0], [0.0, 1.0]]]])

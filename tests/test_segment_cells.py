"""A conjunction of equalities, `vx[r,n] == i and vy[r,n] == j and vz[r,n] == k`, is one
segment over the cell (i, j, k) (symgrad/segment_cells.py): sums, means and maxima by
segment kernels, never the [r,n,i,j,k] mask, exact against loops in NumPy (ids out of
range, negative or equal to their range, belong to no cell; ties split; empty cells) and
against TF float64 autodiff; conjunctions that are no cell stay exact masks."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from harness import Case, check, generate, op_spec
from test_segment_extrema import _bodies

from symgrad.model import build
from symgrad.pipeline import module_text
from symgrad.segment_cells import find, flat_term

CELL = "vx[r,n] == i and vy[r,n] == j and vz[r,n] == k"
SHAPE = (2, 3, 2)
ATTRS = {"OX": 2, "OY": 3, "OZ": 2}
RANGES = {"i": "OX", "j": "OY", "k": "OZ"}
SIZES = dict(zip("ijk", SHAPE, strict=True))

FORMULAS = {
    "sum": f"y[r,i,j,k,c] = sum(where({CELL}, f[n,c], 0), n)",
    "mean": f"y[r,i,j,k,c] = sum(where({CELL}, f[n,c], 0), n) "
    f"/ max(sum(where({CELL}, 1, 0), n), 1)",
    "max": f"y[r,i,j,k,c] = max(where({CELL}, f[n,c], -inf), n)",
}


def _ids(shape, low, high):
    return {name: (shape, low, high + 1) for name in ("vx", "vy", "vz")}


def _case(formula: str, ids=None, shapes=None, **more) -> Case:
    return Case(
        formula,
        shapes or {"f": (9, 2)},
        attrs=ATTRS,
        ranges=RANGES,
        sizes=SIZES,
        index_inputs=ids or _ids((2, 9), -1, 3),  # -1 and 3 (>= every range) included
        **more,
    )


CASES = {
    "sum": _case(FORMULAS["sum"]),
    "mean": _case(FORMULAS["mean"]),
    # an empty cell is -inf: finite differences there are inf - inf (autodiff still checked)
    "max": _case(FORMULAS["max"], finite_differences=False),
    # mmcv's roiaware_maxpool3d: an empty voxel 0
    "roiaware_max": _case(
        f"y[r,i,j,k,c] = where(sum(where({CELL}, 1, 0), n) > 0, "
        f"max(where({CELL}, f[n,c], -inf), n), 0)"
    ),
    # coordinates written in another order than the output's axes, a weight per roi
    "permuted": _case(
        "y[r,k,c,i,j] = sum(where(vz[r,n] == k and vx[r,n] == i and vy[r,n] == j, "
        "f[n,c] * u[r], 0), n)",
        shapes={"f": (9, 2), "u": (2,)},
    ),
    # the same id tensor twice: only the cells with i == j hold points
    "same_ids_twice": Case(
        "y[r,i,j,c] = sum(where(vx[r,n] == i and vx[r,n] == j, f[n,c], 0), n)",
        {"f": (9, 2)},
        attrs={"OX": 3, "OY": 2},
        ranges={"i": "OX", "j": "OY"},
        sizes={"i": 3, "j": 2},
        index_inputs={"vx": ((2, 9), -1, 4)},
    ),
    # the same two id tensors as cells of two outputs over other coordinates (sizes 2 x 3
    # and 3 x 4): each output its own cell ids (the second read the first's, vx·3 + vy,
    # both named after vx and vy alone)
    "two_outputs_over_other_coordinates": Case(
        (
            "y[i,j] = sum(where(vx[n] == i and vy[n] == j, x[n], 0), n)",
            "z[p,q] = sum(where(vx[n] == p and vy[n] == q, x[n], 0), n)",
        ),
        {"x": (9,)},
        ranges={"i": "2", "j": "3", "p": "3", "q": "4"},
        sizes={"i": 2, "j": 3, "p": 3, "q": 4},
        index_inputs={"vx": ((9,), 0, 3), "vy": ((9,), 0, 4)},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_segment_cells_are_exact_and_never_a_dense_mask(name, tmp_path):
    """TF float64 autodiff over the reference evaluator (the dense mask) and finite
    differences; the module holds no range over a coordinate (no [r,n,i,j,k] mask)."""
    case = CASES[name]
    text = module_text(op_spec(case, "SegmentCells"), "test.toml")
    compute, backward = _bodies(text)
    assert "segment_" in compute
    assert "gather(" in backward  # the gradient reads the cells' rows at the ids
    for body in (compute, backward):
        for index in "ijkpq":
            assert f"tf.range(tf.cast(_n_{index}" not in body, index
    check(case, generate(case, tmp_path, prefix="SegmentCells"))


NO_CELLS = {
    # an equality with an expression: `vx + 1 == i` is no segment equality
    "shifted": _case(
        "y[r,i,j,k,c] = sum(where(vx[r,n] + 1 == i and vy[r,n] == j and vz[r,n] == k, "
        "f[n,c], 0), n)"
    ),
    # a condition that is no equality: the conjunction stays a mask
    "with_a_threshold": _case(
        f"y[r,i,j,k,c] = sum(where({CELL} and f[n,c] > 0, f[n,c], 0), n)",
    ),
    # a coordinate read elsewhere (the value at i alone)
    "coordinate_read_alone": _case(
        f"y[r,i,j,k,c] = sum(where({CELL}, f[n,c] * u[i], 0), n)",
        shapes={"f": (9, 2), "u": (2,)},
    ),
}


@pytest.mark.parametrize("name", sorted(NO_CELLS))
def test_conjunctions_that_are_no_cells_stay_exact_masks(name, tmp_path):
    case = NO_CELLS[name]
    program = build(op_spec(case, "NoCell"))
    (term,) = program.outputs[0].level.terms
    *_, cell = flat_term(
        term.expr, program.outputs[0].level.indices, term.summed, ("vx", "vy", "vz")
    )
    assert cell is None
    check(case, generate(case, tmp_path, prefix="NoCell"))


def test_a_cell_needs_every_id_at_the_same_indices():
    program = build(
        op_spec(
            _case(
                "y[r,i,j,k,c] = sum(where(vx[r,n] == i and vy[n,r] == j and vz[r,n] == k, "
                "f[n,c], 0), n)",
                ids={"vx": ((2, 9), 0, 2), "vy": ((9, 2), 0, 3), "vz": ((2, 9), 0, 2)},
            ),
            "Transposed",
        )
    )
    (term,) = program.outputs[0].level.terms
    assert find(term.expr, ("vx", "vy", "vz")) is None


# ------------------------------------------------- against loops over the points, in NumPy


def _data(seed: int = 0):
    """3 rois, 40 points, 2 channels; coordinates from -2 to their range + 1 (so -1, -2,
    and the range itself, which a flat id (vx·J + vy)·K + vz would alias to the next
    row); values in a few integers (ties)."""
    rng = np.random.default_rng(seed)
    R, N, C = 3, 40, 2
    coords = [rng.integers(-2, s + 2, (R, N)).astype(np.int32) for s in SHAPE]
    f = rng.integers(-2, 3, (N, C)).astype(np.float64)
    grad = rng.standard_normal((R, *SHAPE, C))
    return coords, f, grad


def _loops(kind: str, coords, f, grad):
    R, N = coords[0].shape
    C = f.shape[1]
    total = np.zeros((R, *SHAPE, C))
    count = np.zeros((R, *SHAPE))
    top = np.full((R, *SHAPE, C), -np.inf)
    cells = {}
    for r in range(R):
        for n in range(N):
            cell = tuple(int(c[r, n]) for c in coords)
            if not all(0 <= x < s for x, s in zip(cell, SHAPE, strict=True)):
                continue
            cells[r, n] = cell
            total[(r, *cell)] += f[n]
            count[(r, *cell)] += 1
            top[(r, *cell)] = np.maximum(top[(r, *cell)], f[n])
    if kind == "sum":
        y = total
    elif kind == "mean":
        y = total / np.maximum(count, 1)[..., None]
    else:
        y = top
    ties = np.zeros((R, *SHAPE, C))
    for (r, n), cell in cells.items():
        ties[(r, *cell)] += f[n] == top[(r, *cell)]
    dx = np.zeros_like(f)
    for (r, n), cell in cells.items():
        g = grad[(r, *cell)]
        if kind == "sum":
            dx[n] += g
        elif kind == "mean":
            dx[n] += g / count[(r, *cell)]
        else:
            dx[n] += g * (f[n] == top[(r, *cell)]) / ties[(r, *cell)]
    return y, dx


def _tf_step(module, coords, f, grad):
    f = tf.constant(f)
    with tf.GradientTape() as tape:
        tape.watch(f)
        y = module.forward(*(tf.constant(c) for c in coords), f, **ATTRS)
    return y.numpy(), tape.gradient(y, f, output_gradients=tf.constant(grad)).numpy()


def _torch_step(module, coords, f, grad):
    import torch

    leaf = torch.tensor(f, requires_grad=True)
    y = module.forward(*(torch.tensor(c) for c in coords), leaf, **ATTRS)
    (dx,) = torch.autograd.grad(y, leaf, torch.tensor(grad))
    return y.detach().numpy(), dx.numpy()


def _jax_step(module, coords, f, grad):
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    ids = [jnp.asarray(c) for c in coords]
    y, pullback = jax.vjp(lambda u: module.forward(*ids, u, **ATTRS), jnp.asarray(f))
    (dx,) = pullback(jnp.asarray(grad))
    return np.asarray(y), np.asarray(dx)


STEPS = {"tensorflow": _tf_step, "pytorch": _torch_step, "jax": _jax_step}


@pytest.mark.parametrize("target", sorted(STEPS))
@pytest.mark.parametrize("kind", sorted(FORMULAS))
def test_segment_cells_match_loops_with_ids_out_of_range_ties_and_empty_cells(
    kind, target, tmp_path
):
    pytest.importorskip({"pytorch": "torch", "jax": "jax"}.get(target, "tensorflow"))
    coords, f, grad = _data()
    want_y, want_dx = _loops(kind, coords, f, grad)
    assert (np.isinf(want_y) if kind == "max" else want_y == 0).any()  # empty cells
    if kind == "max":  # and ties: some gradient is split
        assert 0 < np.abs(want_dx).min(initial=1, where=want_dx != 0) < np.abs(grad).max()
    case = _case(FORMULAS[kind], shapes={"f": f.shape}, ids=_ids(coords[0].shape, -2, 4))
    module = generate(case, tmp_path, prefix="SegmentCellLoops", target=target)
    y, dx = STEPS[target](module, coords, f, grad)
    np.testing.assert_allclose(y, want_y, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-12, atol=1e-12)


# ------------------------------------------- a weight read over the cell, and its gradient

WEIGHTED = f"y[r,i,j,k,c] = sum(where({CELL}, f[n,c] * w[i,j,k], 0), n)"


def _weighted_loops(coords, f, w, grad):
    """y[r,cell,c] = Σ_n f[n,c]·w[cell]; dw[cell] = Σ_{r,n in cell,c} f[n,c]·grad[r,cell,c]
    and df[n] = Σ_r w[cell]·grad[r,cell]: over the points, never over every cell."""
    R, N = coords[0].shape
    y = np.zeros((R, *SHAPE, f.shape[1]))
    df, dw = np.zeros_like(f), np.zeros_like(w)
    for r in range(R):
        for n in range(N):
            cell = tuple(int(c[r, n]) for c in coords)
            if not all(0 <= x < s for x, s in zip(cell, SHAPE, strict=True)):
                continue
            y[(r, *cell)] += f[n] * w[cell]
            dw[cell] += f[n] @ grad[(r, *cell)]
            df[n] += w[cell] * grad[(r, *cell)]
    return y, df, dw


@pytest.mark.parametrize("target", sorted(STEPS))
def test_a_weight_read_over_the_cell_takes_its_gradient_at_the_cell_ids(target, tmp_path):
    """The gradient of w[i,j,k] is grad_y read at each point's cell and added into w's
    flattened table by cell id, reshaped back: no [r,n,i,j,k] mask (before, the TF
    gradient compared the ids with every cell); exact against loops (ids out of range,
    empty cells) and TF float64 autodiff."""
    pytest.importorskip({"pytorch": "torch", "jax": "jax"}.get(target, "tensorflow"))
    coords, f, grad = _data(1)
    w = np.random.default_rng(2).standard_normal(SHAPE)
    want_y, want_df, want_dw = _weighted_loops(coords, f, w, grad)
    assert (want_dw == 0).any() and (want_y == 0).any()  # an empty cell
    case = _case(WEIGHTED, shapes={"f": f.shape, "w": SHAPE}, ids=_ids(coords[0].shape, -2, 4))
    if target == "tensorflow":
        _, backward = _bodies(module_text(op_spec(case, "WeightedCells"), "test.toml"))
        assert " == " not in backward  # no comparison of the ids with every cell
        assert "segment_sum(" in backward and "gather(" in backward
        check(case, generate(case, tmp_path, prefix="WeightedCells"))
    module = generate(case, tmp_path, prefix="WeightedCellLoops", target=target)
    y, (df, dw) = _weighted_step(target, module, coords, f, w, grad)
    np.testing.assert_allclose(y, want_y, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(df, want_df, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-12, atol=1e-12)


def _weighted_step(target, module, coords, f, w, grad):
    if target == "tensorflow":
        f, w = tf.constant(f), tf.constant(w)
        with tf.GradientTape() as tape:
            tape.watch([f, w])
            y = module.forward(*(tf.constant(c) for c in coords), f, w, **ATTRS)
        got = tape.gradient(y, [f, w], output_gradients=tf.constant(grad))
        return y.numpy(), [g.numpy() for g in got]
    if target == "pytorch":
        import torch

        leaves = [torch.tensor(f, requires_grad=True), torch.tensor(w, requires_grad=True)]
        y = module.forward(*(torch.tensor(c) for c in coords), *leaves, **ATTRS)
        got = torch.autograd.grad(y, leaves, torch.tensor(grad))
        return y.detach().numpy(), [g.numpy() for g in got]
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    ids = [jnp.asarray(c) for c in coords]
    y, pullback = jax.vjp(
        lambda a, b: module.forward(*ids, a, b, **ATTRS), jnp.asarray(f), jnp.asarray(w)
    )
    return np.asarray(y), [np.asarray(g) for g in pullback(jnp.asarray(grad))]


@pytest.mark.parametrize("kind", ["mean", "max", "weighted"])
def test_segment_cells_in_a_graph_with_unknown_dims_and_in_chunks_at_one_byte(kind, tmp_path):
    """TF: under tf.function with every dimension unknown, and in chunks at a 1-byte
    budget (eagerly and in the graph), the cells' outputs and gradients equal the untiled
    eager step."""
    coords, f, grad = _data(1)
    w = np.random.default_rng(2).standard_normal(SHAPE)
    shapes = {"f": f.shape, "w": SHAPE} if kind == "weighted" else {"f": f.shape}
    formula = WEIGHTED if kind == "weighted" else FORMULAS[kind]
    case = _case(formula, shapes=shapes, ids=_ids(coords[0].shape, -2, 4))
    module = generate(case, tmp_path, prefix="SegmentCellGraph")
    xs = [tf.constant(c) for c in coords] + [tf.constant(f)]
    xs += [tf.constant(w)] if kind == "weighted" else []

    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(xs[3:])
            y = module.forward(*xs, **ATTRS)
            finite = tf.where(tf.math.is_inf(y), tf.zeros_like(y), y)  # empty max cells
            loss = tf.reduce_sum(finite * tf.constant(grad))
        return [y, *tape.gradient(loss, list(xs[3:]))]

    signature = [tf.TensorSpec([None] * len(x.shape), x.dtype) for x in xs]
    want = [a.numpy() for a in step(*xs)]
    graph = [a.numpy() for a in tf.function(step, input_signature=signature)(*xs)]
    module.MAX_TEMP_BYTES = 1
    assert module._tile_plan(*xs, **ATTRS) is not None
    chunks = [a.numpy() for a in step(*xs)]
    graph_chunks = [a.numpy() for a in tf.function(step, input_signature=signature)(*xs)]
    for got in (graph, chunks, graph_chunks):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)

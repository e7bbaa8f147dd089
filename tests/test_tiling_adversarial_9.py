"""A ninth set of real ops in their published layouts, none of them in the earlier
adversarial files, written by hand from the kernels as a new user would: mmcv's
dynamic_scatter (a voxel mean and max over points, `coors_map[n] == v`, -1 dropped),
torch_scatter's scatter_softmax composed as the library composes it (a segment
logsumexp, read back at each point's segment), mmcv's roiaware_pool3d (avg and max of
the points in each voxel of each roi, an empty voxel 0) with the voxel given by three
coordinates and flattened as its `pts_mask` encodes it, and PointNet++'s three_nn
weights feeding three_interpolate in [B, C, N] (inverse distances, internal tensors).

Each is checked against a NumPy transcription of its kernel (forward and backward), TF
float64 autodiff over the reference evaluator and finite differences (harness.check), in
chunks against the untiled module, and a training step's peak. The roiaware pool with a
flat voxel id held a dense [r,n,v] mask in its gradient that the tile plan never counted
(22.1 MiB in chunks against a bound of 1.56 MiB); with three coordinates, one position of
both levels held [c,r,k,n] (2.4-5.2 MiB against 2.06 MiB) until the conjunction became
one segment over the cell. mmcv's and torch_scatter's max backward send a tie's gradient
to one point (the lowest index); symgrad splits it equally, as `tf.reduce_max` (README),
so the kernels are compared without ties here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

from adversarial import chunks_equal_the_untiled_module
from harness import Case, check, generate

MASK = "vox[r,n] == v"
CELL = "vx[r,n] == i and vy[r,n] == j and vz[r,n] == k"

REAL = {
    # mmcv/ops/csrc/common/cuda/scatter_points_cuda_kernel.cuh, reduce MEAN: the sum of
    # the rows at coors_map[n] divided by reduce_count (never 0 for mmcv's unique voxels;
    # max(.., 1) keeps random ids finite)
    "dynamic_scatter_mean": Case(
        "y[v,f] = sum(where(coors_map[n] == v, feats[n,f], 0), n) "
        "/ max(sum(where(coors_map[n] == v, 1, 0), n), 1)",
        {"feats": (13, 3)},
        attrs={"V": 5},
        ranges={"v": "V"},
        sizes={"v": 5},
        index_inputs={"coors_map": ((13,), -1, 5)},
    ),
    # reduce MAX (reduceMax into rows at coors_map[n]; -1 points take no part)
    "dynamic_scatter_max": Case(
        "y[v,f] = max(where(coors_map[n] == v, feats[n,f], -inf), n)",
        {"feats": (13, 3)},
        attrs={"V": 4},
        ranges={"v": "V"},
        sizes={"v": 4},
        index_inputs={"coors_map": ((13,), -1, 4)},
    ),
    # torch_scatter/composite/softmax.py: max per segment, exp of the difference, the sum
    # per segment gathered back; as a segment logsumexp s, then exp(src - s[index[n]])
    "scatter_softmax": Case(
        (
            "s[v,h] = log(sum(where(index[n] == v, exp(src[n,h]), 0), n))",
            "y[n,h] = exp(src[n,h] - s[index[n], h])",
        ),
        {"src": (11, 3)},
        attrs={"V": 4},
        ranges={"v": "V"},
        sizes={"v": 4},
        index_inputs={"index": ((11,), 0, 4)},
        outputs=("y",),
    ),
    # mmcv/ops/csrc/common/cuda/roiaware_pool3d_cuda_kernel.cuh: pts_mask decoded to the
    # voxel (x_idx, y_idx, z_idx) of point n in roi r (-1 outside the roi);
    # roiaware_avgpool3d writes sum / total_pts where total_pts > 0, else leaves 0
    "roiaware_avg_3d": Case(
        f"y[r,i,j,k,c] = sum(where({CELL}, pts_feature[n,c], 0), n) "
        f"/ max(sum(where({CELL}, 1, 0), n), 1)",
        {"pts_feature": (9, 2)},
        attrs={"OX": 2, "OY": 3, "OZ": 2},
        ranges={"i": "OX", "j": "OY", "k": "OZ"},
        sizes={"i": 2, "j": 3, "k": 2},
        index_inputs={"vx": ((2, 9), -1, 2), "vy": ((2, 9), 0, 3), "vz": ((2, 9), 0, 2)},
    ),
    # roiaware_maxpool3d: the max where the voxel has points (argmax != -1), else 0
    "roiaware_max_3d": Case(
        f"y[r,i,j,k,c] = where(sum(where({CELL}, 1, 0), n) > 0, "
        f"max(where({CELL}, pts_feature[n,c], -inf), n), 0)",
        {"pts_feature": (9, 2)},
        attrs={"OX": 2, "OY": 3, "OZ": 2},
        ranges={"i": "OX", "j": "OY", "k": "OZ"},
        sizes={"i": 2, "j": 3, "k": 2},
        index_inputs={"vx": ((2, 9), -1, 2), "vy": ((2, 9), 0, 3), "vz": ((2, 9), 0, 2)},
    ),
    # the same with the voxel flattened, (x_idx * OY + y_idx) * OZ + z_idx
    "roiaware_avg_flat": Case(
        f"y[r,v,c] = sum(where({MASK}, pts_feature[n,c], 0), n) "
        f"/ max(sum(where({MASK}, 1, 0), n), 1)",
        {"pts_feature": (9, 2)},
        attrs={"V": 6},
        ranges={"v": "V"},
        sizes={"v": 6},
        index_inputs={"vox": ((3, 9), -1, 6)},
    ),
    "roiaware_max_flat": Case(
        f"y[r,v,c] = where(sum(where({MASK}, 1, 0), n) > 0, "
        f"max(where({MASK}, pts_feature[n,c], -inf), n), 0)",
        {"pts_feature": (9, 2)},
        attrs={"V": 6},
        ranges={"v": "V"},
        sizes={"v": 6},
        index_inputs={"vox": ((3, 9), -1, 6)},
    ),
    # Pointnet2_PyTorch: three_nn's distances (sqrt of dist2), dist_recip = 1 / (d + 1e-8)
    # normalised over the three, three_interpolate(features [B,C,M], idx, weight) -> [B,C,N]
    "three_interpolate_idw": Case(
        (
            "d[b,n,k] = sqrt(sum((unknown[b,n,c] - known[b, idx[b,n,k], c])**2, c))",
            "w[b,n,k] = (1 / (d[b,n,k] + 1e-8)) / sum(1 / (d[b,n,l] + 1e-8), l)",
            "y[b,f,n] = sum(features[b,f,idx[b,n,k]] * w[b,n,k], k)",
        ),
        {"unknown": (2, 5, 3), "known": (2, 4, 3), "features": (2, 3, 4)},
        index_inputs={"idx": ((2, 5, 3), 0, 4)},
        outputs=("y",),
    ),
}


# ------------------------------------------------------- the kernels, transcribed


def _dynamic_scatter(feats, coors_map, V, reduce):
    """feats_reduce_kernel and its traceback kernels: (forward, backward(grad))."""
    N, F = feats.shape
    out = np.full((V, F), -np.inf) if reduce == "max" else np.zeros((V, F))
    count = np.zeros(V)
    for x in range(N):
        to = coors_map[x]
        if to == -1:
            continue
        count[to] += 1
        out[to] = np.maximum(out[to], feats[x]) if reduce == "max" else out[to] + feats[x]
    if reduce == "mean":
        out = out / np.maximum(count, 1)[:, None]

    def backward(grad):
        g = np.zeros_like(feats)
        reduce_from = np.full((V, F), N)
        for x in range(N):
            to = coors_map[x]
            if to == -1:
                continue
            if reduce == "mean":
                g[x] = grad[to] / count[to]
            else:
                for i in range(F):
                    if feats[x, i] == out[to, i]:
                        reduce_from[to, i] = min(reduce_from[to, i], x)
        if reduce == "max":
            for to in range(V):
                for i in range(F):
                    if reduce_from[to, i] < N:
                        g[reduce_from[to, i], i] = grad[to, i]
        return g

    return out, backward


def _scatter_softmax(src, index, V):
    """torch_scatter.composite.scatter_softmax, and its autograd backward."""
    y = np.zeros_like(src)
    for v in range(V):
        rows = index == v
        if rows.any():
            e = np.exp(src[rows] - src[rows].max(0))
            y[rows] = e / e.sum(0)

    def backward(grad):
        g = np.zeros_like(src)
        for v in range(V):
            rows = index == v
            g[rows] = y[rows] * (grad[rows] - (grad[rows] * y[rows]).sum(0))
        return g

    return y, backward


def _roiaware(pts_feature, cell, shape, reduce):
    """roiaware_{max,avg}pool3d and their backward kernels over cell[r, n] (a voxel tuple,
    or None outside the roi): (forward, backward(grad))."""
    R, N = len(cell), pts_feature.shape[0]
    C = pts_feature.shape[1]
    out = np.zeros((R, *shape, C))
    argmax = {}
    for r in range(R):
        for voxel in np.ndindex(*shape):
            pts = [n for n in range(N) if cell[r][n] == voxel]
            if not pts:
                continue
            if reduce == "avg":
                out[(r, *voxel)] = pts_feature[pts].mean(0)
                continue
            for c in range(C):
                best = max(pts, key=lambda n: (pts_feature[n, c], -n))  # the first max
                out[(r, *voxel, c)] = pts_feature[best, c]
                argmax[(r, *voxel, c)] = best

    def backward(grad):
        g = np.zeros_like(pts_feature)
        for r in range(R):
            for voxel in np.ndindex(*shape):
                pts = [n for n in range(N) if cell[r][n] == voxel]
                if reduce == "avg":
                    for n in pts:
                        g[n] += grad[(r, *voxel)] / len(pts)
                    continue
                for c in range(C):
                    if (r, *voxel, c) in argmax:
                        g[argmax[(r, *voxel, c)], c] += grad[(r, *voxel, c)]
        return g

    return out, backward


def _three_interpolate(unknown, known, features, idx):
    """three_nn's distances for the given neighbours, the weights of
    pointnet2_modules.PointnetFPModule, three_interpolate; TF float64 for autodiff."""
    neighbours = tf.gather(known, idx, batch_dims=1)  # [B, N, 3, 3]
    d = tf.sqrt(tf.reduce_sum((unknown[:, :, None] - neighbours) ** 2, -1))
    recip = 1 / (d + 1e-8)
    weight = recip / tf.reduce_sum(recip, -1, keepdims=True)
    gathered = tf.gather(tf.transpose(features, [0, 2, 1]), idx, batch_dims=1)
    return tf.einsum("bnkf,bnk->bfn", gathered, weight)


def _kernel_inputs(name, rng):
    """Inputs as the ops' users pass them (no ties: see the module docstring), and the
    kernel's (forward, backward) on them."""
    if name.startswith("dynamic_scatter"):
        V = 6
        coors_map = rng.integers(-1, V, 40).astype(np.int32)
        coors_map[:V] = np.arange(V)  # mmcv's voxels are unique coordinates: none empty
        feats = rng.standard_normal((40, 3))
        reduce = name.rsplit("_", 1)[1]
        return (
            {"coors_map": coors_map, "feats": feats},
            {"V": V},
            _dynamic_scatter(feats, coors_map, V, reduce),
        )
    if name == "scatter_softmax":
        V = 5
        index = rng.integers(0, V - 1, 30).astype(np.int32)  # segment 4 empty
        src = rng.standard_normal((30, 4)) * 30  # logits in the tens
        return {"index": index, "src": src}, {"V": V}, _scatter_softmax(src, index, V)
    if name.startswith("roiaware"):
        R, N, shape = 3, 50, (2, 3, 2)
        inside = rng.random((R, N)) < 0.7
        coords = [rng.integers(0, s, (R, N)) for s in shape]
        cell = [
            [tuple(int(c[r, n]) for c in coords) if inside[r, n] else None for n in range(N)]
            for r in range(R)
        ]
        for c in coords:
            c[~inside] = -1
        pts_feature = rng.standard_normal((N, 4))
        reduce = "avg" if "avg" in name else "max"
        forward, backward = _roiaware(pts_feature, cell, shape, reduce)
        if name.endswith("_3d"):
            named = {"vx": coords[0], "vy": coords[1], "vz": coords[2]}
            attrs = {"OX": shape[0], "OY": shape[1], "OZ": shape[2]}
        else:
            flat = (coords[0] * shape[1] + coords[1]) * shape[2] + coords[2]
            named = {"vox": np.where(inside, flat, -1)}
            attrs = {"V": int(np.prod(shape))}
            forward = forward.reshape(R, -1, 4)
            backward3d = backward

            def backward(grad):
                return backward3d(grad.reshape(R, *shape, 4))

        named = {k: a.astype(np.int32) for k, a in named.items()}
        return {**named, "pts_feature": pts_feature}, attrs, (forward, backward)
    B, N, M = 2, 20, 9
    unknown, known = rng.standard_normal((B, N, 3)), rng.standard_normal((B, M, 3))
    features = rng.standard_normal((B, 5, M))
    d2 = ((unknown[:, :, None] - known[:, None]) ** 2).sum(-1)
    idx = np.argsort(d2, -1)[:, :, :3].astype(np.int32)  # three_nn's neighbours
    tensors = [tf.constant(a) for a in (unknown, known, features)]
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(tensors)
        y = _three_interpolate(*tensors, tf.constant(idx))

    def backward(grad):
        return tape.gradient(y, tensors, output_gradients=tf.constant(grad))

    named = {"unknown": unknown, "known": known, "features": features, "idx": idx}
    return named, {}, (y.numpy(), backward)


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_ops_equal_their_kernels(name, tmp_path):
    """float64, TensorFlow: forward and vjp equal the NumPy transcription of the kernel
    (three_interpolate: TF autodiff through the PyTorch module's own arithmetic)."""
    module = generate(REAL[name], tmp_path, prefix="Kernel9")
    named, attrs, (want, backward) = _kernel_inputs(name, np.random.default_rng(9))
    args = [tf.constant(named[n]) for n in module.INPUTS]
    np.testing.assert_allclose(module.forward(*args, **attrs).numpy(), want, atol=1e-13)
    grad = np.random.default_rng(10).standard_normal(want.shape)
    grads = module.vjp(*args, tf.constant(grad), **attrs)
    expected = backward(grad)
    floats = [k for k, n in enumerate(module.INPUTS) if named[n].dtype != np.int32]
    if not isinstance(expected, list):
        expected = [expected]
    for k, g in enumerate(grads):
        if k not in floats:
            assert g is None
    for k, e in zip(floats, expected, strict=True):
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(e), atol=1e-12)


@pytest.mark.parametrize(
    "name",
    ["dynamic_scatter_mean", "scatter_softmax", "roiaware_max_flat", "three_interpolate_idw"],
)
def test_real_ops_equal_tf_autodiff(name, tmp_path):
    """forward, vjp, the registered gradient and a tape against TF autodiff over the
    reference evaluator and finite differences, on random ids (out of range too)."""
    case = REAL[name]
    check(case, generate(case, tmp_path, prefix="Check9"))


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("roiaware_avg_flat", "tensorflow"),
        ("roiaware_max_flat", "pytorch"),
        ("roiaware_max_3d", "tensorflow"),
        ("roiaware_avg_3d", "pytorch"),
        ("roiaware_avg_3d", "jax"),
        ("scatter_softmax", "tensorflow"),
        ("three_interpolate_idw", "pytorch"),
    ],
)
def test_real_ops_in_chunks_equal_the_untiled_module(name, target, tmp_path):
    """At a budget of 1 byte (several chunks): forward, every gradient path and a
    training step equal the untiled module in float64."""
    chunks_equal_the_untiled_module(REAL[name], target, tmp_path, "Chunks9")


# ------------------------------------------------------------------ a training step

BUDGET = 2**20
PEAK = """
import json, sys
import numpy as np
import tensorflow as tf
sys.path.insert(0, {folder!r})
sys.path.insert(0, {tests!r})
import importlib
from peaks import peak

rng = np.random.default_rng(0)
R, N, C, O = 8, 2048, 8, 4
coords = [rng.integers(0, O, (R, N)) for _ in range(3)]
inside = rng.random((R, N)) < 0.5
vox = np.where(inside, (coords[0] * O + coords[1]) * O + coords[2], -1).astype(np.int32)
for c in coords:
    c[~inside] = -1
f = tf.constant(rng.standard_normal((N, C)).astype(np.float32))
flat = ([tf.constant(vox), f], {{"V": O**3}})
cells = ([tf.constant(c.astype(np.int32)) for c in coords] + [f], {{"OX": O, "OY": O, "OZ": O}})
found = {{}}
for stem, (args, attrs) in zip({stems!r}, [flat, flat, cells, cells]):
    module = importlib.import_module(stem)
    module.MAX_TEMP_BYTES = {budget}
    assert module._tile_plan(*args, **attrs) is not None

    def run():
        with tf.GradientTape() as tape:
            tape.watch(f)
            loss = tf.reduce_sum(tf.sin(module.forward(*args, **attrs)))
        return tape.gradient(loss, f).numpy()

    io = sum(a.numpy().nbytes for a in args) + module.forward(*args, **attrs).numpy().nbytes
    found[stem] = {{"io": io, "tiled": peak(run)}}
print(json.dumps(found))
"""

NAMES = ("avg_flat", "max_flat", "avg_3d", "max_3d")


@pytest.fixture(scope="module")
def roiaware_peaks(tmp_path_factory):
    """TensorFlow's peaks (BFC allocator, a fresh process) for a float32 training step of
    the four roiaware pools in chunks: 8 rois, 2048 points (half of them in no roi), 8
    channels, 4 x 4 x 4 voxels, 1 MiB."""
    from peaks import run_tensorflow

    folder = tmp_path_factory.mktemp("roiaware")
    stems = [generate(REAL[f"roiaware_{n}"], folder, prefix="Peak9").__name__ for n in NAMES]
    tests = str(Path(__file__).resolve().parent)
    script = PEAK.format(folder=str(folder), tests=tests, stems=stems, budget=BUDGET)
    found = run_tensorflow(script)
    return dict(zip(NAMES, (found[s] for s in stems), strict=True))


@pytest.mark.parametrize("name", ["avg_flat", "max_flat"])
def test_tensorflow_roiaware_step_with_a_flat_voxel_id_is_within_the_bound(roiaware_peaks, name):
    """The max's gradient was a dense [c,r,v,n] mask the plan did not count: 96.2 MiB
    untiled and 22.1 MiB in chunks against 1.56 MiB; the avg had no plan and broadcast the
    points to every roi, 1.94 MiB. Now 0.44 MiB (avg) and 0.70 MiB (max) in chunks."""
    found = roiaware_peaks[name]
    bound = 4 * found["io"] + BUDGET
    assert found["tiled"] <= bound, (found, bound)


@pytest.mark.parametrize("name", ["avg_3d", "max_3d"])
def test_tensorflow_roiaware_step_with_three_voxel_coordinates_is_within_the_bound(
    roiaware_peaks, name
):
    """One position of both levels (i, j) held [c,r,k,n]: 2.4-2.6 MiB (avg) and 4.9-5.2
    MiB (max) against 2.06 MiB. The conjunction is now one segment over the cell (i, j,
    k) (segment_cells.py) and the plan counts its rows [r,n,c]: 0.76 MiB (avg), 0.91-0.97
    MiB (max)."""
    found = roiaware_peaks[name]
    bound = 4 * found["io"] + BUDGET
    assert found["tiled"] <= bound, (found, bound)


# ---------------------------------------------------------------------- the CLI


def _generate(tmp_path, capsys, table: str):
    from symgrad.cli import main

    spec = tmp_path / "symgrad.toml"
    spec.write_text('out = "gen"\n\n' + table, encoding="utf-8")
    code = main(["generate", str(spec)])
    return code, capsys.readouterr().err


def test_a_declared_attr_without_its_range_names_the_index_and_the_attr(tmp_path, capsys):
    """`attrs = { V = "int" }` written, `ranges = { v = "V" }` forgotten: the error was
    "attr 'V' is declared but no formula uses it"; it names the index without a range and
    suggests the attr."""
    code, err = _generate(
        tmp_path,
        capsys,
        "[ops.DynamicScatterMean]\n"
        'formula = "y[v,f] = sum(where(coors_map[n] == v, feats[n,f], 0), n)"\n'
        'attrs = { V = "int" }\n',
    )
    assert code == 2
    first = err.splitlines()[0]
    assert "[ops.DynamicScatterMean]: output index 'v' has no range" in first
    assert 'ranges = { v = "V" }' in first
    assert not (tmp_path / "gen").exists()


def test_python_in_a_range_is_refused_at_its_place_and_never_run(tmp_path, capsys):
    """A range holding a call was reported as "attr 'V' is declared but no formula uses
    it" (the attr it read was not counted when the range failed to parse)."""
    marker = tmp_path / "ran"
    code, err = _generate(
        tmp_path,
        capsys,
        "[ops.DynamicScatterMax]\n"
        'formula = "y[v,f] = max(where(coors_map[n] == v, feats[n,f], -inf), n)"\n'
        'attrs = { V = "int" }\n'
        f"ranges = {{ v = \"V + __import__('os').system('touch {marker}')\" }}\n",
    )
    assert code == 2
    lines = err.splitlines()
    assert "[ops.DynamicScatterMax]: range of index 'v': a function call is not allowed" in lines[0]
    assert lines[2].strip() == "^" and lines[1][len(lines[2]) - 1] == "_"  # under __import__
    assert not marker.exists() and not (tmp_path / "gen").exists()


def test_an_attr_no_formula_or_range_uses_is_still_refused(tmp_path, capsys):
    code, err = _generate(
        tmp_path,
        capsys,
        "[ops.DynamicScatterMax]\n"
        'formula = "y[v,f] = max(where(coors_map[n] == v, feats[n,f], -inf), n)"\n'
        'attrs = { V = "int", W = "int" }\nranges = { v = "V" }\n',
    )
    assert code == 2
    assert "attr 'W' is declared but no formula uses it" in err.splitlines()[0]


def test_check_compares_a_mean_over_empty_segments_where_it_is_defined(tmp_path, capsys):
    """dynamic_scatter's mean written as mmcv computes it, sum / count: `symgrad check`
    (no library) draws 2 points for 2-3 voxels, so some voxels are empty and 0/0 is nan
    in the op and the formula alike. It reported the forward as failed ("op nan, formula
    nan", error inf) and the gradient as passed with error 0 (a nan made every norm nan,
    so any gradient passed). Now nan where both are nan agrees, and the gradient is
    tested on the outputs that are finite. scatter_softmax, which reads its internal
    tensor s at index[n], stopped the check with "internal error in symgrad (KeyError:
    's')" (the index tensor's value range read the size of s among the inputs)."""
    from symgrad.cli import main

    spec = tmp_path / "symgrad.toml"
    spec.write_text(
        'out = "gen"\n\n[ops.DynamicScatterMean]\n'
        'formula = "y[v,f] = sum(where(coors_map[n] == v, feats[n,f], 0), n) '
        '/ sum(where(coors_map[n] == v, 1, 0), n)"\n'
        'attrs = { V = "int" }\nranges = { v = "V" }\n\n[ops.ScatterSoftmax]\n'
        'formula = ["s[v,h] = log(sum(where(index[n] == v, exp(src[n,h]), 0), n))", '
        '"y[n,h] = exp(src[n,h] - s[index[n], h])"]\n'
        'outputs = ["y"]\nattrs = { V = "int" }\nranges = { v = "V" }\n',
        encoding="utf-8",
    )
    assert main(["generate", str(spec)]) == 0
    capsys.readouterr()
    assert main(["check", str(spec), "--json"]) == 0, capsys.readouterr()
    found = json.loads(capsys.readouterr().out)
    errors = {
        (op["op"], op["setting"]): r["error"]
        for op in found["ops"]
        for r in op["checks"]
        if r["check"] == "gradient"
    }
    assert {op for op, _ in errors} == {"DynamicScatterMean", "ScatterSoftmax"}
    assert len(errors) == 4 and all(e < 1e-6 for e in errors.values()), errors
    # the mean's gradient was compared (an error of rounding, not the 0 of a nan norm)
    assert all(e > 0 for (op, _), e in errors.items() if op == "DynamicScatterMean"), errors
    # and a gradient edited by hand still fails beside the nan outputs: 0.1% off, or nan
    module = tmp_path / "gen" / "dynamic_scatter_mean.py"
    text = module.read_text(encoding="utf-8")
    assert text.count("    return (None, grad_feats)") == 1
    for wrong in ("grad_feats * 1.001", 'grad_feats * float("nan")'):
        module.write_text(text.replace("(None, grad_feats)", f"(None, {wrong})"), "utf-8")
        assert main(["check", str(spec), "--op", "DynamicScatterMean", "--json"]) == 1, wrong
        report = json.loads(capsys.readouterr().out)
        passed = [(r["check"], r["passed"]) for op in report["ops"] for r in op["checks"]]
        assert passed and set(passed) == {("forward", True), ("gradient", False)}, wrong

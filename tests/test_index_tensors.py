"""Index tensors anywhere in brackets and index clamps (issue 17, items 4 and 5): each
construct exact in float64 against the independent reference (and TF autodiff on it) in
TensorFlow, PyTorch and JAX, index tensors with values outside their axes (those reads
are zero), refusals with a caret, and real ops against NumPy loop transcriptions of their
kernels."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf
from adversarial import chunks_equal_the_untiled_module, unknown_sizes_equal_eager
from harness import Case, check, generate, load_module, make_tensors
from target_harness import check_target, frameworks

from symgrad.errors import SymgradError
from symgrad.explain import explain
from symgrad.model import build
from symgrad.pipeline import module_text
from symgrad.spec import OpSpec, load_spec

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp

FRAMEWORKS = frameworks()

ROOT = Path(__file__).resolve().parent.parent

# Every construct, with a different size for every index; index values run past both
# ends of the axes they index (reads there are zero).
CASES = {
    "lookup_at_a_constant": Case(
        "y[b,n,c] = x[b, idx[b,n,0], c]",
        {"x": (2, 5, 3)},
        index_inputs={"idx": ((2, 4, 6), -1, 6)},
    ),
    "lookup_shifted_in_a_condition": Case(
        "y[s,f] = sum(where(lo[s] <= n < lo[s + 1], x[n,f], 0), n)",
        {"x": (9, 2)},
        index_inputs={"lo": ((5,), -1, 11)},
        ranges={"s": "lo.shape[0] - 1"},
        sizes={"s": 4},
    ),
    "batched_segments_in_a_condition": Case(
        "y[b,s,f] = sum(where(ptr[b,s] <= n < ptr[b, s + 1], x[b,n,f], 0), n)",
        {"x": (2, 7, 3)},
        index_inputs={"ptr": ((2, 5), 0, 8, tf.int64)},
        ranges={"s": "ptr.shape[1] - 1"},
        sizes={"s": 4},
    ),
    # lo[s + 1] past lo at the last s: both wheres take their `otherwise` there, `not` or no
    # `not` (SymPy turns `not (a > b)` into `a <= b`: the rule is the where's, not the
    # comparison's)
    "lookup_outside_in_a_condition": Case(
        "y[s,f] = sum(where(lo[s + 1] <= n, x[n,f], 0) + where(not (lo[s + 1] > n), x[n,f], 0), n)",
        {"x": (7, 2)},
        index_inputs={"lo": ((4,), 0, 8)},
        ranges={"s": "lo.shape[0]"},
        sizes={"s": 4},
    ),
    "nested_lookup": Case(
        "y[p,c] = sum(w[p,v] * a[t[d[p] - 1, v], c], v)",
        {"w": (5, 3), "a": (6, 2)},
        index_inputs={"t": ((4, 3), -1, 7), "d": ((5,), 0, 6)},
    ),
    "data_dependent_stride": Case(
        "y[b,i,j,h] = sum(q[b,i,h,m] * k[b, i + D[h] * (j - w), h, m], m)",
        {"q": (2, 6, 3, 4), "k": (2, 6, 3, 4)},
        index_inputs={"D": ((3,), 1, 4)},
        fd_directions=3,
        attrs={"w": 2},
        ranges={"j": "2*w + 1"},
        sizes={"j": 5},
    ),
    "clamped_window_start": Case(
        "y[b,i,k] = sum(q[b,i,d] * kk[b, max(min(i - ns, L - K), 0) + k, d], d)",
        {"q": (2, 7, 4), "kk": (2, 7, 4)},
        fd_directions=3,
        attrs={"ns": 1, "K": 3},
        lets={"L": "q.shape[1]"},
        let_values={"L": 7},
        ranges={"k": "K"},
        sizes={"k": 3},
    ),
    "clamped_lookup": Case(
        "y[b,n,c] = x[b, max(min(idx[b,n] + o, L - 1), 0), c]",
        {"x": (2, 5, 3)},
        index_inputs={"idx": ((2, 4), -3, 8)},
        attrs={"o": 1},
        lets={"L": "x.shape[1]"},
        let_values={"L": 5},
    ),
    "clamp_in_a_condition": Case(
        "y[b,i] = sum(where(max(i - 2, 0) <= j, x[b,j], 0), j)",
        {"x": (3, 6)},
        ranges={"i": "x.shape[1]"},
        sizes={"i": 6},
    ),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("index_tensors")


@pytest.mark.parametrize("name", sorted(CASES))
def test_index_tensors_and_clamps_in_tensorflow(name, folder):
    case = CASES[name]
    check(case, generate(case, folder, "Lookup"))


# A clamp of positions read from an index tensor, or beside a segment mask: positions are
# int64 there, and TF converted the clamp's number, its first argument, to int32 before it
# saw them (`tf.maximum(0, p)`), in chunks and under unknown sizes.
CLAMPED_LOOKUPS = {
    "clamped_start_at_looked_up_positions": Case(
        "y[b,n,d] = sum(x[b, max(min(idx[b,n] - 2, L - 5), 0) + k, d] * w[k], k)",
        {"x": (2, 9, 3), "w": (5,)},
        ranges={"k": "5"},
        sizes={"k": 5},
        lets={"L": "x.shape[1]"},
        let_values={"L": 9},
        index_inputs={"idx": ((2, 6), 0, 9)},
    ),
    "clamped_start_in_a_segment_sum": Case(
        "y[b,v,d] = sum(where(seg[b,i] == v, "
        "sum(x[b, max(min(i - 2, L - 5), 0) + k, d] * w[k], k), 0), i)",
        {"x": (2, 9, 3), "w": (5,)},
        ranges={"k": "5", "v": "4"},
        sizes={"k": 5, "v": 4},
        lets={"L": "x.shape[1]"},
        let_values={"L": 9},
        index_inputs={"seg": ((2, 9), 0, 4)},
    ),
}


@pytest.mark.parametrize("name", sorted(CLAMPED_LOOKUPS))
def test_a_clamp_of_int64_positions_in_chunks_and_under_unknown_sizes(name, folder):
    case = CLAMPED_LOOKUPS[name]
    check(case, generate(case, folder, "ClampedExact"))
    chunks_equal_the_untiled_module(case, "tensorflow", folder, "Clamped")
    module = generate(case, folder, "ClampedUnknown")
    unknown_sizes_equal_eager(module, make_tensors(case, module.INPUTS), {}, seed=1)


def _jitted(module):
    static = module.ATTRS
    return SimpleNamespace(
        OP_NAME=module.OP_NAME,
        forward=jax.jit(module.forward, static_argnames=static),
        vjp=jax.jit(module.vjp, static_argnames=static),
        _compute=jax.jit(module._compute, static_argnames=static),
    )


# JAX compiles each case (seconds apiece): these constructs are checked in JAX by the real
# ops below instead (PAConv, nvdiffrast with tid outside tri, Longformer's windows past
# the sequence, NATTEN).
IN_JAX_BY_REAL_OPS = {
    "lookup_at_a_constant",
    "nested_lookup",
    "data_dependent_stride",
    "clamped_window_start",
}
TARGET_CASES = [
    (name, target)
    for name in sorted(CASES)
    for target in sorted(FRAMEWORKS)
    if not (target == "jax" and name in IN_JAX_BY_REAL_OPS)
]


@pytest.mark.parametrize(("name", "target"), TARGET_CASES)
def test_index_tensors_and_clamps_in_pytorch_and_jax(name, target, folder):
    case = CASES[name]
    module = generate(case, folder, "Lookup", target)
    check_target(case, _jitted(module) if target == "jax" else module, FRAMEWORKS[target])


# -- real ops of symgrad.toml against NumPy loop transcriptions of their kernels --------


def _paconv_kernel(scores, points, centers, knn_idx):
    """mmcv assign_score_withk_forward_cuda_kernel, aggregate "sum", one thread per
    (b, o, n, k)."""
    batch, n0, banks, channels = points.shape
    _, n1, neighbours, _ = scores.shape
    output = np.zeros((batch, channels, n1, neighbours))
    for b, o, n, k in np.ndindex(batch, channels, n1, neighbours):
        cn, kn = knn_idx[b, n, 0], knn_idx[b, n, k]
        if kn >= n0 or kn < 0:
            continue
        val = 0.0
        for m in range(banks):
            val += (
                points[b, kn, m, o] * scores[b, n, k, m] - centers[b, cn, m, o] * scores[b, n, k, m]
            )
        output[b, o, n, k] = val
    return output


def _segment_csr_kernel(src, indptr):
    """torch_scatter segment_csr, reduce "sum": each segment sums its rows."""
    out = np.zeros((len(indptr) - 1, src.shape[1]))
    for s in range(len(indptr) - 1):
        for n in range(indptr[s], indptr[s + 1]):
            out[s] += src[n]
    return out


def _interpolate_kernel(attr, rast, tri, tid):
    """nvdiffrast InterpolateFwdKernelTemplate without differentials, one thread per pixel."""
    batch, height, width, _ = rast.shape
    out = np.zeros((batch, height, width, attr.shape[1]))
    for pz, py, px in np.ndindex(batch, height, width):
        r = rast[pz, py, px]
        tri_idx = tid[pz, py, px] - 1
        if not 0 <= tri_idx < len(tri):
            continue  # no triangle: zero output
        vi0, vi1, vi2 = tri[tri_idx]
        b0, b1, b2 = r[0], r[1], 1.0 - r[0] - r[1]
        out[pz, py, px] = b0 * attr[vi0] + b1 * attr[vi1] + b2 * attr[vi2]
    return out


def _natten_window_start(index, length, kernel_size):
    """NATTEN's get_window_start (na_utils.cuh) with stride 1: radius K // 2 both sides."""
    left = right = kernel_size // 2
    leader = min(index, length - 1)
    return max(leader - left, 0) + (leader + right >= length) * (length - right - leader - 1)


def _natten_qk_kernel(query, key, kernel_size):
    batch, heads, length, _ = query.shape
    attn = np.zeros((batch, heads, length, kernel_size))
    for b, h, i in np.ndindex(batch, heads, length):
        start = _natten_window_start(i, length, kernel_size)
        for k in range(kernel_size):
            attn[b, h, i, k] = query[b, h, i] @ key[b, h, start + k]
    return attn


def _longformer_kernel(x, y, dilation, w, diagonaled):
    """diagonaled_mm_tvm.py's TVM `algorithm` (padding 0, w_upper = w, t1 not transposed)."""
    b, n, h, _ = x.shape
    out = np.zeros((b, n, h, y.shape[3] if diagonaled else 2 * w + 1))
    for l, i, q, j in np.ndindex(*out.shape):
        for k in range(x.shape[3]):
            at = i + dilation[q] * ((k if diagonaled else j) - w)
            if 0 <= at < n:
                out[l, i, q, j] += x[l, i, q, k] * y[l, at, q, j if diagonaled else k]
    return out


def _linear_vjp(kernel, inputs, k, grad):
    """<grad, d kernel / d inputs[k]> for a kernel linear in inputs[k] (every op here is
    multilinear in its float inputs): one difference per element, exact up to rounding."""
    base = kernel(*inputs)
    result = np.zeros_like(inputs[k])
    for at in np.ndindex(*inputs[k].shape):
        moved = list(inputs)
        moved[k] = inputs[k].copy()
        moved[k][at] += 1.0
        result[at] = np.sum(grad * (kernel(*moved) - base))
    return result


def _real_inputs():
    rng = np.random.default_rng(11)
    u = rng.uniform(0, 1, (2, 7, 6, 4))  # barycentrics (u, v, z, tid) of 2x7x6 pixels
    u[..., 1] *= 1 - u[..., 0]
    return {
        # B=2, npoint=5, K=4, M=3, N=7, O=6
        "PaconvAssignScore": (
            _paconv_kernel,
            [rng.standard_normal((2, 5, 4, 3)), rng.standard_normal((2, 7, 3, 6))]
            + [rng.standard_normal((2, 7, 3, 6)), rng.integers(0, 7, (2, 5, 4))],
            {},
        ),
        # N=11 rows, F=3, S=5 segments: one empty, rows before the first and after the last
        "SegmentCsrSum": (
            _segment_csr_kernel,
            [rng.standard_normal((11, 3)), np.array([1, 3, 3, 6, 9, 10])],
            {},
        ),
        # V=9 vertices, C=5, T=8 triangles, N=2, H=7, W=6; tid 0 (no triangle) and 9 (> T)
        # read zero
        "NvdiffrastInterpolate": (
            _interpolate_kernel,
            [rng.standard_normal((9, 5)), u, rng.integers(0, 9, (8, 3))]
            + [rng.integers(0, 10, (2, 7, 6))],
            {},
        ),
        # B=2, heads=3, L=9, D=4, K=5: windows clamped at both ends
        "NattenQk1d": (
            lambda q, k: _natten_qk_kernel(q, k, 5),
            [rng.standard_normal((2, 3, 9, 4)), rng.standard_normal((2, 3, 9, 4))],
            {"kernel_size": 5},
        ),
        # b=2, n=8, h=3, m=4, w=2 (2w+1 = 5 diagonals), dilations 1, 2, 3
        "LongformerQk": (
            lambda x, y, d: _longformer_kernel(x, y, d, 2, diagonaled=False),
            [rng.standard_normal((2, 8, 3, 4)), rng.standard_normal((2, 8, 3, 4))]
            + [np.array([1, 2, 3])],
            {"w": 2},
        ),
        "LongformerAv": (
            lambda x, y, d: _longformer_kernel(x, y, d, 2, diagonaled=True),
            [rng.standard_normal((2, 8, 3, 5)), rng.standard_normal((2, 8, 3, 4))]
            + [np.array([1, 2, 3])],
            {"w": 2},
        ),
    }


REAL = _real_inputs()
_EXPECTED: dict[str, tuple] = {}


def _expected(name):
    """The kernel's output, a random output gradient and the kernel's vjp (None for the
    index tensors), computed once per op."""
    if name not in _EXPECTED:
        kernel, inputs, _ = REAL[name]
        out = kernel(*inputs)
        grad = np.random.default_rng(5).standard_normal(out.shape)
        vjps = [
            None if np.issubdtype(a.dtype, np.integer) else _linear_vjp(kernel, inputs, k, grad)
            for k, a in enumerate(inputs)
        ]
        _EXPECTED[name] = (out, grad, vjps)
    return _EXPECTED[name]


def _spec_op(name):
    (op,) = [o for o in load_spec(ROOT / "symgrad.toml").ops if o.name == name]
    return op


TENSORS = {
    "tensorflow": (lambda a: tf.constant(a), lambda t: np.asarray(t)),
    "pytorch": (lambda a: torch.from_numpy(a), lambda t: t.detach().numpy()),
    "jax": (lambda a: jnp.asarray(a), np.asarray),
}


# The ops whose temporaries outgrow their inputs and outputs (gathered windows, the CSR
# mask's dense branch): their modules run in chunks above MAX_TEMP_BYTES.
# NATTEN's 1-D QK is banded, never gathered (bands.py): no tiling.
TILED = {"PaconvAssignScore", "SegmentCsrSum", "LongformerQk", "LongformerAv"}
# Three gathers of attr and their products over the output [n,h,w,c], larger than every
# input (`output_temps`).
TILED |= {"NvdiffrastInterpolate"}


@pytest.mark.parametrize("budget", [None, 64], ids=["whole", "chunks"])
@pytest.mark.parametrize("target", sorted(TENSORS))
@pytest.mark.parametrize("name", sorted(REAL))
def test_real_op_matches_its_kernel_forward_and_gradient(name, target, budget, folder):
    """Each op as symgrad.toml writes it, against the NumPy transcription of its kernel,
    in float64: forward, and the vjp against the kernel's own (linear) differences; in one
    piece and, for the ops that tile, in several chunks under a 64-byte budget (one position
    each, or as many whole positions as TF's nested plan finds within the step's allowance)."""
    _, inputs, attrs = REAL[name]
    if budget is not None and name not in TILED:
        pytest.skip("no temporary outgrows the inputs and outputs: never tiled")
    text = module_text(_spec_op(name), "symgrad.toml", target)
    module = load_module(text, folder, f"real_{target}_{name.lower()}_{budget}")
    assert hasattr(module, "_tile_plan") == (name in TILED), name
    if budget is not None:
        module.MAX_TEMP_BYTES = budget
        tensor = TENSORS[target][0]
        plan = module._tile_plan(*(tensor(a) for a in inputs), **attrs)
        assert plan is not None and int(plan[1]) < int(plan[0]), plan  # (positions, length)
    if target == "jax":  # compiled once: faster than op-by-op dispatch
        module = SimpleNamespace(INPUTS=module.INPUTS, **vars(_jitted(module)))
    tensor, numpy = TENSORS[target]
    args = [tensor(a) for a in inputs]
    out, grad, vjps = _expected(name)
    np.testing.assert_allclose(numpy(module.forward(*args, **attrs)), out, rtol=1e-12, atol=1e-12)
    got = module.vjp(*args, tensor(grad), **attrs)
    for k, (g, want) in enumerate(zip(got, vjps, strict=True)):
        if want is None:
            assert g is None, f"{name}: index tensor {module.INPUTS[k]} gets None"
            continue
        g = tf.convert_to_tensor(g) if target == "tensorflow" else g  # IndexedSlices
        np.testing.assert_allclose(numpy(g), want, rtol=1e-10, atol=1e-10, err_msg=module.INPUTS[k])


def test_csr_segment_sum_of_any_indptr_is_the_kernels_loop(folder):
    """Unsorted indptr (overlapping and reversed segments) takes the dense branch: still the
    loop's sum over [indptr[s], indptr[s + 1])."""
    module = load_module(
        module_text(_spec_op("SegmentCsrSum"), "symgrad.toml", "tensorflow"), folder, "csr_any"
    )
    assert "tf.searchsorted" in text_of(module)
    # in chunks too: a chunk's segments are indptr[s + tile_start], still a binary search
    assert "tf.searchsorted" in inspect.getsource(module._chunk_compute)
    src = np.random.default_rng(2).standard_normal((11, 3))
    for indptr in ([0, 5, 2, 8, 11, 11], [4, 4, 1, 0, 7, 9]):
        got = module.forward(tf.constant(src), tf.constant(indptr)).numpy()
        np.testing.assert_allclose(got, _segment_csr_kernel(src, indptr), rtol=1e-12, atol=1e-12)
        grad = np.random.default_rng(3).standard_normal(got.shape)
        (grad_src, none) = module.vjp(tf.constant(src), tf.constant(indptr), tf.constant(grad))
        want = _linear_vjp(_segment_csr_kernel, [src, np.array(indptr)], 0, grad)
        np.testing.assert_allclose(tf.convert_to_tensor(grad_src).numpy(), want, rtol=1e-10)
        assert none is None


def text_of(module) -> str:
    return Path(module.__file__).read_text(encoding="utf-8")


# -- refusals and explain ------------------------------------------------------------


def _refused(formula, **spec) -> SymgradError:
    op = OpSpec("Refused", (formula,), None, (), (), "test [ops.Refused]", **spec)
    with pytest.raises(SymgradError) as info:
        build(op)
    return info.value


def _caret_at(error: SymgradError, text: str) -> None:
    rendered = str(error)
    formula_line, caret_line = rendered.splitlines()[-2:]
    assert caret_line.strip() == "^", rendered
    column = caret_line.index("^") - (len(formula_line) - len(formula_line.lstrip()))
    assert formula_line.strip()[column:].startswith(text), rendered


def test_what_cannot_be_an_index_is_refused_with_a_caret():
    three = _refused("y[b,i] = x[b, max(i - 1, 0, 2)]")
    assert "only min(a, b) and max(a, b) of index expressions are allowed inside" in str(three)
    _caret_at(three, "max(")
    # Any other function makes a float position, a sampled read (test_sampled_reads.py):
    # `abs(i - 2)` is no index expression, so it sizes nothing.
    other = _refused("y[b,i] = x[b, abs(i - 2)]")
    assert "output index 'i' is not used by any input, so its size is unknown" in str(other)
    # A comparison with a float expression compares values (test_sampled_reads.py), so
    # `exp(i) <= j` sizes nothing either.
    condition = _refused("y[b,i] = sum(where(exp(i) <= j, x[b,j], 0), j)")
    assert "output index 'i' is not used by any input, so its size is unknown" in str(condition)
    product = _refused("y[b,i,j] = x[b, i * (j + D[b])]")  # an index times an index
    assert "a product of indices is not an affine index expression" in str(product)
    _caret_at(product, "i * ")
    value = _refused("y[p,c] = a[t[p], c] * t[p]")
    assert "used both as an index tensor" in str(value)


def test_explain_shows_the_solved_equations_of_lookups_and_clamps():
    def explained(name: str) -> str:
        return explain(build(_spec_op(name)))

    natten = explained("NattenQk1d")
    assert "_g1[b,h,i,k,d] = key[b,h,k + max(0, min(L - kernel_size, -ns + i)),d]" in natten
    assert "grad_key[b,h,p,d] = Σ_{i,k: k + max(0, min(L - kernel_size, -ns + i)) = p}" in natten
    interpolate = explained("NvdiffrastInterpolate")
    assert (
        "attr[tri[tid[n,h,w] - 1,0],c] (0 outside attr, or where tid, tri are read outside)"
        in interpolate
    )
    assert "grad_tri[p0,p1] = None (no_gradient)" in interpolate
    assert "grad_tid[n,h,w] = None (no_gradient)" in interpolate
    longformer = explained("LongformerQk")
    assert "Y[l,i + (-w + j)*D[q],q,k] (0 outside Y, or where D is read outside)" in longformer
    assert "grad_Y[l,p,r,k] = Σ_{i,q,j: i + (-w + j)*D[q] = p, q = r}" in longformer
    paconv = explained("PaconvAssignScore")
    assert "centers[b,knn_idx[b,n,0],m,o]" in paconv and "grad_knn_idx[b,n,k] = None" in paconv
    csr = explained("SegmentCsrSum")
    assert "tf.searchsorted(tf.cast(tf.reshape(indptr, [-1]), tf.int64)" in csr
    assert "tf.math.unsorted_segment_sum" in csr


# -- memory: the gathered window of Longformer in chunks -----------------------------


MEMORY = {
    # (NATTEN's 1-D QK is banded now: its step's bound is in tests/test_bands_memory.py)
    # b=2, n=128, h=4, m=32, w=8, dilations 1..4: a [2, 128, 4, 17, 32] window of Y
    "LongformerQk": ({"X": (2, 128, 4, 32), "Y": (2, 128, 4, 32)}, {"w": 8}),
}


@pytest.mark.parametrize("name", sorted(MEMORY))
def test_torch_training_step_of_a_gathered_window_is_bounded(name, folder):
    """Untiled, a training step holds the gathered window (15-17x a key), over twice the
    bound; with a 256 KiB budget it holds at most 2x the budget plus 4x its inputs and
    outputs (the bound of tests/test_tiling.py). The plan takes whole positions while one
    is within that allowance (`_plan2`), so the tiled step uses much of the bound: the
    test asks for the bound, not for a fixed fraction of the untiled peak."""
    from test_tiling import _torch_memory

    shapes, attrs = MEMORY[name]
    text = module_text(_spec_op(name), "symgrad.toml", "pytorch")
    module = load_module(text, folder, f"memory_{name.lower()}")
    rng = np.random.default_rng(6)
    xs = [
        torch.tensor(rng.standard_normal(shapes[n]), dtype=torch.float32, requires_grad=True)
        for n in module.INPUTS
        if n in shapes
    ]
    if name == "LongformerQk":
        xs.append(torch.tensor([1, 2, 3, 4]))  # D: the dilation per head
    module.MAX_TEMP_BYTES = 2**40
    assert module._tile_plan(*xs, **attrs) is None
    _, untiled = _torch_memory(module, [x for x in xs if x.is_floating_point()], attrs, xs)
    budget = 2**18
    module.MAX_TEMP_BYTES = budget
    assert module._tile_plan(*xs, **attrs) is not None
    _, tiled = _torch_memory(module, [x for x in xs if x.is_floating_point()], attrs, xs)
    inputs = sum(x.nbytes for x in xs)
    with torch.no_grad():
        outputs = module.forward(*xs, **attrs).nbytes
    print(f"{name}: peak {untiled} / {tiled} (untiled / tiled), in+out {inputs + outputs}")
    bound = 2 * budget + 4 * (inputs + outputs)
    assert untiled > 2 * bound, (untiled, bound)  # the size tests the bound
    assert tiled <= bound, (tiled, untiled, bound)


def test_an_op_with_a_let_runs_in_chunks_like_in_one_piece(folder):
    """A let keeps its value in every chunk (the lightconv's padding from w's width, which
    no chunk cuts): one position per chunk gives the whole op's numbers (the dilated
    lightconv: the undilated one is a depthwise kernel, not tiled)."""
    from window_ops import dilated_lightconv

    text = module_text(dilated_lightconv(), "symgrad.toml", "tensorflow")
    module = load_module(text, folder, "let_in_chunks")
    rng = np.random.default_rng(0)
    named = {"x": rng.standard_normal((2, 3, 11)), "w": rng.standard_normal((3, 5))}
    args = [tf.constant(named[n]) for n in module.INPUTS]
    grad = tf.constant(rng.standard_normal((2, 3, 11)))
    whole, whole_vjp = module.forward(*args), module.vjp(*args, grad)
    module.MAX_TEMP_BYTES = 64
    plan2 = module._plan2
    # the second level split by the budget alone (not kept whole within the step's
    # allowance, which at this size is many times the budget), so that it runs
    module._plan2 = lambda n, n2, volumes, itemsize, *allowance: plan2(n, n2, volumes, itemsize)
    # t, one position a chunk (and at 64 bytes a second level: one channel, `tile_nest`)
    assert [int(v) for v in module._tile_plan(*args)] == [11, 1, 3, 1]
    np.testing.assert_allclose(module.forward(*args), whole, rtol=1e-12, atol=1e-12)
    for got, want in zip(module.vjp(*args, grad), whole_vjp, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)

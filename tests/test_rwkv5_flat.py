"""RWKV-5's WKV in the published [B, T, C] layout (BlinkDL/RWKV-LM, RWKV-v5/cuda/wkv5_cuda.cu:
r, k, v and y of [B, T, C] with C = H*N, w and u of [H, N], a state [N, N] per head):
composite reads `v[b,t,(h,i)]` size the state's axis i (C over H), and the output
`y[b,t,(h,i)]` is composite, in a coupled recurrence (y reads S at t - 1) and in a single
one. Checked in float64 against a NumPy transcription of the kernel's forward (loops as its
threads run them), the [B, T, H, N] module (`test_tiling_adversarial_4.RWKV5`) and central
differences, in every target; in float32 with r, k, v near 1e3; under tf.function with
unknown dims; on an empty sequence (and other scans of symgrad.toml on one). What stays
refused says so in one line."""

from __future__ import annotations

import numpy as np
import pytest
from frameworks import FRAMEWORKS, _enable_x64
from harness import load_module
from test_recurrences import _directional, op_spec

from symgrad import scan_render
from symgrad.cli import main
from symgrad.errors import SymgradError
from symgrad.pipeline import module_text

TARGETS = ("tensorflow", "pytorch", "jax")
INPUTS = ("r", "k", "v", "w", "u")

FLAT = (
    "S[b,t,h,j,i] = w[h,j] * S[b,t-1,h,j,i] + k[b,t,(h,j)] * v[b,t,(h,i)]",
    "y[b,t,(h,i)] = sum(r[b,t,(h,j)] * (u[h,j] * k[b,t,(h,j)] * v[b,t,(h,i)] + S[b,t-1,h,j,i]), j)",
)
SPLIT = (
    "S[b,t,h,j,i] = w[h,j] * S[b,t-1,h,j,i] + k[b,t,h,j] * v[b,t,h,i]",
    "y[b,t,h,i] = sum(r[b,t,h,j] * (u[h,j] * k[b,t,h,j] * v[b,t,h,i] + S[b,t-1,h,j,i]), j)",
)
FLAT_WU = tuple(f.replace("w[h,j]", "w[(h,j)]").replace("u[h,j]", "u[(h,j)]") for f in FLAT)
SPELLINGS = {
    # i is read only inside v[b,t,(h,i)]: its size is v's axis over h's (w's first axis)
    "inferred": (FLAT, {}, {}),
    # the same size given by a range through lets
    "lets": (
        FLAT,
        {"lets": (("H", "w.shape[0]"), ("N", "v.shape[2] // H")), "ranges": (("i", "N"),)},
        {},
    ),
    # w and u of [C] too: h, j and i sized by the number of heads, an int attr
    "attr": (
        FLAT_WU,
        {
            "attrs": (("H", "int"),),
            "lets": (("N", "w.shape[0] // H"),),
            "ranges": (("h", "H"), ("j", "N"), ("i", "N")),
        },
        {"H": 2},
    ),
}


def wkv5_kernel(r, k, v, w, u):
    """wkv5_cuda.cu kernel_forward in NumPy: one block per (b, h), one thread per value
    channel i holding state[j] over the key channels j; at each t, y = sum_j r[j] *
    (u[j] * k[j] * v[i] + state[j]), then state[j] = state[j] * w[j] + k[j] * v[i]."""
    B, T, _ = r.shape
    H, N = w.shape
    y = np.zeros_like(r)
    for b in range(B):
        for h in range(H):
            for i in range(N):
                state = np.zeros(N, r.dtype)
                for t in range(T):
                    rr, kk = r[b, t, h * N : (h + 1) * N], k[b, t, h * N : (h + 1) * N]
                    vv = v[b, t, h * N + i]
                    x = kk * vv
                    y[b, t, h * N + i] = np.sum(rr * (u[h] * x + state))
                    state = state * w[h] + x
    return (y,)


def inputs(B=2, T=5, H=2, N=3, seed=0, scale=1.0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    C = H * N
    return {
        "r": (scale * rng.standard_normal((B, T, C))).astype(dtype),
        "k": (scale * rng.standard_normal((B, T, C))).astype(dtype),
        "v": (scale * rng.standard_normal((B, T, C))).astype(dtype),
        "w": rng.uniform(0.3, 0.95, (H, N)).astype(dtype),
        "u": rng.standard_normal((H, N)).astype(dtype),
    }


_MODULES: dict = {}


def module_of(name, formulas, target, folder, **extra):
    if target == "jax":
        _enable_x64()
    key = (name, formulas, target, tuple(sorted(extra.items())))
    if key not in _MODULES:
        op = op_spec(name, formulas, inputs=extra.pop("inputs", INPUTS), outputs=("y",), **extra)
        text = module_text(op, "test", target)
        _MODULES[key] = load_module(text, folder, f"rwkv5_flat_{len(_MODULES)}_{target}")
    return _MODULES[key]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("rwkv5_flat")


def test_the_transcription_is_the_split_formula():
    """The NumPy kernel equals the [B, T, H, N] recurrence written as two einsums per step
    (so the kernel reference is the formula's function, not a copy of the generated code)."""
    values = inputs(seed=1)
    B, T, C = values["r"].shape
    H, N = values["w"].shape
    split = {n: values[n].reshape(B, T, H, N) for n in "rkv"}
    S = np.zeros((B, H, N, N))
    want = np.zeros((B, T, H, N))
    for t in range(T):
        kv = split["k"][:, t, :, :, None] * split["v"][:, t, :, None, :]
        want[:, t] = np.einsum("bhj,bhji->bhi", split["r"][:, t], values["u"][..., None] * kv + S)
        S = S * values["w"][None, :, :, None] + kv
    np.testing.assert_allclose(wkv5_kernel(**values)[0], want.reshape(B, T, C), rtol=1e-13)


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
@pytest.mark.parametrize("target", TARGETS)
def test_rwkv5_in_its_own_layout_equals_the_kernel_and_the_split_module(spelling, target, folder):
    """Forward equal to the kernel's transcription, vjp equal to the [B, T, H, N] module's
    on the same numbers reshaped, and to central differences of the kernel (float64)."""
    fw = FRAMEWORKS[target]
    formulas, extra, attrs = SPELLINGS[spelling]
    module = module_of(f"Rwkv5Flat{spelling.title()}", formulas, target, folder, **extra)
    split = module_of("Rwkv5Split", SPLIT, target, folder)
    assert module.INPUTS == INPUTS
    values = inputs()
    B, T, _ = values["r"].shape
    H, N = values["w"].shape
    flat_wu = formulas is FLAT_WU  # w and u given as [C]
    args = [
        fw.tensor(values[n].reshape(-1) if flat_wu and n in "wu" else values[n]) for n in INPUTS
    ]
    (want,) = wkv5_kernel(*(values[n] for n in INPUTS))
    np.testing.assert_allclose(
        fw.numpy(module.forward(*args, **attrs)), want, rtol=1e-12, atol=1e-13
    )
    rng = np.random.default_rng(7)
    g = rng.standard_normal(want.shape)
    found = [
        fw.numpy(x).reshape(values[n].shape)
        for n, x in zip(INPUTS, module.vjp(*args, fw.tensor(g), **attrs), strict=True)
    ]
    split_args = [
        fw.tensor(values[n].reshape(B, T, H, N) if n in "rkv" else values[n]) for n in INPUTS
    ]
    expected = split.vjp(*split_args, fw.tensor(g.reshape(B, T, H, N)))
    for name, got, e in zip(INPUTS, found, expected, strict=True):
        np.testing.assert_allclose(
            got, fw.numpy(e).reshape(got.shape), rtol=1e-12, atol=1e-13, err_msg=name
        )
    for k, name in enumerate(INPUTS):
        v, fd = _directional(wkv5_kernel, values, INPUTS, [g], k, rng)
        np.testing.assert_allclose(np.sum(found[k] * v), fd, rtol=1e-7, err_msg=name)


# A recurrent tensor with a composite axis (a single recurrence, its state held split), and
# a single scan whose later equation has one (y reads S at t: not a coupled recurrence).
SINGLE = {
    "recurrent": (
        ("y[b,t,(h,i)] = a[h] * y[b,t-1,(h,i)] + x[b,t,(h,i)]",),
        ("x", "a"),
        lambda x, a: (_decayed(x, a),),
    ),
    "later": (
        (
            "S[b,t,h,j,i] = w[h,j] * S[b,t-1,h,j,i] + k[b,t,(h,j)] * v[b,t,(h,i)]",
            "y[b,t,(h,i)] = sum(r[b,t,(h,j)] * S[b,t,h,j,i], j)",
        ),
        ("r", "k", "v", "w"),
        lambda r, k, v, w: (_after_update(r, k, v, w),),
    ),
}


def _decayed(x, a):
    """y[t] = a[h] * y[t-1] + x[t] per head h of the flattened channels."""
    _, T, C = x.shape
    H = a.shape[0]
    decay = np.repeat(a, C // H)
    y = np.zeros_like(x)
    for t in range(T):
        y[:, t] = x[:, t] + (decay * y[:, t - 1] if t else 0)
    return y


def _after_update(r, k, v, w):
    """The kernel's loop with y read after the state's update (and without u)."""
    B, T, _ = r.shape
    H, N = w.shape
    y = np.zeros_like(r)
    for b in range(B):
        for h in range(H):
            state = np.zeros((N, N))
            for t in range(T):
                state = state * w[h][:, None] + np.outer(
                    k[b, t, h * N : (h + 1) * N], v[b, t, h * N : (h + 1) * N]
                )
                y[b, t, h * N : (h + 1) * N] = r[b, t, h * N : (h + 1) * N] @ state
    return y


@pytest.mark.parametrize("case", sorted(SINGLE))
@pytest.mark.parametrize("target", TARGETS)
def test_a_single_recurrence_with_a_composite_output_axis(case, target, folder):
    """Forward and vjp (central differences) against NumPy loops, float64."""
    formulas, names, ref = SINGLE[case]
    fw = FRAMEWORKS[target]
    module = module_of(f"Single{case.title()}", formulas, target, folder, inputs=names)
    full = inputs(seed=3)
    values = {n: full[n] for n in names if n in full}
    if case == "recurrent":
        values = {"x": full["v"], "a": full["w"][:, 0]}
    args = [fw.tensor(values[n]) for n in names]
    (want,) = ref(*(values[n] for n in names))
    np.testing.assert_allclose(fw.numpy(module.forward(*args)), want, rtol=1e-12, atol=1e-13)
    rng = np.random.default_rng(8)
    g = rng.standard_normal(want.shape)
    found = module.vjp(*args, fw.tensor(g))
    for k, name in enumerate(names):
        v, fd = _directional(ref, values, names, [g], k, rng)
        np.testing.assert_allclose(np.sum(fw.numpy(found[k]) * v), fd, rtol=1e-7, err_msg=name)


@pytest.mark.parametrize("target", TARGETS)
def test_rwkv5_flat_in_float32_with_inputs_near_1e3(target, folder):
    """r, k, v of size ~1e3 (y ~ 1e9: the op is linear in each, so stable there): the
    float32 forward and vjp are within float32 rounding of the float64 ones."""
    fw = FRAMEWORKS[target]
    module = module_of("Rwkv5Flat", FLAT, target, folder)
    values = inputs(B=1, T=6, H=2, N=4, seed=4, scale=1e3)
    values = {n: a + (1e3 if n in "rkv" else 0) for n, a in values.items()}
    (want,) = wkv5_kernel(*(values[n] for n in INPUTS))
    g = np.random.default_rng(9).standard_normal(want.shape)
    wide = module.vjp(*[fw.tensor(values[n]) for n in INPUTS], fw.tensor(g))
    narrow = [fw.tensor(values[n].astype(np.float32)) for n in INPUTS]
    y32 = fw.numpy(module.forward(*narrow))
    assert y32.dtype == np.float32
    scale = np.abs(want).max()
    np.testing.assert_allclose(y32, want, rtol=0, atol=1e-5 * scale)
    for name, a, b in zip(
        INPUTS, module.vjp(*narrow, fw.tensor(g.astype(np.float32))), wide, strict=True
    ):
        a, b = fw.numpy(a), fw.numpy(b)
        assert a.dtype == np.float32 and np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max(), err_msg=name)


def test_rwkv5_flat_with_unknown_dims_under_tf_function(folder):
    """Every dim unknown while tracing (tf.function with an input signature of Nones): the
    state's size C // H is computed when the graph runs; equal to eager."""
    import tensorflow as tf

    module = module_of("Rwkv5Flat", FLAT, "tensorflow", folder)
    values = inputs(B=2, T=4, H=3, N=2, seed=5)
    args = [tf.constant(values[n]) for n in INPUTS]
    g = tf.constant(np.random.default_rng(10).standard_normal(values["r"].shape))
    flat = tf.TensorSpec([None, None, None], tf.float64)
    small = tf.TensorSpec([None, None], tf.float64)
    signature = [flat, flat, flat, small, small]
    forward = tf.function(module.forward, input_signature=signature)
    vjp = tf.function(module.vjp, input_signature=[*signature, flat])
    (want,) = wkv5_kernel(*(values[n] for n in INPUTS))
    np.testing.assert_allclose(forward(*args).numpy(), want, rtol=1e-12, atol=1e-13)
    for a, b in zip(vjp(*args, g), module.vjp(*args, g), strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_an_empty_sequence_in_a_graph_traced_with_its_length_unknown(jit, folder):
    """T unknown while tracing and 0 when the graph runs (under XLA too, which compiles
    per shape and drops a graph's checks): y is [B, 0, C] and the gradients are zeros of
    the inputs' shapes, as eagerly (the scan runs one position of zeros, cut to none);
    the same graph runs T = 4. Refused once, by a check XLA dropped: there the forward
    gave y and the gradient failed to compile."""
    import tensorflow as tf

    module = module_of("Rwkv5Flat", FLAT, "tensorflow", folder)
    flat = tf.TensorSpec([None, None, None], tf.float64)
    small = tf.TensorSpec([None, None], tf.float64)
    signature = [flat, flat, flat, small, small]
    forward = tf.function(module.forward, input_signature=signature, jit_compile=jit)
    vjp = tf.function(module.vjp, input_signature=[*signature, flat], jit_compile=jit)
    values = inputs(T=0)
    empty = [tf.constant(values[n]) for n in INPUTS]
    assert forward(*empty).shape == (2, 0, 6)
    grads = vjp(*empty, tf.zeros([2, 0, 6], tf.float64))
    for name, got in zip(INPUTS, grads, strict=True):
        got = got.numpy()
        assert got.shape == values[name].shape and not got.any(), name
    values = inputs(T=4)
    (want,) = wkv5_kernel(*(values[n] for n in INPUTS))
    args = [tf.constant(values[n]) for n in INPUTS]
    np.testing.assert_allclose(forward(*args).numpy(), want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("target", TARGETS)
def test_rwkv5_flat_on_an_empty_sequence(target, folder):
    """T = 0: y is [B, 0, C]; the gradients are zeros of the inputs' shapes."""
    fw = FRAMEWORKS[target]
    module = module_of("Rwkv5Flat", FLAT, target, folder)
    values = inputs(T=0)
    args = [fw.tensor(values[n]) for n in INPUTS]
    y = fw.numpy(module.forward(*args))
    assert y.shape == (2, 0, 6)
    grads = module.vjp(*args, fw.tensor(np.zeros((2, 0, 6))))
    for name, got in zip(INPUTS, grads, strict=True):
        got = fw.numpy(got)
        assert got.shape == values[name].shape and not got.any(), name


def test_check_runs_rwkv5_flat(tmp_path, capsys):
    """`symgrad check` on the [B, T, C] op: sizes for the composite axes (C = H*N), the
    forward against a loop of dense steps and the gradient against differences."""
    spec_path = tmp_path / "symgrad.toml"
    formulas = ",\n".join(f'  "{f}"' for f in FLAT)
    spec_path.write_text(
        f'[ops.Rwkv5Flat]\nformula = [\n{formulas}\n]\ninputs = ["r", "k", "v", "w", "u"]\n'
        'outputs = ["y"]\n',
        encoding="utf-8",
    )
    assert main(["generate", str(spec_path)]) == 0
    capsys.readouterr()
    assert main(["check", str(spec_path)]) == 0, capsys.readouterr()


REFUSED = {
    # a state axis whose range is no quotient of input sizes, int attrs and integers
    "range": (
        (
            "S[b,t,h,j,i] = w[h,j] * S[b,t-1,h,j,i] + k[b,t,(h,j)] * v[b,t,(h,i)]",
            "y[b,t,(h,i)] = sum(r[b,t,(h,j)] * S[b,t,h,j,i], j)",
        ),
        {"ranges": (("i", "v.shape[2] - w.shape[1]"),)},
        (
            "the state's axis 'i' has the range 'v.shape[2] - w.shape[1]', which a scan "
            "cannot size its state by"
        ),
    ),
    # a composite recurrent tensor read at another group than its own
    "other group": (
        ("y[b,t,(h,i)] = a[h] * y[b,t-1,(i,h)] + x[b,t,(h,i)]",),
        {},
        "'y' is a recurrent tensor with the composite axis (h, i) and is read here at (i, h)",
    ),
    # the scan index inside a composite axis
    "scan index in a group": (
        (
            "S[b,t,h] = w[h] * S[b,t-1,h] + x[b,t,h]",
            "y[b,(t,h)] = S[b,t,h]",
        ),
        {},
        "'y' has the scan index 't' inside the composite axis (t, h)",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_stays_refused_says_why_in_one_line(name):
    formulas, extra, message = REFUSED[name]
    with pytest.raises(SymgradError) as caught:
        module_text(op_spec("Refused", formulas, outputs=("y",), **extra), "test", "tensorflow")
    assert message in caught.value.message, caught.value.message
    assert "\n" not in caught.value.message


def test_a_refusal_exits_2_naming_the_op_and_the_place(tmp_path, capsys):
    """`symgrad generate` on a refused spelling: exit 2, one line naming the op, then the
    formula with a caret."""
    spec_path = tmp_path / "symgrad.toml"
    spec_path.write_text(
        '[ops.Refused]\nformula = "y[b,t,(h,i)] = a[h] * y[b,t-1,(i,h)] + x[b,t,(h,i)]"\n',
        encoding="utf-8",
    )
    assert main(["generate", str(spec_path)]) == 2
    first, formula, caret = capsys.readouterr().err.strip().split("\n")
    assert "[ops.Refused]" in first and "is read here at (i, h)" in first, first
    assert formula.strip() == "y[b,t,(h,i)] = a[h] * y[b,t-1,(i,h)] + x[b,t,(h,i)]"
    assert caret.index("^") == formula.index("y[b,t-1")


EMPTY = {
    # (op of symgrad.toml, input shapes, attrs, output shape): an empty scan axis, and the
    # inner (row) axis of a two-index recurrence empty
    "lfilter": ("Lfilter", {"x": (2, 0), "a": (3,), "bb": (4,)}, {}, (2, 0)),
    "soft_dtw_rows": ("SoftDtw", {"D": (2, 0, 3)}, {"gamma": 0.5}, (2, 0, 3)),
    "soft_dtw_columns": ("SoftDtw", {"D": (2, 3, 0)}, {"gamma": 0.5}, (2, 3, 0)),
}


@pytest.mark.parametrize("case", sorted(EMPTY))
@pytest.mark.parametrize("target", TARGETS)
def test_a_sequential_scan_on_an_empty_sequence(case, target, folder):
    """Any sequential scan given no positions (it sliced position -1, or stacked an empty
    list): outputs with the scan's axis empty and zero gradients of the inputs' shapes."""
    from test_recurrences import _spec_op

    name, shapes, attrs, out = EMPTY[case]
    fw = FRAMEWORKS[target]
    if target == "jax":
        _enable_x64()
    text = scan_render.module_text(_spec_op(name), "test", target, associative=False)
    module = load_module(text, folder, f"empty_{case}_{target}")
    args = [fw.tensor(np.ones(shapes[n])) for n in module.INPUTS]
    y = fw.numpy(module.forward(*args, **attrs))
    assert y.shape == out
    grads = module.vjp(*args, fw.tensor(np.zeros(out)), **attrs)
    for n, g in zip(module.INPUTS, grads, strict=True):
        g = fw.numpy(g)
        assert g.shape == shapes[n] and not g.any(), n


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_a_sequential_scan_on_an_empty_sequence_of_a_length_known_when_the_graph_runs(jit, folder):
    """Lfilter (a filter `a`, `bb` summed over the positions, x read at lags) in
    TensorFlow graphs traced with every size unknown, with and without XLA, given no
    positions: y with the scan's axis empty and zero gradients of the inputs' shapes, as
    eagerly. (SoftDtw with no rows or no columns passes too, in 25-45 s.)"""
    import tensorflow as tf
    from test_recurrences import _spec_op

    case = "lfilter"
    name, shapes, attrs, out = EMPTY[case]
    text = scan_render.module_text(_spec_op(name), "test", "tensorflow", associative=False)
    module = load_module(text, folder, f"empty_graph_{case}_{jit}")
    args = [tf.ones(shapes[n], tf.float64) for n in module.INPUTS]
    signature = [tf.TensorSpec([None] * len(shapes[n]), tf.float64) for n in module.INPUTS]
    forward = tf.function(
        lambda *a: module.forward(*a, **attrs), input_signature=signature, jit_compile=jit
    )
    vjp = tf.function(
        lambda *a: module.vjp(*a, **attrs),
        input_signature=[*signature, tf.TensorSpec([None] * len(out), tf.float64)],
        jit_compile=jit,
    )
    assert forward(*args).shape == out
    grads = vjp(*args, tf.zeros(out, tf.float64))
    for n, g in zip(module.INPUTS, grads, strict=True):
        g = g.numpy()
        assert g.shape == shapes[n] and not g.any(), n

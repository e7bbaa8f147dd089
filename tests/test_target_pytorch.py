"""The PyTorch target: every formula of the corpora against the TF reference (forward,
vjp, torch autograd through `forward` and through the generated ops), in float64; the
TF module of the same formula; gradcheck and gradgradcheck; torch.compile(fullgraph=True);
`register` on real custom ops (Python with an opaque NumPy body, and compiled C++); the
call-time errors; and the README example."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("tensorflow")

from harness import Case, generate, make_tensors, op_spec
from target_harness import Framework, check_target, generate_for
from test_indexing import KNOWN
from test_numeric import CORPUS

from symgrad.cli import main
from symgrad.model import build
from symgrad.pipeline import module_text

CASES = {**CORPUS, **{f"indexing_{name}": known.case for name, known in KNOWN.items()}}
ROOT = Path(__file__).resolve().parent.parent


def _autodiff(f, inputs, wrt, grads):
    """torch's own vector-Jacobian product of f(*inputs) with `grads`."""
    xs = [x.detach().clone().requires_grad_(k in wrt) for k, x in enumerate(inputs)]
    outs = f(*xs)
    pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
    if not pairs:  # no output depends on an input (`y = A - A + 2`)
        return [torch.zeros_like(xs[k]) for k in wrt]
    found = torch.autograd.grad(
        [o for o, _ in pairs],
        [xs[k] for k in wrt],
        grad_outputs=[g for _, g in pairs],
        allow_unused=True,
    )
    return [torch.zeros_like(xs[k]) if g is None else g for k, g in zip(wrt, found, strict=True)]


TORCH = Framework(
    target="pytorch",
    tensor=lambda a: torch.from_numpy(np.array(a)),
    numpy=lambda t: t.detach().numpy(),
    autodiff=_autodiff,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("torch_modules")


def _inputs(case: Case, module, seed: int = 0, requires_grad: bool = False) -> list:
    """Random float64 inputs (int index tensors) in the module's input order."""
    tensors = make_tensors(case, module.INPUTS, seed)
    out = [torch.from_numpy(t.numpy()) for t in tensors]
    if requires_grad:
        out = [t.requires_grad_() if t.is_floating_point() else t for t in out]
    return out


# -- every formula ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_corpus(name, folder):
    case = CASES[name]
    module = generate_for(case, "pytorch", folder)
    check_target(case, module, TORCH)


CROSS = [
    "attrs_all_kinds",
    "deep_chain",
    "two_outputs",
    "indexing_conv2d_same",
    "indexing_conv1d_same_stride2",
    "indexing_cumsum_reverse_exclusive",
    "indexing_embedding_plus_position",
    "indexing_gather_out_of_range",
    "indexing_pointnet_weighted",
    "indexing_max_pool_2x3",
]


@pytest.mark.parametrize("name", CROSS)
def test_same_numbers_as_the_tensorflow_module(name, folder):
    """The PyTorch and TF modules of one formula on the same inputs: forward and vjp."""
    case = CASES[name]
    torch_module = generate_for(case, "pytorch", folder)
    tf_module = generate(case, folder, prefix="CrossTf")
    tf_inputs = make_tensors(case, torch_module.INPUTS, seed=3)
    torch_inputs = [torch.from_numpy(t.numpy()) for t in tf_inputs]
    tf_out = tf_module.forward(*tf_inputs, **case.attrs)
    torch_out = torch_module.forward(*torch_inputs, **case.attrs)
    tf_out = tf_out if isinstance(tf_out, tuple) else (tf_out,)
    torch_out = torch_out if isinstance(torch_out, tuple) else (torch_out,)
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal(tuple(o.shape)) for o in torch_out]
    for t, w in zip(torch_out, tf_out, strict=True):
        np.testing.assert_allclose(t.detach().numpy(), w.numpy(), rtol=1e-12, atol=1e-12)
    got = torch_module.vjp(*torch_inputs, *map(torch.from_numpy, grads), **case.attrs)
    want = tf_module.vjp(*tf_inputs, *map(tf.constant, grads), **case.attrs)
    for input_name, g, w in zip(torch_module.INPUTS, got, want, strict=True):
        if w is None:
            assert g is None, input_name
            continue
        np.testing.assert_allclose(
            g.numpy(), tf.convert_to_tensor(w).numpy(), rtol=1e-12, atol=1e-12, err_msg=input_name
        )


# -- torch's own checks of the backward ---------------------------------------------------

GRADCHECK = [
    "deep_chain",  # saved intermediates: recomputed by differentiable ops for 2nd order
    "layer_norm",  # a float attr
    "two_outputs",
    "attrs_all_kinds",
    "indexing_conv1d_stride2",  # the conv backprop kernels, run twice over
    "indexing_cumsum_reverse_exclusive",
    "indexing_max_pool_2x2",
    "indexing_correlation",  # gathers through positions and their scatter-add
    "indexing_gather_out_of_range",  # an index input; ids outside the table
    "indexing_causal_softmax",
]
# Smaller inputs where the corpus's make gradgradcheck slow (it differentiates numerically
# once per input element).
SMALL = {
    "indexing_conv1d_stride2": {"x": (1, 9, 2), "w": (3, 2, 2)},
    "indexing_correlation": {"f1": (1, 3, 4, 2), "f2": (1, 3, 4, 2)},
    "indexing_max_pool_2x2": {"x": (1, 4, 6, 2)},
    "indexing_causal_softmax": {"s": (1, 3, 4)},
}


@pytest.mark.parametrize("name", GRADCHECK)
def test_gradcheck_and_gradgradcheck(name, folder):
    case = replace(CASES[name], shapes=SMALL.get(name, CASES[name].shapes))
    module = generate_for(case, "pytorch", folder)
    inputs = _inputs(case, module, requires_grad=True)
    floats = [k for k, t in enumerate(inputs) if t.is_floating_point()]

    def f(*xs):
        args = list(inputs)
        for k, x in zip(floats, xs, strict=True):
            args[k] = x
        return module.forward(*args, **case.attrs)

    xs = [inputs[k] for k in floats]
    assert torch.autograd.gradcheck(f, xs)
    assert torch.autograd.gradgradcheck(f, xs)


def test_second_order_needs_the_recomputed_intermediates(folder):
    """deep_chain saves intermediates computed without grad; taken as constants, its
    second derivatives are wrong: gradgradcheck sees it (so the check above means it)."""
    module = generate_for(CASES["deep_chain"], "pytorch", folder)
    inputs = _inputs(CASES["deep_chain"], module, requires_grad=True)
    recompute = module._recompute
    module._recompute = lambda *a, **k: tuple(t.detach() for t in recompute(*a, **k))
    try:
        with pytest.raises(RuntimeError, match="Jacobian mismatch"):
            torch.autograd.gradgradcheck(module.forward, inputs)
    finally:
        module._recompute = recompute


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        ("deep_chain", "inductor"),
        ("indexing_gather", "inductor"),
        ("indexing_conv2d_same", "aot_eager"),
    ],
)
def test_torch_compile_fullgraph_forward_and_backward(name, backend, folder):
    """forward under torch.compile(fullgraph=True) (no graph break), its backward through
    AOTAutograd, against eager vjp. With Inductor 5-10 s for the first case (its warm-up;
    up to 25 s on a busy two-core machine), 2-5 s for the next; the convolution
    (torch.nn.grad's kernels in the backward) is traced without code generation."""
    case = CASES[name]
    module = generate_for(case, "pytorch", folder)
    inputs = _inputs(case, module, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *xs: module.forward(*xs, **case.attrs), fullgraph=True, backend=backend
    )
    started = time.perf_counter()
    out = compiled(*inputs)
    grad = torch.randn_like(out)
    floats = [t for t in inputs if t.is_floating_point()]
    got = torch.autograd.grad(out, floats, grad)
    elapsed = time.perf_counter() - started
    torch.testing.assert_close(out, module.forward(*inputs, **case.attrs))
    want = [g for g in module.vjp(*inputs, grad, **case.attrs) if g is not None]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    print(f"{name}: torch.compile ({backend}) forward + backward in {elapsed:.1f} s")


CONV3D = {
    "valid": (
        Case(
            "y[b,i,j,l,o] = sum(x[b,i+u,j+v,l+t,c] * w[u,v,t,c,o], u, v, t, c)",
            {"x": (1, 4, 5, 3, 2), "w": (2, 3, 2, 2, 2)},
        ),
        (1, 1, 1),
    ),
    "strided": (
        Case(
            "y[b,i,j,l,o] = sum(x[b,2*i+u,j+v,2*l+t,c] * w[u,v,t,c,o], u, v, t, c)",
            {"x": (1, 5, 4, 5, 1), "w": (3, 2, 2, 1, 2)},
        ),
        (2, 1, 2),
    ),
}


@pytest.mark.parametrize("name", sorted(CONV3D))
def test_conv3d_against_torch_and_gradcheck(name, folder):
    """3-D convolutions (no corpus has one: the TF reference cannot broadcast that many
    axes) against torch's conv3d, and their backprop kernels by gradcheck."""
    case, stride = CONV3D[name]
    module = generate_for(case, "pytorch", folder)
    x, w = _inputs(case, module, requires_grad=True)
    want = torch.nn.functional.conv3d(x.movedim(-1, 1), w.permute(4, 3, 0, 1, 2), stride=stride)
    torch.testing.assert_close(module.forward(x, w), want.movedim(1, -1))
    assert torch.autograd.gradcheck(module.forward, (x, w))


def test_a_symmetric_window_is_the_kernels_own_padding(folder, monkeypatch):
    """A window torch's kernels read with zeros on both sides (3x3 SAME here) passes
    `padding=` to them: no pad or slice runs around the kernels, forward or backward."""
    import generated_torch.conv2d_same as module

    x = torch.randn(2, 7, 6, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, 3, 4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 7, 6, 4, dtype=torch.float64)
    want = torch.nn.functional.conv2d(x.movedim(-1, 1), w.permute(3, 2, 0, 1), padding=1)
    expected = torch.autograd.grad(want.movedim(1, -1), (x, w), grad)

    def refused(*args, **kwargs):
        raise AssertionError("a pad ran around the convolution")

    monkeypatch.setattr(torch.nn.functional, "pad", refused)
    y = module.forward(x, w)
    torch.testing.assert_close(y, want.movedim(1, -1), rtol=1e-12, atol=1e-12)
    for got in (torch.autograd.grad(y, (x, w), grad), module.vjp(x, w, grad)):
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    assert module._conv_direct([[7, 3, 7, 1, -1], [6, 4, 6, 1, -1]]) is None  # 4 taps: 1 + 2


GAUSSIAN_SUM = Case(
    "y[b,i] = sum(exp(-sum((x[b,i,c] - z[b,j,c])**2, c)), j)",
    {"x": (2, 5, 3), "z": (2, 7, 3)},
)


def test_the_backward_computes_only_the_gradients_autograd_needs(folder, monkeypatch):
    """ctx.needs_input_grad: with z constant, nothing of z's gradient runs (one einsum
    over the pairs, not two), and x's gradient is the same to the bit."""
    module = generate_for(GAUSSIAN_SUM, "pytorch", folder)
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    z = torch.randn(2, 7, 3, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 5, dtype=torch.float64)
    both = torch.autograd.grad(module.forward(x, z), (x, z), grad)
    calls = []
    einsum = torch.einsum
    monkeypatch.setattr(torch, "einsum", lambda *a: calls.append(a[0]) or einsum(*a))
    y = module.forward(x, z.detach())
    forward_calls = len(calls)
    (alone,) = torch.autograd.grad(y, (x,), grad)
    assert len(calls) - forward_calls == 1, calls[forward_calls:]
    assert torch.equal(alone, both[0])
    got = module._backward(x, z, None, *module._compute(x, z)[1], grad, _needs=(False, True))
    assert got[0] is None and torch.equal(got[1], both[1])


def test_a_minus_sign_goes_on_the_smaller_factor(folder, monkeypatch):
    """`-(e * g[b,i])` over the pairs negates g (one pass over b,i), not the product (a
    second pass over b,i,j): the backward of a Gaussian sum negates no pairwise tensor."""
    module = generate_for(GAUSSIAN_SUM, "pytorch", folder)
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    z = torch.randn(2, 7, 3, dtype=torch.float64, requires_grad=True)
    _, saved = module._compute(x.detach(), z.detach())
    negated = []
    neg = torch.Tensor.__neg__
    monkeypatch.setattr(torch.Tensor, "__neg__", lambda t: negated.append(t.shape) or neg(t))
    module._backward(x, z, None, *saved, torch.ones(2, 5, dtype=torch.float64))
    assert (2, 5, 7) not in negated, negated


# -- register(op) on custom ops ------------------------------------------------------------

MATMUL = Case(
    "y[b,i,j] = alpha * A[b,i,k] * B[b,k,j]",
    {"A": (2, 3, 4), "B": (2, 4, 5)},
    attrs={"alpha": 0.5},
)


def _numpy(x):
    return x.numpy(force=True)


@torch.library.custom_op("symgrad_test::scaled_mat_mul", mutates_args=())
def scaled_mat_mul(A: torch.Tensor, B: torch.Tensor, alpha: float) -> torch.Tensor:
    """Opaque to autograd: computed in NumPy."""
    return torch.from_numpy(alpha * np.einsum("bik,bkj->bij", _numpy(A), _numpy(B)))


@scaled_mat_mul.register_fake
def _(A, B, alpha):
    return A.new_empty(A.shape[0], A.shape[1], B.shape[2])


@torch.library.custom_op("symgrad_test::scaled_mat_mul_by_name", mutates_args=())
def scaled_mat_mul_by_name(A: torch.Tensor, B: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.from_numpy(alpha * np.einsum("bik,bkj->bij", _numpy(A), _numpy(B)))


@scaled_mat_mul_by_name.register_fake
def _(A, B, alpha):
    return A.new_empty(A.shape[0], A.shape[1], B.shape[2])


SOFTMAX = Case("y[b,i,j] = exp(A[b,i,j]) / sum(exp(A[b,i,m]), m)", {"A": (2, 3, 4)})


@torch.library.custom_op("symgrad_test::softmax_and_norm", mutates_args=())
def softmax_and_norm(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two outputs, one read back by the backward (softmax's `y`)."""
    a = _numpy(A)
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return torch.from_numpy(e / e.sum(axis=-1, keepdims=True)), torch.from_numpy((a * a).sum(-1))


@softmax_and_norm.register_fake
def _(A):
    return torch.empty_like(A), A.new_empty(A.shape[:-1])


SOFTMAX_AND_NORM = Case(
    ("y[b,i,j] = exp(A[b,i,j]) / sum(exp(A[b,i,m]), m)", "z[b,i] = A[b,i,k] * A[b,i,k]"),
    {"A": (2, 3, 4)},
)


@torch.library.custom_op("symgrad_test::lookup", mutates_args=())
def lookup(W: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """An embedding lookup with an index input; ids outside the table read zero."""
    w, i = _numpy(W), _numpy(ids)
    inside = (i >= 0) & (i < w.shape[0])
    return torch.from_numpy(np.where(inside[..., None], w[np.clip(i, 0, w.shape[0] - 1)], 0.0))


@lookup.register_fake
def _(W, ids):
    return W.new_empty((*ids.shape, W.shape[1]))


LOOKUP = Case("y[b,t,d] = W[ids[b,t], d]", {"W": (7, 3)}, index_inputs={"ids": ((2, 5), -2, 9)})


def _matmul_inputs():
    generator = torch.Generator().manual_seed(0)
    A = torch.randn(2, 3, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    B = torch.randn(2, 4, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    return A, B


def test_register_a_custom_op_object(folder):
    module = generate_for(MATMUL, "pytorch", folder)
    assert module.register(scaled_mat_mul) is scaled_mat_mul
    A, B = _matmul_inputs()
    assert torch.autograd.gradcheck(lambda a, b: scaled_mat_mul(a, b, 0.5), (A, B))
    assert torch.autograd.gradgradcheck(lambda a, b: scaled_mat_mul(a, b, 0.5), (A, B))
    grad = torch.randn(2, 3, 5, dtype=torch.float64)
    got = torch.autograd.grad(scaled_mat_mul(A, B, 0.5), (A, B), grad)
    for g, w in zip(got, module.vjp(A, B, grad, alpha=0.5), strict=True):
        torch.testing.assert_close(g, w)


def test_register_a_custom_op_by_its_name(folder):
    module = generate_for(MATMUL, "pytorch", folder)
    module.register("symgrad_test::scaled_mat_mul_by_name")
    A, B = _matmul_inputs()
    assert torch.autograd.gradcheck(lambda a, b: scaled_mat_mul_by_name(a, b, 0.5), (A, B))


def test_register_an_op_with_two_outputs(folder):
    module = generate_for(SOFTMAX_AND_NORM, "pytorch", folder)
    module.register(softmax_and_norm)
    A = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(softmax_and_norm, (A,))
    assert torch.autograd.gradgradcheck(softmax_and_norm, (A,))
    y, _ = softmax_and_norm(A)  # only one output used: the other's gradient is zero
    (got,) = torch.autograd.grad(y.sum(), A)
    torch.testing.assert_close(got, torch.zeros_like(A), atol=1e-12, rtol=0)
    # Under torch.compile the op is traced by its fake and the backward by AOTAutograd.
    compiled = torch.compile(
        lambda a: sum(o.sum() ** 2 for o in softmax_and_norm(a)),
        fullgraph=True,
        backend="aot_eager",
    )
    (got,) = torch.autograd.grad(compiled(A), A)
    (want,) = torch.autograd.grad(sum(o.sum() ** 2 for o in softmax_and_norm(A)), A)
    torch.testing.assert_close(got, want)


def test_register_an_op_with_an_index_input(folder):
    module = generate_for(LOOKUP, "pytorch", folder)
    module.register(lookup)
    W = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 6, -1, 3, 8], [2, 2, 5, 7, 1]])
    assert torch.autograd.gradcheck(lambda w: lookup(w, ids), (W,))
    grad = torch.randn(2, 5, 3, dtype=torch.float64)
    (got,) = torch.autograd.grad(lookup(W, ids), W, grad)
    torch.testing.assert_close(got, module.vjp(W, ids, grad)[0])


def test_register_refuses_an_op_of_another_signature(folder):
    module = generate_for(SOFTMAX, "pytorch", folder)
    with pytest.raises(ValueError) as error:
        module.register(scaled_mat_mul)
    message = str(error.value)
    assert message.startswith(
        f"{module.OP_NAME}: op symgrad_test::scaled_mat_mul takes (A, B, alpha)"
    )
    assert "\n" not in message
    with pytest.raises(LookupError, match=rf"^{module.OP_NAME}: no op 'symgrad_test::nope'"):
        module.register("symgrad_test::nope")
    with pytest.raises(TypeError, match=rf"^{module.OP_NAME}: register expects a custom op"):
        module.register(42)


def test_register_a_compiled_cpp_op(folder, torch_op_library):
    """A C++ op (tests/custom_op/scaled_mat_mul.cc, in the session's one compiled library)
    gets the generated backward by its name."""
    module = generate_for(MATMUL, "pytorch", folder)
    module.register("symgrad_cpp_test::scaled_mat_mul")
    op = torch.ops.symgrad_cpp_test.scaled_mat_mul
    A, B = _matmul_inputs()
    assert torch.autograd.gradcheck(lambda a, b: op(a, b, 0.5), (A, B))
    assert torch.autograd.gradgradcheck(lambda a, b: op(a, b, 0.5), (A, B))


# -- call-time errors ----------------------------------------------------------------------

STRIDED = KNOWN["conv1d_stride2"].case


def _one_line(error, module, *words):
    message = str(error.value)
    assert message.startswith(f"{module.OP_NAME}: "), message
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


def test_call_time_errors_are_one_line_naming_the_op(folder):
    module = generate_for(MATMUL, "pytorch", folder)
    A, B = (t.detach() for t in _matmul_inputs())
    grad = torch.zeros(2, 3, 5, dtype=torch.float64)
    cases = [
        (
            ValueError,
            lambda: module.forward(A[0], B, alpha=1.0),
            ["input A has rank 2; expected 3"],
        ),
        (
            TypeError,
            lambda: module.forward(A.float(), B, alpha=1.0),
            ["inputs must share one dtype; got A float32, B float64"],
        ),
        (
            TypeError,
            lambda: module.forward(A.long(), B.long(), alpha=1.0),
            ["input A has dtype int64; expected float16, bfloat16, float32 or float64"],
        ),
        (
            ValueError,
            lambda: module.forward(A, B[:, :3], alpha=1.0),
            ["index k has different sizes: A[axis 2] = 4, B[axis 1] = 3"],
        ),
        (
            ValueError,
            lambda: module.vjp(A, B, grad[:, :2], alpha=1.0),
            ["grad_y has shape (2, 2, 5); expected (2, 3, 5) like y"],
        ),
        (
            TypeError,
            lambda: module.vjp(A, B, grad.float(), alpha=1.0),
            ["grad_y has dtype float32; expected float64"],
        ),
        (TypeError, lambda: module.vjp(A, B, None, alpha=1.0), ["grad_y is None"]),
    ]
    for kind, call, words in cases:
        with pytest.raises(kind) as error:
            call()
        _one_line(error, module, *words)


def test_index_and_stride_errors(folder):
    lookup_module = generate_for(LOOKUP, "pytorch", folder)
    W = torch.zeros(7, 3, dtype=torch.float64)
    with pytest.raises(TypeError) as error:
        lookup_module.forward(W, torch.zeros(2, 5))
    _one_line(error, lookup_module, "index tensor ids has dtype float32; expected int32 or int64")
    strided = generate_for(STRIDED, "pytorch", folder)
    x, w = torch.zeros(2, 15, 3, dtype=torch.float64), torch.zeros(4, 3, 5, dtype=torch.float64)
    with pytest.raises(ValueError) as error:
        strided.forward(x, w, s=0)
    _one_line(error, strided, "attr s is 0", "must be positive")


def test_lists_and_int32_ids_are_accepted(folder):
    module = generate_for(LOOKUP, "pytorch", folder)
    W = torch.arange(21, dtype=torch.float64).reshape(7, 3)
    y = module.forward(W, torch.tensor([[1, 9]], dtype=torch.int32))
    torch.testing.assert_close(y, torch.stack([W[1], torch.zeros(3, dtype=torch.float64)])[None])
    matmul = generate_for(MATMUL, "pytorch", folder)
    y = matmul.forward([[[1.0, 2.0]]], torch.ones(1, 2, 1, dtype=torch.float64), alpha=2.0)
    assert y.dtype == torch.float64 and y.item() == 6.0


# -- generation ----------------------------------------------------------------------------


def test_generated_modules_are_deterministic_and_ruff_clean(tmp_path):
    """Every corpus module passes `ruff check` (ruff's default rules: no unused names,
    though the torch printer drops what it does not print); a few, generated twice, are
    byte for byte the same."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or "ruff"
    for name, case in sorted(CASES.items()):
        spec = op_spec(case, "Op" + "".join(w.title() for w in name.split("_")))
        text = module_text(spec, "test.toml", "pytorch")
        if name in CROSS:
            assert text == module_text(spec, "test.toml", "pytorch"), name
        (tmp_path / f"{name}.py").write_text(text, encoding="utf-8")
    result = subprocess.run(
        [ruff, "check", "--isolated", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout


def test_generation_never_imports_torch(tmp_path):
    code = (
        "import sys\n"
        "from symgrad.pipeline import module_text\n"
        "from symgrad.spec import OpSpec\n"
        "op = OpSpec('Mm', ('y[b,i,j] = A[b,i,k] * B[b,k,j]',), None, (), (), 't [ops.Mm]')\n"
        "module_text(op, 't.toml', 'pytorch')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": str(Path(sys.executable).parent)},
    )
    assert result.returncode == 0, result.stderr


def test_the_module_shows_the_formula_and_the_gradients(folder):
    module = generate_for(MATMUL, "pytorch", folder)
    doc = module.__doc__
    assert "y[b,i,j] = alpha * A[b,i,k] * B[b,k,j]" in doc
    assert "grad_A[b,i,k] = " in doc and "grad_B[b,k,j] = " in doc
    assert (module.INPUTS, module.OUTPUTS, module.ATTRS) == (("A", "B"), ("y",), ("alpha",))
    program = build(op_spec(MATMUL, module.OP_NAME))
    assert module.INPUTS == tuple(program.inputs)


README_CHECK = """
# The custom op now has the derived backward: the same gradient as plain torch ops.
A.grad = None
((my_op(A, B, 0.5) - target) ** 2).mean().backward()
plain = A.detach().clone().requires_grad_()
((0.5 * torch.einsum("bik,bkj->bij", plain, B) - target) ** 2).mean().backward()
torch.testing.assert_close(A.grad, plain.grad)
print("same gradient")
"""


def test_readme_example(tmp_path):
    """The README section's spec and Python code, run as a user would run them."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    text = readme.split("\n## PyTorch\n", 1)[1].split("\n## ", 1)[0]
    toml = re.search(r"```toml\n(.*?)```", text, re.DOTALL).group(1)
    code = re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)
    (tmp_path / "symgrad.toml").write_text(toml, encoding="utf-8")
    assert main(["generate", str(tmp_path / "symgrad.toml")]) == 0
    (tmp_path / "example.py").write_text(code + README_CHECK, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "example.py"], capture_output=True, text=True, check=False, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "same gradient"


# -- formulas that crashed PyTorch only --------------------------------------------------

LITERAL_INDICES = {
    "row_of_a_table": Case("y[b] = W[b, 1]", {"W": (3, 4)}),
    "column_of_a_lookup": Case(
        "y[t] = W[ids[t], 1]", {"W": (5, 4)}, index_inputs={"ids": ((6,), -1, 6)}
    ),
    "last_axis_at_zero": Case("y[b,i] = x[b,i,0]", {"x": (2, 3, 4)}),
}


@pytest.mark.parametrize("name", sorted(LITERAL_INDICES))
def test_a_literal_index_in_brackets(name, folder):
    """A literal position is a Python int: torch ops (broadcast_to, logical_and) get it as
    a tensor."""
    case = LITERAL_INDICES[name]
    check_target(case, generate_for(case, "pytorch", folder), TORCH)


def test_a_padded_convolution_trains_with_inputs_that_require_grad(folder):
    """Sizes computed from an int attr (`max(p, 0)`) are Python ints: recomputed by the
    backward, never given to save_for_backward (which takes tensors only)."""
    case = Case(
        "y[b,i,o] = sum(x[b, i + k - p, c] * w[k,c,o], k, c)",
        {"x": (2, 6, 3), "w": (3, 3, 4)},
        attrs={"p": 1},
    )
    module = generate_for(case, "pytorch", folder)
    x, w = _inputs(case, module, requires_grad=True)
    module.forward(x, w, p=1).square().sum().backward()
    grad = 2 * module.forward(x, w, p=1).detach()
    for got, want in zip((x.grad, w.grad), module.vjp(x, w, grad, p=1), strict=True):
        torch.testing.assert_close(got, want)
    assert torch.autograd.gradcheck(lambda a, b: module.forward(a, b, p=2), (x, w))


def test_torch_compile_dynamic_with_int_attrs_as_arguments():
    """The repo's StridedConv1d under torch.compile(dynamic=True, fullgraph=True), its int
    attrs passed as arguments (symbolic ints, which have no `hasattr`)."""
    sys.path.insert(0, str(ROOT))
    try:
        from generated_torch import strided_conv1d as module
    finally:
        sys.path.remove(str(ROOT))
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x, w, s, d, p: module.forward(x, w, s=s, d=d, p=p),
        dynamic=True,
        fullgraph=True,
        backend="aot_eager",
    )
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 13, 3, generator=generator, requires_grad=True)
    w = torch.randn(3, 3, 4, generator=generator, requires_grad=True)
    for s, d, p in ((2, 2, 1), (1, 3, 2)):
        out = compiled(x, w, s, d, p)
        torch.testing.assert_close(out, module.forward(x, w, s=s, d=d, p=p))
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (x, w), grad)
        for g, want in zip(got, module.vjp(x, w, grad, s=s, d=d, p=p), strict=True):
            torch.testing.assert_close(g, want)


def test_a_means_guard_against_an_empty_axis_prints_infinity_alone(tmp_path):
    """A mean's 1 / n, guarded against n = 0 (where Python raises), falls back to
    `float("inf")` itself, not `1 * float("inf")`; and the mean over an empty axis is still
    nan (0 * inf), as torch.mean gives."""
    case = Case("y[b] = mean(x[b,n], n)", {"x": (3, 4)})
    text = module_text(op_spec(case, "MeanGuard"), "test.toml", "pytorch")
    assert 'if float(_n_n) else float("inf"))' in text, text
    assert '* float("inf")' not in text, text
    module = generate(case, tmp_path, prefix="MeanGuard", target="pytorch")
    y = module.forward(torch.ones(3, 0, dtype=torch.float64))
    assert y.shape == (3,) and torch.isnan(y).all()


def test_softplus_is_exact_above_torchs_default_threshold(folder):
    """torch's softplus returns x itself above 20, so `softplus(x) - x` (log(1 + e^-x), 1e-9
    at 20.5) was 0 and its gradient (-sigmoid(-x)) 0: the module asks for threshold 40."""
    case = Case("y[b,i] = softplus(x[b,i]) - x[b,i]", {"x": (2, 3)})
    module = generate_for(case, "pytorch", folder)
    x = torch.linspace(20.5, 39.5, 6, dtype=torch.float64).reshape(2, 3).requires_grad_()
    y = module.forward(x)
    want = np.log1p(np.exp(-x.detach().numpy()))
    # A difference of numbers near 40: exact to their rounding (7e-15), where 20.5 was 1e-9 off.
    np.testing.assert_allclose(y.detach().numpy(), want, rtol=0, atol=2e-14)
    (g,) = torch.autograd.grad(y.sum(), x)
    np.testing.assert_allclose(g.numpy(), -1 / (1 + np.exp(x.detach().numpy())), rtol=0, atol=1e-15)

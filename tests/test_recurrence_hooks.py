"""A recurrence module has the hooks of every module of its target: PyTorch's
`register(op)` attaches the adjoint scan to a custom op of one's own (torch.library), and
JAX's `wrap(primal)` gives a primal of one's own (here a jax.pure_callback) the adjoint
scan as its gradient. Either way the op's forward is opaque: the gradient recomputes the
states from the inputs. Checked on LinearRecurrence, Lfilter and SelectiveScan, whose
forward is a NumPy loop, with a training step through the registered or wrapped op."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from frameworks import FRAMEWORKS
from test_recurrences import CASES, _loss_and_grads, inputs_for, module_for

HOOKED = ("linear", "lfilter", "selective_scan")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("recurrence_hooks")


def _numpy(x):
    return x.numpy(force=True)


def _ref(case):
    return CASES[case][2]


# -- PyTorch: register(op) ----------------------------------------------------------------


@torch.library.custom_op("symgrad_scan_test::linear", mutates_args=())
def linear_op(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Opaque to autograd: a NumPy loop."""
    return torch.from_numpy(_ref("linear")(_numpy(a), _numpy(x))[0])


@linear_op.register_fake
def _(a, x):
    return torch.empty_like(x)


@torch.library.custom_op("symgrad_scan_test::lfilter", mutates_args=())
def lfilter_op(x: torch.Tensor, a: torch.Tensor, bb: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(_ref("lfilter")(_numpy(x), _numpy(a), _numpy(bb))[0])


@lfilter_op.register_fake
def _(x, a, bb):
    return torch.empty_like(x)


@torch.library.custom_op("symgrad_scan_test::selective_scan", mutates_args=())
def selective_scan_op(
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    x: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    arrays = [_numpy(t) for t in (delta, A, B, x, C, D)]
    return torch.from_numpy(_ref("selective_scan")(*arrays)[0])


@selective_scan_op.register_fake
def _(delta, A, B, x, C, D):
    return torch.empty_like(x)


TORCH_OPS = {"linear": linear_op, "lfilter": lfilter_op, "selective_scan": selective_scan_op}
SIGNATURES = {"linear": ("a", "x"), "lfilter": ("x", "a", "bb")}


def _training_step(case, target, forward, module):
    """One SGD step through `forward`: the framework's gradient of Σ ½(y - target)² is the
    generated vjp of (y - target), and the loss goes down."""
    _, shapes, ref = CASES[case]
    fw = FRAMEWORKS[target]
    values = inputs_for(shapes, seed=13)
    args = [fw.tensor(values[n]) for n in module.INPUTS]
    want = ref(*[values[n] for n in module.INPUTS])
    rng = np.random.default_rng(14)
    targets = [w + rng.standard_normal(w.shape) for w in want]
    ours = SimpleNamespace(forward=forward)
    loss, grads, after = _loss_and_grads(fw, ours, args, [fw.tensor(t) for t in targets])
    expected = module.vjp(*args, *[fw.tensor(w - t) for w, t in zip(want, targets, strict=True)])
    assert len(grads) == len(expected) == len(module.INPUTS)
    for name, g, e in zip(module.INPUTS, grads, expected, strict=True):
        assert np.any(g != 0), name
        np.testing.assert_allclose(g, fw.numpy(e), rtol=1e-9, atol=1e-12, err_msg=name)
    assert after < loss


@pytest.mark.parametrize("case", HOOKED)
def test_register_attaches_the_adjoint_scan_to_a_custom_op(case, folder):
    """`register` on a torch.library custom op whose forward is a NumPy loop: gradcheck
    in float64, and a training step whose gradients are the generated vjp's."""
    module = module_for(case, "pytorch", folder)
    op = TORCH_OPS[case]
    assert module.register(op) is op
    values = inputs_for(CASES[case][1], seed=12)
    args = [torch.tensor(values[n], requires_grad=True) for n in module.INPUTS]
    assert torch.autograd.gradcheck(op, tuple(args))
    _training_step(case, "pytorch", op, module)


def test_register_by_name_and_refusal_of_another_signature(folder):
    module = module_for("lfilter", "pytorch", folder)
    module.register("symgrad_scan_test::lfilter")
    other = module_for("selective_scan", "pytorch", folder)
    with pytest.raises(ValueError) as error:
        other.register(lfilter_op)
    message = str(error.value)
    assert message.startswith(f"{other.OP_NAME}: op symgrad_scan_test::lfilter takes (x, a, bb)")
    assert "\n" not in message


# -- JAX: wrap(primal) --------------------------------------------------------------------


def _callback(case, module):
    """A primal of one's own: the NumPy loop through jax.pure_callback."""
    import jax

    def primal(*arrays):
        x = arrays[module.INPUTS.index("x")]  # each of these ops' output is shaped like x
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.pure_callback(
            lambda *xs: _ref(case)(*(np.asarray(x) for x in xs))[0],
            shape,
            *arrays,
            vmap_method="sequential",
        )

    return primal


@pytest.mark.parametrize("case", HOOKED)
def test_wrap_gives_a_primal_the_adjoint_scan(case, folder):
    """`wrap` of a pure_callback: its values, the generated gradient under jax.jit (a
    training step), and the same gradient as the generated forward's."""
    import jax

    module = module_for(case, "jax", folder)
    wrapped = module.wrap(_callback(case, module))
    values = inputs_for(CASES[case][1], seed=15)
    arrays = [jax.numpy.asarray(values[n]) for n in module.INPUTS]
    want = _ref(case)(*[values[n] for n in module.INPUTS])[0]
    np.testing.assert_allclose(np.asarray(wrapped(*arrays)), want, rtol=1e-12)
    _training_step(case, "jax", wrapped, module)


def test_a_wrapped_primal_of_the_wrong_shape_is_one_line(folder):
    import jax.numpy as jnp

    module = module_for("linear", "jax", folder)
    wrapped = module.wrap(lambda a, x: x[:, :-1])
    values = inputs_for(CASES["linear"][1])
    with pytest.raises(ValueError) as error:
        wrapped(*[jnp.asarray(values[n]) for n in module.INPUTS])
    message = str(error.value)
    assert message.startswith(f"{module.OP_NAME}: the primal's h has shape"), message
    assert "\n" not in message

"""Test-only JAX primals for `symgrad check --target jax` against
tests/custom_op/check_py_ops.toml: one function snake_case(op) per op, taking the inputs
and then the attrs as keywords, with no gradient of their own (the check wraps each with
the generated one).

py_mat_mul, py_strided_conv and py_scale compute their formula; py_off_by_one leaves the
last i at 0 and py_transposed returns (b, j, i).
"""

import functools

import jax
import jax.numpy as jnp


def _no_gradient(function):
    """A primal JAX cannot differentiate, like a pure_callback or an ffi_call."""

    @functools.wraps(function)
    def primal(*arrays, **attrs):
        return jax.lax.stop_gradient(function(*arrays, **attrs))

    return primal


@_no_gradient
def py_mat_mul(A, B):
    return A @ B


def py_strided_conv(x, w, *, s=1, d=1):
    taps, length = w.shape[0], x.shape[1]
    count = max(0, (length - 1 - d * (taps - 1)) // s + 1)
    at = s * jnp.arange(count)[:, None] + d * jnp.arange(taps)[None, :]
    return jnp.einsum("bikc,kco->bio", x[:, at, :], w)


def py_scale(x, *, alpha=0.5):
    return alpha * x


def py_off_by_one(x, w):
    return (x * w).at[:, -1].set(0)


def py_transposed(A, B):
    return jnp.swapaxes(A @ B, 1, 2)

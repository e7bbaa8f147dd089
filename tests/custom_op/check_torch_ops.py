"""Test-only PyTorch ops registered with torch.library in namespace `checkpy`, for
`symgrad check --target pytorch` against tests/custom_op/check_py_ops.toml. No backward is
registered here: the check gives each op the generated one.

py_mat_mul, py_strided_conv and py_scale compute their formula; py_off_by_one leaves the
last i at 0 and py_transposed returns (b, j, i).
"""

import torch


@torch.library.custom_op("checkpy::py_mat_mul", mutates_args=())
def py_mat_mul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return A @ B


@torch.library.custom_op("checkpy::py_strided_conv", mutates_args=())
def py_strided_conv(x: torch.Tensor, w: torch.Tensor, s: int = 1, d: int = 1) -> torch.Tensor:
    taps, length = w.shape[0], x.shape[1]
    count = max(0, (length - 1 - d * (taps - 1)) // s + 1)
    at = s * torch.arange(count)[:, None] + d * torch.arange(taps)[None, :]
    return torch.einsum("bikc,kco->bio", x[:, at, :], w)


@torch.library.custom_op("checkpy::py_scale", mutates_args=())
def py_scale(x: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    return alpha * x


@torch.library.custom_op("checkpy::py_off_by_one", mutates_args=())
def py_off_by_one(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x * w
    y[:, -1] = 0
    return y


@torch.library.custom_op("checkpy::py_transposed", mutates_args=())
def py_transposed(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return (A @ B).transpose(1, 2).contiguous()

"""A window op that stays a gathered window in every target, for tests of the chunked
(tiled) path: fairseq's lightconv with its taps dilated. Its undilated form, the channel
read by the filter and kept in the output, is a depthwise convolution, which lowers to the
frameworks' depthwise kernels and holds no window to tile (test_depthwise_convolutions)."""

from __future__ import annotations

from symgrad.spec import OpSpec, parse_spec

DILATED_LIGHTCONV = """
[ops.DilatedLightconv]
# fairseq's lightconv in its [B, C, T] layout, its K taps two positions apart, the
# padding a let of the filter's width
formula = "y[b,c,t] = sum(w[c,k] * x[b, c, t + 2*k - P], k)"
let = { P = "w.shape[1] - 1" }
ranges = { t = "x.shape[2]" }
"""


def dilated_lightconv() -> OpSpec:
    """The op above, as symgrad.toml's ops are read."""
    (op,) = parse_spec(DILATED_LIGHTCONV, "window_ops.toml").ops
    return op

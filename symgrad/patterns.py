"""Recognised patterns: formulas that are exactly an op TensorFlow has a fast kernel for.

Derivation stays general (a gather, an einsum, a scatter-add); lowering asks this module
whether a gather and the one term that reads it are a convolution, and if so emits
`tf.nn.convolution` forward and TF's own backprop kernels backward instead of the
gathered window. Only exact matches count; anything else lowers generally.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from . import indexing
from .model import Index, Level, Program, accesses


@dataclass(frozen=True)
class Spatial:
    """One spatial axis: the source is read at `stride*i + k + offset`."""

    output: Index  # i: an index of the result
    window: Index  # k: summed, a plain index of the filter
    stride: sp.Expr  # a positive int literal or int attr
    offset: sp.Expr  # an int literal or int-attr expression (minus the zero padding)


@dataclass(frozen=True)
class Convolution:
    """`y[b,i..,o] = Σ_{k..,c} x[b, s*i + k + off, .., c] * w[k.., c, o]` (NHWC, HWIO):
    `tf.nn.convolution` on x padded or cropped to the window the outputs read.

    A formula without a batch axis b, an input channel c or an output channel o is the
    same convolution with a unit axis in its place (`batch`, `channel`, `out_channel`
    None): `y[b,i] = Σ_k x[b,i+k] * w[k]` is one with c and o of size one. x and w may
    hold their axes in any order (PyTorch's NCHW and OIHW: `x[b,c,i+u,j+v] * w[o,c,u,v]`):
    `x_axes` and `w_axes` say where each axis of the kernels' layout lies, and lowering
    transposes them into it (and the gradients back).

    A depthwise window, `y[b,i..,c] = Σ_k x[b, i + k + off, .., c] * w[k.., c]` (the
    channel read by w and kept in y, not summed: fairseq's lightconv, a depthwise conv
    layer), is `depthwise` (1-D or 2-D, stride 1, no output channel): TF's depthwise
    kernels, torch's grouped convolution, and in JAX a sum of the taps' shifted slices
    (XLA's grouped convolution on CPU was slower than the gathered window; see the
    template). Its filter in the kernels' layout is (k.., c, 1)."""

    gather: str  # the gather level it replaces
    consumer: str  # the level whose term it is
    source: str  # x
    filter: str  # w
    batch: Index | None
    channel: Index | None  # c, summed
    out_channel: Index | None  # o
    spatial: tuple[Spatial, ...]
    # x's axis holding each of (b, i.., c), w's holding each of (k.., c, o); None: a unit axis
    x_axes: tuple[int | None, ...]
    w_axes: tuple[int | None, ...]
    depthwise: bool = False  # c kept in y, not summed (see above)

    @property
    def indices(self) -> tuple[Index, ...]:
        """The axes of the result, as the formula has them (no unit axes)."""
        last = self.channel if self.depthwise else self.out_channel
        full = (self.batch, *(s.output for s in self.spatial), last)
        return tuple(i for i in full if i is not None)


def convolutions(program: Program) -> dict[str, Convolution]:
    """The gathers that, with the one term reading them, are exactly a convolution."""
    levels: list[Level] = [*program.intermediates, *(o.level for o in program.outputs)]
    readers: dict[str, list[tuple[Level, int]]] = {}
    for level in levels:
        for n, term in enumerate(level.terms):
            for access in accesses(term.expr):
                readers.setdefault(access.base.label.name, []).append((level, n))
    found = {}
    for level in program.intermediates:
        if level.gather is None or len(readers.get(level.name, [])) != 1:
            continue
        consumer, n = readers[level.name][0]
        conv = _match(program, level, consumer, n)
        if conv is not None:
            found[level.name] = conv
    return found


def _match(program: Program, gather: Level, consumer: Level, n: int) -> Convolution | None:
    g = gather.gather
    rank = len(g.positions)
    if not g.computed or g.source in program.index_inputs:
        return None
    spatial_rank = len(g.computed)
    if not 1 <= spatial_rank <= 3:
        return None
    plain_axes = [a for a in range(rank) if a not in g.computed]
    plain = [g.positions[a] for a in plain_axes]
    if len(plain) > 2 or not all(indexing.is_plain(i) for i in plain):
        return None
    if len(set(plain)) != len(plain):
        return None
    term = consumer.terms[n]
    factors = sp.Mul.make_args(term.expr)
    if len(factors) != 2 or not all(isinstance(f, sp.Indexed) for f in factors):
        return None
    mine = [f for f in factors if f.base.label.name == gather.name]
    others = [f for f in factors if f.base.label.name != gather.name]
    if len(mine) != 1 or len(others) != 1:
        return None
    read, weights = mine[0], others[0]
    filter_name = weights.base.label.name
    filter_level = _gathered_filter(program, filter_name)
    if filter_level is None and (
        filter_name not in program.inputs or filter_name in program.index_inputs
    ):
        return None
    if filter_name == g.source or tuple(read.indices) != gather.indices:
        return None
    w = tuple(weights.indices)
    if len(set(w)) != len(w) or len(w) < spatial_rank or not all(indexing.is_plain(k) for k in w):
        return None
    # x's plain axes: the input channel is summed with w, the batch is not read by w
    channels = [i for i in plain if i in w]
    batches = [i for i in plain if i not in w]
    if len(channels) > 1 or len(batches) > 1:
        return None
    channel = channels[0] if channels else None
    batch = batches[0] if batches else None
    spatial = []
    for axis in g.computed:
        position = sp.expand(g.positions[axis])
        windows = [k for k in w if k in position.free_symbols]
        if len(windows) != 1:
            return None
        (window,) = windows
        if position.coeff(window) != 1:
            return None  # dilated: TF's CPU backprop kernels refuse dilations > 1
        rest = position - window
        outputs = [s for s in rest.free_symbols if indexing.is_plain(s)]
        if len(outputs) != 1 or rest.atoms(sp.Indexed):
            return None
        (output,) = outputs
        stride = rest.coeff(output)
        offset = rest - stride * output
        if offset.free_symbols & set(outputs) or any(
            indexing.is_plain(s) for s in offset.free_symbols
        ):
            return None
        if not (stride.is_Integer and stride > 0) and not _int_attr(stride, program):
            return None
        spatial.append(Spatial(output, window, stride, offset))
    windows = {s.window for s in spatial}
    rest_w = [k for k in w if k not in windows and k != channel]
    if len(rest_w) > 1:
        return None
    out_channel = rest_w[0] if rest_w else None
    depthwise = channel is not None and channel not in term.summed
    if depthwise and not _depthwise(spatial, out_channel):
        return None
    if filter_level is not None and not depthwise:
        return None
    summed = windows | ({channel} if channel is not None and not depthwise else set())
    if set(term.summed) != summed or len(windows) != spatial_rank:
        return None
    outputs = {s.output for s in spatial}
    kept = (batch, channel if depthwise else out_channel)
    expected = [i for i in kept if i is not None] + list(outputs)
    if len(set(expected)) != len(expected) or set(expected) & summed:
        return None
    if set(consumer.indices) != set(expected) or len(consumer.indices) != len(expected):
        return None
    x_axes = (
        None if batch is None else g.positions.index(batch),
        *g.computed,
        None if channel is None else g.positions.index(channel),
    )
    w_axes = (
        *(w.index(s.window) for s in spatial),
        None if channel is None else w.index(channel),
        None if out_channel is None else w.index(out_channel),
    )
    return Convolution(
        gather.name,
        consumer.name,
        g.source,
        filter_name,
        batch,
        channel,
        out_channel,
        tuple(spatial),
        x_axes,
        w_axes,
        depthwise,
    )


def _gathered_filter(program: Program, name: str) -> Level | None:
    """The level of a filter gathered from an input of values at computed positions of
    its own indices (`w[c // G, k]`: fairseq's lightconv with H filters shared by G
    channels each), which a depthwise kernel reads like an input: it is no larger than
    the filter the kernel takes (c, k), and its gradient goes back to w by the gather's
    scatter."""
    level = next((lv for lv in program.intermediates if lv.name == name), None)
    if level is None or level.gather is None or level.gather.source not in program.inputs:
        return None
    if level.gather.source in program.index_inputs:
        return None
    return level


def _depthwise(spatial: list[Spatial], out_channel: Index | None) -> bool:
    """Whether a window whose channel w reads and y keeps is one the depthwise kernels
    compute: no output channel of its own (a channel multiplier), 1-D or 2-D (TF has no
    3-D depthwise kernel), stride 1 (TF's depthwise kernels take one stride for both
    axes, and a 1-D window runs as 2-D with a unit height)."""
    return out_channel is None and len(spatial) <= 2 and all(s.stride == 1 for s in spatial)


def _int_attr(e: sp.Expr, program: Program) -> bool:
    """An int attr: a Python int when the op is called. A `let` is not (it may be a
    tensor when dims are unknown), so a let stride lowers as a general gather."""
    attrs = {f"_int_{name}" for name, kind in program.attrs if kind == "int"}
    return isinstance(e, sp.Symbol) and e.name in attrs

"""Recognised patterns lowered to fused kernels: a convolution (`convolution` forward, the
backprop kernels backward) and a prefix sum (`cumsum`).
"""

from __future__ import annotations

import sympy as sp

from .. import functions as fn
from .. import ir
from ..derive import grad_name
from ..indexing import IOTA
from ..model import Index
from .common import (
    RELATIONS,
    _Body,
    _index_set,
    _is_simple,
    align,
    integer,
)


class Kernels:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

    def convolution_term(self, body: _Body, e: sp.Expr, out: tuple[Index, ...]):
        """The term of a recognised convolution (forward), or its filter gradient
        `Σ grad_y · window` (backward), as TF's convolution kernels."""
        reads = [a for a in e.atoms(sp.Indexed) if a.base.label.name in self.convolutions]
        if len(reads) != 1:
            return None
        conv = self.convolutions[reads[0].base.label.name]
        factors = sp.Mul.make_args(e)
        if len(factors) != 2:
            return None
        (other,) = [f for f in factors if f != reads[0]]
        if not isinstance(other, sp.Indexed):
            return None
        if other.base.label.name == conv.filter and conv.depthwise:
            value = self.depthwise(body, conv, None, kernel="depthwise_conv2d")
            return self.without_units(body, value, self.unit_axes(conv, "y")), conv.indices
        if other.base.label.name == conv.filter:  # the forward term
            axes = self.conv_axes(body, conv)
            value = ir.Call(
                "convolution",
                (self.window(body, conv, axes), self.full_filter(body, conv)),
                (
                    ("strides", self.strides(conv, full=False)),
                    ("padding", self.conv_padding(body, axes)),
                ),
            )
            return self.without_units(body, value, self.unit_axes(conv, "y")), conv.indices
        if other.base.label.name == grad_name(conv.consumer):  # ∂L/∂w
            if len(out) != sum(a is not None for a in conv.w_axes):
                return None
            grad = self.conv_grad(body, conv, other)
            value = self.backprop(body, conv, grad, filter_gradient=True)
            value = self.without_units(body, value, self.unit_axes(conv, "w"))
            # the kernel's (k.., c, o), as w's own axes (`out` is w's order)
            return value, tuple(out[a] for a in conv.w_axes if a is not None)
        return None

    @staticmethod
    def to_layout(value: ir.Expr, axes: tuple[int | None, ...]) -> ir.Expr:
        """A tensor whose axis `axes[k]` holds axis k of the kernels' layout (None: a unit
        axis, added later), its axes in that order."""
        own, kernel = _layout_labels(axes)
        return align(value, own, kernel)

    @staticmethod
    def from_layout(value: ir.Expr, axes: tuple[int | None, ...]) -> ir.Expr:
        """The inverse of `to_layout`: a tensor in the kernels' layout (no unit axes) with
        its axes where the source has them."""
        own, kernel = _layout_labels(axes)
        return align(value, kernel, own)

    @staticmethod
    def unit_axes(conv, tensor: str) -> tuple[int, ...]:
        """The unit axes the kernels' layout adds to x, w or y (see `Convolution`)."""
        n = len(conv.spatial)
        if tensor == "x":
            present = (conv.batch, *([0] * n), conv.channel)
        elif tensor == "w":
            present = (*([0] * n), conv.channel, conv.out_channel)
        else:
            last = conv.channel if conv.depthwise else conv.out_channel
            present = (conv.batch, *([0] * n), last)
        return tuple(k for k, index in enumerate(present) if index is None)

    @staticmethod
    def with_units(value: ir.Expr, units: tuple[int, ...], rank: int) -> ir.Expr:
        """`value` with new unit axes at `units` of a result of rank `rank`."""
        if not units:
            return value
        slots, k = [], 0
        for axis in range(rank):
            slots.append(None if axis in units else k)
            k += axis not in units
        return ir.View(value, None, tuple(slots))

    def without_units(self, body: _Body, value: ir.Expr, units: tuple[int, ...]) -> ir.Expr:
        """`value` with its unit axes `units` squeezed away (last first)."""
        for axis in sorted(units, reverse=True):
            value = ir.Var(body.bind(value))
            value = ir.Call("squeeze", (value,), (("axis", ir.Lit(str(axis))),))
        return value

    def full_filter(self, body: _Body, conv) -> ir.Expr:
        """w in the kernels' layout (spatial.., in, out), unit channels added."""
        weights: ir.Expr = self.to_layout(ir.Var(body.tensors[conv.filter]), conv.w_axes)
        return self.with_units(weights, self.unit_axes(conv, "w"), len(conv.spatial) + 2)

    def conv_grad(self, body: _Body, conv, grad: sp.Indexed | None = None) -> ir.Expr:
        """The consumer's incoming gradient on the convolution's axes (b, i.., o)."""
        name = grad_name(conv.consumer)
        labels = tuple(grad.indices) if grad is not None else self.levels[conv.consumer].indices
        if grad is not None:  # the contribution renamed the consumer's indices
            mapping = dict(zip(self.levels[conv.consumer].indices, labels, strict=True))
            target = tuple(mapping[i] for i in conv.indices)
        else:
            target = conv.indices
        value = align(ir.Var(body.tensors[name]), labels, target)
        value = value if _is_simple(value) else ir.Var(body.bind(value))
        return self.with_units(value, self.unit_axes(conv, "y"), len(conv.spatial) + 2)

    def strides(self, conv, *, full: bool) -> ir.Expr:
        """`[s1, s2]` for tf.nn.convolution; `[1, s1, s2, 1]` for the raw kernels (1-D
        as 2-D: `[1, 1, s, 1]`)."""
        strides = [integer(s.stride) for s in conv.spatial]
        if not full:
            return ir.List(tuple(strides))
        if len(strides) == 1:
            strides = [ir.Lit("1"), *strides]
        return ir.List((ir.Lit("1"), *strides, ir.Lit("1")))

    def conv_axes(self, body: _Body, conv) -> ir.List:
        """Per spatial axis `[size, taps, count, stride, offset]`: the outputs read x at
        stride*i + k + offset, i < count, k < taps (the `axes` of `conv_window`)."""
        rows = []
        for n, spatial in enumerate(conv.spatial):
            size = self.axis_size(body, conv.source, conv.x_axes[1 + n])
            taps = self.axis_size(body, conv.filter, conv.w_axes[n])
            count = self.index_size(body, spatial.output)
            parts = (ir.Var(size), ir.Var(taps), ir.Var(count))
            rows.append(ir.List((*parts, integer(spatial.stride), integer(spatial.offset))))
        return ir.List(tuple(rows))

    def conv_padding(self, body: _Body, axes: ir.List, *, flat: bool = False) -> ir.Expr:
        """The kernels' padding for the window (decided when the op runs, from the sizes:
        the kernel's own SAME or VALID where that reads the window, so that no pad or
        slice runs). 1-D runs as 2-D: a leading axis of size one."""
        if flat:
            one = ir.Lit("1")
            axes = ir.List((ir.List((one, one, one, one, ir.Lit("0"))), *axes.items))
        return ir.Var(body.bind(ir.Call("conv_padding", (ir.Var(body.bind(axes)),))))

    def window(self, body: _Body, conv, axes: ir.List) -> ir.Expr:
        """x in the kernels' layout (unit axes added), padded with zeros or cropped to
        exactly the window the outputs read, unless the kernel's padding reads it."""
        x: ir.Expr = self.to_layout(ir.Var(body.tensors[conv.source]), conv.x_axes)
        x = self.with_units(x, self.unit_axes(conv, "x"), len(conv.spatial) + 2)
        if not _is_simple(x):
            x = ir.Var(body.bind(x))
        return ir.Call("conv_window", (x, ir.Var(body.bind(axes))))

    def backprop(self, body: _Body, conv, grad: ir.Expr, *, filter_gradient: bool) -> ir.Expr:
        """TF's backprop kernel for the filter or for the window of x (1-D runs as 2-D
        with a height of one, as tf.nn.conv1d does)."""
        if conv.depthwise:
            kind = "filter" if filter_gradient else "input"
            return self.depthwise(body, conv, grad, kernel=f"depthwise_conv2d_backprop_{kind}")
        window, weights, grad, padding = self.kernel_operands(body, conv, grad)
        flat = len(conv.spatial) == 1
        rank = "3D" if len(conv.spatial) == 3 else "2D"
        if filter_gradient:
            kernel = f"conv{rank.lower()}_backprop_filter"
            first = (("input", window), ("filter_sizes", ir.Call("shape", (weights,))))
        else:
            kernel = f"conv{rank.lower()}_backprop_input"
            first = (("input_sizes", ir.Call("shape", (window,))), ("filter", weights))
        value: ir.Expr = ir.Call(
            kernel,
            (),
            (
                *first,
                ("out_backprop", grad),
                ("strides", self.strides(conv, full=True)),
                ("padding", padding),
            ),
        )
        if flat:  # the added axis: 0 of the filter's shape, 1 of the input's
            axis = "0" if filter_gradient else "1"
            value = ir.Call("squeeze", (ir.Var(body.bind(value)),), (("axis", ir.Lit(axis)),))
        return value

    def kernel_operands(self, body: _Body, conv, grad: ir.Expr | None) -> tuple:
        """The window of x, the filter, the incoming gradient (or None) and the padding
        as the 2-D and 3-D kernels take them: a 1-D window runs as 2-D with a height of
        one, as tf.nn.conv1d does."""
        axes = self.conv_axes(body, conv)
        window: ir.Expr = ir.Var(body.bind(self.window(body, conv, axes)))
        weights: ir.Expr = self.full_filter(body, conv)
        if not _is_simple(weights):
            weights = ir.Var(body.bind(weights))
        flat = len(conv.spatial) == 1
        padding = self.conv_padding(body, axes, flat=flat)
        if flat:
            window = ir.View(window, None, (0, None, 1, 2))
            weights = ir.View(weights, None, (None, 0, 1, 2))
            if grad is not None:
                grad = ir.View(grad, None, (0, None, 1, 2))
        return window, weights, grad, padding

    def depthwise(self, body: _Body, conv, grad: ir.Expr | None, *, kernel: str) -> ir.Expr:
        """TF's depthwise kernel `kernel` (the forward, or the backprop of the filter or
        of the window of x) in 2-D (1-D with a height of one), stride 1: the window in
        NHWC, the filter (kh, kw, c, 1), `grad` the consumer's gradient (b, i, j, c)."""
        window, weights, grad, padding = self.kernel_operands(body, conv, grad)
        flat = len(conv.spatial) == 1
        strides = ("strides", ir.List((ir.Lit("1"),) * 4))
        if kernel == "depthwise_conv2d":
            first = (("input", window), ("filter", weights))
        elif kernel.endswith("filter"):
            first = (
                ("input", window),
                ("filter_sizes", ir.Call("shape", (weights,))),
                ("out_backprop", grad),
            )
        else:
            first = (
                ("input_sizes", ir.Call("shape", (window,))),
                ("filter", weights),
                ("out_backprop", grad),
            )
        value: ir.Expr = ir.Call(kernel, (), (*first, strides, ("padding", padding)))
        if flat:  # the added axis: 0 of the filter's shape, 1 of the input's and output's
            axis = "0" if kernel.endswith("filter") else "1"
            value = ir.Call("squeeze", (ir.Var(body.bind(value)),), (("axis", ir.Lit(axis)),))
        return value

    def convolution_input_gradient(self, body: _Body, conv) -> ir.Expr:
        """∂L/∂x: TF's input backprop kernel on the window, then the window's transpose
        (the crop becomes zero padding, the zero padding is cut away)."""
        value = self.backprop(body, conv, self.conv_grad(body, conv), filter_gradient=False)
        value = ir.Var(body.bind(value))
        axes = ir.Var(body.bind(self.conv_axes(body, conv)))
        value = ir.Call("conv_unwindow", (value, axes))
        value = self.without_units(body, value, self.unit_axes(conv, "x"))
        return self.from_layout(value, conv.x_axes)

    def prefix_sum(self, body, e, summed, out, eyes):
        """`Σ_k where(k <= i, h[k], 0)` is `tf.cumsum(h)` read at i: O(n), not an n×n
        mask (`prefix_sum_form`). The gradient of a prefix sum is a reversed one, so the
        same rule serves the backward pass."""
        if eyes:
            return None
        form = prefix_sum_form(e, summed, out, self.same_size)
        if form is None:
            return None
        k, i, op, rest = form
        out_k = tuple(k if j == i else j for j in out)
        inner = tuple(j for j in summed if j != k)
        value, axes = self.contract(body, rest, inner, out_k, ())
        if k not in axes:
            return None
        if not _is_simple(value):
            value = ir.Var(body.bind(value))
        keywords = [("axis", ir.Lit(str(axes.index(k))))]
        if op in ("<", ">"):
            keywords.append(("exclusive", ir.Lit("True")))
        if op in (">", ">="):
            keywords.append(("reverse", ir.Lit("True")))
        total = ir.Call("cumsum", (value,), tuple(keywords))
        return total, tuple(i if j == k else j for j in axes)


def _layout_labels(axes: tuple[int | None, ...]):
    """Labels of a tensor's own axes, and the same labels in the kernels' layout (`axes[k]`
    the tensor's axis holding the layout's axis k; None, a unit axis, skipped)."""
    present = tuple(a for a in axes if a is not None)
    own = tuple(Index(f"_axis{k}") for k in range(len(present)))
    return own, tuple(own[a] for a in present)


def prefix_sum_form(e: sp.Expr, summed, out, same_size):
    """`(k, i, op, rest)` when the product `e`, summed over `summed` into `out`, is a
    prefix sum `Σ_k where(k op i, rest, 0)`: its one mask (a `where` with 0 else)
    relates a summed index k and an index i of `out` that is not summed, `<=` (`<`:
    exclusive; `>=`, `>`: reversed; `op` reads as `k op i`), and the rest of the product
    reads k and not i; k and i have one size (`same_size(i, k)`).
    Else None. Lowering computes it as a `cumsum` (`Kernels.prefix_sum`), so tiling
    counts no mask of it (`tile._materialized`)."""
    factors = sp.Mul.make_args(e)
    masks = [f for f in factors if isinstance(f, fn.select) and f.args[2] == 0]
    if len(masks) != 1:
        return None
    (mask,) = masks
    cond = mask.args[0]
    if type(cond) not in RELATIONS or RELATIONS[type(cond)] in ("==", "!="):
        return None
    sides = cond.args
    if not all(isinstance(a, sp.Indexed) and a.base.label.name == IOTA for a in sides):
        return None
    left, right = (a.indices[0] for a in sides)
    op = RELATIONS[type(cond)]
    if left in summed and right in out and right not in summed:
        k, i = left, right
    elif right in summed and left in out and left not in summed:
        k, i = right, left
        op = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}[op]
    else:
        return None
    rest = mask.args[1] * sp.Mul(*[f for f in factors if f is not mask])
    if i in _index_set(rest) or k not in _index_set(rest) or not same_size(i, k):
        return None
    return k, i, op, rest

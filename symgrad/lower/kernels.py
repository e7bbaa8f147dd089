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
        if other.base.label.name == conv.filter:  # the forward term
            value = ir.Call(
                "convolution",
                (self.window(body, conv), ir.Var(body.tensors[conv.filter])),
                (
                    ("strides", self.strides(conv, full=False)),
                    ("padding", ir.Lit('"VALID"')),
                ),
            )
            return value, conv.indices
        if other.base.label.name == grad_name(conv.consumer):  # ∂L/∂w
            grad = self.conv_grad(body, conv, other)
            value = self.backprop(body, conv, grad, filter_gradient=True)
            return value, out
        return None

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
        return value if _is_simple(value) else ir.Var(body.bind(value))

    def strides(self, conv, *, full: bool) -> ir.Expr:
        """`[s1, s2]` for tf.nn.convolution; `[1, s1, s2, 1]` for the raw kernels (1-D
        as 2-D: `[1, 1, s, 1]`)."""
        strides = [integer(s.stride) for s in conv.spatial]
        if not full:
            return ir.List(tuple(strides))
        if len(strides) == 1:
            strides = [ir.Lit("1"), *strides]
        return ir.List((ir.Lit("1"), *strides, ir.Lit("1")))

    def window_bounds(self, body: _Body, conv):
        """Per spatial axis: (padding below, padding above, start, length, size) of the
        window of x the outputs read, as code: after padding, the window starts at
        `start` and has length = max(stride*(n_i - 1) + K, 0). Worked out in SymPy, so literal
        offsets and strides fold to numbers."""

        def var(name: str) -> sp.Symbol:
            return sp.Symbol(name, integer=True, nonnegative=True)

        bounds = []
        for axis, spatial in enumerate(conv.spatial, start=1):
            size = var(self.axis_size(body, conv.source, axis))
            taps = var(self.axis_size(body, conv.filter, axis - 1))
            count = var(self.index_size(body, spatial.output))
            # No outputs read no window: never a negative length (a slice size of -1
            # means "to the end").
            length = sp.Max(spatial.stride * (count - 1) + taps, 0)
            low = sp.Max(-spatial.offset, 0)
            high = sp.Max(spatial.offset + length - size, 0)
            start = spatial.offset + low
            parts = [self.bind_integer(body, e) for e in (low, high, start, length)]
            after = self.bind_integer(body, size + low + high - start - length)
            bounds.append((*parts, integer(size), after))
        return bounds

    def bind_integer(self, body: _Body, e: sp.Expr) -> ir.Expr:
        value = integer(e)
        return value if isinstance(value, ir.Lit | ir.Var) else ir.Var(body.bind(value))

    def window(self, body: _Body, conv) -> ir.Expr:
        """x padded with zeros (or cropped) to exactly the window the outputs read."""
        bounds = self.window_bounds(body, conv)
        zero = ir.List((ir.Lit("0"), ir.Lit("0")))
        paddings = ir.List((zero, *(ir.List((lo, hi)) for lo, hi, *_ in bounds), zero))
        padded = ir.Var(body.bind(ir.Call("pad", (ir.Var(body.tensors[conv.source]), paddings))))
        begin = ir.List((ir.Lit("0"), *(b[2] for b in bounds), ir.Lit("0")))
        size = ir.List((ir.Lit("-1"), *(b[3] for b in bounds), ir.Lit("-1")))
        return ir.Call("slice", (padded, begin, size))

    def backprop(self, body: _Body, conv, grad: ir.Expr, *, filter_gradient: bool) -> ir.Expr:
        """TF's backprop kernel for the filter or for the window of x (1-D runs as 2-D
        with a height of one, as tf.nn.conv1d does)."""
        window: ir.Expr = ir.Var(body.bind(self.window(body, conv)))
        weights: ir.Expr = ir.Var(body.tensors[conv.filter])
        flat = len(conv.spatial) == 1
        if flat:
            window = ir.View(window, None, (0, None, 1, 2))
            weights = ir.View(weights, None, (None, 0, 1, 2))
            grad = ir.View(grad, None, (0, None, 1, 2))
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
                ("padding", ir.Lit('"VALID"')),
            ),
        )
        if flat:  # the added axis: 0 of the filter's shape, 1 of the input's
            axis = "0" if filter_gradient else "1"
            value = ir.Call("squeeze", (ir.Var(body.bind(value)),), (("axis", ir.Lit(axis)),))
        return value

    def convolution_input_gradient(self, body: _Body, conv) -> ir.Expr:
        """∂L/∂x: TF's input backprop kernel on the window, then the window's transpose
        (the crop becomes zero padding, the zero padding is cut away)."""
        value = self.backprop(body, conv, self.conv_grad(body, conv), filter_gradient=False)
        value = ir.Var(body.bind(value))
        bounds = self.window_bounds(body, conv)
        zero = ir.List((ir.Lit("0"), ir.Lit("0")))
        paddings = [ir.List((start, after)) for _, _, start, _, _, after in bounds]
        padded = ir.Var(body.bind(ir.Call("pad", (value, ir.List((zero, *paddings, zero))))))
        begin = ir.List((ir.Lit("0"), *(b[0] for b in bounds), ir.Lit("0")))
        size = ir.List((ir.Lit("-1"), *(b[4] for b in bounds), ir.Lit("-1")))
        return ir.Call("slice", (padded, begin, size))

    def prefix_sum(self, body, e, summed, out, eyes):
        """`Σ_k where(k <= i, h[k], 0)` is `tf.cumsum(h)` read at i: O(n), not an n×n
        mask. Also `<` (exclusive) and `>=`, `>` (reversed); the gradient of a prefix sum
        is a reversed one, so the same rule serves the backward pass."""
        if eyes:
            return None
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
        if i in _index_set(rest) or k not in _index_set(rest) or not self.same_size(i, k):
            return None
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

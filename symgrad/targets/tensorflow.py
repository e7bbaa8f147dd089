"""TensorFlow: the neutral ops are TF's own (their semantics are TF's), so printing is
mostly spelling; `ir.Cond` is `tf.cond`, a new axis is `tf.expand_dims`."""

from __future__ import annotations

import math
from dataclasses import replace

from .. import ir
from .printer import ATOM, Printer, is_integer, precedence

NAMES = {
    "abs": "tf.abs",
    "broadcast_to": "tf.broadcast_to",
    "cast": "tf.cast",
    "conv2d_backprop_filter": "tf.raw_ops.Conv2DBackpropFilter",
    "depthwise_conv2d": "tf.nn.depthwise_conv2d",
    "depthwise_conv2d_backprop_filter": "tf.nn.depthwise_conv2d_backprop_filter",
    "depthwise_conv2d_backprop_input": "tf.nn.depthwise_conv2d_backprop_input",
    "conv2d_backprop_input": "tf.raw_ops.Conv2DBackpropInput",
    "conv3d_backprop_filter": "tf.raw_ops.Conv3DBackpropFilterV2",
    "conv3d_backprop_input": "tf.raw_ops.Conv3DBackpropInputV2",
    "convolution": "tf.nn.convolution",
    "conv_padding": "_conv_padding",
    "conv_window": "_conv_window",
    "conv_unwindow": "_conv_unwindow",
    "band_scores": "_band_scores",
    "band_apply": "_band_apply",
    "band_scatter": "_band_scatter",
    "cos": "tf.cos",
    "cosh": "tf.cosh",
    "cumsum": "tf.cumsum",
    "erf": "tf.math.erf",
    "exp": "tf.exp",
    "eye": "tf.eye",
    "fit": "_fit",
    "gather": "tf.gather",
    "is_finite": "tf.math.is_finite",
    "is_nan": "tf.math.is_nan",
    "log": "tf.math.log",
    "log_softmax": "tf.nn.log_softmax",
    "concat": "tf.concat",
    "logical_and": "tf.logical_and",
    "logical_not": "tf.logical_not",
    "logical_or": "tf.logical_or",
    "maximum": "tf.maximum",
    "minimum": "tf.minimum",
    "pad": "tf.pad",
    "range": "tf.range",
    "reduce_all": "tf.reduce_all",
    "reduce_logsumexp": "tf.reduce_logsumexp",
    "reduce_max": "tf.reduce_max",
    "reduce_mean": "tf.reduce_mean",
    "reduce_min": "tf.reduce_min",
    "reduce_sum": "tf.reduce_sum",
    "reshape": "tf.reshape",
    "rsqrt": "tf.math.rsqrt",
    "searchsorted": "tf.searchsorted",
    "segment_max": "tf.math.unsorted_segment_max",
    "segment_min": "tf.math.unsorted_segment_min",
    "segment_sum": "tf.math.unsorted_segment_sum",
    "shape": "tf.shape",
    "sigmoid": "tf.sigmoid",
    "sign": "tf.sign",
    "sin": "tf.sin",
    "sinh": "tf.sinh",
    "slice": "tf.slice",
    "softmax": "tf.nn.softmax",
    "softplus": "tf.nn.softplus",
    "silu": "tf.nn.silu",
    "elu": "tf.nn.elu",
    "relu": "tf.nn.relu",
    "sparse_rows": "tf.IndexedSlices",
    "sqrt": "tf.sqrt",
    "square": "tf.square",
    "squeeze": "tf.squeeze",
    "tan": "tf.tan",
    "floor": "tf.floor",
    "tanh": "tf.tanh",
    "tile": "tf.tile",
    "broadcast_tile": "tf.tile",
    "transpose": "tf.transpose",
    "where": "tf.where",
    "select": "tf.compat.v1.where",  # no broadcast, so any rank (tf.where: up to 8)
    "zeros": "tf.zeros",
    "zeros_like": "tf.zeros_like",
}

# Kernels a module calls through a helper of its template (`_unless_empty`): on an empty
# axis they are not called at all (TF's filter backprop reads garbage from an empty
# gradient, a 2-D one can crash; a gather from an empty axis raises). The helper, then the
# raw kernel it wraps where it serves several.
KERNELS = {
    "convolution": ("_convolution",),
    "conv2d_backprop_filter": ("_conv_backprop_filter", NAMES["conv2d_backprop_filter"]),
    "conv3d_backprop_filter": ("_conv_backprop_filter", NAMES["conv3d_backprop_filter"]),
    "conv2d_backprop_input": ("_conv_backprop_input", NAMES["conv2d_backprop_input"]),
    "conv3d_backprop_input": ("_conv_backprop_input", NAMES["conv3d_backprop_input"]),
    "depthwise_conv2d": ("_depthwise_conv2d",),
    "depthwise_conv2d_backprop_filter": (
        "_conv_backprop_filter",
        NAMES["depthwise_conv2d_backprop_filter"],
    ),
    "depthwise_conv2d_backprop_input": (
        "_conv_backprop_input",
        NAMES["depthwise_conv2d_backprop_input"],
    ),
    "gather": ("_gather",),
    "segment_sum": ("_segment_sum",),
    "segment_max": ("_segment_extremum", NAMES["segment_max"]),
    "segment_min": ("_segment_extremum", NAMES["segment_min"]),
    "sparse_rows": ("_sparse_rows",),
}

# Max and min over axes take their operand through the module's `_whole`: under
# tf.function, Grappler's arithmetic optimizer rewrites a max or min over a monotone
# function (max(log(s)) as log(max(s)); exp, sqrt, rsqrt, negation, ... in chains), which
# drops the NaN of a log or a square root of a negative s that is not the extremum.
EXTREMA = ("reduce_max", "reduce_min")


def _sums_two(subscripts: str) -> bool:
    """Whether an einsum of two operands (no ellipsis, no repeated axis) sums an axis."""
    inputs, output = subscripts.split("->")
    operands = inputs.split(",")
    if len(operands) != 2 or "." in subscripts:
        return False
    if any(len(set(letters)) < len(letters) for letters in operands):
        return False
    return bool(set(inputs.replace(",", "")) - set(output))


def _inexact_number(code: str) -> bool:
    """Whether printed code is a number literal that is no integer (and not ±inf)."""
    try:
        value = float(code)
    except ValueError:
        return False
    return math.isfinite(value) and not value.is_integer()


class TensorFlowPrinter(Printer):
    cond_function = "tf.cond"
    checks_once = True
    # A chunk loop is a tf.while_loop in a graph, whose every op runs again each chunk
    # (TensorFlow's graph optimizer does not move invariant nodes out of a loop by
    # default); under XLA the compiler would, and does no harm to what is moved already.
    hoists = True
    hoists_whole = True

    def cond(self, e: ir.Cond) -> str:
        # A kept Cond's predicate may be the Python bool a chunk loop hands its chunks
        # (`finite_once`): the module's `_cond` builds that branch alone.
        if not e.kept:
            return super().cond(e)
        parts = (self.code(x) for x in (e.predicate, e.then, e.otherwise))
        return "_cond({}, lambda: {}, lambda: {})".format(*parts)

    def axis_size(self, e: ir.AxisSize) -> str:
        # In a module, `_dim(X, k)` reads a static size as a Python int (no op to run
        # eagerly); elsewhere (`symgrad explain`) the self-contained `tf.shape(X)[k]`.
        if self.in_module:
            return f"_dim({e.tensor}, {e.axis})"
        return f"tf.shape({e.tensor})[{e.axis}]"

    def float_size(self, e: ir.FloatSize) -> str:
        return f"tf.cast({e.size}, dtype)"

    def einsum(self, e: ir.Einsum) -> str:
        operands = ", ".join(self.code(o) for o in e.operands)
        if self.in_module and _sums_two(e.subscripts):
            # A module helper: a product where the summed axes have one position (`_einsum`).
            return f'_einsum("{e.subscripts}", {operands})'
        return f'tf.einsum("{e.subscripts}", {operands})'

    def call(self, e: ir.Call) -> str:
        if self.in_module and e.function in ("maximum", "minimum") and is_integer(e):
            # Size arithmetic: a Python int where the sizes are (the module's `_int_max`),
            # where tf.maximum of two ints is a tensor (in a graph: a chunk plan over a
            # tensor). explain prints sizes as tensors (`tf.shape(x)[k]`): tf.maximum.
            return f"_int_{e.function[:3]}({self.arguments(e)})"
        if e.function == "tie_hits":  # `value == extremum` (ties.tie_test)
            return self.code(ir.Binary("==", *e.args))
        if e.function == "whole":  # the module's helper, not a neutral op (EXTREMA)
            return f"_whole({self.arguments(e)})"
        if e.function == "to_int64":
            return f"tf.cast({self.arguments(e)}, tf.int64)"
        if e.function == "floor_position":  # NaN as -inf: on CUDA a cast of NaN is 0, row 0
            f = self.arguments(e)
            least = f"tf.constant(-float('inf'), {f}.dtype)"
            return f"tf.cast(tf.where(tf.math.is_nan({f}), {least}, {f}), tf.int64)"
        if e.function == "cast" and _inexact_number(self.code(e.args[0])):
            # tf.cast(2 / 3, tf.float64) goes through float32 (1.5e-8 off): a literal
            # that is no integer becomes a constant of the dtype directly
            return f"tf.constant({self.arguments(e)})"
        if e.function == "exact_div":  # a module checks it (`_exact_div`); explain not
            if self.in_module:
                return f"_exact_div({self.arguments(e)})"
            return self.code(ir.Binary("//", e.args[0], e.args[1]))
        if e.function == "size_limit":  # a module checks it (`_size_limit`); explain not
            return f"_size_limit({self.arguments(e)})" if self.in_module else self.code(e.args[0])
        if e.function == "same_size":  # alike (`_same_size`)
            return f"_same_size({self.arguments(e)})" if self.in_module else self.code(e.args[0])
        if e.function == "shift":  # a module skips adding the Python int 0 (`_shift`)
            x, start = e.args
            if self.in_module:
                return f"_shift({self.arguments(e)})"
            return self.code(ir.Binary("+", start, x))
        if self.in_module and e.function in EXTREMA:
            whole = replace(e, args=(ir.Call("whole", e.args[:1]), *e.args[1:]))
            return f"{NAMES[e.function]}({self.arguments(whole)})"
        if e.function in ("gelu", "gelu_tanh"):
            return self.gelu(e)
        if e.function == "dropped_id":  # unsorted_segment_sum drops negative ids
            return "-1"
        if e.function == "segment_sum_in":
            return self.call(replace(e, function="segment_sum"))
        if self.in_module and e.function in KERNELS:
            # The module's helper: zeros, never the kernel, when an axis is empty.
            helper, *kernel = KERNELS[e.function]
            return f"{helper}({', '.join([*kernel, self.arguments(e)])})"
        return f"{NAMES[e.function]}({self.arguments(e)})"

    def gelu(self, e: ir.Call) -> str:
        """GELU written out: `tf.nn.gelu` casts its constants through float32 (1e-8 off in
        float64). Its argument is printed twice (three times in the tanh form)."""
        arg = e.args[0]
        x = self.code(arg) if precedence(arg) >= ATOM else f"({self.code(arg)})"
        if e.function == "gelu":
            return f"0.5 * {x} * tf.math.erfc(-0.7071067811865476 * {x})"
        return f"0.5 * {x} * (1 + tf.tanh(0.7978845608028654 * ({x} + 0.044715 * {x} ** 3)))"

    def view(self, e: ir.View) -> str:
        inner = self.code(e.operand)
        if e.perm is not None:
            inner = f"tf.transpose({inner}, {list(e.perm)})"
        # New axes by tf.expand_dims, left to right: in eager mode `x[:, tf.newaxis]`
        # costs several times as much (it builds begin/end/stride tensors each call).
        kept = [n for n, slot in enumerate(e.slots) if slot is not None]
        for position, slot in enumerate(e.slots):
            if slot is None:
                # New trailing axes counted from the end: right at any rank (a mask that
                # broadcasts over leading axes, `gather_plan`'s `outside`).
                at = -1 if not kept or position > kept[-1] else position
                inner = f"tf.expand_dims({inner}, {at})"
        if e.perm is None and None not in e.slots and precedence(e.operand) < ATOM:
            inner = f"({inner})"  # nothing to do; never made by `lower.align`
        return inner

"""JAX: the neutral ops (TensorFlow's semantics) spelled with `jax.numpy`, `jax.lax`,
`jax.nn` and `jax.ops`.

Shapes are static in JAX, so sizes are Python ints (`x.shape[k]`) and integer arithmetic
on them stays Python (`max`, not `jnp.maximum`): a traced size could not shape a pad or a
slice under `jax.jit`. No `ir.Cond` reaches this printer (`branches = False`): `render`
replaces each by its `otherwise` branch, which equals the fast `then` branch whenever the
predicate holds (`ir.without_conds`); a `kept` one (its `otherwise` costly and rare) is
`jax.lax.cond`. A few ops whose TensorFlow meaning JAX has
no single function for print calls to small helpers the template defines
(`_segment_sum`, `_exclusive_cumsum`, `_conv_backprop_filter`, `_conv_backprop_input`,
`_slice`).
"""

from __future__ import annotations

import ast

from .. import ir
from .printer import ATOM, Printer, is_integer, precedence

NAMES = {
    "abs": "jnp.abs",
    "broadcast_to": "jnp.broadcast_to",
    "concat": "jnp.concatenate",
    "cos": "jnp.cos",
    "cosh": "jnp.cosh",
    "cumsum": "jnp.cumsum",
    "erf": "jax.lax.erf",
    "exp": "jnp.exp",
    "eye": "jnp.eye",
    "is_finite": "jnp.isfinite",
    "is_nan": "jnp.isnan",
    "log": "jnp.log",
    "log_softmax": "jax.nn.log_softmax",
    "logical_and": "jnp.logical_and",
    "logical_not": "jnp.logical_not",
    "logical_or": "jnp.logical_or",
    "maximum": "jnp.maximum",
    "minimum": "jnp.minimum",
    "pad": "jnp.pad",
    "range": "jnp.arange",
    "reduce_all": "jnp.all",
    "reduce_logsumexp": "jax.nn.logsumexp",
    "reduce_max": "jnp.max",
    "reduce_mean": "jnp.mean",
    "reduce_min": "jnp.min",
    "reduce_sum": "jnp.sum",
    "reshape": "jnp.reshape",
    "rsqrt": "jax.lax.rsqrt",
    "segment_max": "_segment_max",  # -inf where no row (jax.ops.segment_max)
    "segment_min": "_segment_min",  # +inf where no row (jax.ops.segment_min)
    "segment_sum": "_segment_sum",  # ids of any rank (jax.ops.segment_sum takes 1-D)
    "sigmoid": "jax.nn.sigmoid",
    "sign": "jnp.sign",
    "sin": "jnp.sin",
    "sinh": "jnp.sinh",
    "softmax": "jax.nn.softmax",
    "softplus": "jax.nn.softplus",
    "silu": "jax.nn.silu",
    "elu": "jax.nn.elu",
    "relu": "jax.nn.relu",
    "sqrt": "jnp.sqrt",
    "square": "jnp.square",
    "squeeze": "jnp.squeeze",
    "tan": "jnp.tan",
    "floor": "jnp.floor",
    "tanh": "jnp.tanh",
    "tile": "jnp.tile",
    "broadcast_tile": "jnp.tile",
    "transpose": "jnp.transpose",
    "where": "jnp.where",
    "select": "jnp.where",
    "zeros": "jnp.zeros",
    "zeros_like": "jnp.zeros_like",
    # helpers of the template (TF's backprop kernels as explicit convolutions)
    "conv2d_backprop_filter": "_conv_backprop_filter",
    "conv2d_backprop_input": "_conv_backprop_input",
    "conv3d_backprop_filter": "_conv_backprop_filter",
    "conv3d_backprop_input": "_conv_backprop_input",
    # a depthwise window as a sum of its taps' shifted slices (the template's helpers)
    "depthwise_conv2d": "_depthwise_conv2d",
    "depthwise_conv2d_backprop_filter": "_depthwise_backprop_filter",
    "depthwise_conv2d_backprop_input": "_depthwise_backprop_input",
    "conv_padding": "_conv_padding",
    "conv_window": "_conv_window",
    "conv_unwindow": "_conv_unwindow",
    "band_scores": "_band_scores",
    "band_apply": "_band_apply",
    "band_scatter": "_band_scatter",
    "fit": "_fit",
}

# tf.nn.convolution's layouts (channels last) by the number of spatial axes.
LAYOUTS = {
    1: ("NWC", "WIO", "NWC"),
    2: ("NHWC", "HWIO", "NHWC"),
    3: ("NDHWC", "DHWIO", "NDHWC"),
}


def contraction_path(subscripts: str) -> list[tuple[int, ...]]:
    """An explicit pairwise contraction order for `jnp.einsum(optimize=...)`: with three
    or more operands, greedily the pair whose result keeps the fewest indices (sizes are
    not known when printing), in opt_einsum's convention (the result goes last)."""
    inputs, output = subscripts.split("->")
    operands = [set(term) for term in inputs.split(",")]
    if len(operands) == 1:
        return [(0,)]
    path = []
    while len(operands) > 1:
        best = None
        for i in range(len(operands)):
            for j in range(i + 1, len(operands)):
                others = set(output).union(*(t for k, t in enumerate(operands) if k not in (i, j)))
                kept = (operands[i] | operands[j]) & others
                if best is None or len(kept) < len(best[2]):
                    best = (i, j, kept)
        i, j, kept = best
        path.append((i, j))
        operands = [t for k, t in enumerate(operands) if k not in (i, j)] + [kept]
    return path


class JaxPrinter(Printer):
    branches = False  # `jax.lax.cond` would run under `vmap` as a select of both branches
    # Chunks run as `jax.lax.scan`, one compiled XLA loop: what no chunk changes is left
    # to XLA's own while-loop invariant code motion (`Printer.hoists`).
    hoists = False
    # A `kept` Cond (the others are gone, `ir.without_conds`): jit and grad keep it as one
    # branch (under vmap both run, as a select).
    cond_function = "jax.lax.cond"

    def axis_size(self, e: ir.AxisSize) -> str:
        return f"{e.tensor}.shape[{e.axis}]"

    def float_size(self, e: ir.FloatSize) -> str:
        return f"jnp.asarray({e.size}, dtype)"

    def einsum(self, e: ir.Einsum) -> str:
        operands = ", ".join(self.code(o) for o in e.operands)
        path = contraction_path(e.subscripts)
        return f'jnp.einsum("{e.subscripts}", {operands}, optimize={path})'

    def view(self, e: ir.View) -> str:
        inner = self.code(e.operand)
        if e.perm is not None:
            inner = f"jnp.transpose({inner}, {tuple(e.perm)})"
        elif precedence(e.operand) < ATOM:
            inner = f"({inner})"
        if None not in e.slots:
            return inner
        index = ["None" if slot is None else ":" for slot in e.slots]
        first_new = index.index("None")
        if first_new > 0 and all(item == "None" for item in index[first_new:]):
            index = ["...", *index[first_new:]]  # new trailing axes: right at any rank
        while index[-1] == ":":  # x[:, None] leaves the axes after the last new one
            index.pop()
        return f"{inner}[{', '.join(index)}]"

    def keyword(self, name: str, value: ir.Expr) -> str:
        # JAX reduces over a tuple of axes, not a list.
        if name == "axis" and isinstance(value, ir.Lit) and value.text.startswith("["):
            axes = tuple(ast.literal_eval(value.text))
            return f"axis={axes[0] if len(axes) == 1 else axes}"
        return f"{name}={self.code(value)}"

    def arguments(self, e: ir.Call) -> str:
        parts = [self.code(a) for a in e.args] + [self.keyword(k, v) for k, v in e.keywords]
        return ", ".join(parts)

    def call(self, e: ir.Call) -> str:
        spell = getattr(self, f"call_{e.function}", None)
        if spell is not None:
            return spell(e)
        return f"{NAMES[e.function]}({self.arguments(e)})"

    # -- one method per op whose spelling is more than a name ---------------------------

    def call_reduce_min(self, e: ir.Call) -> str:
        # +inf over an empty axis, as TensorFlow's reduce_min (jnp.min raises there).
        return f"jnp.min({self.arguments(e)}, initial=jnp.inf)"

    def call_reduce_max(self, e: ir.Call) -> str:
        return f"jnp.max({self.arguments(e)}, initial=-jnp.inf)"

    def call_tie_hits(self, e: ir.Call) -> str:  # ties.tie_test: the template's helper
        return f"_tie_hits({self.arguments(e)})"

    def call_gelu(self, e: ir.Call) -> str:  # jax.nn.gelu is the tanh form by default
        return f"jax.nn.gelu({self.arguments(e)}, approximate=False)"

    def call_gelu_tanh(self, e: ir.Call) -> str:
        return f"jax.nn.gelu({self.arguments(e)}, approximate=True)"

    def call_exact_div(self, e: ir.Call) -> str:
        return f"_exact_div({self.arguments(e)})"

    def call_size_limit(self, e: ir.Call) -> str:
        return f"_size_limit({self.arguments(e)})"

    def call_same_size(self, e: ir.Call) -> str:
        return f"_same_size({self.arguments(e)})"

    def call_shift(self, e: ir.Call) -> str:
        return f"_shift({self.arguments(e)})"

    def call_cast(self, e: ir.Call) -> str:
        return f"jnp.asarray({self.arguments(e)})"

    def call_to_int64(self, e: ir.Call) -> str:
        if is_integer(e):  # a Python int cannot wrap around, and stays static under jit
            (size,) = e.args
            return self.code(size) if precedence(size) == ATOM else f"({self.code(size)})"
        # `int` is JAX's widest enabled integer: int64 under jax_enable_x64, otherwise
        # int32 (JAX has no int64 then; asking for jnp.int64 would warn on every call).
        return f"jnp.asarray({self.arguments(e)}, int)"

    def call_floor_position(self, e: ir.Call) -> str:
        # XLA casts NaN to 0: a NaN position would read (and scatter its gradient into)
        # row 0. As -inf it casts to the least integer, outside like every position past
        # the borders (its neighbour + 1 too), as TF and PyTorch print it (their casts
        # of NaN give that value on CPU, but 0 on CUDA).
        code = self.code(e.args[0])
        return f"jnp.asarray(jnp.where(jnp.isnan({code}), -jnp.inf, {code}), int)"

    def call_maximum(self, e: ir.Call) -> str:
        if is_integer(e):
            return f"max({self.arguments(e)})"
        return f"jnp.maximum({self.arguments(e)})"

    def call_minimum(self, e: ir.Call) -> str:
        if is_integer(e):
            return f"min({self.arguments(e)})"
        return f"jnp.minimum({self.arguments(e)})"

    def call_gather(self, e: ir.Call) -> str:
        # The module's `_gather`: jnp.take, never from an empty axis.
        return f"_gather({self.arguments(e)})"

    def call_segment_sum_in(self, e: ir.Call) -> str:
        return f"_segment_sum({self.arguments(e)})"  # drops the id -1 (`dropped_id`)

    def call_dropped_id(self, e: ir.Call) -> str:
        return "-1"

    def call_sparse_rows(self, e: ir.Call) -> str:
        # A gradient given as rows (tf.IndexedSlices) is dense in JAX: the rows added up.
        if len(e.args) != 3:
            return f"jax.ops.segment_sum({self.arguments(e)})"
        values, rows = self.code(e.args[0]), self.code(e.args[1])
        shape = e.args[2]
        if isinstance(shape, ir.Call) and shape.function == "shape" and len(shape.args) == 1:
            count = f"{self.code(shape.args[0])}.shape[0]"  # `W.shape[0]`, not jnp.shape(W)
            if precedence(shape.args[0]) < ATOM:
                count = f"({self.code(shape.args[0])}).shape[0]"
        else:
            count = f"{self.code(shape)}[0]"
            if precedence(shape) < ATOM:
                count = f"({self.code(shape)})[0]"
        return f"jax.ops.segment_sum({values}, {rows}, num_segments={count})"

    def call_shape(self, e: ir.Call) -> str:
        if len(e.args) != 1:
            return f"jnp.shape({self.arguments(e)})"
        (operand,) = e.args
        inner = self.code(operand)
        return f"{inner}.shape" if precedence(operand) == ATOM else f"({inner}).shape"

    def call_slice(self, e: ir.Call) -> str:
        if len(e.args) != 3 or not all(isinstance(a, ir.List) for a in e.args[1:]):
            return f"_slice({self.arguments(e)})"
        operand, begin, size = e.args
        inner = self.code(operand)
        if precedence(operand) < ATOM:
            inner = f"({inner})"
        index = []
        for start, length in zip(begin.items, size.items, strict=True):
            low = "" if start == ir.Lit("0") else self.code(start)
            if length == ir.Lit("-1"):
                high = ""
            elif start == ir.Lit("0"):
                high = self.code(length)
            else:
                high = self.code(ir.Binary("+", start, length))
            index.append(f"{low}:{high}")
        while len(index) > 1 and index[-1] == ":":
            index.pop()
        return f"{inner}[{', '.join(index)}]"

    def call_cumsum(self, e: ir.Call) -> str:
        options = dict(e.keywords)
        exclusive = options.pop("exclusive", None) == ir.Lit("True")
        reverse = options.pop("reverse", None) == ir.Lit("True")
        parts = [self.code(a) for a in e.args] + [self.keyword(k, v) for k, v in options.items()]
        if reverse:
            parts.append("reverse=True")
        if exclusive:
            function = "_exclusive_cumsum"
        else:
            function = "jax.lax.cumsum" if reverse else "jnp.cumsum"
        return f"{function}({', '.join(parts)})"

    def call_convolution(self, e: ir.Call) -> str:
        """tf.nn.convolution (channels last, strides per spatial axis) as
        lax.conv_general_dilated."""
        options = dict(e.keywords)
        strides = options.pop("strides", None)
        spatial = len(strides.items) if isinstance(strides, ir.List) else 2
        parts = [self.code(a) for a in e.args]
        if strides is not None:
            parts.append(f"window_strides={self.code(strides)}")
        parts += [self.keyword(k, v) for k, v in options.items()]
        parts.append(f"dimension_numbers={LAYOUTS[spatial]}")
        # The module's `_convolution`: lax.conv_general_dilated, never on an empty axis.
        return f"_convolution({', '.join(parts)})"

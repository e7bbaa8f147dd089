"""PyTorch: the neutral ops (whose semantics are TensorFlow's) spelled with torch ops.

Most ops map one to one (`tf.reduce_sum(x, axis=[1])` is `torch.sum(x, dim=[1])`); the
rest are spelled from what the IR says statically:

- Sizes are Python ints (`x.shape[k]`), so size arithmetic (`maximum` of sizes) is
  Python's `max`, and `to_int64` of a size is the size itself.
- Layout ops with literal arguments become indexing: `slice` is `x[:, 1:1 + n]`, a new
  axis is `x[:, None]`, `pad` is `torch.nn.functional.pad` with its pairs reversed.
- Convolutions are NHWC in the IR: torch's NCHW kernels between `movedim`s; the
  backprop kernels are `torch.nn.grad.conv{2,3}d_weight` / `_input` (module helpers).
- `gather`, `segment_sum` and `cumsum` with `exclusive`/`reverse` are small module
  helpers (`_gather`, `_segment_sum`, `_cumsum`); `sparse_rows` is a dense scatter-add
  (`index_add`), since torch autograd wants dense gradients.
- No `ir.Cond` but a `kept` one reaches this printer (`branches = False`): `render`
  replaces each by its `otherwise` branch, equal to `then` whenever the predicate holds,
  and drops the predicate's steps (`ir.without_conds`); data-dependent Python control
  flow would break `torch.compile(fullgraph=True)`. A `kept` one (its `otherwise` costly
  and rare) is the module's `_cond`: `torch.cond` when compiled, a Python `if` eagerly.

A function body (`code(block, module, kind)`) is printed here, not in the template:
which steps and prelude lines (`dtype`, sizes, attrs, `_device`) are read is known only
once the expressions are printed, and generated code must be free of unused variables.
"""

from __future__ import annotations

import ast

from .. import ir
from . import torch_overwrite, torch_release, torch_shared
from .printer import ATOM, PRECEDENCE, Printer, precedence

# Elementwise ops on tensors, and reductions (axis= -> dim=, keepdims= -> keepdim=).
ELEMENTWISE = {
    "abs": "torch.abs",
    "cos": "torch.cos",
    "cosh": "torch.cosh",
    "erf": "torch.erf",
    "exp": "torch.exp",
    "is_finite": "torch.isfinite",
    "is_nan": "torch.isnan",
    "log": "torch.log",
    "logical_and": "torch.logical_and",
    "logical_not": "torch.logical_not",
    "logical_or": "torch.logical_or",
    "rsqrt": "torch.rsqrt",
    "sigmoid": "torch.sigmoid",
    "sign": "torch.sign",
    "sin": "torch.sin",
    "sinh": "torch.sinh",
    "softplus": "torch.nn.functional.softplus",
    "silu": "torch.nn.functional.silu",
    "gelu": "torch.nn.functional.gelu",  # approximate="none" by default: the exact form
    "elu": "torch.nn.functional.elu",
    "relu": "torch.relu",
    "sqrt": "torch.sqrt",
    "square": "torch.square",
    "tan": "torch.tan",
    "floor": "torch.floor",
    "tanh": "torch.tanh",
    "zeros_like": "torch.zeros_like",
}
# Options after the operands. softplus: torch returns x itself above its threshold of 20,
# 2e-9 short of log(1 + e^x) (1e-10 relative at 20, more in a difference like softplus(x) - x);
# e^40 is still finite in float32 and log1p(e^-40) is below float64's rounding of 40.
ELEMENTWISE_OPTIONS = {"softplus": ", threshold=40.0"}
REDUCTIONS = {
    "log_softmax": "torch.log_softmax",
    "reduce_all": "torch.all",
    "reduce_logsumexp": "torch.logsumexp",
    "reduce_max": "torch.amax",
    "reduce_mean": "torch.mean",
    "reduce_min": "torch.amin",
    "reduce_sum": "torch.sum",
    "softmax": "torch.softmax",
}
# A comparison cast to numbers is one torch call writing into a tensor of that dtype.
COMPARISONS = {
    "==": "torch.eq",
    "!=": "torch.ne",
    "<": "torch.lt",
    "<=": "torch.le",
    ">": "torch.gt",
    ">=": "torch.ge",
}
# Logic between Python bools (a constant position tested against a size): Python's own
# operators, one `torch.full` where a tensor is needed, not a tensor per operand and a
# torch call per operator.
LOGIC = {"logical_and": "({} and {})", "logical_or": "({} or {})", "logical_not": "(not {})"}
# The template's own helpers (`_conv_window`, `_band_scores`, ..), called with the
# operands as lowering gives them.
HELPERS = frozenset(
    {
        "conv_padding",
        "conv_window",
        "conv_unwindow",
        "band_scores",
        "band_apply",
        "band_scatter",
    }
)
# Each op's parameter names in TF's order (the IR passes some by position, some by name).
PARAMETERS = {
    "broadcast_to": ("x", "shape"),
    "cast": ("x", "dtype"),
    "concat": ("values", "axis"),
    "conv2d_backprop_filter": ("input", "filter_sizes", "out_backprop", "strides", "padding"),
    "conv3d_backprop_filter": ("input", "filter_sizes", "out_backprop", "strides", "padding"),
    "conv2d_backprop_input": ("input_sizes", "filter", "out_backprop", "strides", "padding"),
    "conv3d_backprop_input": ("input_sizes", "filter", "out_backprop", "strides", "padding"),
    "convolution": ("x", "filters", "strides", "padding"),
    "depthwise_conv2d": ("input", "filter", "strides", "padding"),
    "depthwise_conv2d_backprop_filter": (
        "input",
        "filter_sizes",
        "out_backprop",
        "strides",
        "padding",
    ),
    "depthwise_conv2d_backprop_input": (
        "input_sizes",
        "filter",
        "out_backprop",
        "strides",
        "padding",
    ),
    "conv_padding": ("axes",),
    "conv_window": ("x", "axes"),
    "conv_unwindow": ("g", "axes"),
    "band_scores": ("o", "s", "offset", "count", "shift", "spread", "dilation"),
    "band_apply": ("p", "s", "offset", "shift", "spread", "dilation"),
    "band_scatter": ("p", "o", "offset", "m", "shift", "spread", "dilation"),
    "cumsum": ("x", "axis", "exclusive", "reverse"),
    "eye": ("n", "dtype"),
    "gelu_tanh": ("x",),
    "fit": ("x", "axis", "n"),
    "gather": ("x", "positions", "axis"),
    "pad": ("x", "paddings"),
    "range": ("n",),
    "reshape": ("x", "shape"),
    "segment_sum": ("data", "ids", "n"),
    "segment_sum_in": ("data", "ids", "n"),
    "dropped_id": ("n",),
    "segment_max": ("data", "ids", "n"),
    "segment_min": ("data", "ids", "n"),
    "shape": ("x",),
    "size_limit": ("n", "where", "others"),
    "same_size": ("n", "other", "where"),
    "shift": ("x", "start"),
    "exact_div": ("n", "d", "where"),
    "slice": ("x", "begin", "size"),
    "sparse_rows": ("values", "rows", "shape"),
    "squeeze": ("x", "axis"),
    "tile": ("x", "multiples"),
    "broadcast_tile": ("x", "multiples"),
    "to_int64": ("x",),
    "floor_position": ("x",),
    "transpose": ("x", "perm"),
    "where": ("condition", "x", "y"),
    "select": ("condition", "x", "y"),
    "zeros": ("shape", "dtype"),
    "maximum": ("x", "y"),
    "minimum": ("x", "y"),
    **{name: ("x", "axis", "keepdims") for name in REDUCTIONS},
}
# Parameters an op may leave out (TF's defaults apply); every other one must be given.
OPTIONAL = {"axis", "keepdims", "exclusive", "reverse", "padding"}
SIZE_PREFIXES = ("_n_", "_int_")  # sizes and int attrs in index arithmetic: Python ints


def _infinity(numerator: str) -> str:
    """What Python numbers' `numerator / 0` gives as a tensor's division would: `inf`
    (`float('inf')` alone for a mean's 1 / n, minus it for -1), nan for 0."""
    if numerator in ("1", "1.0"):
        return "float('inf')"
    if numerator in ("-1", "-1.0", "(-1)"):
        return "-float('inf')"
    return f"{numerator} * float('inf')"


def _concat(e: ir.Expr) -> bool:
    """Whether `e` is a concatenation along axis 0 (of merged scatters' rows or ids)."""
    return (
        isinstance(e, ir.Call)
        and e.function == "concat"
        and isinstance(e.args[0], ir.List)
        and dict(e.keywords).get("axis") == ir.Lit("0")
    )


def is_python(e: ir.Expr, names: frozenset[str] = frozenset()) -> bool:
    """Whether `e` is a Python number in the generated code (a size, an int attr in index
    arithmetic, a literal, or one of `names`: steps bound to such a number), not a
    tensor."""
    if isinstance(e, ir.Lit | ir.AxisSize | ir.FloatSize):
        return True
    if isinstance(e, ir.Var):
        return e.name.startswith(SIZE_PREFIXES) or e.name in names
    if isinstance(e, ir.Binary):
        return is_python(e.left, names) and is_python(e.right, names)
    if isinstance(e, ir.Negate):
        return is_python(e.operand, names)
    if isinstance(e, ir.Call) and e.function in ("maximum", "minimum", "to_int64", *LOGIC):
        return all(is_python(a, names) for a in e.args)
    if isinstance(e, ir.Call) and e.function == "size_limit":
        return is_python(e.args[0], names)
    if isinstance(e, ir.Call) and e.function == "same_size":
        return is_python(e.args[0], names) and is_python(e.args[1], names)
    if isinstance(e, ir.Call) and e.function == "shift":
        return all(is_python(a, names) for a in e.args)
    if isinstance(e, ir.Whole):
        return is_python(e.whole, names) and is_python(e.part, names)
    if isinstance(e, ir.Call) and e.function == "exact_div":
        return is_python(e.args[0], names) and is_python(e.args[1], names)
    return False


def _is_bool(e: ir.Expr, names: frozenset[str] = frozenset()) -> bool:
    """Whether a Python value is a bool: a comparison or logic between Python values, or
    one of `names` (steps bound to such a bool)."""
    if isinstance(e, ir.Var):
        return e.name in names
    if isinstance(e, ir.Binary):
        return e.op in COMPARISONS
    return isinstance(e, ir.Call) and e.function in LOGIC


def _literal_list(e: ir.Expr | None) -> list[ir.Expr] | None:
    return list(e.items) if isinstance(e, ir.List) else None


class PyTorchPrinter(Printer):
    branches = False  # data-dependent Python control flow breaks torch.compile(fullgraph)
    hoists = True  # a Python loop of eager ops: each chunk dispatches every op again

    # A `kept` Cond (the others are gone, `ir.without_conds`) is the module's `_cond`, one
    # branch run: `torch.cond` under torch.compile (fullgraph=True traces it; the branches
    # close over the tensors they read), a Python `if` eagerly.
    cond_function = "_cond"

    # Steps of the body being printed that hold a Python number (a literal position, as in
    # `W[b, 1]`): torch ops get them as tensors, like sizes.
    python_names: frozenset[str] = frozenset()
    bool_names: frozenset[str] = frozenset()  # those of them that hold a bool
    # While a body's steps are printed: the names the step may write over, and whether
    # fresh sub-expressions may be written over (`torch_overwrite`).
    owned: frozenset[str] = frozenset()
    overwrite_on = False
    unguarded = False  # while a guarded division prints its own operands

    def is_python(self, e: ir.Expr) -> bool:
        return is_python(e, self.python_names)

    # -- function bodies ----------------------------------------------------------------

    def body(
        self, block: ir.Block, m: ir.Module, kind: str, raw: tuple[str, ...] = (), once=None
    ) -> str:
        """The statements of `_compute` (kind "forward"), `_recompute`, `_backward` or a
        tiling's size block ("sizes"), indented, without the steps and prelude lines
        nothing reads. Int attrs in `raw` (a chunk's position in the loop) are taken as
        they come, unchecked. `once`, (`tile_hoist.Hoist`, the call computing its names):
        its invariant steps are not printed, their values come as `_once` (else from the
        call), before anything else."""
        skip: frozenset[str] = frozenset()
        if once is not None:
            block, skip = once[0].block, once[0].once
        roots = {
            "forward": (*m.outputs, *m.saved),
            "recompute": m.saved,
            "backward": tuple(r for r in block.returns if r),
            "sizes": tuple(r for r in block.returns if r),
            "once": tuple(r for r in block.returns if r),
        }[kind]
        numbers: set[str] = set()
        bools: set[str] = set()
        for step in block.steps:
            if is_python(step.value, frozenset(numbers)):
                numbers.add(step.target)
                if _is_bool(step.value, frozenset(bools)):
                    bools.add(step.target)
        self.python_names = frozenset(numbers)
        self.bool_names = frozenset(bools)
        if self.in_module and kind in ("forward", "recompute", "backward"):
            block = torch_shared.shared_once(block, roots, skip, self.is_python)
        live = set(roots)
        kept: list[tuple[ir.Assign, str]] = []
        for step in reversed(block.steps):
            if step.target not in live or step.target in skip:
                continue
            text = self.code(step.value)
            live.discard(step.target)
            live |= _names_read(text)
            kept.append((step, text))
        kept.reverse()
        given = live & skip  # read of what `_once` gives (the rest is not made again)
        live -= skip
        if self.in_module and kind != "sizes":
            backward = kind == "backward"
            kept = self.overwriting(kept, block.returns if backward else roots, backward)
        reference = m.value_inputs[0]
        lines = []
        if once is not None:
            names = [n if n in given else "_" for n in once[0].names]
            unpacked = ", ".join(names) + ("," if len(names) == 1 else "")
            lines.append(f"({unpacked}) = _once if _once is not None else {once[1]}")
        if kind == "backward" and len(m.grads) > 1:
            # An output nothing downstream reads may come without a gradient.
            for grad, output in zip(m.grads, m.outputs, strict=True):
                if grad in live:
                    lines.append(
                        f"{grad} = torch.zeros_like({output}) if {grad} is None else {grad}"
                    )
        for attr in m.attrs:
            if f"_int_{attr.name}" in live and attr.name in raw:
                lines.append(f"_int_{attr.name} = {attr.name}  # a position in the loop")
            elif f"_int_{attr.name}" in live:
                lines.append(f"_int_{attr.name} = _int_attr({attr.name!r}, {attr.name})")
                if attr.name in m.positive_attrs:
                    lines += [
                        f"if _int_{attr.name} <= 0:",
                        (
                            f'    raise ValueError(f"{{OP_NAME}}: attr {attr.name} is '
                            f"{{{attr.name}}}; it scales an index or divides a range, and "
                            'must be positive")'
                        ),
                    ]
        for attr in m.attrs:
            if attr.name in live:  # a value in the formula: a tensor of the inputs' dtype
                lines.append(
                    f"{attr.name} = torch.as_tensor({attr.name}, dtype={reference}.dtype, "
                    f"device={reference}.device)"
                )
        # Read but not defined by a step (a Python number made a tensor, say): from the
        # first value input, like the attrs.
        if "dtype" in live:
            lines.append(f"dtype = {reference}.dtype")
        if "_device" in live:
            lines.append(f"_device = {reference}.device")
        if kind == "backward":
            numbers = self.python_names if self.in_module else None
            lines += _only_if_needed(kept, block.returns, numbers)
        else:
            for step, text in kept:
                lines += _statement(step, text)
        return "".join(f"    {line}\n" for line in lines)

    def overwriting(self, kept: list, returns, backward: bool) -> list:
        """`kept` with each step that may write over a dead temporary printed so
        (`torch_overwrite`), judged in the order the body is printed."""
        order = [i for _, items in _groups(kept, returns)[0] for i in items] if backward else kept
        reads = {step.target: _names_list(text) for step, text in order}
        keep = {name for name in returns if name}
        owned = torch_overwrite.overwritable(
            [step for step, _ in order], reads, keep, self.is_python
        )
        texts = {}
        self.overwrite_on = True
        for (step, _), names in zip(order, owned, strict=True):
            self.owned = frozenset(names)
            texts[step.target] = self.code(step.value)
        self.owned, self.overwrite_on = frozenset(), False
        return [(step, texts[step.target]) for step, _ in kept]

    def code(self, e, module: ir.Module | None = None, kind: str = "", raw=(), once=None) -> str:
        if isinstance(e, ir.Block):
            return self.body(e, module, kind, tuple(raw), once)
        if self.overwrite_on and isinstance(e, ir.Binary | ir.Negate | ir.Call):
            spelled = torch_overwrite.spell(e, self, self.owned)
            if spelled is not None:
                return spelled
        return Printer.code(self, e)

    # -- expressions ----------------------------------------------------------------------

    def atom(self, e: ir.Expr) -> str:
        """`e` where an attribute or a subscript follows it."""
        text = self.code(e)
        return text if precedence(e) >= ATOM else f"({text})"

    def tensor(self, e: ir.Expr, dtype: bool = True) -> str:
        """`e` where torch wants a tensor: a Python number becomes one."""
        if not self.is_python(e):
            return self.code(e)
        keywords = ", dtype=dtype" if dtype else ""
        return f"torch.as_tensor({self.code(e)}{keywords}, device=_device)"

    def scalar(self, e: ir.Expr) -> str | None:
        """A Python number where torch takes a scalar: a literal, a size, or a literal
        cast to the computation dtype; None for a tensor."""
        if isinstance(e, ir.Call) and e.function == "cast" and self.is_python(e.args[0]):
            return self.code(e.args[0])
        if isinstance(e, ir.Call) and e.function == "zeros" and e.args == (ir.Lit("[]"),):
            return "0"
        if self.is_python(e):
            return self.code(e)
        return None

    def binary(self, e: ir.Binary) -> str:
        cast = isinstance(e.right, ir.Call) and e.right.function == "cast"
        number = self.scalar(e.right) if e.op == "/" and cast else None
        if number is not None and not self.is_python(e.left):
            # A tensor over a number cast to the dtype (a mean's count): the number as it
            # is, not a tensor made on every call.
            left = self.code(e.left)
            left = left if precedence(e.left) >= PRECEDENCE["/"] else f"({left})"
            return f"{left} / {number}"
        if e.op != "/" or self.unguarded or not self.is_python(e):
            return super().binary(e)
        # Python numbers over sizes that may be 0 (a mean's 1 / n over an empty axis):
        # +-inf or nan as a tensor's division gives, where Python raises. One guard for
        # a chain `a / n / m`.
        chain, divisors = e, []
        while isinstance(chain, ir.Binary) and chain.op == "/":
            chain, divisors = chain.left, [chain.right, *divisors]
        self.unguarded = True
        try:
            text, first = super().binary(e), self.atom(chain)
            tests = [self.code(d) for d in divisors if not isinstance(d, ir.Lit)]
        finally:
            self.unguarded = False
        if not tests:
            return text
        return f"({text} if {' and '.join(dict.fromkeys(tests))} else {_infinity(first)})"

    def axis_size(self, e: ir.AxisSize) -> str:
        return f"{e.tensor}.shape[{e.axis}]"

    def float_size(self, e: ir.FloatSize) -> str:
        return f"float({e.size})"

    def einsum(self, e: ir.Einsum) -> str:
        operands = ", ".join(self.tensor(o) for o in e.operands)
        if self.in_module and len(e.operands) == 2 and "." not in e.subscripts:
            # A module helper: the output's small axes first (see `_einsum`).
            return f'_einsum("{e.subscripts}", {operands})'
        return f'torch.einsum("{e.subscripts}", {operands})'

    def view(self, e: ir.View) -> str:
        if e.perm is None and None not in e.slots:
            return self.code(e.operand)  # nothing to do; never made by `lower.align`
        inner = self.atom(e.operand)
        if e.perm is not None:
            inner = f"{inner}.permute({', '.join(map(str, e.perm))})"
        if None not in e.slots:
            return inner
        items = ["None" if slot is None else ":" for slot in e.slots]
        first_new = items.index("None")
        if all(item == "None" for item in items[first_new:]) and first_new > 0:
            items = ["...", *items[first_new:]]  # new trailing axes: x[..., None]
        while items[-1] == ":":
            items.pop()
        return f"{inner}[{', '.join(items)}]"

    def call(self, e: ir.Call) -> str:
        args = dict(zip(PARAMETERS.get(e.function, ()), e.args))
        args.update(e.keywords)
        name = e.function
        if name == "tie_hits":  # `value == extremum` (ties.tie_test)
            return f"({self.code(ir.Binary('==', *e.args))})"
        if name in LOGIC and all(self.is_python(a) for a in e.args):
            return LOGIC[name].format(*(self.code(a) for a in e.args))
        if name in ELEMENTWISE:
            operands = ", ".join(
                self.tensor(a, dtype=not name.startswith("logical")) for a in e.args
            )
            return f"{ELEMENTWISE[name]}({operands}{ELEMENTWISE_OPTIONS.get(name, '')})"
        if name in REDUCTIONS:
            return self.reduction(name, args)
        if name in HELPERS:
            return f"_{name}({self.arguments(e)})"
        method = getattr(self, f"call_{name}", None)
        if method is None:
            raise NotImplementedError(f"no PyTorch spelling for the neutral op {name!r}")
        if any(p not in args for p in PARAMETERS[name] if p not in OPTIONAL):
            # Not a call lowering makes: spelled as it came, TF-style, after an underscore.
            return f"_{name}({self.arguments(e)})"
        return method(args)

    def reduction(self, name: str, args: dict) -> str:
        x = self.code(args["x"])
        axis = args.get("axis")
        if isinstance(axis, ir.Lit) and axis.text == "[]":  # TF: nothing to reduce
            return x
        if axis is None and name == "reduce_logsumexp":  # over every axis
            return f"torch.logsumexp({self.atom(args['x'])}.flatten(), dim=0)"
        parts = [x]
        if axis is not None:
            parts.append(f"dim={self.code(axis)}")
        keepdims = args.get("keepdims")
        if keepdims is not None and name not in ("softmax", "log_softmax"):
            parts.append(f"keepdim={self.code(keepdims)}")
        if name in ("softmax", "log_softmax") and axis is None:
            parts.append("dim=-1")
        if self.in_module and name in ("reduce_min", "reduce_max"):
            # A module helper: +inf or -inf over an empty axis, where torch raises.
            return f"_extremum({REDUCTIONS[name]}, {', '.join(parts)})"
        return f"{REDUCTIONS[name]}({', '.join(parts)})"

    # -- one method per op that is not a plain rename --------------------------------------

    def call_maximum(self, args: dict) -> str:
        return self.extremum(args, "max", "torch.maximum", "torch.clamp_min")

    def call_minimum(self, args: dict) -> str:
        return self.extremum(args, "min", "torch.minimum", "torch.clamp_max")

    def extremum(self, args: dict, python: str, both: str, clamp: str) -> str:
        x, y = args["x"], args["y"]
        if self.is_python(x) and self.is_python(y):
            return f"{python}({self.code(x)}, {self.code(y)})"
        # A constant bound: torch.clamp_min(A, 0) (the gradient at a tie goes to A, as
        # TF's maximum gives it to its first argument).
        bound_y, bound_x = self.scalar(y), self.scalar(x)
        if bound_y is not None:
            return f"{clamp}({self.code(x)}, {bound_y})"
        if bound_x is not None:
            return f"{clamp}({self.code(y)}, {bound_x})"
        return f"{both}({self.code(x)}, {self.code(y)})"

    def call_where(self, args: dict) -> str:
        condition, x, y = args["condition"], args["x"], args["y"]
        # torch.where takes a Python number for one branch; it keeps the other's dtype.
        x_text = self.scalar(x) if self.scalar(y) is None else None
        y_text = self.scalar(y) if self.scalar(x) is None else None
        return (
            f"torch.where({self.tensor(condition, dtype=False)}, "
            f"{x_text or self.code(x)}, {y_text or self.code(y)})"
        )

    call_select = call_where  # torch.where takes any rank

    def call_gelu_tanh(self, args: dict) -> str:
        return f'torch.nn.functional.gelu({self.tensor(args["x"])}, approximate="tanh")'

    def call_cast(self, args: dict) -> str:
        x, dtype = args["x"], self.code(args["dtype"])
        if isinstance(x, ir.Call) and x.function == "tie_hits":  # ties.tie_test
            x = ir.Binary("==", *x.args)
        if self.is_python(x):
            return f"torch.as_tensor({self.code(x)}, dtype={dtype}, device=_device)"
        if self.in_module and isinstance(x, ir.Binary) and x.op in COMPARISONS:
            # A module helper: written straight as 0 and 1 of the dtype (see `_compare`).
            left, right = self.code(x.left), self.code(x.right)
            if not self.is_python(x.left):
                return f"_compare({COMPARISONS[x.op]}, {left}, {right}, {dtype})"
        return f"{self.atom(x)}.to({dtype})"

    def call_floor_position(self, args: dict) -> str:
        # NaN as -inf (infinities kept): on CUDA a cast of NaN is 0, a read of row 0
        f = self.atom(args["x"])
        return f"{f}.nan_to_num(-torch.inf, torch.inf, -torch.inf).to(torch.int64)"

    def call_to_int64(self, args: dict) -> str:
        x = args["x"]
        if self.is_python(x):  # a Python int is exact as it is
            return self.code(x)
        return f"{self.atom(x)}.to(torch.int64)"

    def call_broadcast_to(self, args: dict) -> str:
        x, shape = args["x"], self.code(args["shape"])
        value = self.scalar(x)
        if value is not None:
            # A cast value takes its dtype; a bare Python number is an index position.
            dtype = (
                self.code(x.args[1])
                if isinstance(x, ir.Call) and x.function == "cast"
                else "torch.bool"
                if _is_bool(x, self.bool_names)
                else "torch.int64"
            )
            return f"torch.full({shape}, {value}, dtype={dtype}, device=_device)"
        return f"torch.broadcast_to({self.code(x)}, {shape})"

    def call_eye(self, args: dict) -> str:
        return (
            f"torch.eye({self.code(args['n'])}, dtype={self.code(args['dtype'])}, device=_device)"
        )

    def call_zeros(self, args: dict) -> str:
        shape, dtype = self.code(args["shape"]), self.code(args["dtype"])
        return f"torch.zeros({shape}, dtype={dtype}, device=_device)"

    def call_range(self, args: dict) -> str:
        return f"torch.arange({self.code(args['n'])}, device=_device)"

    def call_reshape(self, args: dict) -> str:
        return f"torch.reshape({self.code(args['x'])}, {self.code(args['shape'])})"

    def call_transpose(self, args: dict) -> str:
        return f"torch.permute({self.code(args['x'])}, {self.code(args['perm'])})"

    def call_concat(self, args: dict) -> str:
        return f"torch.cat({self.code(args['values'])}, dim={self.code(args['axis'])})"

    def call_tile(self, args: dict) -> str:
        return f"torch.tile({self.code(args['x'])}, {self.code(args['multiples'])})"

    def call_broadcast_tile(self, args: dict) -> str:
        # torch broadcasts at any rank: the view itself, no copy of the mask per chunk
        return self.code(args["x"])

    def call_squeeze(self, args: dict) -> str:
        return f"torch.squeeze({self.code(args['x'])}, {self.code(args['axis'])})"

    def call_shape(self, args: dict) -> str:
        return f"{self.atom(args['x'])}.shape"

    def call_pad(self, args: dict) -> str:
        x, paddings = self.code(args["x"]), args["paddings"]
        pairs = _literal_list(paddings)
        if pairs is None or any(_literal_list(p) is None for p in pairs):
            flat = f"[_v for _pair in reversed({self.code(paddings)}) for _v in _pair]"
            return f"torch.nn.functional.pad({x}, {flat})"
        # torch pads the last axis first; leading axes without padding are left out.
        while pairs and all(_is_zero(v) for v in _literal_list(pairs[0])):
            pairs = pairs[1:]
        if not pairs:
            return x
        flat = [self.code(v) for pair in reversed(pairs) for v in _literal_list(pair)]
        return f"torch.nn.functional.pad({x}, [{', '.join(flat)}])"

    def call_slice(self, args: dict) -> str:
        x, begin, size = args["x"], args["begin"], args["size"]
        starts, sizes = _literal_list(begin), _literal_list(size)
        if starts is None or sizes is None or len(starts) != len(sizes):
            index = (
                f"tuple(slice(_b, None if _s == -1 else _b + _s) for _b, _s in "
                f"zip({self.code(begin)}, {self.code(size)}))"
            )
            return f"{self.atom(x)}[{index}]"
        items = []
        for start, count in zip(starts, sizes, strict=True):
            first = "" if _is_zero(start) else self.code(start)
            if isinstance(count, ir.Lit) and count.text == "-1":
                items.append(f"{first}:")
            elif _is_zero(start):
                items.append(f":{self.code(count)}")
            else:
                items.append(f"{first}:{self.code(ir.Binary('+', start, count))}")
        while items and items[-1] == ":":
            items.pop()
        if not items:
            return self.code(x)
        return f"{self.atom(x)}[{', '.join(items)}]"

    def call_exact_div(self, args: dict) -> str:
        n, d, where = (self.code(args[k]) for k in ("n", "d", "where"))
        return f"_exact_div({n}, {d}, {where})"

    def call_shift(self, args: dict) -> str:
        return f"_shift({self.code(args['x'])}, {self.code(args['start'])})"

    def call_size_limit(self, args: dict) -> str:
        return f"_size_limit({self.code(args['n'])}, {self.code(args['where'])}, {self.code(args['others'])})"

    def call_same_size(self, args: dict) -> str:
        return f"_same_size({self.code(args['n'])}, {self.code(args['other'])}, {self.code(args['where'])})"

    def call_cumsum(self, args: dict) -> str:
        x, axis = self.code(args["x"]), self.code(args.get("axis", ir.Lit("0")))
        exclusive, reverse = args.get("exclusive"), args.get("reverse")
        if _is_false(exclusive) and _is_false(reverse):
            return f"torch.cumsum({x}, dim={axis})"
        flags = "".join(
            f", {k}={self.code(v)}"
            for k, v in (("exclusive", exclusive), ("reverse", reverse))
            if v is not None
        )
        return f"_cumsum({x}, {axis}{flags})"

    def call_fit(self, args: dict) -> str:
        parts = (self.code(args["x"]), self.code(args["axis"]), self.code(args["n"]))
        return f"_fit({', '.join(parts)})"

    def call_gather(self, args: dict) -> str:
        x, positions = self.code(args["x"]), self.code(args["positions"])
        return f"_gather({x}, {positions}, {self.code(args.get('axis', ir.Lit('0')))})"

    def call_segment_sum(self, args: dict) -> str:
        return self._segment_sums(args, "_segment_sum", "_segment_sums")

    def call_segment_sum_in(self, args: dict) -> str:
        # Ids within [0, n] (`dropped_id` for reads outside): no bounds test.
        return self._segment_sums(args, "_segment_sum_in", "_segment_sums_in")

    def _segment_sums(self, args: dict, one: str, merged: str) -> str:
        data, ids = args["data"], args["ids"]
        if _concat(data) and _concat(ids):  # merged scatters: added in turn, not joined
            parts = (self.code(data.args[0]), self.code(ids.args[0]), self.code(args["n"]))
            return f"{merged}({', '.join(parts)})"
        parts = (self.code(data), self.code(ids), self.code(args["n"]))
        return f"{one}({', '.join(parts)})"

    def call_dropped_id(self, args: dict) -> str:
        # The row past the end `_segment_sum_in` adds into and cuts off.
        return self.code(args["n"])

    def call_segment_max(self, args: dict) -> str:
        parts = (self.code(args["data"]), self.code(args["ids"]), self.code(args["n"]))
        return f'_segment_extremum({", ".join(parts)}, "amax")'

    def call_segment_min(self, args: dict) -> str:
        parts = (self.code(args["data"]), self.code(args["ids"]), self.code(args["n"]))
        return f'_segment_extremum({", ".join(parts)}, "amin")'

    def call_sparse_rows(self, args: dict) -> str:
        values, rows, shape = args["values"], args["rows"], args["shape"]
        if isinstance(shape, ir.Call) and shape.function == "shape":
            zeros = f"torch.zeros_like({self.code(shape.args[0])})"
        else:
            zeros = f"{self.atom(values)}.new_zeros({self.code(shape)})"
        return f"{zeros}.index_add(0, {self.code(rows)}, {self.code(values)})"

    def call_convolution(self, args: dict) -> str:
        x, w = self.atom(args["x"]), self.atom(args["filters"])
        # A module helper: torch's channels-first kernel, never on an empty axis.
        return f"_convolution({x}, {w}, {self.code(args['strides'])}{self.padding(args)})"

    def padding(self, args: dict) -> str:
        """`, padding=..` for a padding `_conv_padding` chose (torch's own: zeros on both
        sides of each spatial axis); nothing for VALID."""
        padding = args.get("padding")
        if padding is None or padding == ir.Lit('"VALID"'):
            return ""
        if not isinstance(padding, ir.Var):
            raise TypeError(f"PyTorch target: a padding of {padding} is not lowered")
        return f", padding={padding.name}"

    def call_conv2d_backprop_filter(self, args: dict) -> str:
        return self.backprop_filter(args)

    def call_conv3d_backprop_filter(self, args: dict) -> str:
        return self.backprop_filter(args)

    def call_conv2d_backprop_input(self, args: dict) -> str:
        return self.backprop_input(args)

    def call_conv3d_backprop_input(self, args: dict) -> str:
        return self.backprop_input(args)

    def call_depthwise_conv2d(self, args: dict) -> str:
        x, w = self.atom(args["input"]), self.atom(args["filter"])
        # A module helper: torch's grouped convolution, never on an empty axis.
        return f"_depthwise_conv2d({x}, {w}{self.padding(args)})"

    def call_depthwise_conv2d_backprop_filter(self, args: dict) -> str:
        parts = [args["input"], args["filter_sizes"], args["out_backprop"]]
        text = ", ".join(self.code(p) for p in parts)
        return f"_depthwise_backprop_filter({text}{self.padding(args)})"

    def call_depthwise_conv2d_backprop_input(self, args: dict) -> str:
        parts = [args["input_sizes"], args["filter"], args["out_backprop"]]
        text = ", ".join(self.code(p) for p in parts)
        return f"_depthwise_backprop_input({text}{self.padding(args)})"

    def backprop_filter(self, args: dict) -> str:
        parts = [args["input"], args["filter_sizes"], args["out_backprop"]]
        text = ", ".join(self.code(p) for p in parts)
        strides = self.code(args["strides"])
        return f"_conv_backprop_filter({text}, strides={strides}{self.padding(args)})"

    def backprop_input(self, args: dict) -> str:
        parts = [args["input_sizes"], args["filter"], args["out_backprop"]]
        text = ", ".join(self.code(p) for p in parts)
        strides = self.code(args["strides"])
        return f"_conv_backprop_input({text}, strides={strides}{self.padding(args)})"


def _statement(step: ir.Assign, text: str) -> list[str]:
    return [*([f"# {step.comment}"] if step.comment else []), f"{step.target} = {text}"]


def _only_if_needed(
    kept: list[tuple[ir.Assign, str]], returns: tuple, numbers: frozenset[str] | None = None
) -> list[str]:
    """The backward's steps and its return, each step under `if _needs[k]:` when only the
    gradients of some inputs k read it (torch's ctx.needs_input_grad): no work is done for
    a gradient nobody asked for. Steps every gradient reads come first, then one block per
    set of inputs, larger sets first (a step only reads steps of a superset of its own).
    With `numbers` (the body's Python numbers), each step is followed by `del` of the
    temporaries no later step reads (`torch_release`)."""
    groups, users, every = _groups(kept, returns)
    order = [(step.target, _names_list(text)) for _, items in groups for step, text in items]
    keep = {name for name in returns if name}
    # A name a lambda reads (`_cond(p, lambda: ..., lambda: ...)`) is a closure cell, and
    # `del` of a cell is DELETE_DEREF, which torch.compile's Dynamo cannot trace: kept.
    keep |= {
        n for _, items in groups for _, text in items if "lambda" in text for n in _names_list(text)
    }
    drops = iter(
        torch_release.dropped(order, keep, numbers) if numbers is not None else [[] for _ in order]
    )
    lines: list[str] = []
    for needed, items in groups:
        body = []
        for step, text in items:
            body += _statement(step, text)
            names = next(drops)
            if names:
                body.append(f"del {', '.join(names)}")
        if needed >= every:
            lines += body
            continue
        lines.append("if " + " or ".join(f"_needs[{k}]" for k in sorted(needed)) + ":")
        lines += [f"    {line}" for line in body]
    parts = []
    for k, name in enumerate(returns):
        if name is None:
            parts.append("None")
        elif users.get(name, every) >= every:  # computed whatever is needed
            parts.append(name)
        else:
            parts.append(f"{name} if _needs[{k}] else None")
    lines.append(f"return ({', '.join(parts)}{',' if len(parts) == 1 else ''})")
    return lines


def _groups(kept: list[tuple[ir.Assign, str]], returns: tuple):
    """The backward's steps grouped by the set of inputs whose gradients read them, in
    the order they are printed; each step's set; the set of every input with a gradient."""
    users: dict[str, set[int]] = {}
    reads = {step.target: _names_read(text) for step, text in kept}
    for k, name in enumerate(returns):
        if name is None:
            continue
        stack = [name]
        while stack:
            current = stack.pop()
            if current in reads and k not in users.setdefault(current, set()):
                users[current].add(k)
                stack.extend(reads[current])
    every = {k for k, name in enumerate(returns) if name is not None}
    groups: dict[frozenset[int], list[tuple[ir.Assign, str]]] = {}
    for step, text in kept:
        groups.setdefault(frozenset(users[step.target]), []).append((step, text))
    ordered = sorted(groups, key=lambda g: (-len(g), sorted(g)))
    return [(needed, groups[needed]) for needed in ordered], users, every


def _names_list(text: str) -> list[str]:
    """The names a printed expression reads, once per reading."""
    return [
        node.id for node in ast.walk(ast.parse(text, mode="eval")) if isinstance(node, ast.Name)
    ]


def _is_zero(e: ir.Expr) -> bool:
    return isinstance(e, ir.Lit) and e.text == "0"


def _is_false(e: ir.Expr | None) -> bool:
    return e is None or (isinstance(e, ir.Lit) and e.text == "False")


def _names_read(text: str) -> set[str]:
    """The names a printed expression reads."""
    tree = ast.parse(text, mode="eval")
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


__all__ = ["PyTorchPrinter", "is_python"]

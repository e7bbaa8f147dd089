"""The lowered program: small frozen dataclasses that templates turn into Python.

Nothing here knows SymPy or a framework. An `Expr` is a tree of neutral tensor ops
(`OPS`), which each target's printer spells in its framework; a `Step` binds one
expression to a name; a `Block` is a straight-line function body. Frozen dataclasses are
hashable, which is how lowering computes a common subexpression once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

# ----------------------------------------------------------------------------- expressions


@dataclass(frozen=True)
class Lit:
    """A numeric literal, already written as Python source (`2`, `0.5`)."""

    text: str


@dataclass(frozen=True)
class Var:
    """A name in scope: a tensor, an attr, a size."""

    name: str


@dataclass(frozen=True)
class DType:
    """`X.dtype`: the computation dtype, read off an input."""

    tensor: str


@dataclass(frozen=True)
class AxisSize:
    """`tf.shape(X)[axis]`: the size of one axis of an input."""

    tensor: str
    axis: int


@dataclass(frozen=True)
class FloatSize:
    """The size of an index as a float of the computation dtype (`tf.cast(_n_k, dtype)`)."""

    size: str  # the integer size variable


@dataclass(frozen=True)
class View:
    """`operand` with its axes permuted by `perm`, then new axes where `slots` says None.

    slots lists, for each axis of the aligned result, the operand axis it comes from
    (after `perm`) or None for a new broadcast axis.
    """

    operand: Expr
    perm: tuple[int, ...] | None
    slots: tuple[int | None, ...]


# The neutral ops a `Call` may name. Their semantics are those of the TensorFlow function
# of the same meaning (axis conventions, broadcasting, NHWC for convolutions); each
# target's printer spells them in its framework (`targets/`).
OPS = {
    # elementwise
    "abs": "|x|",
    "cos": "cos x",
    "cosh": "cosh x",
    "elu": "x if x > 0 else e^x - 1",
    "erf": "erf x",
    "exp": "e^x",
    "gelu": "x * Φ(x), exact (erf) form",
    "gelu_tanh": "GELU, tanh approximation",
    "is_finite": "x is neither inf nor nan",
    "is_nan": "x is nan",
    "log": "natural log",
    "relu": "max(x, 0); its gradient at 0 is 0",
    "logical_and": "a and b",
    "logical_not": "not a",
    "logical_or": "a or b",
    "maximum": "max(a, b), broadcast",
    "minimum": "min(a, b), broadcast",
    "rsqrt": "1 / sqrt(x)",
    "sigmoid": "1 / (1 + e^-x)",
    "sign": "-1, 0 or 1",
    "silu": "x * sigmoid(x)",
    "sin": "sin x",
    "sinh": "sinh x",
    "softplus": "log(1 + e^x)",
    "sqrt": "sqrt x",
    "square": "x^2",
    "tan": "tan x",
    "tanh": "tanh x",
    "where": "where(condition, a, b), broadcast",
    "select": "select(condition, a, b): where over three tensors of one shape, at any rank "
    "(TensorFlow's where broadcasts, and runs, only up to rank 8)",
    "cast": "cast(x, dtype): to the computation dtype (the variable `dtype`)",
    "to_int64": "to_int64(x): positions in int64 (an int64 id must not wrap in int32)",
    "floor_position": "floor_position(f): a sampled read's floored position f as to_int64; a "
    "NaN position is no position, outside every input: each target takes NaN as -inf before "
    "its cast (a cast of NaN is int64's least value on CPU, but 0, a read of row 0, in XLA "
    "and on CUDA)",
    # shapes and layout
    "broadcast_to": "broadcast_to(x, shape)",
    "concat": "concat(values, axis=k): the tensors of the list `values` joined along axis k",
    "eye": "eye(n, dtype=): the identity matrix",
    "pad": "pad(x, [[before, after] per axis]) with zeros",
    "range": "range(n): 0, 1, .., n-1",
    "reshape": "reshape(x, shape)",
    "shape": "shape(x): the sizes, as an int32 vector",
    "shift": "shift(x, start): x + start in x's dtype (a chunk's first position); nothing "
    "runs when start is the Python int 0 (the whole op)",
    "slice": "slice(x, begin, size) with size -1 to the end",
    "fit": "fit(x, axis, n): x along axis `axis` cut to its first n positions or padded with "
    "zeros to n (x itself, no op, when its size is n)",
    "squeeze": "squeeze(x, axis=k)",
    "tile": "tile(x, multiples)",
    "broadcast_tile": "broadcast_tile(x, multiples): tile(x, multiples) read only by an "
    "elementwise op whose other operand has the full shape; a framework that broadcasts at "
    "any rank passes x itself",
    "transpose": "transpose(x, perm)",
    "zeros": "zeros(shape, dtype=)",
    "zeros_like": "zeros_like(x)",
    "exact_div": "exact_div(n, d, where): n // d for the size n of a composite axis `where`, "
    "refused when d does not divide it",
    "size_limit": "size_limit(n, where, others): the size n of an output axis, refused when "
    "n times the other sizes is beyond the largest output allowed",
    "same_size": "same_size(n, other, where): the size n of an index, refused when it is not "
    "`other`, the size of the axis it reads (`where`, a message formatted with both)",
    # reductions and scans (axis=, keepdims=)
    "cumsum": "cumsum(x, axis=, exclusive=, reverse=)",
    "log_softmax": "log_softmax(x, axis=)",
    "reduce_all": "reduce_all(x): every element true",
    "reduce_logsumexp": "log sum exp over axis=, keepdims=",
    "reduce_max": "max over axis=, keepdims=",
    "reduce_mean": "mean over axis=, keepdims=",
    "reduce_min": "min over axis=, keepdims=",
    "reduce_sum": "sum over axis=, keepdims=",
    "softmax": "softmax(x, axis=)",
    # reads at computed positions and their transposes
    "gather": "gather(x, positions, axis=k): positions (any shape) replace axis k",
    "segment_sum": "segment_sum(data, ids, n): rows of data added at ids < n; ids < 0 dropped",
    "segment_sum_in": "segment_sum_in(data, ids, n): as segment_sum, every id in [0, n) or "
    "dropped_id(n)",
    "dropped_id": "dropped_id(n): the id segment_sum_in drops, -1 or n (the row past the end "
    "a target adds into and cuts off)",
    "segment_max": "segment_max(data, ids, n): as segment_sum, the max; -inf where no row",
    "segment_min": "segment_min(data, ids, n): as segment_sum, the min; +inf where no row",
    "sparse_rows": "sparse_rows(values, rows, shape): a gradient as rows (IndexedSlices)",
    # convolutions (NHWC / NDHWC). `axes` lists, per spatial axis, [size, taps, count,
    # stride, offset]: the outputs read x at stride*i + k + offset (zero outside x).
    "convolution": "convolution(x, w, strides=, padding=)",
    "conv_padding": "conv_padding(axes): the kernels' padding: the framework's own where it "
    "reads exactly that window of x (no pad, no slice), else VALID",
    "conv_window": "conv_window(x, axes): x itself where conv_padding reads the window, "
    "else x padded with zeros or cropped to it",
    "conv_unwindow": "conv_unwindow(g, axes): the transpose of conv_window, g onto x's shape",
    # banded windows (bands.py): rows on axis -2, the product's other axes broadcast
    "band_scores": "band_scores(o, s, offset, count): r[.., i, u] = Σ_c o[.., i, c] "
    "s[.., i + u + offset, c], zeros outside s",
    "band_apply": "band_apply(p, s, offset): r[.., i, c] = Σ_u p[.., i, u] s[.., i + u + offset, c]",
    "band_scatter": "band_scatter(p, o, offset, m): r[.., t, c] = Σ_{i + u + offset = t} "
    "p[.., i, u] o[.., i, c], t < m",
    # a clamped start (bands.py): each kernel's optional last operands (shift, spread), the
    # window of row i at i + shift[i] + u + offset, 0 <= shift[i] <= spread; a dilated
    # window: the keyword dilation=d (a Python int of any sign), row i at i + d·u + offset
    "conv2d_backprop_filter": "Conv2DBackpropFilter(input=, filter_sizes=, out_backprop=, ..)",
    "depthwise_conv2d": "tf.nn.depthwise_conv2d(input=, filter=, strides=, padding=): NHWC, "
    "the filter (kh, kw, c, 1), stride 1",
    "depthwise_conv2d_backprop_filter": "tf.nn.depthwise_conv2d_backprop_filter(input=, "
    "filter_sizes=, out_backprop=, strides=, padding=)",
    "depthwise_conv2d_backprop_input": "tf.nn.depthwise_conv2d_backprop_input(input_sizes=, "
    "filter=, out_backprop=, strides=, padding=)",
    "conv2d_backprop_input": "Conv2DBackpropInput(input_sizes=, filter=, out_backprop=, ..)",
    "conv3d_backprop_filter": "Conv3DBackpropFilterV2(input=, filter_sizes=, out_backprop=, ..)",
    "conv3d_backprop_input": "Conv3DBackpropInputV2(input_sizes=, filter=, out_backprop=, ..)",
}


@dataclass(frozen=True)
class Call:
    """`function(args...)` for a neutral op of `OPS`; `keywords` are rendered as `k=v`."""

    function: str
    args: tuple[Expr, ...]
    keywords: tuple[tuple[str, Expr], ...] = ()


@dataclass(frozen=True)
class Einsum:
    """`tf.einsum("subscripts", operands...)`."""

    subscripts: str
    operands: tuple[Expr, ...]


@dataclass(frozen=True)
class Binary:
    """`left op right` for + - * / ** >= <=."""

    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Negate:
    operand: Expr


@dataclass(frozen=True)
class Shape:
    """A list of integer sizes, `[_n_b, _n_i * _n_k]`."""

    dims: tuple[tuple[str, ...], ...]  # each dim is a product of size variables


@dataclass(frozen=True)
class List:
    """A Python list of expressions, `[1, _int_s, 1]` (strides, paddings, slice bounds)."""

    items: tuple[Expr, ...]


@dataclass(frozen=True)
class Cond:
    """`tf.cond(predicate, lambda: then, lambda: otherwise)`: only the branch taken runs.

    `then` equals `otherwise` whenever the predicate holds. Usually `then` is only a fast
    path, and a target without branches runs `otherwise` always (`without_conds`). When
    `kept`, `otherwise` is the rare and costly branch (the exact path over non-finite
    values, `masked_values`): every target runs one branch, PyTorch by `torch.cond`, JAX
    by `jax.lax.cond`."""

    predicate: Expr
    then: Expr
    otherwise: Expr
    kept: bool = False


@dataclass(frozen=True)
class Whole:
    """`whole if name is None else part`: a value that differs between the whole op (the
    attr `name`, a chunk's length, not given) and one chunk of it (`tile_once`)."""

    name: str
    whole: Expr
    part: Expr


Expr = (
    Lit
    | Var
    | DType
    | AxisSize
    | FloatSize
    | View
    | Call
    | Einsum
    | Binary
    | Negate
    | Shape
    | List
    | Cond
    | Whole
)


# ----------------------------------------------------------------------------- statements


@dataclass(frozen=True)
class Assign:
    """`target = value`, with an optional comment saying what it is in the math."""

    target: str
    value: Expr
    comment: str = ""


@dataclass(frozen=True)
class Block:
    """A straight-line function body."""

    steps: tuple[Assign, ...]
    returns: tuple[str | None, ...]  # names returned, None for a `None` gradient


@dataclass(frozen=True)
class DimCheck:
    """Axes that one index names must agree in size (checked when shapes are static)."""

    index: str
    axes: tuple[tuple[str, int], ...]  # (input, axis)


@dataclass(frozen=True)
class Attr:
    name: str
    kind: str  # "float" | "int" | "bool"
    python_type: str  # the annotation in the generated signature


@dataclass(frozen=True)
class Tiling:
    """How a module splits its work when its temporaries outgrow `MAX_TEMP_BYTES`.

    `chunk` is the op over the positions [start, start + length) of index `index` (an
    output index; or, when `summed`, the index of the formula's outer sum)
    (its formulas with `index` -> `index + start`; inputs in `sliced` are cut to the chunk
    along their axis). At call time `sizes` gives every size `volumes` multiply, and the
    module runs the chunk in a loop when the largest temporaries would not fit.
    """

    index: str  # the output index the work is split along
    start: str | None  # the chunk's int attr holding its first position (None: unused)
    length: str | None  # the chunk's int attr holding its length (None: a cut input gives it)
    sliced: tuple[tuple[str, int], ...]  # (input, axis): inputs cut to the chunk
    output_axes: tuple[int, ...]  # per output, the axis of `index` (a composite group: one)
    sizes: Block  # inputs, attrs -> the size variables below
    volumes: tuple[tuple[str, ...], ...]  # per large temporary, the sizes of its axes
    temporaries: tuple[str, ...]  # per large temporary, its axes in index notation: "[b,i,j]"
    count: str  # the size variable of `index`
    chunk: Module
    max_temp_bytes: int  # the default of the module's MAX_TEMP_BYTES
    # `index` is summed by the outputs, not one of theirs: the chunks' outputs are partial
    # sums, added up; every chunk's gradient gets the whole incoming gradient (`tile_sum`)
    summed: bool = False
    # How the chunks of a summed index combine: "sum", or "logaddexp" (`tile_logsumexp`:
    # the outputs are the log-sum-exp of the chunks', each chunk's gradient scaled by its
    # softmax weight exp(L_chunk - L)).
    combine: str = "sum"
    # The chunk's int attr holding the whole size of `index` (a mean's divisor, `tile_sum`),
    # passed by the loop as its count (None: unused)
    total: str | None = None
    untiled_reason: str = ""  # why a summed index could not be chosen (for the docstring)
    # The large temporaries are the outputs' own size: outputs larger than every input,
    # computed in several steps (`output_temps`; the docstring says so).
    output_sized: bool = False
    # An op in parts (`tile_parts`): every part with its own tiling; the fields above are
    # the first part's. The module runs each part's loop and places or adds the outputs.
    parts: tuple[TilingPart, ...] = ()
    parts_doc: tuple[str, ...] = ()  # the docstring's lines on the parts
    # The op's one program, parameterised by `start` (and `length`): the chunk's formulas,
    # which the whole op runs at start 0 (`tile_once`); None when the chunk's lowering
    # differs from the op's and the module keeps both.
    program: Module | None = None
    separate: str = ""  # when `program` is None: how the chunk's lowering differs
    # An op in stages (`tile_stages`): the internal tensors its parts compute, in order;
    # a part reads the ones before it, and the gradient runs the parts in reverse.
    stages: tuple[str, ...] = ()
    # A second level (`tile_nest`): when one position of `index` still holds more than
    # the budget, each chunk of one position runs in chunks of this index too.
    inner: Inner | None = None
    # Levels below `inner`, outermost first (`tile_nest`): where one position of `index` and
    # `inner.index` still holds more than the budget, each such chunk runs in chunks of these.
    deeper: tuple[Inner, ...] = ()
    # Per volume, the bytes of its items: 0 for the values' itemsize, 8 for a sampled
    # read's int64 corner positions (`sampled_temps.widths`); empty: every volume is values.
    widths: tuple[int, ...] = ()

    def cut_axis(self, name: str) -> int | None:
        """The axis along which input `name` is cut to the chunk, or None (read whole)."""
        return dict(self.sliced).get(name)

    @property
    def held_volumes(self) -> tuple[tuple[str, ...], ...]:
        """The volumes as the plan's `_held` reads them: each its items' bytes (0: the
        values' itemsize) and then its sizes."""
        widths = self.widths or (0,) * len(self.volumes)
        return tuple((str(w), *v) for w, v in zip(widths, self.volumes, strict=True))


@dataclass(frozen=True)
class Inner:
    """An inner index of a nested tiling (`tile_nest`), the second or a deeper one: the
    chunk (whose program the module carries) reads `start` and `length` of this index
    beside the outer ones'."""

    index: str
    start: str | None
    length: str | None
    sliced: tuple[tuple[str, int], ...]  # (input, axis): inputs cut along this index too
    output_axes: tuple[int, ...]  # per output, the axis of `index`
    count: str  # the size variable of `index` in the tiling's `sizes`
    # per output, the size variables of its indices, for the bytes the plan's bound counts
    # (`tile_nest.output_volumes`; empty: the plan counts the inputs alone)
    output_volumes: tuple[tuple[str, ...], ...] = ()

    def cut_axis(self, name: str) -> int | None:
        return dict(self.sliced).get(name)


@dataclass(frozen=True)
class TilingPart:
    """One part of an op in parts: its tiling (whose chunk computes the part's outputs) and,
    per output of the part, the op's output it gives (the outputs of parts that give the
    same output are added)."""

    tiling: Tiling
    outputs: tuple[int, ...]
    formula: str  # the part's equation
    # A stage (`tile_stages`): the tensors its functions read (the op's inputs, then the
    # internal tensors of the stages before it; empty: the op's inputs), and the tensor
    # each of its outputs computes (an output of the op or an internal tensor).
    env: tuple[str, ...] = ()
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class Module:
    """Everything one generated module contains."""

    op: str
    source: str  # "symgrad.toml [ops.Name]"
    formulas: tuple[str, ...]
    gradient_lines: tuple[str, ...]  # per input: its gradient in index notation
    inputs: tuple[str, ...]
    ranks: tuple[int, ...]  # per input
    outputs: tuple[str, ...]
    # per output, per axis: the input axes whose sizes multiply to its size (several for
    # a composite axis), to check incoming gradients against
    output_axes: tuple[tuple[tuple[tuple[str, int], ...], ...], ...]
    attrs: tuple[Attr, ...]
    grads: tuple[str, ...]  # names of the incoming gradients, one per output
    dim_checks: tuple[DimCheck, ...]
    forward: Block  # inputs, attrs -> outputs (and the intermediates in `saved`)
    saved: tuple[str, ...]  # forward intermediates the backward reads
    recompute: Block  # inputs, outputs, attrs -> saved (for `gradient(op, ...)`)
    backward: Block  # inputs, outputs, saved, grads, attrs -> one gradient per input
    index_inputs: tuple[str, ...] = ()  # integer index tensors (no gradient, int dtype)
    # value inputs read only at float positions: an integer dtype is cast, no gradient
    position_inputs: tuple[str, ...] = ()
    sparse_gradients: tuple[str, ...] = ()  # gradients returned as tf.IndexedSlices
    positive_attrs: tuple[str, ...] = ()  # int attrs that scale an index: checked > 0
    unsized_outputs: bool = False  # an output axis is sized by a range, not an input axis
    tiling: Tiling | None = None  # how the work is split when temporaries are large
    max_temp_bytes: int = 16 * 2**20  # the default of the module's MAX_TEMP_BYTES
    # formula rewrites applied before lowering (polyphase.py), as docstring lines
    rewrites: tuple[str, ...] = ()

    @property
    def value_inputs(self) -> tuple[str, ...]:
        """The inputs that hold values: the first one sets the computation dtype."""
        return tuple(n for n in self.inputs if n not in self.index_inputs)


# ----------------------------------------------------------------------------- analysis


def children(e: Expr) -> tuple[Expr, ...]:
    """The expressions `e` is made of, one level down (none for a leaf)."""
    if isinstance(e, View | Negate):
        return (e.operand,)
    if isinstance(e, Binary):
        return (e.left, e.right)
    if isinstance(e, Einsum):
        return e.operands
    if isinstance(e, List):
        return e.items
    if isinstance(e, Call):
        return (*e.args, *(v for _, v in e.keywords))
    if isinstance(e, Cond):
        return (e.predicate, e.then, e.otherwise)
    if isinstance(e, Whole):
        return (e.whole, e.part)
    return ()


def names_in(e: Expr) -> set[str]:
    """The names an expression reads."""
    if isinstance(e, Var):
        return {e.name}
    if isinstance(e, DType | AxisSize):
        return {e.tensor}
    if isinstance(e, FloatSize):
        return {e.size, "dtype"}
    if isinstance(e, Shape):
        return {name for dim in e.dims for name in dim}
    names = set().union(*(names_in(c) for c in children(e)))
    return names | {e.name} if isinstance(e, Whole) else names


def rewrite(e: Expr, swap: Callable[[Expr], Expr | None]) -> Expr:
    """`e` with every subexpression for which `swap` gives a replacement replaced (outermost
    first; a replacement is not searched further)."""
    found = swap(e)
    if found is not None:
        return found
    if isinstance(e, View):
        return View(rewrite(e.operand, swap), e.perm, e.slots)
    if isinstance(e, Call):
        return Call(
            e.function,
            tuple(rewrite(a, swap) for a in e.args),
            tuple((k, rewrite(v, swap)) for k, v in e.keywords),
        )
    if isinstance(e, Einsum):
        return Einsum(e.subscripts, tuple(rewrite(a, swap) for a in e.operands))
    if isinstance(e, Binary):
        return Binary(e.op, rewrite(e.left, swap), rewrite(e.right, swap))
    if isinstance(e, Negate):
        return Negate(rewrite(e.operand, swap))
    if isinstance(e, List):
        return List(tuple(rewrite(a, swap) for a in e.items))
    if isinstance(e, Cond):
        return Cond(
            rewrite(e.predicate, swap),
            rewrite(e.then, swap),
            rewrite(e.otherwise, swap),
            e.kept,
        )
    if isinstance(e, Whole):
        return Whole(e.name, rewrite(e.whole, swap), rewrite(e.part, swap))
    return e


def without_conds(module: Module) -> Module:
    """The module for a target without `tf.cond`: every `Cond` as its `otherwise` branch
    (equal to `then` whenever the predicate holds; `then` is only a fast path), and the
    steps only a predicate read dropped. A `kept` one stays (its `otherwise` is the
    costly one: the target spells it as its own branch)."""

    def otherwise(e: Expr) -> Expr | None:
        if not isinstance(e, Cond):
            return None
        if e.kept:
            parts = (rewrite(x, otherwise) for x in (e.predicate, e.then, e.otherwise))
            return Cond(*parts, kept=True)
        return rewrite(e.otherwise, otherwise)

    def strip(block: Block, wanted: tuple[str, ...]) -> Block:
        steps = tuple(Assign(s.target, rewrite(s.value, otherwise), s.comment) for s in block.steps)
        return Block(prune(Block(steps, block.returns), wanted, set()).steps, block.returns)

    def stripped(tiling: Tiling) -> Tiling:  # the chunk is a module of its own
        sizes = strip(tiling.sizes, tuple(r for r in tiling.sizes.returns if r))
        parts = tuple(replace(p, tiling=stripped(p.tiling)) for p in tiling.parts)
        program = tiling.program and without_conds(tiling.program)
        return replace(
            tiling,
            chunk=without_conds(tiling.chunk),
            sizes=sizes,
            parts=parts,
            program=program,
        )

    tiling = module.tiling if module.tiling is None else stripped(module.tiling)
    return replace(
        module,
        forward=strip(module.forward, (*module.outputs, *module.saved)),
        recompute=strip(module.recompute, module.saved),
        backward=strip(module.backward, tuple(r for r in module.backward.returns if r)),
        tiling=tiling,
    )


def names_read(block: Block) -> set[str]:
    """The names a block's steps read."""
    return set().union(*(names_in(step.value) for step in block.steps))


def prune(
    block: Block,
    wanted: tuple[str, ...],
    available: set[str],
    shortcuts: dict[str, Expr] | None = None,
) -> Block:
    """The steps of `block` needed to compute `wanted` from `available` names, taking a
    shortcut definition (from the inputs alone) where one is known."""
    shortcuts = shortcuts or {}
    needed = set(wanted)
    kept: list[Assign] = []
    for step in reversed(block.steps):
        if step.target in needed and step.target not in available - set(wanted):
            if step.target in shortcuts:
                step = Assign(step.target, shortcuts[step.target], step.comment)
            kept.append(step)
            needed |= names_in(step.value)
    kept.reverse()
    return Block(tuple(kept), wanted)


# ----------------------------------------------------------------------------- scans


@dataclass(frozen=True)
class ScanRead:
    """One input of a scan's step: an op input (cut to the step's position along `axis`,
    or whole when `axis` is None), the state `lag` steps back (`kind="lag"`), or the
    window of the last states, newest first (`kind="window"`). A lag read with `shift`
    reads the past state at `shift` earlier positions along its axis `axis` (zero before
    the start): the previous row at j - 1 of a two-index recurrence."""

    kind: str  # "input" | "lag" | "window" | "recent"
    name: str  # the step's name for it (an op input keeps its own)
    axis: int | None = None
    lag: int = 0
    shift: int = 0
    # kind="recent": op input `input` read at lags along its axis `axis` (x[b,t-1],
    # x[b,t-k]); the step reads its recent slices, newest first (`name[e, ...]` is the
    # input `e` positions back in scan order, zero before the start), `depth` of them:
    # `depth` plus coefficient * (size - 1) per `depth_sizes` (coefficient, input, axis).
    input: str | None = None
    depth: int = 0
    depth_sizes: tuple[tuple[int, str, int], ...] = ()

    @property
    def source(self) -> str:
        """The op input (or past state) this read gives the step."""
        return self.input or self.name


@dataclass(frozen=True)
class ScanStep:
    """A step of a scan: an op over one position, its functions `{prefix}_compute` and
    `{prefix}_backward` (derived and lowered like any op's) embedded in the module."""

    prefix: str
    reads: tuple[ScanRead, ...]  # per step input, in the step's input order
    outputs: tuple[str, ...]  # the state first, then outputs computed at the same position
    output_axes: tuple[int, ...]  # per step output, the axis of the scan index in the op's
    attrs: tuple[str, ...]  # the op attrs the step takes


@dataclass(frozen=True)
class Scan:
    """A sequential scan along index `index`: a module computing a recurrence.

    Forward: the state before the start is zero; at each position the step (`init` at the
    first position when given, else `body`) reads the cut inputs and the past states and
    gives the state and the outputs at that position. Backward: the adjoint recurrence
    in the other direction, each step's derived vector-Jacobian product passing the
    gradient of the past states back.
    """

    op: str
    source: str
    formulas: tuple[str, ...]
    index: str
    reverse: bool  # the state reads later positions: the scan runs from the end
    inputs: tuple[str, ...]
    ranks: tuple[int, ...]
    cut_axes: tuple[int | None, ...]  # per input, the axis of `index` (None: read whole)
    attrs: tuple[Attr, ...]
    no_gradient: tuple[str, ...]
    outputs: tuple[str, ...]  # the op's outputs, in order
    output_ranks: tuple[int, ...]  # per output, its number of axes
    state: str
    internal: bool  # the state is not an output
    # per state axis, an input axis of its size; (None, n): an axis of n (coupled states)
    state_axes: tuple[tuple[str | None, int], ...]
    length: tuple[str, int]  # the input axis whose size is the number of positions
    depth: int  # the window's depth: this plus coefficient * (size - 1) per depth_sizes
    depth_sizes: tuple[tuple[int, str, int], ...]
    body: ScanStep
    init: ScanStep | None
    max_temp_bytes: int = 16 * 2**20
    gradient_lines: tuple[str, ...] = ()  # the step's gradients in index notation
    step_formulas: tuple[str, ...] = ()
    # per state axis, the input axes (or (None, n)) its size is divided by: an index read
    # only inside a composite axis (`v[b,t,(h,i)]`: i is v's axis over h's size)
    state_divisors: tuple[tuple[tuple[str | None, int], ...], ...] = ()
    # inputs read as integer positions (`lab[b,t]` in `x[b,t,lab[b,t]]`): no gradient
    index_inputs: tuple[str, ...] = ()

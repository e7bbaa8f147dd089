"""The lowering of one op: `Lowerer` (sizes, axes, levels, gradients) made of its parts by
concern, and `lower`, which assembles the module's function bodies."""

from __future__ import annotations

from dataclasses import replace

import sympy as sp

from .. import bands, ir, lets, masked_values, patterns, sampling
from ..derive import Backward, Contribution, Scatter, fresh_indices, grad_name
from ..model import Index, Level, Program
from ..notation import gradient_lines
from .bands import Bands
from .common import (
    MAX_BROADCAST_RANK,
    _Body,
    _is_simple,
    _plain,
    _preferred_letters,
    _sum_of_squares,
    align,
    integer,
    reduction,
    same_size,
    size_sources,
)
from .contract import Contraction
from .gathers import Gathers
from .intervals import Intervals
from .kernels import Kernels
from .lookups import Lookups
from .masked_sums import MaskedSums
from .merged_scatters import MergedScatters
from .pointwise import Pointwise
from .row_reads import inline_once
from .segment_cells import SegmentCells
from .segment_extrema import SegmentExtrema
from .segments import Segments
from .separable import SeparableGathers
from .ties import Ties


class Lowerer(
    Pointwise,
    Ties,
    Contraction,
    Kernels,
    Bands,
    Gathers,
    MergedScatters,
    SeparableGathers,
    Segments,
    SegmentExtrema,
    SegmentCells,
    Lookups,
    Intervals,
    MaskedSums,
):
    """Lowers one op's Program (and its Backward) into an `ir.Module`: sizes and axes
    here, the rest by concern in the classes it is made of."""

    def __init__(self, program: Program, backward: Backward) -> None:
        self.program = program
        self.backward = backward
        # Where each index's size can be read: index -> (input, axis), or an integer
        # expression (an extent: from `ranges`, or inferred).
        self.size_of: dict[Index, tuple[str, int] | sp.Expr] = size_sources(program)
        self.levels: dict[str, Level] = {lv.name: lv for lv in program.intermediates}
        for output in program.outputs:
            self.levels[output.level.name] = output.level
        self.preferred = _preferred_letters(program, self.backward)
        # Gathers that are exactly a convolution with the one term reading them.
        self.convolutions = patterns.convolutions(program)
        # Sliding windows read only by products the band kernels compute (bands.py).
        self.bands = bands.bands(program)
        # Whether gathers read at sampled (float, floored) positions: int64 positions.
        self.sampled = sampling.samples(program)
        # Set while lowering the operands of one elementwise op whose broadcast patterns
        # TF merges into few enough groups: no operand needs tiling.
        self.broadcast_safe = False
        self.is_output: set[str] = {o.level.name for o in program.outputs}
        # Tables read at the rows of segment ids (row_reads.py): written into their one use.
        self.row_reads: set[str] = set()
        # Segments over several coordinates (segment_cells.py): their ids' names, and
        # each composite key's coordinates.
        self.cell_names: list[str] = []
        self.cell_keys: dict[Index, tuple[Index, ...]] = {}
        # Logsumexp levels, by their name and by the name of an output equal to one.
        self.logsumexp_of: dict[str, Level] = {
            lv.name: lv for lv in program.intermediates if lv.kind == "logsumexp"
        }
        for output in program.outputs:
            terms = output.level.terms
            if len(terms) == 1 and not terms[0].summed and isinstance(terms[0].expr, sp.Indexed):
                source = self.logsumexp_of.get(terms[0].expr.base.label.name)
                if source is not None and tuple(terms[0].expr.indices) == output.level.indices:
                    self.logsumexp_of[output.level.name] = source
                    self.is_output.add(source.name)
                elif (  # its axes in another order (`y[v,h] = _lse[h,v]`): the same values
                    source is not None
                    and tuple(terms[0].expr.indices) == source.indices
                    and set(source.indices) == set(output.level.indices)
                ):
                    self.logsumexp_of[output.level.name] = replace(
                        source, indices=output.level.indices
                    )

    def index_size(self, body: _Body, index: Index) -> str:
        if index in self.cell_keys:
            return self.cell_size(body, index)
        source = self.size_of.get(index)
        if source is None:
            raise AssertionError(f"no size known for index {index}")
        for var, known in body.sizes.items():
            if known == source:
                return var
        name = index.name if not index.name.startswith("_") else self.preferred.get(index, "")
        var = f"_n_{_plain(name.rstrip(chr(39)))}" if name else ""
        if not name or var in body.sizes:
            if isinstance(source, tuple):
                var = f"_n_{source[0]}_{source[1]}"
            else:
                var = f"_n_{len(body.sizes) + 1}"
        body.sizes[var] = source
        return var

    def size_product(self, body: _Body, indices) -> ir.Expr:
        """The number of positions of `indices` together (1 for none): a count written
        out, where a reshape's -1 is ambiguous beside an empty axis."""
        count: ir.Expr = ir.Lit("1")
        for k, index in enumerate(indices):
            size = ir.Var(self.index_size(body, index))
            count = size if k == 0 else ir.Binary("*", count, size)
        return count

    def position_int(self, size: ir.Expr) -> ir.Expr:
        """A size as an integer of the positions' dtype: int64 when index tensors take
        part (an int64 id must not wrap around in int32 arithmetic), else as it is."""
        if not self.program.index_inputs and not self.sampled:
            return size
        return ir.Call("to_int64", (size,))

    def axis_size(self, body: _Body, tensor_name: str, axis: int) -> str:
        """The variable holding the size of one axis of an input (of an internal tensor:
        the size of the index that axis is computed over)."""
        if tensor_name not in self.program.inputs:
            return self.index_size(body, self.levels[tensor_name].indices[axis])
        source = (tensor_name, axis)
        for var, known in body.sizes.items():
            if known == source:
                return var
        var = f"_n_{tensor_name}_{axis}"
        body.sizes[var] = source
        return var

    def register_axes(self, tensor_name: str, labels: tuple[Index, ...]) -> None:
        """Teach `size_of` the indices of a tensor's axes (for gradient indices)."""
        axes = self.axis_sources(tensor_name)
        for label, source in zip(labels, axes, strict=True):
            self.size_of.setdefault(label, source)

    def axis_sources(self, tensor_name: str) -> tuple:
        if tensor_name in self.program.inputs:
            return tuple((tensor_name, a) for a in range(self.program.rank(tensor_name)))
        level = self.levels[tensor_name]
        return tuple(self.size_of[i] for i in level.indices)

    def align(
        self,
        body: _Body,
        operand: ir.Expr,
        labels: tuple[Index, ...],
        target: tuple[Index, ...],
        beside_full: bool = False,
    ) -> ir.Expr:
        """`align`, made safe for TensorFlow's broadcasting limit: beyond
        MAX_BROADCAST_RANK target axes a broadcast operand is tiled to the full shape
        first, so the elementwise op that reads it never broadcasts (`beside_full`: that
        op's other operand has the full shape, so a framework without the limit may read
        the operand as it is, `broadcast_tile`)."""
        aligned = align(operand, labels, target)
        if len(target) <= MAX_BROADCAST_RANK or not labels or set(labels) >= set(target):
            return aligned
        if self.broadcast_safe:  # the operands of this op merge into few enough groups
            return aligned
        order = tuple(i for i in target if i in labels)
        perm = None if order == labels else tuple(labels.index(i) for i in order)
        slots = tuple(order.index(i) if i in order else None for i in target)
        multiples = tuple(("1",) if i in order else (self.index_size(body, i),) for i in target)
        tile = "broadcast_tile" if beside_full else "tile"
        return ir.Call(tile, (ir.View(operand, perm, slots), ir.Shape(multiples)))

    def level(self, body: _Body, level: Level) -> ir.Expr:
        """The value of an intermediate or an output over its own indices."""
        if level.kind == "gather":
            return self.gather(body, level)
        segment = self.segment_level(body, level)
        if segment is not None:
            return segment
        if level.kind in ("max", "min"):
            (term,) = level.terms
            function = "reduce_max" if level.kind == "max" else "reduce_min"
            read = term.expr
            labels = tuple(read.indices) if isinstance(read, sp.Indexed) else ()
            if (
                labels
                and len(set(labels)) == len(labels)
                and set(labels)
                == {
                    *level.indices,
                    *term.summed,
                }
            ):  # reduce in the tensor's own layout: no transpose
                axes = [n for n, i in enumerate(labels) if i in term.summed]
                value = reduction(body, function, self.access(body, read, labels), axes)
                kept = tuple(i for i in labels if i not in term.summed)
                return align(ir.Var(body.bind(value)), kept, level.indices)
            order = (*level.indices, *term.summed)
            operand = self.expr(body, term.expr, order)
            if not _is_simple(operand):
                operand = ir.Var(body.bind(operand))
            body.reduced.setdefault(term.expr, (operand.name, order))
            axes = ir.Lit(repr(list(range(len(level.indices), len(order)))))
            return ir.Call(function, (operand,), (("axis", axes),))
        if level.kind == "logsumexp":
            (term,) = level.terms
            order = (*level.indices, *term.summed)
            operand = self.expr(body, term.expr, order)
            if not _is_simple(operand):
                operand = ir.Var(body.bind(operand))
            if len(term.summed) == 1 and body.part == "forward" and level.name in self.is_output:
                return self.logsumexp_keeping_softmax(body, operand, len(order))
            axes = ir.Lit(repr(list(range(len(level.indices), len(order)))))
            return ir.Call("reduce_logsumexp", (operand,), (("axis", axes),))
        pieces = []
        for term in level.terms:
            parts = self.term(body, term.expr, term.summed, level.indices)
            if len(parts) > 1 and term.summed and _sum_of_squares(term.expr):
                # Expanded, a sum of squares can round below zero (to -0.03 in float32
                # at distance 0): clamp it where it is exactly nonnegative.
                value, axes = self.sum_terms(body, parts, level.indices)
                if not _is_simple(value):
                    value = ir.Var(body.bind(value))
                parts = [(ir.Call("maximum", (value, ir.Lit("0"))), axes)]
            pieces += parts
        if not pieces:  # the formula is identically zero
            body.uses_dtype = True
            shape = ir.Shape(tuple((self.index_size(body, i),) for i in level.indices))
            return ir.Call("zeros", (shape,), (("dtype", ir.Var("dtype")),))
        value, axes = self.sum_terms(body, pieces, level.indices)
        return self.full(body, value, axes, level.indices)

    def gradient(
        self,
        body: _Body,
        target: str,
        contributions: list[Contribution],
        scatters: list[Scatter] = (),
    ) -> ir.Expr:
        """Σ of contributions to one tensor's gradient, shaped like that tensor."""
        if contributions:
            indices = contributions[0].indices
        else:
            indices = fresh_indices(target, self.program.rank(target))
        self.register_axes(target, indices)
        pieces = self.scatter_pieces(body, scatters, indices)
        # Pointwise contributions add up into one expression with common factors pulled
        # out: softmax's `grad*y + s*y` becomes `(grad + s) * y`, two passes, not four.
        pointwise = [c for c in contributions if not c.summed and not c.diagonal]
        if len(pointwise) > 1:
            merged = sp.factor_terms(sp.Add(*[c.grad * c.partial for c in pointwise]))
            pieces += self.term(body, merged, (), indices)
            contributions = [c for c in contributions if c not in pointwise]
        for c in contributions:
            expr = c.grad * c.partial
            pieces += self.term(body, expr, c.summed, indices, c.diagonal)
        value, axes = self.sum_terms(body, pieces, indices)
        return self.full(body, value, axes, indices)


def lower(program: Program, backward: Backward) -> ir.Module:
    """The whole module for one op, from its program and its derivation."""
    lowerer = Lowerer(program, backward)
    inputs = {name: name for name in program.inputs}

    # Forward: intermediates in order, then outputs.
    fwd = _Body(program, dict(inputs), part="forward")
    for level in program.intermediates:
        if level.name in lowerer.bands:
            continue  # never computed: the band kernels read its source
        fwd.tensors[level.name] = level.name
        fwd.bind(lowerer.level(fwd, level), name=level.name)
    outputs = []
    for output in program.outputs:
        level = output.level
        value = lowerer.level(fwd, level)
        if any(len(group) > 1 for group in output.groups):
            value = ir.Var(fwd.bind(value))
            shape = ir.Shape(
                tuple(tuple(lowerer.index_size(fwd, i) for i in group) for group in output.groups)
            )
            value = ir.Call("reshape", (value, shape))
        fwd.bind(value, name=level.name)
        fwd.tensors[level.name] = level.name
        outputs.append(level.name)

    # Backward.
    bwd = _Body(program, dict(inputs), part="backward")
    for output in program.outputs:
        bwd.tensors[output.level.name] = output.level.name
    for level in program.intermediates:
        if level.name not in lowerer.bands:
            bwd.tensors[level.name] = level.name
    grads = []
    for output in program.outputs:
        level = output.level
        name = grad_name(level.name)
        grads.append(name)
        if any(len(group) > 1 for group in output.groups):
            shape = ir.Shape(tuple((lowerer.index_size(bwd, i),) for i in level.indices))
            bwd.bind(
                ir.Call("reshape", (ir.Var(name), shape)),
                name=name,
                comment="split the composite axes",
            )
        bwd.tensors[name] = name
    by_target: dict[str, list[Contribution]] = {}
    for c in backward.contributions:
        by_target.setdefault(c.target, []).append(c)
    for name in backward.order:
        if name in lowerer.convolutions:
            continue  # TF's convolution backprop kernels read the consumer's gradient
        if name in lowerer.bands:
            continue  # `band_scatter` reads the factors of its gradient
        if name in lowerer.levels and name not in {o.level.name for o in program.outputs}:
            level = lowerer.levels[name]
            gname = grad_name(name)
            scatters = [s for s in backward.scatters if s.target == name]
            value = lowerer.gradient(bwd, name, by_target.get(name, []), scatters)
            if isinstance(value, ir.Var):  # passed through unchanged: no new name
                bwd.tensors[gname] = value.name
                continue
            bwd.bind(value, name=gname, comment=f"∂L/∂{name}")
            bwd.tensors[gname] = gname
    returns: list[str | None] = []
    for name in program.inputs:
        if name not in backward.targets:
            returns.append(None)
            continue
        contributions = by_target.get(name, [])
        scatters = [s for s in backward.scatters if s.target == name]
        gname = grad_name(name)
        if not contributions and not scatters:
            bwd.bind(ir.Call("zeros_like", (ir.Var(name),)), name=gname)
        elif not contributions and len(scatters) == 1 and lowerer.reads_rows(scatters[0]):
            bwd.bind(lowerer.sparse_rows(bwd, scatters[0]), name=gname)
        else:
            bwd.bind(lowerer.gradient(bwd, name, contributions, scatters), name=gname)
        returns.append(gname)
    limits = _output_limits(program, lowerer.size_of)
    checks = _same_sizes(program, lowerer.size_of)
    backward_block = _finish(bwd, tuple(returns), limits, checks)

    # What the backward reads from the forward pass, and how `gradient(op)` recomputes it.
    # Borrowing forward values can leave a dtype or size definition nothing reads.
    let_names = frozenset(lets.symbol(name).name for name, _ in program.lets)
    backward_block = _borrow(backward_block, fwd.memo, let_names)
    backward_block = ir.prune(backward_block, backward_block.returns, set())
    backward_block = inline_once(backward_block, lowerer.row_reads)
    read = ir.names_read(backward_block)
    forward_block = _finish(fwd, tuple(outputs), limits, checks)
    keep = set(outputs) | {name for name in read if name not in program.inputs}
    forward_block = ir.prune(
        forward_block,
        tuple(sorted(keep & {s.target for s in forward_block.steps})),
        set(program.inputs),
    )
    forward_block = ir.Block(forward_block.steps, tuple(outputs))
    forward_block = inline_once(forward_block, lowerer.row_reads - read)
    # Masked weights contracted with values that may be inf or nan: exact at call time.
    forward_block, backward_block = masked_values.exact(
        forward_block, backward_block, program.inputs
    )
    saved = tuple(
        step.target
        for step in forward_block.steps
        if step.target in read
        and step.target not in outputs
        and step.target not in program.inputs
        and step.target not in _PRELUDE_NAMES
        and not step.target.startswith(("_n_", "_int_"))
    )
    recompute = ir.prune(forward_block, saved, set(program.inputs) | set(outputs), fwd.recompute)
    # Per output axis, the input axes whose sizes multiply to its size; (None, None) for
    # an index sized by a range (from the spec, or inferred), which has no input axis.
    output_axes = tuple(
        tuple(
            tuple(
                lowerer.size_of[i] if isinstance(lowerer.size_of[i], tuple) else (None, None)
                for i in group
            )
            for group in output.groups
        )
        for output in program.outputs
    )
    return ir.Module(
        op=program.op,
        source=program.source,
        formulas=program.formulas,
        gradient_lines=gradient_lines(program, backward),
        inputs=program.inputs,
        ranks=tuple(program.rank(n) for n in program.inputs),
        outputs=tuple(outputs),
        output_axes=output_axes,
        unsized_outputs=any(
            source == (None, None) for axes in output_axes for group in axes for source in group
        ),
        attrs=tuple(
            ir.Attr(name, kind, {"float": "float", "int": "int", "bool": "bool"}[kind])
            for name, kind in program.attrs
        ),
        grads=tuple(grads),
        dim_checks=tuple(
            # named as written: a summed index's prime is the model's, not the user's
            ir.DimCheck(index.name.rstrip("'"), axes)
            for index, axes in program.dims
            if len(axes) > 1
        ),
        forward=forward_block,
        saved=saved,
        recompute=recompute,
        backward=backward_block,
        index_inputs=program.index_inputs,
        position_inputs=program.position_inputs,
        positive_attrs=tuple(
            sorted(
                {
                    *program.positive_attrs,
                    *(
                        spatial.stride.name.removeprefix("_int_")
                        for conv in lowerer.convolutions.values()
                        for spatial in conv.spatial
                        if isinstance(spatial.stride, sp.Symbol)
                    ),
                }
            )
        ),
        sparse_gradients=tuple(
            step.target
            for step in backward_block.steps
            if isinstance(step.value, ir.Call) and step.value.function == "sparse_rows"
        ),
    )


def lower_sizes(
    program: Program, backward: Backward, indices: list[Index]
) -> tuple[ir.Block, tuple[str, ...]]:
    """A block computing the sizes of `indices` from the inputs and attrs, and the
    variables that hold them (for the call-time tiling plan). A size that must equal
    another (`_same_sizes`) is checked here too: a chunk knows its own length alone, so
    without the plan's check the chunks would compute where the whole op refuses."""
    lowerer = Lowerer(program, backward)
    body = _Body(program, {name: name for name in program.inputs}, part="sizes")
    names = tuple(lowerer.index_size(body, index) for index in indices)
    checks = _same_sizes(program, lowerer.size_of)
    return _finish(body, tuple(dict.fromkeys(names)), {}, checks), names


def _output_limits(program, size_of) -> dict:
    """For each computed size (a range, or inferred from reads) of an output axis: per
    output, the sizes of its other axes, and the output's name. The size is checked at
    call time so that no output beyond `size_limit` elements is ever allocated."""
    limits: dict = {}
    for output in program.outputs:
        indices = [i for group in output.groups for i in group]
        for i in indices:
            source = size_of.get(i)
            if source is None or isinstance(source, tuple):
                continue
            others = []
            for j in indices:
                if j != i:
                    other = size_of[j]
                    others.append(
                        ir.AxisSize(*other) if isinstance(other, tuple) else integer(other)
                    )
            limits.setdefault(source, []).append(
                (output.level.name, i.name, ir.List(tuple(others)))
            )
    return limits


def _same_sizes(program: Program, size_of: dict) -> dict:
    """For each internal tensor's axis sized by a range and read plainly at an index sized
    otherwise (`Program.same_sizes`): per size source of either index, the other's size
    and the message, once per pair. The sizes are checked equal at call time, where the
    read would otherwise fail inside a reshape with the framework's message."""
    checks: dict = {}
    done: set = set()
    for number, (reading, defining, axis) in enumerate(program.same_sizes):
        mine = size_of.get(reading)
        theirs = defining if isinstance(defining, tuple) else size_of.get(defining)
        if mine is None or theirs is None or mine == theirs:
            continue
        if not isinstance(defining, tuple) and same_size(size_of, reading, defining):
            continue
        if (mine, theirs) in done:  # one check per pair of sizes
            continue
        done |= {(mine, theirs), (theirs, mine)}
        name = reading.name.rstrip("'")
        if isinstance(defining, tuple):
            defined = f"{defining[0]}[axis {defining[1]}]"
        elif axis is None:
            defined = f"the range of {defining.name.rstrip(chr(39))}"
        else:
            defined = f"{axis} (the range of {defining.name.rstrip(chr(39))})"
        read = f"{mine[0]}[axis {mine[1]}]" if isinstance(mine, tuple) else f"the range of {name}"
        where = f"index {name} has different sizes: {read} = {{}}, {defined} = {{}}"
        checks.setdefault(mine, []).append((number, _size_expr(theirs), where))
        flipped = f"index {name} has different sizes: {defined} = {{}}, {read} = {{}}"
        checks.setdefault(theirs, []).append((number, _size_expr(mine), flipped))
    return checks


def _size_expr(source) -> ir.Expr:
    return ir.AxisSize(*source) if isinstance(source, tuple) else integer(source)


def _finish(
    body: _Body, returns: tuple[str | None, ...], limits: dict, checks: dict | None = None
) -> ir.Block:
    """Prepend the dtype, `let` and size definitions the steps use; a computed size of an
    output axis is checked against the size limit of an output (`limits`), and a size that
    must equal another (`_same_sizes`) against it."""
    prelude = []
    if body.uses_dtype:
        prelude.append(ir.Assign("dtype", ir.DType(body.program.value_inputs[0])))
    sizes = []
    checked: set[int] = set()
    for var, source in sorted(body.sizes.items()):
        value = _size_expr(source)
        if not isinstance(source, tuple):
            for output, index, others in limits.get(source, ()):
                where = ir.Lit(repr(f"{output}[{index}]"))
                value = ir.Call("size_limit", (value, where, others))
        for number, other, where in (checks or {}).get(source, ()):
            if number not in checked:
                checked.add(number)
                value = ir.Call("same_size", (value, other, ir.Lit(repr(where))))
        sizes.append(ir.Assign(var, value))
    # Each let the steps or sizes read (and the lets those read), in dependency order;
    # unread ones are pruned with everything else.
    for name, value in body.program.lets:
        prelude.append(ir.Assign(lets.symbol(name).name, integer(value)))
    return ir.Block(tuple(prelude + sizes + body.steps), returns)


_PRELUDE_NAMES = ("dtype",)


def _size_arithmetic(e: ir.Expr) -> bool:
    """Whether `e` reads sizes, int attrs alone (`max(p, 0)`) or nothing (a literal
    position): recomputed where it is needed, never kept from the forward pass (a Python
    int is no tensor to save)."""
    names = ir.names_in(e)
    return any(n.startswith("_n_") for n in names) or all(n.startswith("_int_") for n in names)


def _borrow(block: ir.Block, forward: dict[ir.Expr, str], let_names=frozenset()) -> ir.Block:
    """Read values the forward pass already computed (`tanh(A)`) instead of recomputing.

    The `forward` closure keeps them, as TF's tape would; `gradient(op)` recomputes them.
    Integers from sizes and lets are recomputed: cheap, and never saved as tensors.
    """
    usable = {
        expr: name
        for expr, name in forward.items()
        if not _size_arithmetic(expr)
        and not (ir.names_in(expr) & let_names)
        and not name.startswith("_n_")  # a size the lowering named (`Bands.band_size`)
    }

    def borrowed(e: ir.Expr) -> ir.Expr | None:
        return ir.Var(usable[e]) if e in usable else None

    steps = []
    for step in block.steps:
        value = ir.rewrite(step.value, borrowed)
        if isinstance(value, ir.Var) and step.target.startswith("_t"):
            usable[ir.Var(step.target)] = value.name  # an alias: read the original
            continue
        steps.append(ir.Assign(step.target, value, step.comment))
    return ir.Block(tuple(steps), block.returns)

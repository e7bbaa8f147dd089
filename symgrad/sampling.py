"""Sampled reads: a float position inside a value input's brackets reads by linear
interpolation along that axis, several such axes multilinearly (bilinear in 2-D).

`x[n, c, P, Q]` with float positions P and Q is rewritten into the sum over the 2^k
corners of the cell around (P, Q):

    Σ_{a,b ∈ {0,1}} w_a(P) · w_b(Q) · x[n, c, floor(P) + a, floor(Q) + b]
    w_0(P) = 1 - (P - floor(P)),  w_1(P) = P - floor(P)

Each corner is an ordinary gather at integer, data-dependent positions (`floor_index`,
int64), so a neighbour outside the axis reads zero and gets no gradient (grid_sample's
`padding_mode="zeros"`); the weighted sum is one intermediate over the indices it uses.
Nothing else is new: SymPy differentiates the weights (floor has derivative zero, so
the fraction's derivative is 1), which gives the gradient of every float input of the
position -- the difference of the neighbours times the incoming gradient -- and the
gradient of `x` is the corners' scatter-add of the weights times the incoming gradient.

At an integer position (fraction 0) the value is x at that position and the derivative
along the axis is the forward difference x[p + 1] - x[p]: the one-sided convention of
PyTorch's grid_sampler backward (aten/src/ATen/native/GridSampler.cpp, which also takes
`floor` for the north-west corner and the difference of the east and west neighbours).
"""

from __future__ import annotations

import dataclasses

import sympy as sp

from . import functions as fn
from . import interpolation
from .parse import Access, BinOp, Call, Equation, Neg, Sampled, index_names


def is_sampled(node: Access) -> bool:
    """Whether a read has a float position (it interpolates)."""
    return any(isinstance(p, Sampled) for p in node.positions)


def read(builder, node: Access, scope: dict) -> sp.Expr:
    """The interpolated read as an intermediate of the model `builder` (model._Builder)."""
    from .model import Term

    name = node.tensor
    if name in builder.internals:
        raise builder.fail(
            f"internal tensor {name!r} is read at a float position; only inputs can be "
            "sampled (interpolated)",
            node.col,
        )
    if name in builder.index_inputs:
        raise builder.fail(
            f"tensor {name!r} is an integer index tensor; a float position cannot "
            "interpolate it (only value inputs can be sampled)",
            node.col,
        )
    builder.value_inputs.setdefault(name, node.col)
    builder.register(name, len(node.positions), node.col)
    positions: list[sp.Expr] = []
    fractions: dict[int, sp.Expr] = {}
    for axis, position in enumerate(node.positions):
        if isinstance(position, Sampled):
            # The position and its fraction are intermediates: the 2^k weights and their
            # derivatives read them, and the position's gradient is summed once.
            written = [scope[i] for i in dict.fromkeys(index_names(position))]
            value = builder.pointwise(_right_sided_clamps(position.expr), scope)
            integer = value - fn.floor(value) == 0  # `floor(...)`: one neighbour, exactly
            value = _intermediate(builder, value, written)
            positions.append(fn.floor_index(value))
            if not integer:
                fractions[axis] = _intermediate(builder, value - fn.floor(value), written)
        else:
            positions.append(builder.position(position, scope, []))
    written = [scope[i] for i in node.indices]

    def corners(at: list[sp.Expr], axes: list[int]) -> sp.Expr:
        """The interpolation over `axes` (one nested lerp per axis) around `at`."""
        if not axes:
            return builder.gather_level(name, tuple(at), written, node.col)
        axis, rest = axes[0], axes[1:]
        above = list(at)
        above[axis] = at[axis] + 1
        return interpolation.lerp(fractions[axis], corners(at, rest), corners(above, rest))

    total = corners(positions, list(fractions))
    return builder.lift([Term(total, ())], written)


def _right_sided_clamps(node):
    """`node` (a float position) with its clamps of a tensor expression e by a bound that
    reads no tensor (`H - 1`, `0`) written so that a tie takes the right derivative:
    `min(bound, e)` (the gradient to the bound) and `max(e, bound)` (to e).

    The read's derivative at an integer position is the forward difference (the right
    derivative), and so must be the clamp's, or the two sides meet: clamped at the last
    pixel (`min(max(j + flow, 0), W - 1)` at zero flow), the clamp passed the gradient
    to e (its tie rule, TensorFlow's) and the read took the difference with the zero
    outside the axis, -x[W - 1]: neither one-sided derivative of the clamped read (0 to
    the right, the kernels' -- FlowNet2's resample2d, mmcv's bilinear_interpolate --
    and x[W - 1] - x[W - 2] to the left). A clamp of two tensor expressions keeps its
    order; a clamp written in an earlier equation keeps its tie rule."""
    if isinstance(node, Call):
        args = tuple(_right_sided_clamps(a) for a in node.args)
        if node.function in ("min", "max") and len(args) == 2:
            reads = [_reads_a_tensor(a) for a in args]
            if reads[0] != reads[1]:
                e, bound = args if reads[0] else args[::-1]
                args = (bound, e) if node.function == "min" else (e, bound)
        return dataclasses.replace(node, args=args)
    if isinstance(node, BinOp):
        left, right = _right_sided_clamps(node.left), _right_sided_clamps(node.right)
        return dataclasses.replace(node, left=left, right=right)
    if isinstance(node, Neg):
        return dataclasses.replace(node, operand=_right_sided_clamps(node.operand))
    return node


def _reads_a_tensor(node) -> bool:
    """Whether a formula node reads a tensor anywhere in it."""
    if isinstance(node, Access):
        return True
    if dataclasses.is_dataclass(node):
        return any(_reads_a_tensor(getattr(node, f.name)) for f in dataclasses.fields(node))
    if isinstance(node, tuple):
        return any(_reads_a_tensor(n) for n in node)
    return False


def _intermediate(builder, value: sp.Expr, written: list) -> sp.Expr:
    """`value` as an intermediate over its indices (a read or a constant stays as it is)."""
    from .model import Term

    if isinstance(value, sp.Indexed) or not value.atoms(sp.Indexed):
        return value
    return builder.lift([Term(value, ())], written)


def samples(program) -> bool:
    """Whether some gather of the program reads at a sampled (floor) position: its
    positions are int64."""
    return any(
        level.gather is not None and any(p.has(fn.floor_index) for p in level.gather.positions)
        for level in program.intermediates
    )


def position_inputs(equations: list[Equation], inputs, index_inputs) -> tuple[str, ...]:
    """The value inputs read only inside float positions (`off` of deformable conv, `g`
    of grid_sample): the generated module also takes them in an integer dtype, cast to
    the values' dtype (exact: an integer position reads one element) with no gradient."""
    inside: set[str] = set()
    outside: set[str] = set()

    def walk(node, sampled: bool) -> None:
        if isinstance(node, Access):
            (inside if sampled else outside).add(node.tensor)
            for position in node.positions:
                if isinstance(position, Sampled):
                    walk(position.expr, True)
            return  # other positions hold index tensors
        if isinstance(node, Sampled):
            walk(node.expr, True)
            return
        if dataclasses.is_dataclass(node):
            for field in dataclasses.fields(node):
                value = getattr(node, field.name)
                for child in value if isinstance(value, tuple) else (value,):
                    walk(child, sampled)

    for equation in equations:
        walk(equation.rhs, False)
    return tuple(n for n in inputs if n in inside and n not in outside and n not in index_inputs)

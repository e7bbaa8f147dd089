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
from fractions import Fraction

import sympy as sp

from . import functions as fn
from . import interpolation, lets, splits
from .parse import (
    Access,
    AttrRef,
    BinOp,
    Call,
    Compare,
    Constant,
    Equation,
    IndexRef,
    Neg,
    Num,
    Reduce,
    Sampled,
    Where,
    index_names,
)


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
            value = builder.pointwise(_right_sided_clamps(builder, position.expr), scope)
            integer = value - fn.floor(value) == 0  # `floor(...)`: one neighbour, exactly
            value = _intermediate(builder, value, written)
            positions.append(fn.floor_index(value))
            if not integer:
                fractions[axis] = _intermediate(builder, value - fn.floor(value), written)
        else:
            positions.append(builder.position(position, scope, []))
    # an explicit range wins over the size of an axis read plainly (`x[n, c, 0.5]` over
    # ranges c = C): zero past the axis, as at a read without a float position
    positions = list(splits.past_axes(builder, tuple(positions)))
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


def _right_sided_clamps(builder, node, sign: int | None = 1):
    """`node` (a float position) with its clamps of a tensor expression e by a bound that
    reads no tensor (`H - 1`, `0`) ordered so that a tie takes the derivative the read's
    forward difference agrees with: to e where leaving the clamp moves the position to
    the right, else to the bound (a tie counts as clamped: gradient zero).

    The read's derivative at an integer position is the forward difference (the right
    derivative), and so must be the clamp's, or the two sides meet: clamped at the last
    pixel (`min(max(j + flow, 0), W - 1)` at zero flow), the clamp passed the gradient
    to e (its tie rule, TensorFlow's) and the read took the difference with the zero
    outside the axis, -x[W - 1]: neither one-sided derivative of the clamped read (0 to
    the right, the kernels' -- FlowNet2's resample2d, mmcv's bilinear_interpolate --
    and x[W - 1] - x[W - 2] to the left).

    `sign` is how the position moves as `node` grows: 1, -1, or None where that is not
    known (under a factor of unknown sign, inside a function that is not monotone). With
    sign 1 `min(bound, e)` and `max(e, bound)`; with -1 (under a negation or a negative
    factor: `-min(max(-f, ...), ...)`) `min(e, bound)` and `max(bound, e)`; unknown, the
    bound both ways: a tie is clamped, the derivative from the clamped side (zero),
    which is one-sided whichever way the position moves. The branches of a `where` on
    indices keep the sign; a `where` on values or `abs` of a tensor expression whose
    derivative at its tie no order can make one-sided is refused (a where on values whose
    branches read no tensor moves the position by steps: zero either side). A clamp of two tensor
    expressions keeps its order; a clamp written in an earlier equation keeps its tie
    rule."""

    def walk(n, s):
        return _right_sided_clamps(builder, n, s)

    if isinstance(node, Call):
        if node.function in ("min", "max") and len(node.args) == 2:
            args = tuple(walk(a, s) for a, s in zip(node.args, (sign, sign), strict=True))
            reads = [_reads_a_tensor(a) for a in args]
            if reads[0] != reads[1]:
                e, bound = args if reads[0] else args[::-1]
                to_e = sign == 1 if node.function == "max" else sign == -1
                args = (e, bound) if to_e else (bound, e)
            return dataclasses.replace(node, args=args)
        if node.function == "relu" and sign is not None:  # max(e, 0), a clamp too
            return walk(Call("max", (node.args[0], Num(Fraction(0), node.col)), node.col), sign)
        if node.function == "abs" and _reads_a_tensor(node.args[0]):
            if sign != 1:
                raise builder.fail(
                    "abs of a tensor expression inside a float position that does not grow "
                    "with it: at 0 the read's forward difference is neither one-sided "
                    "derivative (write the position with min/max clamps)",
                    node.col,
                )
            # |e| = max(e, -e), the tie at 0 to e: the right derivative, e growing
            e = walk(node.args[0], None)
            negated = Neg(e, node.col)
            return Call("max", (e, negated), node.col)
        inner = sign if node.function in _INCREASING else None
        return dataclasses.replace(node, args=tuple(walk(a, inner) for a in node.args))
    if isinstance(node, BinOp):
        left_sign, right_sign = _operand_signs(builder, node, sign)
        return dataclasses.replace(
            node, left=walk(node.left, left_sign), right=walk(node.right, right_sign)
        )
    if isinstance(node, Neg):
        return dataclasses.replace(node, operand=walk(node.operand, _times(sign, -1)))
    if isinstance(node, Where):
        if _compares_values(node.cond) and _reads_a_tensor((node.then, node.otherwise)):
            raise builder.fail(
                "a where on tensor values inside a float position: its branch at equality "
                "decides the position's derivative there and can take neither one-sided "
                "derivative (write the clamp with min/max)",
                node.col,
            )
        return dataclasses.replace(
            node, then=walk(node.then, sign), otherwise=walk(node.otherwise, sign)
        )
    if isinstance(node, Reduce):
        inner = sign if node.kind in ("sum", "mean", "max", "min") else None
        return dataclasses.replace(node, body=walk(node.body, inner))
    return node


# Functions that grow with their argument: a clamp inside moves the position the same way.
_INCREASING = frozenset(
    ("exp", "log", "sqrt", "tanh", "sinh", "sigmoid", "softplus", "erf", "elu", "relu", "floor")
)


def _times(sign: int | None, factor: int | None) -> int | None:
    return None if sign is None or factor is None else sign * factor


def _operand_signs(builder, node, sign):
    """How the position moves as each operand of `node` (a BinOp) grows."""
    if node.op == "+":
        return sign, sign
    if node.op == "-":
        return sign, _times(sign, -1)
    if node.op == "*":
        return _times(sign, _sign(builder, node.right)), _times(sign, _sign(builder, node.left))
    if node.op == "/":
        return _times(sign, _sign(builder, node.right)), None
    return None, None


def _sign(builder, node) -> int | None:
    """The sign of a value that reads no tensor (1 for >= 0, -1 for <= 0), else None:
    numbers, pi and e, indices and shape lets (>= 0), and their products, quotients and
    sums of one sign."""
    if _reads_a_tensor(node):
        return None
    if isinstance(node, Num):
        return -1 if node.value < 0 else 1
    if isinstance(node, Constant | IndexRef):
        return 1
    if isinstance(node, AttrRef):
        return 1 if node.name in builder.lets and lets.is_size(builder.op, node.name) else None
    if isinstance(node, Neg):
        return _times(_sign(builder, node.operand), -1)
    if isinstance(node, BinOp):
        left, right = _sign(builder, node.left), _sign(builder, node.right)
        if node.op == "-":
            right = _times(right, -1)
        if node.op in ("*", "/"):
            return _times(left, right)
        if node.op in ("+", "-") and left == right:
            return left
    return None


def _compares_values(cond) -> bool:
    """Whether a where's condition compares values that read a tensor."""
    if isinstance(cond, Compare):
        return not cond.on_indices and _reads_a_tensor(cond.operands)
    return any(_compares_values(c) for c in cond.args)


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

"""Internal tensors: `outputs = ["y"]` lists an op's outputs, and every other left-hand
tensor of its equations is internal.

An internal tensor is computed by its equation like an output, then becomes an
intermediate level under its own name: later equations read it like an input (at plain
or computed positions), the gradient flows through it like through any intermediate
(derive processes levels last to first), and it is never returned. Its axes take their
sizes from the indices of its own equation: a later read at plain index `j` shares the
input axes that size the defining index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy as sp

from .errors import counted
from .parse import Access, Equation

if TYPE_CHECKING:  # the builder owns the bookkeeping; this room only reads and extends it
    from .model import Index, Level, _Builder


def is_internal(op_outputs: tuple[str, ...] | None, equation: Equation) -> bool:
    """Whether an equation computes an internal tensor (not listed in `outputs`)."""
    return op_outputs is not None and equation.output not in op_outputs


def define(builder: _Builder, equation: Equation) -> None:
    """Compute an internal tensor's level and make it readable by later equations."""
    if any(len(group) > 1 for group in equation.groups):
        raise builder.fail(
            f"internal tensor {equation.output!r} has a composite axis; internal tensors "
            "have one index per axis (only outputs are flattened)",
            equation.output_col,
        )
    output = builder.output(equation)
    level = output.level
    builder.intermediates.append(level)
    builder.ranks[level.name] = len(level.indices)
    builder.internals[level.name] = (level, equation.text, equation.output_col)


def share_axis(builder: _Builder, symbol: Index, name: str, axis: int, col: int) -> None:
    """Index `symbol` reads axis `axis` of internal tensor `name` plainly: it takes the
    size of the index that axis was computed over."""
    level: Level = builder.internals[name][0]
    defining = level.indices[axis]
    if symbol == defining:
        return
    sources = builder.dims.get(defining, [])
    if not sources and symbol.name.rstrip("'") != defining.name.rstrip("'"):
        # Where the defining index is also the reading equation's output index (a softmax
        # over it), reading with it is refused in turn: a sum of its own is the way out.
        own = defining.name.rstrip("'")
        names = [i.name.rstrip("'") for i in level.indices]
        kept = ", ".join(n for n in names if n != own)
        raise builder.fail(
            f"index {symbol.name.rstrip(chr(39))!r} reads axis {axis} of internal tensor "
            f"{name!r}, which is sized by a range of {own!r}; read that axis with the index "
            f"{own!r} (to sum over it where {own!r} is also an index of the output, sum in "
            f"an equation of its own, e.g. Z[{kept}] = sum(exp({name}[{', '.join(names)}]), "
            f"{own}), and read Z)",
            col,
        )
    if not sources:  # a range sizes the axis: the reading index's size must equal it
        builder.same_sizes.append((symbol, defining, f"{name}[axis {axis}]"))
        builder.internal_axes.setdefault(symbol, defining)
    for source in sources:
        builder.add_dim(symbol, *source)


def read(builder: _Builder, node: Access, scope: dict[str, Index]) -> sp.Expr:
    """A plain read of an internal tensor inside a later equation."""
    name = node.tensor
    level: Level = builder.internals[name][0]
    if len(node.positions) != len(level.indices):
        raise builder.fail(
            f"internal tensor {name!r} has {len(level.indices)} axes but is read with "
            f"{counted(len(node.positions), 'index', 'indices')} here",
            node.col,
        )
    return read_at(builder, name, tuple(scope[index] for index in node.indices), node.col)


def read_at(builder: _Builder, name: str, symbols: tuple, col: int) -> sp.Expr:
    """Internal tensor `name` read at plain indices `symbols` (also a position that
    simplifies to one: `h[i + 0, c]`)."""
    builder.internal_reads.add(name)
    for axis, symbol in enumerate(symbols):
        share_axis(builder, symbol, name, axis, col)
    from .model import tensor

    return tensor(name)[tuple(symbols)]


def check(builder: _Builder, inputs_used: list[str], fail) -> None:
    """Every internal tensor is computed before it is read, and read by some equation."""
    outputs = builder.op.outputs
    if outputs is None:
        return
    for name in outputs:
        if name not in builder.defined:
            raise fail(f"`outputs` names {name!r}, which no equation computes")
    for name in builder.internals:
        if name in builder.attrs or name in builder.lets:
            raise fail(f"internal tensor {name!r} has the name of an attr or a let")
        if name in inputs_used:
            raise fail(
                f"internal tensor {name!r} is read before the equation that computes it; "
                "put its equation first"
            )
        if name not in builder.internal_reads:
            raise fail(
                f"internal tensor {name!r} is computed but no later equation reads it; "
                "list it in `outputs` or remove it"
            )

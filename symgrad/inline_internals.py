"""Internal tensors written in place of their reads, for a recurrence that cannot scan
them: the full RNN-T forward variables with their log-probabilities computed first,

    bl[b,t,u] = x[b,t,u,0] - log(sum(exp(x[b,t,u,v]), v))
    alpha[b,t,u] = log(... exp(alpha[b,t-1,u] + bl[b,t-1,u]) ...)

or soft-DTW with its distances in the op (`D[b,i,j] = sum((x[b,i,d] - y[b,j,d])**2, d)`),
or a pre-activation before a scan with an initial state. A recurrence along two indices
scans one tensor, and a coupled scan (several tensors per position) has no initial
states, so these ops were refused though only one tensor recurs.

An internal tensor that reads no recurrent tensor is a function of the inputs at its own
position, so each read `bl[b,t-1,u]` may be its formula at that position,
`(x[b,t - 1,u,0] - log(sum(exp(x[b,t - 1,u,v]), v)))`, computed inside the step. The
meaning is kept: an internal tensor reads zero before its first position, so a read
shifted back along an axis is guarded, `where(t >= 1, (...), 0)`. The gradient is the
step's derived one, as for every formula the step reads.

Only what is written in place without a second meaning: the tensor is no output, its
formula has no implicit sum (every index on its right is on its left or summed
explicitly) and no composite axes, and each read is at its own indices, each perhaps a
constant back (`bl[b,t-1,u]`, not `bl[b,u,t]` or `bl[b,t+1,u]`, whose sizes or ends
the formula alone does not tell). `recurrence.plan` tries this only after the op as
written is refused, and keeps that refusal when the inlined op is refused too, so every
message points into the user's own formulas.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import sympy as sp

from .composite_states import _written
from .errors import SymgradError
from .parse import Access, Equation, IndexRef, Reduce, index_names
from .spec import OpSpec


def inlined(op: OpSpec) -> OpSpec | None:
    """`op` with each internal tensor that no recurrence reads into written in place of
    its reads (see the module docstring); None when there is none to write in place, or
    a read of one is not of the form kept."""
    from .recurrence import _accesses, _equations, reads_itself, text

    equations = _equations(op)
    outputs = op.outputs or tuple(e.output for e in equations)
    defined = {e.output for e in equations}
    recurrent = {e.output for e in equations if reads_itself(e)}
    placed: dict[str, Equation] = {}  # internal tensor -> its equation, inlined
    formulas = []
    for e in equations:
        try:
            rhs = text(e.rhs, lambda access, e=e: _in_place(access, placed, e))
        except _NotKept:
            return None
        reads = {a.tensor for a in _accesses(e.rhs)} & defined
        if (
            e.output in outputs
            or e.output in recurrent
            or reads - set(placed)
            or any(len(g) > 1 for g in e.groups)
            or len(set(e.output_indices)) != len(e.output_indices)
            or set(_free(e.rhs)) - set(e.output_indices)
        ):
            formulas.append(f"{_written(e)} = {rhs}")
            continue
        placed[e.output] = _reparsed(op, e, rhs)
    if not placed:
        return None
    return replace(op, formulas=tuple(formulas), inputs=op.inputs or _input_order(op))


class _NotKept(Exception):
    """A read of an internal tensor that is not written in place."""


def _in_place(access: Access, placed: dict[str, Equation], reader: Equation) -> str | None:
    """The text of `access` when it reads a tensor written in place: its formula at the
    read's position, guarded where the read is shifted back; None for other tensors."""
    from .recurrence import _Raw, text

    eq = placed.get(access.tensor)
    if eq is None:
        return None
    lhs = eq.output_indices
    if len(access.positions) != len(lhs):
        raise _NotKept
    shifted: dict[str, str] = {}
    guards = []
    for index, position in zip(lhs, access.positions, strict=True):
        lag = _lag(index, position)
        if lag is None:
            raise _NotKept
        if lag:
            shifted[index] = f"({index} - {lag})"
            guards.append(f"{index} >= {lag}")
    taken = set(index_names_of(reader)) | set(lhs)
    renamed = _fresh(_bound(eq.rhs), taken)

    def swap(node):
        if isinstance(node, IndexRef) and node.name in shifted:
            return _Raw(shifted[node.name], node.col)
        if isinstance(node, IndexRef) and node.name in renamed:
            return replace(node, name=renamed[node.name])
        if isinstance(node, Reduce):
            return replace(
                node,
                body=_mapped(node.body, swap),
                indices=tuple(renamed.get(i, i) for i in node.indices),
            )
        return None

    body = f"({text(_mapped(eq.rhs, swap))})"
    return f"where({' and '.join(guards)}, {body}, 0)" if guards else body


def _lag(index: str, position) -> int | None:
    """How far back along `index` a position reads (`t - 1`: 1), or None when it is not
    `index` less a constant >= 0."""
    if isinstance(position, IndexRef):
        return 0 if position.name == index else None
    if set(index_names(position)) != {index}:
        return None
    from .recurrence import _symbolic

    try:
        value = _symbolic(position, _refused)
    except (SymgradError, _NotKept):
        return None
    lag = sp.expand(sp.Symbol(index, integer=True) - value)
    if lag.free_symbols or not lag.is_integer or lag < 0:
        return None
    return int(lag)


def _refused(message, col):
    return _NotKept(message)


def _mapped(node, swap):
    """`node` with every sub-node `swap` returns a replacement for replaced."""
    found = swap(node)
    if found is not None:
        return found
    if not dataclasses.is_dataclass(node):
        return node
    changes = {}
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if isinstance(value, tuple):
            new = tuple(_mapped(v, swap) if dataclasses.is_dataclass(v) else v for v in value)
        elif dataclasses.is_dataclass(value):
            new = _mapped(value, swap)
        else:
            continue
        if new != value:
            changes[field.name] = new
    return replace(node, **changes) if changes else node


def _free(node) -> list[str]:
    """The index names `node` uses that no reduction inside it binds."""
    if isinstance(node, Reduce):
        return [i for i in _free(node.body) if i not in node.indices]
    if isinstance(node, IndexRef):
        return [node.name]
    return [name for child in _children(node) for name in _free(child)]


def _bound(node) -> list[str]:
    """The indices the reductions inside `node` bind."""
    found = list(node.indices) if isinstance(node, Reduce) else []
    return found + [name for child in _children(node) for name in _bound(child)]


def _children(node) -> list:
    """The formula nodes directly inside `node` (the parse dataclasses' fields)."""
    if not dataclasses.is_dataclass(node):
        return []
    found = []
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        found += [
            v
            for v in (value if isinstance(value, tuple) else (value,))
            if dataclasses.is_dataclass(v)
        ]
    return found


def index_names_of(eq: Equation) -> list[str]:
    """Every index name an equation writes or uses."""
    return [*eq.output_indices, *_free(eq.rhs), *_bound(eq.rhs)]


def _fresh(names, taken: set[str]) -> dict[str, str]:
    """A new name for each of `names` that `taken` holds."""
    renamed = {}
    for name in dict.fromkeys(names):
        if name not in taken:
            continue
        new, k = name, 1
        while new in taken or new in renamed.values():
            new, k = f"{name}{k}", k + 1
        renamed[name] = new
    return renamed


def _reparsed(op: OpSpec, eq: Equation, rhs: str) -> Equation:
    """`eq` with its right side `rhs` (the tensors written in place before it inside)."""
    from .recurrence import _equations

    return _equations(replace(op, formulas=(f"{_written(eq)} = {rhs}",)))[0]


def _input_order(op: OpSpec) -> tuple[str, ...]:
    """The op's inputs in order of first appearance, as written (writing tensors in place
    may read an input first elsewhere)."""
    from .recurrence import _accesses, _equations

    equations = _equations(op)
    defined = {e.output for e in equations}
    return tuple(
        dict.fromkeys(
            a.tensor for e in equations for a in _accesses(e.rhs) if a.tensor not in defined
        )
    )

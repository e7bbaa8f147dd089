"""Composite axes in recurrences: an op written in a kernel's flattened layout, as RWKV-5's
WKV with r, k, v and y of [B, T, C], C = H*N (BlinkDL/RWKV-LM, RWKV-v5/cuda/wkv5_cuda.cu):

    S[b,t,h,j,i] = w[h,j] * S[b,t-1,h,j,i] + k[b,t,(h,j)] * v[b,t,(h,i)]
    y[b,t,(h,i)] = sum(r[b,t,(h,j)] * (u[h,j] * k[b,t,(h,j)] * v[b,t,(h,i)] + S[b,t-1,h,j,i]), j)

- An equation's composite output axis stays composite in its step (`lhs`): the step is an
  ordinary op, which writes `y[b,(h,i)]` row-major, and the scan stacks it along `t` at
  the axis of the group that held `t` (`axis_of`).
- A tensor with a composite axis that an equation reads (a recurrent tensor,
  `y[b,t,(h,i)] = w[h,i] * y[b,t-1,(h,i)] + ..`, or one a coupled recurrence reads) is
  computed split (`split_states`): one axis per index, read split where the formula reads
  it at the same group, and the op's output is it merged again by an equation after it,
  which the scan computes inside its step.
- A state axis that no input axis reads plainly, only inside a composite read
  (`v[b,t,(h,i)]`), has the size of that axis divided by the sizes of the group's other
  indices (`state_size`), or the size its range gives from input shapes.
"""

from __future__ import annotations

import ast
from dataclasses import replace

from .errors import SymgradError, counted
from .parse import Access, Equation, Group, shape_read
from .spec import OpSpec


def lhs(eq: Equation, drop: str, fail) -> str:
    """`eq`'s left side without the scan index `drop`, composite groups kept."""
    parts = []
    for group in eq.groups:
        if drop in group and len(group) > 1:
            raise fail(
                f"{eq.output!r} has the scan index {drop!r} inside the composite axis "
                f"({', '.join(group)}); a scan writes one position of {drop} at a time",
                eq.index_col(drop),
            )
        if drop in group:
            continue
        parts.append(group[0] if len(group) == 1 else f"({', '.join(group)})")
    return f"{eq.output}[{', '.join(parts)}]"


def axis_of(eq: Equation, index: str) -> int:
    """The axis of `eq`'s output that holds `index` (composite groups one axis each)."""
    return next(k for k, group in enumerate(eq.groups) if index in group)


# ----------------------------------------------------------------------------- split states


def split_states(op: OpSpec) -> OpSpec:
    """`op` with each recurrent tensor that has a composite axis scanned split (see the
    module docstring); `op` itself when none has."""
    from .recurrence import _accesses, _equations, text

    equations = _equations(op)
    read = {a.tensor for e in equations for a in _accesses(e.rhs)}
    composite = [e for e in equations if e.output in read and any(len(g) > 1 for g in e.groups)]
    if not composite:
        return op
    taken = (
        {a.tensor for e in equations for a in _accesses(e.rhs)}
        | {e.output for e in equations}
        | {n for n, _ in op.attrs}
        | {n for n, _ in op.lets}
    )
    split: dict[str, tuple[str, tuple[tuple[str, ...], ...]]] = {}
    for e in composite:
        name = f"{e.output}_split"
        while name in taken:
            name += "_"
        taken.add(name)
        split[e.output] = (name, e.groups)
    outputs = op.outputs or tuple(e.output for e in equations)

    def rewritten(e: Equation) -> str:
        def swap(access: Access) -> str | None:
            if access.tensor not in split:
                return None
            name, groups = split[access.tensor]
            if len(access.positions) != len(groups):
                raise SymgradError(
                    f"{access.tensor!r} has {len(groups)} axes but is read with "
                    f"{counted(len(access.positions), 'index', 'indices')} here",
                    where=op.source,
                    formula=e.text,
                    column=access.col,
                )
            parts = []
            for p, group in zip(access.positions, groups, strict=True):
                if len(group) == 1:
                    parts.append(text(p, swap))
                elif isinstance(p, Group) and tuple(i.name for i in p.indices) == group:
                    parts.extend(group)
                else:
                    raise SymgradError(
                        f"{access.tensor!r} is a recurrent tensor with the composite axis "
                        f"({', '.join(group)}) and is read here at {text(p)}; a recurrence "
                        f"reads it at the same group ({', '.join(group)}), which the scan "
                        "holds split",
                        where=op.source,
                        formula=e.text,
                        column=access.col,
                    )
            return f"{name}[{', '.join(parts)}]"

        return text(e.rhs, swap)

    formulas = []
    for e in equations:
        reads_split = any(a.tensor in split for a in _accesses(e.rhs))
        if e.output in split:
            name = split[e.output][0]
            plain = ", ".join(e.output_indices)
            formulas.append(f"{name}[{plain}] = {rewritten(e)}")
            if e.output in outputs:
                formulas.append(f"{_written(e)} = {name}[{plain}]")
        elif reads_split:
            formulas.append(f"{_written(e)} = {rewritten(e)}")
        else:
            formulas.append(e.text)
    return replace(op, formulas=tuple(formulas), outputs=tuple(outputs))


def _written(eq: Equation) -> str:
    groups = (g[0] if len(g) == 1 else f"({', '.join(g)})" for g in eq.groups)
    return f"{eq.output}[{', '.join(groups)}]"


# ----------------------------------------------------------------------------- state sizes


def state_size(op: OpSpec, equations, defined, index: str, plain, fail):
    """The size of state axis `index` that no input axis reads plainly, as
    ((input, axis), (None, n) or (None, int attr), divisors alike): its range, when that is
    an input's shape, an int attr, an integer, or one divided by others (through lets); else the axis of a composite read
    `x[.., (h, index), ..]` divided by the sizes of the group's other indices, each read
    plainly by some input axis (`plain(name)`). None when neither gives it."""
    from .recurrence import _accesses

    ranges = dict(op.ranges)
    if index in ranges:
        return _range_size(op, index, ranges[index], fail)
    for e in equations:
        for access in _accesses(e.rhs):
            if access.tensor in defined:
                continue
            for axis, p in enumerate(access.positions):
                if not isinstance(p, Group) or index not in [i.name for i in p.indices]:
                    continue
                others = [plain(i.name) for i in p.indices if i.name != index]
                if all(o is not None for o in others):
                    return (access.tensor, axis), tuple(others)
    return None


def _range_size(op: OpSpec, index: str, source: str, fail):
    lets = dict(op.lets)
    ints = {n for n, kind in op.attrs if kind == "int"}

    def term(node, seen):
        found = shape_read(node)
        if found is not None:
            return found
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return (None, node.value)
        if isinstance(node, ast.Name) and node.id in lets and node.id not in seen:
            return term(_parsed(lets[node.id]), seen | {node.id})
        if isinstance(node, ast.Name) and node.id in ints:
            return (None, node.id)  # an int attr: the module reads it when called
        return None

    def quotient(node, seen):
        if isinstance(node, ast.Name) and node.id in lets and node.id not in seen:
            return quotient(_parsed(lets[node.id]), seen | {node.id})
        single = term(node, seen)
        if single is not None:
            return single, ()
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
            top = quotient(node.left, seen)
            bottom = term(node.right, seen)
            if top is not None and bottom is not None:
                return top[0], (*top[1], bottom)
        return None

    tree = _parsed(source)
    found = quotient(tree, frozenset()) if tree is not None else None
    if found is None:
        raise fail(
            f"the state's axis {index!r} has the range {source!r}, which a scan cannot size "
            "its state by: give it as an input's X.shape[n], an int attr or an integer, or "
            "one divided by others (through lets), or read the index plainly",
        )
    return found


def _parsed(source: str):
    try:
        return ast.parse(source.strip(), mode="eval").body
    except SyntaxError:
        return None


def shape_of(axes, divisors, size, attrs) -> tuple[int, ...]:
    """A state's shape from its axes and divisors (`ir.Scan.state_axes`,
    `state_divisors`), `size(name, axis)` the size of an input axis, (None, n) an axis
    of n and (None, attr) one of the int attr's value in `attrs`."""

    def sized(name, axis):
        if name is not None:
            return size(name, axis)
        return attrs[axis] if isinstance(axis, str) else axis

    shape = []
    for k, (name, axis) in enumerate(axes):
        value = sized(name, axis)
        for d_name, d_axis in divisors[k] if k < len(divisors) else ():
            value //= sized(d_name, d_axis)
        shape.append(value)
    return tuple(shape)


__all__ = ["axis_of", "lhs", "shape_of", "split_states", "state_size"]

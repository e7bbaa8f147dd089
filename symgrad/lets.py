"""Derived integers: `let = { R = "md // s2", kr = "(k - 1) // 2", W = "t.shape[3]" }`.

Each `let` is an integer expression with the grammar of `ranges` (int literals, int attrs,
input sizes `X.shape[n]`, other let names; + - * // and parentheses), read by the same
whitelisted walk. A let is usable wherever an int attr is: in index expressions, in
ranges and as a value. In the math it is the integer symbol `_int_<name>`, like an int
attr in index arithmetic; generated code computes it once per function, from the attrs
and the inputs' sizes, when the op is called (so unknown dims work), before the sizes
that use it. As a value it is `_letvalue_<name>`, the same integer cast to the inputs'
float dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy as sp

from .errors import SymgradError
from .parse import AttrRef, BinOp, Neg, Node, ShapeRef, parse_range

if TYPE_CHECKING:
    from .model import _Builder
    from .spec import OpSpec


def symbol(name: str) -> sp.Symbol:
    """A let in the math: an integer, never an index (`_int_R`, printed `R`)."""
    return sp.Symbol(f"_int_{name}", integer=True)


VALUE_PREFIX = "_letvalue_"


def value_symbol(name: str) -> sp.Symbol:
    """A let used as a value (cast to the inputs' float dtype), printed `R`."""
    return sp.Symbol(f"{VALUE_PREFIX}{name}", real=True)


def names(op: OpSpec) -> frozenset[str]:
    return frozenset(name for name, _ in op.lets)


def is_size(op: OpSpec, name: str) -> bool:
    """Whether let `name` is an input's size (`x.shape[2]`): never negative."""
    try:
        return isinstance(parse_range(dict(op.lets)[name], frozenset()), ShapeRef)
    except SymgradError:  # it reads an int attr or another let
        return False


def parse(op: OpSpec) -> dict[str, Node]:
    """Each let's expression, in spec order; errors name the let and point into its text."""
    int_attrs = frozenset(name for name, kind in op.attrs if kind == "int")
    attrs = {name for name, _ in op.attrs}
    allowed = int_attrs | names(op)
    parsed: dict[str, Node] = {}
    for name, text in op.lets:
        if name in attrs:
            raise SymgradError(f"let {name!r} has the name of an attr", where=op.source)
        try:
            parsed[name] = parse_range(text, allowed)
        except SymgradError as exc:
            raise SymgradError(
                f"let {name!r}: {exc.message.replace('a range', 'a let')}",
                where=op.source,
                formula=exc.formula,
                column=exc.column,
            ) from None
    return parsed


def _references(node: Node, lets: frozenset[str]) -> list[AttrRef]:
    if isinstance(node, AttrRef):
        return [node] if node.name in lets else []
    if isinstance(node, Neg):
        return _references(node.operand, lets)
    if isinstance(node, BinOp):
        return _references(node.left, lets) + _references(node.right, lets)
    return []


def ordered(op: OpSpec, parsed: dict[str, Node]) -> list[str]:
    """The lets in an order where each comes after the lets it reads; a cycle is an
    error naming it, with a caret under the reference that closes it."""
    lets = frozenset(parsed)
    texts = dict(op.lets)
    done: list[str] = []
    visiting: list[str] = []

    def visit(name: str) -> None:
        if name in done:
            return
        for ref in _references(parsed[name], lets):
            if ref.name in visiting or ref.name == name:
                start = visiting.index(ref.name) if ref.name in visiting else len(visiting)
                cycle = [*visiting[start:], name, ref.name]
                raise SymgradError(
                    f"let {name!r} reads {ref.name!r}: the lets form a cycle "
                    f"({' -> '.join(cycle)})",
                    where=op.source,
                    formula=texts[name].strip(" "),
                    column=ref.col,
                )
            visiting.append(name)
            visit(ref.name)
            visiting.pop()
        done.append(name)

    for name in parsed:
        visit(name)
    return done


def definitions(builder: _Builder, range_expr) -> tuple[tuple[str, sp.Expr], ...]:
    """(name, integer expression over `_int_` attrs, input sizes and earlier lets), in
    dependency order; `range_expr` converts a parsed range (checking `X.shape[n]`)."""
    op = builder.op
    parsed = parse(op)
    result = []
    for name in ordered(op, parsed):

        def fail(message: str, name=name) -> SymgradError:
            return SymgradError(f"let {name!r}: {message}", where=op.source)

        result.append((name, range_expr(parsed[name], builder, name, fail)))
    return tuple(result)


def attrs_read(op: OpSpec) -> set[str]:
    """The attrs the lets read (so they count as used)."""
    lets = names(op)
    found: set[str] = set()

    def walk(node: Node) -> None:
        if isinstance(node, AttrRef) and node.name not in lets:
            found.add(node.name)
        elif isinstance(node, Neg):
            walk(node.operand)
        elif isinstance(node, BinOp):
            walk(node.left)
            walk(node.right)

    for node in parse(op).values():
        walk(node)
    return found

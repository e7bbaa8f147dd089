"""Row tables read at the rows, written where they are used: freed as soon as used.

A segment max's backward reads the maxima and `g / count` at each row's segment
(`gather(table, ids)`: [N, F] each) and combines them in one `where`. Bound to names, both
stay alive until the function returns when it runs eagerly (a Python name holds its
tensor), beside the `where`'s own [N, F] result: in TensorFlow 5.4x the step's inputs and
outputs at 48 features. Written inside the expression that reads them, each is freed as
soon as the call that reads it returns (the maxima's read right after the comparison), as
a graph does after a tensor's last use.
"""

from __future__ import annotations

from .. import ir


def inline_once(block: ir.Block, names: set[str]) -> ir.Block:
    """`block` with each step named in `names` that is read exactly once, by a later step
    of the block (not returned), written into that step in place of its name. A step is
    kept when a step between it and its reader assigns a name it reads."""
    steps = list(block.steps)
    for target in sorted(names):
        at = next((k for k, s in enumerate(steps) if s.target == target), None)
        if at is None or target in block.returns:
            continue
        readers = [k for k, s in enumerate(steps) if _count(s.value, target)]
        if len(readers) != 1 or _count(steps[readers[0]].value, target) != 1:
            continue
        (reader,) = readers
        value = steps[at].value
        reads = ir.names_in(value)
        if reader < at or any(s.target in reads for s in steps[at + 1 : reader]):
            continue
        consumer = steps[reader]
        swapped = ir.rewrite(consumer.value, _swap(target, value))
        steps[reader] = ir.Assign(consumer.target, swapped, consumer.comment)
        del steps[at]
    return ir.Block(tuple(steps), block.returns)


def _swap(name: str, value: ir.Expr):
    """A `rewrite` swap: the variable `name` by `value`."""
    return lambda e: value if isinstance(e, ir.Var) and e.name == name else None


def _count(e: ir.Expr, name: str) -> int:
    """How many times `e` reads the variable `name` (a size or dtype read counts too)."""
    found = 0

    def visit(x: ir.Expr) -> None:
        nonlocal found
        own = {x.name} if isinstance(x, ir.Var) else _own_names(x)
        found += name in own

    ir.rewrite(e, lambda x: visit(x))
    return found


def _own_names(e: ir.Expr) -> set[str]:
    """The names an expression reads other than through subexpressions `rewrite` visits
    (a shape's sizes, an axis size's tensor, the attr a `Whole` tests)."""
    if isinstance(e, ir.DType | ir.AxisSize | ir.FloatSize | ir.Shape):
        return ir.names_in(e)
    if isinstance(e, ir.Whole):
        return {e.name}
    return set()

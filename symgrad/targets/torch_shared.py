"""PyTorch: a sub-expression written more than once in a body is computed once.

Lowering hash-conses whole steps (`_Body.bind`), but a gradient written as one expression
per term repeats the pieces the terms share: a bilinear read's backward wrote its corner
weights `1 - s[..., None]`, their unsqueezes and the gradient's permute once per corner,
each an eager op dispatched again in every chunk of a loop. Before a body is printed,
each tensor sub-expression that its live steps write two or more times (largest first)
becomes a step of its own, placed before the first step that reads it, and is read by
name. The math is unchanged: the same ops on the same operands, run once.

Not shared: leaves, Python numbers (sizes, int attrs: no op), the branches of a `Cond`
or a `Whole` (only one of them runs), and `broadcast_tile` (printed as its operand where
the elementwise op that reads it broadcasts).
"""

from __future__ import annotations

from collections import Counter

from .. import ir

_LEAVES = (ir.Lit, ir.Var, ir.DType, ir.AxisSize, ir.FloatSize, ir.Shape, ir.List)


def shared_once(block: ir.Block, roots, skip, is_python, stem: str = "_c") -> ir.Block:
    """`block` with each tensor sub-expression its live steps (those `roots` read, not in
    `skip`) write more than once bound once, as `stem`1, `stem`2, .."""
    steps = list(block.steps)
    wanted = tuple(r for r in roots if r not in skip)
    live = {s.target for s in ir.prune(block, wanted, set(skip)).steps}
    taken = {s.target for s in steps}
    counter = 0
    while True:
        counts: Counter = Counter()
        for step in steps:
            if step.target in live:
                _count(step.value, counts, is_python)
        repeated = [e for e, n in counts.items() if n > 1]
        if not repeated:
            return ir.Block(tuple(steps), block.returns)
        chosen = max(repeated, key=_size)
        counter += 1
        while f"{stem}{counter}" in taken:
            counter += 1
        name = f"{stem}{counter}"
        taken.add(name)

        def swap(e, chosen=chosen, name=name):
            if e == chosen:
                return ir.Var(name)
            return e if isinstance(e, ir.Cond | ir.Whole) else None

        first = next(
            k for k, step in enumerate(steps) if step.target in live and _has(step.value, chosen)
        )
        steps = [
            ir.Assign(s.target, ir.rewrite(s.value, swap), s.comment) if s.target in live else s
            for s in steps
        ]
        steps.insert(first, ir.Assign(name, chosen))
        live.add(name)


def _eligible(e: ir.Expr, is_python) -> bool:
    if isinstance(e, _LEAVES) or is_python(e):
        return False
    return not (isinstance(e, ir.Call) and e.function == "broadcast_tile")


def _count(e: ir.Expr, counts: Counter, is_python) -> None:
    if isinstance(e, ir.Cond | ir.Whole):
        return
    if _eligible(e, is_python):
        counts[e] += 1
    for child in ir.children(e):
        _count(child, counts, is_python)


def _has(e: ir.Expr, part: ir.Expr) -> bool:
    if e == part:
        return True
    if isinstance(e, ir.Cond | ir.Whole):
        return False
    return any(_has(child, part) for child in ir.children(e))


def _size(e: ir.Expr) -> int:
    return 1 + sum(_size(child) for child in ir.children(e))

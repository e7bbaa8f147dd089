"""Output-sized temporaries, counted for tiling (tile.py).

An op whose output is larger than every input (a pairwise output `y[b,n,m] =
exp(-sum((x[b,n,c] - z[b,m,c])**2, c))`, mmcv's PSA mask `y[n,(p,q),h,w]` gathered from
`x[n, .., h, w]`) has no temporary larger than its output, so `tile.big_sets` finds
nothing to tile. But its lowering holds several tensors of the output's size at once: the
Gram matrix, its double, the broadcast sum of squares, the clamped distance, its negation
and the exponential; or the gather's positions, its mask, the gathered values and the
`where`, and in the backward their scatter. A training step then held 6-8 times the
output where the bound allows 4 times the inputs and outputs.

So an index set larger than every input that the program computes in two or more steps
(two levels over it, or a level whose terms are more than one product of plain reads,
or a gather) is a large temporary too, counted once (the plan's `_HELD` of them): the op
is tiled along an output index when its output-sized temporaries exceed the budget, and
below it keeps its one program. An op that computes its large output in one step (an
outer product, an einsum, a broadcast sum) holds no more than the output and is left alone.
"""

from __future__ import annotations

from collections import Counter

import sympy as sp

from .model import Index, Level

# Output-sized tensors the forward holds, counting a level computed in one step (an
# einsum, a broadcast add) once and any other (a nonlinearity of an operand, an expanded
# square, a gather at computed positions, a `where`) twice, at which a training step
# (which adds the output's gradient and the loss's temporaries) exceeds 4 times the
# inputs and outputs.
HELD = 4


def sets(
    levels: list[Level], outputs: list[Level], no_larger_than_an_input
) -> list[tuple[Index, ...]]:
    """The index sets of `outputs`, larger than every input, that `levels` (a program's
    tensors, but the gathers a convolution kernel reads in place) compute in about
    `HELD` steps. `no_larger_than_an_input(indices)` compares with the op's inputs only."""
    own = {frozenset(o.indices) for o in outputs}
    steps: Counter = Counter()
    for level in levels:
        key = frozenset(level.indices)
        if key not in own or level.kind not in ("sum", "gather") or no_larger_than_an_input(key):
            continue  # an extremum's operand is `big_sets`' own
        steps[key] += 1 if _one_step(level) else 2
    found: list[tuple[Index, ...]] = []
    for level in levels:
        key = frozenset(level.indices)
        if steps.get(key, 0) >= HELD and all(set(f) != key for f in found):
            found.append(level.indices)
    return found


def _one_step(level: Level) -> bool:
    """A level computed in one step: one term that is a product of plain reads (an
    einsum), or, with no summed index, a sum of plain reads (a broadcast add)."""
    if level.gather is not None or len(level.terms) != 1:
        return False
    (term,) = level.terms
    if _plain(term.expr):
        return True
    return not term.summed and all(_plain(t) for t in sp.Add.make_args(term.expr))


def _plain(expr: sp.Expr) -> bool:
    """A product of plain reads and constants."""
    return all(isinstance(f, sp.Indexed) or not f.has(sp.Indexed) for f in sp.Mul.make_args(expr))

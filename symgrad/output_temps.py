"""Output-sized temporaries, counted for tiling (tile.py).

An op whose output is larger than every input (a pairwise output `y[b,n,m] =
exp(-sum((x[b,n,c] - z[b,m,c])**2, c))`, mmcv's PSA mask `y[n,(p,q),h,w]` gathered from
`x[n, .., h, w]`) has no temporary larger than its output, so `tile.big_sets` finds
nothing to tile. But its lowering holds several tensors of the output's size at once: the
Gram matrix, its double, the broadcast sum of squares, the clamped distance, its negation
and the exponential; or the gather's positions, its mask, the gathered values and the
`where`, and in the backward their scatter. A training step then held 6-8 times the
output where the bound allows 4 times the inputs and outputs.

So an output's index set, larger than every input, counts as a large temporary (once: the
plan's `_HELD` of its size) when the levels over it take about `HELD` steps (`_steps`): the
op is tiled along an output index when those exceed the budget, and below it keeps its
one program. An op that computes its large output in a step or two (an outer product, an
einsum under `exp`, the Gram form of a squared distance, a broadcast add, split reads)
is left alone, its generated code unchanged. "Larger than every input" compares size
keys, an index whose extent is at most one input axis (a range `x.shape[2]`, a shifted
read's `Max(0, x.shape[1] - 1)`) taking that axis's (`axis_key`).
"""

from __future__ import annotations

import re
from collections import Counter

import sympy as sp

from . import splits
from .model import Index, Level

# Output-sized tensors computing the outputs holds (`_steps`) at which a training step,
# which adds the output's gradient and the backward's own, exceeds 4 times the inputs
# and outputs (RBF kernel matrix and PSA mask: 4; `exp` of an einsum: 3, within it).
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
        steps[key] += _steps(level)
    found: list[tuple[Index, ...]] = []
    for level in levels:
        key = frozenset(level.indices)
        if steps.get(key, 0) >= HELD and all(set(f) != key for f in found):
            found.append(level.indices)
    return found


def _steps(level: Level) -> int:
    """Tensors of the level's size that computing it holds: a gather at positions computed
    from its indices two (the positions, the values; one for a lookup through an index
    tensor or a split read `x[c % 4]`, a view); a sum one per term, one more for a term
    summed and expanded (not an einsum of plain reads), and one per function over the
    level's whole index set (`exp(-d[b,n,m])`, a `where` on it; not `tanh(A[b,i])`)."""
    if level.gather is not None:
        computed = [level.gather.positions[a] for a in level.gather.computed]
        return 2 if any(not _lookup(p) for p in computed) else 1
    whole = set(level.indices)
    steps = 0
    for term in level.terms:
        steps += 1
        if term.summed:  # an expanded polynomial; else its operand is `big_sets`' own
            steps += bool(not _plain(term.expr) and term.expr.is_polynomial(*_reads(term.expr)))
            continue
        steps += sum(
            1
            for node in sp.preorder_traversal(term.expr)
            if _nonlinear(node) and whole <= node.free_symbols
        )
    return steps


def _reads(expr: sp.Expr) -> list[sp.Indexed]:
    return [node for node in sp.preorder_traversal(expr) if isinstance(node, sp.Indexed)]


def _lookup(position: sp.Expr) -> bool:
    """A read of an index tensor (`ids[b,t]`, `tri[tid[n,h,w] - 1, 0]`) or a split of an
    index (`c % 4`, `c // 4`): no tensor of positions is computed."""
    return isinstance(position, sp.Indexed) or splits.has_split(position)


def _nonlinear(node: sp.Basic) -> bool:
    return isinstance(node, sp.Function) or (isinstance(node, sp.Pow) and not node.exp.is_Integer)


def _plain(expr: sp.Expr) -> bool:
    """A product of plain reads and constants."""
    return all(isinstance(f, sp.Indexed) or not f.has(sp.Indexed) for f in sp.Mul.make_args(expr))


def axis_key(program, key):
    """`key` (tile's size key), but an index whose extent is at most one input axis
    (`x.shape[2]`, `Max(0, x.shape[1] - 1)`: a range or a shifted read) keyed as that
    axis, so that an output no larger than an input is not taken for a larger one."""
    extents = dict(program.extents)
    canonical = {source: key(i) for i, sources in program.dims for source in sources}

    def bounded(index):
        extent = extents.get(index)
        if extent is None or index in dict(program.dims):
            return key(index)
        symbols = list(sp.sympify(extent).free_symbols)
        if len(symbols) != 1:
            return key(index)
        (symbol,) = symbols
        match = re.fullmatch(r"(\w+)\.shape\[(\d+)\]", symbol.name)
        if match is None or not all(extent.subs(symbol, n) <= n for n in (1, 7, 1000)):
            return key(index)
        source = (match.group(1), int(match.group(2)))
        return canonical.get(source, source)

    return bounded

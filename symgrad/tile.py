"""Tiling: how a module bounds its memory when the op's temporaries are large.

An op whose program holds a tensor bigger than any of its inputs and outputs (a gathered
window, a pairwise matrix, a mask over a segment axis) is also compiled a second time as
its *chunk*: the same formulas over a slice of one output index `t`, positions
`[start, start + length)`. Every output is a concatenation of its chunks along `t`; every
input gradient is the sum of the chunks' gradients (or, for an input cut to the chunk, their
concatenation). At call time the module estimates the bytes of its largest temporaries
from the actual sizes and, above `MAX_TEMP_BYTES`, runs the chunk in a loop whose length
keeps each chunk's temporaries under the budget (see the templates' `_tiled_*`).

The chunk is derived from the op's own formula text, so it goes through every stage like
any op: inputs that read `t` plainly on one axis (and nowhere else) are cut to the chunk
along that axis; every other use of `t` (inside brackets, in conditions) becomes
`t + start`, an int attr of the chunk. Internal tensors computed along `t` are computed
over the chunk's positions and read there unmoved; lets are computed by the chunk from
the same inputs. The chunk's gradient is then exact by the same derivation as the op's,
and out-of-range reads still read zero.

An output with a composite axis (`attn[b, h, i, j, (u, v)]`) is tiled along a plain output
index like any other: the chunk keeps the composite axis, and its outputs are placed along
the tiled index's axis of the output tensor, a composite group counting as one axis
(`output_axis`). An index inside a composite output group is never tiled: a slice of it is
no slice of the output's axis.
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass, replace

import sympy as sp

from . import bands, block_reads, ir, output_temps, patterns, sampled_temps, splits
from . import functions as fn
from .indexing import IOTA, on_indices
from .lower import masked_sums
from .lower.common import same_size, size_sources
from .lower.kernels import prefix_sum_form
from .model import Index, Level, Program, accesses
from .segment_cells import flat_term, unflatten
from .segment_forms import (
    eq_form,
    extremum_rows,
    segment_condition,
    segment_extremum,
    sum_rows,
    ties_at_rows,
)
from .spec import OpSpec

START = bands.TILE_START  # the chunk's first position along the tiled index
LENGTH = "tile_length"  # the chunk's length, when no input axis gives it


@dataclass(frozen=True)
class Choice:
    """The index to tile and what the chunk reads."""

    index: str
    sliced: tuple[tuple[str, int], ...]  # inputs cut to the chunk: (input, axis)
    big: tuple[tuple[Index, ...], ...]  # index sets of the temporaries that need tiling
    chunk: OpSpec
    start: str | None  # the chunk's attr holding its first position (None: unused)
    length: str | None
    # How a summed index's chunks combine: "sum" (partial sums added, `tile_sum`) or
    # "logaddexp" (partial log-sum-exps, `tile_logsumexp`).
    combine: str = "sum"
    # The chunk's int attr holding the whole size of the tiled index (a `mean`'s divisor,
    # `tile_sum`): passed by the loop, so that no input has to stay uncut to give it.
    total: str | None = None
    # The sets of `big` that are shifted slices of inputs (`choose`): no level must cut them.
    slices: tuple[tuple[Index, ...], ...] = ()


def _read_in_place(program: Program) -> dict:
    """Gathers never computed: those a convolution kernel reads in place, and the windows
    the band kernels read (bands.py); and a depthwise kernel's gathered filter (`w[c //
    G, k]`), computed but of the filter's size [c, k], which the kernel reads whole."""
    kernels = patterns.convolutions(program)
    filters = {c.filter: c for c in kernels.values() if c.filter not in program.inputs}
    return {**kernels, **filters, **bands.bands(program)}


def big_sets(program: Program) -> list[tuple[Index, ...]]:
    """Index sets of the tensors the program materializes that are larger than every input
    and output: levels, reduced operands of extrema, and nonlinear factors of terms (a
    product of plain reads is an einsum and is never materialized; nor is a polynomial,
    which lowering expands; nor a block read's gather, `block_reads`); and, at any size,
    the sets of sampled reads' corners (`sampled_temps`) and of outputs larger than every
    input computed in several steps (`output_temps`)."""
    return big_and_hard(program)[0]


def big_and_hard(program: Program) -> tuple[list, list]:
    """`big_sets`, and the same without the shifted slices of inputs (`_shifted`): the
    sets an index cut must run through (`choose`), from one pass over the program."""
    found, slices, always = _found_sets(program)
    small = _no_larger(program)
    hard = [indices for k, indices in enumerate(found) if k not in slices]
    return _merged(found, always, small), _merged(hard, always, small)


def _merged(found, always, small) -> list[tuple[Index, ...]]:
    """The sets of `found` larger than every input and output (`small`), but those in
    `always`, with none inside another."""
    big: list[tuple[Index, ...]] = []
    for indices in found:
        s = set(indices)
        if small(s) and indices not in always:
            continue  # no larger than an input or output (the same sizes, other names)
        if any(s <= set(other) for other in big):
            continue
        big = [b for b in big if not set(b) <= s]
        big.append(tuple(indices))
    return big


def _found_sets(program: Program) -> tuple[list, set[int], tuple]:
    """Every set `big_sets` weighs, in order; the positions of those that are shifted
    slices; and the sets kept at any size (sampled reads' corners, output temporaries)."""
    found: list[tuple[Index, ...]] = []
    slices: set[int] = set()
    levels: list[Level] = [*program.intermediates, *(o.level for o in program.outputs)]
    kernels = _read_in_place(program)
    sizes = size_sources(program)

    def same(i: Index, k: Index) -> bool:
        return same_size(sizes, i, k)

    for level in levels:
        if level.name in kernels or block_reads.no_larger(level, program):
            continue
        if _shifted(level):  # no set an index must cut (`choose`)
            slices.add(len(found))
        found.append(level.indices)
        for term in level.terms:
            # a mask over several coordinates (segment_cells.py): a segment by one id
            expr, indices, summed, ids, cell = flat_term(
                term.expr, level.indices, term.summed, program.index_inputs, sizes
            )
            expr = eq_form(expr, ids)  # a segment softmax's exponential: a segment sum
            if level.kind in ("max", "min", "logsumexp"):
                segment = segment_extremum(level.kind, indices, expr, summed, ids)
                if segment is None:
                    found.append((*level.indices, *term.summed))
                else:  # a segment kernel's rows: over the ids' indices and the value's
                    found.append(unflatten(extremum_rows(segment[0], segment[2], indices), cell))
                continue
            allowed = {*indices, *summed}
            prefix = prefix_sum_form(expr, summed, indices, same) is not None
            inside = () if prefix else masked_sums.summed_inside(expr, summed)
            found += [
                unflatten(_indices_of(f, allowed), cell)
                for f in _materialized(expr, ids, prefix or bool(inside))
            ]
            if inside:
                found += [unflatten(m, cell) for m in _masked_sets(expr, indices, allowed)]
    always = (*sampled_temps.sets(program), *_output_sized(program))
    return [*found, *always], slices, always


def _shifted(level: Level) -> bool:
    """Whether `level` gathers an input at positions each one index plus a shift free of
    indices (`w[o, C + c]`: DGCNN's EdgeConv reads the second half of a weight [O, 2C]
    with c over x's C channels), each index on one axis: a slice of the input, padded
    with zeros where its range runs past the input's end."""
    gather = level.gather
    if level.kind != "gather" or gather is None:
        return False
    used = []
    for position in gather.positions:
        position = position.replace(splits.Ranged, lambda index: index)
        found = position.free_symbols & set(level.indices)
        if len(found) != 1 or accesses(position):
            return False
        (index,) = found
        if sp.expand(position - index).free_symbols & set(level.indices):
            return False
        used.append(index)
    return len(used) == len(set(used)) == len(level.indices)


def _output_sized(program: Program) -> list[tuple[Index, ...]]:
    """The sets of outputs larger than every input, computed in several steps
    (`output_temps`), but a convolution kernel's gathers (read in place)."""
    kernels = _read_in_place(program)
    levels = [*program.intermediates, *(o.level for o in program.outputs)]
    computed = [level for level in levels if level.name not in kernels]
    outputs = [o.level for o in program.outputs]
    key = output_temps.axis_key(program, _size_key(program))
    return output_temps.sets(computed, outputs, _no_larger(program, outputs=False, key=key))


def _no_larger(program: Program, outputs: bool = True, key=None):
    """`small(indices)`: whether a tensor over these indices is no larger than one of the
    program's inputs or outputs (the same sizes, perhaps under other names); of its
    inputs only when not `outputs`. `key`: an index's size key (default `_size_key`)."""
    key = _size_key(program) if key is None else key
    sizes = tensor_sizes(program, key, outputs)

    def small(indices) -> bool:
        counted = Counter(key(i) for i in set(indices))
        return any(counted <= other for other in sizes)

    return small


def tensor_sizes(program: Program, key, outputs: bool = True) -> list[Counter]:
    """Each input's (and, where `outputs`, each output's) axes as a multiset of size keys
    (`key(index)`), to compare a temporary's indices with."""
    sizes = [_input_sizes(program, name, key) for name in program.inputs]
    if outputs:
        sizes += [Counter(key(i) for i in o.level.indices) for o in program.outputs]
    return sizes


def _one_window(program: Program, reads: dict[str, list[list[ast.AST]]]):
    """`window(index, indices)`: whether a tensor over `indices` (one position of `index`)
    has a single index beyond the outputs', of no output axis's size, that a read moves
    together with `index` (`Y[l, i + D[q] * (k - w), q, j]`: the offsets `k` of a window
    centred at `i`). One window per position is small at any real size, so such a position
    bounds a chunk as well as one no larger than an input; the tie goes to the rules after
    it (the window's centre, a long axis). Else an attention-times-values product would be
    cut along the values' channel `j`, one position of which is the whole `[l,i,q,k]` of
    the attention weights, held several times over by each chunk."""
    key = _size_key(program)
    outputs = {i for o in program.outputs for i in o.level.indices}
    output_sizes = {key(i) for i in outputs}
    together = [
        _names(p)
        for positions_list in reads.values()
        for positions in positions_list
        for p in positions
        if not isinstance(p, ast.Name)
    ]

    def window(index: Index, indices) -> bool:
        extra = {i for i in indices if i not in outputs}
        if len(extra) != 1:
            return False
        (offset,) = extra
        name = offset.name.replace("'", "")
        return key(offset) not in output_sizes and any(
            {index.name, name} <= names for names in together
        )

    return window


def _materialized(
    expr: sp.Expr, ids: tuple[str, ...], mask_elsewhere: bool = False
) -> list[sp.Expr]:
    """The factors of a product that lowering computes as tensors of their own: not plain
    reads (einsum operands), not polynomials (expanded), and not a mask comparing two
    indices when its tensor is counted elsewhere (`mask_elsewhere`: the product is a
    prefix sum, `lower.kernels.prefix_sum_form`, or a sum under the mask, `_masked_sets`)
    or an index tensor with an index (a segment sum, `lower/segments.py`): its value
    instead. A mask of indices that a prefix sum does not take (`where(s < r and r <= t,
    A[b,r,h], 0)` summed over r: Mamba-2's segsum; or `where(s <= t, X[b,s,h,p], 0)`
    times a factor over t) is a `where` over its value's indices and the mask's
    ([b,r,h,s,t]; [b,s,h,p,t]): that tensor too (no larger than an input where the mask
    adds no index)."""
    found = []
    factors = sp.Mul.make_args(expr)
    for factor in factors:
        if isinstance(factor, sp.Indexed) or not factor.has(sp.Indexed):
            continue
        at_rows = ties_at_rows(factor, ids)  # a segment max's ties: a segment sum of
        if at_rows is not None:
            found.append(at_rows)
            continue
        if (
            isinstance(factor, fn.select)
            and factor.args[2] == 0
            and (on_indices(factor.args[0]) or segment_condition(factor.args[0], ids) is not None)
        ):
            inner, segment = factor.args[1], segment_condition(factor.args[0], ids)
            if segment is not None:  # reads at v are read at the ids' rows (a segment sum)
                inner = inner.xreplace({segment[1]: segment[0]})
            found += _materialized(inner, ids)
            if on_indices(factor.args[0]) and not mask_elsewhere:
                found.append(factor)
            elif not on_indices(factor.args[0]):
                found.append(sum_rows(factor))
            continue
        if factor.is_polynomial(*accesses(factor)):
            continue
        found.append(factor)
    return found


def _masked_sets(expr: sp.Expr, indices, allowed: set[Index]) -> list[tuple[Index, ...]]:
    """The tensors a sum under a mask of indices holds once the indices the mask does not
    read are summed inside it (`lower/masked_sums.py`): in the forward, the output's
    indices widened by the mask's and those of the factors left outside it; in the
    gradient of a read, that read's indices widened alike. No term holds more: the rest
    is summed inside the mask."""
    mask, _, outside = masked_sums.index_mask(expr)
    wide = _indices_of(mask.args[0], allowed) + tuple(
        i for f in outside for i in _indices_of(f, allowed)
    )
    reads = [tuple(a.indices) for a in accesses(expr) if a.base.label.name != IOTA]
    found = []
    for own in (tuple(indices), *reads):
        held = set(own) | set(wide)
        found.append(tuple(i for i in sorted(allowed, key=sp.default_sort_key) if i in held))
    return found


def _size_key(program: Program):
    """An index's size, as something to compare: the first of the input axes that have
    its size (axes an index reads together have one size: `k` and `l` both read `A`'s
    axis 2), or its extent; two indices with the same key have the same size."""
    first: dict[tuple[str, int], tuple[str, int]] = {}  # an input axis -> its class's first

    def find(source):
        while first.get(source, source) != source:
            source = first[source]
        return source

    for _, sources in program.dims:
        for source in sources[1:]:
            a, b = find(sources[0]), find(source)
            if a != b:
                first[max(a, b)] = min(a, b)
    axes = {index: find(sources[0]) for index, sources in program.dims if sources}
    extents = dict(program.extents)

    def key(index: Index):
        if index in axes:
            return axes[index]
        return str(extents.get(index, index))

    return key


def _indices_of(expr: sp.Expr, allowed: set[Index]) -> tuple[Index, ...]:
    """The index symbols `expr` depends on (through reads and conditions), sorted."""
    return tuple(sorted(expr.free_symbols & allowed, key=sp.default_sort_key))


def _input_sizes(program: Program, name: str, key) -> Counter:
    """An input's axes as size keys: an axis that some index reads plainly has that
    index's key. (Not the indices its reads use: `k[b,i,c]` and `k[b,t,c]` together use
    four indices, but `k` has three axes.)"""
    canonical = {source: key(index) for index, sources in program.dims for source in sources}
    return Counter(canonical.get((name, axis), (name, axis)) for axis in range(program.rank(name)))


def choose(
    op: OpSpec,
    program: Program,
    exclude: frozenset[str] = frozenset(),
    *,
    plain: bool = False,
    loose: bool = False,
) -> Choice | None:
    """The index to tile and the chunk's spec, or None when nothing needs tiling (no
    temporary is larger than the inputs and outputs) or no index can be tiled. Indices
    named in `exclude` are not chosen (an outer level's, `tile_nest`). `plain`: choose an
    output index even when nothing needs tiling (a small stage, `tile_stages`, run as one
    chunk).

    A shifted slice of an input (`_shifted`) is larger than it only where its range runs
    past the input's end, which the sizes at call time alone tell: its set asks for a
    plan (`x[b, t + S]` with t over another input's long axis), and the index cut runs
    through it; but with `loose` (where no index or summed index serves them all,
    `pipeline.compile_op`), and below an outer level (`exclude`), it need not where other
    sets are large (EdgeConv's `w[o, C + c]` has no point index n; CCNet's
    `a[b, u, i, j]` has no channel c)."""
    found, hard = (left_large(program, b, exclude) for b in big_and_hard(program))
    if not found and not plain:
        return None
    big = (hard or found) if loose or exclude else found
    trees = [ast.parse(text.strip(" "), mode="exec") for text in op.formulas]
    free = [set(o.level.indices) for o in program.outputs]
    candidates = [
        index
        for index in program.outputs[0].level.indices
        if index.name not in exclude
        and all(index in f for f in free)
        and all(index in b for b in big)
        and _cut_internals(index.name, trees, op) is not None
        and not in_composite_output(index, program)
    ]
    reads = _reads(trees, set(program.inputs))
    # An index inside a composite read `x[b, (h, r)]` cannot be moved by an offset.
    candidates = [i for i in candidates if not splits.in_group(i.name, reads)]
    if not candidates:
        return None
    ranged = dict(op.ranges)

    small = _no_larger(program)
    window = _one_window(program, reads)
    whole = _sampled_whole_input(program)

    def score(index: Index) -> tuple:
        sliced = _sliced(index.name, reads, op)
        return (
            # a chunk of one position larger than the inputs would outgrow the bound
            sum(
                (not small(set(b) - {index}) and not window(index, set(b) - {index}))
                or whole(index, b)
                for b in big
            ),
            program.outputs[0].level.indices.index(index) == 0,  # a batch axis: few chunks
            not _in_positions(index.name, reads),  # a window's centre: a long axis
            not any(axis > 0 for _, axis in sliced),  # a cut input, not at its batch axis
            index.name in ranged,
            program.outputs[0].level.indices.index(index),
        )

    index = min(candidates, key=score)
    name = index.name
    sliced = _sliced(name, reads, op)
    taken = {n for tree in trees for n in _names(tree)} | {a for a, _ in (*op.attrs, *op.lets)}
    start = _fresh(START, taken)
    length = None if sliced else _fresh(LENGTH, taken)
    cut = {n for n, _ in sliced} | _cut_internals(name, trees, op)
    offset = _Offset(name, start, cut)
    formulas = tuple(
        ast.unparse(offset.visit(ast.parse(t.strip(" "), mode="exec"))) for t in op.formulas
    )
    if not offset.count:
        start = None  # every read of `t` is on a cut input: no position moves
    ranges = tuple((k, v) for k, v in op.ranges if k != name)
    if length is not None:
        ranges += ((name, length),)
    texts = (*formulas, *(v for _, v in ranges), *(v for _, v in op.lets))
    used = {n for text in texts for n in _names(ast.parse(text.strip(" ")))}
    attrs = (
        *((a, kind) for a, kind in op.attrs if a in used),
        *((a, "int") for a in (start, length) if a),
    )
    chunk = replace(op, formulas=formulas, attrs=attrs, ranges=ranges, inputs=program.inputs)
    big = (*big, *(b for b in found if b not in big and index in b))  # slices it cuts
    slices = tuple(b for b in big if b not in hard)
    return Choice(name, sliced, big, chunk, start, length, slices=slices)


def strict_part(program: Program):
    """`part(indices)`: whether a tensor over these indices is a strict part of an input
    or output (the same sizes, perhaps under other names, and fewer axes): at most half
    of it, so that the bound, 4x the inputs and outputs, holds 8 of them at any size."""
    key = _size_key(program)
    sizes = tensor_sizes(program, key)

    def part(indices) -> bool:
        counted = Counter(key(i) for i in set(indices))
        return any(counted <= other and counted != other for other in sizes)

    return part


def left_large(program: Program, big, held: frozenset[str]) -> list:
    """The sets of `big` not a strict part of an input or output at one position of the
    indices named in `held` (an outer level's, `tile_nest`): a level below must cut
    those, and need not cut the rest. Grouped-query attention's keys gathered to every
    query head, `k[b, j, h // G, d]` over [b,j,h,d], are a strict part of `k` at one head:
    its second level may cut the rows i, which that gather lacks, where requiring every
    set left only the batch (one position of h held the scores [b,i,j] of a whole head)."""
    if not held:
        return list(big)
    part = strict_part(program)
    return [b for b in big if not part({i for i in b if i.name.replace("'", "") not in held})]


def _sampled_whole_input(program: Program):
    """`whole(index, indices)`: whether one position of `index` leaves a sampled read's
    temporary over `indices` as large as a whole input or output (over all of its axes
    that an index runs along; not `loc`'s axis of two coordinates, read at constants).
    Such a temporary is bounded, but counted `sampled_temps.WEIGHT` times in a forward and
    backward that each hold several: dozens of that input's size per position, over the
    memory bound at any budget (multi-scale deformable attention cut along its channel `d`:
    its corners over `[b,l,q,m,p]`, the size of `attn`, held 1.4-1.8x the bound at value
    2x3024x4x16, 300 queries). Another index bounds it better (there, the queries)."""
    key = _size_key(program)
    levels = [*program.intermediates, *(o.level for o in program.outputs)]
    indexed = {key(i) for level in levels for i in level.indices}
    alongs = [
        Counter({k: n for k, n in s.items() if k in indexed}) for s in tensor_sizes(program, key)
    ]

    def whole(index: Index, indices) -> bool:
        if sampled_temps.weight(tuple(indices), program) == 1:
            return False
        rest = Counter(key(i) for i in set(indices) if i.name.replace("'", "") != index.name)
        return any(len(along) > 1 and along == rest for along in alongs)

    return whole


def in_composite_output(index: Index, program: Program) -> bool:
    """Whether `index` is a member of a composite output axis (`y[b, (u, v)]`): the chunk
    of a slice of it would not be a slice of the output's axis."""
    return any(index in group and len(group) > 1 for o in program.outputs for group in o.groups)


def output_axis(index: Index, output) -> int:
    """The axis of the actual output tensor that `index` runs along: a composite group
    (`y[b, i, (u, v)]`) is one axis."""
    return next(a for a, group in enumerate(output.groups) if index in group)


def _names(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _fresh(stem: str, taken: set[str]) -> str:
    name, k = stem, 1
    while name in taken:
        k += 1
        name = f"{stem}{k}"
    return name


def _reads(trees: list[ast.AST], inputs: set[str]) -> dict[str, list[list[ast.AST]]]:
    """Each input's reads on the right-hand sides: the list of position expressions."""
    found: dict[str, list[list[ast.AST]]] = {}
    for tree in trees:
        (assign,) = tree.body
        for node in ast.walk(assign.value):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Name)
                and node.value.id in inputs
            ):
                elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                found.setdefault(node.value.id, []).append(list(elts))
    return found


def _cut_internals(name: str, trees: list[ast.AST], op: OpSpec) -> set[str] | None:
    """The internal tensors the chunk computes over its own positions only (those whose
    equation has `name` on its left), or None when `name` cannot be the chunk's index:
    an equation uses `name` without computing along it, or a later equation reads such
    an internal tensor other than at plain `name` on its axis (it would need positions
    outside the chunk). A cut internal tensor is read unmoved: chunk positions."""
    outputs = set(op.outputs or ())
    axes: dict[str, int] = {}
    for tree in trees:
        (assign,) = tree.body
        (target,) = assign.targets
        elts = target.slice.elts if isinstance(target.slice, ast.Tuple) else [target.slice]
        plain = [a for a, p in enumerate(elts) if isinstance(p, ast.Name) and p.id == name]
        if len(plain) != 1:
            if name in _names(assign.value) or plain:
                return None
            continue
        tensor = target.value.id
        if op.outputs is not None and tensor not in outputs:
            axes[tensor] = plain[0]
    for tree in trees:
        for node in ast.walk(tree.body[0].value):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Name)
                and node.value.id in axes
            ):
                elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                at = [a for a, p in enumerate(elts) if name in _names(p)]
                axis = axes[node.value.id]
                if at != [axis] or not isinstance(elts[axis], ast.Name):
                    return None
    return set(axes)


def _in_positions(name: str, reads: dict[str, list[list[ast.AST]]]) -> bool:
    """Whether some read computes a position from `name` (`x[b, i + u - r]`; a split
    read `w[c // G]` or a composite `x[(h, r)]` is no window)."""
    return any(
        name in _names(p) and not isinstance(p, ast.Name) and not splits.is_split(p)
        for positions_list in reads.values()
        for positions in positions_list
        for p in positions
    )


def _sliced(name: str, reads: dict[str, list[list[ast.AST]]], op: OpSpec) -> tuple:
    """Inputs every read of which puts `name` plainly at one axis and nowhere else, and
    whose size on that axis no range or let reads (the chunk would see the cut size). An
    index with an explicit range may run past the axes it reads: nothing is cut."""
    if name in dict(op.ranges):
        return ()
    found = []
    for tensor, positions_list in sorted(reads.items()):
        axes = set()
        for positions in positions_list:
            plain = [a for a, p in enumerate(positions) if isinstance(p, ast.Name) and p.id == name]
            elsewhere = [a for a, p in enumerate(positions) if a not in plain and name in _names(p)]
            if len(plain) != 1 or elsewhere:
                axes = None
                break
            axes.add(plain[0])
        if not axes or len(axes) != 1:
            continue
        (axis,) = axes
        sizes = (*op.ranges, *op.lets)  # a chunk's cut input would change their values
        if any(f"{tensor}.shape[{axis}]" in text.replace(" ", "") for _, text in sizes):
            continue
        found.append((tensor, axis))
    return tuple(found)


class _Offset(ast.NodeTransformer):
    """`t` -> `(t + start)` on the right-hand side, except where a cut input reads it."""

    def __init__(self, index: str, start: str, cut: set[str]) -> None:
        self.index, self.start, self.cut = index, start, cut
        self.count = 0  # uses of `t` moved by `start`

    def visit_Assign(self, node: ast.Assign) -> ast.Assign:
        node.value = self.visit(node.value)
        return node

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        if isinstance(node.value, ast.Name) and node.value.id in self.cut:
            return node
        node.slice = self.visit(node.slice)
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        # A reduction's index arguments (`sum(e, k)`) never name the output index `t`.
        node.args = [self.visit(a) for a in node.args]
        return node

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id != self.index:
            return node
        self.count += 1
        return ast.BinOp(
            ast.Name(self.index, ast.Load()), ast.Add(), ast.Name(self.start, ast.Load())
        )


def tiling(
    choice: Choice, program: Program, backward, chunk: ir.Module, *, summed: bool = False
) -> ir.Tiling:
    """The IR of a module's tiling: the chunk, and the sizes the call-time plan reads.
    `summed`: the tiled index is summed (`tile_sum`), so the chunks' outputs are added
    rather than placed along an output axis."""
    from .lower import lower_sizes

    if summed:
        index = next(i for b in choice.big for i in b if i.name == choice.index)
    else:
        index = next(i for i in program.outputs[0].level.indices if i.name == choice.index)
    wanted = [index, *dict.fromkeys(i for b in choice.big for i in b)]
    sizes, names = lower_sizes(program, backward, wanted)
    size_of = dict(zip(wanted, names, strict=True))
    volumes, widths = sampled_temps.counted(choice.big, program, size_of)
    return ir.Tiling(
        index=choice.index,
        start=choice.start,
        length=choice.length,
        sliced=choice.sliced,
        output_axes=() if summed else tuple(output_axis(index, o) for o in program.outputs),
        sizes=sizes,
        volumes=volumes,
        temporaries=tuple(
            "[" + ",".join(i.name.replace("'", "") for i in b) + "]" for b in choice.big
        ),
        widths=widths,
        count=size_of[index],
        chunk=chunk,
        max_temp_bytes=choice.chunk.max_temp_bytes,
        summed=summed,
        combine=choice.combine,
        total=choice.total,
        output_sized=all(
            b in _output_sized(program) and sampled_temps.weight(b, program) == 1
            for b in choice.big
        ),
    )

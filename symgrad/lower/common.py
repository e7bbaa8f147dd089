"""What every part of lowering shares: the function body being built (`_Body`), the
tables of elementwise functions, and small helpers over IR and index labels."""

from __future__ import annotations

import itertools
import string
from dataclasses import dataclass, field

import sympy as sp

from .. import functions as fn
from .. import indexing, ir, splits
from ..derive import Backward
from ..model import Index, Program

LETTERS = string.ascii_lowercase + string.ascii_uppercase


# TensorFlow's elementwise broadcasting (BCast, also behind tf.broadcast_to) handles at
# most this many groups of adjacent axes with the same broadcast pattern; beyond it ops
# fail with "Broadcast between ... is not supported yet". tf.tile has no such limit.
MAX_BROADCAST_RANK = 5


REPRESENTATIVE_SIZE = 64  # per index, for choosing contraction orders


MAX_EXPANDED_TERMS = 32


UNARY = {
    sp.exp: "exp",
    sp.log: "log",
    sp.sin: "sin",
    sp.cos: "cos",
    sp.tan: "tan",
    sp.tanh: "tanh",
    sp.sinh: "sinh",
    sp.cosh: "cosh",
    sp.Abs: "abs",
    sp.sign: "sign",
    sp.erf: "erf",
    fn.sigmoid: "sigmoid",
    fn.softplus: "softplus",
    fn.floor: "floor",
    fn.silu: "silu",
    fn.gelu: "gelu",
    fn.gelu_tanh: "gelu_tanh",
    fn.elu: "elu",
    fn.relu: "relu",
}


BINARY = {fn.maximum: "maximum", fn.minimum: "minimum"}


MASKS = {fn.step_ge: ">=", fn.step_le: "<=", fn.step_eq: "=="}


RELATIONS = {sp.Lt: "<", sp.Le: "<=", sp.Gt: ">", sp.Ge: ">=", sp.Eq: "==", sp.Ne: "!="}


LOGIC = {sp.And: "logical_and", sp.Or: "logical_or"}


_STEMS = {"forward": "_f", "backward": "_t", "sizes": "_s"}


@dataclass
class _Body:
    """The steps of one function body being built, with hash-consing and sizes."""

    program: Program
    tensors: dict[str, str]  # SymPy tensor name -> the variable holding it
    steps: list[ir.Assign] = field(default_factory=list)
    memo: dict[ir.Expr, str] = field(default_factory=dict)
    counter: int = 0
    sizes: dict[str, tuple[str, int]] = field(default_factory=dict)  # var -> (tensor, axis)
    uses_dtype: bool = False
    # Which function this body is: "forward", "backward" (the gradient) or "sizes" (the
    # tiling plan's sizes). It also names the temporaries: _f1.., _t1.., _s1...
    part: str = "backward"
    # A cheaper way to compute a value from the inputs alone, for `gradient(op)`.
    recompute: dict[str, ir.Expr] = field(default_factory=dict)
    # A value lowered to read an earlier step -> the same value as the formula writes it
    # (what another body, the backward, lowers it to and borrows by).
    written_as: dict[ir.Expr, ir.Expr] = field(default_factory=dict)
    # A max's (min's) operand by its formula -> (the variable holding it, its axes): its
    # ties compare that very tensor (pointwise.py, `step_eq`).
    reduced: dict[sp.Expr, tuple[str, tuple]] = field(default_factory=dict)
    # Of those, the ones the gradient's body computed again (ties.py), and per extremum
    # read (its name, its indices): the count of ties its last test took again (None: the
    # saved count), and the extrema whose saved count was read before any test.
    recomputed: set[sp.Expr] = field(default_factory=set)
    tie_counts: dict[tuple[str, tuple], str | None] = field(default_factory=dict)
    saved_ties: set[tuple[str, tuple]] = field(default_factory=set)

    def fresh(self) -> str:
        self.counter += 1
        return f"{_STEMS[self.part]}{self.counter}"

    def bind(self, value: ir.Expr, name: str | None = None, comment: str = "") -> str:
        """Assign `value` to a name (reusing an identical earlier step)."""
        if isinstance(value, ir.Var) and name is None:
            return value.name
        if name is None and value in self.memo:
            return self.memo[value]
        target = name or self.fresh()
        self.steps.append(ir.Assign(target, value, comment))
        self.memo.setdefault(value, target)
        if self.written_as:
            self.memo.setdefault(ir.rewrite(value, self.written_as.get), target)
        return target


def size_sources(program: Program) -> dict[Index, tuple[str, int] | sp.Expr]:
    """Where each index's size can be read: index -> (input, axis), or an integer
    expression (an extent: from `ranges`, or inferred)."""
    found: dict[Index, tuple[str, int] | sp.Expr] = {
        index: sources[0] for index, sources in program.dims if sources
    }
    for index, extent in program.extents:
        found.setdefault(index, extent)
    return found


def same_size(size_of: dict, i: Index, k: Index) -> bool:
    """Whether two indices are known to have the same size (`size_of`: `size_sources`)."""

    def key(index):
        source = size_of.get(index)
        if isinstance(source, tuple):
            return indexing.shape_symbol(*source)
        return source

    return key(i) is not None and key(i) == key(k)


def _plain(name: str) -> str:
    return name.replace("'", "_")


def _tensor_argument(body: _Body, value: ir.Expr) -> ir.Expr:
    """A constant passed to a TF function (`tf.maximum(0, A)`) as a tensor of the inputs'
    dtype: TF would make a Python number int32 or float32 in graph mode and under XLA."""
    if ir.names_in(value):
        return value
    body.uses_dtype = True
    return ir.Call("cast", (value, ir.Var("dtype")))


def _sum_of_squares(e: sp.Expr) -> bool:
    """Whether a pointwise product is nonnegative by its form: positive constants and
    sizes times even powers (every value is real)."""
    for factor in sp.Mul.make_args(e):
        if factor.is_positive:
            continue
        if isinstance(factor, sp.Pow) and factor.exp.is_integer and factor.exp.is_even:
            continue
        return False
    return True


def _preferred_letters(program: Program, backward: Backward) -> dict[Index, str]:
    """Einsum letters that read like the formula: each index's own name where possible.

    A gradient index takes the name the formula gives that axis of its tensor.
    """
    preferred: dict[Index, str] = {}
    levels = [*program.intermediates, *(o.level for o in program.outputs)]
    axis_names: dict[str, tuple[Index, ...]] = {lv.name: lv.indices for lv in levels}
    for level in levels:
        for index in level.indices:
            preferred.setdefault(index, index.name[0])
        for term in level.terms:
            for access in _accesses_written(term.expr):
                axis_names.setdefault(access.base.label.name, tuple(access.indices))
            for symbol in sorted(term.expr.free_symbols | set(term.summed), key=str):
                if isinstance(symbol, sp.Symbol) and symbol.name[:1].isalpha():
                    preferred.setdefault(symbol, symbol.name[0])
    for c in backward.contributions:
        names = axis_names.get(c.target, ())
        for p, named in zip(c.indices, names, strict=False):
            preferred.setdefault(p, named.name[0])
    return preferred


def _accesses_written(e: sp.Expr) -> list[sp.Indexed]:
    return sorted(e.atoms(sp.Indexed), key=sp.default_sort_key)


def _letters(groups, preferred: dict[Index, str]) -> dict[Index, str]:
    """Deterministic einsum letters for the indices in `groups` (order of appearance)."""
    chosen: dict[Index, str] = {}
    used: set[str] = set()
    symbols = list(dict.fromkeys(i for group in groups for i in group))
    for symbol in symbols:  # first pass: preferred letters
        letter = preferred.get(symbol)
        if letter and letter in LETTERS and letter not in used:
            chosen[symbol] = letter
            used.add(letter)
    for symbol in symbols:
        if symbol not in chosen:
            letter = next(c for c in LETTERS if c not in used)
            chosen[symbol] = letter
            used.add(letter)
    return chosen


def _word(labels, letters) -> str:
    return "".join(letters[i] for i in labels)


def _index_set(e: sp.Expr) -> set[Index]:
    return {i for a in e.atoms(sp.Indexed) for i in _position_indices(a)}


def _position_indices(access: sp.Indexed) -> list[Index]:
    """The indices an access reads at: its plain indices, and those inside the index
    expressions of an index-tensor lookup (`lo[s + 1]`, `tri[tid[p] - 1, v]`)."""
    found: list[Index] = []
    for position in access.indices:
        if isinstance(position, sp.Symbol):
            found.append(position)
        else:
            found += indexing.index_symbols(position)
    return list(dict.fromkeys(found))


def _axes_of(e: sp.Expr, out: tuple[Index, ...], summed: tuple[Index, ...]):
    """Axes for materializing a pointwise factor: its widest access's own order, so that
    `tanh(A[b,j,k])` is `tf.tanh(A)` (shared with the forward pass), not a transpose."""
    widest = sorted(
        e.atoms(sp.Indexed), key=lambda a: (-len(set(a.indices)), sp.default_sort_key(a))
    )
    order = [i for a in widest for i in _position_indices(a)]
    order += [i for i in (*out, *summed) if i in order]
    return tuple(dict.fromkeys(order))


def _print_order(e: sp.Expr):
    return sp.default_sort_key(e)


def _is_gradient(operand) -> bool:
    if isinstance(operand, tuple):  # a pointwise factor
        return False
    name = operand.base.label.name
    return name.startswith(("grad_", "_grad"))


def _is_simple(e: ir.Expr) -> bool:
    return isinstance(e, ir.Var)


def in_range(position: ir.Expr, size: ir.Expr) -> ir.Expr:
    """`0 <= position < size`: a read at `position` lies inside an axis of `size`."""
    return ir.Call(
        "logical_and", (ir.Binary(">=", position, ir.Lit("0")), ir.Binary("<", position, size))
    )


def both(valid: ir.Expr | None, test: ir.Expr) -> ir.Expr:
    """The mask `valid` (None: every read) narrowed by `test`."""
    return test if valid is None else ir.Call("logical_and", (valid, test))


def align(operand: ir.Expr, labels: tuple[Index, ...], target: tuple[Index, ...]) -> ir.Expr:
    """`operand` (axes `labels`) permuted and expanded to broadcast against `target`."""
    order = tuple(i for i in target if i in labels)
    perm = None
    if order != labels:
        perm = tuple(labels.index(i) for i in order)
    slots = tuple(order.index(i) if i in order else None for i in target)
    # Leading new axes are implied by broadcasting; drop them.
    while slots and slots[0] is None:
        slots = slots[1:]
    if perm is None and all(s is not None for s in slots):
        return operand
    return ir.View(operand, perm, slots)


def integer(e: sp.Expr) -> ir.Expr:
    """An integer SymPy expression (an extent) as code: sizes, int attrs, //, max."""
    if e.is_Integer:
        return ir.Lit(str(int(e)))
    if isinstance(e, sp.Symbol):
        shape = indexing.parse_shape_symbol(e)
        if shape is not None:
            return ir.AxisSize(*shape)
        return ir.Var(e.name)
    if isinstance(e, splits.ExactDiv):  # a composite axis' size over the others'
        where = ir.Lit(repr(str(e.args[0])))
        return ir.Call("exact_div", (integer(e.args[0]), integer(e.args[1]), where))
    if isinstance(e, sp.floor):
        numerator, denominator = sp.fraction(sp.together(e.args[0]))
        return ir.Binary("//", integer(numerator), integer(denominator))
    if isinstance(e, splits.FloorDiv | splits.Mod):  # `K // 2`, `K % 2` as written
        op = "//" if isinstance(e, splits.FloorDiv) else "%"
        return ir.Binary(op, integer(e.args[0]), integer(e.args[1]))
    if isinstance(e, sp.Max | sp.Min):
        function = "maximum" if isinstance(e, sp.Max) else "minimum"
        args = sorted(e.args, key=lambda a: (not a.is_Integer, sp.default_sort_key(a)))
        result = integer(args[-1])
        for arg in reversed(args[:-1]):
            result = ir.Call(function, (result, integer(arg)))
        return result
    if isinstance(e, sp.Add):
        terms = sorted(e.args, key=lambda t: (t.could_extract_minus_sign(), _print_order(t)))
        result = integer(terms[0])
        for term in terms[1:]:
            if term.could_extract_minus_sign():
                result = ir.Binary("-", result, integer(-term))
            else:
                result = ir.Binary("+", result, integer(term))
        return result
    if isinstance(e, sp.Pow) and e.exp.is_Integer and e.exp > 1:  # w*w, printed so
        result = integer(e.base)
        for _ in range(int(e.exp) - 1):
            result = ir.Binary("*", result, integer(e.base))
        return result
    if isinstance(e, sp.Mul):
        if e.could_extract_minus_sign():
            return ir.Negate(integer(-e))
        factors = sorted(sp.Mul.make_args(e), key=_print_order)
        result = integer(factors[0])
        for factor in factors[1:]:
            result = ir.Binary("*", result, integer(factor))
        return result
    raise AssertionError(f"cannot lower the integer expression {e!r}")


def reduction(body: _Body, function: str, operand: ir.Expr, axes: list[int]) -> ir.Expr:
    """`function` (a sum, max or min) over `axes`: one call per run of adjacent axes, the
    last run first. TF reduces adjacent axes as one, but several apart by transposing
    first: over axes 2 and 4 of a rank-6 tensor, two reductions take 3 ms where one
    takes 23 (a 2x2 max-pool of 32x64x64x32 floats)."""
    runs: list[list[int]] = []
    for axis in sorted(axes):
        if runs and runs[-1][-1] == axis - 1:
            runs[-1].append(axis)
        else:
            runs.append([axis])
    for run in reversed(runs):
        if not _is_simple(operand):
            operand = ir.Var(body.bind(operand))
        operand = ir.Call(function, (operand,), (("axis", ir.Lit(repr(run))),))
    return operand


def _merged_groups(args, target: tuple[Index, ...]) -> int:
    """How many axis groups TF's broadcasting sees for an elementwise op on `args` over
    `target`: adjacent axes merge when every operand either has both or lacks both."""
    patterns = [
        tuple(i in present for i in target) for present in (_index_set(a) for a in args) if present
    ]
    states = list(zip(*patterns, strict=True)) if patterns else []
    return 1 + sum(1 for a, b in itertools.pairwise(states) if a != b)

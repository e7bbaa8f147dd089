"""Stage 3: typed AST -> the op's math in canonical form (SymPy), validated.

Canonical form: every tensor the op computes -- each output, and each intermediate that a
nonlinearity forces -- is a `Level`: a sum of `Term`s, a term being a pointwise SymPy
expression (a product of accesses and elementwise functions) summed over a set of bound
indices. A sum nested inside a nonlinearity (`exp(sum(A*B, k))`, `1/sum(...)`) becomes
an intermediate `Level` over the sum's free indices and is then read like an input.

We keep our own index bookkeeping instead of `sympy.Sum`: `Sum.doit` and the array
converter are wrong or slow on batched formulas (see DESIGN.md, "Known pitfalls").
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from fractions import Fraction

import opt_einsum
import sympy as sp

from . import functions as fn
from . import indexing, internals, lets, logaddexp, masked_exp, sampling, segment_forms, splits
from . import lookups as lookups_
from .compared import compared_only
from .errors import SymgradError
from .gather_key import gather_key
from .indexing import Gather, written_name
from .parse import (
    MAX_INDICES,
    REDUCTIONS,
    Access,
    AttrRef,
    BinOp,
    Call,
    Condition,
    Constant,
    Equation,
    Group,
    IndexRef,
    Logic,
    Neg,
    Node,
    Num,
    Reduce,
    ShapeRef,
    Where,
    bracketed_tensors,
    index_names,
    parse_equation,
    parse_range,
)
from .range_hint import range_example
from .spec import OpSpec

Index = sp.Symbol
RELATIONS = {"<": sp.Lt, "<=": sp.Le, ">": sp.Gt, ">=": sp.Ge, "==": sp.Eq, "!=": sp.Ne}
DEFAULT_SIZE = 64  # an index's typical size when the spec gives none


@dataclass(frozen=True)
class Term:
    """`Σ_{summed} expr`: `expr` is pointwise (no sums inside) in tensor accesses."""

    expr: sp.Expr
    summed: tuple[Index, ...]  # bound indices, in order of first appearance


@dataclass(frozen=True)
class Level:
    """A tensor defined by a formula over its free `indices`.

    kind "sum":       value[indices] = Σ_terms Σ_{term.summed} term.expr
    kind "logsumexp": value[indices] = log Σ_{summed} exp(expr) for its single term;
                      the stable form of `log(sum(exp(u)))`, created for any `sum(exp(u))`.
    kind "max"/"min": value[indices] = max (min) over `summed` of expr, its single term;
                      `count` names the level counting the ties (for the gradient).
    kind "gather":    value[indices] = gather.source read at gather.positions; no terms.
    """

    name: str
    indices: tuple[Index, ...]
    terms: tuple[Term, ...]
    kind: str = "sum"
    gather: Gather | None = None
    count: str | None = None


@dataclass(frozen=True)
class Output:
    """One equation's left side: its level, and how its indices group into axes."""

    level: Level
    groups: tuple[tuple[Index, ...], ...]  # one tuple per axis; composite axes have several
    formula: str  # the equation as written


@dataclass(frozen=True)
class Program:
    """An op, ready for differentiation and lowering."""

    op: str
    source: str  # "symgrad.toml [ops.Name]"
    formulas: tuple[str, ...]
    inputs: tuple[str, ...]  # op input order
    ranks: tuple[tuple[str, int], ...]  # (tensor, rank) for inputs, then intermediates
    attrs: tuple[tuple[str, str], ...]
    no_gradient: tuple[str, ...]
    outputs: tuple[Output, ...]
    intermediates: tuple[Level, ...]  # in dependency order
    dims: tuple[tuple[Index, tuple[tuple[str, int], ...]], ...]  # index -> (input, axis)s
    # Sizes of indices that are no plain index of an input axis: integer expressions over
    # input sizes (`indexing.shape_symbol`) and int attrs, evaluated at call time.
    extents: tuple[tuple[Index, sp.Expr], ...] = ()
    index_inputs: tuple[str, ...] = ()  # integer index tensors: no gradient
    positive_attrs: tuple[str, ...] = ()  # int attrs that must be > 0 (strides)
    # `let` names and their integer values (over `_int_` attrs, input sizes and earlier
    # lets), in dependency order: generated code computes them at call time
    lets: tuple[tuple[str, sp.Expr], ...] = ()
    float_positions: tuple[str, ...] = ()  # the spec's `float_positions` (sampling.py)
    position_inputs: tuple[str, ...] = ()  # read only at float positions: int dtype is cast
    # (reading, defining, "h[axis 0]"): an internal tensor's axis, sized by a range of the
    # defining index, read plainly at an index sized otherwise; equal sizes are checked
    # at call time (`internals.share_axis`). Also (index, its ranged namesake, None) where
    # a plain axis sizes one index of a ranged name (`_extents`), and (ranged index,
    # (index tensor, axis), None) for an index tensor read plainly at it.
    same_sizes: tuple[tuple[Index, Index | tuple[str, int], str | None], ...] = ()

    def rank(self, tensor: str) -> int:
        return dict(self.ranks)[tensor]

    @property
    def value_inputs(self) -> tuple[str, ...]:
        """The inputs that hold values (not integer index tensors): they set the dtype."""
        return tuple(n for n in self.inputs if n not in self.index_inputs)

    def size_source(self, index: Index) -> tuple[str, int]:
        """An (input, axis) whose size is the size of `index`."""
        return dict(self.dims)[index][0]

    @property
    def compared(self) -> tuple[str, ...]:
        """The float inputs read only in `==` and `!=` (`compared.py`)."""
        return compared_only(self)


def tensor(name: str) -> sp.IndexedBase:
    """The SymPy handle of a named tensor (inputs, outputs, intermediates, grads)."""
    return sp.IndexedBase(name, real=True)


class ScalarAccess(sp.Indexed):
    """A read of a rank-0 tensor: a sum over every index (`sum(w[k], k)` inside a
    function). SymPy's `Indexed` needs an index; this one has none, and is otherwise an
    access like any other (`.base`, `.indices == ()`, found by `atoms(sp.Indexed)`)."""

    def __new__(cls, base, **kwargs):
        obj = sp.Expr.__new__(cls, base)
        obj._assumptions = base._assumptions.copy() if hasattr(base, "_assumptions") else {}
        return obj

    def _sympystr(self, printer) -> str:
        return printer._print(self.base.label)


def read(name: str, indices: tuple[Index, ...]) -> sp.Expr:
    """`name[indices]`, or the rank-0 tensor `name` when there are no indices."""
    return tensor(name)[indices] if indices else ScalarAccess(tensor(name))


def size_of(index: Index) -> sp.Symbol:
    """The size of an index's dimension as a symbol (`|k|`), used by `mean`."""
    return sp.Symbol(f"|{index.name}|", positive=True)


def index_attr(name: str) -> sp.Symbol:
    """An int attr used in index arithmetic (a position, a range, an index comparison)."""
    return sp.Symbol(f"_int_{name}", integer=True)


def index_of_size(symbol: sp.Symbol) -> str | None:
    name = symbol.name
    return name[1:-1] if name.startswith("|") and name.endswith("|") else None


def accesses(expr: sp.Expr) -> list[sp.Indexed]:
    """The distinct tensor accesses in an expression, in a deterministic order."""
    return sorted(expr.atoms(sp.Indexed), key=sp.default_sort_key)


def indices_in_order(expr: sp.Expr) -> list[Index]:
    """Indices used by accesses in `expr`, in a deterministic order of appearance. An int
    attr or let in a position (`indptr[s + tile_start]`, a chunk's start) is no index."""
    seen: dict[Index, None] = {}
    for access in _accesses_in_print_order(expr):
        for index in access.indices:
            for symbol in sorted(index.free_symbols, key=sp.default_sort_key):
                if not symbol.name.startswith("_int_"):
                    seen.setdefault(symbol, None)
    return list(seen)


def _accesses_in_print_order(expr: sp.Expr) -> list[sp.Indexed]:
    if isinstance(expr, sp.Indexed):
        return [expr]
    found: list[sp.Indexed] = []
    for arg in expr.args:
        found.extend(_accesses_in_print_order(arg))
    return found


class _Builder:
    """Turns one op's equations into Levels; owns the op-wide index and name bookkeeping."""

    def __init__(self, op: OpSpec) -> None:
        self.op = op
        self.attrs = {name: sp.Symbol(name, real=True) for name, _ in op.attrs}
        # Int attrs in index arithmetic stay Python ints in generated code (`_int_s`),
        # apart from the attr cast to the value dtype for arithmetic on values.
        self.int_attrs = {name: index_attr(name) for name, kind in op.attrs if kind == "int"}
        # `let` names: integers like int attrs, computed at call time (see lets.py)
        self.lets = {name: lets.symbol(name) for name in lets.names(op)}
        self.ranks: dict[str, int] = {}
        self.first_access: dict[str, tuple[str, int]] = {}
        self.input_order: list[str] = []
        self.dims: dict[Index, list[tuple[str, int]]] = {}
        self.used_names: set[str] = set()
        self.intermediates: list[Level] = []
        self.by_key: dict[str, tuple[Level, tuple[Index, ...]]] = {}
        self.equation: Equation | None = None
        self.sizes = dict(op.sizes)
        self.index_inputs: dict[str, int] = {}  # read inside brackets -> column
        self.value_inputs: dict[str, int] = {}  # read as values -> column
        self.bare_positions: set[str] = set()  # tensors read inside an index expression
        # Reads at computed positions: (position, source, axis), for inferring ranges.
        self.reads: list[tuple[sp.Expr, str, int]] = []
        # Every read at a computed position, index tensors in it too (for error hints).
        self.moving: list[tuple[sp.Expr, str, int]] = []
        # Indices used at computed positions -> (formula, column) of the first use.
        self.index_uses: dict[Index, tuple[str, int]] = {}
        # index -> the index an internal tensor's axis it reads plainly was computed over,
        # where no input axis sizes that one (a range, or inferred): it takes that size
        self.internal_axes: dict[Index, Index] = {}
        # int attrs an inferred range takes as > 0, or a range divides by
        self.positive_attrs: set[str] = set()
        # Internal tensors (not in `outputs`): name -> (level, formula, column), in order;
        # the ones some later equation reads; every left-hand name.
        self.internals: dict[str, tuple[Level, str, int]] = {}
        self.internal_reads: set[str] = set()
        self.defined: list[str] = []
        self.same_sizes: list[tuple[Index, Index | tuple[str, int], str | None]] = []

    # -- errors -----------------------------------------------------------------------

    def fail(self, message: str, col: int | None = None) -> SymgradError:
        text = self.equation.text if self.equation else None
        return SymgradError(message, formula=text if col is not None else None, column=col)

    # -- indices ----------------------------------------------------------------------

    def bind(self, name: str) -> Index:
        """A fresh index symbol for a bound (summed) index named `name` by the user."""
        candidate = name
        while candidate in self.used_names:
            candidate += "'"
        self.used_names.add(candidate)
        return sp.Symbol(candidate)

    # -- AST -> terms -----------------------------------------------------------------

    def convert(self, node: Node, scope: dict[str, Index]) -> list[Term]:
        """Convert a scope's expression: implicit sums attach to each additive term."""
        result: list[Term] = []
        for sign, part in _additive_parts(node, 1):
            implicit = self.implicit_indices(part, scope)
            inner_scope = dict(scope)
            bound = []
            for name in implicit:
                symbol = self.bind(name)
                inner_scope[name] = symbol
                bound.append(symbol)
            terms = self.factor(part, inner_scope)
            for symbol in bound:
                if not self.dims.get(symbol) and not self.sized_elsewhere(symbol):
                    raise self.fail(
                        f"index {written_name(symbol)!r} is summed over this term, but no tensor in it reads "
                        "it, so its size is unknown",
                        _value_col(part, written_name(symbol)),
                    )
            for term in terms:
                summed = _ordered_union(term.summed, bound)
                result.append(Term(sign * term.expr, summed))
        return _merge_pointwise(result)

    def implicit_indices(self, node: Node, scope: dict[str, Index]) -> list[str]:
        """Indices used in `node` that no enclosing scope binds (Einstein convention)."""
        found: dict[str, None] = {}

        def walk(n: Node, bound: frozenset[str]) -> None:
            if isinstance(n, IndexRef) and n.name not in scope and n.name not in bound:
                found.setdefault(n.name, None)  # an index's value: summed like an access
            if isinstance(n, Access):
                for index in n.indices:
                    if index not in scope and index not in bound:
                        found.setdefault(index, None)
            elif isinstance(n, Where):
                walk_condition(n.cond, bound)
                walk(n.then, bound)
                walk(n.otherwise, bound)
            elif isinstance(n, Reduce):
                walk(n.body, bound | set(n.indices))
            elif isinstance(n, Neg):
                walk(n.operand, bound)
            elif isinstance(n, BinOp):
                walk(n.left, bound)
                walk(n.right, bound)
            elif isinstance(n, Call):
                for arg in n.args:
                    walk(arg, bound)

        def walk_condition(c: Condition, bound: frozenset[str]) -> None:
            if isinstance(c, Logic):
                for arg in c.args:
                    walk_condition(arg, bound)
            elif c.on_indices:
                for index in index_names(c):
                    if index not in scope and index not in bound:
                        found.setdefault(index, None)
            else:  # values: sums inside bind their own indices
                for operand in c.operands:
                    walk(operand, bound)

        walk(node, frozenset())
        return list(found)

    def factor(self, node: Node, scope: dict[str, Index]) -> list[Term]:
        """Convert a node inside a scope where every index is already bound."""
        if isinstance(node, Num):
            return [Term(_number(node.value), ())]
        if isinstance(node, Constant):
            constants = {"pi": sp.pi, "e": sp.E, "inf": -fn.NEG_INF}
            return [Term(constants[node.name], ())]
        if isinstance(node, IndexRef):  # an index as a value
            return [Term(fn.index_value(indexing.index_values(scope[node.name])), ())]
        if isinstance(node, AttrRef):
            is_let = node.name in self.lets
            value = lets.value_symbol(node.name) if is_let else self.attrs[node.name]
            return [Term(value, ())]
        if isinstance(node, Access):
            return [Term(self.access(node, scope), ())]
        if isinstance(node, Neg):
            return [Term(-t.expr, t.summed) for t in self.factor(node.operand, scope)]
        if isinstance(node, Where):
            return [Term(self.where(node, scope), ())]
        if isinstance(node, Reduce) and node.kind not in REDUCTIONS:
            return [Term(self.extremum(node, scope), ())]
        if isinstance(node, Reduce):
            inner = dict(scope)
            bound = []
            for name in node.indices:
                symbol = self.bind(name)
                inner[name] = symbol
                bound.append(symbol)
            body = self.convert(node.body, inner)
            scale = sp.Integer(1)
            if node.kind == "mean":
                for symbol in bound:
                    scale /= size_of(symbol)
            for symbol in bound:
                if not self.dims.get(symbol) and not self.sized_elsewhere(symbol):
                    raise self.fail(
                        f"{node.kind}() over {symbol.name.rstrip(chr(39))!r}, "
                        "which no tensor in it uses",
                        node.col,
                    )
            return [Term(scale * t.expr, _ordered_union(t.summed, bound)) for t in body]
        if isinstance(node, BinOp):
            if node.op in "+-":
                sign = 1 if node.op == "+" else -1
                left = self.factor(node.left, scope)
                right = self.factor(node.right, scope)
                return _merge_pointwise(left + [Term(sign * t.expr, t.summed) for t in right])
            if node.op == "*":
                return self.product(self.factor(node.left, scope), self.factor(node.right, scope))
            if node.op == "/":
                numerator = self.factor(node.left, scope)  # first: inputs in written order
                denominator = self.pointwise(node.right, scope)
                if denominator == 0:
                    raise self.fail("division by zero", node.right.col)
                return self.product(numerator, [Term(1 / denominator, ())])
            base = self.pointwise(node.left, scope)
            exponent = self.pointwise(node.right, scope)
            if base == 0 and exponent.is_negative:
                raise self.fail("division by zero", node.col)
            return [Term(base**exponent, ())]
        if isinstance(node, Call):
            args = [self.pointwise(arg, scope) for arg in node.args]
            value = fn.apply(node.function, args)
            if log_space(value) != value:  # log(1 + exp(x)): one softplus, nothing nested
                return [Term(value, ())]
            if node.function == "log" and not isinstance(value, sp.log):
                return [Term(value, ())]  # log(exp(u)) is u: no exp to lift and underflow
            args = [self.share_nested(arg, node, scope) for arg in args]
            return [Term(fn.apply(node.function, args), ())]
        raise AssertionError(f"unexpected node {node!r}")  # parse only builds the above

    def pointwise(self, node: Node, scope: dict[str, Index]) -> sp.Expr:
        """A node used where only a pointwise value fits: sums become intermediates."""
        terms = self.factor(node, scope)
        written = [scope[name] for name in _written_indices(node) if name in scope]
        return self.as_pointwise(terms, list(dict.fromkeys(written)))

    def share_nested(self, arg: sp.Expr, node: Call, scope: dict[str, Index]) -> sp.Expr:
        """The argument of a function, as an intermediate when it holds a nonlinearity
        of its own (`tanh(tanh(A) * B)`): the chain rule through nested functions
        written out in one expression repeats every inner derivative once per outer
        level (quadratic code and work in the depth); one level per nonlinearity keeps
        reverse mode linear. Single functions stay fused with their gradient."""
        logsumexps = {lv.name for lv in self.intermediates if lv.kind == "logsumexp"}

        def nonlinear(f: sp.Function) -> bool:
            if segment_forms.is_segment_mask(f, self.index_inputs):
                return False
            read = {a.base.label.name for a in f.atoms(sp.Indexed)}
            # exp(L) of a logsumexp L is how `sum(exp(u))` reads: `log` undoes it.
            return bool(read) and not (isinstance(f, sp.exp) and read <= logsumexps)

        if not any(nonlinear(f) for f in arg.atoms(sp.Function)):
            return arg
        written = [scope[name] for name in _written_indices(node) if name in scope]
        return self.lift([Term(arg, ())], list(dict.fromkeys(written)))

    def as_pointwise(self, terms: list[Term], written: list[Index]) -> sp.Expr:
        """Terms as one pointwise expression: each summed term becomes an intermediate.

        Factors without tensors (numbers, attrs, sizes) stay outside the sum, so
        `mean(exp(u), k)` is `exp(L)/|k|` with L a stable logsumexp.
        """
        result = sp.Integer(0)
        for term in terms:
            if not term.summed:
                result += term.expr
                continue
            factors = sp.Mul.make_args(term.expr)
            constant = sp.Mul(*[f for f in factors if not f.atoms(sp.Indexed)])
            tensors = sp.Mul(*[f for f in factors if f.atoms(sp.Indexed)])
            # A summed index nothing reads is a factor |k|: the intermediate's key must
            # not forget it (sums over sizes 3 and 5 are different sums).
            used = _indices_of(tensors)
            for index in term.summed:
                if index not in used:
                    constant *= size_of(index)
            summed = tuple(i for i in term.summed if i in used)
            if not summed:
                result += constant * tensors
                continue
            result += constant * self.lift([Term(tensors, summed)], written)
        return _simplify(result)

    def product(self, left: list[Term], right: list[Term]) -> list[Term]:
        # A sum of several terms, some of them sums, times something that varies:
        # `(x - mean(x)) / sigma` stays one pointwise term (x - mu) / sigma instead of
        # being distributed into separate contractions.
        # A softmax over several sums is the exception: exp(-L) goes into each
        # (logaddexp.distributes).
        if _mixed_sum(left) and _varies(right) and not _softmax_of(left, right):
            left = [Term(self.as_pointwise(left, []), ())]
        if _mixed_sum(right) and _varies(left) and not _softmax_of(right, left):
            right = [Term(self.as_pointwise(right, []), ())]
        out = [
            Term(a.expr * b.expr, _ordered_union(a.summed, b.summed))
            for a, b in itertools.product(left, right)
        ]
        return _merge_pointwise(out)

    def chain(self, terms: list[Term], free: tuple[Index, ...]) -> list[Term]:
        """Contract three or more tensor factors pairwise, each pair an intermediate.

        Reverse mode then shares work the way a hand-written backward does: for
        `A*B*C`, ∂L/∂(AB) is computed once for both grad_A and grad_B (4 matmuls in the
        backward instead of 6). The pair comes from opt_einsum's optimal path.
        """
        out = []
        for term in terms:
            expr, summed = term.expr, term.summed
            while summed:
                factors = [f for f in sp.Mul.make_args(expr) if f.atoms(sp.Indexed)]
                if len(factors) < 3 or any(
                    len(set(a.indices)) != len(a.indices)
                    for f in factors
                    for a in f.atoms(sp.Indexed)
                ):
                    break
                index_sets = [_indices_of(f) for f in factors]
                pair = _first_pair(index_sets, free, self.sizes)
                if pair is None:
                    break
                first, second = pair
                others = set(free).union(*(s for n, s in enumerate(index_sets) if n not in pair))
                joined = index_sets[first] | index_sets[second]
                inner = tuple(i for i in summed if i in joined and i not in others)
                if not inner or joined <= set(inner):
                    break  # nothing to sum, or a scalar pair: leave it to one einsum
                product = factors[first] * factors[second]
                written = [i for i in indices_in_order(product) if i not in inner]
                access = self.lift([Term(product, inner)], written)
                expr = (
                    sp.Mul(
                        *[
                            f
                            for n, f in enumerate(sp.Mul.make_args(expr))
                            if f not in (factors[first], factors[second])
                        ]
                    )
                    * access
                )
                summed = tuple(i for i in summed if i not in inner)
            out.append(Term(expr, summed))
        return out

    def sized_elsewhere(self, symbol: Index) -> bool:
        """Whether an index without a plain input axis may still get a size: a range in
        the spec, or (checked once every formula is read) a range inferred from reads."""
        return (
            written_name(symbol) in dict(self.op.ranges)
            or symbol in self.index_uses
            or symbol in self.internal_axes
        )

    # -- computed positions -----------------------------------------------------------

    def access(self, node: Access, scope: dict[str, Index]) -> sp.Expr:
        for p in node.positions:  # `1.0 * t[..]` there would make it a float position
            self.bare_positions.update(a.tensor for a in _accesses_in(p))
        if sampling.is_sampled(node):
            return sampling.read(self, node, scope)
        if not node.plain or splits.reads_past(self, node):
            return self.gather(node, scope)
        if node.tensor in self.internals:
            return internals.read(self, node, scope)
        self.mark(self.value_inputs, node.tensor, node.col)
        return self.plain_access(node, scope)

    def int_symbol(self, name: str) -> sp.Symbol:
        """An int attr or a `let` in index arithmetic."""
        return self.int_attrs[name] if name in self.int_attrs else self.lets[name]

    def mark(self, uses: dict[str, int], name: str, col: int) -> None:
        """Record how a tensor is read; one read as an index tensor and as a value is
        refused: an index tensor holds integers and gets no gradient."""
        uses.setdefault(name, col)
        if name in self.index_inputs and name in self.value_inputs:
            hint = (
                "; to read at its values as float positions (by interpolation, with a "
                f"gradient), write `1.0 * {name}[...]` where it is read as an index, or "
                f'list it in the spec: `float_positions = ["{name}"]`'
                if name in self.bare_positions
                else ""
            )
            raise self.fail(
                f"tensor {name!r} is used both as an index tensor (inside brackets, or "
                "compared with an index) and as a value; an index tensor holds integers "
                f"and has no gradient{hint}",
                col,
            )

    def position(self, node: Node, scope: dict[str, Index], lookups: list) -> sp.Expr:
        """An index expression as SymPy: index symbols, int attrs, index-tensor reads."""
        if isinstance(node, IndexRef):
            symbol = scope[node.name]
            text = self.equation.text if self.equation else ""
            self.index_uses.setdefault(symbol, (text, node.col))
            return symbol
        if isinstance(node, Num):
            return _number(node.value)
        if isinstance(node, AttrRef):
            return self.int_symbol(node.name)
        if isinstance(node, Neg):
            return -self.position(node.operand, scope, lookups)
        if isinstance(node, BinOp) and node.op in ("//", "%"):
            return splits.position(self, node, scope, lookups)
        if isinstance(node, Group):
            return splits.Composite(*(self.position(i, scope, lookups) for i in node.indices))
        if isinstance(node, BinOp):
            left = self.position(node.left, scope, lookups)
            right = self.position(node.right, scope, lookups)
            return {"+": left + right, "-": left - right, "*": left * right}[node.op]
        if isinstance(node, Call):  # an index clamp: min(a, b), max(a, b)
            return lookups_.clamp(self, node, scope, lookups)
        if isinstance(node, Access) and lookups_.is_lookup(self, node):
            return lookups_.lookup(self, node, scope, lookups)
        if isinstance(node, Access):  # an index tensor
            if len(set(node.indices)) != len(node.indices):
                raise self.fail(
                    f"index tensor {node.tensor!r} is read with a repeated index; read it "
                    "with distinct indices",
                    node.col,
                )
            self.mark(self.index_inputs, node.tensor, node.col)
            lookups.append(node)
            return self.plain_access(node, scope)
        raise AssertionError(f"unexpected index node {node!r}")  # parse builds only these

    def gather(self, node: Access, scope: dict[str, Index]) -> sp.Expr:
        """A read at computed positions: an intermediate over the indices it uses."""
        name = node.tensor
        internal = name in self.internals  # computed by an earlier equation of the op
        if internal:
            self.internal_reads.add(name)
            if len(node.positions) != self.ranks[name]:
                raise self.fail(f"internal tensor {name!r} is read with another rank", node.col)
        else:
            self.mark(self.value_inputs, name, node.col)
            self.register(name, len(node.positions), node.col)
        lookups: list[Access] = []
        positions = tuple(self.position(p, scope, lookups) for p in node.positions)
        if not internal:  # an explicit range wins over the size of an axis read plainly
            positions = splits.past_axes(self, positions)
        if all(indexing.is_plain(p) for p in positions) and not internal:
            return self.simplified_access(name, positions)
        if all(indexing.is_plain(p) for p in positions):  # `h[i + 0, c]`: a plain read
            return internals.read_at(self, name, positions, node.col)
        written = [scope[i] for i in node.indices]
        return self.gather_level(name, positions, written, node.col)

    def gather_level(self, name: str, positions: tuple, written: list, col: int) -> sp.Expr:
        """`name` read at SymPy `positions` (some computed): the gather intermediate over
        the indices it uses, shared by equal reads."""
        internal = name in self.internals
        computed, grid = indexing.layout(positions, written)
        for axis, position in enumerate(positions):
            if indexing.is_plain(position) and internal:
                internals.share_axis(self, position, name, axis, col)
            elif indexing.is_plain(position):  # a plain index takes the axis size
                self.add_dim(position, name, axis)
            elif not internal:
                self.moving.append((position, name, axis))
                if lookups_.affine(position):
                    # Ranges are inferred from reads of inputs only: an internal tensor's
                    # size is known only once it is computed.
                    self.reads.append((position, name, axis))
        key = gather_key(name, positions, grid, frozenset(dict(self.op.ranges)))
        found = self.by_key.get(key)
        if found is not None:
            return tensor(found[0].name)[grid]
        level = Level(
            f"_g{len(self.intermediates) + 1}",
            grid,
            (),
            "gather",
            gather=Gather(name, positions, computed, tuple(False for _ in computed)),
        )
        self.intermediates.append(level)
        self.ranks[level.name] = len(grid)
        self.by_key[key] = (level, grid)
        return tensor(level.name)[grid]

    # -- conditions and extrema -------------------------------------------------------

    def where(self, node: Where, scope: dict[str, Index]) -> sp.Expr:
        cond = self.condition(node.cond, scope)
        then = self.pointwise(node.then, scope)
        otherwise = self.pointwise(node.otherwise, scope)
        # A masked exponential is the exponential of masked logits: sums of it stay in
        # log space (a causal softmax is as stable as the unmasked one).
        if isinstance(then, sp.exp) and otherwise == 0:
            return sp.exp(fn.select(cond, then.args[0], fn.NEG_INF))
        if isinstance(otherwise, sp.exp) and then == 0:
            return sp.exp(fn.select(cond, fn.NEG_INF, otherwise.args[0]))
        masked = masked_exp.masked_exp_times_reads(cond, then, otherwise, set(self.internals))
        return fn.select(cond, then, otherwise) if masked is None else masked

    def condition(self, node: Condition, scope: dict[str, Index]) -> sp.Basic:
        if isinstance(node, Logic):
            args = [self.condition(a, scope) for a in node.args]
            if node.op == "not":
                return sp.Not(args[0])
            return sp.And(*args) if node.op == "and" else sp.Or(*args)
        if node.on_indices:
            values = [self.index_value(o, scope) for o in node.operands]
        else:
            values = [self.pointwise(o, scope) for o in node.operands]
        parts = [
            RELATIONS[op](left, right, evaluate=False)
            for op, left, right in zip(node.ops, values, values[1:], strict=False)
        ]
        return parts[0] if len(parts) == 1 else sp.And(*parts)

    def index_value(self, node: Node, scope: dict[str, Index]) -> sp.Expr:
        """An index expression compared as a number: index i reads as `_iota[i]`, so
        lowering sees which axes the comparison varies over."""
        return indexing.index_values(self.position(node, scope, []))

    def extremum(self, node: Reduce, scope: dict[str, Index]) -> sp.Expr:
        """`max(expr, k, ...)`: an intermediate over the free indices, with a companion
        level counting the ties (TF's reduce_max gradient splits ties equally)."""
        inner = dict(scope)
        bound = []
        for name in node.indices:
            symbol = self.bind(name)
            inner[name] = symbol
            bound.append(symbol)
        body = self.pointwise(node.body, inner)
        for symbol in bound:
            if not self.dims.get(symbol) and not self.sized_elsewhere(symbol):
                raise self.fail(
                    f"{node.kind}() over {written_name(symbol)!r}, which no tensor in it uses",
                    node.col,
                )
        used = _indices_of(body) | {s for s in body.free_symbols if indexing.is_plain(s)}
        if not any(s in used for s in bound):
            return body  # the extremum of a constant over k is the constant
        written = [scope[n] for n in _written_indices(node.body) if n in scope]
        free = [s for s in dict.fromkeys(written) if s in used and s not in bound]
        free += [s for s in indices_in_order(body) if s not in free and s not in bound]
        summed = tuple(s for s in bound if s in used)
        key, canonical_free = _canonical_key(node.kind, [Term(body, summed)], free)
        if key in self.by_key:
            level, level_free = self.by_key[key]
            mapping = dict(zip(canonical_free, free, strict=True))
            return read(level.name, tuple(mapping[c] for c in level_free))
        number = len(self.intermediates) + 1
        name = f"_{node.kind}{number}"
        count_name = f"_ties{number}"
        value = read(name, tuple(free))  # rank 0 for an extremum over every index
        count = Level(count_name, tuple(free), (Term(fn.step_eq(body, value), summed),), "sum")
        level = Level(name, tuple(free), (Term(body, summed),), node.kind, count=count_name)
        self.intermediates += [level, count]
        self.ranks[name] = self.ranks[count_name] = len(free)
        self.by_key[key] = (level, tuple(canonical_free))
        return value

    def register(self, name: str, rank: int, col: int) -> None:
        if name in self.attrs or name in self.lets:
            kind = "an attr" if name in self.attrs else "a let"
            raise self.fail(f"{name!r} is {kind}, not a tensor; use it without indices", col)
        if self.equation and name == self.equation.output:
            raise self.fail(f"output {name!r} cannot be used on the right side", col)
        if rank == 0:
            raise self.fail(f"tensor {name!r} needs at least one index", col)
        known = self.ranks.get(name)
        if known is None:
            self.ranks[name] = rank
            self.first_access[name] = (self.equation.text if self.equation else "", col)
            self.input_order.append(name)
        elif known != rank:
            raise self.fail(
                f"tensor {name!r} is used with {_count(rank, 'index')} here but "
                f"{_count(known, 'index')} elsewhere",
                col,
            )

    def add_dim(self, symbol: Index, name: str, axis: int) -> None:
        self.dims.setdefault(symbol, [])
        if (name, axis) not in self.dims[symbol]:
            self.dims[symbol].append((name, axis))

    def simplified_access(self, name: str, positions: tuple[Index, ...]) -> sp.Indexed:
        """A read whose positions simplify to plain indices (`x[b, i + 0]`, `x[b, 1*i]`,
        `x[b, 2*i - i]`, as templated formulas write them) is the plain read `x[b, i]`."""
        for axis, symbol in enumerate(positions):
            self.add_dim(symbol, name, axis)
        return tensor(name)[positions]

    def plain_access(self, node: Access, scope: dict[str, Index]) -> sp.Indexed:
        name = node.tensor
        self.register(name, len(node.indices), node.col)
        symbols = []
        for axis, index in enumerate(node.indices):
            if index not in scope:  # pragma: no cover - implicit_indices binds all
                raise self.fail(f"index {index!r} is not bound", node.col)
            symbol = scope[index]
            self.add_dim(symbol, name, axis)
            symbols.append(symbol)
        return tensor(name)[tuple(symbols)]

    # -- intermediates ----------------------------------------------------------------

    def lift(self, terms: list[Term], written: list[Index]) -> sp.Expr:
        """A sum used inside a nonlinearity: define it once as an intermediate.

        Its free indices keep the order they are written in (`written`).
        """
        terms = [Term(_simplify(t.expr), t.summed) for t in terms]
        used: list[Index] = []
        for term in terms:
            for symbol in indices_in_order(term.expr):
                if symbol not in term.summed and symbol not in used:
                    used.append(symbol)
        free = [s for s in written if s in used] + [s for s in used if s not in written]
        terms = self.chain(terms, tuple(free))
        exp_sum = len(terms) == 1 and isinstance(terms[0].expr, sp.exp) and terms[0].summed
        kind = "logsumexp" if exp_sum else "sum"
        if exp_sum:
            terms = [Term(terms[0].expr.args[0], terms[0].summed)]
        key, canonical_free = _canonical_key(kind, terms, free)
        if key in self.by_key:
            level, level_free = self.by_key[key]
            mapping = dict(zip(canonical_free, free, strict=True))
            indices = tuple(mapping[c] for c in level_free)
        else:
            name = f"_{'lse' if exp_sum else 's'}{len(self.intermediates) + 1}"
            level = Level(name, tuple(free), tuple(terms), kind)
            self.intermediates.append(level)
            self.ranks[name] = len(free)
            self.by_key[key] = (level, tuple(canonical_free))
            indices = tuple(free)
        value = read(level.name, indices)
        return sp.exp(value) if exp_sum else value

    # -- equations --------------------------------------------------------------------

    def output(self, equation: Equation) -> Output:
        self.equation = equation
        name = equation.output
        indices = equation.output_indices
        seen: set[str] = set()
        for index in indices:
            if index in seen:
                raise self.fail(
                    f"output index {index!r} is repeated; each output index must be distinct",
                    equation.index_col(index, 1),
                )
            seen.add(index)
        if len(indices) > MAX_INDICES:
            raise self.fail(f"more than {MAX_INDICES} output indices", equation.output_col)
        scope = {index: sp.Symbol(index) for index in indices}
        self.used_names.update(indices)
        terms = self.convert(equation.rhs, scope)
        terms = [Term(_simplify(t.expr), t.summed) for t in terms if t.expr != 0]
        terms = self.chain(terms, tuple(scope[i] for i in indices))
        for index in indices:
            if not self.dims.get(scope[index]) and not self.sized_elsewhere(scope[index]):
                raise self.fail(
                    f"output index {index!r} is not used by any input, so its size is unknown",
                    equation.index_col(index),
                )
        for term in terms:
            if term.expr.has(sp.I):
                raise self.fail(
                    "the formula is not real-valued (log or power of a negative constant)", 0
                )
            if term.expr.has(sp.zoo, sp.nan, sp.oo, -sp.oo):
                raise self.fail("the formula divides by zero", 0)
        level = Level(name, tuple(scope[i] for i in indices), tuple(terms))
        groups = tuple(tuple(scope[i] for i in group) for group in equation.groups)
        self.equation = None
        return Output(level, groups, equation.text)


def _accesses_in(node: Node) -> list[Access]:
    """The tensor reads in an index expression (not those inside their brackets)."""
    if isinstance(node, Access):
        return [node]
    if isinstance(node, BinOp):
        return _accesses_in(node.left) + _accesses_in(node.right)
    if isinstance(node, Neg):
        return _accesses_in(node.operand)
    if isinstance(node, Call):
        return [a for arg in node.args for a in _accesses_in(arg)]
    return []


def _number(value: Fraction) -> sp.Expr:
    return sp.Rational(value.numerator, value.denominator)


def _simplify(expr: sp.Expr) -> sp.Expr:
    """Cheap canonical form: log of a positive product split (log(exp(L)/n) -> L - log n),
    exp products combined (exp(a)*exp(-b) -> exp(a-b)), sums of exponentials under a log
    or in a denominator kept in log space (`log_space`)."""
    return sp.powsimp(log_space(sp.expand_log(expr)), combine="exp")


def log_space(expr: sp.Expr) -> sp.Expr:
    """`a + c·exp(X)` (a, c positive constants) under a log or a negative power, rewritten
    so that exp(X) is never formed: with `s = softplus(X + log(c/a)) + log(a)`,

        log(a + c·exp(X)) = s        (a + c·exp(X)) ** -n = exp(-n·s)

    A `sum(exp(u), k)` is `exp(L)` with L its logsumexp, so `log(1 + S)` is
    `softplus(L)` and `exp(u) / (1 + S)` is `exp(u - softplus(L))`: finite wherever the
    result is, where exp(L) itself would overflow. A log of a sigmoid, or of one minus a
    sigmoid, is a softplus too.
    """

    def shifted(base: sp.Expr) -> sp.Expr | None:
        if not isinstance(base, sp.Add):
            return None
        exponentials = [t for t in base.args if t.atoms(sp.Indexed)]
        if len(exponentials) != 1:
            return None
        a = base - exponentials[0]
        c, power = exponentials[0].as_independent(sp.exp, as_Add=False)
        if not isinstance(power, sp.exp) or not (a.is_positive and c.is_positive):
            return None
        if c.atoms(sp.Indexed) or a.atoms(sp.Indexed):
            return None
        return fn.softplus(power.args[0] + sp.log(c / a)) + sp.log(a)

    def log_sigmoid(arg: sp.Expr) -> sp.Expr | None:
        """log(sigmoid(u)) = -softplus(-u), log(1 - sigmoid(u)) = -softplus(u): never
        log(0) where the sigmoid rounds to 0 or 1 (a logit of -100 in float32)."""
        if isinstance(arg, fn.sigmoid):
            return -fn.softplus(-arg.args[0])
        rest = arg - 1
        if isinstance(-rest, fn.sigmoid):
            return -fn.softplus((-rest).args[0])
        return None

    def rewrite(node: sp.Expr) -> sp.Expr:
        if isinstance(node, sp.log) and log_sigmoid(node.args[0]) is not None:
            return log_sigmoid(node.args[0])
        if isinstance(node, sp.log):
            stable = shifted(node.args[0])
            return node if stable is None else stable
        if isinstance(node, sp.Pow) and node.exp.is_negative:
            stable = shifted(node.base)
            return node if stable is None else sp.exp(node.exp * stable)
        return node

    def rewrite_any(node: sp.Expr) -> sp.Expr:
        stable = rewrite(node)  # one exponential: a softplus
        if stable is node:  # several: a logaddexp (logaddexp.py)
            stable = logaddexp.rewrite(node)
        return node if stable is None else stable

    return expr.replace(lambda n: isinstance(n, sp.log | sp.Pow), rewrite_any)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {'indices' if noun == 'index' else noun + 's'}"


def _mixed_sum(terms: list[Term]) -> bool:
    return len(terms) > 1 and any(t.summed for t in terms)


def _softmax_of(terms: list[Term], other: list[Term]) -> bool:
    return len(other) == 1 and not other[0].summed and logaddexp.distributes(terms, other[0].expr)


def _varies(terms: list[Term]) -> bool:
    return any(t.expr.atoms(sp.Indexed) for t in terms)


def _indices_of(expr: sp.Expr) -> frozenset[Index]:
    return frozenset(i for a in expr.atoms(sp.Indexed) for i in a.indices)


def _first_pair(index_sets, free, sizes: dict[str, int]) -> tuple[int, int] | None:
    """The first pairwise contraction of opt_einsum's optimal order for typical sizes."""

    symbols = sorted(set().union(*index_sets, free), key=sp.default_sort_key)
    if len(symbols) > 52:
        return None
    letter = {s: opt_einsum.get_symbol(n) for n, s in enumerate(symbols)}
    inputs = ",".join(
        "".join(letter[i] for i in sorted(s, key=sp.default_sort_key)) for s in index_sets
    )
    present = set().union(*index_sets)
    output = "".join(letter[i] for i in free if i in present)
    shapes = [
        tuple(
            sizes.get(i.name.rstrip("'"), DEFAULT_SIZE) for i in sorted(s, key=sp.default_sort_key)
        )
        for s in index_sets
    ]
    # The optimal search is exponential in the number of factors: greedy beyond six.
    strategy = "optimal" if len(index_sets) <= 6 else "greedy"
    path, _ = opt_einsum.contract_path(
        f"{inputs}->{output}", *shapes, shapes=True, optimize=strategy
    )
    first, second = sorted(path[0])
    return first, second


def _condition_indices(node: Condition) -> list[str]:
    """Index names a condition uses (as numbers or inside index tensors), written order."""
    if isinstance(node, Logic):
        return [name for a in node.args for name in _condition_indices(a)]
    names: list[str] = []
    for operand in node.operands:
        names += _written_indices(operand) if not node.on_indices else index_names(operand)
    return names


def _value_col(node: Node, name: str) -> int | None:
    """The column of the first use of index `name` as a value under `node`."""
    if isinstance(node, IndexRef):
        return node.col if node.name == name else None
    children = {
        Neg: lambda n: [n.operand],
        BinOp: lambda n: [n.left, n.right],
        Call: lambda n: list(n.args),
        Reduce: lambda n: [n.body],
        Where: lambda n: [n.then, n.otherwise],
    }.get(type(node), lambda n: [])(node)
    for child in children:
        col = _value_col(child, name)
        if col is not None:
            return col
    return getattr(node, "col", None)


def _written_indices(node: Node) -> list[str]:
    """Index names of the accesses under `node`, in written order."""
    if isinstance(node, IndexRef):  # an index's value
        return [node.name]
    if isinstance(node, Access):
        return list(node.indices)
    if isinstance(node, Where):  # the values' indices first: they fix the axis order
        return (
            _written_indices(node.then)
            + _written_indices(node.otherwise)
            + _condition_indices(node.cond)
        )
    if isinstance(node, Reduce):
        return _written_indices(node.body)
    if isinstance(node, Neg):
        return _written_indices(node.operand)
    if isinstance(node, BinOp):
        return _written_indices(node.left) + _written_indices(node.right)
    if isinstance(node, Call):
        return [name for arg in node.args for name in _written_indices(arg)]
    return []


def _additive_parts(node: Node, sign: int) -> list[tuple[int, Node]]:
    if isinstance(node, BinOp) and node.op in "+-":
        right_sign = sign if node.op == "+" else -sign
        return _additive_parts(node.left, sign) + _additive_parts(node.right, right_sign)
    if isinstance(node, Neg):
        return _additive_parts(node.operand, -sign)
    return [(sign, node)]


def _ordered_union(first: tuple[Index, ...], second) -> tuple[Index, ...]:
    return tuple(dict.fromkeys((*first, *second)))


def _merge_pointwise(terms: list[Term]) -> list[Term]:
    """Pointwise terms (no sums) add up into one, so `(A + B) * C` stays a product."""
    pointwise = [t.expr for t in terms if not t.summed]
    summed = [t for t in terms if t.summed]
    if len(pointwise) <= 1 and len(pointwise) + len(summed) == len(terms):
        merged = [Term(pointwise[0], ())] if pointwise else []
        return merged + summed
    return [Term(sp.Add(*pointwise), ())] + summed


def _canonical_key(kind: str, terms: list[Term], free: list[Index]):
    """A name-independent key, so the same sub-formula written twice is computed once.

    A free index is renamed only where the sub-formula reads a tensor plainly at it: that
    read sizes it, so the same formula at another index is the same tensor. An index read
    only by value or at a position (`sin(i*f)`, `x[i + 0.5]`) keeps its name: its size is
    its own, and `sin(i*f) + sin(j*f)` shared one level over i's size (read at j, it gave
    0 for 0.64, or an output of the wrong shape, wherever i and j differ in size)."""
    plain = {
        p
        for t in terms
        for a in t.expr.atoms(sp.Indexed)
        if not indexing.is_iota(a)
        for p in a.indices
        if isinstance(p, sp.Symbol)
    }
    named = [(n, i.name) for n, i in enumerate(free) if i not in plain]
    canonical_free = [sp.Symbol(f"_f{n}") for n in range(len(free))]
    bound = list(dict.fromkeys(s for t in terms for s in t.summed))
    best = None
    for order in (
        itertools.permutations(range(len(bound))) if len(bound) <= 4 else [tuple(range(len(bound)))]
    ):
        mapping = dict(zip(free, canonical_free, strict=True))
        mapping.update({bound[n]: sp.Symbol(f"_b{k}") for n, k in enumerate(order)})
        text = repr(
            sorted(
                (sp.srepr(t.expr.xreplace(mapping)), sorted(mapping[s].name for s in t.summed))
                for t in terms
            )
        )
        if best is None or text < best:
            best = text
    return f"{kind}:{len(free)}:{named}:{best}", canonical_free


def build(op: OpSpec) -> Program:
    """Validate an op's formulas and bring them into canonical form."""
    builder = _Builder(op)
    attrs = frozenset(builder.attrs) | frozenset(builder.lets)
    int_attrs = frozenset(n for n, kind in op.attrs if kind == "int") | frozenset(builder.lets)
    equations = []
    # the tensors the op reads at integer positions inside brackets (any equation's)
    written = frozenset(text.split("[", 1)[0].strip() for text in op.formulas)
    bracketed = bracketed_tensors(
        op.formulas, attrs, int_attrs, frozenset(op.float_positions) | written
    )
    for text in op.formulas:
        try:
            # A tensor an earlier equation computes holds floats: inside brackets it is a
            # float position (a sampled read), never an integer index tensor.
            computed = frozenset(e.output for e in equations)
            floats = frozenset(op.float_positions) | computed
            equations.append(parse_equation(text, attrs, int_attrs, floats, bracketed))
        except SymgradError as exc:
            raise exc.located(op.source, text) from None
    # Output indices name one dimension across all equations; a sum in one equation
    # over a name another equation outputs is a different index (primed).
    for equation in equations:
        builder.used_names.update(equation.output_indices)
    outputs: list[Output] = []
    for equation in equations:
        if equation.output in builder.defined:
            raise SymgradError(
                f"{equation.output!r} is computed by two equations",
                where=op.source,
                formula=equation.text,
                column=equation.output_col,
            )
        builder.defined.append(equation.output)
        try:
            if internals.is_internal(op.outputs, equation):
                internals.define(builder, equation)
            else:
                outputs.append(builder.output(equation))
        except SymgradError as exc:
            raise exc.located(op.source, equation.text) from None
    program = _check(builder, outputs)
    found = sampling.position_inputs(equations, program.inputs, program.index_inputs)
    return dataclasses.replace(program, position_inputs=found)


def _check(builder: _Builder, outputs: list[Output]) -> Program:
    op = builder.op
    where = op.source

    def fail(message: str) -> SymgradError:
        return SymgradError(message, where=where)

    names = [o.level.name for o in outputs]
    for name in names:
        if names.count(name) > 1:
            raise fail(f"output {name!r} is defined twice")
    inputs_used = [n for n in builder.input_order if not n.startswith("_")]
    internals.check(builder, inputs_used, fail)
    for output in names:
        if output in inputs_used:
            raise fail(f"output {output!r} is also used as an input")
        if output in builder.attrs:
            raise fail(f"output {output!r} has the name of an attr")
        if output in {n for n, _ in op.lets}:
            raise fail(f"output {output!r} has the name of a let")
    for name in inputs_used:
        if name in builder.attrs:
            raise fail(f"{name!r} is both an attr and a tensor")
    # Inside brackets the name would be the index, outside them the attr or let: `x[b,i] +
    # i` with a let `i` added the let where the index was meant, without a word.
    indices = {indexing.written_name(i) for i in _all_indices(builder, outputs)}
    for kind, name in (*(("attr", n) for n, _ in op.attrs), *(("let", n) for n, _ in op.lets)):
        if name in indices:
            raise fail(f"{kind} {name!r} has the name of an index of the formula; rename one")
    if op.inputs is not None:
        missing = [n for n in op.inputs if n not in inputs_used]
        extra = [n for n in inputs_used if n not in op.inputs]
        if missing:
            raise fail(f"`inputs` lists {', '.join(map(repr, missing))}, which no formula uses")
        if extra:
            raise fail(
                f"`inputs` does not list {', '.join(map(repr, extra))}, which the formula uses"
            )
        inputs = op.inputs
    else:
        inputs = tuple(inputs_used)
    if not inputs:
        raise fail("the formula uses no input tensor")
    for name in op.no_gradient:
        if name not in inputs:
            raise fail(f"`no_gradient` names {name!r}, which is not an input")
    for name in op.float_positions:
        if name not in inputs:
            raise fail(f"`float_positions` names {name!r}, which is not an input")
    # Every index the formulas use, as `ranges` sees them: one sized by a range (no plain
    # input axis) has a typical size too (a conv's `i`, a segment sum's `v`).
    index_names = {symbol.name.rstrip("'") for symbol in builder.dims}
    index_names |= {written_name(s) for s in _all_indices(builder, outputs)}
    for index, _ in op.sizes:
        if index not in index_names:
            raise fail(f"`sizes` names index {index!r}, which no formula uses")
    used_symbols: set[sp.Basic] = set()
    for level in (*[o.level for o in outputs], *builder.intermediates):
        for t in level.terms:
            used_symbols |= t.expr.free_symbols
        if level.gather is not None:
            for position in level.gather.positions:
                used_symbols |= position.free_symbols
    int_attrs = frozenset(builder.int_attrs) | frozenset(builder.lets)
    for _, text in op.ranges:
        try:
            read = _range_attrs(parse_range(text, int_attrs))
            used_symbols |= {builder.attrs[n] for n in read if n in builder.attrs}
        except SymgradError:
            pass  # reported with its place by _extents
    used_symbols |= {builder.attrs[n] for n in lets.attrs_read(op)}
    used_symbols |= {builder.attrs[n] for n, s in builder.int_attrs.items() if s in used_symbols}

    ranks = tuple(
        (n, builder.ranks[n]) for n in (*inputs, *(l.name for l in builder.intermediates))
    )
    dims = tuple(
        (index, tuple((t, a) for t, a in sources if not t.startswith("_")))
        for index, sources in builder.dims.items()
    )
    index_inputs = tuple(n for n in inputs if n in builder.index_inputs)
    if index_inputs and all(n in builder.index_inputs for n in inputs):
        raise fail("every input is an index tensor; the op needs a value input")
    let_values = lets.definitions(builder, _range_expr)
    # A range that does not parse, or one missing, is the error to report, not the attr
    # it would have used (`attrs = { V = "int" }` without `ranges = { v = "V" }`).
    unused = [a for a in builder.attrs if builder.attrs[a] not in used_symbols]
    spare = tuple(a for a in unused if a in builder.int_attrs)
    extents = _extents(builder, outputs, fail, spare)
    _ranged_index_reads(builder, outputs, extents)
    if unused:
        raise fail(f"attr {unused[0]!r} is declared but no formula uses it")
    intermediates = tuple(_bounded(level, extents, builder) for level in builder.intermediates)
    no_gradient = (*op.no_gradient, *(n for n in index_inputs if n not in op.no_gradient))
    return Program(
        op=op.name,
        source=where,
        formulas=op.formulas,
        inputs=tuple(inputs),
        ranks=ranks,
        attrs=op.attrs,
        no_gradient=tuple(no_gradient),
        outputs=tuple(outputs),
        intermediates=intermediates,
        dims=dims,
        extents=tuple(extents.items()),
        index_inputs=index_inputs,
        positive_attrs=tuple(sorted(builder.positive_attrs)),
        lets=let_values,
        float_positions=builder.op.float_positions,
        same_sizes=tuple(dict.fromkeys(builder.same_sizes)),
    )


def _all_indices(builder: _Builder, outputs: list[Output]) -> list[Index]:
    """Every index symbol of the op, in a deterministic order."""
    found: dict[Index, None] = {}
    for level in (*(o.level for o in outputs), *builder.intermediates):
        for index in level.indices:
            found.setdefault(index, None)
        for term in level.terms:
            for index in (*indices_in_order(term.expr), *term.summed):
                found.setdefault(index, None)
    return [i for i in found if indexing.is_plain(i)]


def _range_attrs(node: Node) -> set[str]:
    if isinstance(node, AttrRef):
        return {node.name}
    if isinstance(node, Neg):
        return _range_attrs(node.operand)
    if isinstance(node, BinOp):
        return _range_attrs(node.left) | _range_attrs(node.right)
    return set()


def _range_expr(node: Node, builder: _Builder, index: str, fail) -> sp.Expr:
    """A `ranges` entry as an integer SymPy expression over input sizes and int attrs."""
    if isinstance(node, Num):
        return _number(node.value)
    if isinstance(node, AttrRef):
        return builder.int_symbol(node.name)
    if isinstance(node, ShapeRef):
        rank = builder.ranks.get(node.tensor)
        if rank is None or node.tensor.startswith("_"):
            raise fail(
                f"range of {index!r} reads {node.tensor}.shape, but no formula uses "
                f"a tensor {node.tensor!r}"
            )
        if not 0 <= node.axis < rank:
            raise fail(
                f"range of {index!r} reads {node.tensor}.shape[{node.axis}], but "
                f"{node.tensor!r} has rank {rank}"
            )
        return indexing.shape_symbol(node.tensor, node.axis)
    if isinstance(node, Neg):
        return -_range_expr(node.operand, builder, index, fail)
    if isinstance(node, BinOp):
        left = _range_expr(node.left, builder, index, fail)
        right = _range_expr(node.right, builder, index, fail)
        if node.op == "//":
            if right == 0:
                raise fail(f"range of {index!r} divides by zero")
            # An int attr it divides by is checked > 0 at call time, not left to divide
            # by zero there.
            builder.positive_attrs |= {
                x.name.removeprefix("_int_")
                for x in right.free_symbols
                if x.name.startswith("_int_")
            }
            return sp.floor(left / right)
        return {"+": left + right, "-": left - right, "*": left * right}[node.op]
    raise AssertionError(f"unexpected range node {node!r}")


def _ranged_index_reads(builder: _Builder, outputs: list[Output], extents: dict) -> None:
    """Segment ids read at an index `ranges` sizes (`where(seg[n] == v, ..)` with a range
    on n) are read whole by the segment kernels: their axis must have the range's size,
    checked at call time (`Program.same_sizes`, deduplicated when the Program is made).
    (An index tensor read otherwise at a ranged index, CSR offsets `indptr[s]` over
    `indptr.shape[0] - 1` segments, reads within its axis.)"""
    levels = [*builder.intermediates, *(o.level for o in outputs)]
    for level in levels:
        for term in level.terms:
            for relation in term.expr.atoms(sp.Eq, sp.Ne):
                found = segment_forms.segment_condition(sp.Eq(*relation.args), builder.index_inputs)
                if found is None:
                    continue
                access, _ = found
                name = access.base.label.name
                for axis, position in enumerate(access.indices):
                    if isinstance(position, sp.Symbol) and position in extents:
                        builder.same_sizes.append((position, (name, axis), None))


def _extents(
    builder: _Builder, outputs: list[Output], fail, spare: tuple[str, ...] = ()
) -> dict[Index, sp.Expr]:
    """Sizes of the indices that no plain input axis gives: from `ranges`, else inferred
    (output indices only) as the largest range whose reads stay in bounds at the top.
    `spare`: int attrs no formula or range uses, suggested for an index without one."""
    op = builder.op
    int_attrs = frozenset(n for n, kind in op.attrs if kind == "int") | frozenset(builder.lets)
    symbols = _all_indices(builder, outputs)
    known: dict[Index, sp.Expr] = {}
    for symbol in symbols:
        sources = [(t, a) for t, a in builder.dims.get(symbol, []) if not t.startswith("_")]
        if sources:
            known[symbol] = indexing.shape_symbol(*sources[0])
    extents: dict[Index, sp.Expr] = {}
    names = {written_name(s) for s in symbols}
    for name, text in op.ranges:
        if name not in names:
            raise fail(f"`ranges` names index {name!r}, which no formula uses")
        try:
            node = parse_range(text, int_attrs)
        except SymgradError as exc:
            raise SymgradError(
                f"range of index {name!r}: {exc.message}",
                where=op.source,
                formula=exc.formula,
                column=exc.column,
            ) from None
        written = _range_expr(node, builder, name, fail)
        if written.is_number and written < 0:  # negative at every size: a slip, not a size
            raise fail(f"range of index {name!r} is {written}; a size cannot be negative")
        value = sp.Max(0, written)  # one negative at some sizes only: empty there
        # One name may be several indices: an internal tensor's output index and a sum
        # over that name in a later equation (primed). The range sizes those that no
        # plain read sizes; it is refused only where a plain read sizes every one.
        named = [s for s in symbols if written_name(s) == name]
        unsized = [s for s in named if s not in known]
        if not unsized:
            tensor_name, axis = indexing.parse_shape_symbol(known[named[0]])
            raise fail(
                f"index {name!r} is a plain index of {tensor_name} (axis {axis}) and "
                "takes its size from there; remove it from `ranges`"
            )
        for symbol in unsized:
            extents[symbol] = value
        # where the name's other indices take a plain axis's size, it must be the range's
        # (checked at call time: `Program.same_sizes`)
        builder.same_sizes += [(s, unsized[0], None) for s in named if s in known]
    sized = {**known, **extents}
    output_indices = {i for o in outputs for i in o.level.indices}
    pending = [s for s in symbols if s not in sized]
    split_reads = [r for r in builder.reads if splits.has_split(r[0])]
    for symbol, value in splits.infer(split_reads, sized, pending).items():
        extents[symbol] = sized[symbol] = value
        pending.remove(symbol)
    while pending:
        progress = False
        for symbol in list(pending):
            if builder.internal_axes.get(symbol) in sized:  # an internal tensor's axis
                extents[symbol] = sized[symbol] = sized[builder.internal_axes[symbol]]
                pending.remove(symbol)
                progress = True
                continue
            if symbol not in output_indices:
                continue
            bounds = []
            blocked = False
            for position, source, axis in builder.reads:
                if symbol not in position.free_symbols:
                    continue
                size = indexing.shape_symbol(source, axis)
                bound = indexing.upper_bound(position, symbol, size, sized)
                if bound is None:
                    blocked = True
                    break
                bounds.append(bound)
                # The bound takes int attrs that scale indices to be positive: say so
                # at call time rather than compute a wrong range.
                for term in sp.Add.make_args(sp.expand(position)):
                    if any(indexing.is_plain(x) for x in term.free_symbols):
                        builder.positive_attrs |= {
                            x.name.removeprefix("_int_")
                            for x in term.free_symbols
                            if x.name.startswith("_int_")
                        }
            if blocked or not bounds:
                continue
            value = sp.Max(0, sp.Min(*bounds)) if len(bounds) > 1 else sp.Max(0, bounds[0])
            extents[symbol] = sized[symbol] = value
            pending.remove(symbol)
            progress = True
        if not progress:
            break
    # A summed index can never be inferred: name it first, it is the one to fix.
    pending.sort(key=lambda symbol: symbol in output_indices)
    for symbol in pending:
        kind = "output index" if symbol in output_indices else "index"
        text, col = builder.index_uses.get(symbol, (None, None))
        raise SymgradError(
            f"{kind} {written_name(symbol)!r} has no range: no input axis is read at it plainly"
            f"{'' if symbol in output_indices else ' and it is summed'}; give it one in "
            f"`ranges`, "
            + (
                splits.unsized_hint(symbol, builder.reads)
                or range_example(
                    symbol,
                    written_name(symbol),
                    builder.moving,
                    sized,
                    list(builder.value_inputs),
                    spare,
                )
            ),
            where=op.source,
            formula=text,
            column=col,
        )
    return extents


def _bounded(level: Level, extents: dict[Index, sp.Expr], builder: _Builder) -> Level:
    """Mark the computed axes of a gather whose reads are provably in bounds: no mask.

    Below: the smallest position is a non-negative number. Above: an index of the
    position has an inferred range, which by construction keeps every read of it in
    bounds (ranges from the spec promise nothing)."""
    if level.gather is None:
        return level
    inferred = {s for s in extents if written_name(s) not in dict(builder.op.ranges)}
    flags = []
    for axis in level.gather.computed:
        position = level.gather.positions[axis]
        if not lookups_.affine(position) or level.gather.source in builder.internals:
            flags.append(False)
            continue
        if splits.has_split(position):
            size = indexing.shape_symbol(level.gather.source, axis)
            flags.append(splits.bounded(position, size, extents, inferred))
            continue
        indices = [x for x in position.free_symbols if indexing.is_plain(x)]
        signs = {x: indexing.sign(indexing.coefficient(position, x)) for x in indices}
        offset = sp.expand(position).subs({x: 0 for x in indices})
        # Below: every index scaled up (a positive number or int attrs, checked positive
        # at call time) from a non-negative number; `i - k + 1` can go below 0.
        below = offset.is_number and offset >= 0 and all(v == 1 for v in signs.values())
        above = any(x in inferred and signs[x] == 1 for x in indices)
        flags.append(bool(below and above))
    gather = Gather(
        level.gather.source, level.gather.positions, level.gather.computed, tuple(flags)
    )
    return Level(level.name, level.indices, level.terms, level.kind, gather, level.count)

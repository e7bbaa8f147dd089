"""Stage 5: canonical math -> IR (einsum contractions and elementwise steps).

The same rule lowers the forward pass and every gradient: a sum of terms, each term a
product of tensor accesses and pointwise factors summed over some indices, becomes one
einsum per term (pointwise factors materialized first, over their own indices only),
and the terms are added after aligning their axes. Concretely:

- A pointwise factor whose indices no single operand covers (`(x[b,i,k] - x[b,j,k])**2`)
  would be a tensor bigger than any operand; when it is a polynomial, the term is expanded
  into monomials instead, each of which contracts directly.
- Three or more operands contract pairwise in the order `opt_einsum` finds optimal for
  representative sizes; TF's einsum would guess with unknown dims taken as 1.
- A Kronecker delta left between two gradient indices becomes an identity-matrix operand
  (`tf.eye`) in the einsum, which places the result on the diagonal; einsum itself cannot
  write repeated output labels.
- Identical expressions are computed once per function body (hash-consing on the frozen
  IR), which shares work across the gradients of all inputs.
"""

from __future__ import annotations

import itertools
import string
from dataclasses import dataclass, field

import opt_einsum
import sympy as sp

from . import functions as fn
from . import indexing, ir, patterns
from .derive import Backward, Contribution, Scatter, fresh_indices, grad_name
from .indexing import IOTA
from .model import Index, Level, Program, index_of_size, tensor
from .notation import gradient_lines

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
}
BINARY = {fn.maximum: "maximum", fn.minimum: "minimum"}
MASKS = {fn.step_ge: ">=", fn.step_le: "<=", fn.step_eq: "=="}
RELATIONS = {sp.Lt: "<", sp.Le: "<=", sp.Gt: ">", sp.Ge: ">=", sp.Eq: "==", sp.Ne: "!="}
LOGIC = {sp.And: "logical_and", sp.Or: "logical_or"}


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
    stem: str = "_t"  # temporaries: _f1.. in the forward, _t1.. in the backward
    # A cheaper way to compute a value from the inputs alone, for `gradient(op)`.
    recompute: dict[str, ir.Expr] = field(default_factory=dict)

    def fresh(self) -> str:
        self.counter += 1
        return f"{self.stem}{self.counter}"

    def bind(self, value: ir.Expr, name: str | None = None, comment: str = "") -> str:
        """Assign `value` to a name (reusing an identical earlier step)."""
        if isinstance(value, ir.Var) and name is None:
            return value.name
        if name is None and value in self.memo:
            return self.memo[value]
        target = name or self.fresh()
        self.steps.append(ir.Assign(target, value, comment))
        self.memo.setdefault(value, target)
        return target


def _plain(name: str) -> str:
    return name.replace("'", "_")


class Lowerer:
    """Lowers one op's Program (and its Backward) into an `ir.Module`."""

    def __init__(self, program: Program, backward: Backward) -> None:
        self.program = program
        self.backward = backward
        # Where each index's size can be read: index -> (input, axis), or an integer
        # expression (an extent: from `ranges`, or inferred).
        self.size_of: dict[Index, tuple[str, int] | sp.Expr] = {
            index: sources[0] for index, sources in program.dims if sources
        }
        for index, extent in program.extents:
            self.size_of.setdefault(index, extent)
        self.levels: dict[str, Level] = {lv.name: lv for lv in program.intermediates}
        for output in program.outputs:
            self.levels[output.level.name] = output.level
        self.preferred = _preferred_letters(program, self.backward)
        # Gathers that are exactly a convolution with the one term reading them.
        self.convolutions = patterns.convolutions(program)
        # Set while lowering the operands of one elementwise op whose broadcast patterns
        # TF merges into few enough groups: no operand needs tiling.
        self.broadcast_safe = False
        self.is_output: set[str] = {o.level.name for o in program.outputs}
        # Logsumexp levels, by their name and by the name of an output equal to one.
        self.logsumexp_of: dict[str, Level] = {
            lv.name: lv for lv in program.intermediates if lv.kind == "logsumexp"
        }
        for output in program.outputs:
            terms = output.level.terms
            if len(terms) == 1 and not terms[0].summed and isinstance(terms[0].expr, sp.Indexed):
                source = self.logsumexp_of.get(terms[0].expr.base.label.name)
                if source is not None and tuple(terms[0].expr.indices) == output.level.indices:
                    self.logsumexp_of[output.level.name] = source
                    self.is_output.add(source.name)

    # -- sizes ------------------------------------------------------------------------

    def index_size(self, body: _Body, index: Index) -> str:
        source = self.size_of.get(index)
        if source is None:
            raise AssertionError(f"no size known for index {index}")
        for var, known in body.sizes.items():
            if known == source:
                return var
        name = index.name if not index.name.startswith("_") else self.preferred.get(index, "")
        var = f"_n_{_plain(name.rstrip(chr(39)))}" if name else ""
        if not name or var in body.sizes:
            if isinstance(source, tuple):
                var = f"_n_{source[0]}_{source[1]}"
            else:
                var = f"_n_{len(body.sizes) + 1}"
        body.sizes[var] = source
        return var

    def position_int(self, size: ir.Expr) -> ir.Expr:
        """A size as an integer of the positions' dtype: int64 when index tensors take
        part (an int64 id must not wrap around in int32 arithmetic), else as it is."""
        if not self.program.index_inputs:
            return size
        return ir.Call("to_int64", (size,))

    def axis_size(self, body: _Body, tensor_name: str, axis: int) -> str:
        """The variable holding the size of one axis of an input."""
        source = (tensor_name, axis)
        for var, known in body.sizes.items():
            if known == source:
                return var
        var = f"_n_{tensor_name}_{axis}"
        body.sizes[var] = source
        return var

    def register_axes(self, tensor_name: str, labels: tuple[Index, ...]) -> None:
        """Teach `size_of` the indices of a tensor's axes (for gradient indices)."""
        axes = self.axis_sources(tensor_name)
        for label, source in zip(labels, axes, strict=True):
            self.size_of.setdefault(label, source)

    def axis_sources(self, tensor_name: str) -> tuple:
        if tensor_name in self.program.inputs:
            return tuple((tensor_name, a) for a in range(self.program.rank(tensor_name)))
        level = self.levels[tensor_name]
        return tuple(self.size_of[i] for i in level.indices)

    def align(
        self, body: _Body, operand: ir.Expr, labels: tuple[Index, ...], target: tuple[Index, ...]
    ) -> ir.Expr:
        """`align`, made safe for TensorFlow's broadcasting limit: beyond
        MAX_BROADCAST_RANK target axes a broadcast operand is tiled to the full shape
        first, so the elementwise op that reads it never broadcasts."""
        aligned = align(operand, labels, target)
        if len(target) <= MAX_BROADCAST_RANK or not labels or set(labels) >= set(target):
            return aligned
        if self.broadcast_safe:  # the operands of this op merge into few enough groups
            return aligned
        order = tuple(i for i in target if i in labels)
        perm = None if order == labels else tuple(labels.index(i) for i in order)
        slots = tuple(order.index(i) if i in order else None for i in target)
        multiples = tuple(("1",) if i in order else (self.index_size(body, i),) for i in target)
        return ir.Call("tile", (ir.View(operand, perm, slots), ir.Shape(multiples)))

    # -- pointwise expressions ----------------------------------------------------------

    def expr(self, body: _Body, e: sp.Expr, target: tuple[Index, ...]) -> ir.Expr:
        """A pointwise SymPy expression as TF code over the axes `target`."""
        if len(target) > MAX_BROADCAST_RANK and len(e.args) > 1 and not isinstance(e, sp.Indexed):
            before = self.broadcast_safe
            self.broadcast_safe = _merged_groups(e.args, target) <= MAX_BROADCAST_RANK
            try:
                return self.pointwise(body, e, target)
            finally:
                self.broadcast_safe = before
        return self.pointwise(body, e, target)

    def pointwise(self, body: _Body, e: sp.Expr, target: tuple[Index, ...]) -> ir.Expr:
        if isinstance(e, sp.Indexed):
            return self.access(body, e, target)
        if e.is_Integer:
            return ir.Lit(str(int(e)))
        if e.is_number:  # 1/2, pi, sqrt(pi): a Python float takes the tensors' dtype
            return ir.Lit(repr(float(e)))
        if e == fn.NEG_INF:
            body.uses_dtype = True
            return ir.Call("cast", (ir.Lit('float("-inf")'), ir.Var("dtype")))
        if isinstance(e, sp.Symbol):
            index = index_of_size(e)
            if index is not None:
                body.uses_dtype = True
                return ir.FloatSize(self.index_size(body, sp.Symbol(index)))
            return ir.Var(e.name)  # an attr (`_int_s`: an int attr in index arithmetic)
        if isinstance(e, sp.Add):  # positive terms first: `x - m`, not `-m + x`
            terms = sorted(e.args, key=lambda t: (t.could_extract_minus_sign(), _print_order(t)))
            groups = self.normalized_logits(terms)
            if groups:
                return self.sum_of_normalized(body, groups, terms, target)
            result = self.expr(body, terms[0], target)
            for term in terms[1:]:
                coeff, _ = term.as_coeff_Mul()
                if coeff.is_negative:
                    result = ir.Binary("-", result, self.expr(body, -term, target))
                else:
                    result = ir.Binary("+", result, self.expr(body, term, target))
            return result
        if isinstance(e, sp.Mul):
            coeff, _ = e.as_coeff_Mul()
            if coeff.is_negative:
                return ir.Negate(self.expr(body, -e, target))
            numerator, denominator = [], []
            for factor in sp.Mul.make_args(e):
                base, exponent = factor.as_base_exp()
                if exponent.is_Number and exponent.is_negative and not factor.is_Number:
                    denominator.append(base ** (-exponent))
                else:
                    numerator.append(factor)
            top = [self.expr(body, f, target) for f in sorted(numerator, key=_print_order)]
            result = top[0] if top else ir.Lit("1")
            for factor in top[1:]:
                result = ir.Binary("*", result, factor)
            for factor in sorted(denominator, key=_print_order):
                result = ir.Binary("/", result, self.expr(body, factor, target))
            return result
        if isinstance(e, sp.Pow):
            base, exponent = e.args
            if exponent == -1:
                return ir.Binary("/", ir.Lit("1"), self.expr(body, base, target))
            inner = self.expr(body, base, target)
            if exponent == 2:
                return ir.Call("square", (inner,))
            if exponent == sp.Rational(1, 2):
                return ir.Call("sqrt", (inner,))
            if exponent == -sp.Rational(1, 2):
                return ir.Call("rsqrt", (inner,))
            return ir.Binary("**", inner, self.expr(body, exponent, target))
        if isinstance(e, sp.exp):
            softmax = self.softmax(body, e, target)
            if softmax is not None:
                return softmax
        if isinstance(e, fn.select):
            cond, then, otherwise = e.args
            if then == 1 and otherwise == 0:  # a mask
                body.uses_dtype = True
                return ir.Call("cast", (self.condition(body, cond, target), ir.Var("dtype")))
            return ir.Call(
                "where",
                (
                    self.condition(body, cond, target),
                    self.value(body, then, target),
                    self.value(body, otherwise, target),
                ),
            )
        if isinstance(e, sp.Function):
            func = type(e)
            args = tuple(self.expr(body, a, target) for a in e.args)
            if func in UNARY or func in BINARY:
                args = tuple(_tensor_argument(body, a) for a in args)
            if func in UNARY:
                return ir.Call(UNARY[func], args)
            if func in BINARY:
                return ir.Call(BINARY[func], args)
            if func in MASKS:
                body.uses_dtype = True
                return ir.Call("cast", (ir.Binary(MASKS[func], *args), ir.Var("dtype")))
        raise AssertionError(f"cannot lower {e!r}")

    def value(self, body: _Body, e: sp.Expr, target: tuple[Index, ...]) -> ir.Expr:
        """A pointwise value where TF wants a tensor of the computation dtype (a branch
        of tf.where): constants are cast, since a Python number would become int32 or
        float32."""
        result = self.expr(body, e, target)
        if not ir.names_in(result) or e.is_number:
            body.uses_dtype = True
            return ir.Call("cast", (result, ir.Var("dtype")))
        return result

    def condition(self, body: _Body, cond: sp.Basic, target: tuple[Index, ...]) -> ir.Expr:
        """A condition as a boolean tensor over (a subset of) `target`'s axes."""
        if cond is sp.true or cond is sp.false:
            return ir.Lit(repr(bool(cond)))
        if isinstance(cond, sp.Not):
            return ir.Call("logical_not", (self.condition(body, cond.args[0], target),))
        for kind, function in LOGIC.items():
            if isinstance(cond, kind):
                parts = [self.condition(body, a, target) for a in cond.args]
                parts.sort(key=repr)  # SymPy's argument order is canonical but unstable
                result = parts[0]
                for part in parts[1:]:
                    result = ir.Call(function, (result, part))
                return result
        op = RELATIONS[type(cond)]
        left, right = cond.args
        return ir.Binary(op, self.expr(body, left, target), self.expr(body, right, target))

    def normalized_logits(self, terms: list[sp.Expr]) -> list[tuple[list[sp.Expr], sp.Expr, tuple]]:
        """In a sum, each `-L` (L = log Σ_m exp(u)) with the terms of its own logits `u`
        and the axes of `u` (m last): `u - L <= 0` stays small, where `A + B - L_A - L_B`
        adds the large values first (float16 loses ~2% at logits near 30)."""
        groups = []
        free = list(terms)
        for term in terms:
            coefficient, access = term.as_coeff_Mul()
            if coefficient != -1 or not isinstance(access, sp.Indexed):
                continue
            level = self.logsumexp_of.get(access.base.label.name)
            if level is None or len(set(access.indices)) != len(access.indices):
                continue
            (logits_term,) = level.terms
            summed = logits_term.summed
            mapping = dict(zip(level.indices, access.indices, strict=True))
            present = set().union(*(_index_set(t) for t in free)) - set(access.indices)
            for chosen in itertools.permutations(sorted(present, key=str), len(summed)):
                mapping.update(zip(summed, chosen, strict=True))
                logits = sp.Add.make_args(logits_term.expr.xreplace(mapping))
                if all(part in free and not part.could_extract_minus_sign() for part in logits):
                    groups.append((list(logits), term, (*access.indices, *chosen)))
                    free = [t for t in free if t not in logits and t != term]
                    break
        return groups

    def sum_of_normalized(self, body, groups, terms, target) -> ir.Expr:
        """`(u1 - L1) + (u2 - L2) + rest`, each group as `normalized_logits` found it."""
        used = {t for logits, term, _ in groups for t in (*logits, term)}
        parts = []
        for logits, term, order in groups:
            if len(order) - len(term.as_coeff_Mul()[1].indices) == 1:
                # One summed index: u - L is TF's log_softmax over it, which rounds once
                # (float16: 4x closer than subtracting a rounded logsumexp).
                operand = self.expr(body, sp.Add(*logits), order)
                if not _is_simple(operand):
                    operand = ir.Var(body.bind(operand))
                call = ir.Call("log_softmax", (operand,), (("axis", ir.Lit("-1")),))
                parts.append(self.align(body, ir.Var(body.bind(call)), order, target))
            else:
                u = self.expr(body, sp.Add(*logits), target)
                parts.append(ir.Binary("-", u, self.expr(body, -term, target)))
        result = parts[0]
        for part in parts[1:]:
            result = ir.Binary("+", result, part)
        for term in terms:
            if term in used:
                continue
            coeff, _ = term.as_coeff_Mul()
            if coeff.is_negative:
                result = ir.Binary("-", result, self.expr(body, -term, target))
            else:
                result = ir.Binary("+", result, self.expr(body, term, target))
        return result

    def logsumexp_keeping_softmax(self, body: _Body, operand: ir.Expr) -> ir.Expr:
        """log Σ exp over the last axis, step by step, keeping exp(u - max) / Σ as the
        softmax the gradient needs (as TF's tape keeps it); `gradient(op)` recomputes
        that softmax with one fused `tf.nn.softmax` instead."""
        last = (("axis", ir.Lit("-1")), ("keepdims", ir.Lit("True")))
        peak = body.bind(ir.Call("reduce_max", (operand,), last))
        # A row that is all -inf (every entry masked): log 0 = -inf, as tf.reduce_logsumexp.
        finite = ir.Call("is_finite", (ir.Var(peak),))
        peak = body.bind(
            ir.Call("where", (finite, ir.Var(peak), ir.Call("zeros_like", (ir.Var(peak),))))
        )
        shifted = body.bind(ir.Call("exp", (ir.Binary("-", operand, ir.Var(peak)),)))
        total = body.bind(ir.Call("reduce_sum", (ir.Var(shifted),), last))
        softmax = body.bind(ir.Binary("/", ir.Var(shifted), ir.Var(total)))
        fused = ir.Call("softmax", (operand,), (("axis", ir.Lit("-1")),))
        body.memo[fused] = softmax
        body.recompute[softmax] = fused
        value = ir.Binary("+", ir.Call("log", (ir.Var(total),)), ir.Var(peak))
        return ir.Call("squeeze", (value,), (("axis", ir.Lit("-1")),))

    def softmax(self, body: _Body, e: sp.Expr, target: tuple[Index, ...]) -> ir.Expr | None:
        """`exp(u - L)` with `L = log Σ_m exp(u)`: one fused `tf.nn.softmax(u)` over m.

        L may appear as the logsumexp intermediate or as an output equal to it.
        """
        argument = e.args[0]
        for term in sp.Add.make_args(argument):
            coefficient, access = term.as_coeff_Mul()
            if coefficient != -1 or not isinstance(access, sp.Indexed):
                continue
            level = self.logsumexp_of.get(access.base.label.name)
            if level is None or len(level.terms[0].summed) != 1:
                continue
            if len(set(access.indices)) != len(access.indices):
                continue
            logits = argument - term
            (m,) = level.terms[0].summed
            mapping = dict(zip(level.indices, access.indices, strict=True))
            for candidate in sorted(_index_set(logits) - set(access.indices), key=str):
                mapping[m] = candidate
                if level.terms[0].expr.xreplace(mapping) != logits:
                    continue
                order = (*access.indices, candidate)
                operand = self.expr(body, logits, order)
                if not _is_simple(operand):
                    operand = ir.Var(body.bind(operand))
                weights = body.bind(ir.Call("softmax", (operand,), (("axis", ir.Lit("-1")),)))
                return self.align(body, ir.Var(weights), order, target)
        return None

    def access(self, body: _Body, access: sp.Indexed, target: tuple[Index, ...]) -> ir.Expr:
        """`X[i, j]` aligned to `target` axes (diagonals read with a one-operand einsum)."""
        labels = tuple(access.indices)
        name = access.base.label.name
        if name == IOTA:  # the value of an index: 0, 1, ..., size - 1
            (label,) = labels
            size = self.position_int(ir.Var(self.index_size(body, label)))
            operand = ir.Var(body.bind(ir.Call("range", (size,))))
            return self.align(body, operand, labels, target)
        if name in self.program.index_inputs:  # compared and added with tf.range values
            operand = ir.Var(body.bind(ir.Call("to_int64", (ir.Var(name),))))
            return self.align(body, operand, labels, target)
        operand: ir.Expr = ir.Var(body.tensors[name])
        if len(set(labels)) != len(labels):
            unique = tuple(dict.fromkeys(labels))
            letters = _letters([labels, unique], self.preferred)
            subscripts = f"{_word(labels, letters)}->{_word(unique, letters)}"
            operand = ir.Var(body.bind(ir.Einsum(subscripts, (operand,))))
            labels = unique
        return self.align(body, operand, labels, target)

    # -- terms: products summed over indices ------------------------------------------

    def term(
        self,
        body: _Body,
        e: sp.Expr,
        summed: tuple[Index, ...],
        out: tuple[Index, ...],
        eyes: tuple[tuple[Index, Index], ...] = (),
    ) -> list[tuple[ir.Expr, tuple[Index, ...]]]:
        """Σ_summed e, as (expression, axes) pieces whose sum is the term (axes ⊆ out)."""
        convolution = self.convolution_term(body, e, out)
        if convolution is not None:
            return [convolution]
        prefix = self.prefix_sum(body, e, summed, out, eyes)
        if prefix is not None:
            return [prefix]
        factors = sp.Mul.make_args(e)
        operand_sets = [set(a.indices) for a in e.atoms(sp.Indexed)]
        for factor in factors:
            if isinstance(factor, sp.Indexed) or not factor.atoms(sp.Indexed):
                continue
            needed = _index_set(factor)
            if any(needed <= s for s in operand_sets):
                continue
            if factor.is_polynomial(*factor.atoms(sp.Indexed)):
                centered = self.centered(body, factor)
                if centered is not None:
                    e = e.xreplace({factor: centered})
                expanded = sp.expand(e, power_base=False, power_exp=False, log=False)
                parts = sp.Add.make_args(expanded)
                if 1 < len(parts) <= MAX_EXPANDED_TERMS:
                    pieces = []
                    for part in parts:
                        pieces += self.term(body, part, summed, out, eyes)
                    return pieces
        return [self.contract(body, e, summed, out, eyes)]

    # -- convolutions ---------------------------------------------------------------------

    def convolution_term(self, body: _Body, e: sp.Expr, out: tuple[Index, ...]):
        """The term of a recognised convolution (forward), or its filter gradient
        `Σ grad_y · window` (backward), as TF's convolution kernels."""
        reads = [a for a in e.atoms(sp.Indexed) if a.base.label.name in self.convolutions]
        if len(reads) != 1:
            return None
        conv = self.convolutions[reads[0].base.label.name]
        factors = sp.Mul.make_args(e)
        if len(factors) != 2:
            return None
        (other,) = [f for f in factors if f != reads[0]]
        if not isinstance(other, sp.Indexed):
            return None
        if other.base.label.name == conv.filter:  # the forward term
            value = ir.Call(
                "convolution",
                (self.window(body, conv), ir.Var(body.tensors[conv.filter])),
                (
                    ("strides", self.strides(conv, full=False)),
                    ("padding", ir.Lit('"VALID"')),
                ),
            )
            return value, conv.indices
        if other.base.label.name == grad_name(conv.consumer):  # ∂L/∂w
            grad = self.conv_grad(body, conv, other)
            value = self.backprop(body, conv, grad, filter_gradient=True)
            return value, out
        return None

    def conv_grad(self, body: _Body, conv, grad: sp.Indexed | None = None) -> ir.Expr:
        """The consumer's incoming gradient on the convolution's axes (b, i.., o)."""
        name = grad_name(conv.consumer)
        labels = tuple(grad.indices) if grad is not None else self.levels[conv.consumer].indices
        if grad is not None:  # the contribution renamed the consumer's indices
            mapping = dict(zip(self.levels[conv.consumer].indices, labels, strict=True))
            target = tuple(mapping[i] for i in conv.indices)
        else:
            target = conv.indices
        value = align(ir.Var(body.tensors[name]), labels, target)
        return value if _is_simple(value) else ir.Var(body.bind(value))

    def strides(self, conv, *, full: bool) -> ir.Expr:
        """`[s1, s2]` for tf.nn.convolution; `[1, s1, s2, 1]` for the raw kernels (1-D
        as 2-D: `[1, 1, s, 1]`)."""
        strides = [integer(s.stride) for s in conv.spatial]
        if not full:
            return ir.List(tuple(strides))
        if len(strides) == 1:
            strides = [ir.Lit("1"), *strides]
        return ir.List((ir.Lit("1"), *strides, ir.Lit("1")))

    def window_bounds(self, body: _Body, conv):
        """Per spatial axis: (padding below, padding above, start, length, size) of the
        window of x the outputs read, as code: after padding, the window starts at
        `start` and has length = stride*(n_i - 1) + K. Worked out in SymPy, so literal
        offsets and strides fold to numbers."""

        def var(name: str) -> sp.Symbol:
            return sp.Symbol(name, integer=True, nonnegative=True)

        bounds = []
        for axis, spatial in enumerate(conv.spatial, start=1):
            size = var(self.axis_size(body, conv.source, axis))
            taps = var(self.axis_size(body, conv.filter, axis - 1))
            count = var(self.index_size(body, spatial.output))
            length = spatial.stride * (count - 1) + taps
            low = sp.Max(-spatial.offset, 0)
            high = sp.Max(spatial.offset + length - size, 0)
            start = spatial.offset + low
            parts = [self.bind_integer(body, e) for e in (low, high, start, length)]
            after = self.bind_integer(body, size + low + high - start - length)
            bounds.append((*parts, integer(size), after))
        return bounds

    def bind_integer(self, body: _Body, e: sp.Expr) -> ir.Expr:
        value = integer(e)
        return value if isinstance(value, ir.Lit | ir.Var) else ir.Var(body.bind(value))

    def window(self, body: _Body, conv) -> ir.Expr:
        """x padded with zeros (or cropped) to exactly the window the outputs read."""
        bounds = self.window_bounds(body, conv)
        zero = ir.List((ir.Lit("0"), ir.Lit("0")))
        paddings = ir.List((zero, *(ir.List((lo, hi)) for lo, hi, *_ in bounds), zero))
        padded = ir.Var(body.bind(ir.Call("pad", (ir.Var(body.tensors[conv.source]), paddings))))
        begin = ir.List((ir.Lit("0"), *(b[2] for b in bounds), ir.Lit("0")))
        size = ir.List((ir.Lit("-1"), *(b[3] for b in bounds), ir.Lit("-1")))
        return ir.Call("slice", (padded, begin, size))

    def backprop(self, body: _Body, conv, grad: ir.Expr, *, filter_gradient: bool) -> ir.Expr:
        """TF's backprop kernel for the filter or for the window of x (1-D runs as 2-D
        with a height of one, as tf.nn.conv1d does)."""
        window: ir.Expr = ir.Var(body.bind(self.window(body, conv)))
        weights: ir.Expr = ir.Var(body.tensors[conv.filter])
        flat = len(conv.spatial) == 1
        if flat:
            window = ir.View(window, None, (0, None, 1, 2))
            weights = ir.View(weights, None, (None, 0, 1, 2))
            grad = ir.View(grad, None, (0, None, 1, 2))
        rank = "3D" if len(conv.spatial) == 3 else "2D"
        if filter_gradient:
            kernel = f"conv{rank.lower()}_backprop_filter"
            first = (("input", window), ("filter_sizes", ir.Call("shape", (weights,))))
        else:
            kernel = f"conv{rank.lower()}_backprop_input"
            first = (("input_sizes", ir.Call("shape", (window,))), ("filter", weights))
        value: ir.Expr = ir.Call(
            kernel,
            (),
            (
                *first,
                ("out_backprop", grad),
                ("strides", self.strides(conv, full=True)),
                ("padding", ir.Lit('"VALID"')),
            ),
        )
        if flat:  # the added axis: 0 of the filter's shape, 1 of the input's
            axis = "0" if filter_gradient else "1"
            value = ir.Call("squeeze", (ir.Var(body.bind(value)),), (("axis", ir.Lit(axis)),))
        return value

    def convolution_input_gradient(self, body: _Body, conv) -> ir.Expr:
        """∂L/∂x: TF's input backprop kernel on the window, then the window's transpose
        (the crop becomes zero padding, the zero padding is cut away)."""
        value = self.backprop(body, conv, self.conv_grad(body, conv), filter_gradient=False)
        value = ir.Var(body.bind(value))
        bounds = self.window_bounds(body, conv)
        zero = ir.List((ir.Lit("0"), ir.Lit("0")))
        paddings = [ir.List((start, after)) for _, _, start, _, _, after in bounds]
        padded = ir.Var(body.bind(ir.Call("pad", (value, ir.List((zero, *paddings, zero))))))
        begin = ir.List((ir.Lit("0"), *(b[0] for b in bounds), ir.Lit("0")))
        size = ir.List((ir.Lit("-1"), *(b[4] for b in bounds), ir.Lit("-1")))
        return ir.Call("slice", (padded, begin, size))

    def prefix_sum(self, body, e, summed, out, eyes):
        """`Σ_k where(k <= i, h[k], 0)` is `tf.cumsum(h)` read at i: O(n), not an n×n
        mask. Also `<` (exclusive) and `>=`, `>` (reversed); the gradient of a prefix sum
        is a reversed one, so the same rule serves the backward pass."""
        if eyes:
            return None
        factors = sp.Mul.make_args(e)
        masks = [f for f in factors if isinstance(f, fn.select) and f.args[2] == 0]
        if len(masks) != 1:
            return None
        (mask,) = masks
        cond = mask.args[0]
        if type(cond) not in RELATIONS or RELATIONS[type(cond)] in ("==", "!="):
            return None
        sides = cond.args
        if not all(isinstance(a, sp.Indexed) and a.base.label.name == IOTA for a in sides):
            return None
        left, right = (a.indices[0] for a in sides)
        op = RELATIONS[type(cond)]
        if left in summed and right in out and right not in summed:
            k, i = left, right
        elif right in summed and left in out and left not in summed:
            k, i = right, left
            op = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}[op]
        else:
            return None
        rest = mask.args[1] * sp.Mul(*[f for f in factors if f is not mask])
        if i in _index_set(rest) or k not in _index_set(rest) or not self.same_size(i, k):
            return None
        out_k = tuple(k if j == i else j for j in out)
        inner = tuple(j for j in summed if j != k)
        value, axes = self.contract(body, rest, inner, out_k, ())
        if k not in axes:
            return None
        if not _is_simple(value):
            value = ir.Var(body.bind(value))
        keywords = [("axis", ir.Lit(str(axes.index(k))))]
        if op in ("<", ">"):
            keywords.append(("exclusive", ir.Lit("True")))
        if op in (">", ">="):
            keywords.append(("reverse", ir.Lit("True")))
        total = ir.Call("cumsum", (value,), tuple(keywords))
        return total, tuple(i if j == k else j for j in axes)

    def same_size(self, i: Index, k: Index) -> bool:
        """Whether two indices are known to have the same size."""

        def key(index):
            source = self.size_of.get(index)
            if isinstance(source, tuple):
                return indexing.shape_symbol(*source)
            return source

        return key(i) is not None and key(i) == key(k)

    def centered(self, body: _Body, factor: sp.Expr) -> sp.Expr | None:
        """A translation-invariant polynomial (`(x[b,i,k] - z[b,j,k])**2`) over points
        moved next to the origin, before it is expanded into monomials.

        Expanded, `x² + z² - 2xz` cancels catastrophically for points far from the
        origin (float32 at offset 100 gives negative squared distances). Every access
        is shifted by the same center `c` over the indices all accesses share -- the
        mean of one set of points over its other indices -- which changes nothing in
        exact arithmetic: the polynomial is checked to be invariant under `u -> u + t`.
        """
        found = sorted(factor.atoms(sp.Indexed), key=sp.default_sort_key)
        if any(len(set(a.indices)) != len(a.indices) for a in found):
            return None
        shift = sp.Dummy("t")
        if sp.expand(factor.xreplace({a: a + shift for a in found}) - factor) != 0:
            return None
        common = set.intersection(*(set(a.indices) for a in found))
        spread = [a for a in found if not set(a.indices) <= common]
        if not spread:
            return None
        first = spread[0]  # a set of points: an access with indices the others lack
        axes = [n for n, i in enumerate(first.indices) if i not in common]
        center_labels = tuple(i for i in first.indices if i in common)
        points = ir.Var(body.tensors[first.base.label.name])
        center = ir.Var(
            body.bind(ir.Call("reduce_mean", (points,), (("axis", ir.Lit(repr(axes))),)))
        )
        mapping = {}
        for access in found:
            labels = tuple(access.indices)
            shifted = ir.Binary(
                "-",
                ir.Var(body.tensors[access.base.label.name]),
                self.align(body, center, center_labels, labels),
            )
            name = body.bind(shifted)
            body.tensors[name] = name
            mapping[access] = tensor(name)[labels]
        return factor.xreplace(mapping)

    def contract(
        self,
        body: _Body,
        e: sp.Expr,
        summed: tuple[Index, ...],
        out: tuple[Index, ...],
        eyes: tuple[tuple[Index, Index], ...],
    ) -> tuple[ir.Expr, tuple[Index, ...]]:
        """One product, summed: an elementwise expression or an einsum."""
        present = _index_set(e) | {i for pair in eyes for i in pair}
        result_axes = tuple(i for i in out if i in present)
        absent = [s for s in summed if s not in present]
        summed = tuple(s for s in summed if s in present)
        coefficient = sp.Integer(1)
        for index in absent:  # Σ over an index nothing depends on: times its size
            coefficient *= sp.Symbol(f"|{index.name}|")
        if not summed and not eyes:
            return self.expr(body, coefficient * e, result_axes), result_axes
        operands: list[tuple[ir.Expr, tuple[Index, ...]]] = []
        pointwise: list[sp.Expr] = []
        for factor in sp.Mul.make_args(e):
            if not factor.atoms(sp.Indexed):
                coefficient *= factor
            elif isinstance(factor, sp.Indexed):
                operands.append((factor, tuple(factor.indices)))
            else:
                pointwise.append(factor)
        # Pointwise factors are materialized over their own indices only: factors merge
        # (and accesses fold in, one operand less) only into a factor covering them, so
        # `tanh(A[b,i,k]) * tanh(A[b,j,k])` stays two (b,_,k) operands, never (b,i,j,k).
        groups: list[tuple[set[Index], sp.Expr]] = []
        for factor in sorted(
            pointwise, key=lambda f: (-len(_index_set(f)), sp.default_sort_key(f))
        ):
            need = _index_set(factor)
            for n, (cover, merged) in enumerate(groups):
                if need <= cover:
                    groups[n] = (cover, merged * factor)
                    break
            else:
                groups.append((need, factor))
        keep = []
        for access, labels in operands:
            for n, (cover, merged) in enumerate(groups):
                if set(labels) <= cover:
                    groups[n] = (cover, merged * access)
                    break
            else:
                keep.append((access, labels))
        operands = keep + [
            (("pointwise", merged), _axes_of(merged, result_axes, summed)) for _, merged in groups
        ]
        # The incoming gradient first: `grad_y[b,i,j] * B[b,k,j]` as in the docstring.
        operands.sort(key=lambda item: not _is_gradient(item[0]))
        einsum_operands = []
        for operand, labels in operands:
            if isinstance(operand, tuple):
                merged = operand[1]
                name = body.bind(self.expr(body, merged, labels))
                einsum_operands.append((ir.Var(name), labels))
            else:
                einsum_operands.append((ir.Var(body.tensors[operand.base.label.name]), labels))
        for left, right in eyes:
            eye = body.bind(
                ir.Call(
                    "eye", (ir.Var(self.index_size(body, left)),), (("dtype", ir.Var("dtype")),)
                )
            )
            body.uses_dtype = True
            einsum_operands.append((ir.Var(eye), (left, right)))
        value = self.einsum(body, einsum_operands, result_axes)
        if coefficient != 1:
            if not _is_simple(value):  # bound, so the same sum elsewhere is shared
                value = ir.Var(body.bind(value))
            if coefficient == -1:
                value = ir.Negate(value)
            elif coefficient.could_extract_minus_sign():
                value = ir.Negate(ir.Binary("*", self.expr(body, -coefficient, ()), value))
            else:
                value = ir.Binary("*", self.expr(body, coefficient, ()), value)
        return value, result_axes

    def einsum(
        self,
        body: _Body,
        operands: list[tuple[ir.Expr, tuple[Index, ...]]],
        out: tuple[Index, ...],
    ) -> ir.Expr:
        """Contract operands to `out`, pairwise in an optimal order."""
        labels = [lab for _, lab in operands]
        if any(len(set(lab)) != len(lab) for lab in labels):
            return self._einsum_call(operands, out)  # diagonals: leave to einsum
        summed = {i for lab in labels for i in lab} - set(out)
        # (R3) Operands without a summed index multiply the contraction of the others.
        if summed and len(operands) > 1:
            carrying = [op for op in operands if set(op[1]) & summed]
            free = [op for op in operands if not set(op[1]) & summed]
            if free:
                kept = {i for _, lab in carrying for i in lab} & set(out)
                axes = tuple(i for i in out if i in kept)
                inner = self.einsum(body, carrying, axes)
                if not _is_simple(inner):
                    inner = ir.Var(body.bind(inner))
                return self.einsum(body, [*free, (inner, axes)], out)
        while len(operands) > 2:
            operands = self.contract_pair(body, operands, out)
        if len(operands) == 1:
            return self._reduce(body, *operands[0], out)
        (x, lx), (y, ly) = operands
        # (R2) Sum an index only one operand has before anything else.
        x, lx = self._pre_reduce(body, x, lx, set(ly) | set(out))
        y, ly = self._pre_reduce(body, y, ly, set(lx) | set(out))
        shared_summed = (set(lx) & set(ly)) - set(out)
        if not shared_summed or set(lx) == set(ly):
            # A broadcasting product, summed over what both have: 'bij,bij->bi' would be
            # a BatchMatMul of 1x1 results, far slower than multiply + reduce_sum.
            union = tuple(dict.fromkeys((*lx, *ly)))
            order = tuple(i for i in out if i in union) + tuple(i for i in union if i not in out)
            product = ir.Binary("*", self.align(body, x, lx, order), self.align(body, y, ly, order))
            return self._reduce(body, product, order, out)
        # (R1) TF's einsum runs BatchMatMul, whose result is [batch, free of the first
        # operand, free of the second]; list operands so that is `out`, or einsum adds
        # a transpose of the result.
        first_free = next((i for i in out if (i in lx) != (i in ly)), None)
        if first_free is not None and first_free in ly:
            (x, lx), (y, ly) = (y, ly), (x, lx)
        return self._einsum_call([(x, lx), (y, ly)], out)

    def _einsum_call(self, operands, out):
        labels = [lab for _, lab in operands]
        if len(operands) == 1 and labels[0] == out:
            return operands[0][0]
        letters = _letters([*labels, out], self.preferred)
        inputs = ",".join(_word(lab, letters) for lab in labels)
        return ir.Einsum(f"{inputs}->{_word(out, letters)}", tuple(op for op, _ in operands))

    def _pre_reduce(self, body, operand, labels, keep):
        if not any(i not in keep for i in labels):
            return operand, labels
        rest = tuple(i for i in labels if i in keep)
        return ir.Var(body.bind(self._reduce(body, operand, labels, rest))), rest

    def _reduce(self, body, operand, labels, out):
        """`operand` (axes `labels`) summed over the labels not in `out`, permuted to out."""
        axes = [n for n, i in enumerate(labels) if i not in out]
        if axes:
            if not _is_simple(operand):
                operand = ir.Var(body.bind(operand))
            operand = reduction(body, "reduce_sum", operand, axes)
            labels = tuple(i for i in labels if i in out)
        if labels == out:
            return operand
        if not _is_simple(operand):
            operand = ir.Var(body.bind(operand))
        return align(operand, labels, out)

    def contract_pair(self, body, operands, out):
        letters = _letters([*[lab for _, lab in operands], out], self.preferred)
        words = [_word(lab, letters) for _, lab in operands]
        equation = f"{','.join(words)}->{_word(out, letters)}"
        shapes = [(REPRESENTATIVE_SIZE,) * len(lab) for _, lab in operands]
        path, _ = opt_einsum.contract_path(
            equation, *shapes, shapes=True, optimize="optimal", memory_limit="max_input"
        )
        first, second = sorted(path[0])
        pair = [operands[first], operands[second]]
        rest = [op for n, op in enumerate(operands) if n not in (first, second)]
        needed = set(out) | {i for _, lab in rest for i in lab}
        kept = {i for _, lab in pair for i in lab if i in needed}
        # Axes the result keeps first in the output's order (batch first), then the rest.
        axes = tuple(i for i in out if i in kept)
        axes += tuple(dict.fromkeys(i for _, lab in pair for i in lab if i in kept - set(out)))
        name = body.bind(self.einsum(body, pair, axes))
        return [*rest, (ir.Var(name), axes)]

    def sum_terms(
        self,
        body: _Body,
        pieces: list[tuple[ir.Expr, tuple[Index, ...]]],
        out: tuple[Index, ...],
    ) -> tuple[ir.Expr, tuple[Index, ...]]:
        """Add pieces over subsets of `out`; the result's axes are their union, in order."""
        union = {i for _, axes in pieces for i in axes}
        axes = tuple(i for i in out if i in union)
        result: ir.Expr | None = None
        for value, piece_axes in pieces:
            if piece_axes != axes and not _is_simple(value):
                value = ir.Var(body.bind(value))
            aligned = self.align(body, value, piece_axes, axes)
            if result is None:
                result = aligned
            elif isinstance(aligned, ir.Negate):
                result = ir.Binary("-", result, aligned.operand)
            else:
                result = ir.Binary("+", result, aligned)
        assert result is not None
        return result, axes

    def full(
        self,
        body: _Body,
        value: ir.Expr,
        axes: tuple[Index, ...],
        out: tuple[Index, ...],
    ) -> ir.Expr:
        """Broadcast a value over `axes` ⊆ `out` to the full shape of `out`."""
        if axes == out:
            return value
        if len(out) > MAX_BROADCAST_RANK and axes:
            return self.align(body, value, axes, out)  # tiled: already the full shape
        aligned = align(value, axes, out)
        if not ir.names_in(aligned):
            # A constant (`A - A + 2`): a Python number would broadcast as int32.
            body.uses_dtype = True
            aligned = ir.Call("cast", (aligned, ir.Var("dtype")))
        shape = ir.Shape(tuple((self.index_size(body, i),) for i in out))
        return ir.Call("broadcast_to", (aligned, shape))

    # -- levels -------------------------------------------------------------------------

    # -- computed positions -------------------------------------------------------------

    def position(self, body: _Body, e: sp.Expr, axes: tuple[Index, ...]) -> ir.Expr:
        """An affine position (index values, index tensors, int attrs) over `axes`: int32,
        or int64 when index tensors take part."""
        return self.expr(body, indexing.index_values(e), axes)

    def gather_plan(self, body: _Body, level: Level):
        """The positions of a gather: (flat position P over the inner indices, the mask of
        reads in bounds or None, the inner indices)."""
        gather = level.gather
        computed = gather.computed
        inner = gather.inner(level.indices)
        flat: ir.Expr | None = None
        valid: ir.Expr | None = None
        for axis, bounded in zip(computed, gather.bounded, strict=True):
            position = self.position(body, gather.positions[axis], inner)
            if not _is_simple(position):
                position = ir.Var(body.bind(position))
            if not bounded:
                size = self.position_int(ir.Var(self.axis_size(body, gather.source, axis)))
                inside = ir.Call(
                    "logical_and",
                    (ir.Binary(">=", position, ir.Lit("0")), ir.Binary("<", position, size)),
                )
                valid = inside if valid is None else ir.Call("logical_and", (valid, inside))
            if flat is None:
                flat = position
            else:
                size = self.position_int(ir.Var(self.axis_size(body, gather.source, axis)))
                flat = ir.Binary("+", ir.Binary("*", flat, size), position)
        positions = [gather.positions[n] for n in computed]
        spans = (
            len(positions) == 1
            and isinstance(positions[0], sp.Indexed)
            and tuple(positions[0].indices) == inner
        )
        if not spans:  # an index tensor read at exactly the inner indices has their shape
            shape = ir.Shape(tuple((self.index_size(body, i),) for i in inner))
            flat = ir.Var(body.bind(ir.Call("broadcast_to", (flat, shape))))
            if valid is not None:
                valid = ir.Var(body.bind(ir.Call("broadcast_to", (valid, shape))))
        elif valid is not None:
            valid = ir.Var(body.bind(valid))
        return flat, valid, inner

    def rows(self, body: _Body, gather) -> tuple[str, ...]:
        """The sizes of the computed axes (their product is the number of rows read)."""
        return tuple(self.axis_size(body, gather.source, n) for n in gather.computed)

    def blocks(self, level: Level):
        """Non-overlapping windows: every computed axis read at `s*i + u` with u's range s
        (`x[b, 2*i+u, 2*j+v, c]` with u, v < 2), in bounds, and laid out as (.., i, u, ..).
        Such a gather is a slice and a reshape, its transpose a reshape and a pad: no index
        arithmetic, gather or scatter-add. Returns [(axis, i, u, s)] or None."""
        gather = level.gather
        found = []
        for axis, bounded in zip(gather.computed, gather.bounded, strict=True):
            position = sp.expand(gather.positions[axis])
            symbols = [x for x in position.free_symbols if indexing.is_plain(x)]
            if not bounded or len(symbols) != 2 or position.atoms(sp.Indexed):
                return None
            for i, u in (symbols, symbols[::-1]):
                stride = position.coeff(i)
                if (
                    stride.is_Integer
                    and stride > 1
                    and position.coeff(u) == 1
                    and position - stride * i - u == 0
                    and self.size_of.get(u) == stride
                ):
                    found.append((axis, i, u, int(stride)))
                    break
            else:
                return None
        inner = [x for _, i, u, _ in found for x in (i, u)]
        start = level.indices.index(inner[0]) if inner[0] in level.indices else -1
        if tuple(level.indices[start : start + len(inner)]) != tuple(inner):
            return None
        return found

    def gather(self, body: _Body, level: Level) -> ir.Expr:
        """`X` read at computed positions: one `tf.gather` (several computed axes are
        flattened into one first); reads out of bounds are zero."""
        blocks = self.blocks(level)
        if blocks is not None:
            return self.gather_blocks(body, level, blocks)
        gather = level.gather
        computed = gather.computed
        rank = self.program.rank(gather.source)
        plain = [n for n in range(rank) if n not in computed]
        flat, valid, inner = self.gather_plan(body, level)
        source: ir.Expr = ir.Var(body.tensors[gather.source])
        if len(computed) == 1:
            axis = computed[0]
        elif computed == tuple(range(computed[0], computed[-1] + 1)):  # adjacent: merge
            axis = computed[0]
            dims = [(self.axis_size(body, gather.source, n),) for n in range(axis)]
            dims.append(self.rows(body, gather))
            dims += [
                (self.axis_size(body, gather.source, n),) for n in range(computed[-1] + 1, rank)
            ]
            source = ir.Call("reshape", (source, ir.Shape(tuple(dims))))
        else:
            order = (*computed, *plain)
            if order != tuple(range(rank)):
                source = ir.Call("transpose", (source, ir.Lit(repr(list(order)))))
            dims = [self.rows(body, gather)]
            dims += [(self.axis_size(body, gather.source, n),) for n in plain]
            source = ir.Call("reshape", (source, ir.Shape(tuple(dims))))
            axis = 0

        def read(index: ir.Expr) -> ir.Expr:
            return ir.Call("gather", (source, index), (("axis", ir.Lit(str(axis))),))

        if valid is None:
            return read(flat)
        if self.looks_up(gather):
            if not _is_simple(source):  # read by both branches
                source = ir.Var(body.bind(source))
            # Positions from index tensors are nearly always in bounds: mask only when
            # some are not (the mask is a second pass over everything read).
            masked = self.zero_outside(
                body, read(self.clipped(flat, valid)), valid, inner, level.indices
            )
            return ir.Cond(self.all_in_bounds(body, valid), read(flat), masked)
        index = ir.Var(body.bind(self.clipped(flat, valid)))
        return self.zero_outside(body, ir.Var(body.bind(read(index))), valid, inner, level.indices)

    @staticmethod
    def looks_up(gather) -> bool:
        """Whether a gather reads at positions taken from index tensors."""
        return any(gather.positions[n].atoms(sp.Indexed) for n in gather.computed)

    @staticmethod
    def clipped(flat: ir.Expr, valid: ir.Expr) -> ir.Expr:
        """Positions with those out of bounds sent to 0 (TF's CPU gather raises on them)."""
        return ir.Call("where", (valid, flat, ir.Lit("0")))

    def all_in_bounds(self, body: _Body, valid: ir.Expr) -> ir.Expr:
        return ir.Var(body.bind(ir.Call("reduce_all", (valid,))))

    def zero_outside(self, body: _Body, value: ir.Expr, valid: ir.Expr, inner, indices):
        """`value` (axes `indices`) with zeros where its reads were out of bounds (`valid`,
        over `inner`, is false)."""
        body.uses_dtype = True
        zero = ir.Call("zeros", (ir.Lit("[]"),), (("dtype", ir.Var("dtype")),))
        mask = self.align(body, valid, inner, indices)
        return ir.Call("where", (mask, value, zero))

    def reads_rows(self, scatter: Scatter) -> bool:
        """Whether a gather reads whole rows (computed positions on the first axis only,
        like `W[ids[b, t], d]`): its gradient can then be sparse, as TF's Gather's is."""
        if scatter.level in self.convolutions:
            return False
        return self.levels[scatter.level].gather.computed == (0,)

    def sparse_rows(self, body: _Body, scatter: Scatter) -> ir.Expr:
        """The gradient of a row gather as `tf.IndexedSlices`: the rows read and their
        gradients, never a dense tensor the size of the table (rows read out of bounds
        carry zeros)."""
        level = self.levels[scatter.level]
        gather = level.gather
        flat, valid, inner = self.gather_plan(body, level)
        grad: ir.Expr = ir.Var(body.tensors[grad_name(level.name)])
        rank = self.program.rank(gather.source)
        if valid is not None:  # as in `gather`: mask only when some read is out of bounds
            inside = self.all_in_bounds(body, valid)
            masked = self.zero_outside(body, grad, valid, inner, level.indices)
            grad = ir.Var(body.bind(ir.Cond(inside, grad, masked)))
            flat = ir.Var(body.bind(self.clipped(flat, valid)))  # small: one cond is enough
        rows = [
            ir.Lit("-1"),
            *(ir.Var(self.axis_size(body, gather.source, n)) for n in range(1, rank)),
        ]
        values = ir.Call("reshape", (grad, ir.List(tuple(rows))))
        ids = ir.Call("reshape", (flat, ir.List((ir.Lit("-1"),))))
        shape = ir.Call("shape", (ir.Var(body.tensors[gather.source]),))
        return ir.Call("sparse_rows", (values, ids, shape))

    def gather_blocks(self, body: _Body, level: Level, blocks) -> ir.Expr:
        """x[:, :s*n_i, ..] reshaped to (.., n_i, s, ..)."""
        gather = level.gather
        rank = self.program.rank(gather.source)
        by_axis = {axis: (i, stride) for axis, i, _, stride in blocks}
        begin, size, shape = [], [], []
        for n in range(rank):
            begin.append(ir.Lit("0"))
            if n in by_axis:
                i, stride = by_axis[n]
                count = self.index_size(body, i)
                size.append(ir.Binary("*", ir.Lit(str(stride)), ir.Var(count)))
                shape += [(count,), (str(stride),)]
            else:
                size.append(ir.Lit("-1"))
                shape.append((self.axis_size(body, gather.source, n),))
        window = ir.Call(
            "slice",
            (ir.Var(body.tensors[gather.source]), ir.List(tuple(begin)), ir.List(tuple(size))),
        )
        return ir.Call("reshape", (window, ir.Shape(tuple(shape))))

    def scatter_blocks(self, body: _Body, level: Level, blocks) -> ir.Expr:
        """The transpose of `gather_blocks`: reshape back, pad with zeros to x's size."""
        gather = level.gather
        rank = self.program.rank(gather.source)
        by_axis = {axis: (i, stride) for axis, i, _, stride in blocks}
        shape, paddings = [], []
        for n in range(rank):
            size = self.axis_size(body, gather.source, n)
            if n in by_axis:
                i, stride = by_axis[n]
                count = self.index_size(body, i)
                shape.append((str(stride), count))
                used = ir.Binary("*", ir.Lit(str(stride)), ir.Var(count))
                paddings.append(ir.List((ir.Lit("0"), ir.Binary("-", ir.Var(size), used))))
            else:
                shape.append((size,))
                paddings.append(ir.List((ir.Lit("0"), ir.Lit("0"))))
        grad = ir.Var(body.tensors[grad_name(level.name)])
        window = ir.Var(body.bind(ir.Call("reshape", (grad, ir.Shape(tuple(shape))))))
        return ir.Call("pad", (window, ir.List(tuple(paddings))))

    def scatter(self, body: _Body, scatter: Scatter, indices: tuple[Index, ...]) -> ir.Expr:
        """The transpose of a gather: its gradient added back where it read (reads out of
        bounds add nothing), shaped like the source with axes `indices`."""
        if scatter.level in self.convolutions:
            return self.convolution_input_gradient(body, self.convolutions[scatter.level])
        level = self.levels[scatter.level]
        blocks = self.blocks(level)
        if blocks is not None:
            return self.scatter_blocks(body, level, blocks)
        gather = level.gather
        computed = gather.computed
        rank = self.program.rank(gather.source)
        plain = [n for n in range(rank) if n not in computed]
        flat, valid, inner = self.gather_plan(body, level)
        rows = self.rows(body, gather)
        ids = flat
        if valid is not None:  # dropped by unsorted_segment_sum
            ids = ir.Var(body.bind(ir.Call("where", (valid, flat, ir.Lit("-1")))))
        grad = ir.Var(body.tensors[grad_name(level.name)])
        rest = tuple(i for i in level.indices if i not in inner)
        grad = align(grad, level.indices, (*inner, *rest))
        if not _is_simple(grad):
            grad = ir.Var(body.bind(grad))
        count: ir.Expr = ir.Var(rows[0])
        for row in rows[1:]:
            count = ir.Binary("*", count, ir.Var(row))
        total = ir.Var(body.bind(ir.Call("segment_sum", (grad, ids, count))))
        # `total` has the computed axes (flattened) first, then the plain ones in order.
        if len(computed) == 1:
            order = (computed[0], *plain)
            value: ir.Expr = total
        else:
            dims = [(self.axis_size(body, gather.source, n),) for n in (*computed, *plain)]
            value = ir.Call("reshape", (total, ir.Shape(tuple(dims))))
            order = (*computed, *plain)
        if order != tuple(range(rank)):
            inverse = [order.index(n) for n in range(rank)]
            value = ir.Call("transpose", (value, ir.Lit(repr(inverse))))
        return value

    def level(self, body: _Body, level: Level) -> ir.Expr:
        """The value of an intermediate or an output over its own indices."""
        if level.kind == "gather":
            return self.gather(body, level)
        if level.kind in ("max", "min"):
            (term,) = level.terms
            function = "reduce_max" if level.kind == "max" else "reduce_min"
            read = term.expr
            labels = tuple(read.indices) if isinstance(read, sp.Indexed) else ()
            if (
                labels
                and len(set(labels)) == len(labels)
                and set(labels)
                == {
                    *level.indices,
                    *term.summed,
                }
            ):  # reduce in the tensor's own layout: no transpose
                axes = [n for n, i in enumerate(labels) if i in term.summed]
                value = reduction(body, function, self.access(body, read, labels), axes)
                kept = tuple(i for i in labels if i not in term.summed)
                return align(ir.Var(body.bind(value)), kept, level.indices)
            order = (*level.indices, *term.summed)
            operand = self.expr(body, term.expr, order)
            if not _is_simple(operand):
                operand = ir.Var(body.bind(operand))
            axes = ir.Lit(repr(list(range(len(level.indices), len(order)))))
            return ir.Call(function, (operand,), (("axis", axes),))
        if level.kind == "logsumexp":
            (term,) = level.terms
            order = (*level.indices, *term.summed)
            operand = self.expr(body, term.expr, order)
            if not _is_simple(operand):
                operand = ir.Var(body.bind(operand))
            if len(term.summed) == 1 and body.stem == "_f" and level.name in self.is_output:
                return self.logsumexp_keeping_softmax(body, operand)
            axes = ir.Lit(repr(list(range(len(level.indices), len(order)))))
            return ir.Call("reduce_logsumexp", (operand,), (("axis", axes),))
        pieces = []
        for term in level.terms:
            parts = self.term(body, term.expr, term.summed, level.indices)
            if len(parts) > 1 and term.summed and _sum_of_squares(term.expr):
                # Expanded, a sum of squares can round below zero (to -0.03 in float32
                # at distance 0): clamp it where it is exactly nonnegative.
                value, axes = self.sum_terms(body, parts, level.indices)
                if not _is_simple(value):
                    value = ir.Var(body.bind(value))
                parts = [(ir.Call("maximum", (value, ir.Lit("0"))), axes)]
            pieces += parts
        if not pieces:  # the formula is identically zero
            body.uses_dtype = True
            shape = ir.Shape(tuple((self.index_size(body, i),) for i in level.indices))
            return ir.Call("zeros", (shape,), (("dtype", ir.Var("dtype")),))
        value, axes = self.sum_terms(body, pieces, level.indices)
        return self.full(body, value, axes, level.indices)

    def gradient(
        self,
        body: _Body,
        target: str,
        contributions: list[Contribution],
        scatters: list[Scatter] = (),
    ) -> ir.Expr:
        """Σ of contributions to one tensor's gradient, shaped like that tensor."""
        if contributions:
            indices = contributions[0].indices
        else:
            indices = fresh_indices(target, self.program.rank(target))
        self.register_axes(target, indices)
        pieces = [(self.scatter(body, s, indices), indices) for s in scatters]
        # Pointwise contributions add up into one expression with common factors pulled
        # out: softmax's `grad*y + s*y` becomes `(grad + s) * y`, two passes, not four.
        pointwise = [c for c in contributions if not c.summed and not c.diagonal]
        if len(pointwise) > 1:
            merged = sp.factor_terms(sp.Add(*[c.grad * c.partial for c in pointwise]))
            pieces += self.term(body, merged, (), indices)
            contributions = [c for c in contributions if c not in pointwise]
        for c in contributions:
            expr = c.grad * c.partial
            pieces += self.term(body, expr, c.summed, indices, c.diagonal)
        value, axes = self.sum_terms(body, pieces, indices)
        return self.full(body, value, axes, indices)


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
    return {i for a in e.atoms(sp.Indexed) for i in a.indices}


def _axes_of(e: sp.Expr, out: tuple[Index, ...], summed: tuple[Index, ...]):
    """Axes for materializing a pointwise factor: its widest access's own order, so that
    `tanh(A[b,j,k])` is `tf.tanh(A)` (shared with the forward pass), not a transpose."""
    widest = sorted(
        e.atoms(sp.Indexed), key=lambda a: (-len(set(a.indices)), sp.default_sort_key(a))
    )
    order = [i for a in widest for i in a.indices]
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


def lower(program: Program, backward: Backward) -> ir.Module:
    """The whole module for one op, from its program and its derivation."""
    lowerer = Lowerer(program, backward)
    inputs = {name: name for name in program.inputs}

    # Forward: intermediates in order, then outputs.
    fwd = _Body(program, dict(inputs), stem="_f")
    for level in program.intermediates:
        fwd.tensors[level.name] = level.name
        fwd.bind(lowerer.level(fwd, level), name=level.name)
    outputs = []
    for output in program.outputs:
        level = output.level
        value = lowerer.level(fwd, level)
        if any(len(group) > 1 for group in output.groups):
            value = ir.Var(fwd.bind(value))
            shape = ir.Shape(
                tuple(tuple(lowerer.index_size(fwd, i) for i in group) for group in output.groups)
            )
            value = ir.Call("reshape", (value, shape))
        fwd.bind(value, name=level.name)
        fwd.tensors[level.name] = level.name
        outputs.append(level.name)

    # Backward.
    bwd = _Body(program, dict(inputs))
    for output in program.outputs:
        bwd.tensors[output.level.name] = output.level.name
    for level in program.intermediates:
        bwd.tensors[level.name] = level.name
    grads = []
    for output in program.outputs:
        level = output.level
        name = grad_name(level.name)
        grads.append(name)
        if any(len(group) > 1 for group in output.groups):
            shape = ir.Shape(tuple((lowerer.index_size(bwd, i),) for i in level.indices))
            bwd.bind(
                ir.Call("reshape", (ir.Var(name), shape)),
                name=name,
                comment="split the composite axes",
            )
        bwd.tensors[name] = name
    by_target: dict[str, list[Contribution]] = {}
    for c in backward.contributions:
        by_target.setdefault(c.target, []).append(c)
    for name in backward.order:
        if name in lowerer.convolutions:
            continue  # TF's convolution backprop kernels read the consumer's gradient
        if name in lowerer.levels and name not in {o.level.name for o in program.outputs}:
            level = lowerer.levels[name]
            gname = grad_name(name)
            value = lowerer.gradient(bwd, name, by_target[name])
            if isinstance(value, ir.Var):  # passed through unchanged: no new name
                bwd.tensors[gname] = value.name
                continue
            bwd.bind(value, name=gname, comment=f"∂L/∂{name}")
            bwd.tensors[gname] = gname
    returns: list[str | None] = []
    for name in program.inputs:
        if name not in backward.targets:
            returns.append(None)
            continue
        contributions = by_target.get(name, [])
        scatters = [s for s in backward.scatters if s.target == name]
        gname = grad_name(name)
        if not contributions and not scatters:
            bwd.bind(ir.Call("zeros_like", (ir.Var(name),)), name=gname)
        elif not contributions and len(scatters) == 1 and lowerer.reads_rows(scatters[0]):
            bwd.bind(lowerer.sparse_rows(bwd, scatters[0]), name=gname)
        else:
            bwd.bind(lowerer.gradient(bwd, name, contributions, scatters), name=gname)
        returns.append(gname)
    backward_block = _finish(bwd, tuple(returns))

    # What the backward reads from the forward pass, and how `gradient(op)` recomputes it.
    # Borrowing forward values can leave a dtype or size definition nothing reads.
    backward_block = _borrow(backward_block, fwd.memo)
    backward_block = ir.prune(backward_block, backward_block.returns, set())
    read = ir.names_read(backward_block)
    forward_block = _finish(fwd, tuple(outputs))
    keep = set(outputs) | {name for name in read if name not in program.inputs}
    forward_block = ir.prune(
        forward_block,
        tuple(sorted(keep & {s.target for s in forward_block.steps})),
        set(program.inputs),
    )
    forward_block = ir.Block(forward_block.steps, tuple(outputs))
    saved = tuple(
        step.target
        for step in forward_block.steps
        if step.target in read
        and step.target not in outputs
        and step.target not in program.inputs
        and step.target not in _PRELUDE_NAMES
        and not step.target.startswith("_n_")
    )
    recompute = ir.prune(forward_block, saved, set(program.inputs) | set(outputs), fwd.recompute)
    # Per output axis, the input axes whose sizes multiply to its size; (None, None) for
    # an index sized by a range (from the spec, or inferred), which has no input axis.
    output_axes = tuple(
        tuple(
            tuple(
                lowerer.size_of[i] if isinstance(lowerer.size_of[i], tuple) else (None, None)
                for i in group
            )
            for group in output.groups
        )
        for output in program.outputs
    )
    return ir.Module(
        op=program.op,
        source=program.source,
        formulas=program.formulas,
        gradient_lines=gradient_lines(program, backward),
        inputs=program.inputs,
        ranks=tuple(program.rank(n) for n in program.inputs),
        outputs=tuple(outputs),
        output_axes=output_axes,
        unsized_outputs=any(
            source == (None, None) for axes in output_axes for group in axes for source in group
        ),
        attrs=tuple(
            ir.Attr(name, kind, {"float": "float", "int": "int", "bool": "bool"}[kind])
            for name, kind in program.attrs
        ),
        grads=tuple(grads),
        dim_checks=tuple(
            ir.DimCheck(index.name, axes) for index, axes in program.dims if len(axes) > 1
        ),
        forward=forward_block,
        saved=saved,
        recompute=recompute,
        backward=backward_block,
        index_inputs=program.index_inputs,
        positive_attrs=tuple(
            sorted(
                {
                    *program.positive_attrs,
                    *(
                        spatial.stride.name.removeprefix("_int_")
                        for conv in lowerer.convolutions.values()
                        for spatial in conv.spatial
                        if isinstance(spatial.stride, sp.Symbol)
                    ),
                }
            )
        ),
        sparse_gradients=tuple(
            step.target
            for step in backward_block.steps
            if isinstance(step.value, ir.Call) and step.value.function == "sparse_rows"
        ),
    )


def _finish(body: _Body, returns: tuple[str | None, ...]) -> ir.Block:
    """Prepend the size and dtype definitions the steps use."""
    prelude = []
    if body.uses_dtype:
        prelude.append(ir.Assign("dtype", ir.DType(body.program.value_inputs[0])))
    for var, source in sorted(body.sizes.items()):
        if isinstance(source, tuple):
            prelude.append(ir.Assign(var, ir.AxisSize(*source)))
        else:
            prelude.append(ir.Assign(var, integer(source)))
    return ir.Block(tuple(prelude + body.steps), returns)


def integer(e: sp.Expr) -> ir.Expr:
    """An integer SymPy expression (an extent) as code: sizes, int attrs, //, max."""
    if e.is_Integer:
        return ir.Lit(str(int(e)))
    if isinstance(e, sp.Symbol):
        shape = indexing.parse_shape_symbol(e)
        if shape is not None:
            return ir.AxisSize(*shape)
        return ir.Var(e.name)
    if isinstance(e, sp.floor):
        numerator, denominator = sp.fraction(sp.together(e.args[0]))
        return ir.Binary("//", integer(numerator), integer(denominator))
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


_PRELUDE_NAMES = ("dtype",)


def _borrow(block: ir.Block, forward: dict[ir.Expr, str]) -> ir.Block:
    """Read values the forward pass already computed (`tanh(A)`) instead of recomputing.

    The `forward` closure keeps them, as TF's tape would; `gradient(op)` recomputes them.
    """
    usable = {
        expr: name
        for expr, name in forward.items()
        if not any(n.startswith("_n_") for n in ir.names_in(expr))
    }

    def walk(e: ir.Expr) -> ir.Expr:
        if e in usable:
            return ir.Var(usable[e])
        if isinstance(e, ir.View):
            return ir.View(walk(e.operand), e.perm, e.slots)
        if isinstance(e, ir.Call):
            return ir.Call(
                e.function,
                tuple(walk(a) for a in e.args),
                tuple((k, walk(v)) for k, v in e.keywords),
            )
        if isinstance(e, ir.Einsum):
            return ir.Einsum(e.subscripts, tuple(walk(a) for a in e.operands))
        if isinstance(e, ir.Binary):
            return ir.Binary(e.op, walk(e.left), walk(e.right))
        if isinstance(e, ir.Negate):
            return ir.Negate(walk(e.operand))
        if isinstance(e, ir.List):
            return ir.List(tuple(walk(a) for a in e.items))
        if isinstance(e, ir.Cond):
            return ir.Cond(walk(e.predicate), walk(e.then), walk(e.otherwise))
        return e

    steps = []
    for step in block.steps:
        value = walk(step.value)
        if isinstance(value, ir.Var) and step.target.startswith("_t"):
            usable[ir.Var(step.target)] = value.name  # an alias: read the original
            continue
        steps.append(ir.Assign(step.target, value, step.comment))
    return ir.Block(tuple(steps), block.returns)


__all__ = ["Backward", "align", "lower", "tensor"]

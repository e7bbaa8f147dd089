"""Elementwise steps: functions, conditions and masks, softmax and logsumexp in log space,
reads of tensors.
"""

from __future__ import annotations

import itertools

import sympy as sp

from .. import functions as fn
from .. import interpolation, ir, lets, logaddexp, splits
from ..indexing import IOTA
from ..model import Index, index_of_size
from . import wide_select
from .common import (
    BINARY,
    LOGIC,
    MASKS,
    MAX_BROADCAST_RANK,
    RELATIONS,
    UNARY,
    _Body,
    _index_set,
    _is_gradient,
    _is_simple,
    _letters,
    _merged_groups,
    _print_order,
    _tensor_argument,
    _word,
)


class Pointwise:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

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
        if isinstance(e, logaddexp.logaddexp | logaddexp.nonempty):  # log Σ exp(a_i), max-shifted
            return logaddexp.lower(self, body, e, target)
        if isinstance(e, interpolation.lerp):  # a sampled read along one axis
            return interpolation.lower(self, body, e, target)
        if isinstance(e, splits.SPLITS):  # c // G, c % G, (h, r) in a position
            return splits.lower(self, body, e, target)
        if isinstance(e, sp.Min | sp.Max):  # an index clamp
            return self.clamp(body, e, target)
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
            if e.name.startswith(lets.VALUE_PREFIX):  # a let, computed at call time
                body.uses_dtype = True
                return ir.FloatSize(lets.symbol(e.name.removeprefix(lets.VALUE_PREFIX)).name)
            if e.name.startswith("_int_"):  # an int attr in index arithmetic
                return self.position_int(ir.Var(e.name))  # int64 beside index tensors
            return ir.Var(e.name)  # an attr
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
            if body.part == "backward":
                last = _select_last(e)
                if last is not None:
                    return self.expr(body, last, target)
            coeff, _ = e.as_coeff_Mul()
            negated = None
            if coeff.is_negative:
                negated = _smallest_factor(-e)
                if negated is None:
                    return ir.Negate(self.expr(body, -e, target))
                e = -e
            numerator, denominator = [], []
            for factor in sp.Mul.make_args(e):
                base, exponent = factor.as_base_exp()
                if exponent.is_Number and exponent.is_negative and not factor.is_Number:
                    denominator.append(base ** (-exponent))
                else:
                    numerator.append(factor)

            def product(numerator: list, denominator: list) -> ir.Expr:
                top = [
                    ir.Negate(self.expr(body, f, target))
                    if f == negated
                    else self.expr(body, f, target)
                    for f in sorted(numerator, key=_print_order)
                ]
                result = top[0] if top else ir.Lit("1")
                for factor in top[1:]:
                    result = ir.Binary("*", result, factor)
                for factor in sorted(denominator, key=_print_order):
                    result = ir.Binary("/", result, self.expr(body, factor, target))
                return result

            # The factors over fewer indices than the product first, among themselves:
            # `m * (g / t)` is one pass over m's axes, `m * g / t` two.
            full = len(_index_set(e))
            small = [f for f in (*numerator, *denominator) if len(_index_set(f)) < full]
            big = [f for f in numerator if f not in small]
            if big and len(small) >= 2:
                whole = product(big, [f for f in denominator if f not in small])
                small_numerator = [f for f in numerator if f in small]
                small_denominator = [f for f in denominator if f in small]
                if not (small_denominator and any(isinstance(f, tuple(MASKS)) for f in big)):
                    return ir.Binary("*", whole, product(small_numerator, small_denominator))
                # A mask times a quotient divides last, `m * g / t`: XLA turns a mask
                # times a value into a select of the value, so `m * (g / t)` gave 0 where
                # the mask is 0 and t is 0 (a max that is NaN: no entry ties, and NaN
                # as everywhere else), and `m * g / t` gives 0 / 0 as every target does.
                if small_numerator:
                    whole = ir.Binary("*", whole, product(small_numerator, []))
                for factor in sorted(small_denominator, key=_print_order):
                    whole = ir.Binary("/", whole, self.expr(body, factor, target))
                return whole
            return product(numerator, denominator)
        if isinstance(e, sp.Pow):
            base, exponent = e.args
            if exponent == -1:
                return ir.Binary("/", ir.Lit("1"), self.expr(body, base, target))
            inner = self.expr(body, base, target)
            if base.is_integer and exponent.is_Integer and exponent > 0:
                # a power in a position (`(c // G)*K*K` is `K**2`): an integer, never the
                # float `square` of the inputs' dtype (PyTorch's index_select refuses it)
                return ir.Binary("**", inner, ir.Lit(str(int(exponent))))
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
            if body.part == "backward" or self.segment_masked(e.args[0]):
                guarded = self.masked_weights(body, e, target)
                if guarded is not None:
                    return guarded
        if isinstance(e, fn.select):
            cond, then, otherwise = e.args
            if len(target) > wide_select.MAX_SELECT_RANK:  # past tf.where's rank
                wide = wide_select.lower(self, body, e, target)
                if wide is not None:
                    return wide
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
        if isinstance(e, fn.floor_index):  # a sampled read's lower neighbour (sampling.py)
            # Steps of their own, shared: a sampled coordinate's fraction takes its floor,
            # and its two neighbours (floor, floor + 1) the same integer floor.
            floor = ir.Call("floor", (_tensor_argument(body, self.expr(body, e.args[0], target)),))
            return ir.Var(body.bind(ir.Call("floor_position", (ir.Var(body.bind(floor)),))))
        if isinstance(e, fn.index_value):  # 0, 1, ... in the inputs' float dtype
            body.uses_dtype = True
            return ir.Call("cast", (self.expr(body, e.args[0], target), ir.Var("dtype")))
        if isinstance(e, sp.Function):
            func = type(e)
            args = tuple(self.expr(body, a, target) for a in e.args)
            if func in UNARY or func in BINARY:
                args = tuple(_tensor_argument(body, a) for a in args)
            if func is fn.floor:  # shared with the sampled read's neighbours (above)
                return ir.Var(body.bind(ir.Call(UNARY[func], args)))
            if func in UNARY:
                return ir.Call(UNARY[func], args)
            if func in BINARY:
                return ir.Call(BINARY[func], args)
            if func is fn.step_eq:  # a max's ties (ties.py)
                return self.tie_mask(body, e, args, target)
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
        """A condition as a boolean tensor over (a subset of) `target`'s axes; false
        wherever an index tensor it reads is read outside (lookups.py)."""
        compared, valid = self.collect_valid(body, lambda: self.logic(body, cond, target), target)
        if valid is None:
            return compared
        return ir.Call("logical_and", (compared, valid))

    def logic(self, body: _Body, cond: sp.Basic, target: tuple[Index, ...]) -> ir.Expr:
        if cond is sp.true or cond is sp.false:
            return ir.Lit(repr(bool(cond)))
        if isinstance(cond, sp.Not):
            return ir.Call("logical_not", (self.logic(body, cond.args[0], target),))
        for kind, function in LOGIC.items():
            if isinstance(cond, kind):
                parts = [self.logic(body, a, target) for a in cond.args]
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

    def logsumexp_keeping_softmax(self, body: _Body, operand: ir.Expr, rank: int) -> ir.Expr:
        """log Σ exp over the last axis of a rank-`rank` operand, step by step, keeping
        exp(u - max) / Σ as the softmax the gradient needs (as TF's tape keeps it);
        `gradient(op)` recomputes that softmax with one fused `tf.nn.softmax` instead."""
        last = (("axis", ir.Lit("-1")), ("keepdims", ir.Lit("True")))
        peak = body.bind(ir.Call("reduce_max", (operand,), last))
        # A row that is all -inf (every entry masked): log 0 = -inf, as tf.reduce_logsumexp.
        # Past rank 8 TensorFlow's where (SelectV2) raises even between one shape, so the
        # peak is selected flat and given its shape back.
        flat = ir.Var(peak)
        if rank > wide_select.MAX_SELECT_RANK:
            flat = ir.Call("reshape", (flat, ir.List((ir.Lit("-1"),))))
        finite = ir.Call("is_finite", (flat,))
        kept = ir.Call("where", (finite, flat, ir.Call("zeros_like", (flat,))))
        if rank > wide_select.MAX_SELECT_RANK:
            kept = ir.Call("reshape", (kept, ir.Call("shape", (ir.Var(peak),))))
        peak = body.bind(kept)
        shifted = body.bind(ir.Call("exp", (ir.Binary("-", operand, ir.Var(peak)),)))
        total = body.bind(ir.Call("reduce_sum", (ir.Var(shifted),), last))
        softmax = body.bind(ir.Binary("/", ir.Var(shifted), ir.Var(total)))
        fused = ir.Call("softmax", (operand,), (("axis", ir.Lit("-1")),))
        body.memo[fused] = softmax
        body.recompute[softmax] = fused
        value = ir.Binary("+", ir.Call("log", (ir.Var(total),)), ir.Var(peak))
        return ir.Call("squeeze", (value,), (("axis", ir.Lit("-1")),))

    def empty_rows_weigh_nothing(self, body: _Body, operand: ir.Expr, weights: str) -> str:
        """The gradient's softmax weights of masked logits, 0 in a row that is all -inf
        (every entry masked) where the softmax is 0 / 0 = nan: that row's log-sum-exp is
        -inf, and a term added to it (`log(sum(where(.., exp(u), 0), k) + sum(exp(s),
        j))`, Longformer's window beside its global keys) leaves the result finite and
        the row's cotangent exactly 0, so nan * 0 put nan into a gradient whose value is
        0. The forward keeps the softmax as it is (a masked mean of nothing is 0 / 0)."""
        last = (("axis", ir.Lit("-1")), ("keepdims", ir.Lit("True")))
        keep = ir.Call("is_finite", (ir.Call("reduce_max", (operand,), last),))
        zeros = ir.Call("zeros_like", (ir.Var(weights),))
        return body.bind(ir.Call("where", (keep, ir.Var(weights), zeros)))

    def masked_weights(self, body: _Body, e: sp.exp, target: tuple[Index, ...]) -> ir.Expr | None:
        """`exp(u - L)` in the gradient, with L a log-sum-exp and u masked logits that the
        fused softmax did not match (a gathered `a[src[n]]` read twice, as n and n', is two
        names for one set of logits): 0 where L is not finite, as the guarded softmax
        (`empty_rows_weigh_nothing`). Unguarded, a node with no edges (L = -inf) made
        exp(-inf + inf) = nan, and nan times its 0 mask reached every edge's gradient."""
        for term in sp.Add.make_args(e.args[0]):
            coefficient, access = term.as_coeff_Mul()
            if coefficient != -1 or not isinstance(access, sp.Indexed):
                continue
            if access.base.label.name not in self.logsumexp_of:
                continue
            if not self.may_be_masked(e.args[0] - term):
                return None
            argument = _tensor_argument(body, self.expr(body, e.args[0], target))
            weights = ir.Var(body.bind(ir.Call(UNARY[sp.exp], (argument,))))
            keep = ir.Call("is_finite", (self.expr(body, access, target),))
            return ir.Call("where", (keep, weights, ir.Call("zeros_like", (weights,))))
        return None

    def segment_masked(self, logits: sp.Expr) -> bool:
        """Whether `logits` are masked by a comparison of an index tensor (`where(dst[n]
        == v, u, -inf)`, in a chunk `dst[n] == v + tile_start`): a segment's, whose sums
        the op in one piece takes over the segment's rows alone, 0 where it has none.
        A chunk's forward is dense where the op's is segment sums (the shifted ids are
        no segment's), and there `exp(u - L)` at a node with no edge is exp(-inf + inf):
        it weighs nothing there (`masked_weights`), as the op's segment sum does."""

        def by_ids(c: sp.Basic) -> bool:
            return isinstance(c, sp.Eq | sp.Ne) and any(
                isinstance(side, sp.Indexed) and side.base.label.name in self.program.index_inputs
                for side in c.args
            )

        return any(
            isinstance(s, fn.select) and s.has(fn.NEG_INF) and by_ids(s.args[0])
            for s in logits.atoms(fn.select)
        )

    def may_be_masked(self, logits: sp.Expr, seen: frozenset = frozenset()) -> bool:
        """Whether `logits` hold -inf as written: in themselves, or in a level they read
        (`exp(where(dst[n] != v, -inf, s[n,h]))` makes the masked logits a level of their
        own, whose row of a node with no edges is all -inf)."""
        if logits.has(fn.NEG_INF):
            return True
        for access in logits.atoms(sp.Indexed):
            name = access.base.label.name
            level = self.levels.get(name)
            if level is None or name in seen:
                continue
            if any(self.may_be_masked(t.expr, seen | {name}) for t in level.terms):
                return True
        return False

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
                if self.may_be_masked(logits) and body.part == "backward":
                    weights = self.empty_rows_weigh_nothing(body, operand, weights)
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
        if name in self.program.index_inputs and self.is_lookup(access):
            return self.lookup(body, access, target)
        if name in self.program.index_inputs:  # compared and added with tf.range values
            ids: ir.Expr = ir.Var(name)
            for axis, label in enumerate(labels):
                # read at an index `ranges` sizes (CSR offsets `indptr[s]` over
                # indptr.shape[0] - 1 segments): its first positions, zero past its end
                if not isinstance(self.size_of.get(label), tuple | None):
                    size = ir.Var(self.index_size(body, label))
                    ids = ir.Var(body.bind(ir.Call("fit", (ids, ir.Lit(str(axis)), size))))
            operand = ir.Var(body.bind(ir.Call("to_int64", (ids,))))
            return self.align(body, operand, labels, target)
        count = self.tie_count(body, name, labels)  # a max's ties, counted again (ties.py)
        operand: ir.Expr = ir.Var(body.tensors[name] if count is None else count)
        if len(set(labels)) != len(labels):
            unique = tuple(dict.fromkeys(labels))
            letters = _letters([labels, unique], self.preferred)
            subscripts = f"{_word(labels, letters)}->{_word(unique, letters)}"
            operand = ir.Var(body.bind(ir.Einsum(subscripts, (operand,))))
            labels = unique
        return self.align(body, operand, labels, target)


def _select_last(e: sp.Mul) -> sp.Expr | None:
    """A gradient's product with a select of 0 (`g * where(c, 2x, 0)`) as the select of
    the product (`where(c, g * 2x, 0)`), as autodiff applies a `where` last: where the
    chain rule's other factor is inf (`sqrt` of a row summed to 0, every term masked),
    `inf * 0` was nan, and in a gathered read (a ball query's empty ball) that nan was
    added into points other rows use. Only where another factor is a quotient or an
    incoming gradient (what is inf at a finite point: 1/S, S**-1/2, the gradient of such
    an intermediate) and the select holds no exponential (masked weights keep their form
    for `masked_values`). None where no factor is such a select."""
    factors = sp.Mul.make_args(e)
    if not any(
        (f.is_Pow and f.exp.is_negative) or any(_is_gradient(a) for a in f.atoms(sp.Indexed))
        for f in factors
        if not isinstance(f, fn.select)
    ):
        return None
    for factor in factors:
        if (
            isinstance(factor, fn.select)
            and 0 in factor.args[1:]
            and not factor.has(sp.exp)
            and not all(b.is_number for b in factor.args[1:])  # a 0/1 mask: masked_values
        ):
            cond, then, otherwise = factor.args
            rest = sp.Mul(*(f for f in factors if f is not factor))
            if then == 0:
                return fn.select(cond, 0, rest * otherwise)
            return fn.select(cond, rest * then, 0)
    return None


def _smallest_factor(e: sp.Mul) -> sp.Expr | None:
    """The factor of a product with fewer indices than the product itself, the fewest: a
    minus sign on it (`x * -g[b,i]`) costs a pass over that factor, not over the product
    (`-(x * g)` negates every element of the product). Negating a factor is exact."""
    if not isinstance(e, sp.Mul):
        return None
    full = len(_index_set(e))
    candidates = [
        f
        for f in sp.Mul.make_args(e)
        if len(_index_set(f)) < full and not (f.is_Pow and f.exp.is_negative)
    ]
    if not candidates or full == 0:
        return None
    return min(candidates, key=lambda f: (len(_index_set(f)), _print_order(f)))

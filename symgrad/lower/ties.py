"""A max's (min's) ties in its gradient, `[value == max] / ties`: the entries that attain
the extremum, sharing its gradient equally.

The test must compare the value exactly as the extremum it is compared with was taken
from it. The gradient's body computes the value again (the max's operand is not kept for
the backward: it is the large temporary), and a second computation need not be the same
bits: inside a graph (the user's tf.function, or TF's loop over chunks, where a chunk's
forward and gradient are one graph) TF's arithmetic optimizer orders the two products
apart, 1 ulp off, and no entry ties (a 0 gradient where one was due, and 0 / 0 nowhere
visible). So where the gradient computes the value itself, it takes the extremum and its
count of ties again from that very tensor (`recount`): both sides of every test are one
computation, and a row's shares add to 1 whatever the optimizer does.
"""

from __future__ import annotations

import itertools

import sympy as sp

from .. import functions as fn
from .. import ir
from ..model import Index
from .common import _Body, _index_set, align, reduction


class Ties:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

    def tie_mask(
        self, body: _Body, e: fn.step_eq, args: tuple[ir.Expr, ir.Expr], target: tuple[Index, ...]
    ) -> ir.Expr:
        """`[value == extremum]` over `target` as a 0/1 mask in the computation dtype."""
        body.uses_dtype = True
        key = _key(e)
        axes = _reduced_axes(e, target)
        kind = self.extremum_kind(key)
        mask = ir.Call("cast", (tie_test(*args, axes, kind), ir.Var("dtype")))
        same = self.reduced_tensor(body, e, args[0], target)
        if same is None:
            if key is not None:
                body.tie_counts[key] = None  # the saved count goes with the saved extremum
            return mask
        recounted = self.recount(body, e) if key is not None else None
        if recounted is not None:  # the recount's own mask, in this layout
            hits, count, order = recounted
            body.tie_counts[key] = count
            return align(ir.Var(hits), order, target)
        if key is not None:
            body.tie_counts[key] = None
        read = tie_test(same, args[1], axes, kind)
        body.written_as[ir.Call("cast", (read, ir.Var("dtype")))] = mask
        return ir.Call("cast", (read, ir.Var("dtype")))

    def extremum_kind(self, key: tuple[str, tuple] | None) -> str | None:
        """ "max" or "min": the kind of the extremum a tie test compares with."""
        if key is None:
            return None
        return next((lv.kind for lv in self.program.intermediates if lv.name == key[0]), None)

    def tie_count(self, body: _Body, name: str, labels: tuple) -> str | None:
        """The variable counting an extremum's ties (`_ties1[i,k]`) as the gradient's last
        test of it counted them (`recount`); None: the count the forward saved (also
        from now on, where the count is read before any test: the two must agree)."""
        if body.part != "backward":
            return None
        level = next((lv for lv in self.program.intermediates if lv.count == name), None)
        if level is None:
            return None
        key = (level.name, tuple(labels))
        if key not in body.tie_counts:
            body.tie_counts[key] = None
            body.saved_ties.add(key)
            return None
        return body.tie_counts[key]

    def recount(self, body: _Body, e: fn.step_eq) -> tuple[str, str, tuple] | None:
        """(the tie mask, the count of ties, their operand's axes) from the extremum taken
        again of the operand the gradient's body computed for `e` (`reduced_value`); None
        where it computed none, or read the saved count before (then the saved extremum
        is compared)."""
        key = _key(e)
        if body.part != "backward" or key in body.saved_ties or e.args[0] not in body.recomputed:
            return None
        operand, order = body.reduced[e.args[0]]
        at = key[1]
        axes = list(range(len(at), len(order)))
        kind = self.extremum_kind(key)
        function = "reduce_max" if kind == "max" else "reduce_min"
        local = body.bind(reduction(body, function, ir.Var(operand), axes))
        body.uses_dtype = True
        hit = tie_test(ir.Var(operand), align(ir.Var(local), at, order), tuple(axes), kind)
        hits = body.bind(ir.Call("cast", (hit, ir.Var("dtype"))))
        count = body.bind(reduction(body, "reduce_sum", ir.Var(hits), axes))
        return hits, count, order

    def reduced_tensor(
        self, body: _Body, e: fn.step_eq, value: ir.Expr, target: tuple[Index, ...]
    ) -> ir.Expr | None:
        """What a max's ties `e` = `[value == max]` compare, aligned to `target`: the very
        tensor the max reduced, or None (then `value`, as lowered, is compared).

        A second copy of it is the same value only if TF's graph optimizer merges the two
        copies. Unmerged, it can fuse one of them (Log and Neg into one kernel,
        tests/test_tf_monotone_extrema.py) or, where the ties want it in another layout
        (the max reduced `B[k,j] * D[i,j] * u[i]` over [i,k,j], the ties read it as
        [k,j,i]), multiply the products in another order (the smaller operands first):
        1 ulp off, no entry tied, and a nan or a wrong gradient under tf.function. The
        gradient's body, which computes the value again, compares it with the extremum
        taken again from it (`recount`)."""
        if body.part != "backward" and value in body.memo:
            return ir.Var(body.memo[value])
        if e.args[0] in body.recomputed:  # computed again, maybe read as that Var
            name, labels = body.reduced[e.args[0]]
            if set(labels) <= set(target):
                return align(ir.Var(name), labels, target)
        if isinstance(value, ir.Var) or (
            isinstance(value, ir.View) and isinstance(value.operand, ir.Var)
        ):  # a read of one tensor (`_s1`): the max's very operand already
            return None
        reduced = self.reduced_value(body, e)
        if reduced is None or not set(reduced[1]) <= set(target):
            if value in body.memo:
                return ir.Var(body.memo[value])
            return None
        name, labels = reduced
        return align(ir.Var(name), labels, target)

    def reduced_value(self, body: _Body, e: fn.step_eq) -> tuple[str, tuple] | None:
        """The tensor a max's (min's) ties `e` = `[value == max]` compare: the one the max
        reduced, in this body; else (the gradient's body) the value computed as the max
        computes it, in its layout (`body.recomputed`)."""
        found = body.reduced.get(e.args[0])
        if found is not None:
            return found
        extremum = e.args[1]
        if not isinstance(extremum, sp.Indexed):
            return None
        name = extremum.base.label.name
        level = next((lv for lv in body.program.intermediates if lv.name == name), None)
        if level is None or level.kind not in ("max", "min") or len(level.terms) != 1:
            return None
        (term,) = level.terms
        at = tuple(extremum.indices)  # the gradient's names for the max's indices
        if len(set(at)) != len(at) or set(at) & set(term.summed):
            return None
        summed = _summed_as(term.expr, dict(zip(level.indices, at, strict=True)), term.summed, e)
        if summed is None:
            return None
        value = e.args[0]
        order = (*at, *summed)
        operand = self.expr(body, value, order)
        if not isinstance(operand, ir.Var):
            operand = ir.Var(body.bind(operand))
        body.reduced[value] = (operand.name, order)
        body.recomputed.add(value)
        return body.reduced[value]


def tie_test(value: ir.Expr, extremum: ir.Expr, axes, kind: str | None) -> ir.Expr:
    """`value == extremum`, the entries of `value` that attain the extremum it was reduced
    to over `axes` (their positions in `value`'s layout), as `ir.Call("tie_hits")` where
    they are known: each target spells it. Under XLA (`jax.jit`) one tensor is computed
    again inside every fusion that reads it, and with FMA contraction a product-sum
    (`x² + z² - 2xz`) need not round alike in two fusions: the max's entry failed its
    own test in one and the row's gradient was lost (Chamfer's grad_z off by 1.2 in 7 of
    40 draws at x, z 1x2x1), so JAX takes a row with one entry (or none, where the
    extremum is a number) at the materialized arg-extremum (`_tie_hits`)."""
    if axes is None or kind not in ("max", "min"):
        return ir.Binary("==", value, extremum)
    keywords = (("axis", ir.Lit(repr(list(axes)))), ("kind", ir.Lit(repr(kind))))
    return ir.Call("tie_hits", (value, extremum), keywords)


def _reduced_axes(e: fn.step_eq, target: tuple[Index, ...]) -> tuple[int, ...] | None:
    """The positions in `target` of the indices a tie test `e` = `[value == max]` reduced
    (the value's indices the extremum lacks); None where `target` holds other indices
    than those and the extremum's, or the value does not read every one of them."""
    key = _key(e)
    if key is None:
        return None
    at = set(key[1])
    value_indices = _index_set(e.args[0])
    reduced = [n for n, i in enumerate(target) if i not in at]
    if not reduced or any(target[n] not in value_indices for n in reduced):
        return None
    return tuple(reduced)


def _summed_as(expr: sp.Expr, free: dict, summed: tuple, e: fn.step_eq) -> tuple | None:
    """The gradient's names for the indices the max reduced over, in their order, where
    `e` compares the max's own operand `expr` (its free indices renamed by `free`): a
    reduced index may be renamed too, to the input's own axis a δ left (the gradient of
    P[i,l] in a max over l reads the operand at l = that axis)."""
    named = expr.xreplace(free)
    rest = sorted(_index_set(e.args[0]) - set(free.values()), key=str)
    if len(rest) != len(summed):
        return None
    for names in itertools.permutations(rest):
        if named.xreplace(dict(zip(summed, names, strict=True))) == e.args[0]:
            return names
    return None


def _key(e: fn.step_eq) -> tuple[str, tuple] | None:
    """(the extremum's name, the gradient's names for its indices) of a tie test."""
    extremum = e.args[1]
    if not isinstance(extremum, sp.Indexed):
        return None
    return extremum.base.label.name, tuple(extremum.indices)

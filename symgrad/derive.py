"""Stage 4: the vector-Jacobian product of every level, with Kronecker deltas eliminated.

For a level `v[F] = Σ_terms Σ_S expr` and a tensor `X` it reads, the contribution to
`grad_X[P]` (P fresh indices, one per axis of X) is

    Σ_F Σ_S grad_v[F] · Σ_{accesses X[I] in expr} ∂expr/∂X[I] · Π_n δ(I_n, P_n).

Every index but P is summed, so each δ(u, P_n) whose `u` is still summed is eliminated by
substituting `u -> P_n` everywhere in the term. A δ that is left ties two of the P indices
(`A[b,i,i]`): the gradient lives on that diagonal. Differentiation is with respect to the
access as a plain symbol, never with respect to `Indexed` (SymPy would add its own deltas),
and P are fresh symbols, never a bound index (DESIGN.md, "Known pitfalls").

Levels are processed outputs first, then intermediates from the last to the first, so the
incoming gradient of an intermediate is complete before its own level is differentiated.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from . import functions as fn
from . import taken_branch
from .model import Index, Level, Program, accesses, read

P_PREFIX = "_p"


@dataclass(frozen=True)
class Partial:
    """∂(term)/∂X[P] before elimination, for `explain`: a partial times its deltas."""

    target: str
    level: str
    partial: sp.Expr  # ∂expr/∂X[I] with the level's own indices
    access: sp.Indexed  # X[I]
    deltas: tuple[tuple[sp.Expr, Index], ...]  # (I_n, P_n)
    summed: tuple[Index, ...]  # the term's bound indices


@dataclass(frozen=True)
class Contribution:
    """One einsum-shaped piece of grad_X: Σ_{summed} grad · partial, on X's axes `indices`."""

    target: str  # X: an input or an intermediate
    level: str  # the level it comes from
    grad: sp.Indexed  # the level's incoming gradient, indices after elimination
    partial: sp.Expr  # the derivative, indices after elimination
    summed: tuple[Index, ...]  # indices still summed
    indices: tuple[Index, ...]  # P: one per axis of X
    diagonal: tuple[tuple[Index, Index], ...]  # δ(P_m, P_n) left: nonzero only on P_m == P_n


@dataclass(frozen=True)
class Scatter:
    """grad_X += the transpose of a gather of X: its incoming gradient added back at the
    positions it read (a scatter-add; reads out of bounds add nothing)."""

    target: str  # X, an input
    level: str  # the gather level


@dataclass(frozen=True)
class Backward:
    """Everything lowering needs to emit the backward pass."""

    grads: tuple[tuple[str, str], ...]  # (level name, name of its incoming gradient)
    order: tuple[str, ...]  # levels in the order their gradients are complete
    contributions: tuple[Contribution, ...]
    partials: tuple[Partial, ...]
    targets: tuple[str, ...]  # inputs that get a gradient, in op input order
    scatters: tuple[Scatter, ...] = ()


def grad_name(level: str) -> str:
    """`y` -> `grad_y`; intermediates `_s1` -> `_grad_s1`."""
    return f"_grad{level}" if level.startswith("_") else f"grad_{level}"


def fresh_indices(target: str, rank: int) -> tuple[Index, ...]:
    """The gradient indices of `target`: fresh, and distinct per target."""
    return tuple(sp.Symbol(f"{P_PREFIX}{n}_{target.lstrip('_')}") for n in range(rank))


def _differentiable(program: Program) -> set[str]:
    """Inputs that get a gradient, and intermediates that depend on one of them."""
    live = {name for name in program.inputs if name not in program.no_gradient}
    for level in program.intermediates:
        reads = {a.base.label.name for t in level.terms for a in accesses(t.expr)}
        if level.gather is not None:
            reads.add(level.gather.source)
        if reads & live:
            live.add(level.name)
    return live


def partial_derivative(level: Level, expr: sp.Expr, access: sp.Indexed) -> sp.Expr:
    """∂expr/∂access, treating every distinct access as an independent scalar."""
    placeholders = {a: sp.Symbol(f"_x{n}", real=True) for n, a in enumerate(accesses(expr))}
    plain = expr.xreplace(placeholders)
    # powsimp: d(u**n)/du is n*u**n/u in SymPy, nan at u = 0; n*u**(n-1) is not.
    derivative = sp.powsimp(sp.diff(plain, placeholders[access]))
    if level.kind == "logsumexp":
        # ∂/∂u log Σ exp(u) = exp(u - L): the softmax weight, in the stable form.
        weight = sp.exp(plain - read(level.name, level.indices))
        derivative = weight * derivative
    elif level.kind in ("max", "min"):
        # As TF's reduce_max: the gradient goes to the entries that attain the extremum,
        # split equally among ties.
        value = read(level.name, level.indices)
        ties = read(level.count, level.indices)
        derivative = fn.step_eq(plain, value) / ties * derivative
    back = {symbol: a for a, symbol in placeholders.items()}
    return derivative.xreplace(back)


def eliminate(
    deltas: list[tuple[sp.Expr, Index]], summed: list[Index]
) -> tuple[dict[Index, Index], list[tuple[Index, Index]], list[Index]]:
    """Eliminate δ(u, p) for summed u: returns (substitution, residual deltas, summed left)."""
    substitution: dict[Index, Index] = {}
    residual: list[tuple[Index, Index]] = []
    remaining = list(summed)
    for u, p in deltas:
        u = u.xreplace(substitution)
        if u in remaining:
            substitution = {k: v.xreplace({u: p}) for k, v in substitution.items()}
            substitution[u] = p
            remaining.remove(u)
        elif u != p:
            residual.append((u, p))
    return substitution, residual, remaining


def output_patterns(program: Program) -> list[tuple[sp.Expr, sp.Indexed]]:
    """Forward results a derivative may contain: (pointwise formula, output access)."""
    extrema = {lv.name for lv in program.intermediates if lv.kind in ("max", "min")}
    patterns = []
    for output in program.outputs:
        level = output.level
        if any(len(group) > 1 for group in output.groups):
            continue  # op.outputs holds it with composite axes merged: another shape
        if len(level.terms) != 1 or level.terms[0].summed or level.kind != "sum":
            continue
        expr = level.terms[0].expr
        if isinstance(expr, sp.Indexed) and expr.base.label.name in program.inputs:
            continue  # y = X[...] is a copy; reading X is as cheap
        if isinstance(expr, sp.Indexed) and expr.base.label.name in extrema:
            # The tie mask compares each entry with the extremum, and its count must be
            # at least 1: compare with the extremum recomputed from the same entries, not
            # with an output a compiled kernel may have rounded differently.
            continue
        if not expr.atoms(sp.Indexed):
            continue
        patterns.append((expr, read(level.name, level.indices)))
    return patterns


def reuse_outputs(expr: sp.Expr, patterns) -> sp.Expr:
    """Replace sub-expressions equal to an output's formula (up to index renaming)."""
    for pattern, output in patterns:
        # The access with the most indices pins the renaming of the others.
        key = max(accesses(pattern), key=lambda a: len(set(a.indices)))
        needed = set(output.indices)
        if not needed <= set(key.indices):
            continue
        for candidate in accesses(expr):
            if candidate.base != key.base:
                continue
            mapping: dict[Index, Index] = {}
            consistent = True
            for mine, theirs in zip(key.indices, candidate.indices, strict=True):
                if mapping.setdefault(mine, theirs) != theirs:
                    consistent = False
            if not consistent:
                continue
            renamed = pattern.xreplace(mapping)
            if renamed.atoms(sp.Indexed) - expr.atoms(sp.Indexed):
                continue
            replacement = output.xreplace(mapping)
            candidate_expr = expr.subs(renamed, replacement)
            if isinstance(renamed, sp.Mul):
                candidate_expr = sp.Add(
                    *[
                        _divide_out(t, renamed, replacement)
                        for t in sp.Add.make_args(candidate_expr)
                    ]
                )
            if (
                _well_conditioned(candidate_expr, replacement)
                and _divides_by(candidate_expr) <= _divides_by(expr)
                and _splits_no_exp(expr, candidate_expr, renamed, replacement)
            ):
                expr = candidate_expr
    return expr


def _divide_out(term: sp.Expr, pattern: sp.Expr, output: sp.Expr) -> sp.Expr:
    """`term` as (term / pattern) * output when that removes accesses, e.g. layer norm's
    `(x - mu) / sigma**3` -> `y / sigma**2`: `subs` does not see through such powers."""
    quotient = sp.powsimp(term / pattern)
    before, after = term.atoms(sp.Indexed), quotient.atoms(sp.Indexed)
    if not after < before:
        return term
    # Never divide by something the term did not already divide by: `A*sin(B)` would
    # give `cos(B)*y/sin(B)`, nan wherever sin(B) = 0.
    _, term_denominator = sp.fraction(term)
    _, quotient_denominator = sp.fraction(quotient)
    if sp.fraction(sp.powsimp(term_denominator / quotient_denominator))[1] != 1:
        return term
    return quotient * output


def _divides_by(expr: sp.Expr) -> set[sp.Expr]:
    """What `expr` divides by. Reading an output must not add to it: `max(A,0)**(n-1)`
    as `y / max(A,0)` is nan wherever A <= 0."""
    return {p.base for p in expr.atoms(sp.Pow) if p.exp.could_extract_minus_sign()}


def _splits_no_exp(before: sp.Expr, after: sp.Expr, pattern: sp.Expr, output: sp.Expr) -> bool:
    """Whether reading an output left every exponential whole: `exp(A - L)` (a softmax
    weight) as `exp(A) * y` with `y = exp(-L)` is inf·0 = nan for logits in the hundreds,
    while `exp(A - y)` with `y = L` only renames inside the exponent."""
    whole = {sp.exp(e.args[0].subs(pattern, output)) for e in before.atoms(sp.exp)}
    return after.atoms(sp.exp) <= whole


def _well_conditioned(expr: sp.Expr, output: sp.Indexed) -> bool:
    """Whether reading `output` in `expr` only takes small powers of it: `A**0.001`
    would otherwise give `y**-999`, exact algebra but ruinous rounding."""
    for power in expr.atoms(sp.Pow):
        if power.base == output and not (power.exp.is_Rational and abs(power.exp) <= 2):
            return False
    return True


def derive(program: Program) -> Backward:
    """All contributions to all gradients of one op."""
    live = _differentiable(program)
    patterns = output_patterns(program)
    levels: list[Level] = [o.level for o in program.outputs]
    levels += list(reversed(program.intermediates))
    contributions: list[Contribution] = []
    scatters: list[Scatter] = []
    partials: list[Partial] = []
    order: list[str] = []
    reached = {o.level.name for o in program.outputs}
    outputs = set(reached)
    for level in levels:
        if level.name not in reached:
            continue  # no gradient flows into this intermediate
        order.append(level.name)
        grad = read(grad_name(level.name), level.indices)
        if level.gather is not None:
            if level.gather.source in live:
                scatters.append(Scatter(level.gather.source, level.name))
                reached.add(level.gather.source)
            continue
        into = [c for c in contributions if c.target == level.name]
        cond = taken_branch.guard(level, into) if level.name not in outputs else None
        for term in level.terms:
            for access in accesses(term.expr):
                target = access.base.label.name
                if target not in live:
                    continue
                partial = partial_derivative(level, term.expr, access)
                if partial == 0:
                    continue
                partial = taken_branch.guarded(partial, cond)
                indices = fresh_indices(target, len(access.indices))
                deltas = list(zip(access.indices, indices, strict=True))
                partials.append(
                    Partial(target, level.name, partial, access, tuple(deltas), term.summed)
                )
                summed = [*level.indices, *term.summed]
                substitution, residual, remaining = eliminate(deltas, summed)
                new_grad = grad.xreplace(substitution)
                new_partial = partial.xreplace(substitution)
                new_partial = reuse_outputs(new_partial, patterns)
                contributions.append(
                    Contribution(
                        target=target,
                        level=level.name,
                        grad=new_grad,
                        partial=new_partial,
                        summed=tuple(remaining),
                        indices=indices,
                        diagonal=tuple(residual),
                    )
                )
                reached.add(target)
    targets = tuple(name for name in program.inputs if name in live)
    grads = tuple((name, grad_name(name)) for name in order)
    return Backward(
        grads, tuple(order), tuple(contributions), tuple(partials), targets, tuple(scatters)
    )

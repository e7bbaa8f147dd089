"""Contractions: a term (a product summed over indices) as einsums, pairwise in the order
opt_einsum finds, with pre-reductions, diagonal embedding, centring and polynomial
expansion.
"""

from __future__ import annotations

import opt_einsum
import sympy as sp
from sympy.core.relational import Relational

from .. import functions as fn
from .. import ir
from ..model import Index, tensor
from .common import (
    MAX_BROADCAST_RANK,
    MAX_EXPANDED_TERMS,
    REPRESENTATIVE_SIZE,
    _axes_of,
    _Body,
    _index_set,
    _is_gradient,
    _is_simple,
    _letters,
    _word,
    align,
    reduction,
    same_size,
)


def _first_or_zero(points: ir.Var, axes: list[int], rank: int, sized: str) -> ir.Expr:
    """The first of `points` over `axes`, or 0 where they hold none: a point of the set,
    so that the differences of points on a lattice (integers, say) stay exact and
    distances that tie stay tied. A mean of several points rounded them apart: the
    gradient of a max over tied squared distances went to one of them, not split."""
    size: list[ir.Expr] = [ir.Lit("-1")] * rank
    for axis in axes:
        size[axis] = ir.Call("minimum", (ir.AxisSize(sized, axis), ir.Lit("1")))
    first = ir.Call("slice", (points, ir.List((ir.Lit("0"),) * rank), ir.List(tuple(size))))
    return ir.Call("reduce_sum", (first,), (("axis", ir.Lit(repr(axes))),))


def _finite_or_zero(center: ir.Var) -> ir.Expr:
    """`center` where it is finite, else 0: a nan or inf first point moves nothing. Moved
    by a nan, every point was nan (every output, where the op as written has nan in
    that point's row alone)."""
    finite = ir.Call("is_finite", (center,))
    return ir.Call("where", (finite, center, ir.Call("zeros_like", (center,))))


def _shift_directions(factor: sp.Expr, found: list) -> list[dict]:
    """A basis of the directions σ (one number per access) along which the polynomial
    `factor` does not change, `u -> u + σ_u t` for every t: its derivative along σ,
    Σ_u σ_u ∂factor/∂u, is identically 0, a linear system in σ (SymPy's nullspace)."""
    sigma = [sp.Dummy(f"s{n}") for n in range(len(found))]
    along = sp.expand(sum((s * sp.diff(factor, a) for s, a in zip(sigma, found)), sp.S.Zero))
    if along == 0:
        return [dict.fromkeys(found, sp.S.One)] if found else []
    equations = sp.Poly(along, *found).coeffs()
    matrix, _ = sp.linear_eq_to_matrix(equations, sigma)
    directions = [dict(zip(found, vector, strict=True)) for vector in matrix.nullspace()]
    # a shift by a number per access (an attr's value is not known when lowering)
    return [d for d in directions if all(v.is_Rational for v in d.values())]


def _invariant_basis(factor: sp.Expr, spread: list) -> list[tuple[sp.Indexed, dict]]:
    """The directions of `spread` along which `factor` does not change
    (`_shift_directions`), in reduced row echelon form over `spread`'s order: each moves
    its own set of points (its pivot) by 1 and no other direction's pivot. `(x - z)**2`:
    both by 1; `(x + z)**2`: z by -1; `(x - 2z)**2`: z by 1/2; `(x - z)**2 * (u - v)**2`:
    x and z by 1, then u and v by 1, each pair moved to its own origin."""
    directions = _shift_directions(factor, spread) if spread else []
    if not directions:
        return []
    # A pivot from the set read in the most sums first: `(x - z) * (u - z)` moves all
    # three alike, by z's first point, next to both x and u. Moved by u's (far from x,
    # as u - z says nothing of u - x), `x'z'` and `z'²` cancelled: 641 off in 2e5.
    sums = [f.base if f.is_Pow else f for f in sp.Mul.make_args(factor)]
    spread = sorted(
        spread, key=lambda a: -sum(1 for s in sums if s.is_Add and s.has(a))
    )  # stable: `spread`'s own order among equals
    rows, pivots = sp.Matrix([[d[a] for a in spread] for d in directions]).rref()
    return [
        (spread[p], {a: rows[r, n] for n, a in enumerate(spread)}) for r, p in enumerate(pivots)
    ]


def _expands_safely(polynomial: sp.Expr) -> bool:
    """Whether the product of polynomial factors `polynomial` may be expanded into
    monomials: where it multiplies sums of accesses together (a power of a sum, or a
    product of two), no such sum reads a set of points that no direction the product is
    invariant along moves (`_invariant_basis`). `(x - s*z)**2`, s an attr, moves by no
    number: expanded, `x² - 2sxz + s²z²` is 0 in float32 far from the origin where the
    square is not, and `(x - s*z) * (u - v)` cancels so however u and v move. A single
    sum (`w[o,c] * (x[idx] - x[n])`, EdgeConv) is expanded as before, into einsums of
    x. Reads at looked-up positions are never moved (`Contraction.centered`)."""
    sums = [
        (f.base if f.is_Pow else f, f.exp if f.is_Pow else sp.S.One)
        for f in sp.Mul.make_args(polynomial)
    ]
    sums = [(s, n) for s, n in sums if s.is_Add and len(s.atoms(sp.Indexed)) >= 2 and n.is_Integer]
    if sum(n for _, n in sums) < 2:
        return True
    found, _, spread = _sets_of_points(polynomial)
    moved: set = set()
    if not _unmovable(found):
        for _, direction in _invariant_basis(polynomial, spread):
            moved |= {a for a, v in direction.items() if v != 0}
    return all(not (s.atoms(sp.Indexed) & set(spread)) - moved for s, _ in sums)


def _sets_of_points(polynomial: sp.Expr) -> tuple[list, set, list]:
    """The accesses of `polynomial` (in SymPy's order), the indices they all share, and
    its sets of points: the accesses over more than those (`x[i,c]`, `z[j,c]`, not the
    offset `t[c]`)."""
    found = sorted(polynomial.atoms(sp.Indexed), key=sp.default_sort_key)
    common = set.intersection(*(set(a.indices) for a in found))
    return found, common, [a for a in found if not set(a.indices) <= common]


def _unmovable(found: list) -> bool:
    """Whether a set of accesses is read where moving it is not done: at repeated indices,
    or at looked-up positions (`x[b,c,idx[b,n,k]] - x[b,c,n]`): moved, that held one more
    copy of x in PyTorch (EdgeConv, 1.23x the step's bound)."""
    return any(len(set(a.indices)) != len(a.indices) for a in found) or any(
        not isinstance(p, sp.Symbol) for a in found for p in a.indices
    )


class Contraction:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

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
        band = self.band_term(body, e, summed, out, eyes)
        if band is not None:
            return [band]
        prefix = self.prefix_sum(body, e, summed, out, eyes)
        if prefix is not None:
            return [prefix]
        segment = self.segment_term(body, e, summed, out, eyes)
        if segment is not None:
            return [segment]
        interval = self.interval_term(body, e, summed, out, eyes)
        if interval is not None:
            return [interval]
        masked = self.masked_sum(body, e, summed, out, eyes)
        if masked is not None:
            return masked
        # The polynomial factors no single operand covers, centred together: a product
        # `(x - z) * (u - v)` moves x and z to one origin and u and v to another;
        # centred one factor at a time, the rest of the product was expanded far from
        # the origin (float32 at 1e4 and -3e4: 356 for 194).
        operand_sets = [set(a.indices) for a in e.atoms(sp.Indexed)]
        polynomial = [
            factor
            for factor in sp.Mul.make_args(e)
            if not isinstance(factor, sp.Indexed)
            and factor.atoms(sp.Indexed)
            and not any(_index_set(factor) <= s for s in operand_sets)
            and factor.is_polynomial(*factor.atoms(sp.Indexed))
        ]
        group = sp.Mul(*polynomial)
        if polynomial and _expands_safely(group):
            centered = self.centered(body, group)
            if centered is not None:
                rest = [f for f in sp.Mul.make_args(e) if f not in polynomial]
                e = sp.Mul(*rest) * centered
            # A comparison stays as written: a max's tie test `[(x - z)**2 == m]`
            # (`step_eq`) against the max of `(x - z)**2` never holds once its left side
            # is `x**2 - 2*x*z + z**2` (rounded otherwise): every gradient was 0.
            kept = {r: sp.Dummy() for r in e.atoms(Relational, fn._Step)}
            expanded = sp.expand(
                e.xreplace(kept), power_base=False, power_exp=False, log=False
            ).xreplace({d: r for r, d in kept.items()})
            parts = sp.Add.make_args(expanded)
            if 1 < len(parts) <= MAX_EXPANDED_TERMS:
                pieces = []
                for part in parts:
                    pieces += self.term(body, part, summed, out, eyes)
                return pieces
        return [self.contract(body, e, summed, out, eyes)]

    def same_size(self, i: Index, k: Index) -> bool:
        """Whether two indices are known to have the same size."""
        return same_size(self.size_of, i, k)

    def centered(self, body: _Body, factor: sp.Expr) -> sp.Expr | None:
        """A translation-invariant polynomial (`(x[b,i,k] - z[b,j,k])**2`) over points
        moved next to the origin, before it is expanded into monomials.

        Expanded, `x² + z² - 2xz` cancels catastrophically for points far from the
        origin (float32 at offset 100 gives negative squared distances). Points are
        shifted by a center `c` over the indices all accesses share -- the first of one
        set of points over its other indices -- which changes nothing in exact
        arithmetic: the polynomial is checked to be invariant under `u -> u + σ_u t`,
        each access moved with its sign (`(x + z)**2` moves z the other way), or not at
        all. An access over shared indices alone that the polynomial reads only beside
        a set of points (`t[c]` in `(x[i,c] - z[j,c] - t[c])**2`) is first added into
        that set (`z + t`): centred or not, `z² + t² + 2zt` cancelled as well (float32 at
        offset 1e4 gave 0 for 3.7).
        """
        found, common, spread = _sets_of_points(factor)
        if _unmovable(found):
            return None
        # The sets of points first, an offset held: added to points next to the origin
        # (`z - c + t`, c near -t) it rounds as the difference as written does; added
        # to points far from it (`x + t/2`) it rounded off 1e-3 of a square of 2.
        origins: dict[str, str] = {}
        moved = self.moved_to_origins(body, factor, spread, common, origins)
        folded = self.folded_offsets(body, moved, common, origins)
        if folded != moved:  # the offset went into one set: moved again, both together
            spread = sorted(folded.atoms(sp.Indexed), key=sp.default_sort_key)
            return self.moved_to_origins(body, folded, spread, common, origins)
        return moved if moved != factor else None

    def moved_to_origins(
        self, body: _Body, factor: sp.Expr, spread: list, common: set, origins: dict[str, str]
    ) -> sp.Expr:
        """`factor` moved along each direction of `_invariant_basis`, by the first point
        of its pivot set: the pivot moves next to the origin, and no other pivot moves."""
        current = {a: a for a in spread}
        for pivot, direction in _invariant_basis(factor, spread):
            signs = {current[a]: v for a, v in direction.items()}
            factor, renamed = self.moved(body, factor, current[pivot], signs, common, origins)
            current = {a: renamed.get(c, c) for a, c in current.items()}
        return factor

    def moved(
        self,
        body: _Body,
        factor: sp.Expr,
        pivot: sp.Indexed,
        signs: dict,
        common: set,
        origins: dict[str, str],
    ) -> tuple[sp.Expr, dict]:
        """`factor` over its accesses moved by `signs` times the center, the first point
        of the set `pivot` over its other indices; and the accesses it renamed."""
        axes = [n for n, i in enumerate(pivot.indices) if i not in common]
        center_labels = tuple(i for i in pivot.indices if i in common)
        points = ir.Var(body.tensors[pivot.base.label.name])
        sized = origins.get(pivot.base.label.name, points.name)  # a step's own name is
        # not renamed where another body borrows the step (`_f1` for `_t1`)
        first = ir.Var(body.bind(_first_or_zero(points, axes, len(pivot.indices), sized)))
        center = ir.Var(body.bind(_finite_or_zero(first)))
        mapping = {  # `(x - 2z)**2`: z moves by c / 2
            access: self.added(body, access, -v, center, center_labels, origins)
            for access, v in signs.items()
            if v != 0
        }
        return factor.xreplace(mapping), mapping

    def added(
        self,
        body: _Body,
        access: sp.Indexed,
        coefficient: sp.Rational,
        other: ir.Expr,
        labels: tuple[Index, ...],
        origins: dict[str, str],
    ) -> sp.Indexed:
        """`access + coefficient * other` (`other` over `labels`, aligned to the access)
        as a tensor of the body, read as the access is; `origins` records the input
        whose shape it has."""
        read = self.align(body, other, labels, tuple(access.indices))
        if abs(coefficient) != 1:
            read = ir.Binary("*", ir.Lit(repr(float(abs(coefficient)))), read)
        source = access.base.label.name
        total = ir.Binary("+" if coefficient > 0 else "-", ir.Var(body.tensors[source]), read)
        name = body.bind(total)
        body.tensors[name] = name
        origins[name] = origins.get(source, body.tensors[source])
        return tensor(name)[tuple(access.indices)]

    def folded_offsets(
        self, body: _Body, factor: sp.Expr, common: set[Index], origins: dict[str, str]
    ) -> sp.Expr:
        """`factor` with each access over shared indices alone that it reads only as
        `u + κ f` for a set of points u added into u (`f -> 0`, `u -> u + κ f`);
        `origins` gets each tensor made, as the input whose shape it has."""
        found = sorted(factor.atoms(sp.Indexed), key=sp.default_sort_key)
        for offset in [a for a in found if set(a.indices) <= common]:
            directions = _shift_directions(factor, found)  # of the factor as it is now
            for points in [a for a in found if not set(a.indices) <= common]:
                # factor reads (points, offset) as points + κ offset: invariant along
                # (points: κ, offset: -1), which the other accesses do not move
                sign = next(
                    (
                        -d[points] / d[offset]
                        for d in directions
                        if d[offset] != 0
                        and d[points] != 0
                        and all(v == 0 for a, v in d.items() if a not in (points, offset))
                    ),
                    None,
                )
                if sign is None:
                    continue
                offset_tensor = ir.Var(body.tensors[offset.base.label.name])
                sum_read = self.added(
                    body, points, sign, offset_tensor, tuple(offset.indices), origins
                )
                factor = factor.xreplace({points: sum_read, offset: 0})
                found = sorted(factor.atoms(sp.Indexed), key=sp.default_sort_key)
                break
        return factor

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
        return self.scaled(body, value, coefficient), result_axes

    def scaled(self, body: _Body, value: ir.Expr, coefficient: sp.Expr) -> ir.Expr:
        """value times a scalar coefficient (numbers, attrs, sizes)."""
        if coefficient == 1:
            return value
        if not _is_simple(value):  # bound, so the same sum elsewhere is shared
            value = ir.Var(body.bind(value))
        if coefficient == -1:
            return ir.Negate(value)
        if coefficient.could_extract_minus_sign():
            return ir.Negate(ir.Binary("*", self.expr(body, -coefficient, ()), value))
        return ir.Binary("*", self.expr(body, coefficient, ()), value)

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

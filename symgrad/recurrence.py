"""Recurrences: an equation that reads its own left-hand tensor at earlier positions
along one index (the scan index), e.g. `h[b,t,d] = a[b,t,d] * h[b,t-1,d] + x[b,t,d]`.

Such an op is a sequential scan over its step: the equation at one position `t`, with
the scan index cut out of every tensor. Its step is an ordinary symgrad op, so its forward
and its gradient are derived like every other op's:

- the tensors read at `t` become their slices at `t` (`a[b,t,d]` -> `a[b,d]`), and
  inputs read at a lag a window of their recent slices (`x[b,t-k]` -> `x_recent[k, b]`,
  see `lagged_reads`);
- the reads of the recurrent tensor `e` steps back become reads of the past states: a
  constant lag `e` reads `h_lag<e>[b,d]`, a lag that depends on a summed index
  (`y[b,t-1-k]`, lfilter's order k) reads the window of the last states, newest first
  (`y_past[k, b]`); reads before the start read zero;
- `where(t == 0, h0[b,d], ...)` makes the first position its own step (the init step);
- equations after the recurrence that read the recurrent tensor at `t` (Mamba's
  `y[b,d,t] = sum(C[b,n,t] * h[b,d,n,t], n) + ...`) are computed inside the step, so an
  internal state (`outputs = ["y"]`) is never held over the whole sequence.

The gradient is the adjoint recurrence, run in the other direction: at each position the
step's derived vector-Jacobian product takes dL/dh[t] (from the direct uses plus what
later steps passed back) and gives the gradients of the step's inputs; its gradient
with respect to the past states is what it passes back to the earlier positions.

A read at a later position (`h[b,t+1,d]`) makes a reverse recurrence: the same scan over
the reversed sequence.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace

import sympy as sp

from . import composite_states, ir
from .errors import SymgradError, counted
from .lagged_reads import find_recent, input_lag, lagged_source, length_source, recent_text
from .parse import (
    Access,
    AttrRef,
    BinOp,
    Call,
    Compare,
    Constant,
    Equation,
    Group,
    IndexRef,
    Logic,
    Neg,
    Node,
    Num,
    Reduce,
    Sampled,
    Where,
    index_names,
    names_outside_lookups,
    parse_equation,
    shape_read,
)
from .spec import OpSpec
from .wavefront import wavefront_axes, wavefront_read


@dataclass(frozen=True)
class Plan:
    """A recurrence op split into its scan (`ir.Scan`) and the step ops it runs."""

    scan: ir.Scan
    body: OpSpec
    init: OpSpec | None


def _equations(op: OpSpec) -> list[Equation]:
    attrs = frozenset(n for n, _ in op.attrs) | frozenset(n for n, _ in op.lets)
    int_attrs = frozenset(n for n, k in op.attrs if k == "int") | frozenset(n for n, _ in op.lets)
    found = []
    for text in op.formulas:
        try:
            found.append(parse_equation(text, attrs, int_attrs))
        except SymgradError as exc:
            raise exc.located(op.source, text) from None
    return found


def _accesses(node) -> list[Access]:
    """Every tensor access in a formula, in written order (index tensors inside brackets
    included)."""
    if isinstance(node, Access):
        return [node, *(a for p in node.positions for a in _accesses(p))]
    if isinstance(node, Neg):
        return _accesses(node.operand)
    if isinstance(node, BinOp):
        return _accesses(node.left) + _accesses(node.right)
    if isinstance(node, Call):
        return [a for arg in node.args for a in _accesses(arg)]
    if isinstance(node, Reduce):
        return _accesses(node.body)
    if isinstance(node, Compare):
        return [a for o in node.operands for a in _accesses(o)]
    if isinstance(node, Logic):
        return [a for arg in node.args for a in _accesses(arg)]
    if isinstance(node, Where):
        return _accesses(node.cond) + _accesses(node.then) + _accesses(node.otherwise)
    if isinstance(node, Sampled):
        return _accesses(node.expr)
    return []


def _value_indices(node, inside: bool = False) -> list[IndexRef]:
    """Index names used as values or in comparisons (outside any brackets)."""
    if isinstance(node, IndexRef):
        return [] if inside else [node]
    if isinstance(node, Access):
        return []
    if isinstance(node, Neg):
        return _value_indices(node.operand)
    if isinstance(node, BinOp):
        return _value_indices(node.left) + _value_indices(node.right)
    if isinstance(node, Call):
        return [i for arg in node.args for i in _value_indices(arg)]
    if isinstance(node, Reduce):
        return _value_indices(node.body)
    if isinstance(node, Compare):
        return [i for o in node.operands for i in _value_indices(o)]
    if isinstance(node, Logic):
        return [i for arg in node.args for i in _value_indices(arg)]
    if isinstance(node, Where):
        return (
            _value_indices(node.cond) + _value_indices(node.then) + _value_indices(node.otherwise)
        )
    return []


def reads_itself(equation: Equation) -> bool:
    return any(a.tensor == equation.output for a in _accesses(equation.rhs))


def is_recurrence(op: OpSpec) -> bool:
    """Whether an op has an equation that reads its own left-hand tensor."""
    return any(reads_itself(e) for e in _equations(op))


# ----------------------------------------------------------------------------- positions


def _symbolic(node: Node, fail) -> sp.Expr:
    """An integer index expression as SymPy (indices and int attrs as symbols)."""
    if isinstance(node, IndexRef | AttrRef):
        return sp.Symbol(node.name, integer=True)
    if isinstance(node, Num):
        return sp.Rational(node.value.numerator, node.value.denominator)
    if isinstance(node, Neg):
        return -_symbolic(node.operand, fail)
    if isinstance(node, BinOp) and node.op in "+-*":
        left, right = _symbolic(node.left, fail), _symbolic(node.right, fail)
        return {"+": left + right, "-": left - right, "*": left * right}[node.op]
    raise fail("a recurrence reads positions that are sums of indices and integers", node.col)


def _index_text(expr: sp.Expr) -> str:
    return str(sp.expand(expr)).replace(" ", "")


# ----------------------------------------------------------------------------- text


def _precedence(node) -> int:
    """How tightly a node binds when written back (Python's order)."""
    if isinstance(node, BinOp):
        return {"+": 1, "-": 1, "*": 2, "/": 2, "//": 2, "%": 2, "**": 4}[node.op]
    if isinstance(node, Neg):
        return 3
    if isinstance(node, Num) and node.value < 0 and node.value.denominator == 1:
        return 3  # written -3, like a negation
    return 5


def text(node, swap=lambda access: None) -> str:
    """A formula node written back as formula text; `swap` may rewrite accesses."""
    if isinstance(node, Num):
        v = node.value
        return str(v.numerator) if v.denominator == 1 else f"({v.numerator}/{v.denominator})"
    if isinstance(node, Constant | AttrRef | IndexRef):
        return node.name
    if isinstance(node, _Raw):
        return node.source
    if isinstance(node, Group):  # a composite read `x[b, (h, j)]`
        return f"({', '.join(i.name for i in node.indices)})"
    if isinstance(node, Sampled):  # a float position; `1.0 *` keeps it one when read back
        return f"1.0 * ({text(node.expr, swap)})"
    if isinstance(node, Access):
        found = swap(node)
        if found is not None:
            return found
        return f"{node.tensor}[{', '.join(text(p, swap) for p in node.positions)}]"
    if isinstance(node, Neg):
        inner = text(node.operand, swap)
        return f"-{inner}" if _precedence(node.operand) >= 3 else f"-({inner})"
    if isinstance(node, BinOp):
        mine = _precedence(node)
        left, right = text(node.left, swap), text(node.right, swap)
        if _precedence(node.left) < mine or (node.op == "**" and _precedence(node.left) <= mine):
            left = f"({left})"
        if _precedence(node.right) < mine or (
            node.op in ("-", "/", "//", "%") and _precedence(node.right) <= mine
        ):
            right = f"({right})"
        if node.op == "**" and _precedence(node.right) < 5:
            right = f"({text(node.right, swap)})"
        return f"{left} {node.op} {right}"
    if isinstance(node, Call):
        return f"{node.function}({', '.join(text(a, swap) for a in node.args)})"
    if isinstance(node, Reduce):
        return f"{node.kind}({text(node.body, swap)}, {', '.join(node.indices)})"
    if isinstance(node, Compare):
        parts = [text(node.operands[0], swap)]
        for op, operand in zip(node.ops, node.operands[1:], strict=True):
            parts += [op, text(operand, swap)]
        return f"({' '.join(parts)})"
    if isinstance(node, Logic):
        if node.op == "not":
            return f"(not {text(node.args[0], swap)})"
        return "(" + f" {node.op} ".join(text(a, swap) for a in node.args) + ")"
    if isinstance(node, Where):
        return (
            f"where({text(node.cond, swap)}, {text(node.then, swap)}, {text(node.otherwise, swap)})"
        )
    raise TypeError(f"not a formula node: {node!r}")  # pragma: no cover


# ----------------------------------------------------------------------------- analysis


class _Analysis:
    def __init__(self, op: OpSpec) -> None:
        self.op = op
        self.equations = _equations(op)
        recurrent = [e for e in self.equations if reads_itself(e)]
        self.eq = recurrent[0]
        if len(recurrent) > 1:
            raise self.fail(
                "an op has at most one recurrent equation (one that reads its own tensor)",
                recurrent[1].output_col,
                recurrent[1],
            )
        self.state = self.eq.output
        self.cuts: dict[str, int | None] = {}  # op input -> axis cut at the step, or None
        self.lags: set[int] = set()
        self.shifts: set[tuple[int, int]] = set()  # (lag, shift) of two-index reads
        self.window_reads = False
        self.recent: dict = {}  # op input -> lagged_reads.Recent: read at lags
        self.lookups: set[str] = set()  # index tensors the step reads: no gradient
        self.after_first = False  # the step being written runs from the second position on
        self.depth_sizes: list[tuple[int, str, int]] = []
        self.depth_const = 0

    def fail(self, message: str, col: int | None, equation: Equation | None = None):
        equation = equation or self.eq
        return SymgradError(message, where=self.op.source, formula=equation.text, column=col)

    # -- the scan index and direction ------------------------------------------------

    def scan_axis(self) -> None:
        eq = self.eq
        if any(len(g) > 1 for g in eq.groups):
            raise self.fail("a recurrent tensor has one index per axis", eq.output_col)
        lhs = eq.output_indices
        if len(set(lhs)) != len(lhs):
            raise self.fail("a recurrent tensor is not written on a diagonal", eq.output_col)
        axes: set[int] = set()
        for access in self.self_reads(eq):
            if len(access.positions) != len(lhs):
                raise self.fail(
                    f"{self.state!r} has {len(lhs)} axes but is read with "
                    f"{counted(len(access.positions), 'index', 'indices')} here",
                    access.col,
                )
            differ = [
                k
                for k, (p, i) in enumerate(zip(access.positions, lhs, strict=True))
                if not (isinstance(p, IndexRef) and p.name == i)
            ]
            # axes read at a shift of their own index; others may read another index
            # (an RNN's h[b,t-1,e] summed over e)
            shifted = [k for k in differ if lhs[k] in index_names(access.positions[k])]
            if differ and not shifted:
                raise self.fail(
                    f"{self.state!r} is read at other indices "
                    f"({', '.join(text(access.positions[k]) for k in differ)}) but at no shift "
                    "of its own: a recurrence reads its own tensor at earlier (or later) "
                    "positions of one of its indices, as h[b,t-1]",
                    access.col,
                )
            differ = shifted
            if not differ:
                raise self.fail(
                    f"{self.state!r} reads itself at the same position: a recurrence reads "
                    "its own tensor only at earlier (or only at later) positions of one index",
                    access.col,
                )
            axes.update(differ)
        self.inner = None
        if len(axes) > 1:
            self.axis, inner = wavefront_axes(self, sorted(axes))
            self.inner = lhs[inner]
        else:
            self.axis = axes.pop()
        self.index = lhs[self.axis]

    def self_reads(self, eq: Equation) -> list[Access]:
        return [a for a in _accesses(eq.rhs) if a.tensor == self.state]

    def lag_of(self, access: Access) -> sp.Expr:
        """e with the read at t - e (forward) or t + e (reverse); checked affine."""
        t = sp.Symbol(self.index, integer=True)

        def fail(message, col):
            return self.fail(message, col)

        position = _symbolic(access.positions[self.axis], fail)
        if sp.expand(position).coeff(t) != 1 or sp.expand(position - t).has(t):
            raise self.fail(
                f"{self.state!r} is read at a position along {self.index!r} that is not "
                f"{self.index} plus or minus an offset",
                access.col,
            )
        return sp.expand(t - position)

    def direction(self) -> None:
        signs = set()
        for access in self.self_reads(self.eq):
            lag = self.lag_of(access)
            if self.inner is not None and lag == 0:
                continue  # a read along the inner index of a two-index recurrence
            const = lag.subs({s: 0 for s in lag.free_symbols})
            coefficients = [lag.coeff(s) for s in lag.free_symbols]
            if const == 0 and not coefficients:
                raise self.fail("reads itself at the same position", access.col)
            if const >= 1 and all(c >= 0 for c in coefficients):
                signs.add(1)
            elif const <= -1 and all(c <= 0 for c in coefficients):
                signs.add(-1)
            else:
                raise self.fail(
                    f"{self.state!r} is read at {self.index} - ({lag}), which is not always "
                    f"before (or always after) {self.index}: the recurrence cannot be ordered",
                    access.col,
                )
        if len(signs) > 1:
            raise self.fail(
                f"{self.state!r} is read both before and after {self.index}: the recurrence "
                "cannot be ordered",
                self.self_reads(self.eq)[0].col,
            )
        self.reverse = signs == {-1}

    # -- sizes --------------------------------------------------------------------------

    def plain_source(self, index: str) -> tuple[str, int] | None:
        """An op input axis that `index` reads plainly, in any equation."""
        for eq in self.equations:
            for access in _accesses(eq.rhs):
                if access.tensor == self.state or access.tensor in self.defined:
                    continue
                for axis, p in enumerate(access.positions):
                    if isinstance(p, IndexRef) and p.name == index:
                        return access.tensor, axis
        return None

    def sized(self, index: str, col: int, eq: Equation | None = None) -> tuple[str, int]:
        found = self.plain_source(index) or lagged_source(self, index)
        if found is None:
            raise self.fail(
                f"index {index!r} of a recurrence must be read plainly by some input axis "
                "(it sizes the scan's state)",
                col,
                eq,
            )
        return found

    def state_size(self, index: str, col: int) -> tuple[tuple[str | None, int], tuple]:
        """The input axis that sizes state axis `index`, and what its size is divided by
        (an index read only inside a composite axis, or sized by its range)."""
        found = self.plain_source(index) or lagged_source(self, index)
        if found is not None:
            return found, ()

        def fail(message, col=col):
            return self.fail(message, col)

        found = composite_states.state_size(
            self.op, self.equations, self.defined | {self.state}, index, self.plain_source, fail
        )
        if found is None:
            raise self.fail(
                f"index {index!r} of a recurrence must be read plainly by some input axis "
                "(it sizes the scan's state), inside a composite read whose other indices "
                "are, or have a range from input shapes",
                col,
            )
        return found

    # -- rewriting a formula into its step -----------------------------------------------

    def cut(self, eq: Equation, index: str, node: Access) -> None:
        """Record how input `node.tensor` is read along the scan index `index`."""
        if node.tensor in self.recent:  # read at lags: its window, along one axis
            if not any(index in index_names(p) for p in node.positions):
                raise self.fail(
                    f"{node.tensor!r} is read at lags of {index!r} and here not along it; a "
                    "recurrence reads each input along the scan index, or whole",
                    node.col,
                    eq,
                )
            self.cuts[node.tensor] = self.recent[node.tensor].axis
            return
        axes = [
            k
            for k, p in enumerate(node.positions)
            if index in names_outside_lookups(p)
            if not (isinstance(p, IndexRef) and p.name == index)
        ]
        if axes:
            raise self.fail(
                f"{node.tensor!r} is read at a position computed from the scan index "
                f"{index!r}; a recurrence reads its inputs at {index} itself",
                node.col,
                eq,
            )
        plain = [
            k for k, p in enumerate(node.positions) if isinstance(p, IndexRef) and p.name == index
        ]
        if len(plain) > 1:
            raise self.fail(f"{node.tensor!r} is read on a diagonal of {index!r}", node.col, eq)
        axis = plain[0] if plain else None
        if node.tensor in self.cuts and self.cuts[node.tensor] != axis:
            raise self.fail(
                f"{node.tensor!r} is read both at {index} and elsewhere along another axis; "
                "a recurrence reads each input at the scan position along one axis, or whole",
                node.col,
                eq,
            )
        self.cuts[node.tensor] = axis

    def step_text(self, eq: Equation, rhs: Node, index: str, state_now: str | None) -> str:
        """`eq` at one position of `index`: cut inputs, past states, the state now."""
        for ref in _value_indices(rhs):
            if ref.name == index:
                raise self.fail(
                    f"the scan index {index!r} is used as a value; a recurrence may use it "
                    f"only as where({index} == 0, initial, ...)",
                    ref.col,
                    eq,
                )

        def swap(node: Access) -> str | None:
            if node.lookups:
                self.lookup_read(eq, node, index)
            rest = [text(p) for k, p in enumerate(node.positions) if k != self.axis]
            if node.tensor == self.state and eq is self.eq:
                lag = self.lag_of(node)
                lag = -lag if self.reverse else lag
                if self.inner is not None:
                    return wavefront_read(self, node, int(lag), rest)
                if not lag.free_symbols:
                    self.lags.add(int(lag))
                    return f"{self.lag_name(int(lag))}[{', '.join(rest)}]"
                self.window_reads = True
                return f"{self.window_name}[{_index_text(lag - 1)}, {', '.join(rest)}]"
            if node.tensor == self.state:  # a later equation, at the position now
                p = node.positions[self.axis]
                if not (isinstance(p, IndexRef) and p.name == index):
                    raise self.fail(
                        f"{self.state!r} is read here at another position than {index}; an "
                        "equation after a recurrence reads its state at the same position",
                        node.col,
                        eq,
                    )
                return f"{state_now}[{', '.join(rest)}]"
            if node.tensor in self.defined:
                raise self.fail(
                    f"{node.tensor!r} is computed by another equation; in a recurrence op, "
                    "later equations read only the recurrent tensor and inputs",
                    node.col,
                    eq,
                )
            self.cut(eq, index, node)
            if node.tensor in self.recent:
                return recent_text(self, eq, node, index, self.recent_name(node.tensor), swap)
            axis = self.cuts[node.tensor]
            kept = [text(p, swap) for k, p in enumerate(node.positions) if k != axis]
            if not kept:  # a step's tensors have an index: a[t] would be `a[]`
                raise self.fail(
                    f"{node.tensor!r} is read at the scan index {index!r} alone; not yet: "
                    f"a recurrence reads each input with another index too (give it the "
                    f"state's batch axis, {node.tensor}[b,{index}], or a unit one)",
                    node.col,
                    eq,
                )
            return f"{node.tensor}[{', '.join(kept)}]"

        body = text(rhs, swap)
        return body

    def lookup_read(self, eq: Equation, node: Access, index: str) -> None:
        """An input read at an index tensor's values (`x[b,t,lab[b,t]]`, CTC's and
        RNN-T's labels): the step reads both at the scan position, each cut along it or
        whole, and gathers there; an index tensor gets no gradient. Refused where the
        step could not read them so: the recurrent tensor or another equation's tensor at
        an index tensor's values, lags of either, index tensors inside index tensors."""
        if node.tensor == self.state or node.tensor in self.defined:
            raise self.fail(
                f"{node.tensor!r} is computed by the op and read here at an index tensor's "
                "values; a recurrence reads inputs there, not its own tensors",
                node.col,
                eq,
            )
        for lookup in node.lookups:
            # a window holds zeros before the start, where the index tensor has no value:
            # the read there must be zero (as an op reads outside an index tensor), not x
            # at position 0. Only a step that never sees the start may read one back.
            lag = input_lag(self, eq, lookup, index) if lookup.tensor in self.recent else None
            if lag is not None and lag[1] != 0 and not (lag[1] == 1 and self.after_first):
                raise self.fail(
                    f"index tensor {lookup.tensor!r} is read at an earlier position of the "
                    f"scan index {index!r}, which does not exist at the start; not yet: write "
                    f"the first position apart, where({index} == 0, ..., ...), with the read "
                    "in the other branch (one position back)",
                    lookup.col,
                    eq,
                )
            if lookup.lookups:
                raise self.fail(
                    f"index tensor {lookup.tensor!r} is read at another index tensor's values "
                    "inside a recurrence; not yet",
                    lookup.col,
                    eq,
                )
            self.lookups.add(lookup.tensor)

    def shift_name(self, lag: int, shift: int) -> str:
        return self.fresh(f"{self.state}_lag{lag}_back{shift}")

    def recent_name(self, name: str) -> str:
        return self.fresh(f"{name}_recent")

    def lag_name(self, lag: int) -> str:
        return self.fresh(f"{self.state}_lag{lag}")

    @property
    def window_name(self) -> str:
        return self.fresh(f"{self.state}_past")

    def fresh(self, name: str) -> str:
        while name in self.taken:
            name += "_"
        return name


def _lhs(a: _Analysis, eq: Equation, drop: str) -> str:
    def fail(message, col):
        return a.fail(message, col, eq)

    return composite_states.lhs(eq, drop, fail)


def plan(op: OpSpec) -> Plan:
    """The scan and the step ops of a recurrence op. SymgradError on what cannot be
    ordered or is not supported; an op refused as written is tried again with its
    internal tensors written in place of their reads (`inline_internals`), keeping the
    first refusal when that is refused too."""
    from . import inline_internals

    try:
        return _plan(op)
    except SymgradError as refused:
        simpler = inline_internals.inlined(op)
        if simpler is None:
            raise
        try:
            found = _plan(simpler)
        except SymgradError:
            raise refused from None
    return replace(found, scan=replace(found.scan, formulas=op.formulas))


def _plan(op: OpSpec) -> Plan:
    from . import coupled

    split = composite_states.split_states(op)  # a read tensor's composite axis: split
    if split is not op:  # the module's docstring shows the formulas as written
        found = _plan(split)
        return replace(found, scan=replace(found.scan, formulas=op.formulas))
    if coupled.is_coupled(op):  # several recurrent tensors, or reads of one at t - e
        return coupled.plan(op)
    a = _Analysis(op)
    a.defined = {e.output for e in a.equations}
    a.taken = (
        {acc.tensor for e in a.equations for acc in _accesses(e.rhs)}
        | a.defined
        | {n for n, _ in op.attrs}
        | {n for n, _ in op.lets}
    )
    a.scan_axis()
    a.direction()
    eq = a.eq
    if a.equations.index(eq) != 0:
        raise a.fail("a recurrence op's recurrent equation comes first", eq.output_col)
    if any(name == a.index for name, _ in op.ranges):
        raise a.fail(f"the scan index {a.index!r} takes its size from an input, not a range", 0)

    rhs, init_rhs = eq.rhs, None
    if _conditions_on(rhs, a.index):  # where(t == 0, h0[b,d], ...): the first position
        if a.reverse:
            raise a.fail(
                f"a reverse recurrence starts at the last position; a condition on "
                f"{a.index!r} names positions from the first",
                _conditions_on(rhs, a.index)[0].col,
            )
        init_rhs = _decide(rhs, a, first=True)
        rhs = _decide(rhs, a, first=False)

    later = a.equations[1:]
    outputs = op.outputs or tuple(e.output for e in a.equations)
    internal = a.state not in outputs
    for e in later:
        if e.output not in outputs:
            raise a.fail(
                "in a recurrence op, only the recurrent tensor may be internal",
                e.output_col,
                e,
            )
        if not a.self_reads(e):
            raise a.fail(
                f"in a recurrence op, every later equation reads {a.state!r} at the scan "
                "position (ops without it are separate ops)",
                e.output_col,
                e,
            )
    fused = bool(later)
    now = a.fresh(f"{a.state}_now") if fused else None

    def later_index(e: Equation) -> str:
        p = a.self_reads(e)[0].positions[a.axis]
        if isinstance(p, IndexRef) and p.name not in e.output_indices:
            raise a.fail(
                f"{e.output!r} sums or reduces {a.state!r} over the scan index {p.name!r}; "
                f"not yet: an equation after a recurrence keeps the scan index (reduce over "
                "it in an op of its own)",
                e.output_col,
                e,
            )
        if not (isinstance(p, IndexRef) and p.name in e.output_indices):
            raise a.fail(
                f"{a.state!r} is read here at another position than the scan position",
                a.self_reads(e)[0].col,
                e,
            )
        return p.name

    def step(rhs_node: Node, name: str) -> tuple[OpSpec, ir.ScanStep]:
        a.cuts_before = dict(a.cuts)
        state_text = _with_sizing_read(a, eq, rhs_node, a.step_text(eq, rhs_node, a.index, None))
        formulas = []
        if fused:
            formulas += [f"{now}[{', '.join(_rest(eq, a.index))}] = {state_text}"]
            formulas += [f"{_lhs(a, eq, a.index)} = {now}[{', '.join(_rest(eq, a.index))}]"]
        else:
            formulas += [f"{_lhs(a, eq, a.index)} = {state_text}"]
        step_outputs = [a.state]
        axes = [a.axis]
        for e in later:
            u = later_index(e)
            formulas.append(f"{_lhs(a, e, u)} = {a.step_text(e, e.rhs, u, now)}")
            step_outputs.append(e.output)
            axes.append(composite_states.axis_of(e, u))
        used = _used_names(formulas)
        reads: list[ir.ScanRead] = []
        op_inputs = _op_inputs(op, a)
        for n in op_inputs:
            if n in a.recent and a.recent_name(n) in used:
                r = a.recent[n]
                sizes = tuple((c, *source) for source, c in r.sizes.items())
                reads.append(
                    ir.ScanRead(
                        "recent",
                        a.recent_name(n),
                        r.axis,
                        input=n,
                        depth=r.const,
                        depth_sizes=sizes,
                    )
                )
            elif n in used and n not in a.recent:
                reads.append(ir.ScanRead("input", n, a.cuts.get(n)))
        for lag in sorted(a.lags):
            if a.lag_name(lag) in used:
                reads.append(ir.ScanRead("lag", a.lag_name(lag), None, lag))
        if a.window_reads and a.window_name in used:
            reads.append(ir.ScanRead("window", a.window_name))
        for lag, shift in sorted(a.shifts):
            if a.shift_name(lag, shift) in used:
                axis = _rest(eq, a.index).index(a.inner)
                reads.append(ir.ScanRead("lag", a.shift_name(lag, shift), axis, lag, shift))
        attrs = tuple((n, k) for n, k in op.attrs if n in used | _size_names(op))
        spec = OpSpec(
            name=f"{op.name}{name}",
            formulas=tuple(formulas),
            inputs=tuple(r.name for r in reads),
            attrs=attrs,
            no_gradient=tuple(n for n in op.no_gradient if n in used),
            source=op.source,
            sizes=tuple((i, s) for i, s in op.sizes if i != a.index),
            ranges=op.ranges,
            max_temp_bytes=op.max_temp_bytes,
            outputs=tuple(step_outputs) if fused else None,
            lets=op.lets,
        )
        spec = _without_vanished_attrs(spec)
        return spec, ir.ScanStep(
            prefix=f"_{name.lower()}",
            reads=tuple(reads),
            outputs=tuple(step_outputs),
            output_axes=tuple(axes),
            attrs=tuple(n for n, _ in spec.attrs),
        )

    a.recent = find_recent(a, [(eq, a.index)] + [(e, later_index(e)) for e in later])
    # the body step runs from the second position on where the first has a step of its own
    a.after_first = init_rhs is not None
    body_spec, body = step(rhs, "Step")
    a.after_first = False
    init_spec, init = step(init_rhs, "Init") if init_rhs is not None else (None, None)
    lets, ranges = step_sizes(op, a.cuts, a.index, {r.name for r in body.reads})
    body_spec = replace(body_spec, lets=lets, ranges=ranges)
    if init_spec is not None:
        init_spec = replace(init_spec, lets=lets, ranges=ranges)

    # sizes: the state's axes, the number of steps, the window's depth
    state_sizes = [a.state_size(i, eq.output_col) for i in _rest(eq, a.index)]
    state_axes = tuple(axes for axes, _ in state_sizes)
    state_divisors = tuple(divisors for _, divisors in state_sizes)
    length = a.plain_source(a.index) or length_source(a, a.recent)
    length = length or a.sized(a.index, eq.index_col(a.index))
    depth_const, depth_sizes = max({*a.lags, *(lag for lag, _ in a.shifts)}, default=0), []
    if a.window_reads:
        depth_const, depth_sizes = _window_depth(a, eq)
        depth_const = max(depth_const, max(a.lags, default=0))
    op_inputs = _op_inputs(op, a)
    ranks = []
    for n in op_inputs:
        found = [
            len(acc.positions) for e in a.equations for acc in _accesses(e.rhs) if acc.tensor == n
        ]
        ranks.append(found[0])
    scan = ir.Scan(
        op=op.name,
        source=op.source,
        formulas=op.formulas,
        index=a.index,
        reverse=a.reverse,
        inputs=op_inputs,
        ranks=tuple(ranks),
        cut_axes=tuple(a.cuts.get(n) for n in op_inputs),
        attrs=tuple(
            ir.Attr(n, k, {"float": "float", "int": "int", "bool": "bool"}[k]) for n, k in op.attrs
        ),
        no_gradient=(
            *op.no_gradient,
            *(n for n in op_inputs if n in a.lookups - set(op.no_gradient)),
        ),
        index_inputs=tuple(n for n in op_inputs if n in a.lookups),
        outputs=tuple(outputs),
        output_ranks=tuple({e.output: len(e.groups) for e in a.equations}[o] for o in outputs),
        state=a.state,
        internal=internal,
        state_axes=state_axes,
        state_divisors=state_divisors if any(state_divisors) else (),
        length=length,
        depth=depth_const,
        depth_sizes=tuple(depth_sizes),
        body=body,
        init=init,
        max_temp_bytes=op.max_temp_bytes,
    )
    return Plan(scan, body_spec, init_spec)


def _with_sizing_read(a: _Analysis, eq: Equation, rhs: Node, step_text: str) -> str:
    """A step that reads nothing along some axis of its state (RNN-T's first cell,
    `alpha[b] = log(1)`) is a constant: it reads the last state times zero, which sizes
    the axis (the state before the start is zero)."""
    rest = _rest(eq, a.index)
    read = {i for acc in _accesses(rhs) for p in acc.positions for i in index_names(p)}
    if all(i in read for i in rest):
        return step_text
    a.lags.add(1)
    return f"{step_text} + 0 * {a.lag_name(1)}[{', '.join(rest)}]"


def step_sizes(op: OpSpec, cuts, index: str, step_inputs) -> tuple[tuple, tuple]:
    """The op's lets and ranges as its step sees them. The step reads an input the scan
    cuts without the cut axis, so `X.shape[n]` past the cut is the step's `X.shape[n - 1]`
    (Mamba's group size `u.shape[1] // B.shape[1]`, B cut along its last axis). The cut
    axis itself is the scan's length, which no step sees: an error, as is the shape of a
    cut input the step reads in another form (a window of recent positions)."""

    def renumbered(name: str, text_: str) -> str:
        try:
            tree = ast.parse(text_.strip(), mode="eval")
        except SyntaxError:
            return text_  # the step op's own parse reports it, with its place
        changed = False
        for node in ast.walk(tree):
            found = shape_read(node)
            if found is None:
                continue
            tensor, axis = found
            cut = cuts.get(tensor)
            if cut is None:
                continue
            if axis == cut or tensor not in step_inputs:
                raise SymgradError(
                    f"{name!r} reads {tensor}.shape[{axis}], "
                    + (
                        f"the length of the scan along {index!r}, which a step does not "
                        "see; read another input's shape"
                        if axis == cut
                        else f"and the scan reads {tensor!r} as a window of recent "
                        "positions; read another input's shape"
                    ),
                    where=op.source,
                )
            if axis > cut:
                node.slice = ast.Constant(axis - 1)
                changed = True
        return ast.unparse(tree) if changed else text_

    return (
        tuple((n, renumbered(n, t)) for n, t in op.lets),
        tuple((n, renumbered(n, t)) for n, t in op.ranges),
    )


def _without_vanished_attrs(spec: OpSpec) -> OpSpec:
    """`spec` without the attrs its formulas name but no longer use once a condition is
    decided (soft-DTW's first cell `D - gamma * log(1)` is `D`)."""
    if not spec.attrs or is_recurrence(spec):
        return spec
    from .pipeline import compile_op

    try:
        compile_op(spec)
    except SymgradError as exc:
        for name, _ in spec.attrs:
            if f"attr {name!r} is declared but no formula uses it" in str(exc):
                # the formula does not depend on it: any value (1) reads the same
                import re

                attrs = tuple(a for a in spec.attrs if a[0] != name)
                formulas = tuple(re.sub(rf"\b{name}\b", "1", f) for f in spec.formulas)
                return _without_vanished_attrs(replace(spec, attrs=attrs, formulas=formulas))
    return spec


@dataclass(frozen=True)
class _Raw:
    """A condition already written as formula text (`text` prints it as it is)."""

    source: str
    col: int = 0


def _conditions_on(node, index: str) -> list[Compare]:
    """The comparisons between index expressions that involve `index`."""
    if isinstance(node, Compare):
        return [node] if node.on_indices and index in index_names(node) else []
    if isinstance(node, Logic):
        return [c for arg in node.args for c in _conditions_on(arg, index)]
    if isinstance(node, Where):
        return [
            *_conditions_on(node.cond, index),
            *_conditions_on(node.then, index),
            *_conditions_on(node.otherwise, index),
        ]
    if isinstance(node, Neg):
        return _conditions_on(node.operand, index)
    if isinstance(node, BinOp):
        return _conditions_on(node.left, index) + _conditions_on(node.right, index)
    if isinstance(node, Call):
        return [c for arg in node.args for c in _conditions_on(arg, index)]
    if isinstance(node, Reduce):
        return _conditions_on(node.body, index)
    return []


_RELATIONS = {"<": sp.Lt, "<=": sp.Le, ">": sp.Gt, ">=": sp.Ge, "==": sp.Eq, "!=": sp.Ne}


def _decide(node, a: _Analysis, *, first: bool):
    """`node` at the first position of the scan index (`first`) or at every later one:
    each condition on the index decided there (True/False) or, at the first position,
    left on the other indices. SymgradError where a later position does not decide it."""
    t = a.index

    def condition(c):
        if isinstance(c, Compare) and c.on_indices and t in index_names(c):
            symbols = {}

            def fail(message, col):
                return a.fail(message, col)

            values = [_symbolic(o, fail) for o in c.operands]
            # an index's value is never negative; an int attr's or a let's may be
            # (`t + n > 0` with n = -2 holds from t = 3 on, not at every t >= 1)
            signed = {n for n, _ in a.op.attrs} | {n for n, _ in a.op.lets}
            for v in values:
                for s in v.free_symbols:
                    if s.name in signed:
                        symbols[s] = sp.Symbol(s.name, integer=True)
                    else:
                        symbols[s] = sp.Symbol(s.name, integer=True, nonnegative=True)
            step = sp.Symbol("_later", integer=True, nonnegative=True)
            position = sp.Integer(0) if first else step + 1
            symbols[sp.Symbol(t, integer=True)] = position
            values = [v.xreplace(symbols) for v in values]
            results = [
                _RELATIONS[op](left, right)
                for op, left, right in zip(c.ops, values, values[1:], strict=False)
            ]
            if all(r is sp.true for r in results):
                return True
            if any(r is sp.false for r in results):
                return False
            if first:
                kept = [_relation_text(r) for r in results if r is not sp.true]
                return _Raw(" and ".join(kept), c.col)
            raise a.fail(
                f"this condition on the scan index {t!r} does not hold the same at every "
                f"position after the first; a recurrence's conditions on {t} pick out "
                f"{t} == 0 only",
                c.col,
            )
        if isinstance(c, Logic):
            parts = [condition(arg) for arg in c.args]
            if c.op == "not":
                return (
                    (not parts[0])
                    if isinstance(parts[0], bool)
                    else Logic("not", tuple(parts), c.col)
                )
            decided = [p for p in parts if isinstance(p, bool)]
            rest = tuple(p for p in parts if not isinstance(p, bool))
            if c.op == "and" and False in decided or c.op == "or" and True in decided:
                return c.op == "or"
            if not rest:
                return c.op == "and"
            return rest[0] if len(rest) == 1 else Logic(c.op, rest, c.col)
        return c

    def walk(n):
        if isinstance(n, Where):
            cond = condition(n.cond)
            if cond is True:
                return walk(n.then)
            if cond is False:
                return walk(n.otherwise)
            return Where(cond, walk(n.then), walk(n.otherwise), n.col)
        if isinstance(n, Neg):
            return Neg(walk(n.operand), n.col)
        if isinstance(n, BinOp):
            return BinOp(n.op, walk(n.left), walk(n.right), n.col)
        if isinstance(n, Call):
            return Call(n.function, tuple(walk(arg) for arg in n.args), n.col)
        if isinstance(n, Reduce):
            return Reduce(n.kind, walk(n.body), n.indices, n.col)
        return n

    return walk(node)


def _relation_text(relation) -> str:
    """A SymPy comparison of index expressions as formula text (`j == 0`)."""
    ops = {sp.Eq: "==", sp.Ne: "!=", sp.Lt: "<", sp.Le: "<=", sp.Gt: ">", sp.Ge: ">="}
    op = next(o for kind, o in ops.items() if isinstance(relation, kind))
    return f"({_index_text(relation.lhs)} {op} {_index_text(relation.rhs)})"


def _rest(eq: Equation, index: str) -> list[str]:
    return [i for i in eq.output_indices if i != index]


def _size_names(op: OpSpec) -> set[str]:
    """The names the op's lets and ranges read (an int attr that sizes an index only)."""
    return _used_names([t for _, t in (*op.lets, *op.ranges)])


def _used_names(formulas: list[str]) -> set[str]:
    import re

    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", " ".join(formulas)))


def _op_inputs(op: OpSpec, a: _Analysis) -> tuple[str, ...]:
    if op.inputs is not None:
        return op.inputs
    seen: dict[str, None] = {}
    for e in a.equations:
        for acc in _accesses(e.rhs):
            if acc.tensor not in a.defined:
                seen[acc.tensor] = None
    return tuple(seen)


def _window_depth(a: _Analysis, eq: Equation) -> tuple[int, list[tuple[int, str, int]]]:
    """The window's depth: the largest lag a summed index can reach, as a constant plus
    coefficient * (size - 1) per summed index."""
    const, sizes = 0, {}
    for access in a.self_reads(eq):
        lag = a.lag_of(access)
        lag = -lag if a.reverse else lag
        if not lag.free_symbols:
            continue
        c = int(lag.subs({s: 0 for s in lag.free_symbols}))
        const = max(const, c)
        for s in lag.free_symbols:
            source = a.sized(s.name, access.col)
            coefficient = int(lag.coeff(s))
            sizes[source] = max(sizes.get(source, 0), coefficient)
    return const, [(c, n, ax) for (n, ax), c in sizes.items()]


__all__ = ["Plan", "is_recurrence", "plan", "replace"]

"""Split and composite reads of inputs: `x[b, (h, r), t]`, `w[c // G, k]`, `x[g, c % G]`,
and reads at an index whose range runs past the axis (`f[b, c, h, z]` with z over H+W-1).

Each is a position like any other computed position (`indexing.Gather`), so the gradient
is the transpose of the gather: a scatter-add at the positions read. A read through
`c // G` therefore sums the gradient over the G values of c that share a row; a read
through `c % G` over the rows c that share a remainder; a composite `(h, r)` reads the
axis row-major at `h*R + r` (R the size of r), exactly a reshape.

In the math the three are SymPy functions of integer-valued arguments, which stay
unevaluated for symbols: `FloorDiv(c, G)`, `Mod(c, G)`, `Composite(h, r)`. `Ranged(z)` is
the position z itself, marked so that the axis counts as computed (masked) rather than
plain: an explicit range of z wins over the axis' size, and a read past the axis is zero.

Sizes. A composite `(h, r)` on an axis of size S with one member of unknown size gets
S / (the others' sizes); `c // G` with c of unknown size gets c's size S·G. Division is
checked exact when the op is called. Other unknown sizes are errors naming the index.
"""

from __future__ import annotations

import ast

import sympy as sp

from . import indexing, ir


class FloorDiv(sp.Function):
    """`a // d` of an index expression a and a positive integer d (literal, attr, let)."""

    is_integer = True
    nargs = 2

    @classmethod
    def eval(cls, a, d):
        if a.is_Integer and d.is_Integer and d != 0:
            return sp.Integer(int(a) // int(d))
        return None

    def _symgrad_str(self, printer) -> str:
        return f"{_operand(printer, self.args[0])} // {_operand(printer, self.args[1])}"

    _sympystr = _symgrad_str

    def _latex(self, printer) -> str:
        a, d = (printer._print(x) for x in self.args)
        return rf"\left\lfloor {a} / {d} \right\rfloor"


class Mod(sp.Function):
    """`a % d` (Python's: in [0, d) for d > 0) of an index expression and a positive d."""

    is_integer = True
    nargs = 2

    @classmethod
    def eval(cls, a, d):
        if a.is_Integer and d.is_Integer and d != 0:
            return sp.Integer(int(a) % int(d))
        return None

    def _symgrad_str(self, printer) -> str:
        return f"{_operand(printer, self.args[0])} % {_operand(printer, self.args[1])}"

    _sympystr = _symgrad_str

    def _latex(self, printer) -> str:
        a, d = (printer._print(x) for x in self.args)
        return rf"\left({a} \bmod {d}\right)"


class Composite(sp.Function):
    """`(h, r)`: the row-major position `h*R + r` of plain indices, R the size of r."""

    is_integer = True

    def _symgrad_str(self, printer) -> str:
        return f"({', '.join(printer._print(a) for a in self.args)})"

    _sympystr = _symgrad_str

    def _latex(self, printer) -> str:
        return rf"\left({', '.join(printer._print(a) for a in self.args)}\right)"


class Ranged(sp.Function):
    """An index at a read whose axis its explicit range may run past: the index itself."""

    is_integer = True
    nargs = 1

    def _symgrad_str(self, printer) -> str:
        return printer._print(self.args[0])

    _sympystr = _symgrad_str
    _latex = _symgrad_str


SPLITS = (FloorDiv, Mod, Composite, Ranged)


def _operand(printer, e: sp.Expr) -> str:
    text = printer._print(e)
    return f"({text})" if isinstance(e, sp.Add) else text


def has_split(position: sp.Expr) -> bool:
    return any(position.atoms(f) for f in SPLITS)


def divisors(position: sp.Expr) -> set[str]:
    """The int attrs and lets a position divides by (checked > 0 at call time)."""
    found = set()
    for f in (*position.atoms(FloorDiv), *position.atoms(Mod)):
        found |= {
            s.name.removeprefix("_int_")
            for s in f.args[1].free_symbols
            if s.name.startswith("_int_")
        }
    return found


def position(builder, node, scope, lookups) -> sp.Expr:
    """`c // G` or `c % G` (a parsed `BinOp`) as SymPy; an int attr or let divisor is
    checked > 0 when the op is called."""
    left = builder.position(node.left, scope, lookups)
    divisor = builder.position(node.right, scope, lookups)
    builder.positive_attrs |= {
        s.name.removeprefix("_int_") for s in divisor.free_symbols if s.name.startswith("_int_")
    }
    return FloorDiv(left, divisor) if node.op == "//" else Mod(left, divisor)


def ranged(builder, symbol: sp.Symbol) -> bool:
    """Whether an index has an explicit `ranges` entry (which wins over an axis' size)."""
    return symbol.name.rstrip("'") in dict(builder.op.ranges)


def reads_past(builder, node) -> bool:
    """Whether a plain read of an input has an index with an explicit range: it is read
    like a computed position, zero past the axis."""
    if node.tensor in builder.internals:
        return False
    return any(p.name in dict(builder.op.ranges) for p in node.positions)


def past_axes(builder, positions: tuple) -> tuple:
    """Plain positions at indices with an explicit range, marked `Ranged`."""
    return tuple(Ranged(p) if indexing.is_plain(p) and ranged(builder, p) else p for p in positions)


# ----------------------------------------------------------------------------- sizes


def infer(reads, sized: dict, pending: list) -> dict:
    """Sizes of pending indices that split reads determine exactly: {index: extent}.

    `reads` are (position, input, axis); `sized` maps indices to their known sizes."""
    found: dict = {}
    progress = True
    while progress:
        progress = False
        for position, source, axis in reads:
            size = indexing.shape_symbol(source, axis)
            for index, extent in _determined(position, size, {**sized, **found}):
                if index in pending and index not in found:
                    found[index] = extent
                    progress = True
    return found


def _determined(position: sp.Expr, size: sp.Expr, sized: dict):
    if isinstance(position, Composite):
        members = position.args
        unknown = [m for m in members if m not in sized]
        if len(unknown) == 1 and indexing.is_plain(unknown[0]):
            others = sp.Mul(*(sized[m] for m in members if m is not unknown[0]))
            yield unknown[0], ExactDiv(size, others)
    if isinstance(position, FloorDiv):
        a, d = position.args
        if indexing.is_plain(a) and a not in sized:
            yield a, size * d


def unsized_hint(symbol: sp.Symbol, reads) -> str | None:
    """For an index no read sizes that is split by one: what would size it."""
    for position, source, axis in reads:
        if isinstance(position, Composite) and symbol in position.args:
            names = ", ".join(m.name for m in position.args)
            return (
                f"or size all but one of ({names}) elsewhere: axis {axis} of {source} is "
                f"their product, which gives the last"
            )
        if isinstance(position, FloorDiv | Mod) and symbol in position.free_symbols:
            return (
                f'e.g. ranges = {{ {symbol.name} = "..." }}, or read it plainly elsewhere: '
                f"{position} says only which row of {source} (axis {axis}) it reads"
            )
    return None


class ExactDiv(sp.Function):
    """`a / b` for sizes that must divide exactly (a composite axis): checked when the op
    is called, `a // b` in code."""

    is_integer = True
    nargs = 2

    def _sympystr(self, printer) -> str:
        return f"{_operand(printer, self.args[0])} / {_operand(printer, self.args[1])}"


def bounded(position: sp.Expr, size: sp.Expr, extents: dict, inferred: set) -> bool:
    """Whether every read of a split position on an axis of `size` is in bounds by
    construction: a composite or `c // G` whose unknown member was sized from this axis."""
    if isinstance(position, Composite):
        return any(
            m in inferred and isinstance(extents.get(m), ExactDiv) and extents[m].args[0] == size
            for m in position.args
        )
    if isinstance(position, FloorDiv):
        a, d = position.args
        return a in inferred and extents.get(a) == size * d
    return False


# ----------------------------------------------------------------------------- check


def check_sizes(program, indices: dict[str, int], ints: dict[str, int]) -> dict:
    """Sizes `symgrad check` gives axes read at split positions, from the sizes of the
    indices they split (name -> size) and int attrs (`_int_G` -> value): `(h, r)` the
    product, `c % G` G, `c // G` the rows c reads, and for a let G (not known before the
    sizes are) the smallest divisor > 1 of c's size, so that c's size over it is whole.
    The same for an index tensor read at a split position inside another read's position
    (mmcv's tin_shift, `x[b, t + shift[b, c // CG], c, hw]`)."""
    found: dict = {}
    for level in program.intermediates:
        gather = level.gather
        if gather is None:
            continue
        for axis in gather.computed:
            size = _check_size(gather.positions[axis], indices, ints)
            if size is not None:
                found.setdefault((gather.source, axis), size)
        for position in gather.positions:
            for read in sorted(position.atoms(sp.Indexed), key=str):
                for axis, inner in enumerate(read.indices):
                    size = _check_size(inner, indices, ints)
                    if size is not None:
                        found.setdefault((str(read.base), axis), size)
    return found


def _check_size(position: sp.Expr, indices: dict[str, int], ints: dict[str, int]) -> int | None:
    if isinstance(position, Composite):
        sizes = [indices.get(m.name) for m in position.args]
        return None if None in sizes else int(sp.Mul(*sizes))
    if not isinstance(position, FloorDiv | Mod) or not indexing.is_plain(position.args[0]):
        return None
    total = indices.get(position.args[0].name)
    divisor = position.args[1].xreplace({sp.Symbol(k, integer=True): v for k, v in ints.items()})
    if total is None:
        return None
    if divisor.is_Integer and divisor > 0:
        d = int(divisor)
        return d if isinstance(position, Mod) else -(-total // d)
    if isinstance(position, Mod):
        return None
    return next(d for d in range(2, total + 1) if total % d == 0) if total > 1 else 1


# ----------------------------------------------------------------------------- tiling


def reshapes(level) -> bool:
    """Whether a gather is a composite read with every other axis plain: it holds exactly
    its source's elements, reshaped (no larger than the input)."""
    gather = level.gather
    return all(isinstance(gather.positions[n], Composite) for n in gather.computed)


def is_split(position: ast.AST) -> bool:
    """Whether a read's position (a Python syntax tree) is `a // d`, `a % d` or `(h, r)`."""
    if isinstance(position, ast.Tuple):
        return True
    return isinstance(position, ast.BinOp) and isinstance(position.op, ast.FloorDiv | ast.Mod)


def in_group(name: str, reads) -> bool:
    """Whether an index is a member of a composite read (`x[b, (h, r)]`) in `reads`, the
    positions (Python syntax trees) of each input's reads."""
    return any(
        isinstance(p, ast.Tuple) and any(isinstance(e, ast.Name) and e.id == name for e in p.elts)
        for positions_list in reads.values()
        for positions in positions_list
        for p in positions
    )


# ----------------------------------------------------------------------------- lowering


def reshape_grid(level) -> bool:
    """Whether a gather is its source reshaped: every computed axis a composite of distinct
    plain indices, and the gathered axes in the source's order with each composite's
    members in place of its axis. A composite sized from its axis (bounded) reads the axis
    itself; another reads it cut or padded with zeros to the members' product (`fit`), which
    is the gather with its mask: `(h, r)` reads h*R + r, from 0 to H*R - 1 in order."""
    gather = level.gather
    if not gather.computed or not reshapes(level):
        return False
    expected = []
    for position in gather.positions:
        members = position.args if isinstance(position, Composite) else (position,)
        if not all(indexing.is_plain(m) for m in members):
            return False
        expected += members
    return len(set(expected)) == len(expected) and tuple(expected) == tuple(level.indices)


def _product(lowerer, body, position) -> ir.Expr:
    sizes = [ir.Var(lowerer.index_size(body, m)) for m in position.args]
    result = sizes[0]
    for size in sizes[1:]:
        result = ir.Binary("*", result, size)
    return result


def _unbounded(level):
    """The computed axes whose composite is not sized from the axis (maybe cut or padded)."""
    gather = level.gather
    return [axis for axis, ok in zip(gather.computed, gather.bounded, strict=True) if not ok]


def reshape_read(lowerer, body, level) -> ir.Expr:
    """`x[b, (h, r), t]` as `reshape(x, [B, H, R, T])`, each axis not sized by its
    composite first fit to the product of its members' sizes."""
    source: ir.Expr = ir.Var(body.tensors[level.gather.source])
    for axis in _unbounded(level):
        product = _product(lowerer, body, level.gather.positions[axis])
        source = ir.Var(body.bind(ir.Call("fit", (source, ir.Lit(str(axis)), product))))
    shape = ir.Shape(tuple((lowerer.index_size(body, i),) for i in level.indices))
    return ir.Call("reshape", (source, shape))


def reshape_back(lowerer, body, level, grad: ir.Expr) -> ir.Expr:
    """The transpose of `reshape_read`: the gradient reshaped to the source's shape (each
    fit axis at the members' product, then fit back to the axis' size)."""
    source = level.gather.source
    rank = lowerer.program.rank(source)
    unbounded = _unbounded(level)
    dims = []
    for n in range(rank):
        position = level.gather.positions[n]
        if n in unbounded:
            dims.append(tuple(lowerer.index_size(body, m) for m in position.args))
        else:
            dims.append((lowerer.axis_size(body, source, n),))
    result: ir.Expr = ir.Call("reshape", (grad, ir.Shape(tuple(dims))))
    for axis in unbounded:
        size = ir.Var(lowerer.axis_size(body, source, axis))
        result = ir.Call("fit", (ir.Var(body.bind(result)), ir.Lit(str(axis)), size))
    return result


def lower(lowerer, body, e: sp.Expr, target) -> ir.Expr:
    """A split position (its indices already `_iota[i]` values) as integer code."""
    if isinstance(e, Ranged):
        return lowerer.expr(body, e.args[0], target)
    if isinstance(e, FloorDiv | Mod):
        op = "//" if isinstance(e, FloorDiv) else "%"
        left = lowerer.expr(body, e.args[0], target)
        right = lowerer.expr(body, e.args[1], target)
        return ir.Binary(op, left, lowerer.position_int(right))
    assert isinstance(e, Composite)
    result = lowerer.expr(body, e.args[0], target)
    for member in e.args[1:]:
        index = member.indices[0] if isinstance(member, sp.Indexed) else member
        size = lowerer.position_int(ir.Var(lowerer.index_size(body, index)))
        result = ir.Binary("+", ir.Binary("*", result, size), lowerer.expr(body, member, target))
    return result


# ----------------------------------------------------------------------------- notation


def equation(position: sp.Expr, text: str) -> str:
    """An index equation of a gather's transpose (`c // G = p`), with its solution for a
    split read: `c // G = p, so c = G*p + g with 0 <= g < G`."""
    from .notation import show  # notation imports this module

    if isinstance(position, FloorDiv | Mod):
        a, d = (show(x) for x in position.args)
        shown = text.rsplit(" = ", 1)[1]
        if isinstance(position, FloorDiv):
            return f"{text}, so {a} = {d}*{shown} + g with 0 <= g < {d}"
        return f"{text}, so {a} = {d}*m + {shown} with m >= 0"
    if isinstance(position, Composite):
        names = [show(x) for x in position.args]
        shown = text.rsplit(" = ", 1)[1]
        if len(names) == 2:
            h, r = names
            return f"{text}, so {h} = {shown} // |{r}|, {r} = {shown} % |{r}|"
        row_major = names[0]
        for name in names[1:]:
            row_major = (
                f"({row_major})*|{name}| + {name}"
                if "+" in row_major
                else (f"{row_major}*|{name}| + {name}")
            )
        return f"{text}, so {row_major} = {shown}"
    return text

"""Stage 2: formula text -> typed AST.

Python's own tokenizer and parser (`ast.parse`) read the text; nothing is ever evaluated.
The walk below accepts a small whitelist of node shapes and turns them into the frozen
dataclasses of this module; everything else is refused with its column. Size limits are
checked before `ast.parse` sees the text, so hostile input fails fast.
"""

from __future__ import annotations

import ast
import difflib
import keyword
import math
import operator
import re
import warnings
from dataclasses import dataclass
from fractions import Fraction

from .errors import SymgradError

# The exact (Fraction) and the float folding of constant sub-formulas share these.
_ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul}

MAX_FORMULA_LENGTH = 2000
MAX_DEPTH = 40  # nesting of brackets and of the walked expression tree
MAX_OPERATIONS = 400  # operators and calls in one formula: a bound on its total size
MAX_FACTORS = 41  # of one product chain: each factor's gradient multiplies all the others
MAX_INTEGER = 10**9
MAX_EXPONENT = 64
MAX_INDICES = 52  # einsum has 52 letters

FUNCTIONS: dict[str, int] = {
    "exp": 1,
    "log": 1,
    "sin": 1,
    "cos": 1,
    "tan": 1,
    "tanh": 1,
    "sinh": 1,
    "cosh": 1,
    "sqrt": 1,
    "abs": 1,
    "sigmoid": 1,
    "softplus": 1,
    "erf": 1,
    "max": 2,
    "min": 2,
    "floor": 1,  # the largest integer <= x, as a value; its gradient is zero
    "silu": 1,  # activations, each its framework's own function (functions.py)
    "gelu": 1,
    "gelu_tanh": 1,
    "elu": 1,
    "relu": 1,
}
REDUCTIONS = ("sum", "mean")
EXTREMA = ("max", "min")  # `max(x, y)` is elementwise; `max(expr, k, ...)` reduces over k
CONSTANTS = ("pi", "e", "inf")  # inf only as a branch of where: `where(c, x, -inf)`
COMPARISONS = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
}

# Names the generated module uses itself, or that would read confusingly as tensors.
RESERVED = frozenset(
    {
        *FUNCTIONS,
        *REDUCTIONS,
        *CONSTANTS,
        "where",
        # the modules generated code calls, for every target
        "tf",
        "torch",
        "jax",
        "jnp",
        "lax",
        "op",
        "grad",
        "grads",
        "dtype",
        "forward",
        "vjp",
        "gradient",
        "OP_TYPE",
        "OP_NAME",
        "register",
        "wrap",
        "INPUTS",
        "OUTPUTS",
        "ATTRS",
        "None",
        "True",
        "False",
        "math",
        "np",
        "self",
        "cls",
        "print",
        "len",
        "float",
        "int",
        "bool",
        "range",
        "tuple",
        "list",
        "dict",
        "str",
        "type",
        "object",
        "super",
        "isinstance",
        "ValueError",
        "TypeError",
        "KeyError",
    }
)
IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
MAX_NUMBER_BITS = 1024  # numerator and denominator of any exact constant
MAX_TERMS = 64  # summed terms after multiplying out; derivation time grows fast beyond
MAX_DIGITS = 400  # digits of a decimal literal, and the size of its exponent
DECIMAL = re.compile(r"(\d*)\.?(\d*)(?:[eE]([+-]?\d+))?\Z")

# Characters no formula needs that Python's parser would not show us as nodes: a comment
# would vanish from the AST but stay in the text, which generated docstrings quote.
FORBIDDEN = {
    "#": "comments ('#') are not allowed in a formula",
    "\\": "backslashes are not allowed in a formula",
}


# ----------------------------------------------------------------------------- AST


@dataclass(frozen=True)
class Num:
    """A numeric literal, kept exact."""

    value: Fraction
    col: int


@dataclass(frozen=True)
class Constant:
    """`pi` or `e`."""

    name: str
    col: int


@dataclass(frozen=True)
class AttrRef:
    """A scalar op attribute used by name."""

    name: str
    col: int


@dataclass(frozen=True)
class IndexRef:
    """An index used as a number: inside brackets, in a comparison (`j <= i`), or as a
    value (`(t - 1 - i) * w[c]`: its integer value in the inputs' float dtype)."""

    name: str
    col: int


@dataclass(frozen=True)
class Access:
    """`X[i, j, ...]`: one element of an input tensor.

    Each position is an index expression: a plain `IndexRef` (the common case), or an
    integer-linear combination of indices with integer (literal or int attr) coefficients
    and offsets, possibly plus the value of an integer index tensor (`ids[b, t]`).
    """

    tensor: str
    positions: tuple[Node, ...]
    col: int

    @property
    def plain(self) -> bool:
        """Every axis is read at a plain index (`A[b, i, k]`, diagonals included)."""
        return all(isinstance(p, IndexRef) for p in self.positions)

    @property
    def indices(self) -> tuple[str, ...]:
        """Plain access: the index of each axis. Otherwise every index name it uses, in
        written order (those inside index tensors included), each once."""
        if self.plain:
            return tuple(p.name for p in self.positions)
        return tuple(dict.fromkeys(name for p in self.positions for name in index_names(p)))

    @property
    def lookups(self) -> tuple[Access, ...]:
        """The index tensors read inside the brackets."""
        return tuple(a for p in self.positions for a in _lookups(p))


@dataclass(frozen=True)
class Group:
    """`(h, r)` inside an input's brackets: one axis read row-major (`h*R + r`)."""

    indices: tuple[IndexRef, ...]
    col: int


@dataclass(frozen=True)
class Neg:
    operand: Node
    col: int


@dataclass(frozen=True)
class BinOp:
    """`left op right` with op one of + - * / **."""

    op: str
    left: Node
    right: Node
    col: int


@dataclass(frozen=True)
class Call:
    """An elementwise function applied to sub-formulas."""

    function: str
    args: tuple[Node, ...]
    col: int


@dataclass(frozen=True)
class Reduce:
    """`sum(body, k, ...)`, `mean(...)`, or `max(body, k, ...)` / `min(...)` over indices."""

    kind: str
    body: Node
    indices: tuple[str, ...]
    col: int


@dataclass(frozen=True)
class Compare:
    """`a < b <= c`: a chain of comparisons, between index expressions (integers) when
    `on_indices`, else between values."""

    ops: tuple[str, ...]
    operands: tuple[Node, ...]
    on_indices: bool
    col: int


@dataclass(frozen=True)
class Logic:
    """`and` / `or` of conditions, or `not` of one."""

    op: str
    args: tuple[Condition, ...]
    col: int


Condition = Compare | Logic


@dataclass(frozen=True)
class Where:
    """`where(cond, then, otherwise)`: the condition gets no gradient."""

    cond: Condition
    then: Node
    otherwise: Node
    col: int


@dataclass(frozen=True)
class Sampled:
    """A float position inside a value input's brackets (`(g[n,h,w,1] + 1) * (H - 1) / 2`):
    a value expression, read by linear interpolation along that axis (sampling.py)."""

    expr: Node
    col: int


Node = (
    Num
    | Constant
    | AttrRef
    | IndexRef
    | Group
    | Access
    | Neg
    | BinOp
    | Call
    | Reduce
    | Where
    | Sampled
)


@dataclass(frozen=True)
class Equation:
    """`out[groups] = rhs`; each output group is one index or a composite `(i, k)`."""

    output: str
    groups: tuple[tuple[str, ...], ...]
    rhs: Node
    text: str
    output_col: int
    index_cols: tuple[int, ...] = ()  # the column of each of `output_indices`

    @property
    def output_indices(self) -> tuple[str, ...]:
        """The plain indices of the output, composite groups flattened."""
        return tuple(index for group in self.groups for index in group)

    def index_col(self, index: str, occurrence: int = 0) -> int:
        """Where output index `index` is written (its `occurrence`-th time), for carets."""
        cols = [c for i, c in zip(self.output_indices, self.index_cols, strict=False) if i == index]
        return cols[occurrence] if occurrence < len(cols) else self.output_col


def index_names(node) -> list[str]:
    """Index names used in an index expression or condition, in written order."""
    if isinstance(node, IndexRef):
        return [node.name]
    if isinstance(node, Group):
        return [i.name for i in node.indices]
    if isinstance(node, Access):
        return [name for p in node.positions for name in index_names(p)]
    if isinstance(node, Neg):
        return index_names(node.operand)
    if isinstance(node, BinOp):
        return index_names(node.left) + index_names(node.right)
    if isinstance(node, Call):  # an index clamp
        return [name for arg in node.args for name in index_names(arg)]
    if isinstance(node, Compare):
        return [name for o in node.operands if node.on_indices for name in index_names(o)]
    if isinstance(node, Logic):
        return [name for a in node.args for name in index_names(a)]
    if isinstance(node, Sampled):
        return _value_index_names(node.expr)
    return []


def _value_index_names(node) -> list[str]:
    """Index names used anywhere in a value expression, in written order."""
    if isinstance(node, IndexRef):
        return [node.name]
    if isinstance(node, Access | Compare | Logic):
        return index_names(node)
    if isinstance(node, Neg):
        return _value_index_names(node.operand)
    if isinstance(node, BinOp):
        return _value_index_names(node.left) + _value_index_names(node.right)
    if isinstance(node, Call):
        return [name for a in node.args for name in _value_index_names(a)]
    return []


def _lookups(node) -> list[Access]:
    if isinstance(node, Access):
        return [node]
    if isinstance(node, Neg):
        return _lookups(node.operand)
    if isinstance(node, BinOp):
        return _lookups(node.left) + _lookups(node.right)
    if isinstance(node, Call):  # an index clamp
        return [a for arg in node.args for a in _lookups(arg)]
    return []


def _plain_indices(node) -> list[str]:
    """The indices an index expression uses outside index-tensor reads."""
    if isinstance(node, IndexRef):
        return [node.name]
    if isinstance(node, Neg):
        return _plain_indices(node.operand)
    if isinstance(node, BinOp):
        return _plain_indices(node.left) + _plain_indices(node.right)
    if isinstance(node, Call):
        return [name for arg in node.args for name in _plain_indices(arg)]
    return []


def names_outside_lookups(position) -> list[str]:
    """The index names a position uses outside the index tensors read in it
    (`lab[b,t]` of `x[b, lab[b,t]]` is read as an input of its own)."""
    return _plain_indices(position) if _lookups(position) else index_names(position)


# ----------------------------------------------------------------------------- checks


def check_name(name: str, what: str) -> str | None:
    """Why `name` cannot be used as a `what`, or None when it can."""
    if not IDENTIFIER.match(name):
        return (
            f"{what} name {name!r} must be a plain ASCII identifier "
            "(a letter, then letters, digits or '_')"
        )
    # grad_*: the gradients' names; tile_*: a chunk's position and length, and the chunk
    # count and length the tiled TF loops take (names TF accepts as graph node names)
    if keyword.iskeyword(name) or name in RESERVED or name.startswith(("grad_", "tile_")):
        return f"{what} name {name!r} is reserved"
    return None


def _check_text(text: str) -> None:
    if len(text) > MAX_FORMULA_LENGTH:
        raise SymgradError(
            f"formula is {len(text)} characters long; the limit is {MAX_FORMULA_LENGTH}"
        )
    for col, char in enumerate(text):
        if not (" " <= char <= "~"):
            described = repr(char) if char.isprintable() else f"U+{ord(char):04X}"
            raise SymgradError(
                f"character {described} is not allowed in a formula "
                "(formulas are one line of printable ASCII)",
                formula=_printable(text),
                column=col,
            )
    for col, char in enumerate(text):
        if char in FORBIDDEN:
            raise SymgradError(FORBIDDEN[char], formula=text, column=col)
    depth = 0
    for col, char in enumerate(text):
        if char in "([{":
            depth += 1
            if depth > MAX_DEPTH:
                raise SymgradError(
                    f"brackets nest deeper than {MAX_DEPTH} levels", formula=text, column=col
                )
        elif char in ")]}":
            depth -= 1


def _printable(text: str) -> str:
    return "".join(char if " " <= char <= "~" else "?" for char in text)


# ----------------------------------------------------------------------------- walk


class _Walker:
    def __init__(
        self,
        text: str,
        attrs: frozenset[str],
        int_attrs: frozenset[str],
        floats: frozenset[str] = frozenset(),
        bracketed: frozenset[str] = frozenset(),
    ) -> None:
        self.text = text
        self.floats = floats  # tensors whose values are float positions (`float_positions`)
        # Tensors the op reads inside another tensor's brackets (index tensors, unless
        # `floats` says otherwise): compared with integers alone, they stay integers.
        self.bracketed = bracketed - floats
        self.attrs = attrs
        self.int_attrs = int_attrs  # attrs that may scale or shift an index
        self.indices: set[str] = set()  # every index name used, for the einsum letter limit
        self.output_indices: frozenset[str] = frozenset()
        self.summing: list[str] = []  # indices bound by the enclosing sum()/mean() calls
        # Names that are indices somewhere in the equation (inside brackets, on the left,
        # or reduced over): outside brackets such a name is the index's value.
        self.known_indices: frozenset[str] = frozenset()

    def fail(self, message: str, node: ast.AST | None = None, col: int | None = None):
        column = col if col is not None else getattr(node, "col_offset", None)
        raise SymgradError(message, formula=self.text, column=column)

    def equation(self, tree: ast.Module) -> Equation:
        if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign):
            self.fail("a formula is one equation `out[i, ...] = expression`", col=0)
        assign = tree.body[0]
        if len(assign.targets) != 1:
            self.fail("a formula has exactly one `=`", assign.targets[1])
        target = assign.targets[0]
        if not isinstance(target, ast.Subscript) or not isinstance(target.value, ast.Name):
            self.fail("the left side must be an indexed output such as `y[b, i]`", target)
        output = target.value.id
        problem = check_name(output, "output")
        if problem:
            self.fail(problem, target)
        groups: list[tuple[str, ...]] = []
        cols: list[int] = []
        # `y[(b,i,j)]` has the syntax tree of `y[b,i,j]`; only the text shows that the whole
        # subscript is one composite axis.
        elements = [target.slice] if self.parenthesised(target.slice) else None
        for element in elements or _slice_elements(target.slice):
            if isinstance(element, ast.Tuple):
                if len(element.elts) < 2:
                    self.fail("a composite output index needs two or more indices", element)
                groups.append(tuple(self.index_name(e) for e in element.elts))
                cols.extend(e.col_offset for e in element.elts)
            else:
                if not isinstance(element, ast.Name):
                    self.fail(
                        "the left side takes plain indices (`y[b, i]`); index expressions "
                        "such as `2*i` belong inside an input's brackets on the right, and "
                        "a flattened axis is a composite index such as `y[b, (i, j)]` "
                        "(i*J + j)",
                        element,
                    )
                groups.append((self.index_name(element),))
                cols.append(element.col_offset)
        self.output_indices = frozenset(index for group in groups for index in group)
        self.known_indices = self.output_indices | _bracket_names(assign.value)
        rhs = self.expr(assign.value, 0)
        terms = _term_count(rhs)
        if terms > MAX_TERMS:
            self.fail(
                f"the formula multiplies out to {_shorten(str(terms))} summed terms (the limit "
                f"is {MAX_TERMS}): a product of sums expands; split it into several ops",
                assign.value,
            )
        return Equation(output, tuple(groups), rhs, self.text, target.col_offset, tuple(cols))

    def parenthesised(self, node: ast.AST) -> bool:
        """Whether a subscript tuple is wrapped in its own parentheses: `[(b,i)]`, not `[b,i]`
        or `[(b,i),j]`."""
        segment = ast.get_source_segment(self.text, node) or ""
        if not isinstance(node, ast.Tuple) or not segment.startswith("("):
            return False
        depth = 0
        for position, char in enumerate(segment):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                return position == len(segment) - 1
        return False  # pragma: no cover - the segment of a parsed tuple is balanced

    def index_name(self, node: ast.AST) -> str:
        if not isinstance(node, ast.Name):
            self.fail("an index must be a plain name such as `i`", node)
        # Inside brackets and after a sum's body a name can only be an index, so the
        # constants' names are free there (`y[b,i,e]` for an embedding axis).
        problem = None if node.id in CONSTANTS else check_name(node.id, "index")
        if problem:
            self.fail(problem, node)
        self.indices.add(node.id)
        if len(self.indices) > MAX_INDICES:
            self.fail(
                f"more than {MAX_INDICES} different indices in one formula (einsum has 52 letters)",
                node,
            )
        return node.id

    def expr(self, node: ast.AST, depth: int) -> Node:
        if depth > MAX_DEPTH:
            self.fail(f"the expression nests deeper than {MAX_DEPTH} levels", node)
        col = getattr(node, "col_offset", 0)
        if isinstance(node, ast.BinOp):
            ops = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}
            op = ops.get(type(node.op))
            if op is None:
                hint = "; powers are `**`" if isinstance(node.op, ast.BitXor) else ""
                if isinstance(node.op, ast.FloorDiv | ast.Mod):
                    symbol = "//" if isinstance(node.op, ast.FloorDiv) else "%"
                    hint = (
                        f" on values or float positions; an index is split by `{symbol}` with "
                        "a positive int literal, an int attr or a let"
                    )
                self.fail(
                    f"operator {_op_symbol(node.op)} is not supported{hint}",
                    col=_operator_col(self.text, node),
                )
            # `a + b + c` is a left-deep tree, but a chain, not nesting: the left operand of
            # an operator of the same precedence stays at this depth.
            if op in "*/" and _chain_length(node) > MAX_FACTORS:
                self.fail(
                    f"a product of {_chain_length(node)} factors; the limit is {MAX_FACTORS}",
                    node,
                )
            chained = isinstance(node.left, ast.BinOp) and _same_chain(node.op, node.left.op)
            left = self.expr(node.left, depth if chained else depth + 1)
            right = self.expr(node.right, depth + 1)
            if op == "/" and isinstance(right, Num) and right.value == 0:
                self.fail("division by zero", node.right)
            if op == "**":
                self.check_exponent(right, node.right)
                self.check_base(left, right, node.left)
            result = BinOp(op, left, right, col)
            try:
                _constant_value(result)  # constant sub-formulas must stay of sane size
            except SymgradError as exc:
                self.fail(exc.message, col=exc.column)
            self.check_real(result, node)
            return result
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.USub):
                return Neg(self.expr(node.operand, depth + 1), col)
            if isinstance(node.op, ast.UAdd):
                return self.expr(node.operand, depth + 1)
            self.fail(f"operator {_op_symbol(node.op)} is not supported", node)
        if isinstance(node, ast.Constant):
            return self.number(node)
        if isinstance(node, ast.Name):
            if node.id == "inf":
                self.fail(
                    "`inf` is only allowed as a whole branch of where, e.g. "
                    "`max(where(seg[n] == v, x[n, f], -inf), n)`",
                    node,
                )
            if node.id in CONSTANTS:
                return Constant(node.id, col)
            if node.id in self.attrs:
                return AttrRef(node.id, col)
            if node.id in FUNCTIONS or node.id in REDUCTIONS:
                self.fail(f"function {node.id!r} must be called", node)
            if node.id in self.known_indices:
                return IndexRef(node.id, col)  # an index's value, as a float
            self.fail(
                f"unknown name {node.id!r}: tensors need indices (`{node.id}[...]`) "
                "and scalars must be declared in `attrs`",
                node,
            )
        if isinstance(node, ast.Subscript):
            if not isinstance(node.value, ast.Name):
                self.fail("only a named tensor can be indexed", node)
            name = node.value.id
            problem = check_name(name, "tensor")
            if problem:
                self.fail(problem, node)
            # `x[(h, r)]` and `x[b, (h, r), t]`: composite axes, read row-major.
            whole = self.parenthesised(node.slice)
            elements = [node.slice] if whole else _slice_elements(node.slice)
            positions = tuple(self.position(e, depth + 1, value=True) for e in elements)
            return Access(name, positions, col)
        if isinstance(node, ast.Call):
            return self.call(node, depth)
        self.fail(f"{_describe(node)} is not allowed in a formula", node)

    # -- index expressions ----------------------------------------------------------

    def position(self, node: ast.AST, depth: int, *, value: bool = False) -> Node:
        """One position inside an input's brackets: a plain index, an index expression, or
        a float expression (a sampled read). `value`: the brackets are a value tensor's,
        where a tensor read added to an index expression is a sampled read too."""
        if isinstance(node, ast.Name):
            return IndexRef(self.index_name(node), node.col_offset)
        if isinstance(node, ast.Tuple):
            if len(node.elts) < 2:
                self.fail("a composite index needs two or more indices", node)
            members = tuple(IndexRef(self.index_name(e), e.col_offset) for e in node.elts)
            return Group(members, node.col_offset)
        if _is_float_position(node, self.floats, self.attrs - self.int_attrs) or (
            value and _is_offset_read(node, self.attrs)
        ):
            return Sampled(self.expr(node, depth), node.col_offset)
        return self.index_expr(node, depth, inside=True)

    def index_expr(self, node: ast.AST, depth: int, *, inside: bool) -> Node:
        """An integer-linear index expression: `s*i + d*k - p`, `idx[b, n] + k`."""
        if depth > MAX_DEPTH:
            self.fail(f"the expression nests deeper than {MAX_DEPTH} levels", node)
        col = getattr(node, "col_offset", 0)
        if isinstance(node, ast.Name):
            if node.id in self.attrs:
                if node.id not in self.int_attrs:
                    self.fail(
                        f"attr {node.id!r} is not an int attr; index expressions take integers",
                        node,
                    )
                return AttrRef(node.id, col)
            if node.id in FUNCTIONS or node.id in REDUCTIONS:
                self.fail(f"{node.id!r} cannot be used in an index expression", node)
            return IndexRef(self.index_name(node), col)
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, int):
                self.fail(
                    f"index expressions take integers, not {_describe(node)}",
                    node,
                )
            if abs(value) > MAX_INTEGER:
                self.fail(f"integer constant is larger than {MAX_INTEGER}", node)
            return Num(Fraction(value), col)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = self.index_expr(node.operand, depth + 1, inside=inside)
            return Neg(inner, col) if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv | ast.Mod):
            return self.split(node, depth, inside=inside)
        if isinstance(node, ast.BinOp):
            op = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}.get(type(node.op))
            if op is None:
                hint = " (only + - * // % with integer coefficients)"
                self.fail(
                    f"operator {_op_symbol(node.op)} is not allowed in an index expression{hint}",
                    node,
                )
            chained = (
                isinstance(node.left, ast.BinOp)
                and op in "+-"
                and (type(node.left.op) in (ast.Add, ast.Sub))
            )  # `a + b + c` is a flat chain, not nesting
            left = self.index_expr(node.left, depth if chained else depth + 1, inside=inside)
            right = self.index_expr(node.right, depth + 1, inside=inside)
            # A data-dependent stride (`D[h] * (j - w)`) is fine: the position is still
            # one integer per grid point; a product of two indices is not.
            if op == "*" and _plain_indices(left) and _plain_indices(right):
                self.fail(
                    "a product of indices is not an affine index expression; "
                    "coefficients must be integers or int attrs",
                    node,
                )
            return BinOp(op, left, right, col)
        if isinstance(node, ast.Subscript):
            if not isinstance(node.value, ast.Name):
                self.fail("only a named tensor can be indexed", node)
            name = node.value.id
            problem = check_name(name, "tensor")
            if problem:
                self.fail(problem, node)
            # An index tensor's own positions are index expressions too: at constants
            # (`idx[b, n, 0]`), shifted (`indptr[s + 1]`), nested (`tri[tid[p], v]`).
            elements = _slice_elements(node.slice)
            positions = tuple(self.position(e, depth + 1) for e in elements)
            return Access(name, positions, col)
        if isinstance(node, ast.Call):
            return self.index_clamp(node, depth, inside=inside)
        if isinstance(node, ast.Tuple):
            self.fail(
                "a composite index `(i, k)` is a whole axis, on the left or of an input", node
            )
        where = "inside brackets" if inside else "in an index comparison"
        self.fail(f"{_describe(node)} is not allowed {where}", node)

    def split(self, node: ast.BinOp, depth: int, *, inside: bool) -> Node:
        """`c // G`, `c % G`: by a positive int literal, an int attr or a let."""
        op = "//" if isinstance(node.op, ast.FloorDiv) else "%"
        left = self.index_expr(node.left, depth + 1, inside=inside)
        right = node.right
        if isinstance(right, ast.Constant) and type(right.value) is int and right.value > 0:
            divisor: Node = Num(Fraction(right.value), right.col_offset)
        elif isinstance(right, ast.Name) and right.id in self.int_attrs:
            divisor = AttrRef(right.id, right.col_offset)
        else:
            self.fail(
                f"an index is split by `{op}` with a positive int literal, an int attr or a "
                "let on its right",
                right,
            )
        return BinOp(op, left, divisor, node.col_offset)

    def index_clamp(self, node: ast.Call, depth: int, *, inside: bool) -> Node:
        """`min(a, b)` and `max(a, b)` of index expressions: NATTEN's window start
        `max(min(i - ns, L - K), 0)`."""
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in EXTREMA or len(node.args) != 2 or node.keywords:
            where = "inside brackets" if inside else "in an index comparison"
            self.fail(
                f"only min(a, b) and max(a, b) of index expressions are allowed {where}", node
            )
        args = tuple(self.index_expr(a, depth + 1, inside=inside) for a in node.args)
        return Call(name, args, node.col_offset)

    # -- conditions -------------------------------------------------------------------

    def condition(self, node: ast.AST, depth: int) -> Condition:
        """`where`'s first argument: comparisons combined with and / or / not."""
        if depth > MAX_DEPTH:
            self.fail(f"the expression nests deeper than {MAX_DEPTH} levels", node)
        col = getattr(node, "col_offset", 0)
        if isinstance(node, ast.BoolOp):
            op = "and" if isinstance(node.op, ast.And) else "or"
            return Logic(op, tuple(self.condition(v, depth + 1) for v in node.values), col)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return Logic("not", (self.condition(node.operand, depth + 1),), col)
        if isinstance(node, ast.Compare):
            ops = []
            for op in node.ops:
                symbol = COMPARISONS.get(type(op))
                if symbol is None:
                    self.fail(f"{type(op).__name__} is not a comparison a condition can use", node)
                ops.append(symbol)
            operands = [node.left, *node.comparators]
            # A comparison with a float expression (`h < -floor(-(y0[r] + bh[r]))`) is
            # between values: an index there is its value, as in arithmetic.
            floats = any(
                _is_float_position(o, self.floats, self.attrs - self.int_attrs) for o in operands
            )
            on_indices = not floats and (
                any(self.mentions_index(o) for o in operands) or self.integers_only(operands)
            )
            if on_indices:
                values = tuple(self.index_expr(o, depth + 1, inside=False) for o in operands)
            else:
                values = tuple(self.expr(o, depth + 1) for o in operands)
            return Compare(tuple(ops), values, on_indices, col)
        self.fail(
            "a condition is a comparison (< <= > >= == !=) or conditions combined with "
            "and / or / not",
            node,
        )

    def integers_only(self, operands: list[ast.AST]) -> bool:
        """Whether a comparison with no index in it compares integers: an index tensor
        the op reads inside brackets against int attrs, int literals and index tensors
        (`t[n] != ig`, an ignore_index loss's label that also picks `x[n, t[n]]`)."""

        def integer(node: ast.AST) -> bool:
            if isinstance(node, ast.Constant):
                return type(node.value) is int
            if isinstance(node, ast.Name):
                return node.id in self.int_attrs
            if isinstance(node, ast.Subscript):
                return isinstance(node.value, ast.Name) and node.value.id in self.bracketed
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
                return integer(node.operand)
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
                return integer(node.left) and integer(node.right)
            return False

        tensors = [n for o in operands for n in ast.walk(o) if isinstance(n, ast.Subscript)]
        return bool(tensors) and all(integer(o) for o in operands)

    def mentions_index(self, node: ast.AST) -> bool:
        """Whether a comparison operand uses an index as a number (outside brackets)."""
        if isinstance(node, ast.Name):
            return node.id not in self.attrs and node.id not in CONSTANTS
        if isinstance(node, ast.Subscript | ast.Call):
            return False
        return any(self.mentions_index(child) for child in ast.iter_child_nodes(node))

    def call(self, node: ast.Call, depth: int) -> Node:
        col = node.col_offset
        if not isinstance(node.func, ast.Name):
            self.fail(f"{_describe(node.func)} cannot be called; only named functions", node)
        name = node.func.id
        if node.keywords:
            self.fail(f"{name}() takes no keyword arguments", node.keywords[0].value)
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                self.fail("starred arguments are not allowed", arg)
        if name == "where":
            if len(node.args) != 3:
                self.fail("where(condition, then, otherwise) takes 3 arguments", node)
            cond = self.condition(node.args[0], depth + 1)
            then = _infinity(node.args[1]) or self.expr(node.args[1], depth + 1)
            otherwise = _infinity(node.args[2]) or self.expr(node.args[2], depth + 1)
            return Where(cond, then, otherwise, col)
        if name in REDUCTIONS or (name in EXTREMA and self.is_reduction(node)):
            if len(node.args) < 2:
                self.fail(f"{name}(expr, k, ...) needs an expression and at least one index", node)
            indices = tuple(self.index_name(a) for a in node.args[1:])
            if len(set(indices)) != len(indices):
                self.fail(f"{name}() names an index twice", node.args[1])
            for index, arg in zip(indices, node.args[1:], strict=True):
                if index in self.output_indices:
                    self.fail(f"{name}() over {index!r}, which is an output index", arg)
                if index in self.summing:
                    self.fail(
                        f"{name}() over {index!r}, which an enclosing sum already sums over", arg
                    )
            self.summing.extend(indices)
            try:
                body = self.expr(node.args[0], depth + 1)
            finally:
                del self.summing[len(self.summing) - len(indices) :]
            return Reduce(name, body, indices, col)
        arity = FUNCTIONS.get(name)
        if arity is None:
            known = sorted(FUNCTIONS) + list(REDUCTIONS) + ["where"]
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            self.fail(f"unknown function {name!r} (known: {', '.join(known)}){hint}", node)
        if len(node.args) != arity:
            self.fail(
                f"{name}() takes {arity} argument{'s' if arity > 1 else ''}, got {len(node.args)}",
                node,
            )
        result = Call(name, tuple(self.expr(a, depth + 1) for a in node.args), col)
        self.check_real(result, node)
        return result

    def is_reduction(self, node: ast.Call) -> bool:
        """`max(expr, k, ...)`: every argument after the first is a bare index name (not an
        attr or a constant); `max(x, y)` with a value `y` stays elementwise."""
        rest = node.args[1:]
        return bool(rest) and all(
            isinstance(a, ast.Name) and a.id not in self.attrs and a.id not in CONSTANTS
            for a in rest
        )

    def number(self, node: ast.Constant) -> Num:
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(f"{_describe(node)} is not allowed in a formula", node)
        if isinstance(value, int):
            if abs(value) > MAX_INTEGER:
                self.fail(f"integer constant is larger than {MAX_INTEGER}", node)
            return Num(Fraction(value), node.col_offset)
        if not math.isfinite(value) or abs(value) > MAX_INTEGER:
            self.fail(f"number {value!r} is out of range", node)
        # The literal as written, exactly: 0.1 means one tenth, not the nearest double.
        literal = (ast.get_source_segment(self.text, node) or repr(value)).replace("_", "")
        match = DECIMAL.fullmatch(literal)
        if match is None:  # pragma: no cover - Python float literals are decimal
            self.fail(f"number {literal!r} is not a decimal number", node)
        digits = match.group(1) + match.group(2)
        exponent = int(match.group(3) or 0)
        if len(digits) > MAX_DIGITS:
            self.fail(f"number {_shorten(literal)} has too many digits", node)
        if abs(exponent) > MAX_DIGITS:
            self.fail(f"number {_shorten(literal)} is out of range", node)
        exact = Fraction(literal)  # cheap now: at most ~2*MAX_DIGITS decimal digits
        if (exact != 0 and value == 0) or _too_big(exact):
            self.fail(f"number {_shorten(literal)} is out of range", node)
        return Num(exact, node.col_offset)

    def check_base(self, base: Node, exponent: Node, node: ast.AST) -> None:
        """A constant base must keep the power real and differentiable."""
        try:
            value = _constant_value(base)
            power = _constant_value(exponent)
        except SymgradError as exc:
            self.fail(exc.message, col=exc.column)
        if value is not None and power is not None and value < 0 and power.denominator != 1:
            self.fail(f"a negative number to the power {_show_number(power)} is not real", node)
        if _float_value(exponent) is None:  # both sides were checked by check_real
            approximate = _float_value(base)
            if approximate is not None and approximate <= 0:
                self.fail(
                    "the base of a power with a variable exponent must be positive, "
                    f"not {self.source(node)}",
                    node,
                )

    def check_real(self, value: Node, node: ast.AST) -> None:
        """A constant sub-formula must have a finite real value in float64."""
        try:
            _float_value(value)
        except ZeroDivisionError:
            self.fail("division by zero", node)
        except (ArithmeticError, ValueError):
            self.fail(f"{self.source(node)} is not a finite real number", node)

    def source(self, node: ast.AST) -> str:
        return _shorten(ast.get_source_segment(self.text, node) or "the constant")

    def check_exponent(self, exponent: Node, node: ast.AST) -> None:
        try:
            value = _constant_value(exponent)
        except SymgradError as exc:
            self.fail(exc.message, col=exc.column)
        if value is not None and abs(value) > MAX_EXPONENT:
            self.fail(f"exponent {value} is larger than {MAX_EXPONENT} in magnitude", node)


def _infinity(node: ast.AST) -> Node | None:
    """`inf` or `-inf` written as a whole branch of where, or None."""
    negated = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
    name = node.operand if negated else node
    if not (isinstance(name, ast.Name) and name.id == "inf"):
        return None
    constant = Constant("inf", name.col_offset)
    return Neg(constant, node.col_offset) if negated else constant


def _is_float_position(node: ast.AST, floats: frozenset[str], float_attrs) -> bool:
    """Whether a position is a float expression: it divides (`/`), holds a non-integer
    number or a float attr, reads a tensor of `float_positions`, or calls `floor`. Other
    positions are integer index expressions (tensors in them are integer index tensors)."""
    for n in ast.walk(node):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            return True
        if isinstance(n, ast.Constant) and isinstance(n.value, float):
            return True
        if isinstance(n, ast.Name) and (n.id in floats or n.id in float_attrs):
            return True
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) not in EXTREMA:
            return True  # floor(...), sqrt(...); max/min of indices are integer clamps
    return False


def _is_offset_read(node: ast.AST, attrs: frozenset[str]) -> bool:
    """Whether a position displaces an index expression by a tensor read at that same
    index (`s*i - p + u + off[b, 2*(u*KW + v), i, j]`, `h + flow[b, 1, h, w]`): inside a
    value tensor's brackets that is a sampled read (sampling.py).

    A spec has no dtypes, so a tensor inside a position is ambiguous: PointNet's
    `x[b, idx[b, n, k], c]` is an integer gather, deformable convolution's offsets are
    float. The rule is syntactic (dtypes are only known at the call): a displacement
    field is read at the indices of the position it moves (`off[.., i, j]` moves output
    (i, j)), while a window start or a shift (`X[b, idx[b, i] + k]`, TIN's
    `x[n, t + shift[n, g], c]`) and a bare read (`x[b, idx[b, n]]`) share no index
    with the rest and stay integer gathers -- their single gather, in-bounds planning
    and range hints stay as they were, and a float tensor there is refused at the call
    with a message naming `float_positions`, the explicit override. A sampled read is
    exact for an integer displacement too: cast to the values' dtype its fraction is 0,
    so it reads the element an integer gather would (the other neighbour gets weight 0),
    and an integer input gets no gradient."""
    terms = _sum_terms(node)
    reads = [t for t in terms if isinstance(t, ast.Subscript)]
    rest = [t for t in terms if not isinstance(t, ast.Subscript)]
    moved = {n.id for t in rest for n in ast.walk(t) if isinstance(n, ast.Name)} - attrs
    return any(moved & _slice_names(r) for r in reads)


def _slice_names(read: ast.Subscript) -> set[str]:
    """The names used as indices inside a read's brackets (not the tensors read there)."""
    inside = list(ast.walk(read.slice))
    named = {id(n.value) for n in inside if isinstance(n, ast.Subscript)}
    return {n.id for n in inside if isinstance(n, ast.Name) and id(n) not in named}


def _sum_terms(node: ast.AST) -> list[ast.AST]:
    """The terms of a chain of + and - (signs dropped)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
        return _sum_terms(node.left) + _sum_terms(node.right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        return _sum_terms(node.operand)
    return [node]


def _bracket_names(tree: ast.AST) -> frozenset[str]:
    """Names used as indices: inside any brackets, or as the indices of a reduction."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            inside = list(ast.walk(node.slice))
            named = {id(n.value) for n in inside if isinstance(n, ast.Subscript)}
            named |= {id(n.func) for n in inside if isinstance(n, ast.Call)}
            names |= {n.id for n in inside if isinstance(n, ast.Name) and id(n) not in named}
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
            *REDUCTIONS,
            *EXTREMA,
        ):
            names |= {a.id for a in node.args[1:] if isinstance(a, ast.Name)}
    return frozenset(names)


def _constant_value(node: Node) -> Fraction | None:
    """The exact value of a constant sub-formula (numbers only), or None.

    Folding is guarded so that `9**9**9**9` fails fast instead of hanging.
    """
    if isinstance(node, Num):
        return node.value
    if isinstance(node, Neg):
        inner = _constant_value(node.operand)
        return None if inner is None else -inner
    if not isinstance(node, BinOp):
        return None
    left, right = _constant_value(node.left), _constant_value(node.right)
    if left is None or right is None:
        return None
    if node.op in _ARITHMETIC:
        value = _ARITHMETIC[node.op](left, right)
    elif node.op == "/":
        if right == 0:
            raise SymgradError("division by zero", column=node.col)
        value = left / right
    else:
        if right.denominator != 1:
            return None  # a root: stays symbolic
        if abs(right) > MAX_EXPONENT:
            raise SymgradError(
                f"exponent {right} is larger than {MAX_EXPONENT} in magnitude", column=node.col
            )
        if left == 0 and right < 0:
            raise SymgradError("division by zero", column=node.col)
        value = left ** int(right)
    if _too_big(value):
        raise SymgradError("constant is too large", column=node.col)
    return value


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1 / (1 + math.exp(-x))
    return math.exp(x) / (1 + math.exp(x))


def _softplus(x: float) -> float:
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def _gelu(x: float) -> float:
    return x * (1 + math.erf(x / math.sqrt(2))) / 2


def _gelu_tanh(x: float) -> float:
    return x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))) / 2


FLOAT_FUNCTIONS = {
    "exp": math.exp,
    "log": math.log,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "tanh": math.tanh,
    "sinh": math.sinh,
    "cosh": math.cosh,
    "sqrt": math.sqrt,
    "abs": math.fabs,
    "sigmoid": _sigmoid,
    "softplus": _softplus,
    "erf": math.erf,
    "max": max,
    "min": min,
    "floor": math.floor,
    "silu": lambda x: x * _sigmoid(x),
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "elu": lambda x: x if x > 0 else math.expm1(x),
    "relu": lambda x: max(x, 0.0),
}


def _float_value(node: Node) -> float | None:
    """The float64 value of a constant sub-formula (numbers, pi, e, functions), or None.

    Raises ArithmeticError or ValueError when it has no finite real value (log(-1),
    exp(exp(10)), (-pi) ** 0.5): generated code would compute nan or inf there.
    """
    if isinstance(node, Num):
        value = float(node.value)
    elif isinstance(node, Constant):
        if node.name == "inf":
            return None  # only a branch of where: never folded
        value = math.pi if node.name == "pi" else math.e
    elif isinstance(node, Neg):
        inner = _float_value(node.operand)
        return None if inner is None else -inner
    elif isinstance(node, BinOp):
        left, right = _float_value(node.left), _float_value(node.right)
        if left is None or right is None:
            return None
        if node.op in _ARITHMETIC:
            value = _ARITHMETIC[node.op](left, right)
        elif node.op == "/":
            value = left / right
        else:
            value = math.pow(left, right)
    elif isinstance(node, Call) and node.function in FLOAT_FUNCTIONS:
        args = [_float_value(arg) for arg in node.args]
        if any(arg is None for arg in args):
            return None
        value = FLOAT_FUNCTIONS[node.function](*args)
    else:
        return None  # tensors, attrs and sums are not constants
    if not math.isfinite(value):
        raise OverflowError("not finite")
    return value


def _term_count(node: Node) -> int:
    """How many summed terms the formula becomes once products of sums are multiplied out.

    Mirrors the canonical form (see `model`): parts without an explicit sum() merge into one
    pointwise term; sums inside functions, powers and denominators become one intermediate.
    """
    if not _has_reduce(node):
        return 1
    if isinstance(node, Reduce):
        return _term_count(node.body) if node.kind in REDUCTIONS else 1
    if isinstance(node, Neg):
        return _term_count(node.operand)
    if isinstance(node, BinOp) and node.op in "+-":
        return _term_count(node.left) + _term_count(node.right)
    if isinstance(node, BinOp) and node.op == "*":
        return _term_count(node.left) * _term_count(node.right)
    if isinstance(node, BinOp) and node.op == "/":
        return _term_count(node.left)
    return 1


def _has_reduce(node: Node) -> bool:
    if isinstance(node, Reduce):
        return True
    if isinstance(node, Where):
        return _has_reduce(node.then) or _has_reduce(node.otherwise)
    if isinstance(node, Neg):
        return _has_reduce(node.operand)
    if isinstance(node, BinOp):
        return _has_reduce(node.left) or _has_reduce(node.right)
    if isinstance(node, Call):
        return any(_has_reduce(arg) for arg in node.args)
    return False


def _too_big(value: Fraction) -> bool:
    return max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_NUMBER_BITS


def _show_number(value: Fraction) -> str:
    return _shorten(str(value))


def _shorten(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


_CHAINS = {ast.Add: "+", ast.Sub: "+", ast.Mult: "*", ast.Div: "*"}


def _same_chain(op: ast.AST, left_op: ast.AST) -> bool:
    """`a - b + c` and `a / b * c` are chains; `a ** b ** c` nests (it groups to the right)."""
    chain = _CHAINS.get(type(op))
    return chain is not None and chain == _CHAINS.get(type(left_op))


def _chain_length(node: ast.BinOp) -> int:
    """How many operands the chain `a * b / c * ...` ending at `node` has."""
    length = 2
    while isinstance(node.left, ast.BinOp) and _same_chain(node.op, node.left.op):
        node, length = node.left, length + 1
    return length


def _check_size(tree: ast.Module) -> None:
    """A bound on total size, so that walking a long flat chain stays cheap and shallow."""
    operations = sum(isinstance(n, ast.BinOp | ast.UnaryOp | ast.Call) for n in ast.walk(tree))
    if operations > MAX_OPERATIONS:
        raise SymgradError(
            f"the formula has {operations} operations (operators and calls); "
            f"the limit is {MAX_OPERATIONS}"
        )


def _slice_elements(node: ast.AST) -> list[ast.AST]:
    return list(node.elts) if isinstance(node, ast.Tuple) else [node]


def _operator_col(text: str, node: ast.BinOp) -> int:
    """The column of a binary operator: the first character between its operands that is
    not a space or a bracket of a parenthesised operand."""
    for col in range(node.left.end_col_offset or 0, node.right.col_offset):
        if text[col] not in " ()":
            return col
    return node.col_offset  # pragma: no cover - an operator is always between its operands


def _op_symbol(op: ast.AST) -> str:
    symbols = {
        ast.Pow: "**",
        ast.Div: "/",
        ast.FloorDiv: "//",
        ast.Mod: "%",
        ast.MatMult: "@",
        ast.BitAnd: "&",
        ast.BitOr: "|",
        ast.BitXor: "^",
        ast.LShift: "<<",
        ast.RShift: ">>",
        ast.Not: "not",
        ast.Invert: "~",
    }
    return repr(symbols.get(type(op), type(op).__name__))


def _describe(node: ast.AST) -> str:
    names = {
        ast.Attribute: "attribute access",
        ast.Lambda: "a lambda",
        ast.ListComp: "a comprehension",
        ast.GeneratorExp: "a comprehension",
        ast.SetComp: "a comprehension",
        ast.DictComp: "a comprehension",
        ast.Compare: "a comparison",
        ast.BoolOp: "and/or",
        ast.IfExp: "a conditional expression",
        ast.List: "a list",
        ast.Tuple: "a tuple",
        ast.Dict: "a dict",
        ast.Set: "a set",
        ast.Starred: "a starred expression",
        ast.NamedExpr: "an assignment expression",
        ast.JoinedStr: "a string",
        ast.Await: "await",
        ast.Yield: "yield",
        ast.Slice: "a slice",
        ast.Call: "a function call",
        ast.Subscript: "indexing (other than `X.shape[n]` with n >= 0)",
    }
    if isinstance(node, ast.Constant):
        return f"the literal {node.value!r}"
    return names.get(type(node), type(node).__name__)


def _python_tree(text: str, mode: str, what: str) -> ast.AST:
    """Python's own parser on the text (nothing is evaluated); its errors as ours."""
    try:
        with warnings.catch_warnings():
            # "invalid decimal literal" (`1if`) and the like: errors, not stderr noise.
            warnings.simplefilter("error", SyntaxWarning)
            return ast.parse(text, mode=mode)
    except SyntaxError as exc:
        column = max((exc.offset or 1) - 1, 0)
        message = (exc.msg or "invalid syntax").split(" (")[0]
        raise SymgradError(f"syntax error: {message}", formula=text, column=column) from None
    except (RecursionError, MemoryError, ValueError):
        raise SymgradError(f"the {what} is too deeply nested to read") from None


def parse_equation(
    text: str,
    attrs: frozenset[str] = frozenset(),
    int_attrs: frozenset[str] = frozenset(),
    floats: frozenset[str] = frozenset(),
    bracketed: frozenset[str] = frozenset(),
) -> Equation:
    """Parse one `out[idx] = expr` formula; raise SymgradError with a column on failure.
    `bracketed`: the tensors the op reads inside brackets (`bracketed_tensors`)."""
    text = text.strip(" ")
    _check_text(text)
    if not text:
        raise SymgradError("formula is empty")
    tree = _python_tree(text, "exec", "formula")
    _check_size(tree)
    return _Walker(text, attrs, int_attrs, floats, bracketed).equation(tree)


def bracketed_tensors(
    texts,
    attrs: frozenset[str] = frozenset(),
    int_attrs: frozenset[str] = frozenset(),
    floats: frozenset[str] = frozenset(),
) -> frozenset[str]:
    """The tensors read at integer positions inside another read's brackets (`t` in
    `x[n, t[n]]`, not in a sampled read's `x[1.0 * t[n]]` or a displacement's
    `x[b, h + flow[b, h]]`) in any of an op's formulas; a formula that does not parse
    adds none (parse_equation reports it)."""
    found = set()
    for text in texts:
        try:
            tree = _python_tree(text.strip(" "), "exec", "formula")
        except SymgradError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Subscript):
                continue
            for element in _slice_elements(node.slice):
                if _is_float_position(element, floats, attrs - int_attrs) or _is_offset_read(
                    element, attrs
                ):
                    continue
                for inner in ast.walk(element):
                    if isinstance(inner, ast.Subscript) and isinstance(inner.value, ast.Name):
                        found.add(inner.value.id)
    return frozenset(found)


# ----------------------------------------------------------------------------- ranges


@dataclass(frozen=True)
class ShapeRef:
    """`X.shape[n]`: the size of axis n of input X, known when the op is called."""

    tensor: str
    axis: int
    col: int


MAX_RANGE_LENGTH = 200


def shape_read(node: ast.AST) -> tuple[str, int] | None:
    """(X, n) where `node` is `X.shape[n]` with n an int literal, the one read of a size
    that ranges and lets allow; else None."""
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "shape"
        and isinstance(node.value.value, ast.Name)
        and isinstance(node.slice, ast.Constant)
        and type(node.slice.value) is int
    ):
        return node.value.value.id, node.slice.value
    return None


def parse_range(text: str, int_attrs: frozenset[str]) -> Node:
    """An index range from the spec's `ranges` table: an integer expression over int
    literals, int attrs and input sizes `X.shape[n]`, with + - * // and parentheses.
    Read by a whitelisted walk like formulas; nothing is evaluated."""
    text = text.strip(" ")
    if len(text) > MAX_RANGE_LENGTH:
        raise SymgradError(f"range is longer than {MAX_RANGE_LENGTH} characters")
    _check_text(text)
    if not text:
        raise SymgradError("range is empty")
    tree = _python_tree(text, "eval", "range")

    def fail(message: str, node: ast.AST):
        raise SymgradError(message, formula=text, column=getattr(node, "col_offset", 0))

    def walk(node: ast.AST, depth: int) -> Node:
        if depth > MAX_DEPTH:
            fail(f"the range nests deeper than {MAX_DEPTH} levels", node)
        col = getattr(node, "col_offset", 0)
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, int):
                fail(f"a range takes integers, not {_describe(node)}", node)
            if abs(value) > MAX_INTEGER:
                fail(f"integer constant is larger than {MAX_INTEGER}", node)
            return Num(Fraction(value), col)
        if isinstance(node, ast.Name):
            if node.id not in int_attrs:
                fail(
                    f"unknown name {node.id!r}: a range uses int literals, int attrs and "
                    "input sizes `X.shape[n]` (X an input of the formula)",
                    node,
                )
            return AttrRef(node.id, col)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = walk(node.operand, depth + 1)
            return Neg(inner, col) if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp):
            ops = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//"}
            op = ops.get(type(node.op))
            if op is None:
                fail(f"operator {_op_symbol(node.op)} is not allowed in a range", node)
            return BinOp(op, walk(node.left, depth + 1), walk(node.right, depth + 1), col)
        found = shape_read(node)
        if found is not None:
            tensor, axis = found
            problem = check_name(tensor, "tensor")
            if problem:
                fail(problem, node)
            return ShapeRef(tensor, axis, col)
        fail(f"{_describe(node)} is not allowed in a range", node)

    return walk(tree.body, 0)

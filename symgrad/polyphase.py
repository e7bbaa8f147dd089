"""Polyphase sums: a filter read at a strided position of a summed index.

StyleGAN2's upfirdn2d upsamples x by zero-stuffing, pads, convolves with a small filter f
and keeps every dn-th output. As a formula (rosinality's `upfirdn2d_native`, one axis):

    y[b,c,i] = sum(x[b,c,n] * f[K - 1 + dn*i - up*n - p0], n)

Written so, the sum runs over all N positions of x for every output i, and the filter is
gathered over [i, n]: I·N multiply-adds per axis where only the about K/up values of n
with 0 <= K - 1 + dn*i - up*n - p0 < K add anything. This module rewrites such a sum before
the op is parsed, so that it runs over those positions only:

    with E = K - 1 + dn*i - p0 (the position without n) and a = up,
    n = E // a - k, k in [0, ceil(K/a)):  f's position is a*k + E % a,

    y[b,c,i] = sum(x[b,c,(E) // a - k] * f[a*k + (E) % a], k)

(a position `+a*n + E` takes n = k - E // a, the same filter position). Every n whose
filter position lies in [0, K) is one k (distinct k are distinct n), the k whose position
lands past K read 0 from f, and reads outside x read 0 as before: the rewrite is exact.
The new reads are a window of x (gathered over [i, k]) and a small gather of f: the work
of the real kernel.

The rule (sizes are unknown when a module is generated, so it is read off the formula):
in `sum(body, ..., n, ...)`, a summed index n (not an int attr or let) is rewritten when

- exactly one read in the body has n inside a computed position, on one axis, as
  `a*n + E` or `E - a*n` with a a positive int literal, int attr or let and E free of n (an
  integer expression of indices, int literals, int attrs and lets);
- every other read of n is a plain axis `x[.., n, ..]`, and n appears nowhere else (not as
  a value, not in a condition);
- every index in E has a range of its own (`ranges`): sized by this read, it would be
  sized by f after the rewrite;
- the tensor read at the computed position (the filter f) reads no plain index at all
  (each of its axes is a computed position, or an index an earlier rewrite made: `fd[kp,
  2*j - q]` once p is done), and the plain readers read an output index f does not (a
  batch or channel that the filter is shared across);
- the filter read is a factor of the body (a product, or the numerator of a quotient):
  the body is zero where f is read outside, the positions the rewrite adds.

The positions it drops are those where n leaves its own range [0, N). Where a plain read
of n is a factor and reads zero there, nothing more is needed: n without a range of its
own is sized by that read's axis, and an internal tensor's axis that its equation
computes along n has n's range (StyleGAN3's filtered_lrelu downsamples `Z[b,c,p,q]`
summed over p, which has a range since Z is internal). Otherwise the body is kept where
`0 <= substitute < N` (a `where` around it; N is n's range, or a let for the axis of a
plain input read): in `(x[b,c,n] + bias[c]) * f[..]` (filtered_lrelu adds its bias
before upsampling) the bias term is not zero where n leaves x, and summed over the whole
filter at the borders it was wrong. An index no formula reads after the rewrite loses
its range.

The last condition tells the filter from the data: in a convolution written with its
window on the data, `x[b, s*i + d*k, c] * w[k,c,o]` or without a batch `x[i + k, c] *
w[k,c,o]`, the strided read is of x, which reads the channel c plainly, so it is left
alone (rewriting it would sum over x's length, and size i from w). The
rewritten sum has ceil(K/a) terms instead of N: fewer whenever the filter is shorter than
a times the input, which is what a filter is.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace

from .errors import SymgradError
from .model import build
from .spec import OpSpec

_INT_OPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)


@dataclass(frozen=True)
class Rewrite:
    """One summed index replaced by its phase index."""

    index: str  # the summed index of the formula (n)
    fresh: str  # the index that replaces it (k)
    tensor: str  # the tensor read at the strided position (f)
    axis: int
    position: str  # f's position as written
    substitute: str  # n in terms of k
    new_position: str  # f's position after the rewrite
    range: str  # k's range
    # n's own range [0, size) kept as a condition on the substitute (None: the reads
    # outside the plain readers already zero the body there), and a let naming that size
    # when it is an input's axis
    size: str | None = None
    let: tuple[str, str] | None = None

    def note(self) -> str:
        kept = f", kept where 0 <= {self.substitute} < {self.size}" if self.size is not None else ""
        return (
            f"{self.index} = {self.substitute}, {self.fresh} in [0, {self.range}): the only "
            f"{self.index} that add anything have {self.position} in [0, "
            f"{self.tensor}.shape[{self.axis}]), one per {self.fresh}; {self.tensor} is then "
            f"read at {self.new_position}{kept}"
        )

    def condition(self) -> str:
        """The substitute within n's own range."""
        return f"0 <= {self.substitute} and {self.substitute} < {self.size}"


def rewrite(op: OpSpec) -> tuple[OpSpec, tuple[Rewrite, ...]]:
    """The op with its polyphase sums rewritten (see the module docstring), and what was
    rewritten; the op itself when nothing matches or a formula does not parse (the parser
    then reports it)."""
    int_names = {n for n, kind in op.attrs if kind == "int"} | {n for n, _ in op.lets}
    # float and bool attrs: a position holding one is a sampled read, never rewritten
    others = {n for n, kind in op.attrs if kind != "int"}
    ranged = dict(op.ranges)
    defined = {}  # internal tensor -> the index its equation computes along, per axis
    trees = []
    for text in op.formulas:
        try:
            tree = ast.parse(text.strip(" "), mode="exec")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return op, ()
        statement = tree.body[0] if len(tree.body) == 1 else None
        if not isinstance(statement, ast.Assign) or len(statement.targets) != 1:
            return op, ()
        target = statement.targets[0]
        if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
            defined[target.value.id] = [
                el.id if isinstance(el, ast.Name) else None for el in _elements(target)
            ]
        trees.append((text.strip(" "), statement))
    taken = {node.id for _, s in trees for node in ast.walk(s) if isinstance(node, ast.Name)}
    taken |= int_names | set(ranged) | {n for n, _ in op.attrs}
    formulas, ranges, lets, done = [], list(op.ranges), list(op.lets), []
    for text, statement in trees:
        right = text[statement.value.col_offset :]
        if "[(" in right.replace(" ", ""):  # a composite read: ast.unparse would lose it
            formulas.append(text)
            continue
        found = []
        for call in [n for n in ast.walk(statement.value) if _is_sum(n)]:
            kept = []
            for position, name in enumerate(call.args[1:], start=1):
                made = {r.fresh for r in (*done, *found)}
                done_here = _rewrite_index(
                    call,
                    position,
                    name.id,
                    statement,
                    (int_names, others, made),
                    ranged,
                    defined,
                    taken,
                )
                if done_here is not None:
                    taken.add(done_here.fresh)
                    found.append(done_here)
                    if done_here.let is not None:
                        taken.add(done_here.let[0])
                        lets.append(done_here.let)
                    if done_here.size is not None:
                        kept.append(done_here)
            if kept:  # the body where every substitute lies in its index's own range
                condition = ast.parse(" and ".join(r.condition() for r in kept), mode="eval")
                call.args[0] = ast.Call(
                    ast.Name("where", ast.Load()),
                    [condition.body, call.args[0], ast.Constant(0)],
                    [],
                )
        if not found:
            formulas.append(text)
            continue
        done += found
        ranges += [(r.fresh, r.range) for r in found]
        formulas.append(text[: statement.value.col_offset] + ast.unparse(statement.value))
    if not done:
        return op, ()
    # a summed index with a range of its own that no formula reads any more
    used = {x.id for f in formulas for x in ast.walk(ast.parse(f)) if isinstance(x, ast.Name)}
    gone = {r.index for r in done} - used
    ranges = [(name, size) for name, size in ranges if name not in gone]
    rewritten = replace(op, formulas=tuple(formulas), ranges=tuple(ranges), lets=tuple(lets))
    try:  # an op the parser refuses keeps its own formulas, for its own error
        build(rewritten)
    except SymgradError:
        return op, ()
    return rewritten, tuple(done)


def _is_sum(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "sum"
        and not node.keywords
        and len(node.args) >= 2
        and all(isinstance(a, ast.Name) for a in node.args[1:])
    )


def _rewrite_index(call, position, n, statement, names, ranged, defined, taken):
    """Rewrite summed index `n` of `call` in place and return what was done, or None.
    `names`: the int attrs and lets, the other attrs, and the indices earlier rewrites
    made (a filter read at one, `f[kn, 2*j - m]`, is still a filter)."""
    int_names, others, made = names
    if n in int_names:
        return None
    outside = [x for x in ast.walk(statement) if isinstance(x, ast.Name) and x.id == n]
    inside = [x for x in ast.walk(call.args[0]) if isinstance(x, ast.Name) and x.id == n]
    if len(outside) != len(inside) + 1:  # n read outside this sum's body (or summed twice)
        return None
    plain, strided = [], []
    for read in _reads(call.args[0]):
        for axis, element in enumerate(_elements(read)):
            uses = [x for x in ast.walk(element) if isinstance(x, ast.Name) and x.id == n]
            if not uses:
                continue
            if isinstance(element, ast.Name):
                plain.append((read, axis))
            else:
                strided.append((read, axis, element))
    in_reads = sum(
        1
        for read in _reads(call.args[0])
        for element in _elements(read)
        for x in ast.walk(element)
        if isinstance(x, ast.Name) and x.id == n
    )
    if len(strided) != 1 or not plain or in_reads != len(inside):
        return None
    read, axis, element = strided[0]
    factors = _factors(call.args[0])
    if not any(read is x for x in factors):
        return None  # f read where its position leaves f must zero the body
    f = read.value.id
    if f in defined or any(r.value.id == f for r, _ in plain):
        return None
    kept = _own_range(n, plain, factors, ranged, defined, taken)
    if kept is None:
        return None
    size, let = kept
    linear = _linear(element, n, int_names, others)
    if linear is None:
        return None
    sign, a, rest = linear
    if not _filter_is_shared(read, [r for r, _ in plain], statement, made):
        return None
    indices = {x.id for x in ast.walk(rest) if isinstance(x, ast.Name)} if rest else set()
    if indices - set(int_names) - set(others) - set(ranged):
        return None  # an index sized by this read: after the rewrite, f would size it
    fresh = _fresh(n, taken)
    e = ast.unparse(rest) if rest is not None else "0"
    if a == "1":
        substitute = f"{fresh} - ({e})" if sign > 0 else f"({e}) - {fresh}"
        new_position = fresh
        range_ = f"{f}.shape[{axis}]"
    else:
        substitute = f"{fresh} - ({e}) // {a}" if sign > 0 else f"({e}) // {a} - {fresh}"
        new_position = f"{a}*{fresh} + ({e}) % {a}"
        minus_one = f"{int(a) - 1}" if a.isdigit() else f"{a} - 1"
        range_ = f"({f}.shape[{axis}] + {minus_one}) // {a}"
    original = ast.unparse(element)
    _replace_element(read, axis, ast.parse(new_position, mode="eval").body)
    for other, _ in plain:
        for k, el in enumerate(_elements(other)):
            if isinstance(el, ast.Name) and el.id == n:
                _replace_element(other, k, ast.parse(substitute, mode="eval").body)
    call.args[position] = ast.Name(fresh, ast.Load())
    return Rewrite(n, fresh, f, axis, original, substitute, new_position, range_, size, let)


def _own_range(n, plain, factors, ranged, defined, taken):
    """(None, None) when the body is zero wherever n leaves its own range [0, N) (a plain
    read of n is a factor, and reads zero there: the axis that sizes an n without a range,
    or an internal tensor's axis its equation computes along n, whose size is n's range);
    else (N, the let naming it or None) for a condition that keeps [0, N): the bias in
    `(x[b,c,n] + bias[c]) * f[..]` is not zero past x, and summed over every filter tap
    it was wrong at the borders. None when N has no name to write (an unranged n read
    plainly by internal tensors only)."""
    for read, axis in plain:
        if not any(read is x for x in factors):
            continue
        name = read.value.id
        if n not in ranged or name in defined and defined[name][axis] == n:
            return None, None
    if n in ranged:
        size = ranged[n]
        if size.isidentifier():  # an int attr or a let
            return size, None
    else:
        inputs = [(r.value.id, axis) for r, axis in plain if r.value.id not in defined]
        if not inputs:
            return None
        size = f"{inputs[0][0]}.shape[{inputs[0][1]}]"
    let = _fresh_name(f"size_{n}", taken)
    return let, (let, size)


def _factors(node: ast.AST) -> list[ast.AST]:
    """The factors of a product (`a * b / c` gives a and b, a sign is dropped): the body
    is zero wherever one of them is."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _factors(node.left) + _factors(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _factors(node.left)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        return _factors(node.operand)
    return [node]


def _reads(node: ast.AST) -> list[ast.Subscript]:
    """The tensor reads in `node`, outermost only (an index tensor inside another read's
    brackets is part of that read's position)."""
    found = []

    def visit(x):
        if isinstance(x, ast.Subscript) and isinstance(x.value, ast.Name):
            found.append(x)
            return
        for child in ast.iter_child_nodes(x):
            visit(child)

    visit(node)
    return found


def _elements(read: ast.Subscript) -> list[ast.AST]:
    s = read.slice
    return list(s.elts) if isinstance(s, ast.Tuple) else [s]


def _replace_element(read: ast.Subscript, axis: int, node: ast.AST) -> None:
    if isinstance(read.slice, ast.Tuple):
        read.slice.elts[axis] = node
    else:
        read.slice = node


def _linear(node, n, int_names, others=frozenset()):
    """(sign, coefficient text, the rest or None) when `node` is `±a*n + E` with `a` a
    positive int literal or int name and E an integer expression free of n; else None."""
    terms = []

    def split(x, sign):
        if isinstance(x, ast.BinOp) and isinstance(x.op, ast.Add | ast.Sub):
            split(x.left, sign)
            split(x.right, sign if isinstance(x.op, ast.Add) else -sign)
        elif isinstance(x, ast.UnaryOp) and isinstance(x.op, ast.USub):
            split(x.operand, -sign)
        else:
            terms.append((sign, x))

    split(node, 1)
    with_n = [(s, t) for s, t in terms if _mentions(t, n)]
    if len(with_n) != 1:
        return None
    sign, term = with_n[0]
    coefficient = _coefficient(term, n, int_names)
    if coefficient is None:
        return None
    rest = [(s, t) for s, t in terms if t is not term]
    if not all(_is_int_expression(t, others) for _, t in rest):
        return None
    expression = None
    for s, t in rest:
        if expression is None:
            expression = t if s > 0 else ast.UnaryOp(ast.USub(), t)
        else:
            expression = ast.BinOp(expression, ast.Add() if s > 0 else ast.Sub(), t)
    return sign, coefficient, expression


def _coefficient(term, n, int_names):
    if isinstance(term, ast.Name) and term.id == n:
        return "1"
    if not (isinstance(term, ast.BinOp) and isinstance(term.op, ast.Mult)):
        return None
    left, right = term.left, term.right
    if isinstance(right, ast.Name) and right.id == n:
        left, right = right, left
    if not (isinstance(left, ast.Name) and left.id == n):
        return None
    if isinstance(right, ast.Constant) and type(right.value) is int and right.value > 0:
        return str(right.value)
    if isinstance(right, ast.Name) and right.id in int_names:
        return right.id
    return None


def _mentions(node, n) -> bool:
    return any(isinstance(x, ast.Name) and x.id == n for x in ast.walk(node))


def _is_int_expression(node, others=frozenset()) -> bool:
    """Indices, int literals and names combined with + - * // %: no reads, no calls, no
    floats, no names in `others` (the float and bool attrs; other names are checked by
    the parser once the formula is rewritten)."""
    for x in ast.walk(node):
        if isinstance(x, ast.Name) and x.id in others:
            return False
        if isinstance(x, ast.BinOp) and not isinstance(x.op, _INT_OPS):
            return False
        if isinstance(x, ast.UnaryOp) and not isinstance(x.op, ast.USub | ast.UAdd):
            return False
        if isinstance(x, ast.Constant) and type(x.value) is not int:
            return False
        if not isinstance(
            x,
            ast.BinOp
            | ast.UnaryOp
            | ast.Constant
            | ast.Name
            | ast.operator
            | ast.unaryop
            | ast.Load,
        ):
            return False
    return True


def _filter_is_shared(read, plain, statement, made) -> bool:
    """f reads no plain index (a filter: every axis a computed position, or an index an
    earlier rewrite made), and the plain readers read an output index f lacks."""

    def names(r):
        return {x.id for el in _elements(r) for x in ast.walk(el) if isinstance(x, ast.Name)}

    def plain_names(r):
        return {el.id for el in _elements(r) if isinstance(el, ast.Name)}

    target = statement.targets[0]
    outputs = (
        {x.id for x in ast.walk(target.slice) if isinstance(x, ast.Name)}
        if isinstance(target, ast.Subscript)
        else set()
    )
    if plain_names(read) - made:
        return False  # `x[i + k, c]`: data read along a window, not a filter
    f_names = names(read)
    return all((plain_names(r) & outputs) - f_names for r in plain)


def _fresh(n: str, taken: set[str]) -> str:
    return _fresh_name(f"k{n}", taken)


def _fresh_name(base: str, taken: set[str]) -> str:
    name, count = base, 1
    while name in taken:
        count += 1
        name = f"{base}{count}"
    return name


def doc_lines(op: OpSpec, rewrites: tuple[Rewrite, ...]) -> tuple[str, ...]:
    """What a module's docstring (and `explain`) says about the rewrites of `op` (the
    rewritten op): each substitution, then the formulas as lowered."""
    if not rewrites:
        return ()
    return (
        *(r.note() for r in rewrites),
        "so the formula lowered is",
        *(f"    {f}" for f in op.formulas),
    )


def explained(op: OpSpec, rewrites: tuple[Rewrite, ...], fmt: str = "text") -> str:
    """What `symgrad explain` prints before the gradients of a rewritten op (LaTeX: as
    comments); "" when nothing was rewritten."""
    lines = doc_lines(op, rewrites)
    if not lines:
        return ""
    title = "Polyphase (symgrad/polyphase.py): the sum runs over the filter's taps only:"
    if fmt == "latex":
        return "".join(f"% {line}\n" for line in (title, *lines)) + "\n"
    return "\n".join((title, *(f"    {line}" for line in lines))) + "\n\n"

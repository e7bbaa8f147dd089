"""An independent TF evaluator of formulas: the oracle of the numerical tests and of
`symgrad check` without a library (generated `forward` against the formula itself).

It reads the same typed AST as symgrad (the grammar is the contract) but shares nothing
else: no canonical form, no lifting, no derivation, no einsum lowering. Every
sub-expression is evaluated densely over all of its indices with broadcasting, and sums
are `tf.reduce_sum` over axes -- slow and memory-hungry, obviously right. TF autodiff over
it is the gradient reference.

Index expressions are evaluated the same way: a position such as `2*i + k - 1` or
`idx[b, n] + k` is an integer tensor over the grid of the indices it uses (`tf.range` per
index), the input is read there with `tf.gather_nd` after clipping, and reads outside the
input are masked to zero. Conditions are boolean tensors over their indices, `where` is
`tf.where` (select), and `max`/`min` over indices are `tf.reduce_max`/`tf.reduce_min`, so
TF's autodiff splits the gradient of ties equally. Indices that no input axis reads plainly
take their sizes from the caller (`sizes=`); nothing evaluates the spec's `ranges`.

It imports TensorFlow, so only `symgrad check` and the tests import it: generation never does.
"""

from __future__ import annotations

import itertools
import math

import tensorflow as tf

from symgrad.parse import (
    Access,
    AttrRef,
    BinOp,
    Call,
    Compare,
    Constant,
    Group,
    IndexRef,
    Logic,
    Neg,
    Num,
    Reduce,
    Sampled,
    Where,
    bracketed_tensors,
    parse_equation,
)

FUNCTIONS = {
    "exp": tf.exp,
    "log": tf.math.log,
    "sin": tf.sin,
    "cos": tf.cos,
    "tan": tf.tan,
    "tanh": tf.tanh,
    "sinh": tf.sinh,
    "cosh": tf.cosh,
    "sqrt": tf.sqrt,
    "abs": tf.abs,
    "sigmoid": tf.sigmoid,
    "softplus": tf.nn.softplus,
    "erf": tf.math.erf,
    "silu": tf.nn.silu,
    # tf.nn.gelu's constants go through float32 (1e-8 off in float64): its formulas
    "gelu": lambda x: 0.5 * x * tf.math.erfc(-0.7071067811865476 * x),
    "gelu_tanh": lambda x: 0.5 * x * (1 + tf.tanh(0.7978845608028654 * (x + 0.044715 * x**3))),
    "elu": tf.nn.elu,
    "relu": tf.nn.relu,
    "max": tf.maximum,
    "min": tf.minimum,
    "floor": tf.floor,  # TF's Floor has no gradient: zero
}


class Dense:
    """A value over named indices: `tensor`'s axes are `labels`."""

    def __init__(self, tensor, labels):
        self.tensor = tensor
        self.labels = tuple(labels)


def _to(value: Dense, labels) -> tf.Tensor:
    """Transpose and expand `value` so it broadcasts over `labels`."""
    present = [label for label in labels if label in value.labels]
    tensor = value.tensor
    if value.labels:
        perm = [value.labels.index(label) for label in present]
        tensor = tf.transpose(tensor, perm)
    shape = [tensor.shape[present.index(label)] if label in value.labels else 1 for label in labels]
    return tf.reshape(tensor, shape) if labels else tensor


def _broadcast(tensor: tf.Tensor, shape) -> tf.Tensor:
    """`tensor` broadcast to `shape` (static sizes). TF broadcasts (in BroadcastTo and
    every binary op) only up to rank 5 after merging neighbouring axes that broadcast
    alike, so [2,6,4,3,6,1] against [2,1,4,1,6,2] fails: past rank 5 one axis at a time
    (each step merges into at most three axes)."""
    if len(shape) <= 5 or not tensor.shape.is_fully_defined():
        return tf.broadcast_to(tensor, shape)
    for axis, size in enumerate(shape):
        if tensor.shape[axis] != size:
            tensor = tf.broadcast_to(
                tensor, [*tensor.shape[:axis], size, *tensor.shape[axis + 1 :]]
            )
    return tensor


def _sum_over(value: Dense, indices, sizes) -> Dense:
    tensor = value.tensor
    labels = list(value.labels)
    for index in indices:
        if index in labels:
            tensor = tf.reduce_sum(tensor, axis=labels.index(index))
            labels.remove(index)
        else:  # nothing depends on it: the sum is a product with its size
            tensor = tensor * sizes[index]
    return Dense(tensor, labels)


COMPARE = {
    "<": tf.less,
    "<=": tf.less_equal,
    ">": tf.greater,
    ">=": tf.greater_equal,
    "==": tf.equal,
    "!=": tf.not_equal,
}


class Evaluator:
    def __init__(self, inputs: dict, attrs: dict, dtype, sizes: dict | None = None):
        self.inputs = inputs
        self.attrs = attrs
        self.dtype = dtype
        # Sizes given by the caller win; the rest come from plain uses of input axes.
        self.sizes: dict[str, int] = dict(sizes or {})
        self.given = frozenset(self.sizes)
        # Names that separate sums bind with different sizes (`sum(A[b,k], k) *
        # sum(B[b,k], k)`): fine for plain reads and sums, which see the axes themselves,
        # but no grid can be built for them.
        self.ambiguous: set[str] = set()
        # Where the index tensors read by the condition being evaluated were inside them.
        self.lookups_valid: list[Dense] = []

    def learn_sizes(self, node) -> None:
        if isinstance(node, Access):
            shape = self.inputs[node.tensor].shape
            for axis, position in enumerate(node.positions):
                if isinstance(position, IndexRef):
                    size = self.sizes.setdefault(position.name, int(shape[axis]))
                    if size != int(shape[axis]) and position.name not in self.given:
                        self.ambiguous.add(position.name)
            for lookup in node.lookups:
                self.learn_sizes(lookup)
            for position in node.positions:
                if isinstance(position, Sampled):
                    self.learn_sizes(position.expr)
        for child in _children(node):
            self.learn_sizes(child)

    def size(self, index: str) -> int:
        assert index not in self.ambiguous, f"reference: index {index!r} has several sizes"
        if index not in self.sizes:
            raise KeyError(f"reference: index {index!r} needs a size (sizes={{...}})")
        return self.sizes[index]

    def scope(self, node, free: frozenset) -> Dense:
        """A scope (right side, or a sum's body): implicit sums per additive part."""
        total = None
        for sign, part in _additive_parts(node, 1):
            implicit = sorted(_loose(part, free))
            value = self.value(part, free | set(implicit))
            value = _sum_over(value, implicit, self.sizes)
            if sign < 0:
                value = Dense(-value.tensor, value.labels)
            total = value if total is None else self.combine(total, value, tf.add)
        return total

    def combine(self, left: Dense, right: Dense, op) -> Dense:
        labels = tuple(dict.fromkeys((*left.labels, *right.labels)))
        a, b = _to(left, labels), _to(right, labels)
        known = a.shape.is_fully_defined() and b.shape.is_fully_defined()
        if len(labels) > 5 and known and a.shape != b.shape:
            shape = tf.broadcast_static_shape(a.shape, b.shape).as_list()
            a, b = _broadcast(a, shape), _broadcast(b, shape)  # past rank 5: see there
        return Dense(op(a, b), labels)

    def grid(self, value: Dense, labels) -> tf.Tensor:
        """`value` broadcast to the full grid of `labels`."""
        return _broadcast(_to(value, labels), [self.size(i) for i in labels])

    # -- index expressions: int64 tensors over the indices they use -----------------

    def position(self, node) -> tuple[Dense, Dense | None]:
        """An index expression, and where the index tensors it reads were read inside
        them (None: everywhere). A read at a position whose lookup was outside its index
        tensor is zero; a `where` whose condition reads it takes `otherwise`."""
        if isinstance(node, IndexRef):
            return Dense(tf.range(self.size(node.name), dtype=tf.int64), (node.name,)), None
        if isinstance(node, Num):
            assert node.value.denominator == 1, node
            return Dense(tf.constant(int(node.value), tf.int64), ()), None
        if isinstance(node, AttrRef):
            value = self.attrs[node.name]
            assert isinstance(value, int) and not isinstance(value, bool), node.name
            return Dense(tf.constant(value, tf.int64), ()), None
        if isinstance(node, Neg):
            inner, valid = self.position(node.operand)
            return Dense(-inner.tensor, inner.labels), valid
        if isinstance(node, Group):  # (h, r): row-major, h * |r| + r
            total, valid = self.position(node.indices[0])
            for member in node.indices[1:]:
                size = Dense(tf.constant(self.size(member.name), tf.int64), ())
                part, ok = self.position(member)
                total = self.combine(self.combine(total, size, tf.multiply), part, tf.add)
                valid = self.both(valid, ok)
            return total, valid
        if isinstance(node, BinOp | Call):
            ops = {"+": tf.add, "-": tf.subtract, "*": tf.multiply}
            ops |= {"//": tf.math.floordiv, "%": tf.math.floormod}
            ops |= {"min": tf.minimum, "max": tf.maximum}  # index clamps
            op = ops[node.op if isinstance(node, BinOp) else node.function]
            left, right = node.args if isinstance(node, Call) else (node.left, node.right)
            (a, a_ok), (b, b_ok) = self.position(left), self.position(right)
            return self.combine(a, b, op), self.both(a_ok, b_ok)
        if isinstance(node, Access):  # an integer index tensor
            value, inside = self.gathered(node)
            assert value.tensor.dtype.is_integer, f"{node.tensor} is not an integer tensor"
            return Dense(tf.cast(value.tensor, tf.int64), value.labels), inside
        raise TypeError(node)

    def both(self, a: Dense | None, b: Dense | None) -> Dense | None:
        if a is None or b is None:
            return a if b is None else b
        return self.combine(a, b, tf.logical_and)

    def read(self, node: Access) -> Dense:
        """`X[positions]` over the grid of the indices the positions use; zero outside X."""
        values, inside = self.gathered(node)
        if inside is None:
            return values
        tensor = values.tensor
        if tensor.shape.rank > 8:  # tf.where runs only up to rank 8 (NATTEN's 3-D window)
            mask = tf.broadcast_to(inside.tensor, tf.shape(tensor))
            return Dense(tf.compat.v1.where(mask, tensor, tf.zeros_like(tensor)), values.labels)
        return Dense(tf.where(inside.tensor, tensor, tf.zeros_like(tensor)), values.labels)

    def gathered(self, node: Access) -> tuple[Dense, Dense | None]:
        """`X[positions]` read after clipping, and where the reads were inside X."""
        tensor = self.inputs[node.tensor]
        # A plain read whose index has a range past (or short of) the axis is read like
        # a computed one: zero beyond the axis.
        fits = all(
            i in self.ambiguous or self.sizes.get(i, int(d)) == int(d)
            for i, d in zip(node.indices, tensor.shape, strict=False)
        )
        if node.plain and len(set(node.indices)) == len(node.indices) and fits:
            return Dense(tensor, node.indices), None
        labels = tuple(dict.fromkeys(node.indices))
        if any(isinstance(p, Sampled) for p in node.positions):
            return self.interpolate(node, labels)
        coords = []
        inside = tf.ones([self.size(i) for i in labels], tf.bool)
        for axis, position in enumerate(node.positions):
            at, valid = self.position(position)
            where = self.grid(at, labels)
            dim = int(tensor.shape[axis])
            inside = inside & (where >= 0) & (where < dim)
            if valid is not None:
                inside = inside & self.grid(valid, labels)
            coords.append(tf.clip_by_value(where, 0, max(dim - 1, 0)))
        values = tf.gather_nd(tensor, tf.stack(coords, axis=-1))
        return Dense(values, labels), Dense(inside, labels)

    def interpolate(self, node: Access, labels) -> tuple[Dense, None]:
        """A read with float positions: the 2^k neighbours of each point, by the products
        of the fractions (1 - f or f per float axis); a neighbour outside X reads zero."""
        tensor = self.inputs[node.tensor]
        floors, fractions, axes = [], [], []
        looked_up = tf.ones([self.size(i) for i in labels], tf.bool)
        for position in node.positions:
            if isinstance(position, Sampled):
                at = self.grid(self.value(position.expr, frozenset(labels)), labels)
                below = tf.floor(at)
                floors.append(tf.cast(below, tf.int64))
                fractions.append(at - below)
                axes.append(True)
            else:
                at, valid = self.position(position)
                floors.append(self.grid(at, labels))
                if valid is not None:  # an index tensor read outside itself: zero
                    looked_up = looked_up & self.grid(valid, labels)
                fractions.append(None)
                axes.append(False)
        total = tf.zeros([self.size(i) for i in labels], tensor.dtype)
        for corner in itertools.product((0, 1), repeat=sum(axes)):
            steps = iter(corner)
            coords, weight = [], tf.ones_like(total)
            inside = looked_up
            for axis, (where, fraction) in enumerate(zip(floors, fractions, strict=True)):
                if fraction is not None:
                    step = next(steps)
                    where = where + step
                    weight = weight * (fraction if step else 1 - fraction)
                dim = int(tensor.shape[axis])
                inside = inside & (where >= 0) & (where < dim)
                coords.append(tf.clip_by_value(where, 0, max(dim - 1, 0)))
            values = tf.gather_nd(tensor, tf.stack(coords, axis=-1))
            total += weight * tf.where(inside, values, tf.zeros_like(values))
        return Dense(total, labels), None

    # -- conditions: bool tensors over their indices ------------------------------

    def condition(self, node, free: frozenset) -> Dense:
        if isinstance(node, Logic):
            parts = [self.condition(a, free) for a in node.args]
            if node.op == "not":
                return Dense(tf.logical_not(parts[0].tensor), parts[0].labels)
            op = tf.logical_and if node.op == "and" else tf.logical_or
            result = parts[0]
            for part in parts[1:]:
                result = self.combine(result, part, op)
            return result
        if isinstance(node, Compare):
            if node.on_indices:
                operands, valid = zip(*(self.position(o) for o in node.operands), strict=True)
                self.lookups_valid += [ok for ok in valid if ok is not None]
            else:
                operands = [self.value(o, free) for o in node.operands]
            result = None
            for op, left, right in zip(node.ops, operands, operands[1:], strict=False):
                link = self.combine(left, right, COMPARE[op])
                result = link if result is None else self.combine(result, link, tf.logical_and)
            return result
        raise TypeError(node)

    # -- values ---------------------------------------------------------------------

    def value(self, node, free: frozenset) -> Dense:
        if isinstance(node, Num):
            return Dense(tf.constant(float(node.value), self.dtype), ())
        if isinstance(node, Constant):
            values = {"pi": math.pi, "e": math.e, "inf": math.inf}
            return Dense(tf.constant(values[node.name], self.dtype), ())
        if isinstance(node, IndexRef):  # an index's value, in the float dtype
            return Dense(tf.cast(tf.range(self.size(node.name)), self.dtype), (node.name,))
        if isinstance(node, AttrRef):
            return Dense(tf.constant(float(self.attrs[node.name]), self.dtype), ())
        if isinstance(node, Access):
            return self.read(node)
        if isinstance(node, Neg):
            inner = self.value(node.operand, free)
            return Dense(-inner.tensor, inner.labels)
        if isinstance(node, BinOp):
            if node.op in "+-":
                return self.scope(node, free)
            ops = {"*": tf.multiply, "/": tf.divide, "**": tf.pow}
            return self.combine(
                self.value(node.left, free), self.value(node.right, free), ops[node.op]
            )
        if isinstance(node, Call):
            args = [self.value(a, free) for a in node.args]
            if len(args) == 1:
                return Dense(FUNCTIONS[node.function](args[0].tensor), args[0].labels)
            return self.combine(args[0], args[1], FUNCTIONS[node.function])
        if isinstance(node, Where):
            # A where whose condition reads an index tensor outside it takes `otherwise`.
            outer, self.lookups_valid = self.lookups_valid, []
            cond = self.condition(node.cond, free)
            for ok in self.lookups_valid:
                cond = self.combine(cond, ok, tf.logical_and)
            self.lookups_valid = outer
            then = self.value(node.then, free)
            otherwise = self.value(node.otherwise, free)
            labels = tuple(dict.fromkeys((*cond.labels, *then.labels, *otherwise.labels)))
            # All three on the full grid: past rank 8 (tf.where's limit) the select of
            # operands of one shape, which runs at any rank.
            select = tf.where if len(labels) <= 8 else tf.compat.v1.where
            return Dense(
                select(
                    self.grid(cond, labels), self.grid(then, labels), self.grid(otherwise, labels)
                ),
                labels,
            )
        if isinstance(node, Reduce):
            body = self.scope(node.body, free | set(node.indices))
            if node.kind in ("max", "min"):
                # An index the body does not depend on changes nothing in an extremum.
                axes = [body.labels.index(i) for i in node.indices if i in body.labels]
                reduce = tf.reduce_max if node.kind == "max" else tf.reduce_min
                labels = [label for label in body.labels if label not in node.indices]
                return Dense(reduce(body.tensor, axis=axes), labels) if axes else body
            summed = _sum_over(body, node.indices, self.sizes)
            if node.kind == "mean":
                count = math.prod(self.sizes[i] for i in node.indices)
                summed = Dense(summed.tensor / count, summed.labels)
            return summed
        raise TypeError(node)


def _children(node):
    if isinstance(node, Neg):
        return [node.operand]
    if isinstance(node, BinOp):
        return [node.left, node.right]
    if isinstance(node, Call):
        return list(node.args)
    if isinstance(node, Reduce):
        return [node.body]
    if isinstance(node, Where):
        return [node.cond, node.then, node.otherwise]
    if isinstance(node, Compare):
        return list(node.operands)
    if isinstance(node, Logic):
        return list(node.args)
    return []


def _additive_parts(node, sign):
    if isinstance(node, BinOp) and node.op in "+-":
        right = sign if node.op == "+" else -sign
        return _additive_parts(node.left, sign) + _additive_parts(node.right, right)
    if isinstance(node, Neg):
        return _additive_parts(node.operand, -sign)
    return [(sign, node)]


def _loose(node, free, bound=frozenset()) -> set:
    """Indices used in `node` that neither the scope nor an inner sum binds."""
    if isinstance(node, Access | IndexRef):
        names = node.indices if isinstance(node, Access) else (node.name,)
        return {i for i in names if i not in free and i not in bound}
    if isinstance(node, Reduce):
        return _loose(node.body, free, bound | set(node.indices))
    found = set()
    for child in _children(node):
        found |= _loose(child, free, bound)
    return found


def _int_attrs(attrs: dict) -> frozenset[str]:
    """The attrs whose value is a Python int (those that may appear in index
    expressions, by default)."""
    return frozenset(a for a, v in attrs.items() if isinstance(v, int) and not isinstance(v, bool))


def evaluate(
    formula: str,
    inputs: dict,
    attrs: dict | None = None,
    *,
    sizes: dict[str, int] | None = None,
    int_attrs: frozenset[str] | None = None,
    floats: frozenset[str] = frozenset(),
    bracketed: frozenset[str] | None = None,
):
    """The output of one equation, densely evaluated (composite axes row-major).

    `sizes` gives the size of each index that no input axis reads plainly (a window offset,
    an output position of a strided access, ...). `int_attrs` are the attrs that may appear
    in index expressions; by default those whose value is a Python int.
    """
    attrs = attrs or {}
    if int_attrs is None:
        int_attrs = _int_attrs(attrs)
    if bracketed is None:
        bracketed = bracketed_tensors([formula], frozenset(attrs), frozenset(int_attrs), floats)
    equation = parse_equation(formula, frozenset(attrs), frozenset(int_attrs), floats, bracketed)
    dtype = next(t.dtype for t in inputs.values() if t.dtype.is_floating)
    evaluator = Evaluator(inputs, attrs, dtype, sizes)
    evaluator.learn_sizes(equation.rhs)
    out = equation.output_indices
    value = evaluator.scope(equation.rhs, frozenset(out))
    tensor = evaluator.grid(value, out)
    shape = [math.prod(evaluator.size(i) for i in group) for group in equation.groups]
    return tf.reshape(tensor, shape)


def evaluate_op(
    formulas,
    inputs: dict,
    attrs: dict | None = None,
    *,
    outputs=None,
    sizes: dict[str, int] | None = None,
    int_attrs: frozenset[str] | None = None,
    floats: frozenset[str] = frozenset(),
) -> list:
    """The outputs of an op's equations, evaluated in order: each left-hand tensor is
    readable by the equations after it (internal tensors), and only those in `outputs`
    (all of them when None) are returned, in equation order."""
    named = dict(inputs)
    results = []
    computed: set[str] = set()  # as in model.build: inside brackets a float position
    computed_all = frozenset(f.split("[", 1)[0].strip() for f in formulas)
    bracketed = bracketed_tensors(
        formulas,
        frozenset(attrs or {}),
        int_attrs if int_attrs is not None else _int_attrs(attrs or {}),
        frozenset(floats) | computed_all,
    )
    for formula in formulas:
        value = evaluate(
            formula,
            named,
            attrs,
            sizes=sizes,
            int_attrs=int_attrs,
            floats=frozenset(floats) | computed,
            bracketed=bracketed,
        )
        name = formula.split("[", 1)[0].strip()
        named[name] = value
        computed.add(name)
        if outputs is None or name in outputs:
            results.append(value)
    return results

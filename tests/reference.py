"""An independent TF evaluator of formulas: the oracle for numerical tests.

It reads the same typed AST as symgrad (the grammar is the contract) but shares nothing
else: no canonical form, no lifting, no derivation, no einsum lowering. Every
sub-expression is evaluated densely over all of its indices with broadcasting, and sums
are `tf.reduce_sum` over axes -- slow and memory-hungry, obviously right. TF autodiff over
it is the gradient reference.
"""

from __future__ import annotations

import math

import tensorflow as tf

from symgrad.parse import Access, AttrRef, BinOp, Call, Constant, Neg, Num, Reduce, parse_equation

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
    "max": tf.maximum,
    "min": tf.minimum,
}


class Dense:
    """A value over named indices: `tensor`'s axes are `labels`."""

    def __init__(self, tensor, labels):
        self.tensor = tensor
        self.labels = tuple(labels)


def _to(value: Dense, labels, sizes) -> tf.Tensor:
    """Transpose and expand `value` so it broadcasts over `labels`."""
    present = [label for label in labels if label in value.labels]
    tensor = value.tensor
    if value.labels:
        perm = [value.labels.index(label) for label in present]
        tensor = tf.transpose(tensor, perm)
    shape = [sizes[label] if label in value.labels else 1 for label in labels]
    return tf.reshape(tensor, shape) if labels else tensor


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


class Evaluator:
    def __init__(self, inputs: dict, attrs: dict, dtype):
        self.inputs = inputs
        self.attrs = attrs
        self.dtype = dtype
        self.sizes: dict[str, int] = {}

    def learn_sizes(self, node) -> None:
        if isinstance(node, Access):
            shape = self.inputs[node.tensor].shape
            for axis, index in enumerate(node.indices):
                self.sizes.setdefault(index, int(shape[axis]))
        for child in _children(node):
            self.learn_sizes(child)

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
        return Dense(op(_to(left, labels, self.sizes), _to(right, labels, self.sizes)), labels)

    def value(self, node, free: frozenset) -> Dense:
        if isinstance(node, Num):
            return Dense(tf.constant(float(node.value), self.dtype), ())
        if isinstance(node, Constant):
            return Dense(tf.constant(math.pi if node.name == "pi" else math.e, self.dtype), ())
        if isinstance(node, AttrRef):
            return Dense(tf.constant(float(self.attrs[node.name]), self.dtype), ())
        if isinstance(node, Access):
            tensor = self.inputs[node.tensor]
            labels = node.indices
            if len(set(labels)) != len(labels):  # a diagonal: gather it element by element
                unique = tuple(dict.fromkeys(labels))
                grids = tf.meshgrid(*[tf.range(self.sizes[u]) for u in unique], indexing="ij")
                coords = tf.stack([grids[unique.index(label)] for label in labels], axis=-1)
                return Dense(tf.gather_nd(tensor, coords), unique)
            return Dense(tensor, labels)
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
        if isinstance(node, Reduce):
            body = self.scope(node.body, free | set(node.indices))
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
    if isinstance(node, Access):
        return {i for i in node.indices if i not in free and i not in bound}
    if isinstance(node, Reduce):
        return _loose(node.body, free, bound | set(node.indices))
    found = set()
    for child in _children(node):
        found |= _loose(child, free, bound)
    return found


def evaluate(formula: str, inputs: dict, attrs: dict | None = None):
    """The output of one equation, densely evaluated (composite axes row-major)."""
    attrs = attrs or {}
    equation = parse_equation(formula, frozenset(attrs))
    dtype = next(iter(inputs.values())).dtype
    evaluator = Evaluator(inputs, attrs, dtype)
    evaluator.learn_sizes(equation.rhs)
    out = equation.output_indices
    value = evaluator.scope(equation.rhs, frozenset(out))
    tensor = _to(value, out, evaluator.sizes)
    tensor = tf.broadcast_to(tensor, [evaluator.sizes[i] for i in out])
    shape = [math.prod(evaluator.sizes[i] for i in group) for group in equation.groups]
    return tf.reshape(tensor, shape)

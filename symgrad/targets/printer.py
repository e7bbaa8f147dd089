"""The part of printing that is plain Python: literals, names, arithmetic, lists.

A target's printer subclasses `Printer` and says how each neutral op (`ir.Call` by name,
`ir.Einsum`, `ir.View`, `ir.Cond`, sizes) is spelled in its framework. Parentheses are
only those Python's precedence needs.
"""

from __future__ import annotations

from .. import ir

# Precedence, low to high, as Python parses it.
PRECEDENCE = {
    ">=": 0,
    "<=": 0,
    ">": 0,
    "<": 0,
    "==": 0,
    "!=": 0,
    "+": 1,
    "-": 1,
    "*": 2,
    "/": 2,
    "//": 2,
    "%": 2,
    "neg": 3,
    "**": 4,
}
ATOM = 5


def precedence(e: ir.Expr) -> int:
    if isinstance(e, ir.Binary):
        if e.op == "*" and e.left == ir.Lit("-1"):
            return PRECEDENCE["neg"]
        return PRECEDENCE[e.op]
    if isinstance(e, ir.Negate):
        return PRECEDENCE["neg"]
    if isinstance(e, ir.Lit) and e.text.startswith("-"):
        return PRECEDENCE["neg"]
    return ATOM


class Printer:
    """Python source for IR expressions. `in_module` is True when printing a generated
    module (which has helpers such as `_dim`), False for a self-contained line (explain)."""

    # Whether the framework can run one branch of an `ir.Cond` (TF's `tf.cond`). A target
    # without gets its modules through `ir.without_conds` before printing, so its printer
    # never sees a `Cond`.
    branches = True
    # Whether a module tiled in chunks checks its values for `masked_values`' kept Conds
    # once for every chunk (`finite_once`), rather than each chunk again.
    checks_once = False
    # Whether a module tiled in chunks computes its chunk-invariant work once before its
    # chunk loop (`tile_hoist`): where the loop's body runs its ops one by one, each chunk
    # paying their dispatch, rather than as one compiled loop whose compiler moves
    # invariant code out of it itself.
    hoists = False
    # and the second tier of a tiling in two levels, while its inner level is one chunk
    # (`tile_hoist.WHOLE`): the TensorFlow templates only
    hoists_whole = False

    def __init__(self, in_module: bool = True) -> None:
        self.in_module = in_module

    def code(self, e: ir.Expr) -> str:
        if isinstance(e, ir.Lit):
            return e.text
        if isinstance(e, ir.Var):
            return e.name
        if isinstance(e, ir.List):
            return "[" + ", ".join(self.code(item) for item in e.items) + "]"
        if isinstance(e, ir.Shape):
            return "[" + ", ".join(" * ".join(dim) for dim in e.dims) + "]"
        if isinstance(e, ir.Negate):
            inner = self.code(e.operand)
            return f"-{inner}" if precedence(e.operand) > PRECEDENCE["neg"] else f"-({inner})"
        if isinstance(e, ir.Binary):
            return self.binary(e)
        if isinstance(e, ir.DType):
            return f"{e.tensor}.dtype"
        if isinstance(e, ir.AxisSize):
            return self.axis_size(e)
        if isinstance(e, ir.FloatSize):
            return self.float_size(e)
        if isinstance(e, ir.Einsum):
            return self.einsum(e)
        if isinstance(e, ir.Call):
            return self.call(e)
        if isinstance(e, ir.View):
            return self.view(e)
        if isinstance(e, ir.Cond):
            return self.cond(e)
        if isinstance(e, ir.Whole):
            return f"({self.code(e.whole)} if {e.name} is None else {self.code(e.part)})"
        raise TypeError(f"not an IR expression: {e!r}")

    def binary(self, e: ir.Binary) -> str:
        if e.op == "*" and e.left == ir.Lit("-1"):
            return self.code(ir.Negate(e.right))
        mine = PRECEDENCE[e.op]
        left, right = self.code(e.left), self.code(e.right)
        left_prec, right_prec = precedence(e.left), precedence(e.right)
        if e.op == "**":
            if left_prec <= mine:
                left = f"({left})"
            if right_prec < mine:
                right = f"({right})"
        else:
            if left_prec < mine:
                left = f"({left})"
            if right_prec <= mine:
                right = f"({right})"
        return f"{left} {e.op} {right}"

    def arguments(self, e: ir.Call) -> str:
        parts = [self.code(a) for a in e.args] + [f"{k}={self.code(v)}" for k, v in e.keywords]
        return ", ".join(parts)

    # -- what each framework spells its own way ---------------------------------------

    def axis_size(self, e: ir.AxisSize) -> str:
        raise NotImplementedError

    def float_size(self, e: ir.FloatSize) -> str:
        raise NotImplementedError

    def einsum(self, e: ir.Einsum) -> str:
        raise NotImplementedError

    def call(self, e: ir.Call) -> str:
        raise NotImplementedError

    def view(self, e: ir.View) -> str:
        raise NotImplementedError

    # The function that runs one branch of an `ir.Cond`, `f(predicate, lambda: then,
    # lambda: otherwise)`: TF's `tf.cond`; in a target without branches, the one for the
    # `kept` Conds that `ir.without_conds` leaves.
    cond_function = ""

    def cond(self, e: ir.Cond) -> str:
        if not self.cond_function:
            raise NotImplementedError
        parts = (self.code(x) for x in (e.predicate, e.then, e.otherwise))
        return "{}({}, lambda: {}, lambda: {})".format(self.cond_function, *parts)


def is_integer(e: ir.Expr) -> bool:
    """Whether `e` is size arithmetic (sizes, int attrs, integer literals, + - * //, max,
    min): a Python int at run time (in TensorFlow, a tensor only where a size is known
    just when the graph runs)."""
    if isinstance(e, ir.Lit):
        return e.text.removeprefix("-").isdigit()
    if isinstance(e, ir.AxisSize):
        return True
    if isinstance(e, ir.Var):  # the names lowering gives sizes and int attrs
        return e.name.startswith(("_n_", "_int_"))
    if isinstance(e, ir.Negate):
        return is_integer(e.operand)
    if isinstance(e, ir.Binary):
        return e.op in ("+", "-", "*", "//", "%") and is_integer(e.left) and is_integer(e.right)
    if isinstance(e, ir.Whole):
        return is_integer(e.whole) and is_integer(e.part)
    if isinstance(e, ir.Call):
        integral = ("maximum", "minimum", "to_int64", "size_limit", "same_size")
        integral = (*integral, "exact_div", "shift")
        return e.function in integral and all(is_integer(a) for a in e.args)
    return False

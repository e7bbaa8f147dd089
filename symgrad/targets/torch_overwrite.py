"""PyTorch: elementwise steps written over a temporary nothing else reads.

Eager PyTorch allocates a fresh tensor for every op, and on CPU a fresh tensor of a few
MiB is fresh pages from the system (glibc returns freed blocks that large): a chunk of a
pairwise op spent about half its time there. Where an elementwise op's operand is a
temporary that no later step reads (or a sub-expression's own result), the op is printed
as `_overwrite(a, "exp")` / `_overwrite(a, "sub", b)`: the module helper runs the
in-place op (`a.exp_()`) when autograd records nothing (`torch.is_grad_enabled()` is
false: the forward of the autograd.Function, a backward without create_graph) and the
result has a's shape and dtype, else the plain op. So gradients of gradients, and `vjp`
under autograd, compute exactly as before.

Which names may be overwritten at a step (`overwritable`): temporaries made by an op that
returns fresh memory (arithmetic, an elementwise call, a clamp, a contraction of two
operands: never a view, an alias or a reduction, which may return its operand), never
read by a step that keeps a view or an alias of them, not returned, and read once by this
step and by no step after it (in the order the body is printed).
"""

from __future__ import annotations

from .. import ir

# Binary operators with an in-place method; + and * also overwrite their right operand.
METHODS = {"+": "add", "-": "sub", "*": "mul", "/": "div"}
COMMUTATIVE = {"+", "*"}
# Elementwise calls with an in-place method (`torch.exp` -> `a.exp_()`), by neutral name.
UNARY = {
    "abs": "abs",
    "cos": "cos",
    "cosh": "cosh",
    "erf": "erf",
    "exp": "exp",
    "floor": "floor",
    "log": "log",
    "rsqrt": "rsqrt",
    "sigmoid": "sigmoid",
    "sign": "sign",
    "sin": "sin",
    "sinh": "sinh",
    "sqrt": "sqrt",
    "square": "square",
    "tan": "tan",
    "tanh": "tanh",
}


def fresh(e: ir.Expr, is_python) -> bool:
    """Whether `e`, printed, returns a tensor in memory of its own (not a view or an
    alias of another tensor, nor a Python number)."""
    if is_python(e):
        return False
    if isinstance(e, ir.Binary):
        return e.op in METHODS
    if isinstance(e, ir.Negate):
        return True
    if isinstance(e, ir.Einsum):
        return len(e.operands) >= 2
    if isinstance(e, ir.Call):
        return e.function in UNARY or e.function in ("maximum", "minimum")
    return False


def overwritable(steps: list[ir.Assign], reads: dict[str, list[str]], keep, is_python) -> list[set]:
    """Per step (in printed order), the names its op may overwrite. `reads[target]`: the
    names the step's text reads, with repeats; `keep`: names returned."""
    made_fresh = {s.target for s in steps if fresh(s.value, is_python)}
    aliased = {name for s in steps if _may_alias(s.value, is_python) for name in reads[s.target]}
    later: set[str] = set()
    found: list[set] = []
    for step in reversed(steps):
        names = reads[step.target]
        found.append(
            {
                n
                for n in names
                if n in made_fresh
                and n not in aliased
                and n not in keep
                and n not in later
                and names.count(n) == 1
            }
        )
        later |= set(names)
    found.reverse()
    return found


def _may_alias(e: ir.Expr, is_python) -> bool:
    """Whether a step's value may share memory with a name it reads: anything but a fresh
    op or a reduction over a non-empty list of axes (`torch.sum(x, dim=[])` is printed as
    `x` itself)."""
    if fresh(e, is_python):
        return False
    if isinstance(e, ir.Call) and e.function.startswith("reduce_"):
        axis = e.args[1] if len(e.args) > 1 else dict(e.keywords).get("axis")
        return axis == ir.Lit("[]") or (isinstance(axis, ir.List) and not axis.items)
    return True


def spell(e: ir.Expr, printer, owned: set[str]) -> str | None:
    """`e` as an `_overwrite(...)` call when one of its operands may be overwritten (a name
    in `owned`, or a fresh sub-expression); None to print it as usual."""

    def ours(operand: ir.Expr) -> bool:
        if isinstance(operand, ir.Var):
            return operand.name in owned
        return fresh(operand, printer.is_python)

    if isinstance(e, ir.Binary) and e.op == "*" and e.left == ir.Lit("-1"):
        e = ir.Negate(e.right)
    if isinstance(e, ir.Negate) and ours(e.operand):
        return f'_overwrite({printer.code(e.operand)}, "neg")'
    if isinstance(e, ir.Binary) and e.op in METHODS:
        method = METHODS[e.op]
        if ours(e.left):
            return f'_overwrite({printer.code(e.left)}, "{method}", {printer.code(e.right)})'
        if e.op in COMMUTATIVE and ours(e.right):
            return f'_overwrite({printer.code(e.right)}, "{method}", {printer.code(e.left)})'
        return None
    if isinstance(e, ir.Call) and e.function in UNARY and len(e.args) == 1 and ours(e.args[0]):
        return f'_overwrite({printer.code(e.args[0])}, "{UNARY[e.function]}")'
    if isinstance(e, ir.Call) and e.function in ("maximum", "minimum") and len(e.args) == 2:
        clamp = "clamp_min" if e.function == "maximum" else "clamp_max"
        x, y = e.args
        bound_y, bound_x = printer.scalar(y), printer.scalar(x)
        if bound_y is not None and ours(x) and not printer.is_python(x):
            return f'_overwrite({printer.code(x)}, "{clamp}", {bound_y})'
        if bound_x is not None and bound_y is None and ours(y):
            return f'_overwrite({printer.code(y)}, "{clamp}", {bound_x})'
    return None

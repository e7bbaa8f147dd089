"""Masked weights against values that may be inf or nan: exact at call time.

`sum(where(j <= i, exp(s[b,i,j]) * v[b,j,e], 0), j)` (over its denominator: causal
attention) is lowered as the contraction `einsum(P, v)` with `P = softmax(where(j <= i,
s, -inf))` (`masked_exp.masked_exp_times_reads`): stable at logits in the hundreds, and no
[b,i,j,e] product. A masked position then multiplies P = 0 by v[b,j,e]; where that value
is inf or nan, 0 * inf is nan at every query, where the formula's masked branch gives 0.
A padding mask (over the values' own indices) masks the values themselves; a causal
mask cannot without the [b,i,j,e] product.

So, after lowering, each such contraction becomes a branch (`ir.Cond`, `kept`: TF's
`tf.cond`, `torch.cond`, `jax.lax.cond`) on one reduction, whether every value is finite
(a TF module in chunks makes it once for all chunks, `finite_once`):

- all finite (the usual case): the contraction as before;
- else the exact sum without the [b,i,j,e] product: the contraction of the finite
  values (non-finite ones as 0), plus, per output, what the non-finite terms that the
  mask keeps give in IEEE arithmetic, from contractions of the mask against indicators
  of +inf, -inf and nan values (counts: any nan, or an inf at a weight that is exactly 0,
  gives nan; +inf and -inf together give nan; else the inf that is there). Masked terms
  give 0. This is design "indicators", chosen over a second lowering with the values
  masked (a [b,i,j,e] product, which would have to be tiled apart): the counts are
  contractions of the same shape as the op's own, so the chunks that bound the op
  bound them too.

Weights that vanish under a mask without a softmax (Mamba-2's decay `exp(where(s <= t,
segsum, -inf))` times its masked `B * C`, contracted with an unmasked `X`: no [b,s,h,p,t]
masked copy of X) have either sign: the exact branch counts an inf at a positive weight
as itself, at a negative one as its opposite, and at a kept weight of exactly 0 as nan
(`_exact_signed`). The kept positions come from the mask in the weights' own layout
(`_vanishing`, through the views and products that built them).

In the gradient, where the backward contracts the values into a tensor of the weights'
shape (`einsum(grad_y, v)`), and the gradient of the masked logits (a sum of products of
a factor that is 0 under the mask), are set to 0 under the mask (`where`, one
elementwise pass), as the formula's masked branch has no gradient; the unmasked
positions keep IEEE arithmetic. That runs only when a value or an incoming gradient is
not finite (a branch too: a `where` with a broadcast mask costs PyTorch a third of the
backward on CPU).
"""

from __future__ import annotations

from . import ir

_NEG_INF = ir.Lit('float("-inf")')
_MASK = "where", "select"


def exact(forward: ir.Block, backward: ir.Block, inputs: tuple[str, ...]) -> tuple:
    """The forward and backward blocks with every masked-weight contraction of an input
    made exact for non-finite values (unchanged when there is none)."""
    return _forward(forward, inputs), _backward(backward, inputs)


def _steps(block: ir.Block) -> dict[str, ir.Expr]:
    return {s.target: s.value for s in block.steps}


def _weights_mask(name: str, steps: dict[str, ir.Expr]) -> ir.Expr | None:
    """The condition that keeps a position, when step `name` is `softmax(where(c, s,
    -inf))` (or the mirror `where(c, -inf, s)`: kept where c does not hold); else None."""
    value = steps.get(name)
    if _guarded(value):  # lower/pointwise.py's empty_rows_weigh_nothing: 0 where all masked
        return _weights_mask(value.args[1].name, steps)
    if not (isinstance(value, ir.Call) and value.function == "softmax"):
        return None
    (operand,) = value.args
    if isinstance(operand, ir.Var):
        operand = steps.get(operand.name)
    if not (isinstance(operand, ir.Call) and operand.function in _MASK):
        return None
    return _kept_where(operand, _is_neg_inf)


def _guarded(value: ir.Expr | None) -> bool:
    """`where(is_finite(..), weights, zeros_like(weights))`: a step's weights with the rows
    that are all -inf set to 0."""
    return (
        isinstance(value, ir.Call)
        and value.function == "where"
        and isinstance(value.args[0], ir.Call)
        and value.args[0].function == "is_finite"
        and isinstance(value.args[1], ir.Var)
    )


def _is_neg_inf(e: ir.Expr) -> bool:
    return e == _NEG_INF or (
        isinstance(e, ir.Call) and e.function == "cast" and e.args[0] == _NEG_INF
    )


def _cast(e: ir.Expr) -> ir.Expr:
    return ir.Call("cast", (e, ir.Var("dtype")))


def _constant(text: str) -> ir.Expr:
    return _cast(ir.Lit(f'float("{text}")'))


def _forward(block: ir.Block, inputs: tuple[str, ...]) -> ir.Block:
    steps = _steps(block)
    out = []
    for step in block.steps:
        value = step.value
        if isinstance(value, ir.Einsum) and len(value.operands) == 2:
            exact_value = _exact_contraction(value, steps, inputs)
            if exact_value is not None:
                value = exact_value
        out.append(ir.Assign(step.target, value, step.comment))
    return ir.Block(tuple(out), block.returns)


def _exact_contraction(e: ir.Einsum, steps, inputs) -> ir.Expr | None:
    """`einsum(P, v)` for masked softmax weights P and an input v, as a branch on whether
    v is all finite (see the module's docstring)."""
    for w in (0, 1):
        weights, values = e.operands[w], e.operands[1 - w]
        if not (isinstance(weights, ir.Var) and isinstance(values, ir.Var)):
            continue
        if values.name not in inputs:
            continue
        keep = _weights_mask(weights.name, steps)
        if keep is None:
            keep = _vanishing(weights, steps)
            if keep is not None:
                return _exact_signed(e, w, weights, values, keep)
            continue
        # The kept positions, as the weights' shape: each term there is exp(s) * v[..]
        # with exp(s) > 0 (a weight that rounds to 0 still counts: the formula's inf).
        kept = _cast(ir.Call("broadcast_to", (keep, ir.Call("shape", (weights,)))))
        finite = ir.Call("is_finite", (values,))
        slow = _contract(e, w, weights, ir.Call("where", (finite, values, ir.Lit("0"))))
        for indicator, text in (
            (ir.Binary(">=", values, _constant("inf")), "inf"),
            (ir.Binary("<=", values, _constant("-inf")), "-inf"),
            (ir.Call("is_nan", (values,)), "nan"),
        ):
            count = _contract(e, w, kept, _cast(indicator))
            hit = ir.Binary(">=", count, ir.Lit("1"))
            slow = ir.Binary("+", slow, ir.Call("where", (hit, _constant(text), ir.Lit("0"))))
        return ir.Cond(_all_finite(values), e, slow, kept=True)
    return None


def _vanishing(e: ir.Expr, steps) -> ir.Expr | None:
    """Where `e` is kept, as a condition that broadcasts to `e`'s shape from the right,
    when `e` is 0 elsewhere by a mask: `exp(where(c, u, -inf))`, `where(c, x, 0)`, a
    product with such a factor, a step or a view of one (Mamba-2's decay times its masked
    `B * C`); else None."""
    if isinstance(e, ir.Var):
        value = steps.get(e.name)
        return None if value is None else _vanishing(value, steps)
    if isinstance(e, ir.View) and isinstance(e.operand, ir.Var):
        inner = _vanishing(e.operand, steps)
        if inner is None:
            return None
        whole = ir.Call("broadcast_to", (inner, ir.Call("shape", (e.operand,))))
        return ir.View(whole, e.perm, e.slots)
    if isinstance(e, ir.Binary) and e.op == "*":
        found = _vanishing(e.left, steps)
        return found if found is not None else _vanishing(e.right, steps)
    if isinstance(e, ir.Call) and e.function == "exp":
        (operand,) = e.args
        if isinstance(operand, ir.Call) and operand.function in _MASK:
            return _kept_where(operand, _is_neg_inf)
        return None
    if isinstance(e, ir.Call) and e.function in _MASK:
        return _kept_where(e, _is_zero)
    return None


def _kept_where(select: ir.Call, neutral) -> ir.Expr | None:
    """Where `where(c, a, b)` keeps the branch that is not `neutral` (-inf under an exp,
    0 otherwise): c when b is, not c when a is; else None."""
    cond, then, otherwise = select.args
    if neutral(otherwise):
        return cond
    if neutral(then):
        return ir.Call("logical_not", (cond,))
    return None


def _is_zero(e: ir.Expr) -> bool:
    return e == ir.Lit("0") or (
        isinstance(e, ir.Call) and e.function == "cast" and e.args[0] == ir.Lit("0")
    )


def _exact_signed(e: ir.Einsum, w: int, weights, values, keep) -> ir.Expr:
    """`einsum(W, v)` for weights W of either sign that are 0 where `keep` fails, as a
    branch on whether v is all finite. The exact branch: the contraction of the finite
    weights with the finite values, plus, per output, +inf where a kept term w * v is
    +inf, -inf where one is -inf, nan where one is nan, as IEEE products give them (an
    inf value at a weight of its sign, or of the other; an inf weight at a value of its
    sign, or of the other; nan for a nan value or weight, an inf value at a kept weight
    of exactly 0, an inf weight at a value of 0); +inf and -inf together give nan as IEEE
    sums do. Masked weights are exactly 0 (a masked term is 0 whatever v)."""
    kept = ir.Call("broadcast_to", (keep, ir.Call("shape", (weights,))))
    zero = ir.Lit("0")

    def count(*pairs):
        total = None
        for a, b in pairs:
            term = _contract(e, w, _cast(a), _cast(b))
            total = term if total is None else ir.Binary("+", total, term)
        return total

    w_pos, w_neg = ir.Binary(">", weights, zero), ir.Binary("<", weights, zero)
    w_inf, w_minf = (
        ir.Binary(">=", weights, _constant("inf")),
        ir.Binary("<=", weights, _constant("-inf")),
    )
    v_pos, v_neg = ir.Binary(">", values, zero), ir.Binary("<", values, zero)
    v_inf, v_minf = (
        ir.Binary(">=", values, _constant("inf")),
        ir.Binary("<=", values, _constant("-inf")),
    )
    w_zero = ir.Call("logical_and", (kept, ir.Binary("==", weights, zero)))
    v_zero = ir.Binary("==", values, zero)
    counts = (
        (count((w_pos, v_inf), (w_neg, v_minf), (w_inf, v_pos), (w_minf, v_neg)), "inf"),
        (count((w_pos, v_minf), (w_neg, v_inf), (w_inf, v_neg), (w_minf, v_pos)), "-inf"),
        (
            count(
                (kept, ir.Call("is_nan", (values,))),
                (ir.Call("is_nan", (weights,)), ir.Binary("==", values, values)),
                (w_zero, v_inf),
                (w_zero, v_minf),
                (w_inf, v_zero),
                (w_minf, v_zero),
            ),
            "nan",
        ),
    )
    finite_weights = ir.Call("where", (ir.Call("is_finite", (weights,)), weights, zero))
    finite_values = ir.Call("where", (ir.Call("is_finite", (values,)), values, zero))
    slow = _contract(e, w, finite_weights, finite_values)
    for total, text in counts:
        hit = ir.Binary(">=", total, ir.Lit("1"))
        slow = ir.Binary("+", slow, ir.Call("where", (hit, _constant(text), zero)))
    return ir.Cond(_all_finite(values), e, slow, kept=True)


def _all_finite(values: ir.Expr) -> ir.Expr:
    """Whether every value is finite, as whether their sum is: an inf or nan makes the
    sum inf or nan. One pass with no tensor of bools (a chunk checks the whole values
    again: `all(isfinite(v))` was 0.9 ms a chunk for a 4 x 1024 x 64 v in PyTorch, the
    sum 0.03 ms); finite values whose sum overflows take the exact branch, exact too."""
    return ir.Call("is_finite", (ir.Call("reduce_sum", (values,)),))


def _contract(e: ir.Einsum, w: int, weights: ir.Expr, values: ir.Expr) -> ir.Expr:
    """`e`'s contraction with its weights (operand `w`) and values replaced."""
    operands = (weights, values) if w == 0 else (values, weights)
    return ir.Einsum(e.subscripts, operands)


def _backward(block: ir.Block, inputs: tuple[str, ...]) -> ir.Block:
    """Under the mask, 0: each contraction of an input that is only multiplied by
    vanishing factors, and each vanishing step that a contraction reads."""
    steps = _steps(block)
    masks: dict[str, ir.Expr] = {}  # vanishing steps: the condition that keeps a position

    def vanishing(e: ir.Expr) -> ir.Expr | None:
        if isinstance(e, ir.Var):
            return masks.get(e.name) or _weights_mask(e.name, steps)
        if isinstance(e, ir.Binary) and e.op == "*":
            return vanishing(e.left) or vanishing(e.right)
        if isinstance(e, ir.Call) and e.function == "exp":
            return _vanishing(e, steps)
        if isinstance(e, ir.Binary) and e.op in "+-":
            left, right = vanishing(e.left), vanishing(e.right)
            return left if left is not None and left == right else None
        return None

    for step in block.steps:
        found = vanishing(step.value)
        if found is not None:
            masks[step.target] = found
    uses: dict[str, list[ir.Expr]] = {}
    for step in block.steps:
        _collect_uses(step.value, uses)
    wrapped: dict[str, ir.Expr] = {}  # step -> the mask it is set to 0 outside of
    read: list[ir.Expr] = []  # what the contractions of inputs read
    for step in block.steps:
        value = step.value
        if isinstance(value, ir.Einsum) and any(
            isinstance(o, ir.Var) and o.name in inputs for o in value.operands
        ):
            mask = _only_vanishing_products(step.target, uses, vanishing)
            if mask is not None:
                wrapped[step.target] = mask
                read += [o for o in value.operands if o not in read]
    if not wrapped:
        return block
    for step in block.steps:
        if step.target in masks and any(
            isinstance(u, ir.Einsum) for u in uses.get(step.target, [])
        ):
            wrapped[step.target] = masks[step.target]
    # Only a non-finite value or incoming gradient makes a masked position non-finite: a
    # kept branch in every target (a `where` with a broadcast mask, run always, cost
    # PyTorch a third of the backward on CPU).
    finite = _fresh("_finite", steps)
    checks = [_all_finite(o) for o in read]
    predicate = checks[0]
    for check in checks[1:]:
        predicate = ir.Call("logical_and", (predicate, check))
    out = []
    waiting: list[tuple[set[str], ir.Assign]] = []  # wrapped steps whose mask is not made yet
    for step in block.steps:
        value = step.value
        if step.target in wrapped:
            if finite not in {s.target for s in out}:
                out.append(ir.Assign(finite, predicate, "every value contracted is finite"))
            # Each branch computes the value (a branch of torch.cond must not return a
            # tensor from outside it); only one runs.
            masked = ir.Call("where", (wrapped[step.target], value, ir.Lit("0")))
            value = ir.Cond(ir.Var(finite), value, masked, kept=True)
            # A mask taken from a later product (a decay's `exp(where(s <= t, u, -inf))`)
            # may read steps made after this one, and before that product: the step
            # waits for them.
            later = ir.names_in(wrapped[step.target]) & set(steps) - {s.target for s in out}
            if later:
                waiting.append((later, ir.Assign(step.target, value, step.comment)))
                continue
        out.append(ir.Assign(step.target, value, step.comment))
        for pending in [w for w in waiting if w[0] <= {s.target for s in out}]:
            waiting.remove(pending)
            out.append(pending[1])
    assert not waiting, waiting
    return ir.Block(tuple(out), block.returns)


def _fresh(name: str, steps: dict) -> str:
    number = 1
    while f"{name}{number}" in steps:
        number += 1
    return f"{name}{number}"


def _collect_uses(e: ir.Expr, uses: dict[str, list[ir.Expr]]) -> None:
    """Per name, the expressions that read it directly."""
    for child in ir.children(e):
        if isinstance(child, ir.Var):
            uses.setdefault(child.name, []).append(e)
        _collect_uses(child, uses)


def _only_vanishing_products(name: str, uses, vanishing) -> ir.Expr | None:
    """The mask when every read of `name` is a product with a factor that is 0 under it
    (the same mask for all), else None."""
    found = None
    for use in uses.get(name, []):
        if not (isinstance(use, ir.Binary) and use.op == "*"):
            return None
        other = use.right if use.left == ir.Var(name) else use.left
        mask = vanishing(other)
        if mask is None or (found is not None and mask != found):
            return None
        found = mask
    return found

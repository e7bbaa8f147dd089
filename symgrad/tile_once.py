"""A tiled module's program, written once: the chunk's, which the whole op runs at start 0.

A tiled op is compiled twice (`tile`): the op, and its chunk (the same formulas with the
tiled index `t` -> `t + tile_start`, inputs cut to the chunk, and `t` ranging over
`tile_length` where no cut input gives its length). Lowered, the two programs are
usually the same steps, except that the chunk adds `tile_start` to a few positions and
sizes `t` by `tile_length`. Then the module carries the chunk's program alone, with
`tile_start=0` and `tile_length=None` (the whole op) as defaults:

- `tile_start + positions` becomes `shift(positions, tile_start)`, which runs nothing for
  the Python int 0, so the untiled call costs what the op's own program cost;
- a step that differs only where it reads `tile_length` becomes `Whole`: the op's value
  when no length is given, the chunk's otherwise.

This is checked step by step on the lowered programs: at start 0, every step of the
chunk's must be the op's own (same name, same expression), or differ only through the
length. Where the lowering differs in any other way (a pattern such as a convolution or a
prefix sum recognized in the op but not after `t + tile_start`, other saved tensors), the
module keeps both programs (`merge` returns why not).
"""

from __future__ import annotations

from dataclasses import replace

from . import ir

CASTS = ("to_int64", "cast")  # how lowering turns the int start into a position's dtype
PARTS = {
    "inputs": "inputs",
    "outputs": "outputs",
    "saved": "intermediates for its gradient",
    "grads": "incoming gradients",
}


def merge(module: ir.Module) -> tuple[ir.Module, str]:
    """The module with its tiling's `program` set when the chunk's program at start 0 is
    the op's own; else the module unchanged and the reason."""
    tiling = module.tiling
    if tiling is None:
        return module, "not tiled"
    chunk = tiling.chunk
    for part, what in PARTS.items():
        if getattr(chunk, part) != getattr(module, part):
            return module, f"the chunk has other {what}"
    start = f"_int_{tiling.start}" if tiling.start else None
    starts = {start, tiling.start} - {None}
    length = f"_int_{tiling.length}" if tiling.length else None
    blocks = []
    for kind in ("forward", "backward"):
        merged = _merge_block(getattr(module, kind), getattr(chunk, kind), start, starts, length)
        if isinstance(merged, str):
            return module, f"{kind}: {merged}"
        blocks.append(merged)
    forward, backward = blocks
    # The chunk's own attrs: its starts and lengths (a nested tiling's, every level's).
    theirs = {a.name for a in module.attrs}
    own = tuple(a for a in chunk.attrs if a.name not in theirs)
    attrs = (*module.attrs, *own)
    positive = tuple(dict.fromkeys((*module.positive_attrs, *chunk.positive_attrs)))
    program = replace(
        chunk, forward=forward, backward=backward, attrs=attrs, positive_attrs=positive
    )
    # The loop passes the op's every attr: the one program reads them all.
    chunk = replace(chunk, attrs=attrs, positive_attrs=positive)
    return replace(module, tiling=replace(tiling, chunk=chunk, program=program)), ""


def chunk_saved_only(module: ir.Module) -> bool:
    """Whether a tiled module's chunk gradient reads none of the chunk's outputs: its
    tiled backward then recomputes only the intermediates (PyTorch's `_chunk_saved` or
    `_recompute`) or waits for them alone (TensorFlow's `_after`, so the loop's graph never
    computes the outputs)."""
    tiling = module.tiling
    return tiling is not None and not ir.names_read(tiling.chunk.backward) & set(
        tiling.chunk.outputs
    )


def program_recomputes(module: ir.Module) -> bool:
    """Whether a module with one program recomputes its intermediates with it too, so that
    one `_recompute` (PyTorch) serves the untiled backward and every chunk's.

    The two used to be apart: `_recompute` takes the op's inputs and outputs, for the
    untiled backward; the tiled backward keeps no chunk's outputs, so where the chunk's
    gradient reads none it had its own `_chunk_saved`, the chunk's forward cut to the
    intermediates. They are one computation when the op's recompute is its forward's steps
    from the inputs alone (no output, no shortcut read): the program at its defaults is
    then those steps, step for step (`merge`)."""
    tiling = module.tiling
    if tiling is None or tiling.program is None or not module.saved:
        return False
    if not chunk_saved_only(module):
        return False
    plain = ir.prune(module.forward, module.saved, set(module.inputs))
    return plain.steps == module.recompute.steps


def _merge_block(
    whole: ir.Block, part: ir.Block, start: str | None, starts: set[str], length: str | None
) -> ir.Block | str:
    if len(whole.steps) != len(part.steps):
        return f"{len(whole.steps)} steps against the chunk's {len(part.steps)}"
    if whole.returns != part.returns:
        return "other results"
    steps = []
    for ours, theirs in zip(whole.steps, part.steps, strict=True):
        if ours.target != theirs.target:
            return f"step {ours.target} against the chunk's {theirs.target}"
        shifted = shifts(theirs.value, start, starts) if start else theirs.value
        at_zero = _at_zero(shifted)
        if starts & ir.names_in(at_zero):
            return f"{ours.target} reads the start other than as a shift"
        if at_zero == ours.value:
            steps.append(ir.Assign(ours.target, shifted, ours.comment))
        elif length and length in ir.names_in(theirs.value):
            steps.append(
                ir.Assign(ours.target, ir.Whole(length, ours.value, shifted), ours.comment)
            )
        else:
            return f"{ours.target} is computed otherwise in the chunk"
    return ir.Block(tuple(steps), whole.returns)


def shifts(e: ir.Expr, start: str, starts: set[str]) -> ir.Expr:
    """`e` with every `start + x` (the start perhaps cast to x's dtype) as `shift(x, start)`.

    `shift` adds the start in x's dtype, and a number has none: a cast start beside one
    (the chunk's `i + 1` is `(1 + to_int64(start)) + i`; its `i + 0.5` in a sampled
    position `(0.5 + tile_start) + i`, the attr read as a float) shifts the tensor the
    sum adds next, `1 + shift(i, start)`. As `shift(1, start)` TensorFlow added the
    loop's int32 start to the number, an int32 that the int64 positions cannot be added
    to (and 0.5 no int32 at all). With no such tensor the sum stays as written: the
    module keeps two programs (`merge`)."""

    def is_start(x: ir.Expr) -> bool:
        if isinstance(x, ir.Call) and x.function in CASTS and x.args:
            x = x.args[0]
        return isinstance(x, ir.Var) and x.name in starts

    def typed(s: ir.Expr, other: ir.Expr) -> bool:
        """Whether `other + s` is `shift(other, start)`: the int start as it is, or a
        start cast (the float attr `tile_start` too) to the dtype of `other`, a tensor."""
        return s == ir.Var(start) or not _number(other)

    def shift(x: ir.Expr) -> ir.Expr:
        return ir.Call("shift", (ir.rewrite(x, swap), ir.Var(start)))

    def swap(x: ir.Expr) -> ir.Expr | None:
        if not (isinstance(x, ir.Binary) and x.op == "+"):
            return None
        inner, then = x.left, x.right
        if isinstance(inner, ir.Binary) and inner.op == "+" and not _number(then):
            for s, number in ((inner.left, inner.right), (inner.right, inner.left)):
                if is_start(s) and not typed(s, number):
                    return ir.Binary("+", number, shift(then))
        for s, other in ((x.left, x.right), (x.right, x.left)):
            if is_start(s) and typed(s, other):
                return shift(other)
        return None

    return ir.rewrite(e, swap)


def _number(e: ir.Expr) -> bool:
    """Whether `e` is a number where the sizes are known: a literal, a size or an int attr,
    or arithmetic of them, never a cast (in a graph a size may be the int32 of
    `tf.shape`, still not the dtype the start is cast to)."""
    if isinstance(e, ir.Lit | ir.AxisSize):
        return True
    if isinstance(e, ir.Var):
        return e.name.startswith(("_n_", "_int_"))
    if isinstance(e, ir.Negate):
        return _number(e.operand)
    if isinstance(e, ir.Binary):
        return _number(e.left) and _number(e.right)
    if isinstance(e, ir.Call) and e.function in ("maximum", "minimum", "exact_div", "size_limit"):
        return all(_number(a) for a in e.args)
    if isinstance(e, ir.Call) and e.function == "same_size":
        return _number(e.args[0]) and _number(e.args[1])
    return False


def _at_zero(e: ir.Expr) -> ir.Expr:
    """`e` at start 0: every `shift(x, start)` as `x`."""

    def swap(x: ir.Expr) -> ir.Expr | None:
        if isinstance(x, ir.Call) and x.function == "shift":
            return ir.rewrite(x.args[0], swap)
        return None

    return ir.rewrite(e, swap)

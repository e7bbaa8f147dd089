"""`symgrad explain` for a recurrence: the recurrence, its step at one position (an
ordinary op, explained like any other: its forward and its derived vector-Jacobian
product), and the adjoint recurrence that the step's gradient makes.
"""

from __future__ import annotations

from .explain import explain
from .model import build
from .recurrence import is_recurrence, plan
from .spec import OpSpec


def recurrence_lines(op: OpSpec) -> list[str]:
    """The recurrence and its adjoint, in words and index notation (plain text)."""
    from .coupled import CoupledPlan
    from .coupled import recurrence_lines as coupled_lines

    found = plan(op)
    if isinstance(found, CoupledPlan):  # several states in one carry
        return coupled_lines(found, op)
    scan = found.scan
    t, h = scan.index, scan.state
    way = "from the last position back" if scan.reverse else "from the first position on"
    back = "first" if scan.reverse else "last"
    later = f"{t} - e" if scan.reverse else f"{t} + e"
    lines = [f"Recurrence along {t} ({way}; reads before the start read zero):"]
    lines += [f"  {f}" for f in op.formulas]
    lines.append(f"  computed by a scan: the step below at each position of {t}, where")
    for read in scan.body.reads:
        if read.kind == "lag":
            shift = f"{t} + {read.lag}" if scan.reverse else f"{t} - {read.lag}"
            along = f", read {read.shift} back along its axis {read.axis}" if read.shift else ""
            lines.append(f"    {read.name} is {h} at {shift}{along} (zero before the start)")
        elif read.kind == "window":
            shift = f"{t} + 1 + j" if scan.reverse else f"{t} - 1 - j"
            lines.append(f"    {read.name}[j, ...] is {h} at {shift} (zero before the start)")
        elif read.kind == "recent":
            lines.append(_recent_line(read, t, scan.reverse))
        elif read.axis is not None:
            lines.append(f"    {read.name} is read at position {t} (axis {read.axis})")
    if found.init is not None:
        lines.append(f"  and at {t} = 0 the initial step: {'; '.join(found.init.formulas)}")
    if scan.internal:
        lines.append(
            f"  {h} is internal: kept as one window of states per chunk of about sqrt(L) "
            "positions, recomputed chunk by chunk for the gradient"
        )
    direct = "" if scan.internal else f" (grad_{h})"
    gathered = (
        f"  ḡ_{h} at {t} = the gradient reaching {h}[{t}] from its direct uses{direct}"
        f" + for each past state the step at {later} reads (lag e), that step's "
        f"gradient of it (grad_{h}_lag<e>, or grad_{h}_past[e - 1] of the window);"
    )
    passed = (
        f"  the step's vector-Jacobian product at {t}, fed ḡ_{h} as grad_{h}, gives the "
        f"gradients of the inputs at {t} (cut inputs) or adds to them (inputs read whole)."
    )
    if any(r.kind == "recent" for r in scan.body.reads):
        at = f"{t} + e" if scan.reverse else f"{t} - e"
        passed += (
            "\n  An input read at lags gets its window's gradient: slice e is added to its "
            f"gradient at {at}."
        )
    lines += [
        "",
        f"Adjoint recurrence (the gradient; run from the {back} position):",
        gathered,
        passed,
        "",
        "The step (an op over one position; its gradient derived like every op's):",
    ]
    return lines


def explain_recurrence(op: OpSpec, fmt: str = "text") -> str:
    lines = recurrence_lines(op)
    body = plan(op).body
    if is_recurrence(body):  # a two-index recurrence: its step is a recurrence along the row
        step = explain_recurrence(body, fmt)
    else:
        step = explain(build(body), fmt)
    if fmt == "latex":
        head = [f"% symgrad explain: {op.name} (a recurrence)", r"\begin{verbatim}"]
        plain = [line.replace("ḡ", "gbar") for line in lines]
        return "\n".join([*head, *plain, r"\end{verbatim}", "", step])
    if fmt == "markdown":
        return "\n".join([f"# Recurrence {op.name}", "", "```text", *lines, "```", "", step])
    return "\n".join(lines) + "\n" + step


def _recent_line(read, t: str, reverse: bool) -> str:
    """What the step's window of an input read at lags holds."""
    at = f"{t} + e" if reverse else f"{t} - e"
    where = "past the end" if reverse else "before the start"
    return (
        f"    {read.name}[e, ...] is {read.input} at {at} along its axis {read.axis} (zero {where})"
    )

"""The float inputs an op reads only inside `==` or `!=` (segment ids kept as floats, as in
`where(seg[m] == seg[n], ...)`). Random reals are never equal, so a check that drew them
would never take the `==` branch and would pass a kernel that gets the segments wrong:
`symgrad check` draws them as small integers instead, so equal values occur. Their
gradient is 0 and a difference step would break the ties, so the gradient check leaves
them. Every program `check` reads carries them as `compared`: `model.Program` by
`compared_only`, a recurrence's (`check_recurrence.Program`) from its step's.
"""

from __future__ import annotations

import sympy as sp


def compared_only(program) -> tuple[str, ...]:
    """The inputs of `program` (a `model.Program`) read only in `==` and `!=`; not its
    integer index tensors, which have a draw of their own."""
    levels = [*program.intermediates, *(o.level for o in program.outputs)]
    compared: set[str] = set()
    elsewhere: set[str] = set()
    for level in levels:
        if level.gather is not None:
            elsewhere.add(level.gather.source)
            for position in level.gather.positions:
                elsewhere |= {str(a.base) for a in position.atoms(sp.Indexed)}
        for term in level.terms:
            relations = term.expr.atoms(sp.Eq, sp.Ne)
            for relation in relations:
                compared |= {str(a.base) for a in relation.atoms(sp.Indexed)}
            rest = term.expr.xreplace({r: sp.Dummy() for r in relations})
            elsewhere |= {str(a.base) for a in rest.atoms(sp.Indexed)}
    return tuple(
        name
        for name in program.inputs
        if name in compared and name not in elsewhere and name not in program.index_inputs
    )

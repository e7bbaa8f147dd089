"""PyTorch: a backward's temporaries dropped after their last reading.

A generated function's steps bind Python names, and eager PyTorch frees a tensor only
when its last reference goes: every temporary of a backward lived until the function
returned. A chunk's backward of a pairwise op reads inputs whole (`x[b,k,c]` beside the
chunk's `x[b,n,c]`), so its input-sized temporaries (the input minus its centre, the
gradients scattered back, their products) were all held at once at its end. Each step
is now followed by `del` of the temporaries no later step reads (in the order the body
is printed), so a temporary's memory is free for the steps after its last use.

Only names a step of the body binds are dropped; never a returned name, nor one the
caller passed in. A step under `if _needs[k]:` only drops names bound by steps that run
whenever it runs (`_only_if_needed` prints a step's readers in blocks of the same or
fewer inputs, after it), and only names no later step reads, in any block.
"""

from __future__ import annotations


def dropped(order: list[tuple[str, list[str]]], keep, numbers) -> list[list[str]]:
    """Per step (target, names its text reads) in printed order, the names to `del`
    after it: bound by a step of the body, read by this step and by no later one, not
    in `keep` (returned) nor in `numbers` (Python numbers: nothing to free)."""
    bound = {target for target, _ in order}
    later: set[str] = set()
    found: list[list[str]] = []
    for target, reads in reversed(order):
        names = sorted(
            {n for n in reads if n in bound and n not in later and n not in keep} - set(numbers)
        )
        found.append(names)
        later |= set(reads)
    found.reverse()
    return found

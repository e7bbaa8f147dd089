"""Several scatters into one input, added as one: the corners of a bilinear read.

A sampled read (grid_sample, deformable convolution, ROI Align) reads its source at four
corners, so the source's gradient is the sum of four scatter-adds, each a tensor of the
source's full size (and, in another layout, four transposed copies). When the source is
larger than the op's output, those are the largest tensors of a chunk's backward: four
at once (eagerly the names keep them; a graph may run the four scatters before adding).
Scatters of one source over the same indices are one scatter of their rows and positions
concatenated: one tensor of the source's size, laid out once. PyTorch spells it as
index-adds of each scatter's rows into one result in turn (`_segment_sums`), which needs
no concatenated copy of the rows (multi-scale deformable attention's eight scatters have
more rows than its source).
"""

from __future__ import annotations

from .. import ir, splits
from ..derive import Scatter
from ..model import Index
from .common import _Body


class MergedScatters:
    """One part of `Lowerer` (lowerer.py); `self` is the whole Lowerer."""

    def scatter_pieces(
        self, body: _Body, scatters: list[Scatter], indices: tuple[Index, ...]
    ) -> list[tuple[ir.Expr, tuple[Index, ...]]]:
        """The scatters' terms of a gradient shaped like `indices`: one per scatter, or
        one per group of scatters that `merge_key` puts together (at its first's place)."""
        keys = [self.merge_key(s) for s in scatters]
        groups: dict[tuple, list[Scatter]] = {}
        for key, scatter in zip(keys, scatters, strict=True):
            if key is not None:
                groups.setdefault(key, []).append(scatter)
        pieces, done = [], set()
        for key, scatter in zip(keys, scatters, strict=True):
            group = groups.get(key, ()) if key is not None else ()
            if len(group) < 2:
                pieces.append((self.scatter(body, scatter, indices), indices))
            elif key not in done:
                done.add(key)
                pieces.append((self.merged_scatter(body, group), indices))
        return pieces

    def merge_key(self, scatter: Scatter) -> tuple | None:
        """What scatters must share to be one: a plain scatter-add (no convolution, no
        blocks, no reshape) of the same source's same axes, its rows over the same
        inner indices and the same plain axes in the same order (so their rows and
        positions concatenate along the first axis), reads outside dropped alike
        (`outside_row`); None for a scatter that is lowered
        otherwise."""
        if scatter.level in self.convolutions or scatter.level in self.bands:
            return None
        level = self.levels[scatter.level]
        if self.blocks(level) is not None or splits.reshape_grid(level):
            return None
        gather = level.gather
        inner = gather.inner(level.indices)
        if not inner:  # a single row: nothing to concatenate along
            return None
        # The other indices by the source axes they read plainly: two reads of one input
        # at the same positions (`x[t, b, c']` and `x[t, b, c'']`, one linear map written
        # twice as a softmax's numerator and denominator) lay their rows out alike.
        rest = tuple(i for i in level.indices if i not in inner)
        if not set(rest) <= set(gather.positions):
            return None
        rest = tuple(gather.positions.index(i) for i in rest)
        return (gather.source, gather.computed, inner, rest, self.outside_row(level))

    def merged_scatter(self, body: _Body, group: list[Scatter]) -> ir.Expr:
        """One segment sum of the group's rows and positions, concatenated."""
        levels = [self.levels[s.level] for s in group]
        parts = [self.scatter_rows(body, level) for level in levels]
        axis = (("axis", ir.Lit("0")),)
        # Not bound: the concatenations live only for the call, and PyTorch adds each
        # pair into one result in turn instead (`_segment_sums`: no concatenated copy).
        rows = ir.Call("concat", (ir.List(tuple(g for g, _ in parts)),), axis)
        ids = ir.Call("concat", (ir.List(tuple(i for _, i in parts)),), axis)
        count = self.row_count(body, levels[0])
        kernel = self.scatter_kernel(levels[0])  # one for the group (`merge_key`)
        total = ir.Var(body.bind(ir.Call(kernel, (rows, ids, count))))
        return self.scatter_layout(body, levels[0], total)

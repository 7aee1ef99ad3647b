"""Depths and ancestor masks of a dense forest from its parents, in one Triton launch (the CUDA
path of :meth:`bole.forest.DenseForest.from_parents`; it sits on the forest's floor, below ops).

    forest_structure(parents [R, T] int64, max_depth) -> (depth [R, T] int64, ancestors [R, T, T] bool)

The torch reference (:func:`bole.forest.depths_from_parents` and
:func:`bole.forest.ancestors_from_parents`) propagates whole [R, T, T] masks ``max_depth`` times,
two to three launches a step; here one program per (request, block of rows) walks each row's
parent chain ``max_depth`` steps up with gathers (a runtime bound: one compiled kernel for every
depth), marking every node it meets. The same result:
exact for trees no deeper than ``max_depth``, roots and padding (parent -1) of depth 0 holding
only themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["forest_structure"]


@triton.jit(do_not_specialize=["T", "D"])
def _forest_kernel(parents, depth, anc, T, D, RB: tl.constexpr, TB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * RB + tl.arange(0, RB)
    rm = rows < T
    cols = tl.arange(0, TB)
    mask = cols[None, :] == rows[:, None]
    cur = tl.load(parents + r * T + rows, mask=rm, other=-1)
    d = tl.zeros([RB], dtype=tl.int64)
    for _ in range(D):
        up = cur >= 0
        mask = mask | ((cols[None, :] == cur[:, None]) & up[:, None])
        d += up.to(tl.int64)
        cur = tl.load(parents + r * T + tl.maximum(cur, 0), mask=rm & up, other=-1)
    tl.store(depth + r * T + rows, d, mask=rm)
    tl.store(anc + (r * T + rows[:, None]) * T + cols[None, :], mask.to(tl.uint8),
             mask=rm[:, None] & (cols < T)[None, :])


def forest_structure(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(depth [R, T] int64, ancestors [R, T, T] bool)`` of local ``parents [R, T]`` (-1 for
    roots and padding), walking at most ``max_depth`` steps up (CUDA, or the CPU interpreter)."""
    R, T = parents.shape
    parents = parents.contiguous()
    depth = torch.empty(R, T, dtype=torch.int64, device=parents.device)
    anc = torch.empty(R, T, T, dtype=torch.bool, device=parents.device)
    if R * T == 0:
        return depth, anc
    tb = triton.next_power_of_2(T)
    rb = max(1, min(tb, 4096 // tb))
    _forest_kernel[(R, triton.cdiv(T, rb))](parents, depth, anc.view(torch.uint8), T,
                                            max(0, int(max_depth)), RB=rb, TB=tb, num_warps=4)
    return depth, anc

"""The batch-shared budget's ranking over the dense layout in two Triton launches (the CUDA path
of :func:`bole.speculative.budget.ranking.rank_dense`; its torch code is the reference).

    rank_dense_triton(rho [R, T], parents [R, T], valid [R, T], active [R] | None, root_floor,
                      max_depth) -> Ranking

1. One program per row walks every node's parent chain (at most ``max_depth`` steps, in the
   row) for its score (the smallest rho on its path below the root, NaN as -inf) and depth,
   marks roots and draft nodes (rows with ``active`` False are padding), and picks the floors:
   a root child is in its root's floor when fewer than ``root_floor`` of its siblings come
   before it in rank order.
2. One program per block of nodes counts, for each node, the nodes that come before it in rank
   order (ascending ``(-score, depth, index)``, every key distinct by the index), which is its
   place in the order: it writes ``order[place] = node`` and the eligibility there.

The torch path takes about 80 launches (pointer jumping, three sorts, the floors' grouping).
Counting is O((R T)^2) comparisons, a few microseconds at the engine's sizes (R T <= 4096).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole.ops.triton_utils import check_kernel_device

__all__ = ["rank_dense_triton"]


@triton.jit
def _before(s_j, d_j, j, s_i, d_i, i):
    """Whether node j comes before node i: ascending (-score, depth, index)."""
    return (s_j > s_i) | ((s_j == s_i) & ((d_j < d_i) | ((d_j == d_i) & (j < i))))


@triton.jit(do_not_specialize=["T", "D", "root_floor"])
def _row_kernel(rho, parents, valid, active, score, depth, root, draft, floor, T, D, root_floor,
                HAS_ACTIVE: tl.constexpr, TB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    base = r * T
    t = tl.arange(0, TB)
    tm = t < T
    live = tl.load(valid + base + t, mask=tm, other=0) != 0
    if HAS_ACTIVE:
        live = live & (tl.load(active + r + t * 0, mask=tm, other=0) != 0)
    par = tl.load(parents + base + t, mask=tm, other=-1)
    is_draft = live & (par >= 0)
    is_root = live & (par < 0)
    x = tl.load(rho + base + t, mask=tm, other=0.0).to(tl.float64)
    x = tl.where(x != x, float("-inf"), x)                  # NaN rho counts as -inf
    low = x
    d = is_draft.to(tl.int64)
    cur = tl.where(is_draft, par, -1)
    for _ in range(D):
        up = cur >= 0
        safe = tl.maximum(cur, 0)
        cur_live = tl.load(valid + base + safe, mask=tm & up, other=0) != 0
        cur_par = tl.load(parents + base + safe, mask=tm & up, other=-1)
        anc_draft = up & cur_live & (cur_par >= 0)
        a = tl.load(rho + base + safe, mask=tm & anc_draft, other=0.0).to(tl.float64)
        a = tl.where(a != a, float("-inf"), a)
        low = tl.where(anc_draft, tl.minimum(low, a), low)
        d += anc_draft.to(tl.int64)
        cur = tl.where(anc_draft, cur_par, -1)
    s = tl.where(is_draft, low, float("-inf"))
    d = tl.where(is_draft, d, 0)
    # root children: a draft node whose parent is a root of this (live) row
    p_safe = tl.maximum(par, 0)
    p_par = tl.load(parents + base + p_safe, mask=tm & is_draft, other=0)
    p_live = tl.load(valid + base + p_safe, mask=tm & is_draft, other=0) != 0
    child = is_draft & p_live & (p_par < 0)
    # siblings before each root child in rank order (all root children share the row's roots:
    # compare parents too, for rows with several roots)
    ahead = (child[None, :] & child[:, None] & (par[None, :] == par[:, None])
             & _before(s[None, :], d[None, :], t[None, :], s[:, None], d[:, None], t[:, None]))
    in_floor = child & (tl.sum(ahead.to(tl.int32), axis=1) < root_floor)
    tl.store(score + base + t, s, mask=tm)
    tl.store(depth + base + t, d, mask=tm)
    tl.store(root + base + t, is_root.to(tl.int8), mask=tm)
    tl.store(draft + base + t, is_draft.to(tl.int8), mask=tm)
    tl.store(floor + base + t, in_floor.to(tl.int8), mask=tm)


@triton.jit(do_not_specialize=["N"])
def _order_kernel(score, depth, draft, floor, order, eligible, N, BI: tl.constexpr,
                  BJ: tl.constexpr):
    i = tl.program_id(0) * BI + tl.arange(0, BI)
    im = i < N
    s_i = tl.load(score + i, mask=im, other=0.0)
    d_i = tl.load(depth + i, mask=im, other=0).to(tl.int32)
    place = tl.zeros([BI], dtype=tl.int32)
    for j0 in range(0, N, BJ):
        j = j0 + tl.arange(0, BJ)
        jm = j < N
        s_j = tl.load(score + j, mask=jm, other=0.0)
        d_j = tl.load(depth + j, mask=jm, other=0).to(tl.int32)
        first = _before(s_j[None, :], d_j[None, :], j[None, :], s_i[:, None], d_i[:, None],
                        i[:, None]) & jm[None, :]
        place += tl.sum(first.to(tl.int32), axis=1)
    ok = (tl.load(draft + i, mask=im, other=0) != 0) & (tl.load(floor + i, mask=im, other=0) == 0)
    tl.store(order + place, i.to(tl.int64), mask=im)
    tl.store(eligible + place, ok.to(tl.int8), mask=im)


def rank_dense_triton(rho: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
                      active: torch.Tensor | None, root_floor: int, max_depth: int):
    """The fields of :func:`bole.speculative.budget.ranking.rank_dense`'s ranking of a dense forest
    (``rho``, local ``parents`` and ``valid`` ``[R, T]``; ``active`` ``[R]`` bool or None), in
    two launches, equal to the torch ranking for forests no deeper than ``max_depth``:
    ``(order [N] int64, eligible [N] bool, root [N] bool, floor [N] bool, score [N] float64)``,
    ``N = R * T``."""
    if rho.dim() != 2 or parents.shape != rho.shape or valid.shape != rho.shape:
        raise ValueError(f"rho {tuple(rho.shape)}, parents {tuple(parents.shape)} and valid "
                         f"{tuple(valid.shape)} must all be [R, T]")
    if not isinstance(root_floor, int) or root_floor < 0:
        raise ValueError(f"root_floor must be an int >= 0, got {root_floor!r}")
    check_kernel_device(rho.device, "rank_dense_triton")
    R, T = rho.shape
    N, dev = R * T, rho.device
    rho64 = rho.to(torch.float64).contiguous()
    parents = parents.to(torch.int64).contiguous()
    valid8 = valid.contiguous().view(torch.int8) if valid.dtype == torch.bool else \
        valid.to(torch.int8).contiguous()
    act = active.contiguous().view(torch.int8) if active is not None else valid8
    score = torch.empty(N, dtype=torch.float64, device=dev)
    depth = torch.empty(N, dtype=torch.int64, device=dev)
    flags = torch.empty(3, N, dtype=torch.int8, device=dev)          # root, draft, floor
    order = torch.empty(N, dtype=torch.int64, device=dev)
    eligible = torch.empty(N, dtype=torch.int8, device=dev)
    if N:
        _row_kernel[(R,)](rho64, parents, valid8, act, score, depth, flags[0], flags[1],
                          flags[2], T, max(0, int(max_depth)), root_floor,
                          HAS_ACTIVE=active is not None, TB=triton.next_power_of_2(T),
                          num_warps=4)
        bi = 64
        _order_kernel[(triton.cdiv(N, bi),)](score, depth, flags[1], flags[2], order, eligible,
                                             N, BI=bi, BJ=32, num_warps=4)
    bools = flags.view(torch.bool)
    return order, eligible.view(torch.bool), bools[0], bools[2], score

"""One Triton launch per growth step: :meth:`TreeGrowth._add_children` and
:meth:`TreeGrowth._next_frontier` (the torch reference in ``tree_growth.py``) fused.

One program per request writes the step's ``K * topk`` created slots of the :class:`NodeTable`
(tokens, parents, depth, rho, live, ancestor rows) and picks the next frontier: the ``topk`` live
slots of highest rho, ties by slot (creation order), masked to -1 where the request's depth
limit ends before the next step. The torch version spends about 30 launches (gathers, wheres, a
stable sort) per step, a launch-bound cost that a drafter step of a small model pays eight times
per round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole.ops.triton_utils import fix_interpreter_scalar_index

fix_interpreter_scalar_index()

_COL_BLOCK = 64


@triton.jit
def _grow_step_kernel(front, tok_in, prob_in, limit, next_front,
                      t_tok, t_par, t_dep, t_rho, t_live, t_anc, C, lo, step,
                      K: tl.constexpr, TOPK: tl.constexpr, NB: tl.constexpr, CB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    n: tl.constexpr = K * TOPK
    j = tl.arange(0, NB)
    valid = j < n
    parent = tl.load(front + r * K + j // TOPK, mask=valid, other=-1)
    tok = tl.load(tok_in + r * n + j, mask=valid, other=-1)
    prob = tl.load(prob_in + r * n + j, mask=valid, other=0.0)
    # a NaN probability is a missing proposal; the rest are clamped to [0, 1] (as in torch)
    live = valid & (parent >= 0) & (tok >= 0) & (prob == prob)
    prob = tl.minimum(tl.maximum(tl.where(prob == prob, prob, 0.0), 0.0), 1.0)
    safe = tl.maximum(parent, 0)
    # rho in float64 of the float32 probabilities, as the host multiplies Python floats
    rho = tl.load(t_rho + r * C + safe, mask=valid, other=0.0) * prob.to(tl.float64)
    rho = tl.where(live, rho, 0.0)
    row = r * C + lo + j
    tl.store(t_tok + row, tl.where(live, tok, 0), mask=valid)
    tl.store(t_par + row, tl.where(live, parent, -1), mask=valid)
    tl.store(t_dep + row, tl.where(live, step + 1, 0).to(tl.int64), mask=valid)
    tl.store(t_rho + row, rho, mask=valid)
    tl.store(t_live + row, live.to(tl.uint8), mask=valid)
    # a node's ancestors are its parent's plus itself; slots not created keep only themselves
    base = t_anc + r * C * C
    for c0 in range(0, C, CB):
        cols = c0 + tl.arange(0, CB)
        m2 = valid[:, None] & (cols < C)[None, :]
        inherited = tl.load(base + safe[:, None] * C + cols[None, :], mask=m2, other=0)
        own = cols[None, :] == (lo + j)[:, None]
        val = ((inherited != 0) & live[:, None]) | own
        tl.store(base + (lo + j)[:, None] * C + cols[None, :], val.to(tl.uint8), mask=m2)
    # the next frontier: the topk best live slots, best first, ties by slot
    key = tl.where(live, rho, -1.0)
    go_on = tl.load(limit + r) > step + 1
    for i in tl.static_range(TOPK):
        best = tl.max(key, 0)
        at = tl.min(tl.where(key == best, j, NB), 0)
        ok = (best >= 0) & go_on
        tl.store(next_front + r * TOPK + i, tl.where(ok, lo + at, -1).to(tl.int64))
        key = tl.where(j == at, -2.0, key)


def grow_step(table, step: int, lo: int, frontier: torch.Tensor, tokens: torch.Tensor,
              probs: torch.Tensor, limit: torch.Tensor, topk: int) -> torch.Tensor:
    """Write the proposals ``tokens, probs [R, K, topk]`` of ``frontier [R, K]`` into ``table``'s
    slots ``lo ..`` (in place) and return the next step's frontier ``[R, topk]`` (masked by
    ``limit [R]``: -1 for requests whose growth stops after this step)."""
    R, K = frontier.shape
    C = table.tokens.shape[1]
    n = K * topk
    nxt = torch.empty(R, topk, dtype=torch.int64, device=frontier.device)
    _grow_step_kernel[(R,)](
        frontier.contiguous(), tokens.contiguous(), probs.to(torch.float32).contiguous(), limit,
        nxt, table.tokens, table.parents, table.depth, table.rho, table.live.view(torch.uint8),
        table.ancestors.view(torch.uint8), C, lo, step, K=K, TOPK=topk,
        NB=triton.next_power_of_2(n), CB=min(_COL_BLOCK, triton.next_power_of_2(C)),
        num_warps=4)
    return nxt


@triton.jit
def _rank_key(t_live, t_rho, base, i, n):
    """Ascending rank key of slots ``i``: -rho of created nodes, +inf for the rest (NaN too),
    -inf for the root."""
    m = i < n
    key = tl.where(tl.load(t_live + base + i, mask=m, other=0) != 0,
                   0.0 - tl.load(t_rho + base + i, mask=m, other=0.0), float("inf"))
    key = tl.where(key == key, key, float("inf"))
    return tl.where(i == 0, float("-inf"), key)


@triton.jit
def _rerank_kernel(t_tok, t_par, t_dep, t_rho, t_live, C, scratch, inv, keys,
                   o_tok, o_rho, o_src, o_par, o_valid,
                   TK: tl.constexpr, B: tl.constexpr, D: tl.constexpr, TB: tl.constexpr,
                   CB: tl.constexpr, KB: tl.constexpr):
    """Program per request: keep the root and the TK - 1 best slots by (-rho, slot), lay them
    out by (depth, parent's position, rank) in D - 1 passes, write the [B] output row."""
    r = tl.program_id(0).to(tl.int64)
    tb = r * C
    # ---- rank every slot by (-rho, slot), the root first; the TK best go to scratch[rank]
    for i0 in range(0, C, CB):
        i = i0 + tl.arange(0, CB)
        im = i < C
        ki = _rank_key(t_live, t_rho, tb, i, C)
        rank = tl.zeros([CB], dtype=tl.int32)
        for j0 in range(0, C, CB):
            j = j0 + tl.arange(0, CB)
            jm = j < C
            kj = _rank_key(t_live, t_rho, tb, j, C)
            before = (kj[None, :] < ki[:, None]) | ((kj[None, :] == ki[:, None])
                                                    & (j[None, :] < i[:, None]))
            rank += tl.sum((before & jm[None, :]).to(tl.int32), 1)
        tl.store(scratch + r * TK + rank, i.to(tl.int64), mask=im & (rank < TK))
    tl.debug_barrier()
    # ---- rank space: entry a is the a-th best slot
    a = tl.arange(0, TB)
    am = a < TK
    slot = tl.load(scratch + r * TK + a, mask=am, other=0)
    kept = am & (tl.load(t_live + tb + slot, mask=am, other=0) != 0)
    level = tl.where(kept, tl.load(t_dep + tb + slot, mask=am, other=0), D + 1)
    pslot = tl.where(kept, tl.load(t_par + tb + slot, mask=am, other=-1), -1)
    tl.store(inv + tb + slot, a.to(tl.int64), mask=kept)
    tl.debug_barrier()
    # a kept node's parent is kept (rho never grows along a path; ties go to the parent's slot)
    prank = tl.load(inv + tb + pslot, mask=kept & (pslot >= 0), other=-1)
    pos = a.to(tl.int64)
    for _ in range(D - 1):
        tl.store(keys + r * TB + a, pos, mask=am)
        tl.debug_barrier()
        ppos = tl.load(keys + r * TB + prank, mask=prank >= 0, other=-1)
        key = (level.to(tl.int64) * (TK + 1) + ppos + 1) * TK + a
        tl.debug_barrier()
        tl.store(keys + r * TB + a, key, mask=am)
        tl.debug_barrier()
        cnt = tl.zeros([TB], dtype=tl.int64)
        for b0 in range(0, TB, KB):
            b = b0 + tl.arange(0, KB)
            kb = tl.load(keys + r * TB + b, mask=b < TK, other=0)
            cnt += tl.sum(((kb[None, :] < key[:, None]) & (b < TK)[None, :]).to(tl.int64), 1)
        pos = cnt
        tl.debug_barrier()
    tl.store(keys + r * TB + a, pos, mask=am)
    tl.debug_barrier()
    ppos = tl.load(keys + r * TB + prank, mask=prank >= 0, other=-1)
    out = r * B + pos
    tl.store(o_tok + out, tl.where(kept, tl.load(t_tok + tb + slot, mask=am, other=0), 0), mask=am)
    tl.store(o_rho + out, tl.where(kept, tl.load(t_rho + tb + slot, mask=am, other=0.0), 0.0),
             mask=am)
    tl.store(o_src + out, tl.where(kept, slot, -1), mask=am)
    tl.store(o_par + out, tl.where(kept, ppos, -1), mask=am)
    tl.store(o_valid + out, kept.to(tl.uint8), mask=am)
    for p0 in range(TK, B, TB):                 # padding past the kept slots
        pad = p0 + tl.arange(0, TB)
        pm = pad < B
        tl.store(o_tok + r * B + pad, tl.zeros([TB], dtype=tl.int64), mask=pm)
        tl.store(o_rho + r * B + pad, tl.zeros([TB], dtype=tl.float64), mask=pm)
        tl.store(o_src + r * B + pad, tl.full([TB], -1, tl.int64), mask=pm)
        tl.store(o_par + r * B + pad, tl.full([TB], -1, tl.int64), mask=pm)
        tl.store(o_valid + r * B + pad, tl.zeros([TB], dtype=tl.uint8), mask=pm)


def rerank(table, kept: int, budget: int, depth: int):
    """``(tokens, rho, source, parents, valid)``, each ``[R, budget]``: the root and the
    ``kept - 1`` best nodes of ``table`` in the dense layout, padded to ``budget`` (see
    :meth:`TreeGrowth._rerank`, the torch reference)."""
    R, C = table.tokens.shape
    dev = table.tokens.device
    tb = triton.next_power_of_2(kept)
    i64 = dict(dtype=torch.int64, device=dev)
    scratch = torch.empty(R, kept, **i64)
    inv = torch.full((R, C), -1, **i64)           # a parent not kept reads -1 (no parent)
    keys = torch.empty(R, tb, **i64)
    tokens, source, parents = (torch.empty(R, budget, **i64) for _ in range(3))
    rho = torch.empty(R, budget, dtype=torch.float64, device=dev)
    valid = torch.empty(R, budget, dtype=torch.bool, device=dev)
    cb = min(64, triton.next_power_of_2(C))
    _rerank_kernel[(R,)](table.tokens, table.parents, table.depth, table.rho,
                         table.live.view(torch.uint8), C, scratch, inv, keys,
                         tokens, rho, source, parents, valid.view(torch.uint8),
                         TK=kept, B=budget, D=depth, TB=tb, CB=cb, KB=min(32, tb), num_warps=4)
    return tokens, rho, source, parents, valid

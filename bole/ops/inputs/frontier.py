"""The MTP head's per-step inputs from the growth's frontier, in one launch.

    frontier_inputs(frontier [R, K], table, prev_out [R * K', H] | None, prev_lo, topk,
                    last_hidden [S, H], slots [R], ctx [R], junk_row) -> FrontierInputs

For each frontier node (its slot in the :class:`~bole.speculative.tree_growth.NodeTable`, -1 for
none): its token, its position (ctx + depth), the MTP pool row its KV goes to (ctx - 1 + slot, the
junk row for none), its attention mask over the table's slots (its ancestors, nothing for none)
and the hidden state it reads: at the root the slot's last target hidden state, below it the MTP
output of its parent. The previous step expanded that parent and wrote the node at slot
``prev_lo + f * topk + j``, f being the parent's place in that step's frontier, so the parent's
output is row ``r * K' + f`` of that step's output ``prev_out`` (K' entries a request): no table
of outputs by slot to scatter into. :func:`frontier_inputs_torch` is the reference (about a
dozen gathers and wheres); the kernel is one program per frontier node, which a drafter step of
a small model pays eight times a round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["FrontierInputs", "frontier_inputs", "frontier_inputs_torch"]


@dataclass
class FrontierInputs:
    tokens: torch.Tensor      # [R * K] int64
    positions: torch.Tensor   # [R * K] int64
    rows: torch.Tensor        # [R, K] int64 MTP pool rows
    mask: torch.Tensor        # [R * K, C] bool
    prev: torch.Tensor        # [R * K, H] hidden states (m_table's dtype)


def frontier_inputs_torch(frontier, table, prev_out, prev_lo: int, topk: int, last_hidden,
                          slots, ctx, junk_row: int) -> FrontierInputs:
    R, K = frontier.shape
    C, H = table.tokens.shape[1], last_hidden.shape[-1]
    live = frontier >= 0
    f = frontier.clamp(min=0)
    tok = torch.gather(table.tokens, 1, f)
    parent = torch.gather(table.parents, 1, f)
    depth = torch.gather(table.depth, 1, f)
    root_h = last_hidden[slots.long()][:, None].expand(R, K, H)
    if prev_out is None:
        prev = root_h
    else:
        kp = prev_out.shape[0] // R
        place = ((f - prev_lo) // topk).clamp(0, kp - 1)
        parent_m = torch.gather(prev_out.view(R, kp, H), 1, place[..., None].expand(R, K, H))
        prev = torch.where((parent >= 0)[..., None], parent_m, root_h.to(prev_out.dtype))
    rows = torch.where(live, (ctx - 1)[:, None] + f, junk_row)
    mask = torch.gather(table.ancestors, 1, f[..., None].expand(R, K, C)) & live[..., None]
    return FrontierInputs(tok.reshape(-1), (ctx[:, None] + depth).reshape(-1), rows,
                          mask.reshape(R * K, C), prev.reshape(R * K, H))


@triton.jit
def _frontier_kernel(frontier, t_tok, t_par, t_dep, t_anc, prev_out, last_hidden, slots, ctx,
                     o_tok, o_pos, o_rows, o_mask, o_prev, C, H, junk_row, prev_lo, prev_k,
                     K: tl.constexpr, TOPK: tl.constexpr, CB: tl.constexpr, HB: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)            # frontier entry r * K + k
    r = i // K
    f = tl.load(frontier + i)
    live = f >= 0
    fc = tl.maximum(f, 0)
    tok = tl.load(t_tok + r * C + fc)
    parent = tl.load(t_par + r * C + fc)
    depth = tl.load(t_dep + r * C + fc)
    c0 = tl.load(ctx + r)
    tl.store(o_tok + i, tok)
    tl.store(o_pos + i, c0 + depth)
    tl.store(o_rows + i, tl.where(live, c0 - 1 + fc, junk_row))
    for lo in range(0, C, CB):
        cols = lo + tl.arange(0, CB)
        a = tl.load(t_anc + (r * C + fc) * C + cols, mask=cols < C, other=0)
        tl.store(o_mask + i * C + cols, ((a != 0) & ((cols * 0 + f) >= 0)).to(tl.uint8),
                 mask=cols < C)
    slot = tl.load(slots + r).to(tl.int64)
    place = tl.minimum(tl.maximum((fc - prev_lo) // TOPK, 0), prev_k - 1)
    src_m = prev_out + (r * prev_k + place) * H
    src_h = last_hidden + slot * H
    for lo in range(0, H, HB):
        cols = lo + tl.arange(0, HB)
        hm = cols < H
        from_m = (cols * 0 + parent) >= 0           # the scalar test as a vector (for masks)
        from_h = (cols * 0 + parent) < 0
        pm = tl.load(src_m + cols, mask=hm & from_m, other=0.0)
        ph = tl.load(src_h + cols, mask=hm & from_h, other=0.0)
        val = tl.where(from_m, pm, ph.to(pm.dtype))
        tl.store(o_prev + i * H + cols, val, mask=hm)


def frontier_inputs(frontier, table, prev_out, prev_lo: int, topk: int, last_hidden, slots, ctx,
                    junk_row: int, impl: str = "auto") -> FrontierInputs:
    """The frontier's MTP inputs (see the module docstring): ``prev_out [R * K', H]`` the
    previous step's MTP outputs in its frontier's order (None at the first step, whose frontier
    holds roots only), ``prev_lo`` the first slot that step created, ``topk`` proposals per
    node. ``impl``: "torch", "triton" (CUDA, or CPU tensors under TRITON_INTERPRET=1) or "auto"
    (the kernel on CUDA)."""
    if impl == "torch" or (impl == "auto" and frontier.device.type != "cuda"):
        return frontier_inputs_torch(frontier, table, prev_out, prev_lo, topk, last_hidden,
                                     slots, ctx, junk_row)
    R, K = frontier.shape
    C, H = table.tokens.shape[1], last_hidden.shape[-1]
    dev = frontier.device
    dtype = last_hidden.dtype if prev_out is None else prev_out.dtype
    out = FrontierInputs(torch.empty(R * K, dtype=torch.int64, device=dev),
                         torch.empty(R * K, dtype=torch.int64, device=dev),
                         torch.empty(R, K, dtype=torch.int64, device=dev),
                         torch.empty(R * K, C, dtype=torch.bool, device=dev),
                         torch.empty(R * K, H, dtype=dtype, device=dev))
    if last_hidden.dtype != dtype:
        last_hidden = last_hidden.to(dtype)
    src = last_hidden if prev_out is None else prev_out.contiguous()   # None: never read
    prev_k = 1 if prev_out is None else prev_out.shape[0] // R
    _frontier_kernel[(R * K,)](
        frontier.contiguous(), table.tokens, table.parents, table.depth,
        table.ancestors.view(torch.uint8), src, last_hidden, slots, ctx.to(torch.int64),
        out.tokens, out.positions, out.rows, out.mask.view(torch.uint8), out.prev, C, H,
        junk_row, int(prev_lo), prev_k, K=K, TOPK=int(topk),
        CB=min(256, triton.next_power_of_2(C)), HB=min(1024, triton.next_power_of_2(H)),
        num_warps=4)
    return out

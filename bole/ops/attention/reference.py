"""Torch paths of tree attention: the vectorised one (one batched softmax over the slots'
positions) and the oracle, and the output gate both paths apply."""

from __future__ import annotations

import torch

from bole.ops.attention.checks import _check_tree

__all__ = ["tree_attention_reference"]


def _apply_gate(o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """``o [N, Hq, D]`` (already in q's dtype) times ``sigmoid(gate [N, Hq * D])``."""
    if gate is None:
        return o
    gate = gate.reshape(o.shape[0], -1)
    return (o.reshape(o.shape[0], -1) * torch.sigmoid(gate)).view(o.shape)


def _visible(ctx_lens: torch.Tensor, tree_mask: torch.Tensor, R: int, Tq: int, M: int) -> torch.Tensor:
    """``[R, Tq, M]`` bool: node t of request r sees pool position p of its slot."""
    Tk = tree_mask.shape[1]
    ctx = ctx_lens.long().clamp(0, M - Tk)[:, None]                           # [R, 1]
    pos = torch.arange(M, device=tree_mask.device)[None]                      # [1, M]
    j = pos - ctx                                                              # scratch index
    in_scratch = (j >= 0) & (j < Tk)
    scratch = tree_mask.bool().view(R, Tq, Tk).gather(
        2, j.clamp(0, Tk - 1)[:, None, :].expand(R, Tq, M))                   # [R, Tq, M]
    return (pos < ctx)[:, None, :] | (scratch & in_scratch[:, None, :])


def _tree_attention_torch(q, k_pool, v_pool, slots, ctx_lens, tree_mask, scale, R, Tq):
    """One batched fp32 softmax over the R slots' first M positions. Returns ``[N, Hq, D]`` fp32."""
    N, Hq, D = q.shape
    M, Hkv = k_pool.shape[1], k_pool.shape[2]
    G = Hq // Hkv
    visible = _visible(ctx_lens, tree_mask, R, Tq, M)
    # index_select of the head-major view copies straight into [R, Hkv, M, D], ready for bmm
    keys = k_pool.transpose(1, 2).index_select(0, slots.long()).float()       # [R, Hkv, M, D]
    vals = v_pool.transpose(1, 2).index_select(0, slots.long()).float()
    qf = q.float().view(R, Tq, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(R, Hkv, Tq * G, D)
    scores = (qf @ keys.transpose(2, 3)).mul_(scale).view(R, Hkv, Tq, G, M)
    scores.masked_fill_(~visible[:, None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)   # a row seeing nothing: NaN -> 0
    o = probs.view(R, Hkv, Tq * G, M) @ vals                                  # [R, Hkv, Tq*G, D]
    return o.view(R, Hkv, Tq, G, D).permute(0, 2, 1, 3, 4).reshape(N, Hq, D)


def tree_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                             slots: torch.Tensor, ctx_lens: torch.Tensor, tree_mask: torch.Tensor,
                             *, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Slow fp64 oracle of :func:`tree_attention`: a loop over requests and nodes, each node's
    visible keys gathered explicitly. Shapes as there; returns ``[N, Hq, D]`` in q's dtype."""
    R, Tq, Tk = _check_tree(q, k_pool, v_pool, slots, ctx_lens, tree_mask, gate)
    N, Hq, D = q.shape
    kv_head = torch.arange(Hq) // (Hq // k_pool.shape[2])
    out = torch.zeros(N, Hq, D, dtype=torch.float64)
    mask = tree_mask.bool().cpu()
    for r in range(R):
        slot, ctx = int(slots[r]), int(ctx_lens[r])
        for t in range(Tq):
            n = r * Tq + t
            pos = list(range(ctx)) + [ctx + j for j in range(Tk) if bool(mask[n, j])]
            if not pos:
                continue                                    # nothing visible: zeros
            keys = k_pool[slot, pos].double().cpu()[:, kv_head]                # [L, Hq, D]
            vals = v_pool[slot, pos].double().cpu()[:, kv_head]
            scores = torch.einsum("lhd,hd->hl", keys, q[n].double().cpu()) * scale
            out[n] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), vals)
    return _apply_gate(out.to(q.dtype).to(q.device), gate)

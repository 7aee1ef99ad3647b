"""Tensor parallelism: which slice of each checkpoint tensor a rank holds (Megatron-style).

Heads are independent in attention and in Gated DeltaNet, so ranks split them:

    attention     q_proj (query + gate) and k/v_proj rows by head; o_proj columns (row-parallel,
                  its output summed over ranks); q/k norms replicated
    Gated DeltaNet the [q | k | v] rows of in_proj_qkv (and the conv channels) by key / value
                  head, z / b / a rows, A_log and dt_bias by value head, out_proj columns; value
                  heads stay with their key head (GVA groups stay whole); Qwen3-Next's grouped
                  in_proj_qkvz / in_proj_ba by key head
    MLP           gate / up rows, down columns (every expert alike; the router replicated; fused
                  experts: both halves of gate_up_proj [E, 2F, H] along dim 1, down_proj
                  [E, H, F] along dim 2)
    embedding     rows by vocabulary range (a lookup outside the range gives zeros, summed over
                  ranks); the lm_head likewise, its logits gathered over ranks
    the rest      replicated (norms, MTP fc, the shared-expert gate)

A row-parallel bias is kept by rank 0 only, so that the sum over ranks adds it once.
:func:`shard_plan` names the slice; the loader reads only those rows or columns from safetensors.
"""

from __future__ import annotations

import torch

from bole.distributed import TPShard
from bole.models.config import HybridConfig

#: a slice of a tensor: the dim it cuts and the [start, stop) ranges concatenated along it
Plan = tuple[int, tuple[tuple[int, int], ...]]


def check_divisible(c: HybridConfig, world: int) -> None:
    """Raise a ValueError naming every count that ``world`` ranks cannot split evenly."""
    if world < 1:
        raise ValueError(f"tp must be >= 1, got {world}")
    counts = {"attention heads": c.num_attention_heads, "key-value heads": c.num_key_value_heads,
              "GDN key heads": c.linear_num_key_heads, "GDN value heads": c.linear_num_value_heads,
              "vocabulary": c.vocab_size}
    if c.num_experts:
        counts["expert MLP width"] = c.moe_intermediate_size
        if c.shared_expert_intermediate_size:
            counts["shared expert MLP width"] = c.shared_expert_intermediate_size
    if not c.num_experts or c.mlp_only_layers:
        counts["MLP width"] = c.intermediate_size
    bad = [f"{name} ({n})" for name, n in counts.items() if n % world]
    if bad:
        raise ValueError(f"tp={world} does not divide the model's {', '.join(bad)}; use a tp "
                         f"that divides them (the model has {c.num_key_value_heads} key-value "
                         f"heads and {c.linear_num_key_heads} GDN key heads)")


def shard_plan(c: HybridConfig, name: str, shard: TPShard) -> Plan | None:
    """The slice of tensor ``name`` that ``shard`` holds, or None when it is replicated."""
    if shard.world == 1:
        return None
    hd, dk, dv = c.head_dim, c.linear_key_head_dim, c.linear_value_head_dim
    Hq, Hkv, Hk, Hv = (c.num_attention_heads, c.num_key_value_heads, c.linear_num_key_heads,
                       c.linear_num_value_heads)
    rows = lambda *ranges: (0, tuple(ranges))          # noqa: E731
    cols = lambda *ranges: (1, tuple(ranges))          # noqa: E731
    if name.endswith(("embed_tokens.weight",)) or name == "lm_head.weight":
        return rows(shard.part(c.vocab_size))
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return rows(shard.part(Hq, 2 * hd))
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                      "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
        return rows(shard.part(Hkv, hd))
    if name.endswith("self_attn.o_proj.weight"):
        return cols(shard.part(Hq, hd))
    if name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):
        q, k, v = shard.part(Hk, dk), shard.part(Hk, dk), shard.part(Hv, dv)
        return rows(q, (Hk * dk + k[0], Hk * dk + k[1]), (2 * Hk * dk + v[0], 2 * Hk * dk + v[1]))
    if name.endswith("linear_attn.in_proj_z.weight"):
        return rows(shard.part(Hv, dv))
    if name.endswith(("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
                      "linear_attn.A_log", "linear_attn.dt_bias")):
        return rows(shard.part(Hv))
    if name.endswith("linear_attn.in_proj_qkvz.weight"):
        return rows(shard.part(Hk, 2 * dk + 2 * (Hv // Hk) * dv))
    if name.endswith("linear_attn.in_proj_ba.weight"):
        return rows(shard.part(Hk, 2 * (Hv // Hk)))
    if name.endswith("linear_attn.out_proj.weight"):
        return cols(shard.part(Hv, dv))
    if name.endswith("mlp.experts.gate_up_proj"):
        F = c.moe_intermediate_size
        a, b = shard.part(F)
        return 1, ((a, b), (F + a, F + b))
    if name.endswith("mlp.experts.down_proj"):
        return 2, (shard.part(c.moe_intermediate_size),)
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return rows(shard.part(_mlp_width(c, name)))
    if name.endswith("down_proj.weight"):
        return cols(shard.part(_mlp_width(c, name)))
    return None


def _mlp_width(c: HybridConfig, name: str) -> int:
    if ".shared_expert." in name:
        return c.shared_expert_intermediate_size
    if ".experts." in name:
        return c.moe_intermediate_size
    return c.intermediate_size


def zero_on_other_ranks(name: str) -> bool:
    """A row-parallel layer's bias: added once, by rank 0, before the sum over ranks."""
    return name.endswith("self_attn.o_proj.bias")


def take(t: torch.Tensor, plan: Plan | None) -> torch.Tensor:
    """The slice ``plan`` of a full tensor (a copy, contiguous)."""
    if plan is None:
        return t
    dim, ranges = plan
    return torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()


def shard_tensors(c: HybridConfig, tensors: dict[str, torch.Tensor],
                  shard: TPShard) -> dict[str, torch.Tensor]:
    """Every tensor's slice for ``shard`` (random-weight models are built whole, then cut)."""
    out = {}
    for name, t in tensors.items():
        t = take(t, shard_plan(c, name, shard))
        if shard.rank and zero_on_other_ranks(name):
            t = torch.zeros_like(t)
        out[name] = t
    return out

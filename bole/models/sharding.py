"""Tensor parallelism: which slice of each checkpoint tensor a rank holds (Megatron-style).

Heads are independent in attention and in linear attention, so ranks split them:

    attention     q_proj (query + gate) and k/v_proj rows by head; o_proj columns (row-parallel,
                  its output summed over ranks); q/k norms replicated
    linear        each linear-attention type's own plan (:meth:`LinearAttention.shard_plan
                  <bole.models.layers.base.LinearAttention.shard_plan>`), by head as well
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
from bole.models.layers.base import Plan
from bole.models.layers.registry import linear_attention_type


def check_divisible(c: HybridConfig, world: int) -> None:
    """Raise a ValueError naming every count that ``world`` ranks cannot split evenly."""
    if world < 1:
        raise ValueError(f"tp must be >= 1, got {world}")
    counts = {"attention heads": c.num_attention_heads, "key-value heads": c.num_key_value_heads}
    heads = [f"{c.num_key_value_heads} key-value heads"]
    for kind, cfg in c.linear_attention:
        own = linear_attention_type(kind).divisible_counts(cfg)
        counts.update(own)
        heads += [f"{n} {name}" for name, n in list(own.items())[:1]]
    counts["vocabulary"] = c.vocab_size
    if c.num_experts:
        counts["expert MLP width"] = c.moe_intermediate_size
        if c.shared_expert_intermediate_size:
            counts["shared expert MLP width"] = c.shared_expert_intermediate_size
    if not c.num_experts or c.mlp_only_layers:
        counts["MLP width"] = c.intermediate_size
    bad = [f"{name} ({n})" for name, n in counts.items() if n % world]
    if bad:
        raise ValueError(f"tp={world} does not divide the model's {', '.join(bad)}; use a tp "
                         f"that divides them (the model has {' and '.join(heads)})")


def shard_plan(c: HybridConfig, name: str, shard: TPShard) -> Plan | None:
    """The slice of tensor ``name`` that ``shard`` holds, or None when it is replicated."""
    if shard.world == 1:
        return None
    hd, Hq, Hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    rows = lambda *ranges: (0, tuple(ranges))          # noqa: E731
    cols = lambda *ranges: (1, tuple(ranges))          # noqa: E731
    if name.endswith(("embed_tokens.weight",)) or name == "lm_head.weight":
        return rows(shard.part(c.vocab_size))
    kind = _linear_kind(c, name)
    if kind is not None:           # the type's own tensors; its layer's norms and MLP below
        plan = linear_attention_type(kind).shard_plan(c, dict(c.linear_attention)[kind], name,
                                                      shard)
        if plan is not None:
            return plan
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return rows(shard.part(Hq, 2 * hd))
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                      "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
        return rows(shard.part(Hkv, hd))
    if name.endswith("self_attn.o_proj.weight"):
        return cols(shard.part(Hq, hd))
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


def _linear_kind(c: HybridConfig, name: str) -> str | None:
    """The linear-attention type of the decoder layer tensor ``name`` belongs to (None: not a
    linear-attention layer's)."""
    layers = f"{c.weight_prefix}layers."
    if not name.startswith(layers):
        return None
    kind = c.layer_types[int(name[len(layers):].split(".", 1)[0])]
    return kind if kind in dict(c.linear_attention) else None


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

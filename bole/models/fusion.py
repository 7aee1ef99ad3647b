"""Projections that read the same input, fused into one weight at load time, so that a forward
runs one product instead of several.

Unquantized parts are concatenated into one tensor (the parts become row views of it, no second
copy is kept). FP8 parts (:class:`~bole.ops.fp8.Fp8Weight`) are concatenated with their scales
where every part but the last fills whole row blocks. A group that mixes FP8 and unquantized
parts (Qwen's FP8 releases keep the GDN's b / a projections and the MoE router in bf16) becomes
a :class:`~bole.ops.fp8.StackedWeight` of its runs of one kind: still one call, one output.
"""

from __future__ import annotations

import torch

from bole.models.layers.registry import LINEAR_ATTENTION_TYPES
from bole.models.moe_layer import MOE_IN_PROJ
from bole.ops.fp8 import Fp8Weight, StackedWeight

__all__ = ["FUSED_GROUPS", "fuse_projections"]

#: (fused name, parts) per layer prefix: projections that read the same input (the
#: linear-attention types' own first, :attr:`~bole.models.layers.base.LinearAttention.fused_groups`).
FUSED_GROUPS = {
    **{name: parts for t in LINEAR_ATTENTION_TYPES.values()
       for name, parts in t.fused_groups.items()},
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    # router logits, the shared expert's gate, then its gate / up projections (a shared expert
    # of another width than the experts'; the others are merged, bole.models.moe_layer)
    "mlp." + MOE_IN_PROJ: ("mlp.gate.weight", "mlp.shared_expert_gate.weight",
                           "mlp.shared_expert.gate_proj.weight",
                           "mlp.shared_expert.up_proj.weight"),
}


def _runs(parts: list) -> list[list]:
    """Consecutive parts that one FP8 or one unquantized concatenation can hold."""
    runs: list[list] = []
    for p in parts:
        last = runs[-1] if runs else None
        same = last is not None and isinstance(p, Fp8Weight) == isinstance(last[0], Fp8Weight)
        if same and isinstance(p, Fp8Weight):
            same = p.block == last[0].block and all(q.shape[0] % p.block[0] == 0 for q in last)
        if same:
            last.append(p)
        else:
            runs.append([p])
    return runs


def _fuse(w: dict, names: list[str], fused_name: str) -> None:
    runs = _runs([w[n] for n in names])
    wholes = []
    row_views = []
    for run in runs:
        if isinstance(run[0], Fp8Weight):
            whole = run[0] if len(run) == 1 else Fp8Weight.cat(run)
            view = whole.rows
        else:
            whole = run[0] if len(run) == 1 else torch.cat(run)
            view = lambda a, b, whole=whole: whole[a:b]          # noqa: E731
        wholes.append(whole)
        row = 0
        for p in run:
            row_views.append(view(row, row + p.shape[0]))
            row += p.shape[0]
    w[fused_name] = wholes[0] if len(wholes) == 1 else StackedWeight(wholes)
    for n, v in zip(names, row_views):
        w[n] = v


def fuse_projections(w: dict) -> None:
    """Fuse every group of :data:`FUSED_GROUPS` present in ``w`` (by layer prefix), in place."""
    prefixes = {name[: name.index(part)] for name in w
                for parts in FUSED_GROUPS.values() for part in parts if name.endswith(part)}
    for prefix in sorted(prefixes):
        for fused_name, parts in FUSED_GROUPS.items():
            names = [prefix + p for p in parts]
            if prefix + fused_name in w or not all(n in w for n in names):
                continue
            _fuse(w, names, prefix + fused_name)

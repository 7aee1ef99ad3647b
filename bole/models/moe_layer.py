"""The mixture-of-experts MLP of Qwen3.5-MoE / Qwen3-Next: its weights in the layout the fused
kernels read (:mod:`bole.ops.moe`), its routing and its forward.

Weights of one MoE layer (prefix ``...mlp.``), prepared once at load:

    experts        per-expert tensors stacked into ``experts.gate_up_proj [E, 2F, H]`` (gate
                   rows, then up rows) and ``experts.down_proj [E, H, F]``
    shared expert  when its width is the experts' (every published Qwen MoE hybrid), it becomes
                   expert E of ``experts.all_gate_up_proj [E + 1, 2F, H]`` /
                   ``experts.all_down_proj [E + 1, H, F]`` (the routed experts' tensors are
                   views of these), and the router and the shared expert's gate one product
                   ``router_proj [E + 1, H]``: routing gives every token slot k = (expert E,
                   sigmoid(gate)), so one pair of kernels computes the routed experts and the
                   gated shared expert, and sums them, in one pass
    otherwise      the router, the shared gate and the shared gate / up projections are one
                   product ``moe_in_proj`` and the shared expert runs beside the kernels
"""

from __future__ import annotations

import torch

from bole.models.config import HybridConfig
from bole.models.weights import FUSED_DOWN, FUSED_GATE_UP
from bole.ops import fused
from bole.ops.fp8 import Fp8Weight
from bole.ops.linear import linear
from bole.ops.moe import fused_moe, route

__all__ = ["stack_experts", "merge_shared_experts", "expert_weights", "moe_routing",
           "moe_forward", "ALL_GATE_UP", "ALL_DOWN", "ROUTER", "MOE_IN_PROJ"]

#: the routed experts and the shared expert as expert E (under ``...mlp.``)
ALL_GATE_UP = "experts.all_gate_up_proj"
ALL_DOWN = "experts.all_down_proj"
#: router rows, then the shared expert's gate row
ROUTER = "router_proj.weight"
#: router rows, the shared expert's gate row, then its gate / up rows (widths that differ)
MOE_IN_PROJ = "moe_in_proj.weight"
_SHARED = ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
           "shared_expert.down_proj.weight")


def _cat_rows(parts: list) -> torch.Tensor | Fp8Weight:
    """Row-wise concatenation of tensors, or of FP8 weights (whole row blocks but the last)."""
    if isinstance(parts[0], Fp8Weight):
        if not all(isinstance(p, Fp8Weight) for p in parts):
            raise ValueError("an MoE layer's expert tensors must be all FP8 or all unquantized")
        return Fp8Weight.cat(parts)
    return torch.cat(parts, -2)


def _stack(parts: list) -> torch.Tensor | Fp8Weight:
    """[E, ...] from E equal-shaped tensors or FP8 weights."""
    if isinstance(parts[0], Fp8Weight):
        return Fp8Weight(torch.stack([p.q for p in parts]), torch.stack([p.scale for p in parts]),
                         parts[0].block)
    return torch.stack(parts)


def _append(stacked: torch.Tensor | Fp8Weight, one) -> torch.Tensor | Fp8Weight:
    """[E + 1, ...]: the E experts of ``stacked`` and then ``one``."""
    if isinstance(stacked, Fp8Weight):
        return Fp8Weight(torch.cat([stacked.q, one.q[None]]),
                         torch.cat([stacked.scale, one.scale[None]]), stacked.block)
    return torch.cat([stacked, one[None]])


def _head(w: torch.Tensor | Fp8Weight, n: int) -> torch.Tensor | Fp8Weight:
    """The first ``n`` experts as a view."""
    return Fp8Weight(w.q[:n], w.scale[:n], w.block) if isinstance(w, Fp8Weight) else w[:n]


def stack_experts(w: dict, num_experts: int) -> None:
    """Per-expert MoE tensors (``mlp.experts.{e}.gate_proj.weight`` ...) into the fused
    ``mlp.experts.gate_up_proj [E, 2F, H]`` and ``mlp.experts.down_proj [E, H, F]``, in place
    (FP8 weights with their scales alike); the per-expert entries are dropped (fused
    checkpoints arrive stacked already)."""
    suffix = "experts.0.gate_proj.weight"
    prefixes = sorted(n[: -len(suffix)] for n in w if n.endswith("mlp." + suffix))
    E = num_experts
    for p in prefixes:
        names = [f"{p}experts.{e}.{proj}.weight" for e in range(E)
                 for proj in ("gate_proj", "up_proj", "down_proj")]
        missing = [n for n in names if n not in w]
        if missing:
            raise ValueError(f"MoE layer {p[:-1]} lacks {len(missing)} expert tensors "
                             f"(first: {missing[0]}); a MoE layer needs all {E} experts")
        try:
            w13 = _stack([_cat_rows([w.pop(names[3 * e]), w.pop(names[3 * e + 1])])
                          for e in range(E)])
        except ValueError as exc:
            raise ValueError(f"MoE layer {p[:-1]}: {exc}") from None
        w2 = _stack([w.pop(names[3 * e + 2]) for e in range(E)])
        w[p + FUSED_GATE_UP], w[p + FUSED_DOWN] = w13, w2


def merge_shared_experts(w: dict) -> None:
    """In place, for every MoE layer whose gated shared expert is as wide as its experts (and
    stored alike, FP8 or not): the shared expert as expert E of ``experts.all_*`` and the router
    with the shared gate as ``router_proj`` (module docstring); the stacked experts and the
    router become views, the shared expert's own tensors are dropped. One layer's experts are
    copied at a time."""
    for p in sorted(n[: -len(FUSED_GATE_UP)] for n in w if n.endswith("mlp." + FUSED_GATE_UP)):
        if not all(p + s in w for s in _SHARED) or p + "shared_expert_gate.weight" not in w:
            continue
        w13, w2 = w[p + FUSED_GATE_UP], w[p + FUSED_DOWN]
        E, F2, _ = w13.shape
        shared = [w[p + s] for s in _SHARED]
        fp8 = isinstance(w13, Fp8Weight)
        if shared[0].shape[0] != F2 // 2 or any(isinstance(t, Fp8Weight) != fp8 for t in shared):
            continue
        if fp8 and (F2 // 2) % w13.block[0]:
            continue                                   # gate / up rows would split a block
        for s in _SHARED:
            del w[p + s]
        all13, all2 = _append(w13, _cat_rows(shared[:2])), _append(w2, shared[2])
        w[p + ALL_GATE_UP], w[p + ALL_DOWN] = all13, all2
        w[p + FUSED_GATE_UP], w[p + FUSED_DOWN] = _head(all13, E), _head(all2, E)
        router = torch.cat([w[p + "gate.weight"], w.pop(p + "shared_expert_gate.weight")])
        w[p + ROUTER], w[p + "gate.weight"] = router, router[:E]


def expert_weights(w: dict[str, torch.Tensor], p: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13, w2)`` the kernels read for MoE layer ``p``: [E(+1), 2F, H] and [E(+1), H, F],
    with the shared expert as the last expert where it was merged."""
    if p + ALL_GATE_UP in w:
        return w[p + ALL_GATE_UP], w[p + ALL_DOWN]
    return w[p + FUSED_GATE_UP], w[p + FUSED_DOWN]


def moe_routing(w: dict[str, torch.Tensor], p: str, x: torch.Tensor, config: HybridConfig,
                impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(topk_weights [N, k'] fp32, topk_ids [N, k'] int32, shared [N, H] or None)`` of MoE
    layer ``p`` for x [N, H]: k' = k + 1 with the shared expert merged (its slot last, id E),
    else k and the gated shared expert's output apart (None without a shared expert)."""
    k, norm = config.num_experts_per_tok, config.norm_topk_prob
    router = w.get(p + ROUTER)
    if router is not None:
        weights, ids = route(linear(x, router), k, norm, impl=impl, shared=True)
        return weights, ids, None
    E = config.num_experts
    joint = w.get(p + MOE_IN_PROJ)
    shared = None
    if joint is not None:
        logits, s_gate, gate_up = torch.split(linear(x, joint),
                                              [E, 1, joint.shape[0] - E - 1], dim=-1)
        shared = torch.sigmoid(s_gate) * linear(fused.silu_mul(gate_up),
                                                w[p + "shared_expert.down_proj.weight"])
    else:
        logits = linear(x, w[p + "gate.weight"])
    weights, ids = route(logits, k, norm, impl=impl)
    return weights, ids, shared


def moe_forward(w: dict[str, torch.Tensor], p: str, x: torch.Tensor, routing, impl: str
                ) -> torch.Tensor:
    """MoE layer ``p`` on x [N, H] given its ``routing`` (:func:`moe_routing`'s triple):
    the fused kernels (``impl="triton"``, no host sync) or the torch loop ("torch")."""
    weights, ids, shared = routing
    w13, w2 = expert_weights(w, p)
    y = fused_moe(x, w13, w2, weights, ids, impl=impl)
    return y if shared is None else y + shared

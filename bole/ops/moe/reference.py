"""The mixture of experts as a torch loop over the experts used: the oracle of the fused kernel.

It reads the routing back to the host (``torch.unique(...).tolist()``), so it cannot run inside a
CUDA graph; it follows transformers' Qwen3.5-MoE / Qwen3-Next expert loop operation by operation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bole.ops.fp8 import Fp8Weight


def _expert(w, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s weight in ``dtype`` (an FP8 one dequantized)."""
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.q[e], w.scale[e], w.block).dequantize(dtype)
    return w[e]


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``, e =
    ``topk_ids[t, j]``.

    x [T, H]; w13 [E, 2F, H] (gate rows, then up rows); w2 [E, H, F]; topk_weights [T, k];
    topk_ids [T, k]; FP8 experts (:class:`~bole.ops.fp8.Fp8Weight`) are dequantized into x's
    dtype one expert at a time. Returns [T, H] in x's dtype (each expert's weighted output is
    cast to it before the sum, as transformers does).
    """
    F_ = w2.shape[2]
    y = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == e)
        gate, up = F.linear(x[tok], _expert(w13, e, x.dtype)).split(F_, dim=-1)
        out = F.linear(F.silu(gate) * up, _expert(w2, e, x.dtype)) \
            * topk_weights[tok, slot, None].to(x.dtype)
        y.index_add_(0, tok, out.to(y.dtype))
    return y

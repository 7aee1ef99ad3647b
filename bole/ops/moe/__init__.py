"""Mixture-of-experts kernels: device routing, expert alignment and grouped GEMMs.

    route(logits [T, E], top_k, renormalize, impl) -> (weights [T, k] fp32, ids [T, k] int32)
        (shared=True: logits [T, E + 1], the shared expert's gate last; slot k = expert E)
    align_blocks(ids [T, k], num_experts, block_m, impl) -> BlockAlignment (pairs by expert)
    fused_moe(x [T, H], w13 [E, 2F, H], w2 [E, H, F], weights, ids, impl) -> y [T, H]
        (grouped GEMMs over the aligned blocks, or for a few tokens moe_gemv's two
        matrix-vector kernels)
    moe_reference(...)                             the torch loop over experts (the oracle)

Every size is a function of T, k, E and the block size, never of the routing, so a fused MoE
forward makes no host sync and captures in a CUDA graph.
"""

from bole.ops.moe.gemv import GemvConfig, moe_gemv
from bole.ops.moe.grouped_gemm import GEMV_MAX_PAIRS, MoEConfig, fused_moe, pick_moe_config
from bole.ops.moe.reference import moe_reference
from bole.ops.moe.routing import BlockAlignment, align_blocks, max_blocks, route

__all__ = ["route", "align_blocks", "max_blocks", "BlockAlignment", "fused_moe", "MoEConfig",
           "GemvConfig", "moe_gemv", "GEMV_MAX_PAIRS", "pick_moe_config", "moe_reference"]

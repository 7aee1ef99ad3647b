"""The fused mixture of experts: two grouped GEMMs over blocks of (token, slot) pairs sorted by
expert (:func:`bole.ops.moe.routing.align_blocks`).

    gate/up   h[p] = silu(x[t] @ w13[e, :F].T) * (x[t] @ w13[e, F:].T)     p = t k + j, [T k, F]
    down      o[p] = topk_weight[p] * (h[p] @ w2[e].T)                        [T k, H], fp32
    sum       y[t] = sum_j o[t k + j]                                         [T, H]

One program computes a ``BLOCK_M x BLOCK_N`` tile of one block (all its rows share the expert, so
the tile reads one expert's weights); gate and up accumulate side by side and SiLU-and-mul runs on
the accumulators, so the [T k, 2F] gate/up product is never stored. Unused blocks and padding rows
are skipped. The launch grid depends on T, k, E and the block sizes only: no host sync, and the
forward captures in a CUDA graph. Accumulation is fp32; fp32 inputs use IEEE products (no TF32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bole.ops.fp8 import Fp8Weight
from bole.ops.moe.gemv import GemvConfig, expert_operands, moe_gemv
from bole.ops.moe.reference import moe_reference
from bole.ops.moe.routing import align_blocks
from bole.ops.triton_utils import check_kernel_device, fix_interpreter_scalar_index, interpreting

__all__ = ["fused_moe", "MoEConfig", "pick_moe_config", "GEMV_MAX_PAIRS"]

fix_interpreter_scalar_index()


@dataclass(frozen=True)
class MoEConfig:
    """Tile sizes of the grouped GEMMs (powers of two, at least 16 for ``tl.dot``) and the
    implementation of the block alignment ("triton": one launch; "torch": about twenty).
    ``down``: the down GEMM's own tiles (its ``block_m`` must equal this one's, since both read
    one alignment); None: the gate/up tiles."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    align_impl: str = "triton"
    down: MoEConfig | None = None

    def __post_init__(self):
        if self.down is not None and self.down.block_m != self.block_m:
            raise ValueError(f"MoEConfig: the down GEMM's block_m ({self.down.block_m}) must equal "
                             f"the gate/up GEMM's ({self.block_m}): both read one alignment")


#: at most this many routed pairs, a CUDA forward takes the matrix-vector kernels
#: (:mod:`bole.ops.moe.gemv`): up to 8 tokens of a top-8 model with its shared expert, where
#: they beat the grouped GEMMs on the H200 at every count measured (1-8 tokens)
GEMV_MAX_PAIRS = 72


def pick_moe_config(num_pairs: int, num_experts: int, device: torch.device
                    ) -> MoEConfig | GemvConfig:
    """Kernels and tiles for ``num_pairs`` routed pairs, from bench/tuning/moe_configs.py on an
    H200 (Qwen3.5-35B-A3B's layer, H 2048, F 512, 256 experts, top 8): up to
    :data:`GEMV_MAX_PAIRS` pairs the matrix-vector kernels; then 16-row blocks with narrow,
    deep tiles while experts see few rows each (decode, verify; more programs stream the
    experts' weights), 64-row blocks for long prefill chunks; small tiles under the
    interpreter."""
    if device.type != "cuda":
        return MoEConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
    if num_pairs <= GEMV_MAX_PAIRS:
        return GemvConfig()
    rows_per_expert = num_pairs / max(num_experts, 1)
    if rows_per_expert >= 32:
        return MoEConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
    if num_pairs <= 64:
        tiles = dict(block_n=32, block_k=256, num_warps=4)
        down = dict(block_n=128, block_k=64, num_warps=4)
    elif rows_per_expert < 4:
        tiles = dict(block_n=32, block_k=128, num_warps=4)
        down = dict(block_n=64, block_k=128, num_warps=8)
    else:
        tiles = dict(block_n=64, block_k=128, num_warps=4)
        down = dict(block_n=64, block_k=128, num_warps=4)
    return MoEConfig(block_m=16, num_stages=3, **tiles,
                     down=MoEConfig(block_m=16, num_stages=3, **down))


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, s_ptr, c_ptr, w_ptr, sorted_pairs, block_expert,
                         NUM_PAIRS, NUM_EXPERTS, N, K,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk,
                         stride_se, stride_sn, stride_cm, stride_cn,
                         TOP_K: tl.constexpr, GATHER_TOKENS: tl.constexpr,
                         SILU_MUL: tl.constexpr, WEIGHTED: tl.constexpr,
                         FP8: tl.constexpr, QBN: tl.constexpr, QBK: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[p, n] = (silu-mul of) a[row(p)] @ b[e, n(, N + n)].T (times w[p]) for the pairs p of
    block ``program_id(0)``; row(p) = p // TOP_K when GATHER_TOKENS, else p. FP8: b holds e4m3
    values with scales s[e, row // QBN, k // QBK], each K step inside one scale block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert + pid_m)
    if e < NUM_EXPERTS:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pairs + offs_m)
        row_ok = pair < NUM_PAIRS
        if GATHER_TOKENS:
            a_row = pair // TOP_K
        else:
            a_row = pair
        a_row = tl.where(row_ok, a_row, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = (b_ptr + e.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
                  + offs_k[:, None] * stride_bk)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        s_rows = s_ptr + e.to(tl.int64) * stride_se + (offs_n // QBN) * stride_sn
        s_up = s_ptr + e.to(tl.int64) * stride_se + ((N + offs_n) // QBN) * stride_sn
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8:
                sc = tl.load(s_rows + k0 // QBK, mask=n_ok, other=0.0)
                b = (b.to(tl.float32) * sc[None, :]).to(a.dtype)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if SILU_MUL:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :],
                               other=0.0)
                if FP8:
                    sc_up = tl.load(s_up + k0 // QBK, mask=n_ok, other=0.0)
                    b_up = (b_up.to(tl.float32) * sc_up[None, :]).to(a.dtype)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if SILU_MUL:
            acc = acc * tl.sigmoid(acc) * acc_up
        if WEIGHTED:
            w = tl.load(w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        c_ptrs = (c_ptr + pair[:, None].to(tl.int64) * stride_cm
                  + offs_n[None, :] * stride_cn)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _launch(a, b, c, weights, align, n: int, k: int, *, gather: bool, silu_mul: bool,
            weighted: bool, top_k: int, cfg: MoEConfig) -> None:
    grid = (align.num_blocks, triton.cdiv(n, cfg.block_n))
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    w = expert_operands(b)
    q = w.values
    _grouped_gemm_kernel[grid](
        a, q, w.scales, c, weights, align.sorted_pairs, align.block_expert,
        align.num_pairs, align.num_experts, n, k,
        a.stride(0), a.stride(1), q.stride(0), q.stride(1), q.stride(2),
        w.stride_se, w.stride_sn, c.stride(0), c.stride(1),
        TOP_K=top_k, GATHER_TOKENS=gather, SILU_MUL=silu_mul, WEIGHTED=weighted,
        FP8=w.fp8, QBN=w.qbn, QBK=w.qbk,
        PRECISION=precision, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=w.step(cfg.block_k), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _check(x, w13, w2, topk_weights, topk_ids) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe takes x [T, H], w13 [E, 2F, H], w2 [E, H, F]; got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    T, H = x.shape
    E, F2, H13 = w13.shape
    if H13 != H or tuple(w2.shape) != (E, H, F2 // 2) or F2 % 2:
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not "
                         f"match x [T, {H}] as [E, 2F, H] and [E, H, F]")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={T}, k]")
    fp8 = [isinstance(w, Fp8Weight) for w in (w13, w2)]
    if fp8[0] != fp8[1] or (not fp8[0] and (w13.dtype != x.dtype or w2.dtype != x.dtype)):
        raise ValueError(f"fused_moe: w13 and w2 must both be FP8 weights or share x's dtype, "
                         f"got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if fp8[0]:
        qbk = w13.block[1]
        if w13.block != w2.block or qbk < 16 or qbk & (qbk - 1):
            raise ValueError(f"fused_moe: FP8 experts need one block size whose width is a "
                             f"power of two >= 16, got blocks {w13.block} and {w2.block}")
    q13, q2 = (w13.q, w2.q) if fp8[0] else (w13, w2)
    if q13.stride(2) != 1 or q2.stride(2) != 1:
        raise ValueError("fused_moe: w13 and w2 need unit stride along their last dim")


def fused_moe(x: torch.Tensor, w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight,
              topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, impl: str = "auto",
              config: MoEConfig | GemvConfig | None = None) -> torch.Tensor:
    """The experts' weighted sum per token (module docstring). x [T, H]; w13 [E, 2F, H] (gate
    rows, then up rows); w2 [E, H, F] (both tensors of x's dtype, or both FP8 weights with
    block scales, :class:`~bole.ops.fp8.Fp8Weight`); topk_weights [T, k]; topk_ids [T, k].
    Returns [T, H] in x's dtype. ``impl``: "triton" (the kernels; CUDA, or CPU under
    TRITON_INTERPRET=1), "torch" (:func:`moe_reference`), "auto" (triton on CUDA).
    ``config``: a :class:`MoEConfig` (the grouped GEMMs), a :class:`GemvConfig` (the
    matrix-vector kernels) or None (:func:`pick_moe_config`)."""
    _check(x, w13, w2, topk_weights, topk_ids)
    if impl == "auto":
        impl = "triton" if x.device.type == "cuda" else "torch"
    if impl == "torch":
        return moe_reference(x, w13, w2, topk_weights, topk_ids)
    if impl != "triton":
        raise ValueError(f"fused_moe impl must be 'triton', 'torch' or 'auto', got {impl!r}")
    check_kernel_device(x.device, "fused_moe")
    T, H = x.shape
    E, F2, _ = w13.shape
    F_, k = F2 // 2, topk_ids.shape[1]
    num_pairs = T * k
    cfg = config or pick_moe_config(num_pairs, E, x.device)
    if isinstance(cfg, GemvConfig):
        return moe_gemv(x, w13, w2, topk_weights, topk_ids, cfg)
    align = align_blocks(topk_ids, E, cfg.block_m, impl=cfg.align_impl)
    x = x if x.stride(1) == 1 else x.contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    h = torch.empty(num_pairs, F_, dtype=x.dtype, device=x.device)
    _launch(x, w13, h, weights, align, F_, H, gather=True, silu_mul=True, weighted=False,
            top_k=k, cfg=cfg)
    out = torch.empty(num_pairs, H, dtype=torch.float32, device=x.device)
    _launch(h, w2, out, weights, align, H, F_, gather=False, silu_mul=False, weighted=True,
            top_k=k, cfg=cfg.down or cfg)
    return out.view(T, k, H).sum(dim=1).to(x.dtype)

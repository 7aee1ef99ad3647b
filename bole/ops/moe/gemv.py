"""The mixture of experts for a few tokens: two matrix-vector kernels, no block alignment.

    gate/up   h[p] = silu(w13[e, :F] x[t]) * (w13[e, F:] x[t])     p = t k + j, e = ids[p]
    down+sum  y[t] = sum_j weight[t k + j] * (w2[e_j] h[t k + j])    in fp32, j in slot order

With one or a few tokens every expert serves about one pair, so the grouped GEMM's 16-row blocks
would hold one real row each. Here each program streams one expert's weight tile and multiplies
it with one vector: the gate/up kernel runs a program per (pair, column tile), the down kernel a
program per (token, column tile) that adds its token's k slots in order, so the [T k, H] partial
outputs are never stored and the sum is deterministic. Sizes depend on T, k and the tiles only:
no host sync, CUDA-graph safe. Products accumulate in fp32 (fp32 inputs are multiplied in fp32,
no TF32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from bole.ops.fp8 import Fp8Weight
from bole.ops.triton_utils import fix_interpreter_scalar_index

__all__ = ["GemvConfig", "moe_gemv", "launch_gate_up", "launch_down_sum"]

fix_interpreter_scalar_index()


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the two kernels: ``block_n`` output columns a program, ``block_k`` of the
    reduced dimension a step (powers of two); warps and pipeline stages."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    down_block_n: int = 8
    down_block_k: int = 512
    down_num_warps: int = 4


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, F, H, stride_xt, stride_we, stride_wn,
                    stride_se, stride_sn, stride_hp, TOP_K: tl.constexpr, FP8: tl.constexpr,
                    QBN: tl.constexpr, QBK: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """h[p, n] = silu(gate_n . x[t]) * (up_n . x[t]) for pair ``program_id(0)``'s expert (FP8:
    e4m3 rows times their scales s[e, row // QBN, k // QBK], each K step inside one block)."""
    p = tl.program_id(0)
    t = p // TOP_K
    e = tl.load(ids_ptr + p).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < F
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    s_gate = s_ptr + e * stride_se + (offs_n // QBN) * stride_sn
    s_up = s_ptr + e * stride_se + ((F + offs_n) // QBN) * stride_sn
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = k0 + offs_k < H
        xv = tl.load(x_ptr + t * stride_xt + k0 + offs_k, mask=k_ok, other=0.0)
        m = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(rows + k0 + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(rows + F * stride_wn + k0 + offs_k[None, :], mask=m, other=0.0)
        wu = wu.to(tl.float32)
        if FP8:   # the dequantized weight's values: q * scale rounded to x's dtype
            sg = tl.load(s_gate + k0 // QBK, mask=n_ok, other=0.0)
            su = tl.load(s_up + k0 // QBK, mask=n_ok, other=0.0)
            wg = (wg * sg[:, None]).to(xv.dtype).to(tl.float32)
            wu = (wu * su[:, None]).to(xv.dtype).to(tl.float32)
        xf = xv.to(tl.float32)
        acc_g += tl.sum(wg * xf[None, :], 1)
        acc_u += tl.sum(wu * xf[None, :], 1)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + p * stride_hp + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_sum_kernel(h_ptr, w_ptr, s_ptr, ids_ptr, wt_ptr, y_ptr, H, F, stride_hp, stride_we,
                     stride_wn, stride_se, stride_sn, stride_yt, TOP_K: tl.constexpr,
                     FP8: tl.constexpr, QBN: tl.constexpr, QBK: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[t, n] = sum_j weight[p_j] (w2[e_j, n] . h[p_j]) for token ``program_id(0)``."""
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(TOP_K):
        p = t * TOP_K + j
        e = tl.load(ids_ptr + p).to(tl.int64)
        wt = tl.load(wt_ptr + p).to(tl.float32)
        rows = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        s_rows = s_ptr + e * stride_se + (offs_n // QBN) * stride_sn
        part = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            k_ok = k0 + offs_k < F
            hv = tl.load(h_ptr + p * stride_hp + k0 + offs_k, mask=k_ok, other=0.0)
            wv = tl.load(rows + k0 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                         other=0.0).to(tl.float32)
            if FP8:
                sc = tl.load(s_rows + k0 // QBK, mask=n_ok, other=0.0)
                wv = (wv * sc[:, None]).to(hv.dtype).to(tl.float32)
            part += tl.sum(wv * hv.to(tl.float32)[None, :], 1)
        acc += wt * part
    tl.store(y_ptr + t * stride_yt + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


class ExpertOperands(NamedTuple):
    """What an expert kernel reads of stacked experts: values (the FP8 ones, or the tensor
    itself), scales (the tensor again where there are none, never read), whether FP8, the
    scale block (QBN, QBK) and the scales' expert and row strides."""

    values: torch.Tensor
    scales: torch.Tensor
    fp8: bool
    qbn: int
    qbk: int
    stride_se: int
    stride_sn: int

    def step(self, block_k: int) -> int:
        """A kernel's K step: FP8 steps stay inside one scale block."""
        return min(block_k, self.qbk) if self.fp8 else block_k


def expert_operands(w: torch.Tensor | Fp8Weight) -> ExpertOperands:
    """:class:`ExpertOperands` of an expert tensor or FP8 weight."""
    if isinstance(w, Fp8Weight):
        return ExpertOperands(w.q, w.scale, True, *w.block, w.scale.stride(0),
                              w.scale.stride(1))
    return ExpertOperands(w, w, False, 1, 1, 0, 0)


def launch_gate_up(x: torch.Tensor, w13, ids: torch.Tensor, h: torch.Tensor, top_k: int,
                   block_n: int, block_k: int, num_warps: int, num_stages: int) -> None:
    """The gate/up kernel into ``h [T k, F]`` for flat ``ids [T k]`` (tiles given)."""
    w = expert_operands(w13)
    F_, H = w.values.shape[1] // 2, x.shape[1]
    _gate_up_kernel[(h.shape[0], triton.cdiv(F_, block_n))](
        x, w.values, w.scales, ids, h, F_, H, x.stride(0), w.values.stride(0),
        w.values.stride(1), w.stride_se, w.stride_sn, h.stride(0), TOP_K=top_k, FP8=w.fp8,
        QBN=w.qbn, QBK=w.qbk, BLOCK_N=block_n, BLOCK_K=w.step(block_k), num_warps=num_warps,
        num_stages=num_stages)


def launch_down_sum(h: torch.Tensor, w2, ids: torch.Tensor, weights: torch.Tensor,
                    y: torch.Tensor, top_k: int, block_n: int, block_k: int, num_warps: int,
                    num_stages: int) -> None:
    """The down-and-sum kernel into ``y [T, H]`` (tiles given)."""
    w = expert_operands(w2)
    H, F_ = w.values.shape[1], w.values.shape[2]
    _down_sum_kernel[(y.shape[0], triton.cdiv(H, block_n))](
        h, w.values, w.scales, ids, weights, y, H, F_, h.stride(0), w.values.stride(0),
        w.values.stride(1), w.stride_se, w.stride_sn, y.stride(0), TOP_K=top_k, FP8=w.fp8,
        QBN=w.qbn, QBK=w.qbk, BLOCK_N=block_n, BLOCK_K=w.step(block_k), num_warps=num_warps,
        num_stages=num_stages)


def moe_gemv(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             config: GemvConfig | None = None) -> torch.Tensor:
    """The experts' weighted sum per token (module docstring), checked inputs as
    :func:`bole.ops.moe.fused_moe` takes them: x [T, H], w13 [E, 2F, H], w2 [E, H, F] (tensors
    of x's dtype, or FP8 weights), topk_weights / topk_ids [T, k]. Returns [T, H] in x's
    dtype."""
    cfg = config or GemvConfig()
    T, H = x.shape
    F_, k = w2.shape[2], topk_ids.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    wts = topk_weights.reshape(-1).contiguous()
    h = torch.empty(T * k, F_, dtype=x.dtype, device=x.device)
    y = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    launch_gate_up(x, w13, ids, h, k, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
    launch_down_sum(h, w2, ids, wts, y, k, cfg.down_block_n, cfg.down_block_k,
                    cfg.down_num_warps, cfg.num_stages)
    return y

"""``y = x @ w.T`` with ``w`` held in FP8 with block scales, read as FP8.

At decode and verify widths (at most :data:`KERNEL_ROWS` rows) one program computes
``BLOCK_N`` (32) output columns of up to 64 rows of x: it streams its FP8 rows in
``[BLOCK_N, BLOCK_K]`` tiles, each step inside one scale block along K (``BLOCK_K`` divides the
block's width), dequantizes the tile in fp32 with the step's per-row scales, rounds it to x's
dtype (the dequantized weight's own values) and multiplies with tensor cores, the rows of x
padded to 16. Bytes read: one per weight and 64 rows, against two in bf16. Wider inputs
(prefill chunks) dequantize the weight into x's dtype (:func:`dequantize`, one pass) and run
cuBLAS: the product then costs its compute, not its read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bole.ops.fp8.blockwise import Fp8Weight, StackedWeight
from bole.ops.triton_utils import fix_interpreter_scalar_index, interpreting

__all__ = ["fp8_linear", "stacked_linear", "dequantize", "Fp8Tiles", "KERNEL_ROWS"]

fix_interpreter_scalar_index()

#: the most rows the kernel takes (more: dequantize, then cuBLAS); a program takes up to
#: ``ROW_TILE`` of them, so the kernel reads each weight byte once per 64 rows, where
#: dequantizing and cuBLAS move about five bytes a weight whatever the rows (untuned)
KERNEL_ROWS = 256
ROW_TILE = 64


@dataclass(frozen=True)
class Fp8Tiles:
    """One launch of the kernel: output columns and K elements a step (the step must stay in
    one scale block: ``block_k`` divides the block's width), warps, pipeline stages."""

    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _fp8_linear_kernel(x, q, s, bias, y, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                       QBN: tl.constexpr, QBK: tl.constexpr, HAS_BIAS: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    n_ok = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        xt = tl.load(x + m[:, None] * stride_xm + k[None, :], mask=(m < M)[:, None] & k_ok[None, :],
                     other=0.0)
        wt = tl.load(q + n[:, None].to(tl.int64) * stride_qn + k[None, :],
                     mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        st = tl.load(s + (n // QBN) * stride_sn + k0 // QBK, mask=n_ok, other=0.0)
        wd = (wt.to(tl.float32) * st[:, None]).to(xt.dtype)
        acc = tl.dot(xt, tl.trans(wd), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y + m[:, None] * stride_ym + n[None, :], acc.to(y.dtype.element_ty),
             mask=(m < M)[:, None] & n_ok[None, :])


@triton.jit
def _dequantize_kernel(q, s, w, N, K, stride_qn, stride_sn, stride_wn, QBN: tl.constexpr,
                       QBK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w[n, k] = q[n, k] * s[n // QBN, k // QBK] in fp32, rounded once to w's dtype."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (n < N)[:, None] & (k < K)[None, :]
    qt = tl.load(q + n[:, None].to(tl.int64) * stride_qn + k[None, :], mask=ok, other=0.0)
    st = tl.load(s + (n // QBN)[:, None] * stride_sn + (k // QBK)[None, :], mask=ok, other=0.0)
    tl.store(w + n[:, None].to(tl.int64) * stride_wn + k[None, :],
             (qt.to(tl.float32) * st).to(w.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=ok)


def dequantize(w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """:meth:`Fp8Weight.dequantize` of a 2-D weight in one pass (one byte read and two written a
    weight, where the torch expression moves about fifteen): its values exactly (the same fp32
    product, rounded once). CUDA or the interpreter; otherwise the torch expression."""
    if w.dim() != 2 or not (w.device.type == "cuda" or interpreting()) or \
            w.q.stride(-1) != 1 or w.scale.stride(-1) != 1:
        return w.dequantize(dtype)
    N, K = w.shape
    out = torch.empty(N, K, dtype=dtype, device=w.device)
    if N and K:
        bn, bk = 32, 128
        _dequantize_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
            w.q, w.scale, out, N, K, w.q.stride(0), w.scale.stride(0), out.stride(0),
            QBN=w.block[0], QBK=w.block[1], BLOCK_N=bn, BLOCK_K=bk)
    return out


def _kernel_tiles(w: Fp8Weight, tiles: Fp8Tiles | None = None) -> Fp8Tiles | None:
    """The launch for ``w``'s blocks (``tiles``, default :class:`Fp8Tiles`'s: 32 columns a
    program, since at decode the weight's read is the cost and narrow programs keep every SM
    streaming; untuned on a GPU yet, ``bench/linear.py --fp8`` sweeps them), or None where
    the kernel cannot step inside one scale block (a block width that is not a power of two
    of at least 16)."""
    bk = w.block[1]
    if bk < 16 or bk & (bk - 1):
        return None
    tiles = tiles or Fp8Tiles()
    if bk % tiles.block_k:
        tiles = Fp8Tiles(tiles.block_n, min(bk, tiles.block_k), tiles.num_warps,
                         tiles.num_stages)
    return tiles


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None, kernel: bool | None = None,
               tiles: Fp8Tiles | None = None) -> torch.Tensor:
    """``x [..., K] @ dequantize(w).T (+ bias)`` in x's dtype. ``kernel``: the FP8 kernel (CUDA,
    or the interpreter on CPU), default where it applies (at most :data:`KERNEL_ROWS` rows);
    otherwise the weight is dequantized into x's dtype for ``F.linear``. ``out``: an [M, N]
    tensor of x's dtype to write into (2-D x). ``tiles``: the kernel's launch (benchmarks)."""
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"fp8_linear takes x [..., K] and a 2-D weight [N, K], got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    M, N = rows.shape[0], w.shape[0]
    tiles = _kernel_tiles(w, tiles)
    on_device = x.device.type == "cuda" or interpreting()
    if kernel is None:
        kernel = on_device and tiles is not None and M <= KERNEL_ROWS
    if not kernel:
        wd = dequantize(w, x.dtype)
        if out is None:
            return F.linear(x, wd, bias)
        return torch.mm(x, wd.t(), out=out) if bias is None else torch.addmm(bias, x, wd.t(), out=out)
    if tiles is None or M > KERNEL_ROWS:
        raise ValueError(f"the FP8 kernel takes at most {KERNEL_ROWS} rows and blocks whose width "
                         f"is a power of two >= 16; got {M} rows, block {w.block}")
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    if w.q.stride(-1) != 1 or w.scale.stride(-1) != 1:
        raise ValueError("the FP8 kernel reads q and scale with unit stride along K")
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        block_m = min(ROW_TILE, max(16, triton.next_power_of_2(M)))
        _fp8_linear_kernel[(triton.cdiv(N, tiles.block_n), triton.cdiv(M, block_m))](
            rows, w.q, w.scale, bias if bias is not None else rows, y, M, N, rows.shape[1],
            rows.stride(0), w.q.stride(0), w.scale.stride(0), y.stride(0),
            QBN=w.block[0], QBK=w.block[1], HAS_BIAS=bias is not None,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m, BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
            num_stages=1 if interpreting() else tiles.num_stages)
    return y if out is not None else y.view(*x.shape[:-1], N)


def stacked_linear(x: torch.Tensor, w: StackedWeight, linear_fn, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``[linear_fn(x, p) for p in w.parts]`` side by side, written into one ``[..., N]``
    output (``out`` when given)."""
    N = w.shape[0]
    y = out if out is not None else torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    flat = y.view(-1, N)
    rows = x.reshape(-1, x.shape[-1])
    col = 0
    for p in w.parts:
        n = p.shape[0]
        flat[:, col:col + n] = linear_fn(rows, p)
        col += n
    return y

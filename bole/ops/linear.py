"""Linear layers at decode shapes: ``y = x @ w.T (+ bias)`` for a few rows of ``x``.

At one to a few tokens a forward is a weight read: each ``[N, K]`` weight crosses the memory
bus once and every other cost is small. On the H200, cuBLAS reads the 9B preset's weights at
3.1-3.9 TB/s at one row (its LM head at 3.6); the kernel here streams each weight in
``[BLOCK_N, BLOCK_K]`` tiles through a software pipeline of ``num_stages`` loads, one program
per ``BLOCK_N`` output columns, the rows of ``x`` padded to 16 and multiplied by tensor cores
(``tl.dot``; at these shapes the products cost nothing beside the read).

:func:`linear` takes it where it is measured to win (:func:`pick_linear_config`, from
``bench/linear.py`` on the H200) and ``torch.nn.functional.linear`` everywhere else: more rows,
small weights, other devices and dtypes, strided weights. It accumulates in fp32 and rounds
once, as cuBLAS does; the sums run in another order, so results agree to rounding, not bit for
bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bole.ops.fp8 import Fp8Weight, StackedWeight, fp8_linear, stacked_linear
from bole.ops.triton_utils import check_kernel_device

__all__ = ["LinearConfig", "pick_linear_config", "linear", "linear_triton", "MAX_ROWS",
           "WIDE_ROWS", "KERNEL_ROWS"]

#: the most rows of x that :func:`linear` sends to the kernel (more go to cuBLAS: the weight
#: read is then shared by enough rows that cuBLAS's tiles are at the floor)
MAX_ROWS = 16
#: the most rows sent to the kernel for the weights where it still wins past MAX_ROWS: outputs
#: of at most 4096 columns (o_proj, the GDN out_proj, the MLP's down, the MTP's fc) and the
#: vocabulary-wide LM head
WIDE_ROWS = 32
#: the most rows :func:`linear_triton` takes (padded to a power of two of at least 16 for
#: ``tl.dot``): what ``bench/linear.py`` can time beyond MAX_ROWS
KERNEL_ROWS = 64
#: the smallest weight (elements) the kernel takes: below it a product is launch-bound and
#: cuBLAS's kernel costs the same
MIN_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class LinearConfig:
    """One launch: its tile, warps and pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _linear_kernel(x, w, bias, y, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    nm, mm = n < N, m < M
    w_rows = w + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        wt = tl.load(w_rows + k[None, :], mask=nm[:, None] & km[None, :], other=0.0,
                     eviction_policy="evict_first")
        xt = tl.load(x + m[:, None] * stride_xm + k[None, :], mask=mm[:, None] & km[None, :],
                     other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc)
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y + m[:, None] * stride_ym + n[None, :], acc.to(y.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


def pick_linear_config(M: int, N: int, K: int) -> LinearConfig | None:
    """The launch for ``M`` rows of a ``[N, K]`` weight, or None where cuBLAS is as fast.

    From ``bench/linear.py`` on the H200 (bf16, 1-16 rows,
    ``bench/results/linear-2026-12-02-qwen3.5-9b.json``): wide weights (the MLP's gate and up,
    the LM heads) stream best in 64 x 128 tiles, three stages deep; narrower ones in 32 x 256
    tiles, five stages deep where N is the hidden size (each program then runs a long K).

    At 24-32 rows (``linear-2026-12-02-qwen3.5-9b-rows.json``) the kernel still wins on narrow
    outputs (N <= 4096: 12.4 against 14.0 us for a 4096 x 4096 weight) and on the LM head (476
    against 552 us), four stages deep; cuBLAS keeps the attention qkv, the MLP's gate and up and
    the 32k draft head (the kernel 3-7% slower) and the GDN input projection (the kernel 4-8%
    faster, but no rule on N alone separates it from the qkv). The kernel's lead shrinks at 48
    rows and is gone at 64 for the narrow outputs: :data:`WIDE_ROWS` stops at 32, the rows of a
    verify of one or two requests' trees."""
    if M < 1 or K % 8 or N < 256 or N * K < MIN_ELEMENTS:
        return None
    if M > MAX_ROWS:
        if M > WIDE_ROWS or 4096 < N < 131072:
            return None
        return LinearConfig(64, 128, num_warps=4, num_stages=4) if N >= 131072 else \
            LinearConfig(32, 256, num_warps=4, num_stages=4)
    if N >= 16384:
        return LinearConfig(64, 128, num_warps=4, num_stages=3)
    return LinearConfig(32, 256, num_warps=4, num_stages=5 if N <= 8192 else 3)


def linear_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                  config: LinearConfig | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ w[N, K].T (+ bias [N])`` by this module's kernel, M at most
    :data:`KERNEL_ROWS` (``config``, default
    :func:`pick_linear_config`'s, else 32 x 256 tiles). ``x`` and ``w`` share a dtype;
    ``w`` and ``x`` have unit stride along K. Returns ``[M, N]`` in x's dtype (written into
    ``out`` when given: ``[M, N]`` of x's dtype with unit stride along N)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear takes x [M, K] and w [N, K], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if x.dtype != w.dtype or (bias is not None and (bias.shape != (w.shape[0],)
                                                    or bias.dtype != x.dtype)):
        raise ValueError(f"x ({x.dtype}), w ({w.dtype}) and bias "
                         f"({None if bias is None else (bias.dtype, tuple(bias.shape))}) must "
                         f"share a dtype, the bias of shape [N]")
    if x.stride(1) != 1 or w.stride(1) != 1 or (bias is not None and bias.stride(0) != 1):
        raise ValueError("linear's kernel reads x and w with unit stride along K and the bias "
                         "with unit stride; pass .contiguous() tensors")
    check_kernel_device(x.device, "linear")
    M, K = x.shape
    N = w.shape[0]
    if M > KERNEL_ROWS:
        raise ValueError(f"linear's kernel takes at most {KERNEL_ROWS} rows, got {M}")
    config = config or pick_linear_config(M, N, K) or LinearConfig(32, 256)
    if out is not None:
        _check_out(out, M, N, x)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    if M == 0 or N == 0:
        return y
    _linear_kernel[(triton.cdiv(N, config.block_n),)](
        x, w, bias if bias is not None else w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=max(16, triton.next_power_of_2(M)),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return y


def _check_out(out: torch.Tensor, M: int, N: int, x: torch.Tensor) -> None:
    if (tuple(out.shape) != (M, N) or out.dtype != x.dtype or out.device != x.device
            or (N > 1 and out.stride(1) != 1)):
        raise ValueError(f"out must be [{M}, {N}] {x.dtype} on {x.device} with unit stride "
                         f"along N, got {out.dtype} {tuple(out.shape)} on {out.device} "
                         f"(strides {out.stride()})")


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``, through this module's kernel where it wins: CUDA, fp16 or
    bf16, ``x`` of at most :data:`MAX_ROWS` rows (:data:`WIDE_ROWS` for the weights named
    there; leading dimensions flattened), contiguous weights and bias (else cuBLAS). ``out``
    (2-D ``x`` only): a ``[M, N]`` tensor the product is written into (cuBLAS's ``mm`` /
    ``addmm``, the products ``F.linear`` runs), e.g. one layer's slice of a stacked buffer.
    ``w`` may be an :class:`~bole.ops.fp8.Fp8Weight` (:func:`~bole.ops.fp8.fp8_linear`) or a
    :class:`~bole.ops.fp8.StackedWeight` (each part by this function, side by side)."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w, bias, out=out)
    if isinstance(w, StackedWeight):
        if bias is not None:
            raise ValueError("linear: a StackedWeight takes no bias")
        return stacked_linear(x, w, linear, out=out)
    if out is not None:
        if x.dim() != 2:
            raise ValueError(f"linear(out=...) takes x [M, K], got shape {tuple(x.shape)}")
        _check_out(out, x.shape[0], w.shape[0], x)
    if (x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16)
            or w.dtype != x.dtype or not w.is_contiguous() or x.stride(-1) != 1
            or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))):
        return _torch_linear(x, w, bias, out)
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    config = pick_linear_config(rows.shape[0], w.shape[0], w.shape[1])
    if config is None or rows.stride(-1) != 1:
        return _torch_linear(x, w, bias, out)
    return linear_triton(rows, w, bias, config=config, out=out).view(*x.shape[:-1], w.shape[0])


def _torch_linear(x, w, bias, out):
    if out is None:
        return F.linear(x, w, bias)
    if bias is None:
        return torch.mm(x, w.t(), out=out)
    return torch.addmm(bias, x, w.t(), out=out)

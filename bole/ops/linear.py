"""Linear layers at decode shapes: ``y = x @ w.T (+ bias)`` for a few rows of ``x``.

At one to a few tokens a forward is a weight read: each ``[N, K]`` weight crosses the memory
bus once and every other cost is small. cuBLAS's kernels for ``M = 1`` reach about 78% of the
H200's copy rate on the 9B preset's projections; the kernels here stream each weight in
``[BLOCK_N, BLOCK_K]`` tiles, one program per ``BLOCK_N`` output columns, and keep the few rows of
``x`` beside them:

    rows   (M <= 4)   each tile multiplied by every row of x on the CUDA cores, the products
                      summed over K in fp32
    dot    (M <= 16)  the rows padded to 16 and multiplied by tensor cores (``tl.dot``)

:func:`linear` takes them where they are measured to win (:func:`pick_linear_config`, tuned by
``bench/linear.py`` on the H200) and ``torch.nn.functional.linear`` everywhere else: more rows,
other devices and dtypes, strided weights. Both accumulate in fp32 and round once, as cuBLAS
does; the sums run in another order, so results agree to rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bole.ops.triton_utils import check_kernel_device

__all__ = ["LinearConfig", "pick_linear_config", "linear", "linear_triton", "MAX_ROWS"]

#: the most rows of x the kernels take (more go to cuBLAS: the weight read is then shared by
#: enough rows that cuBLAS's tiles are at the floor)
MAX_ROWS = 16
#: the smallest weight (elements) the kernels take: below it a product is launch-bound and
#: cuBLAS's kernel costs the same
MIN_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class LinearConfig:
    """One launch: the kernel (``rows`` or ``dot``), its tile and its warps and stages."""

    kernel: str
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _linear_rows_kernel(x, w, bias, y, M, N, K, stride_xm, stride_wn, stride_ym,
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
                     eviction_policy="evict_first").to(tl.float32)
        xt = tl.load(x + m[:, None] * stride_xm + k[None, :], mask=mm[:, None] & km[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.sum(xt[:, None, :] * wt[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(y + m[:, None] * stride_ym + n[None, :], acc.to(y.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


@triton.jit
def _linear_dot_kernel(x, w, bias, y, M, N, K, stride_xm, stride_wn, stride_ym,
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

    From ``bench/linear.py`` on the H200 (bf16; ``bench/NOTES.md``): ..."""
    if M < 1 or M > MAX_ROWS or K % 8 or N < 256 or N * K < MIN_ELEMENTS:
        return None
    if M <= 2:
        return LinearConfig("rows", 8, 512, num_warps=4, num_stages=1)
    return LinearConfig("dot", 32, 256, num_warps=4, num_stages=4)


def linear_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                  config: LinearConfig | None = None) -> torch.Tensor:
    """``x [M, K] @ w[N, K].T (+ bias [N])`` by this module's kernels (``config``, default
    :func:`pick_linear_config`'s, else the ``rows`` kernel). ``x`` and ``w`` share a dtype;
    ``w`` and ``x`` have unit stride along K. Returns ``[M, N]`` in x's dtype."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear takes x [M, K] and w [N, K], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if x.dtype != w.dtype or (bias is not None and bias.shape != (w.shape[0],)):
        raise ValueError(f"x ({x.dtype}), w ({w.dtype}) and bias "
                         f"({None if bias is None else (bias.dtype, tuple(bias.shape))}) must "
                         f"share a dtype, the bias of shape [N]")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("linear's kernels read x and w with unit stride along K; pass "
                         ".contiguous() tensors")
    check_kernel_device(x.device, "linear")
    M, K = x.shape
    N = w.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"linear's kernels take at most {MAX_ROWS} rows, got {M}")
    config = config or pick_linear_config(M, N, K) or LinearConfig("rows", 8, 512)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    kernel = _linear_dot_kernel if config.kernel == "dot" else _linear_rows_kernel
    block_m = 16 if config.kernel == "dot" else triton.next_power_of_2(M)
    kernel[(triton.cdiv(N, config.block_n),)](
        x, w, bias if bias is not None else w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``, through this module's kernels where they win: CUDA, fp16 or
    bf16, ``x`` of at most :data:`MAX_ROWS` rows (leading dimensions flattened), contiguous
    weights (else cuBLAS)."""
    if (x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16)
            or w.dtype != x.dtype or not w.is_contiguous() or x.stride(-1) != 1
            or (bias is not None and bias.dtype != x.dtype)):
        return F.linear(x, w, bias)
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    config = pick_linear_config(rows.shape[0], w.shape[0], w.shape[1])
    if config is None or rows.stride(-1) != 1:
        return F.linear(x, w, bias)
    return linear_triton(rows, w, bias, config=config).view(*x.shape[:-1], w.shape[0])

"""The top-k of a softmax over a large vocabulary, without the softmax: a drafter step's proposals.

    topk_softmax(logits [M, V], k) -> (probs [M, k] float32, tokens [M, k] int64)

``probs`` are the k largest of ``softmax(logits.float())`` in descending order and ``tokens`` their
columns, distinct; among equal logits the lower column comes first (``-inf`` logits included, so a
row with fewer than k finite logits still gets k distinct columns). NaN logits are not supported. The reference (``impl="torch"``) is
``torch.topk`` on the fp32 logits followed by ``exp(l - logsumexp(l))``. The kernel
(``impl="triton"``) never forms the [M, V] probabilities: it is two launches whatever M, V and k,

    stage 1   one program per (row, vocabulary chunk): the chunk's max, its sum of exp(l - max) and
              its k largest logits with their columns (k arg-max passes over the chunk)
    stage 2   one program per row: the row's max and log-sum-exp from the chunks', and the k
              largest of the chunks' candidates

where ``torch.softmax`` followed by ``torch.topk`` runs one block per row (a batch-1 drafter step
has 1-4 rows against Qwen3.5's 248k columns) in five to ten launches. Launches depend only on
shapes, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bole.ops.triton_utils import check_kernel_device, fix_interpreter_scalar_index

__all__ = ["topk_softmax", "MAX_K"]

fix_interpreter_scalar_index()

#: the largest k (a drafter's top-k) the kernel takes: its passes are unrolled k times
MAX_K = 16
_CHUNK = 4096


@triton.jit
def _chunk_topk_kernel(logits, stride, V, cand_val, cand_idx, chunk_max, chunk_sum, NCHUNK,
                       K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                       NONE: tl.constexpr):
    """Program (row, chunk): the chunk's max, sum of exp(l - max), and k largest (value, column),
    largest first, ties by lower column."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    x = tl.load(logits + row * stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    # a chunk of -inf logits adds nothing (exp(-inf - -inf) would be NaN)
    s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), 0)
    out = (row * NCHUNK + chunk) * KP
    slot = tl.arange(0, KP)
    vals = tl.full([KP], float("-inf"), tl.float32)
    idxs = tl.full([KP], NONE, tl.int64)
    taken = cols < 0
    for j in tl.static_range(K):
        free = tl.where(taken, float("-inf"), x)
        best = tl.max(free, 0)
        # the lowest column not yet taken holding the maximum (NONE when the chunk has no more)
        at = tl.min(tl.where((free == best) & ~taken & inside, cols, NONE), 0)
        vals = tl.where(slot == j, best, vals)
        idxs = tl.where(slot == j, at.to(tl.int64), idxs)
        taken = taken | (cols == at)
    tl.store(cand_val + out + slot, vals)
    tl.store(cand_idx + out + slot, idxs)
    tl.store(chunk_max + row * NCHUNK + chunk, m)
    tl.store(chunk_sum + row * NCHUNK + chunk, s)


@triton.jit
def _merge_topk_kernel(cand_val, cand_idx, chunk_max, chunk_sum, probs, tokens, ids, NCHUNK,
                       K: tl.constexpr, KP: tl.constexpr, CBLOCK: tl.constexpr,
                       NBLOCK: tl.constexpr, NONE: tl.constexpr, HAS_IDS: tl.constexpr):
    """Program per row: log-sum-exp over the chunks, then the k best of NCHUNK * KP candidates.
    Candidates sit chunk-major and largest-first within a chunk, so among equal values the lowest
    position holds the lowest column. With ``HAS_IDS`` a column c is stored as ``ids[c]``."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, NBLOCK)
    cm = tl.load(chunk_max + row * NCHUNK + c, mask=c < NCHUNK, other=float("-inf"))
    cs = tl.load(chunk_sum + row * NCHUNK + c, mask=c < NCHUNK, other=0.0)
    gmax = tl.max(cm, 0)
    scale = tl.where(cm == float("-inf"), 0.0, tl.exp(cm - gmax))     # empty chunks add nothing
    total = tl.sum(tl.where(c < NCHUNK, cs * scale, 0.0), 0)
    p = tl.arange(0, CBLOCK)
    n = NCHUNK * KP
    v = tl.load(cand_val + row * n + p, mask=p < n, other=float("-inf"))
    ix = tl.load(cand_idx + row * n + p, mask=p < n, other=NONE)
    taken = p < 0
    for j in tl.static_range(K):
        free = tl.where(taken, float("-inf"), v)
        best = tl.max(free, 0)
        # among equal values the lowest column (real columns before the NONE placeholders)
        col = tl.min(tl.where((free == best) & ~taken, ix, NONE), 0)
        at = tl.min(tl.where((free == best) & ~taken & (ix == col), p, CBLOCK), 0)
        tl.store(probs + row * K + j, tl.exp(best - gmax) / total)
        if HAS_IDS:       # (NONE only for NaN rows, which are not supported: no read then)
            col = tl.load(ids + col, mask=col != NONE, other=NONE).to(tl.int64)
        tl.store(tokens + row * K + j, col)
        taken = taken | (p == at)


def _reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()
    top = torch.topk(x, k, dim=-1)
    return torch.exp(top.values - torch.logsumexp(x, dim=-1, keepdim=True)), top.indices


def topk_softmax(logits: torch.Tensor, k: int, impl: str = "auto", chunk: int = _CHUNK,
                 ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs [M, k] float32, tokens [M, k] int64)``: the k largest softmax probabilities of each
    row of ``logits [M, V]`` (fp16, bf16 or fp32), largest first. ``ids [V]`` (integer, optional):
    the token each column stands for (a reduced draft vocabulary), returned in place of the
    columns (the same as ``ids[tokens]``; the kernel gathers them in its last launch).
    ``impl``: "torch", "triton" (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) or "auto"
    (the kernel on CUDA)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocabulary], got shape {tuple(logits.shape)}")
    M, V = logits.shape
    if ids is not None and (ids.shape != (V,) or ids.dtype.is_floating_point
                            or ids.dtype.is_complex or ids.dtype == torch.bool
                            or ids.device != logits.device):
        raise ValueError(f"ids must be an integer tensor [{V}] (one token per column) on "
                         f"{logits.device}, got {ids.dtype} {tuple(ids.shape)} on {ids.device}")
    if not 1 <= k <= min(V, MAX_K):
        raise ValueError(f"k must lie in [1, {min(V, MAX_K)}] (at most the vocabulary and "
                         f"MAX_K = {MAX_K}), got {k}")
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be auto, torch or triton, got {impl!r}")
    if impl == "torch" or (impl == "auto" and logits.device.type != "cuda"):
        probs, cols = _reference(logits, k)
        return probs, (cols if ids is None else ids[cols].to(torch.int64))
    check_kernel_device(logits.device, "topk_softmax")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    block = min(triton.next_power_of_2(V), chunk)
    nchunk = triton.cdiv(V, block)
    kp = triton.next_power_of_2(k)
    cand_val = torch.empty(M, nchunk, kp, dtype=torch.float32, device=dev)
    cand_idx = torch.empty(M, nchunk, kp, dtype=torch.int64, device=dev)
    chunk_max = torch.empty(M, nchunk, dtype=torch.float32, device=dev)
    chunk_sum = torch.empty_like(chunk_max)
    probs = torch.empty(M, k, dtype=torch.float32, device=dev)
    tokens = torch.empty(M, k, dtype=torch.int64, device=dev)
    if M == 0:
        return probs, tokens
    none = 2 ** 31 - 1                           # "no column": past every real one
    _chunk_topk_kernel[(M, nchunk)](logits, logits.stride(0), V, cand_val, cand_idx, chunk_max,
                                    chunk_sum, nchunk, K=k, KP=kp, BLOCK=block, NONE=none,
                                    num_warps=8 if block >= 2048 else 4)
    _merge_topk_kernel[(M,)](cand_val, cand_idx, chunk_max, chunk_sum, probs, tokens,
                             tokens if ids is None else ids.contiguous(), nchunk,
                             K=k, KP=kp, CBLOCK=triton.next_power_of_2(nchunk * kp),
                             NBLOCK=triton.next_power_of_2(nchunk), NONE=none,
                             HAS_IDS=ids is not None, num_warps=4)
    return probs, tokens

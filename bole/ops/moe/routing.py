"""Routing of a mixture of experts on the device, and the alignment of (token, slot) pairs into
blocks of one expert each, with sizes fixed by the shapes (no host sync, CUDA-graph safe).

Pairs are numbered ``p = t * k + j`` (token t's j-th expert). :func:`align_blocks` sorts them by
expert (stably, so within an expert pairs keep their order) and pads every expert's run to a
multiple of ``block_m``; block b then holds ``block_m`` entries of ``sorted_pairs`` that all belong
to expert ``block_expert[b]``. Padding entries hold ``T * k`` (no pair) and blocks past the used
ones hold expert ``E`` (none); kernels skip both. The number of blocks is bounded by
``ceil(T k / block_m) + min(E, T k)`` whatever the routing (each used expert adds at most one
partly filled block). Two implementations give identical results: torch ops (``impl="torch"``,
about twenty small launches) and one Triton launch (``impl="triton"``: one program per expert
counts every expert's pairs with a histogram, places its own pairs by a running in-chunk cumsum,
pads its run and names its blocks; program 0 fills the unused tail).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bole.ops.triton_utils import check_kernel_device, fix_interpreter_scalar_index

fix_interpreter_scalar_index()


@triton.jit
def _route_kernel(logits_ptr, stride_t, E, w_ptr, ids_ptr, K: tl.constexpr, K_P: tl.constexpr,
                  E_P: tl.constexpr, RENORMALIZE: tl.constexpr, SHARED: tl.constexpr):
    """Token ``program_id(0)``: softmax over its E logits, k arg-max passes, renormalisation;
    with SHARED, slot k is expert E weighted by the sigmoid of logit E."""
    t = tl.program_id(0)
    K_OUT: tl.constexpr = K + SHARED
    cols = tl.arange(0, E_P)
    valid = cols < E
    lg = tl.load(logits_ptr + t * stride_t + cols, mask=valid, other=float("-inf"))
    lg = lg.to(tl.float32)
    ex = tl.where(valid, tl.exp(lg - tl.max(lg, 0)), 0.0)
    p = ex / tl.sum(ex, 0)
    slots = tl.arange(0, K_P)
    vals = tl.zeros((K_P,), dtype=tl.float32)
    idx = tl.zeros((K_P,), dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.argmax(p, 0, tie_break_left=True)
        top = tl.max(p, 0)
        vals = tl.where(slots == j, top, vals)
        idx = tl.where(slots == j, best.to(tl.int32), idx)
        p = tl.where(cols == best, -1.0, p)
    if RENORMALIZE:
        vals = vals / tl.sum(tl.where(slots < K, vals, 0.0), 0)
    if SHARED:
        gate = tl.load(logits_ptr + t * stride_t + E).to(tl.float32)
        vals = tl.where(slots == K, tl.sigmoid(gate), vals)
        idx = tl.where(slots == K, E, idx)
    tl.store(w_ptr + t * K_OUT + slots, vals, mask=slots < K_OUT)
    tl.store(ids_ptr + t * K_OUT + slots, idx, mask=slots < K_OUT)


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True, *, impl: str = "torch",
          shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (fp32), the top ``top_k`` and, with ``renormalize``, their weights
    divided by their sum. logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32), in
    descending weight. ``shared``: logits are [T, E + 1], the last column the shared expert's
    gate; the result gains slot k = (expert E, sigmoid of that logit): the shared expert as one
    more expert of every token. ``impl``: "torch" (``torch.softmax`` and ``torch.topk``,
    transformers' operations) or "triton" (one launch, a program per token; among equal
    probabilities the lower expert first; weights equal torch's to rounding)."""
    E = logits.shape[-1] - int(shared) if logits.dim() == 2 else 0
    if logits.dim() != 2 or not 1 <= top_k <= E:
        raise ValueError(f"route takes logits [T, E{' + 1' if shared else ''}] and "
                         f"1 <= top_k <= E, got shape {tuple(logits.shape)} and top_k={top_k}")
    if impl == "triton":
        check_kernel_device(logits.device, "route(impl='triton')")
        T = logits.shape[0]
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        k_out = top_k + int(shared)
        weights = torch.empty(T, k_out, dtype=torch.float32, device=logits.device)
        ids = torch.empty(T, k_out, dtype=torch.int32, device=logits.device)
        if T:
            _route_kernel[(T,)](logits, logits.stride(0), E, weights, ids, K=top_k,
                                K_P=triton.next_power_of_2(k_out),
                                E_P=triton.next_power_of_2(E), RENORMALIZE=renormalize,
                                SHARED=int(shared))
        return weights, ids
    if impl != "torch":
        raise ValueError(f"route impl must be 'torch' or 'triton', got {impl!r}")
    probs = torch.softmax(logits[:, :E], dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    if shared:
        gate = torch.sigmoid(logits[:, E:].float())
        weights = torch.cat([weights, gate], dim=1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], E)], dim=1)
    return weights, ids


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks any routing of ``num_pairs`` pairs over ``num_experts`` experts needs."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


@dataclass(frozen=True)
class BlockAlignment:
    """Pairs sorted by expert in blocks of ``block_m`` (shapes fixed by T, k, E, block_m).

    sorted_pairs [num_blocks * block_m] int32: pair ids, ``num_pairs`` in padding entries
    block_expert [num_blocks] int32: the expert of each block, ``num_experts`` for unused blocks
    expert_counts [E] int32: pairs per expert (the experts a forward touches are those > 0)
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    expert_counts: torch.Tensor
    num_pairs: int
    num_experts: int
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


@triton.jit
def _align_kernel(ids_ptr, N, E, NUM_BLOCKS, sorted_ptr, block_expert_ptr, counts_ptr,
                  BLOCK_M: tl.constexpr, E_P: tl.constexpr, CHUNK: tl.constexpr):
    """Program e places expert e's pairs (module docstring); E_P > E bins, bin E the sentinel
    of masked lanes."""
    e = tl.program_id(0)
    bins = tl.arange(0, E_P)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros((E_P,), dtype=tl.int32)
    for c0 in range(0, N, CHUNK):
        ids = tl.load(ids_ptr + c0 + offs, mask=c0 + offs < N, other=E)
        counts += tl.histogram(ids, E_P)
    padded = tl.where(bins < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    start = tl.sum(tl.where(bins < e, padded, 0))
    mine_count = tl.sum(tl.where(bins == e, counts, 0))
    mine_padded = tl.sum(tl.where(bins == e, padded, 0))
    run = tl.sum(offs * 0)
    for c0 in range(0, N, CHUNK):
        ids = tl.load(ids_ptr + c0 + offs, mask=c0 + offs < N, other=E)
        sel = ids == e
        one = sel.to(tl.int32)
        rank = run + tl.cumsum(one, 0) - one
        tl.store(sorted_ptr + start + rank, c0 + offs, mask=sel)
        run += tl.sum(one)
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + start + mine_count + pad, N + pad * 0,
             mask=mine_count + pad < mine_padded)
    first = start // BLOCK_M
    for b0 in range(0, mine_padded // BLOCK_M, CHUNK):
        tl.store(block_expert_ptr + first + b0 + offs, e + offs * 0,
                 mask=b0 + offs < mine_padded // BLOCK_M)
    tl.store(counts_ptr + e, mine_count)
    if e == 0:
        total = tl.sum(padded)
        for t0 in range(total, NUM_BLOCKS * BLOCK_M, CHUNK):
            tl.store(sorted_ptr + t0 + offs, N + offs * 0, mask=t0 + offs < NUM_BLOCKS * BLOCK_M)
        for b0 in range(total // BLOCK_M, NUM_BLOCKS, CHUNK):
            tl.store(block_expert_ptr + b0 + offs, E + offs * 0, mask=b0 + offs < NUM_BLOCKS)


def _align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    check_kernel_device(topk_ids.device, "align_blocks(impl='triton')")
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n = flat.shape[0]
    nb = max_blocks(n, num_experts, block_m)
    sorted_pairs = torch.empty(nb * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=flat.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    _align_kernel[(num_experts,)](
        flat, n, num_experts, nb, sorted_pairs, block_expert, counts, BLOCK_M=block_m,
        E_P=triton.next_power_of_2(num_experts + 1), CHUNK=128 if flat.is_cuda else 32)
    return BlockAlignment(sorted_pairs, block_expert, counts, n, num_experts, block_m)


def align_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                 impl: str = "torch") -> BlockAlignment:
    """Sort the (token, slot) pairs of ``topk_ids [T, k]`` by expert into padded blocks of
    ``block_m`` on the ids' device, no value read back to the host. ``impl``: "torch" (torch
    ops) or "triton" (one launch; CUDA, or CPU under TRITON_INTERPRET=1)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {tuple(topk_ids.shape)}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    if impl == "triton":
        return _align_triton(topk_ids, num_experts, block_m)
    if impl != "torch":
        raise ValueError(f"align_blocks impl must be 'torch' or 'triton', got {impl!r}")
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.shape[0]
    nb = max_blocks(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)                      # one past each expert's last block
    padded_start = (block_end - blocks) * block_m            # first entry of each expert's run
    pair_start = torch.cumsum(counts, 0) - counts            # first sorted pair of each expert
    order = torch.sort(flat, stable=True).indices            # pairs by expert, stable
    expert_sorted = flat[order]
    rank = torch.arange(n, device=dev) - pair_start[expert_sorted]
    dest = padded_start[expert_sorted] + rank
    sorted_pairs = torch.full((nb * block_m,), n, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    block_ids = torch.arange(nb, device=dev)
    block_expert = torch.searchsorted(block_end, block_ids, right=True).to(torch.int32)
    return BlockAlignment(sorted_pairs, block_expert, counts.to(torch.int32), n, num_experts,
                          block_m)

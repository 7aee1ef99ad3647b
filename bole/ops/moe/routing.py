"""Routing of a mixture of experts on the device, and the alignment of (token, slot) pairs into
blocks of one expert each, with sizes fixed by the shapes (no host sync, CUDA-graph safe).

Pairs are numbered ``p = t * k + j`` (token t's j-th expert). :func:`align_blocks` sorts them by
expert (stably, so within an expert pairs keep their order) and pads every expert's run to a
multiple of ``block_m``; block b then holds ``block_m`` entries of ``sorted_pairs`` that all belong
to expert ``block_expert[b]``. Padding entries hold ``T * k`` (no pair) and blocks past the used
ones hold expert ``E`` (none); kernels skip both. The number of blocks is bounded by
``ceil(T k / block_m) + min(E, T k)`` whatever the routing (each used expert adds at most one
partly filled block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (fp32), the top ``top_k`` and, with ``renormalize``, their weights
    divided by their sum. logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32). Ties go to
    the lower expert index first only as far as ``torch.topk`` orders them (the kernels and
    the reference read the same ids, so ties cannot make them differ)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


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


def align_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """Sort the (token, slot) pairs of ``topk_ids [T, k]`` by expert into padded blocks of
    ``block_m`` (torch ops on the ids' device; no value is read back to the host)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {tuple(topk_ids.shape)}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
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

"""Fixed-shape draft forests on the device: R requests x T node slots each.

The speculative round runs in fixed shapes so that it can be captured in a CUDA graph: request r
owns the node slots ``r * T .. r * T + T - 1`` of every per-node tensor, whatever the size of its
tree. A request's real nodes come first in topological order (node 0 the root, parents precede
children); the rest of its slots are padding. Padding nodes have parent -1 and ``valid == False``;
to the kernels they are extra roots that no real node descends from, so they change nothing.

Everything here is tensor code without host synchronisation (no ``.item()``, no boolean
indexing, no data-dependent shapes): the structure a round needs is derived on the device from
``parents`` alone, with loops only over the static depth bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bole.ops.forest.kernel import forest_structure
from bole.tree import ForestMeta, PackedForest

__all__ = ["DenseForest", "ancestors_from_parents", "depths_from_parents"]


def depths_from_parents(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[R, T]`` depth of every node (0 for roots and padding) from local ``parents [R, T]``.

    Exact for trees no deeper than ``max_depth`` (``max_depth`` gather steps)."""
    depth = torch.zeros_like(parents)
    has_parent = parents >= 0
    safe = parents.clamp(min=0)
    for _ in range(max_depth):
        depth = torch.where(has_parent, torch.gather(depth, 1, safe) + 1, 0)
    return depth


def ancestors_from_parents(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[R, T, T]`` bool: ``[r, i, j]`` iff node j is an ancestor of node i or i itself.

    Row i is its parent's row plus i; ``max_depth`` propagation steps make it exact for trees of
    at most that depth."""
    R, T = parents.shape
    eye = torch.eye(T, dtype=torch.bool, device=parents.device).expand(R, T, T)
    anc = eye.clone()
    has_parent = (parents >= 0)[:, :, None]
    index = parents.clamp(min=0)[:, :, None].expand(R, T, T)
    for _ in range(max_depth):
        anc = eye | (has_parent & torch.gather(anc, 1, index))
    return anc


@dataclass
class DenseForest:
    """R trees of at most T nodes each, in fixed-shape device tensors.

    parents:   ``[R, T]`` int64 local parent index, -1 for roots and padding.
    valid:     ``[R, T]`` bool, False for padding slots.
    depth:     ``[R, T]`` int64 (0 for padding).
    ancestors: ``[R, T, T]`` bool, ``[r, i, j]`` iff j is an ancestor of i or i itself.
    max_depth: static bound on every tree's depth (a host int: it sizes loops and kernels).
    """

    parents: torch.Tensor
    valid: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    max_depth: int

    @classmethod
    def from_parents(cls, parents: torch.Tensor, valid: torch.Tensor,
                     max_depth: int) -> "DenseForest":
        """Derive depths and ancestors on ``parents``' device (no host synchronisation)."""
        if parents.dim() != 2 or valid.shape != parents.shape:
            raise ValueError(f"parents {tuple(parents.shape)} and valid {tuple(valid.shape)} must "
                             "both be [R, T]")
        if parents.dtype != torch.int64 or valid.dtype != torch.bool:
            raise TypeError(f"parents must be int64 and valid bool, got {parents.dtype} and "
                            f"{valid.dtype}")
        parents = torch.where(valid, parents, -1)
        if parents.is_cuda:              # one launch (bole/ops/forest/kernel.py) instead of ~3 per level
            return cls(parents, valid, *forest_structure(parents, max_depth), int(max_depth))
        return cls(parents, valid, depths_from_parents(parents, max_depth),
                   ancestors_from_parents(parents, max_depth), int(max_depth))

    @classmethod
    def chain(cls, num_requests: int, length: int, device) -> "DenseForest":
        """``num_requests`` chains of ``length`` nodes (prefill chunks, decode at length 1),
        built directly: a chain's ancestors are the lower triangle."""
        node = torch.arange(length, device=device)
        parents = (node - 1).expand(num_requests, length).clone()
        anc = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        return cls(parents, torch.ones(num_requests, length, dtype=torch.bool, device=device),
                   node.expand(num_requests, length).clone(),
                   anc.expand(num_requests, length, length).clone(), length - 1)

    @classmethod
    def from_packed(cls, forest: PackedForest, num_slots: int | None = None,
                    device=None) -> "DenseForest":
        """The dense layout of a host-built ragged forest (n-gram drafts, tests): request r's
        nodes move to slots ``r * T ..``; ``T`` defaults to the largest tree."""
        sizes = forest.sizes().tolist()
        T = num_slots or max(sizes)
        if max(sizes) > T:
            raise ValueError(f"a tree of {max(sizes)} nodes does not fit {T} node slots")
        R = forest.num_requests
        parents = torch.full((R, T), -1, dtype=torch.int64)
        valid = torch.zeros(R, T, dtype=torch.bool)
        for r, n in enumerate(sizes):
            lo = int(forest.cu_nodes[r])
            parents[r, :n] = forest.parents[lo:lo + n]
            valid[r, :n] = True
        device = device if device is not None else forest.parents.device
        return cls.from_parents(parents.to(device), valid.to(device), max(forest.max_depth, 0))

    # ---- shapes ----
    @property
    def num_requests(self) -> int:
        return self.parents.shape[0]

    @property
    def nodes_per_request(self) -> int:
        return self.parents.shape[1]

    @property
    def num_nodes(self) -> int:
        return self.parents.numel()

    # ---- what a forward needs ----
    def positions(self, lengths: torch.Tensor) -> torch.Tensor:
        """``[R * T]`` token positions ``lengths[r] + depth`` (``lengths [R]`` committed tokens)."""
        return (lengths.to(self.depth.dtype)[:, None] + self.depth).reshape(-1)

    def parent_global(self) -> torch.Tensor:
        """``[R * T]`` parent index into the flattened node list, -1 for roots and padding."""
        R, T = self.parents.shape
        base = torch.arange(R, device=self.parents.device)[:, None] * T
        return torch.where(self.parents >= 0, self.parents + base, -1).reshape(-1)

    def kernel_meta(self, block_nodes: int | None = None) -> ForestMeta:
        """The GDN kernels' view: every request owns T consecutive nodes (padding included)."""
        R, T = self.parents.shape
        dev = self.parents.device
        block = block_nodes or max(16, 1 << (T - 1).bit_length())
        if block < T:
            raise ValueError(f"block_nodes={block} is smaller than the {T} node slots per tree")
        mask = torch.zeros(R * T, block, dtype=torch.uint8, device=dev)
        mask[:, :T] = self.ancestors.reshape(R * T, T)
        request = torch.arange(R, device=dev, dtype=torch.int32).repeat_interleave(T)
        return ForestMeta(
            cu_nodes=(torch.arange(R + 1, device=dev, dtype=torch.int32) * T),
            ancestor_mask=mask, parent_global=self.parent_global().to(torch.int32),
            request=request, num_requests=R, num_nodes=R * T, max_tree_nodes=T,
            max_depth=self.max_depth, block_nodes=block)

    def paths(self, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Root-to-node paths of each request's ``accepted [R]`` local node.

        Returns ``(index [R, max_depth + 1], lengths [R])``: local node indices root first, rows
        padded with the accepted node past ``lengths[r] = depth(accepted) + 1``."""
        R, T = self.parents.shape
        D = self.max_depth + 1
        acc = accepted.to(torch.int64)
        on_path = torch.gather(self.ancestors, 1, acc[:, None, None].expand(R, 1, T))[:, 0]
        depth_acc = torch.gather(self.depth, 1, acc[:, None])                    # [R, 1]
        index = acc[:, None].expand(R, D).clone()
        # each ancestor (and the node) sits at its own depth; other nodes go to a dump column
        col = torch.where(on_path, self.depth, D).clamp(max=D)
        node = torch.arange(T, device=acc.device).expand(R, T)
        wide = torch.cat([index, index[:, :1]], dim=1)
        wide.scatter_(1, col, node)
        return wide[:, :D], depth_acc[:, 0] + 1

    def global_index(self, local: torch.Tensor) -> torch.Tensor:
        """Flattened node index of ``local [R, ...]`` node indices."""
        T = self.nodes_per_request
        base = torch.arange(local.shape[0], device=local.device) * T
        return local + base.view(-1, *([1] * (local.dim() - 1)))

"""Draft trees and packed forests.

Conventions (docs/design.md section 4):

* A draft tree of ``T`` nodes is given by a parent array. Node 0 is the root (the bonus token of the
  previous round, not yet seen by the target) and its parent is -1. Parents precede children, so
  ``0 <= parents[i] < i`` for every ``i > 0``; this also rules out cycles.
* ``depth(root) = 0``; ``positions = committed_length + depth``.
* ``ancestor_mask[i, j]`` is True when ``j`` is an ancestor of ``i`` (and, with ``include_self``,
  when ``j == i``): row ``i`` is the set of nodes whose keys node ``i`` may see.
* A batch is a :class:`PackedForest`: the trees' nodes concatenated request by request, with
  ``cu_nodes`` offsets and parent indices local to each tree. Padding nodes, where a caller adds
  them, sit after the last request, have parent -1, request -1 and ``valid == False``; the kernels
  write zeros for them.

The one ancestor-mask builder here is :meth:`DraftTree.ancestor_mask` (host, per tree); the
fixed-shape device layout derives its own on the device (:mod:`bole.forest`).

All structure lives on the CPU as int64 tensors (trees are small and built once per round); use
:meth:`PackedForest.to` to move the index tensors a kernel needs to the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

__all__ = ["DraftTree", "PackedForest", "ForestMeta"]


def _as_index_array(x, name: str) -> np.ndarray:
    """A 1-D int64 numpy copy of ``x`` (list, numpy array or integer tensor)."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got a tensor of dtype {x.dtype}")
        arr = x.detach().cpu().numpy()
    else:
        arr = np.asarray(x)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got values of dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    return arr.astype(np.int64, copy=True)


def _depths(parents: np.ndarray) -> np.ndarray:
    depth = np.zeros(len(parents), dtype=np.int64)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def _ancestor_mask(parents: np.ndarray, depth: np.ndarray, include_self: bool) -> np.ndarray:
    """Dense ``[T, T]`` bool: ``mask[i, j]`` iff j is an ancestor of i (or i itself)."""
    n = len(parents)
    mask = np.eye(n, dtype=bool)
    # Rows are filled level by level: a node's row is its parent's row plus itself.
    for d in range(1, int(depth.max(initial=0)) + 1):
        rows = np.nonzero(depth == d)[0]
        mask[rows] |= mask[parents[rows]]
    if not include_self:
        mask[np.arange(n), np.arange(n)] = False
    return mask


@dataclass(frozen=True)
class DraftTree:
    """One validated draft tree.

    Attributes:
        parents: ``[T]`` int64, ``parents[0] == -1`` and ``0 <= parents[i] < i`` otherwise.
        depth: ``[T]`` int64, root depth 0.
    """

    parents: torch.Tensor
    depth: torch.Tensor = field(repr=False)

    @classmethod
    def from_parents(cls, parents, max_depth: int | None = None) -> "DraftTree":
        """Build and validate a tree from a parent array.

        ``max_depth`` bounds the deepest node's depth (root = 0); ``None`` means unbounded.
        Raises ValueError naming the offending node on any malformed input.
        """
        arr = _as_index_array(parents, "parents")
        n = len(arr)
        if n == 0:
            raise ValueError("a draft tree needs at least its root node; got an empty parent array")
        if arr[0] != -1:
            raise ValueError(
                f"node 0 must be the root with parent -1, got parent {arr[0]}; "
                "put the bonus token of the previous round first")
        for i in range(1, n):
            p = int(arr[i])
            if p == -1:
                raise ValueError(
                    f"second root: node {i} has parent -1, but only node 0 may be a root; "
                    "pack several requests' trees with PackedForest.pack instead")
            if p < -1 or p >= n:
                raise ValueError(
                    f"parent index out of range: node {i} has parent {p}, valid parents are 0..{n - 1}")
            if p >= i:
                raise ValueError(
                    f"parent {p} of node {i} does not precede it (cycle or parent after child); "
                    "order nodes topologically so that every parent comes before its children")
        depth = _depths(arr)
        tree_depth = int(depth.max())
        if max_depth is not None and tree_depth > max_depth:
            deepest = int(depth.argmax())
            raise ValueError(
                f"tree depth {tree_depth} (node {deepest}) exceeds the limit max_depth={max_depth}; "
                "draft fewer steps or raise the limit")
        return cls(torch.from_numpy(arr), torch.from_numpy(depth))

    # ---- shapes used by tests, demos and benchmarks ----
    @classmethod
    def chain(cls, num_nodes: int) -> "DraftTree":
        return cls.from_parents(np.arange(-1, num_nodes - 1))

    @classmethod
    def star(cls, num_nodes: int) -> "DraftTree":
        return cls.from_parents(np.array([-1] + [0] * (num_nodes - 1)))

    @classmethod
    def full_kary(cls, arity: int, depth: int) -> "DraftTree":
        """Complete ``arity``-ary tree whose deepest nodes have depth ``depth`` (BFS order)."""
        parents = [-1]
        frontier = [0]
        for _ in range(depth):
            nxt = []
            for p in frontier:
                for _ in range(arity):
                    parents.append(p)
                    nxt.append(len(parents) - 1)
            frontier = nxt
        return cls.from_parents(np.array(parents))

    @classmethod
    def random(cls, num_nodes: int, max_depth: int, generator: np.random.Generator) -> "DraftTree":
        """Random tree of exactly ``num_nodes`` nodes and depth at most ``max_depth``."""
        parents = [-1]
        depth = [0]
        for i in range(1, num_nodes):
            choices = [j for j in range(i) if depth[j] < max_depth]
            p = int(generator.choice(choices))
            parents.append(p)
            depth.append(depth[p] + 1)
        return cls.from_parents(np.array(parents))

    # ---- derived structure ----
    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node (0 for a lone root)."""
        return int(self.depth.max())

    def positions(self, committed_length: int) -> torch.Tensor:
        """``[T]`` token positions: ``committed_length + depth``."""
        return self.depth + int(committed_length)

    def ancestor_mask(self, include_self: bool = True) -> torch.Tensor:
        """``[T, T]`` bool; ``mask[i, j]`` iff j is a (strict, unless include_self) ancestor of i."""
        return torch.from_numpy(
            _ancestor_mask(self.parents.numpy(), self.depth.numpy(), include_self))

    def path(self, node: int) -> torch.Tensor:
        """Nodes from the root down to ``node`` inclusive (the accepted path ending at ``node``)."""
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} is out of range for a tree of {self.num_nodes} nodes")
        out = []
        parents = self.parents.numpy()
        while node != -1:
            out.append(node)
            node = int(parents[node])
        return torch.tensor(out[::-1], dtype=torch.int64)

    def children(self, node: int) -> torch.Tensor:
        return torch.nonzero(self.parents == node).flatten()


@dataclass(frozen=True)
class PackedForest:
    """A batch of draft trees packed into one ragged forest.

    Attributes (all CPU int64/bool tensors unless moved with :meth:`to`):
        parents: ``[N]`` parent index local to its tree, -1 for roots and padding.
        cu_nodes: ``[R + 1]`` offsets; request r owns nodes ``cu_nodes[r]:cu_nodes[r + 1]``.
        request: ``[N]`` owning request, -1 for padding.
        parent_global: ``[N]`` parent index into the packed forest, -1 for roots and padding.
        depth: ``[N]`` depth within its tree (0 for padding).
        valid: ``[N]`` False for padding nodes.
    """

    parents: torch.Tensor
    cu_nodes: torch.Tensor
    request: torch.Tensor
    parent_global: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def pack(cls, trees: Sequence[DraftTree]) -> "PackedForest":
        if len(trees) == 0:
            raise ValueError("cannot pack an empty batch: pass at least one DraftTree")
        for r, t in enumerate(trees):
            if not isinstance(t, DraftTree):
                raise TypeError(f"trees[{r}] is a {type(t).__name__}, expected a DraftTree")
        sizes = torch.tensor([t.num_nodes for t in trees], dtype=torch.int64)
        cu = torch.zeros(len(trees) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(sizes, 0)
        parents = torch.cat([t.parents for t in trees])
        request = torch.repeat_interleave(torch.arange(len(trees)), sizes)
        offsets = cu[:-1][request]
        parent_global = torch.where(parents >= 0, parents + offsets, parents)
        depth = torch.cat([t.depth for t in trees])
        valid = torch.ones(len(parents), dtype=torch.bool)
        return cls(parents, cu, request, parent_global, depth, valid)

    @classmethod
    def from_parents(cls, parents, max_depth: int | None = None) -> "PackedForest":
        """``parents`` is ``[B, T]`` (B trees of T nodes each) or a list of 1-D parent arrays."""
        if isinstance(parents, torch.Tensor) and parents.dim() == 2:
            parents = list(parents)
        elif isinstance(parents, np.ndarray) and parents.ndim == 2:
            parents = list(parents)
        return cls.pack([DraftTree.from_parents(p, max_depth=max_depth) for p in parents])

    def to(self, device) -> "PackedForest":
        return PackedForest(*(getattr(self, f).to(device) for f in
                              ("parents", "cu_nodes", "request", "parent_global", "depth", "valid")))

    # ---- derived structure ----
    @property
    def num_nodes(self) -> int:
        """Total packed nodes, padding included."""
        return int(self.parents.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.cu_nodes.shape[0]) - 1

    @property
    def num_valid_nodes(self) -> int:
        return int(self.cu_nodes[-1])

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.num_nodes else 0

    def sizes(self) -> torch.Tensor:
        return self.cu_nodes[1:] - self.cu_nodes[:-1]

    def tree(self, r: int) -> DraftTree:
        lo, hi = int(self.cu_nodes[r]), int(self.cu_nodes[r + 1])
        return DraftTree(self.parents[lo:hi].cpu(), self.depth[lo:hi].cpu())

    def positions(self, committed_lengths) -> torch.Tensor:
        """``[N]`` positions: each request's committed length + depth (0 for padding)."""
        lens = torch.as_tensor(committed_lengths, dtype=torch.int64, device=self.depth.device)
        if lens.shape != (self.num_requests,):
            raise ValueError(
                f"committed_lengths must have one entry per request ({self.num_requests}), "
                f"got shape {tuple(lens.shape)}")
        base = torch.where(self.valid, lens[self.request.clamp(min=0)], torch.zeros_like(self.depth))
        return base + self.depth

    def accepted_paths(self, accepted) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed global node indices of each request's accepted path, root first.

        ``accepted``: ``[R]`` local index of each request's accepted (deepest kept) node.
        Returns ``(nodes [sum of path lengths], cu_path [R + 1])``.
        """
        acc = _as_index_array(accepted, "accepted")
        if len(acc) != self.num_requests:
            raise ValueError(
                f"accepted must have one node per request ({self.num_requests}), got {len(acc)}")
        sizes = self.sizes().tolist()
        paths = []
        for r, a in enumerate(acc.tolist()):
            if not 0 <= a < sizes[r]:
                raise ValueError(
                    f"accepted node {a} of request {r} is out of range; its tree has {sizes[r]} nodes")
            paths.append(self.tree(r).path(a) + int(self.cu_nodes[r]))
        cu = torch.zeros(len(paths) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor([len(p) for p in paths]), 0)
        return torch.cat(paths), cu

    def padded_paths(self, accepted) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [R, P], lengths [R])``: accepted paths as packed global indices, root first.

        Rows are padded with the path's last node up to ``P`` = the longest path; entries past
        ``lengths[r]`` must be ignored.
        """
        nodes, cu = self.accepted_paths(accepted)
        lengths = cu[1:] - cu[:-1]
        P = int(lengths.max())
        index = torch.empty(self.num_requests, P, dtype=torch.int64)
        for r, n in enumerate(lengths.tolist()):
            path = nodes[int(cu[r]): int(cu[r]) + n]
            index[r, :n] = path
            index[r, n:] = path[-1]
        return index, lengths

    def kernel_meta(self, device=None, block_nodes: int | None = None) -> "ForestMeta":
        """Device-side metadata for the kernels, built once per round and shared by all layers."""
        sizes = self.sizes()
        max_nodes = int(sizes.max())
        block = block_nodes or max(16, 1 << (max_nodes - 1).bit_length())
        if block < max_nodes:
            raise ValueError(f"block_nodes={block} is smaller than the largest tree ({max_nodes} nodes)")
        mask = torch.zeros(self.num_nodes, block, dtype=torch.uint8)
        for r in range(self.num_requests):
            lo, hi = int(self.cu_nodes[r]), int(self.cu_nodes[r + 1])
            mask[lo:hi, : hi - lo] = self.tree(r).ancestor_mask()
        device = device if device is not None else self.parents.device
        return ForestMeta(
            cu_nodes=self.cu_nodes.to(device=device, dtype=torch.int32),
            ancestor_mask=mask.to(device),
            parent_global=self.parent_global.to(device=device, dtype=torch.int32),
            request=self.request.to(device=device, dtype=torch.int32),
            num_requests=self.num_requests, num_nodes=self.num_nodes,
            max_tree_nodes=max_nodes, max_depth=self.max_depth, block_nodes=block)


@dataclass(frozen=True)
class ForestMeta:
    """What a kernel needs to know of a packed forest, on the device. Built once per round.

    cu_nodes:      ``[R + 1]`` int32 offsets of each request's nodes.
    ancestor_mask: ``[N, block_nodes]`` uint8; ``[i, j] = 1`` iff local node j of i's tree is an
                   ancestor of node i or i itself (columns are local indices; zero for padding).
    parent_global: ``[N]`` int32 packed parent index, -1 for roots and padding.
    request:       ``[N]`` int32 owning request, -1 for padding.
    max_tree_nodes, max_depth: host ints (no device sync in the hot path);
    block_nodes:   power of two >= max(16, max_tree_nodes), a kernel's tile over one tree.
    """

    cu_nodes: torch.Tensor
    ancestor_mask: torch.Tensor
    parent_global: torch.Tensor
    request: torch.Tensor
    num_requests: int
    num_nodes: int
    max_tree_nodes: int
    max_depth: int
    block_nodes: int

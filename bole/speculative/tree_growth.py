"""EAGLE-2 draft-tree growth for every request at once, in fixed-shape device tensors.

This is :func:`bole.speculative.drafters.host_growth.build_draft_trees` (same trees, same node order, same
rho) without host synchronisation, so that a whole drafting round can be captured in a CUDA graph:
every tensor has a shape fixed by ``(num_requests, topk, depth, budget)``, Python loops run only
over the static step count, and every selection is a stable sort or a gather.

Created nodes live in a :class:`NodeTable` of ``C = node_capacity(topk, depth)`` slots per request,
each slot fixed in advance by (step, frontier rank, proposal rank)::

    slot 0                                    the root
    slots 1 .. topk                           step 0: the root's proposals
    slots 1 + topk + (s - 1) * topk**2 ..     step s >= 1: frontier node f's proposal j sits at
                                              offset f * topk + j of the step's block

Slot order is therefore creation order (frontier order, then proposal rank) among the nodes that
were really created, which is all the host's tie-breaking compares. A slot whose node was not
created (no frontier node, a missing proposal, past the request's depth limit) has ``live ==
False``, parent -1, token 0, depth 0 and rho 0.

After ``depth`` steps :meth:`TreeGrowth.grow` keeps the root and the ``budget - 1`` best created
nodes by (-rho, depth, creation order) and lays them out as a :class:`DraftForest` in the dense
layout of :mod:`bole.forest`: level by level, within a level by the parent's new position, then by
(-rho, creation order), exactly as the host's ``_Growth.result``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from bole.forest import DenseForest
from bole.ops.growth.kernel import grow_step, rerank

__all__ = ["NodeTable", "DraftForest", "StepFn", "TreeGrowth", "node_capacity", "step_slots"]

_INF = float("inf")


def node_capacity(topk: int, depth: int) -> int:
    """Slots per request for every node a growth can create, root included:
    ``1 + topk + (depth - 1) * topk**2`` (1 for ``depth == 0``)."""
    return 1 if depth == 0 else 1 + topk + (depth - 1) * topk * topk


def step_slots(topk: int, step: int) -> tuple[int, int]:
    """``(first slot, number of slots)`` of the nodes created at ``step`` (0-based)."""
    if step == 0:
        return 1, topk
    return 1 + topk + (step - 1) * topk * topk, topk * topk


@dataclass
class NodeTable:
    """Every node created so far, per request, in ``C`` fixed slots (see the module docstring).

    tokens:    ``[R, C]`` int64 token of each node (0 for slots not created).
    parents:   ``[R, C]`` int64 slot of the parent, -1 for the root and slots not created.
    depth:     ``[R, C]`` int64 (root 0; 0 for slots not created).
    rho:       ``[R, C]`` float64 cumulative draft probability (root 1, 0 for slots not created).
    live:      ``[R, C]`` bool: the slot holds a created node (the root always does).
    ancestors: ``[R, C, C]`` bool, ``[r, i, j]`` iff node j is an ancestor of node i or i itself;
               the row of a slot not created holds only itself, so that an attention mask built
               from it never has an empty row.
    """

    tokens: Tensor
    parents: Tensor
    depth: Tensor
    rho: Tensor
    live: Tensor
    ancestors: Tensor

    @classmethod
    def empty(cls, roots: Tensor, capacity: int) -> "NodeTable":
        """A table holding only the roots (``roots [R]`` int64) in slot 0."""
        R, C, dev = roots.shape[0], capacity, roots.device
        tokens = torch.zeros(R, C, dtype=torch.int64, device=dev)
        tokens[:, 0] = roots
        rho = torch.zeros(R, C, dtype=torch.float64, device=dev)
        rho[:, 0] = 1.0
        live = torch.zeros(R, C, dtype=torch.bool, device=dev)
        live[:, 0] = True
        eye = torch.eye(C, dtype=torch.bool, device=dev)
        return cls(tokens, torch.full((R, C), -1, dtype=torch.int64, device=dev),
                   torch.zeros(R, C, dtype=torch.int64, device=dev), rho, live,
                   eye.expand(R, C, C).clone())

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]


#: ``step_fn(step, frontier, table) -> (tokens, probs)``.
#:
#: ``frontier [R, K]`` int64: the slots to expand at this step, best first (``K = 1`` at step 0,
#: where it is the root, ``K = topk`` afterwards); -1 where a request has no such node (fewer
#: candidates, or past its depth limit). Frontier nodes sit at depth ``step``; ``table`` holds the
#: nodes created before this step (it is updated in place after the call).
#: Returns ``tokens [R, K, topk]`` int64 and ``probs [R, K, topk]`` float: each frontier node's
#: proposals in descending probability (what ``torch.topk(softmax(logits), topk)`` gives), distinct
#: tokens in ``[0, 1]`` probability. A negative token or a NaN probability marks a missing proposal
#: (a drafter with fewer than ``topk`` continuations); probabilities are clamped to [0, 1].
#: Entries of -1 frontier slots are ignored, NaNs included.
StepFn = Callable[[int, Tensor, NodeTable], "tuple[Tensor, Tensor]"]


@dataclass
class DraftForest:
    """The kept trees in the dense layout of :mod:`bole.forest` (request r owns its row).

    tokens: ``[R, T]`` int64 (0 for padding), ``tokens[:, 0]`` the roots.
    rho:    ``[R, T]`` float64 cumulative draft probability (root 1, padding 0).
    source: ``[R, T]`` int64 slot in ``table`` of each kept node, -1 for padding.
    forest: the structure: ``parents [R, T]`` (local, -1 for the root and padding), ``valid
            [R, T]``, ``depth [R, T]``, ``ancestors [R, T, T]``, ``max_depth`` = the growth depth.
    table:  every node created during the growth (``[R, C]`` slots).
    """

    tokens: Tensor
    rho: Tensor
    source: Tensor
    forest: DenseForest
    table: NodeTable

    @property
    def parents(self) -> Tensor:
        return self.forest.parents

    @property
    def valid(self) -> Tensor:
        return self.forest.valid

    @property
    def depth(self) -> Tensor:
        return self.forest.depth

    def sizes(self) -> Tensor:
        """``[R]`` kept nodes per request (on the device)."""
        return self.forest.valid.sum(1)


class TreeGrowth:
    """EAGLE-2 growth of ``num_requests`` trees in fixed shapes.

    Step 0 expands the root; each later step expands the ``topk`` best nodes created in the
    previous step (highest rho, ties by creation order) into their ``topk`` proposals. Request
    ``r`` grows for ``depth_limit[r]`` of the ``depth`` steps. Then the root and the ``budget - 1``
    best created nodes are kept: ``T = budget`` output slots per request (``budget`` counts the
    root; budget 1 gives lone roots and never calls ``step_fn``).
    """

    def __init__(self, num_requests: int, topk: int, depth: int, budget: int, device=None,
                 impl: str = "auto"):
        """``impl``: how each step updates the table: "torch" (the reference below), "triton"
        (one launch per step, ``bole/ops/growth/kernel.py``: CUDA, or the CPU interpreter) or
        "auto" (the kernel on CUDA)."""
        if num_requests < 1 or topk < 1 or depth < 0 or budget < 1:
            raise ValueError(f"need num_requests >= 1, topk >= 1, depth >= 0 and budget >= 1; got "
                             f"num_requests={num_requests}, topk={topk}, depth={depth}, "
                             f"budget={budget}")
        if impl not in ("auto", "torch", "triton"):
            raise ValueError(f"impl must be auto, torch or triton, got {impl!r}")
        self.num_requests, self.topk, self.depth, self.budget = num_requests, topk, depth, budget
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.fused = impl == "triton" or (impl == "auto" and self.device.type == "cuda")
        self.capacity = node_capacity(topk, depth)
        self.kept = min(budget, self.capacity)       # output slots that can hold a real node

    @torch.no_grad()
    def grow(self, roots: Tensor, depth_limit: Tensor, step_fn: StepFn) -> DraftForest:
        """Grow from ``roots [R]`` (int64 root tokens) for ``depth_limit [R]`` steps each
        (clamped to ``[0, depth]``), calling ``step_fn`` once per step (``depth`` calls whatever
        the limits, none for budget 1), and keep the best ``budget`` nodes per request.

        No host synchronisation: capturable in a CUDA graph together with ``step_fn``."""
        roots = self._check_index(roots, "roots")
        limit = self._check_index(depth_limit, "depth_limit").clamp(0, self.depth)
        table = NodeTable.empty(roots, self.capacity)
        if self.budget > 1:
            frontier = torch.where(limit[:, None] > 0, 0, -1)
            for step in range(self.depth):
                tokens, probs = step_fn(step, frontier, table)
                self._check_proposals(step, frontier, tokens, probs)
                tokens, probs = tokens.to(self.device, torch.int64), probs.to(self.device)
                if self.fused:
                    frontier = grow_step(table, step, step_slots(self.topk, step)[0], frontier,
                                         tokens, probs, limit, self.topk)
                else:
                    self._add_children(table, step, frontier, tokens, probs)
                    frontier = torch.where(limit[:, None] > step + 1,
                                           self._next_frontier(table, step), -1)
        return self._rerank(table)

    # ---- argument checks (shapes and dtypes only: host metadata, no synchronisation) ----
    def _check_index(self, x: Tensor, name: str) -> Tensor:
        if not isinstance(x, Tensor) or x.shape != (self.num_requests,):
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a tensor of shape [{self.num_requests}] (one per "
                             f"request), got {shape}")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
        return x.to(self.device, torch.int64)

    def _check_proposals(self, step: int, frontier: Tensor, tokens: Tensor, probs: Tensor) -> None:
        want = (*frontier.shape, self.topk)
        if not isinstance(tokens, Tensor) or not isinstance(probs, Tensor):
            raise ValueError(f"step_fn must return two tensors (tokens, probs), got "
                             f"{type(tokens).__name__} and {type(probs).__name__}")
        if tokens.shape != want or probs.shape != want:
            raise ValueError(f"step_fn at step {step} must return tokens and probs of shape "
                             f"{list(want)} ([R, frontier nodes, topk]), got "
                             f"{list(tokens.shape)} and {list(probs.shape)}")

    # ---- growth ----
    def _add_children(self, table: NodeTable, step: int, frontier: Tensor, tokens: Tensor,
                      probs: Tensor) -> None:
        """Write the proposals of ``frontier [R, K]`` into the step's slots of ``table``.

        Frontier node f's proposal j goes to slot ``lo + f * topk + j``: creation order is
        frontier order, then proposal rank."""
        R, C = table.tokens.shape
        lo, n = step_slots(self.topk, step)
        parent = frontier[:, :, None].expand(-1, -1, self.topk).reshape(R, n)
        tokens, probs = tokens.reshape(R, n), probs.reshape(R, n)
        # a NaN probability is a missing proposal; the rest are clamped to [0, 1], so that rho
        # never grows down a path and the kept nodes stay connected to the root
        live = (parent >= 0) & (tokens >= 0) & ~torch.isnan(probs)
        probs = torch.nan_to_num(probs, nan=0.0).clamp(0.0, 1.0)
        safe = parent.clamp(min=0)
        # rho in float64 of the float32 probabilities, as the host multiplies Python floats
        rho = torch.gather(table.rho, 1, safe) * probs.to(torch.float64)
        block = slice(lo, lo + n)
        table.tokens[:, block] = torch.where(live, tokens, 0)
        table.parents[:, block] = torch.where(live, parent, -1)
        table.depth[:, block] = torch.where(live, step + 1, 0)
        table.rho[:, block] = torch.where(live, rho, 0.0)
        table.live[:, block] = live
        # a node's ancestors are its parent's plus itself; slots not created keep only themselves
        inherited = torch.gather(table.ancestors, 1, safe[:, :, None].expand(R, n, C))
        own = torch.arange(C, device=parent.device) == torch.arange(
            lo, lo + n, device=parent.device)[:, None]                           # [n, C]
        table.ancestors[:, block] = (inherited & live[:, :, None]) | own

    def _next_frontier(self, table: NodeTable, step: int) -> Tensor:
        """``[R, topk]`` slots of the ``topk`` best nodes created at ``step`` (highest rho, ties
        by creation order), best first; -1 where fewer were created."""
        lo, n = step_slots(self.topk, step)
        key = _rank_key(table.rho[:, lo:lo + n], table.live[:, lo:lo + n])
        order = torch.sort(key, dim=1, stable=True).indices[:, :self.topk]
        live = torch.gather(table.live[:, lo:lo + n], 1, order)
        return torch.where(live, order + lo, -1)

    # ---- rerank ----
    def _rerank(self, table: NodeTable) -> DraftForest:
        """Keep the root and the budget - 1 best nodes; lay them out level by level."""
        if self.fused:
            tokens, rho, source, parents, valid = rerank(table, self.kept, self.budget, self.depth)
            forest = DenseForest.from_parents(parents, valid, max_depth=self.depth)
            return DraftForest(tokens, rho, source, forest, table)
        R, C = table.tokens.shape
        Tk, dev = self.kept, table.tokens.device
        # rank every slot by (-rho, creation order); the root first. Depth needs no key of its
        # own: slots are grouped by step, so creation order already sorts shallower nodes first
        # among equal rho, as the host's (-rho, depth, index) does.
        key = _rank_key(table.rho, table.live)
        key = torch.where(torch.arange(C, device=dev) == 0, -_INF, key)
        slot = torch.sort(key, dim=1, stable=True).indices[:, :Tk]        # [R, Tk] by rank
        kept = torch.gather(table.live, 1, slot)
        pos = self._layout(table, slot, kept)
        # scatter the rank-ordered nodes to their positions (pos is a permutation of 0..Tk-1)
        place = lambda x: torch.empty_like(x).scatter_(1, pos, x)  # noqa: E731
        source = place(torch.where(kept, slot, -1))
        valid = place(kept)
        safe = source.clamp(min=0)
        tokens = torch.where(valid, torch.gather(table.tokens, 1, safe), 0)
        rho = torch.where(valid, torch.gather(table.rho, 1, safe), 0.0)
        parent_slot = torch.where(valid, torch.gather(table.parents, 1, safe), -1)
        slot_pos = _slot_positions(C, slot, kept, pos)
        parents = torch.where(parent_slot >= 0,
                              torch.gather(slot_pos, 1, parent_slot.clamp(min=0)), -1)
        tokens, rho, source, parents, valid = (
            _pad(x, self.budget, fill) for x, fill in
            ((tokens, 0), (rho, 0.0), (source, -1), (parents, -1), (valid, False)))
        forest = DenseForest.from_parents(parents, valid, max_depth=self.depth)
        return DraftForest(tokens, rho, source, forest, table)

    def _layout(self, table: NodeTable, slot: Tensor, kept: Tensor) -> Tensor:
        """``[R, Tk]`` output position of each ranked node: by (depth, parent's position,
        rank), kept nodes before the rest.

        Each pass sorts by the parents' positions from the previous pass. The number of nodes per
        level does not depend on the order, so a level whose nodes are in the right relative
        order lands at its final positions. The starting order (rank) is already right for
        levels 0 and 1 (one root; depth-1 nodes are all its children, ordered by rank), and pass
        d makes level d + 1 right, so ``depth - 1`` passes suffice."""
        Tk = slot.shape[1]
        rank = torch.arange(Tk, device=slot.device).expand_as(slot)
        level = torch.where(kept, torch.gather(table.depth, 1, slot), self.depth + 1)
        parent_slot = torch.where(kept, torch.gather(table.parents, 1, slot), -1)
        pos = rank
        for _ in range(self.depth - 1):
            slot_pos = _slot_positions(table.capacity, slot, kept, pos)
            parent_pos = torch.where(parent_slot >= 0,
                                     torch.gather(slot_pos, 1, parent_slot.clamp(min=0)), -1)
            # one int64 key per node, unique through the rank term
            key = (level * (Tk + 1) + parent_pos + 1) * Tk + rank
            pos = (key[:, None, :] < key[:, :, None]).sum(-1)              # its place in key order
        return pos


def _rank_key(rho: Tensor, live: Tensor) -> Tensor:
    """Ascending sort key: -rho for created nodes, +inf for the rest. ``0.0 - rho`` turns
    rho = 0 into +0.0 (not -0.0), so that radix sorts see equal keys for equal rho."""
    return torch.where(live, 0.0 - rho, _INF)


def _slot_positions(capacity: int, slot: Tensor, kept: Tensor, pos: Tensor) -> Tensor:
    """``[R, C + 1]``: the position of each kept slot's node, -1 elsewhere (column C is a dump
    for the ranked entries that are not kept; it is never read)."""
    R = slot.shape[0]
    out = torch.full((R, capacity + 1), -1, dtype=torch.int64, device=slot.device)
    return out.scatter_(1, torch.where(kept, slot, capacity), pos)


def _pad(x: Tensor, width: int, fill) -> Tensor:
    """``x [R, n]`` padded on the right with ``fill`` to ``[R, width]`` (static shapes)."""
    if x.shape[1] >= width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)

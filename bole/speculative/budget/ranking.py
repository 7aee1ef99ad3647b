"""Which draft nodes a round verifies under a batch-shared budget, chosen on the device.

Every request's draft tree competes for one budget of draft nodes (roots are always verified and
not counted). :func:`select_nodes` keeps

1. every request's root;
2. the floor: the ``root_floor`` best children of every root (all of them when it has fewer),
   kept even when the floors together exceed the budget;
3. the rest of the budget, ``max(budget - floors, 0)`` nodes, from the other draft nodes of the
   whole batch in *rank order*.

**Rank order** is ascending ``(-score, depth, index)``: highest score first, ties broken parent
first (smaller depth), then by index into the packed node list. A node's score is the smallest
rho on its path from its root's child down to itself; for cumulative draft probabilities (rho
never increases down a path) that is rho itself. Root children are ranked the same way when the
floors are picked, per root.

**Ancestor closure.** For a draft node ``c`` with draft parent ``p``: ``score(p) >= score(c)``
(the path minimum of a longer path is smaller) and ``depth(p) < depth(c)``, so ``p`` comes
strictly before ``c`` in rank order, equal scores included. Hence every prefix of the rank order
is ancestor-closed, and so is the kept set: a kept non-floor node's parent is a root (kept), a
floor node (kept), or an earlier non-floor node (inside the prefix that was taken). Inputs whose
rho increases somewhere down a path are ranked by the path minimum, which is what keeps them
closed; their children can then never outrank them. NaN rho counts as -inf.

Everything is fixed-shape tensor code without host synchronisation (sorts, cumsums, gathers,
scatters; no ``.item()``, no boolean indexing), so it runs inside a CUDA graph; ``budget`` may be
a 0-d device tensor that changes between replays. The dense layout caps a global budget per row
(:func:`cap_rows`): at a verify width ``W`` a row holds its root and ``W - 1`` draft nodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Union

import torch
from torch import Tensor

from bole.forest import DenseForest

__all__ = ["Budget", "Ranking", "rank_nodes", "select_nodes", "cap_rows", "dense_inputs",
           "rank_dense", "select_dense", "Compacted", "compact", "safe_width"]

#: a budget of draft nodes: a host int, or a 0-d tensor on the forest's device
Budget = Union[int, Tensor]
_INF = float("inf")


# ---- ranking ----
@dataclass
class Ranking:
    """The order in which draft nodes win budget (module docstring), over ``N`` packed nodes.

    order:    ``[N]`` int64 node indices in rank order: ascending ``(-score, depth, index)``
              (roots and padding score -inf; they sort with the lowest draft nodes but are
              never eligible).
    eligible: ``[N]`` bool in rank order: a draft node outside the floors.
    root:     ``[N]`` bool per node: a request's root.
    floor:    ``[N]`` bool per node: one of its root's ``root_floor`` best children.
    score:    ``[N]`` per node: the path minimum of rho (-inf for roots and padding).
    """

    order: Tensor
    eligible: Tensor
    root: Tensor
    floor: Tensor
    score: Tensor


def _jump_steps(max_depth: int) -> int:
    """Pointer-jumping steps that reach the root from depth ``max_depth``: ``2**s >= depth``."""
    return max(0, max_depth - 1).bit_length()


def _path_min_and_depth(rho: Tensor, parents: Tensor, draft: Tensor,
                        steps: int) -> tuple[Tensor, Tensor]:
    """``(score [N], depth [N])`` by pointer jumping.

    Invariant: ``low[i]`` is the minimum rho over the draft nodes from ``i`` up to, not
    including, ``anc[i]``, and ``depth[i]`` the number of hops to ``anc[i]``. Roots and padding
    point to themselves with ``low = +inf`` and depth 0, so each step doubles the hops until every
    node points at its root. ``steps`` must satisfy ``2**steps >= max depth``."""
    node = torch.arange(rho.shape[0], device=rho.device)
    anc = torch.where(draft, parents, node)
    low = torch.where(draft, rho, _INF)
    depth = draft.to(torch.int64)
    for _ in range(steps):
        low = torch.minimum(low, low.gather(0, anc))
        depth = depth + depth.gather(0, anc)
        anc = anc.gather(0, anc)
    return torch.where(draft, low, -_INF), depth


def _floors(order: Tensor, root_child: Tensor, parents: Tensor, root_floor: int) -> Tensor:
    """``[N]`` bool: the ``root_floor`` first root children of every root in rank ``order``.

    A stable sort by parent groups each root's children, keeping their rank order; a node's rank
    among its siblings is its distance to the start of its group (a cummax of group starts)."""
    N = order.shape[0]
    child = root_child.gather(0, order)
    group = torch.where(child, parents.gather(0, order), N)
    by_group = torch.sort(group, stable=True).indices
    g = group.gather(0, by_group)
    pos = torch.arange(N, device=order.device)
    start = torch.ones_like(child)
    start[1:] = g[1:] != g[:-1]
    first = torch.cummax(torch.where(start, pos, 0), 0).values
    in_floor = child.gather(0, by_group) & (pos - first < root_floor)
    return torch.zeros_like(child).scatter(0, order.gather(0, by_group), in_floor)


def rank_nodes(rho: Tensor, parents: Tensor, request_of_node: Tensor, root_floor: int = 1, *,
               max_depth: int | None = None) -> Ranking:
    """Rank a packed forest's draft nodes and pick the floors (see the module docstring).

    rho:             ``[N]`` float cumulative draft probability (roots' values are ignored).
    parents:         ``[N]`` int64 parent's index into the packed list, -1 for roots and padding.
    request_of_node: ``[N]`` int64 owning request, -1 for padding (never kept, never counted).
    max_depth:       bound on every tree's depth (sizes the pointer jumping; default ``N - 1``).
    """
    _check_inputs(rho, parents, request_of_node, root_floor)
    N = rho.shape[0]
    valid = request_of_node >= 0
    draft = valid & (parents >= 0)
    root = valid & (parents < 0)
    safe_parent = torch.where(draft, parents, 0)
    clean = torch.where(torch.isnan(rho), -_INF, rho)
    steps = _jump_steps(N - 1 if max_depth is None else max_depth)
    score, depth = _path_min_and_depth(clean, safe_parent, draft, steps)
    # rank order: a stable sort by depth, then a stable sort by -score (0.0 - x turns -0.0 into
    # +0.0 so that radix sorts see equal keys for equal scores)
    by_depth = torch.sort(depth, stable=True).indices
    key = (0.0 - score).gather(0, by_depth)
    order = by_depth.gather(0, torch.sort(key, stable=True).indices)
    root_child = draft & root.gather(0, safe_parent)
    floor = _floors(order, root_child, safe_parent, root_floor)
    eligible = (draft & ~floor).gather(0, order)
    return Ranking(order, eligible, root, floor, score)


def select_nodes(rho: Tensor, parents: Tensor, request_of_node: Tensor, budget: Budget,
                 root_floor: int = 1, *, max_depth: int | None = None) -> Tensor:
    """``[N]`` bool keep mask over a packed forest: roots, floors, then the best draft nodes.

    Shapes as in :func:`rank_nodes`. ``budget`` counts draft nodes over the whole batch (an int
    or a 0-d tensor on the forest's device; negative counts as 0). The result is
    ancestor-closed, holds every root and the floors, and keeps exactly
    ``max(floors, min(budget, draft nodes))`` draft nodes. No host synchronisation."""
    return _keep(rank_nodes(rho, parents, request_of_node, root_floor, max_depth=max_depth),
                 budget)


def _keep(rank: Ranking, budget: Budget) -> Tensor:
    """``[N]`` bool: the roots, the floors and the first ``budget - floors`` eligible nodes."""
    _check_budget(budget)
    rest = (budget - rank.floor.sum()).clamp(min=0)
    taken = rank.eligible & (torch.cumsum(rank.eligible, 0) <= rest)
    return rank.root | rank.floor | torch.zeros_like(taken).scatter(0, rank.order, taken)


def _by_row(rank: Ranking, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """A dense ranking regrouped by row: ``(by_row [N], eligible [R, T], position [R, T])``,
    ``by_row`` the rank positions in row order (a stable sort of the rank order by row: row r's
    nodes fill slots ``[r T, (r + 1) T)``), ``eligible`` the eligible flags in that order and
    ``position`` each eligible node's 1-based place among its row's (0 for the others)."""
    T = rank.root.shape[0] // rows
    by_row = torch.sort(rank.order // T, stable=True).indices
    eligible = rank.eligible.gather(0, by_row).view(rows, T)
    return by_row, eligible, torch.where(eligible, torch.cumsum(eligible, 1), 0)


def cap_rows(rank: Ranking, rows: int, width: int) -> Ranking:
    """``rank`` with each row's eligible nodes cut to those that fit a verify ``width`` beside the
    row's root and floors: its first ``width - 1 - floors`` eligible nodes in rank order (a prefix
    of the row's rank order, so still ancestor-closed). :func:`_keep` of the result is the global
    budget taken in rank order among what every row can hold. ``rank`` ranks a ``rows x T``
    dense layout (:func:`rank_dense`). No synchronisation."""
    T = rank.root.shape[0] // rows
    by_row, eligible, position = _by_row(rank, rows)
    room = (width - 1 - rank.floor.view(rows, T).sum(1)).clamp(min=0)
    fits = (eligible & (position <= room[:, None])).reshape(-1)
    capped = torch.zeros_like(rank.eligible).scatter(0, by_row, fits)
    return Ranking(rank.order, capped, rank.root, rank.floor, rank.score)


def dense_inputs(forest: DenseForest, active: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(parents [R*T], request_of_node [R*T])`` of a dense forest for :func:`rank_nodes`.

    Rows with ``active [R] == False`` (a bucket's dummy rows) become padding: they take no budget
    and count no request."""
    R, T = forest.parents.shape
    row = torch.arange(R, device=forest.parents.device)[:, None].expand(R, T)
    live = forest.valid if active is None else forest.valid & active[:, None]
    return forest.parent_global(), torch.where(live, row, -1).reshape(-1)


def rank_dense(rho: Tensor, forest: DenseForest, root_floor: int = 1,
               active: Tensor | None = None) -> Ranking:
    """:func:`rank_nodes` over the dense layout (inputs as in :func:`select_dense`), for callers
    that both select and estimate (the goodput policy ranks once for both). On CUDA it runs as
    two Triton launches (:mod:`bole.ops.rank.kernel`), equal to this torch code;
    ``BOLE_RANK_KERNEL=0`` in the environment keeps the torch code there too."""
    R, T = forest.parents.shape
    if rho.shape != (R, T):
        raise ValueError(f"rho {tuple(rho.shape)} must match the forest's [R, T] = {[R, T]}")
    if rho.device.type == "cuda" and os.environ.get("BOLE_RANK_KERNEL", "1") != "0":
        from bole.ops.rank.kernel import rank_dense_triton
        return Ranking(*rank_dense_triton(rho, forest.parents, forest.valid, active, root_floor,
                                          forest.max_depth))
    parents, request = dense_inputs(forest, active)
    return rank_nodes(rho.reshape(-1), parents, request, root_floor, max_depth=forest.max_depth)


def select_dense(rho: Tensor, forest: DenseForest, budget: Budget, root_floor: int = 1,
                 active: Tensor | None = None, rank: Ranking | None = None,
                 row_width: int | None = None) -> Tensor:
    """``[R, T]`` keep mask of :func:`select_nodes` over the dense layout.

    rho: ``[R, T]`` cumulative draft probability (a :class:`DraftForest`'s ``rho``).
    active: optional ``[R]`` bool; an inactive row keeps only its root slot 0 (so that the
    forward stays well-formed) and takes no budget. rank: :func:`rank_dense` of the same
    inputs, when the caller has it. row_width: when given, each row keeps at most what a verify
    of that width holds (:func:`cap_rows`; floors beyond it are still kept)."""
    R, T = forest.parents.shape
    if rank is None:
        rank = rank_dense(rho, forest, root_floor, active)
    if row_width is not None:
        rank = cap_rows(rank, R, row_width)
    keep = _keep(rank, budget).view(R, T)
    if active is not None:
        keep[:, 0] |= forest.valid[:, 0] & ~active
    return keep


@dataclass
class Compacted:
    """Each row's kept nodes moved to its front, in a narrower fixed width W.

    tokens:  ``[R, W]`` int64 (0 for padding).
    parents: ``[R, W]`` int64 local parent in the new row, -1 for roots and padding.
    valid:   ``[R, W]`` bool.
    source:  ``[R, W]`` int64 slot of the node in the input row, -1 for padding.
    """

    tokens: Tensor
    parents: Tensor
    valid: Tensor
    source: Tensor

    def gather(self, x: Tensor, fill=0) -> Tensor:
        """Any per-node tensor ``x [R, T, ...]`` in the compacted layout ``[R, W, ...]``."""
        R, W = self.source.shape
        index = self.source.clamp(min=0).view(R, W, *([1] * (x.dim() - 2)))
        out = torch.gather(x, 1, index.expand(R, W, *x.shape[2:]))
        mask = self.valid.view(R, W, *([1] * (x.dim() - 2)))
        return torch.where(mask, out, fill)

    def forest(self, max_depth: int) -> DenseForest:
        """The compacted rows as a :class:`DenseForest` for the verify forward."""
        return DenseForest.from_parents(self.parents, self.valid, max_depth)


def compact(keep: Tensor, tokens: Tensor, parents: Tensor, width: int | None = None) -> Compacted:
    """Move each row's kept nodes to the front, stable by index, and remap their parents.

    keep, tokens, parents: ``[R, T]`` (``parents`` local, -1 for roots and padding; every row
    topologically ordered, parents before children, as every Bole forest is; ``keep``
    ancestor-closed, as :func:`select_dense` returns it). ``width`` (default T) is the static
    output width W; kept nodes past it are dropped, which drops a suffix of a topological order
    and so leaves the rest ancestor-closed (:func:`safe_width` gives a W that never drops). The
    stable order of a topological row is again topological. No host synchronisation: the j-th
    output slot's source is found by a search in the row's running count of kept nodes."""
    if keep.dim() != 2 or tokens.shape != keep.shape or parents.shape != keep.shape:
        raise ValueError(f"keep {tuple(keep.shape)}, tokens {tuple(tokens.shape)} and parents "
                         f"{tuple(parents.shape)} must all be [R, T]")
    R, T = keep.shape
    W = T if width is None else int(width)
    if W < 1:
        raise ValueError(f"width must be at least 1, got {W}")
    count = torch.cumsum(keep, 1)                                         # [R, T], inclusive
    target = torch.arange(1, W + 1, device=keep.device).expand(R, W).contiguous()
    src = torch.searchsorted(count, target)                               # T when past the end
    valid = src < T
    safe = src.clamp(max=T - 1)
    old_parent = torch.gather(parents, 1, safe)
    new_slot = count - 1                                                  # of every kept node
    new_parent = torch.gather(new_slot, 1, old_parent.clamp(min=0))
    return Compacted(tokens=torch.where(valid, torch.gather(tokens, 1, safe), 0),
                     parents=torch.where(valid & (old_parent >= 0), new_parent, -1),
                     valid=valid, source=torch.where(valid, src, -1))


def safe_width(T: int, max_budget: int, root_floor: int = 1) -> int:
    """The narrowest W for which :func:`compact` never drops a kept node of a row of T slots.

    A row keeps its root plus at most ``max(budget, root_floor)`` draft nodes: if the floors fit
    the budget, all of its draft nodes count against the budget; if not, only floors are kept."""
    return max(1, min(T, 1 + max(int(max_budget), int(root_floor), 0)))


# ---- argument checks (metadata only: no synchronisation) ----
def _check_inputs(rho: Tensor, parents: Tensor, request_of_node: Tensor, root_floor: int) -> None:
    if rho.dim() != 1 or parents.shape != rho.shape or request_of_node.shape != rho.shape:
        raise ValueError(f"rho {tuple(rho.shape)}, parents {tuple(parents.shape)} and "
                         f"request_of_node {tuple(request_of_node.shape)} must all be [N]")
    if not rho.dtype.is_floating_point:
        raise TypeError(f"rho must be floating point, got {rho.dtype}")
    if parents.dtype != torch.int64 or request_of_node.dtype != torch.int64:
        raise TypeError(f"parents and request_of_node must be int64, got {parents.dtype} and "
                        f"{request_of_node.dtype}")
    if not isinstance(root_floor, int) or root_floor < 0:
        raise ValueError(f"root_floor must be an int >= 0, got {root_floor!r}")


def _check_budget(budget: Budget) -> None:
    if isinstance(budget, Tensor):
        if budget.dim() != 0:
            raise ValueError(f"a tensor budget must be 0-d, got shape {tuple(budget.shape)}")
    elif not isinstance(budget, int) or isinstance(budget, bool):
        raise TypeError(f"budget must be an int or a 0-d tensor, got {type(budget).__name__}")

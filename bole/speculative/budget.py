"""Which draft nodes a round verifies: a batch-shared budget, chosen on the device.

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
a 0-d device tensor that changes between replays.

Goodput's helpers: :func:`expected_accepted_curve` prices every global budget of a grid, and
:func:`goodput_best`, :func:`goodput_budget` (device) and :func:`goodput_choice` (host) pick one.
The engine's dense verify (R rows at one width) makes the policy pick a verify width instead and
fill every row to it (:class:`RowFill`, :func:`width_fill_curve`, :func:`width_fill_keep`,
:func:`width_fill_choice`), priced from the calibrated curve by :func:`width_priced_t_ver`.
The same layout caps a global budget per row (:func:`cap_rows`): at a verify width ``W`` a row
holds its root and ``W - 1`` draft nodes, and a budget of ``R (W - 1)`` nodes
(:func:`width_capacity`) is the most that width's verify can take.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Union

import torch
from torch import Tensor

from bole.forest import DenseForest

__all__ = ["Ranking", "rank_nodes", "select_nodes", "dense_inputs", "rank_dense", "select_dense",
           "Compacted", "compact", "safe_width", "expected_accepted_curve", "goodput_rates",
           "goodput_choice", "goodput_best", "goodput_budget", "RowFill", "WidthChoice",
           "width_fill_curve", "width_fill_keep", "width_fill_could_widen", "width_fill_choice",
           "width_priced_t_ver", "width_buckets", "width_bucket", "spread_width",
           "width_capacity", "cap_rows"]

#: a budget of draft nodes: a host int, or a 0-d tensor on the forest's device
Budget = Union[int, Tensor]
#: expected accepted tokens per budget: a callable, a table {N: tokens}, or a list indexed by N
Expected = Union[Callable[[int], float], Mapping[int, float], Sequence[float]]

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


# ---- the dense layout of the engine (R rows x T node slots) ----
def width_buckets(T: int) -> tuple[int, ...]:
    """The verify widths of a round whose trees have ``T`` node slots: powers of two, and T."""
    out, w = [], 2
    while w < T:
        out.append(w)
        w *= 2
    return tuple(out) + (T,)


def width_bucket(need: int, T: int) -> int:
    """The narrowest verify width of :func:`width_buckets` that holds ``need`` nodes a row (the
    tree's ``T``, at most)."""
    return next((w for w in width_buckets(T) if w >= need), T)


def spread_width(rows: int, nodes: int, T: int) -> int:
    """The verify width that ``nodes`` draft nodes spread evenly over ``rows`` rows need: each
    row a root plus ``ceil(nodes / rows)``, in a bucket of :func:`width_buckets`."""
    return width_bucket(1 + -(-nodes // rows), T)


def width_capacity(rows: int, nodes: int, T: int) -> int:
    """The most draft nodes a verify of ``rows`` rows takes at the width that ``nodes`` draft
    nodes spread evenly over them need (:func:`spread_width`): ``rows (W - 1)``. A dense verify
    pads every row to its width, so it costs the same for any count up to this one."""
    if rows < 1 or nodes < 0:
        raise ValueError(f"rows must be >= 1 and nodes >= 0, got {rows} and {nodes}")
    if nodes == 0:
        return 0
    return rows * (spread_width(rows, nodes, T) - 1)


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


# ---- the goodput policy ----
def expected_accepted_curve(rho: Tensor, parents: Tensor | None, request_of_node: Tensor | None,
                            node_grid: Tensor | Sequence[int], root_floor: int = 1, *,
                            acceptance: Callable[[Tensor], Tensor] | None = None,
                            max_depth: int | None = None,
                            rank: Ranking | None = None) -> Tensor:
    """``[G]`` float64 expected accepted tokens if the round kept ``budget = node_grid[g]``.

    Expected tokens = one per request (the bonus token) + the acceptance estimates of the kept
    draft nodes (the EAGLE-2 / Sequoia estimate: a node is accepted with the probability of its
    path). The estimate is the score clamped to [0, 1], mapped by ``acceptance`` when given (a
    fitted :class:`AcceptanceCalibrator`; its output is clamped to [0, 1] too). One ranking
    serves every budget: the kept set of budget n is the floors plus the first ``n - floors``
    eligible nodes, so a prefix sum answers them all. Inputs as in :func:`rank_nodes`; no host
    synchronisation. ``rank``: these inputs' ranking when the caller has it already (then
    ``parents`` and ``request_of_node`` are not read and may be None)."""
    if rank is None:
        rank = rank_nodes(rho, parents, request_of_node, root_floor, max_depth=max_depth)
    est = _estimates(rank, acceptance)
    N, dev = est.shape[0], est.device
    in_rank = torch.where(rank.eligible, est.gather(0, rank.order), 0.0)
    # prefix[k] = estimate of the first k eligible nodes: each eligible node lands at its
    # 1-based position among eligible nodes, the rest add 0 at position 0
    slot = torch.where(rank.eligible, torch.cumsum(rank.eligible, 0), 0)
    prefix = torch.cumsum(torch.zeros(N + 1, dtype=torch.float64, device=dev)
                          .scatter_add(0, slot, in_rank), 0)
    grid = torch.as_tensor(node_grid, device=dev).to(torch.int64)
    floors = rank.floor.sum()
    take = (grid - floors).clamp(0, N)
    base = rank.root.sum().to(torch.float64) + torch.where(rank.floor, est, 0.0).sum()
    return base + prefix.gather(0, take)


def _expected_at(expected: Expected, n: int) -> float:
    if callable(expected):
        return float(expected(n))
    return float(expected[n])


def goodput_rates(expected_accepted: Expected, t_ver: Mapping[int, float],
                  round_overhead_ms: float = 0.0) -> dict[int, float]:
    """Expected tokens per ms of a round verifying N draft nodes, for every N of ``t_ver``.

    ``t_ver`` maps N to the verify forward's time (ms) at this batch; ``round_overhead_ms`` is
    what a speculative round spends besides it (drafting, acceptance) and plain decoding does
    not."""
    if not t_ver:
        raise ValueError("t_ver is empty: the policy needs the measured verify times")
    return {int(n): _expected_at(expected_accepted, int(n)) / (float(t) + round_overhead_ms)
            for n, t in t_ver.items()}


def goodput_choice(expected_accepted: Expected, t_ver: Mapping[int, float], t_dec: float,
                   batch: int, *, round_overhead_ms: float = 0.0,
                   min_gain: float = 1.0) -> tuple[int, bool]:
    """``(N, use_ar)``: the budget that maximises expected tokens per ms, or plain decoding.

    expected_accepted: expected accepted tokens of a round keeping N draft nodes, one bonus token
    per request included (so ``batch`` at N = 0): a callable, ``{N: tokens}`` or a list indexed
    by N. t_ver: ``{N: ms}``, the measured curve at this batch; t_dec: plain decoding's ms.
    The best N is the highest rate, ties to the smaller N. When it is below ``min_gain`` times
    plain decoding's rate ``batch / t_dec``, the whole batch falls back: ``(0, True)``."""
    if t_dec <= 0 or batch < 1:
        raise ValueError(f"need t_dec > 0 and batch >= 1, got t_dec={t_dec}, batch={batch}")
    rates = goodput_rates(expected_accepted, t_ver, round_overhead_ms)
    best = max(rates, key=lambda n: (rates[n], -n))
    if rates[best] < min_gain * batch / t_dec:
        return 0, True
    return best, False


@dataclass
class RowFill:
    """A dense ranking regrouped by row, for filling each row of a verify width.

    position: ``[R, T]`` each eligible node's 1-based place among its row's eligible nodes in rank
              order (0 for the others), in the regrouped order ``by_row`` (a stable sort of the
              rank order by row: row r's nodes fill slots ``[r T, (r + 1) T)``).
    by_row:   ``[N]`` rank positions in that order.
    floors:   ``[R]`` floor nodes per row.
    est:      ``[N]`` float64 acceptance estimate per node (:func:`expected_accepted_curve`'s).
    grouped:  ``[R, T]`` float64 the eligible nodes' estimates in the regrouped order (0 for the
              others).
    sums:     ``[R, T + 1]`` float64, ``sums[r, k]`` the estimates of row r's first k eligible
              nodes.
    eligible: ``[R]`` eligible nodes per row (the most a row can take).
    """

    position: Tensor
    by_row: Tensor
    floors: Tensor
    est: Tensor
    grouped: Tensor
    sums: Tensor
    eligible: Tensor

    @classmethod
    def of(cls, rank: Ranking, rows: int,
           acceptance: Callable[[Tensor], Tensor] | None = None) -> "RowFill":
        """The regrouping of ``rank`` (a ranking of the ``rows x T`` dense layout, as
        :func:`rank_dense` gives), with estimates mapped by ``acceptance`` when given."""
        est = _estimates(rank, acceptance)
        T = rank.root.shape[0] // rows
        by_row, eligible, position = _by_row(rank, rows)
        in_rank = torch.where(rank.eligible, est.gather(0, rank.order), 0.0)
        grouped = in_rank.gather(0, by_row).view(rows, T)
        sums = torch.zeros(rows, T + 1, dtype=torch.float64, device=est.device)
        sums.scatter_add_(1, position, grouped)
        return cls(position, by_row, rank.floor.view(rows, T).sum(1), est, grouped,
                   torch.cumsum(sums, 1), eligible.sum(1))

    def take(self, width: Tensor) -> Tensor:
        """Eligible nodes each row keeps at ``width`` (any shape ``[...]``): ``[..., R]``."""
        room = width.to(torch.int64)[..., None] - 1 - self.floors
        return torch.minimum(room.clamp(min=0), self.eligible)


def width_fill_curve(rank: Ranking, rows: int, widths: Tensor, *,
                     acceptance: Callable[[Tensor], Tensor] | None = None,
                     fill: RowFill | None = None, taken: Tensor | None = None) -> Tensor:
    """``[Wn]`` float64 expected accepted tokens if every row kept its best ``W - 1`` draft
    nodes, for each verify width ``W`` of ``widths [Wn]``.

    A dense forest of ``rows`` rows verifies every row at one width, so the verify costs the
    same whether a row fills it or not: at a width, the most tokens come from filling every
    row. A row's candidates are its floors (kept whatever the width) and then its eligible
    nodes in rank order (a prefix of the rank order restricted to the row: ancestor-closed).
    ``rank`` ranks the ``rows x T`` dense layout (:func:`rank_dense`); estimates as in
    :func:`expected_accepted_curve`; ``fill``: :meth:`RowFill.of` of the same inputs, and
    ``taken`` its :meth:`RowFill.take` of ``widths``, when the caller has them. On the device,
    no synchronisation."""
    fill = fill or RowFill.of(rank, rows, acceptance)
    take = fill.take(widths) if taken is None else taken                         # [Wn, R]
    rows_sums = fill.sums[None].expand(take.shape[0], -1, -1)
    filled = rows_sums.gather(2, take[..., None])[..., 0].sum(1)
    return rank.root.sum().to(torch.float64) + torch.where(rank.floor, fill.est, 0.0).sum() + \
        filled


def width_fill_keep(rank: Ranking, rows: int, width: Tensor | int,
                    fill: RowFill | None = None) -> Tensor:
    """``[rows, T]`` bool: the roots, the floors and each row's best eligible nodes up to
    ``width`` slots a row (a 0-d device tensor or an int), the set :func:`width_fill_curve`
    prices. No synchronisation."""
    fill = fill or RowFill.of(rank, rows)
    N = rank.root.shape[0]
    take = fill.take(torch.as_tensor(width, device=fill.floors.device))          # [R]
    taken = (fill.position > 0) & (fill.position <= take[:, None])
    keep = torch.zeros(N, dtype=torch.bool, device=taken.device)
    keep.scatter_(0, rank.order.gather(0, fill.by_row), taken.reshape(-1))
    return (keep | rank.root | rank.floor).view(rows, N // rows)


def width_fill_could_widen(rank: Ranking, rows: int, widths: Tensor, choice: Tensor,
                           expected: Tensor, t_ver: Tensor, *,
                           acceptance: Callable[[Tensor], Tensor] | None = None,
                           round_overhead_ms: float | Tensor = 0.0,
                           fill: RowFill | None = None, taken: Tensor | None = None,
                           kept: Tensor | None = None) -> Tensor:
    """0-d bool: whether a width wider than ``choice`` could beat it if what lies past each row's
    fill were accepted as often as the row's last kept node. Under the acceptance estimates' own
    model (acceptance a non-decreasing function of rho, which never grows down a path) that is
    the most verifying those nodes could show: a row's estimates do not grow down its rank
    order. A row whose fill keeps no eligible node is bounded by its best floor (every other
    node is a worse root child or lies below one), or 1 without floors. Where it is False,
    verifying the nodes past the fill cannot change the choice unless acceptance falls as rho
    grows, which the estimates cannot represent anyway.

    widths ``[Wn]`` ascending, ``choice`` 0-d (one of them), ``expected`` ``[Wn]``
    (:func:`width_fill_curve` of the same ``rank`` and ``acceptance``), ``t_ver`` ``[Wn]`` ms;
    ``taken`` ``[Wn, R]`` and ``kept`` ``[R]``: ``fill.take`` of ``widths`` and of ``choice``,
    when the caller has them. On the device, no synchronisation."""
    fill = fill or RowFill.of(rank, rows, acceptance)
    T = rank.root.shape[0] // rows
    kept = fill.take(choice) if kept is None else kept                           # [R]
    last = torch.where((fill.position == kept[:, None]) & (kept[:, None] > 0), fill.grouped,
                       0.0).amax(1)
    floor_top = torch.where(rank.floor.view(rows, T), fill.est.view(rows, T), 0.0).amax(1)
    bound = torch.where(kept > 0, last, torch.where(fill.floors > 0, floor_top, 1.0))  # [R]
    taken = fill.take(widths) if taken is None else taken                        # [Wn, R]
    more = (taken - kept[None, :]).clamp(min=0)
    widths = widths.to(torch.int64)
    at = torch.searchsorted(widths, choice.view(1).to(torch.int64))               # [1]
    optimistic = expected.gather(0, at) + (more * bound[None, :]).sum(1)         # [Wn]
    t = t_ver.to(torch.float64) + round_overhead_ms
    return ((widths > choice) & (optimistic / t > expected.gather(0, at) / t.gather(0, at))).any()


@dataclass
class WidthChoice:
    """The goodput policy's choice of a round (:func:`width_fill_choice`).

    width:       0-d int64, the chosen verify width.
    keep:        ``[R, T]`` bool, every row filled to ``min(width, max_width)``.
    kept:        ``[R]`` int64, what each row would keep at ``width`` (roots and floors
                 included): what the next round's verify width follows.
    could_widen: 0-d bool, :func:`width_fill_could_widen`.
    """

    width: Tensor
    keep: Tensor
    kept: Tensor
    could_widen: Tensor


def width_fill_choice(rank: Ranking, rows: int, widths: Tensor, t_ver: Tensor, *,
                      max_width: int | None = None,
                      acceptance: Callable[[Tensor], Tensor] | None = None,
                      round_overhead_ms: float | Tensor = 0.0) -> WidthChoice:
    """The goodput policy's choice in one pass: the width of ``widths [Wn]`` with the most
    expected tokens per ms (its verify ``t_ver [Wn]`` plus ``round_overhead_ms``), the rows
    filled to it (:func:`width_fill_keep`) or to ``max_width`` where that is narrower (the width
    this round's forward was built for: its best nodes in rank order, not the first slots that
    compaction would leave), each row's count at the chosen width, and
    :func:`width_fill_could_widen`. No synchronisation. On CUDA it runs as two Triton launches
    (:mod:`bole.ops.width.kernel`); ``BOLE_WIDTH_KERNEL=0`` in the environment keeps
    this torch code there too."""
    if rank.order.device.type == "cuda" and os.environ.get("BOLE_WIDTH_KERNEL", "1") != "0":
        from bole.ops.width.kernel import width_fill_choice_triton
        return WidthChoice(*width_fill_choice_triton(
            rank.order, rank.eligible, rank.root, rank.floor, rows, widths, t_ver,
            _estimates(rank, acceptance), max_width=max_width,
            round_overhead_ms=round_overhead_ms))
    fill = RowFill.of(rank, rows, acceptance)
    taken = fill.take(widths)                                                     # [Wn, R]
    curve = width_fill_curve(rank, rows, widths, fill=fill, taken=taken)
    width, _ = goodput_best(widths, curve, t_ver, round_overhead_ms=round_overhead_ms)
    drafted = fill.take(width)                                                    # [R]
    widen = width_fill_could_widen(rank, rows, widths, width, curve, t_ver,
                                   round_overhead_ms=round_overhead_ms, fill=fill, taken=taken,
                                   kept=drafted)
    T = rank.root.shape[0] // rows
    kept = rank.root.view(rows, T).sum(1) + fill.floors + drafted
    fill_to = width if max_width is None else torch.clamp(width, max=max_width)
    return WidthChoice(width, width_fill_keep(rank, rows, fill_to, fill=fill), kept, widen)


def width_priced_t_ver(rows: int, node_grid: Sequence[int], t_ver: Sequence[float],
                       width: int) -> float:
    """The verify time (ms) of ``rows`` rows at verify width ``width``, from a profile's curve
    ``t_ver`` over ``node_grid`` (ascending; N nodes spread evenly over ``rows`` rows, each row
    padded to its width bucket): the largest grid point whose even spread fits the width, at
    most ``rows * (width - 1)`` nodes (the first point when none does)."""
    fits = [t for n, t in zip(node_grid, t_ver) if n <= rows * (width - 1)]
    return float(fits[-1] if fits else t_ver[0])


def _estimates(rank: Ranking, acceptance: Callable[[Tensor], Tensor] | None) -> Tensor:
    """``[N]`` float64 acceptance estimate per node: the score clamped to [0, 1] (roots and
    padding 0), mapped by ``acceptance`` when given."""
    est = rank.score.to(torch.float64).clamp(0.0, 1.0)        # -inf (roots, NaN rho) -> 0
    if acceptance is not None:
        est = torch.nan_to_num(acceptance(est).to(torch.float64), nan=0.0).clamp(0.0, 1.0)
    return est


def goodput_best(node_grid: Tensor, expected: Tensor, t_ver: Tensor, *,
                 round_overhead_ms: float | Tensor = 0.0) -> tuple[Tensor, Tensor]:
    """``(choice 0-d int64, its rate 0-d float64)``: the point of ``node_grid`` with the most
    expected tokens per ms, on the device (the round has drafted already, so it never falls
    back).

    node_grid ``[G]`` ascending (budgets, or the engine's verify widths), expected ``[G]``
    (:func:`expected_accepted_curve`, :func:`width_fill_curve`), t_ver ``[G]`` ms. ``argmax``
    takes the first maximum, the smaller point on ties."""
    rate = expected.to(torch.float64) / (t_ver.to(torch.float64) + round_overhead_ms)
    best = torch.argmax(rate).view(1)                  # gathers, not indexing: no .item()
    return node_grid.to(torch.int64).gather(0, best)[0], rate.gather(0, best)[0]


def goodput_budget(node_grid: Tensor, expected: Tensor, t_ver: Tensor, t_dec: float,
                   batch: Tensor | int, *, round_overhead_ms: float = 0.0,
                   min_gain: float = 1.0) -> tuple[Tensor, Tensor]:
    """:func:`goodput_choice` on the device: ``(budget 0-d int64, use_ar 0-d bool)``, the
    budget of :func:`goodput_best`, or 0 with ``use_ar`` when its rate is below ``min_gain``
    times plain decoding's ``batch / t_dec`` (``batch`` an int or a 0-d tensor)."""
    budget, rate = goodput_best(node_grid, expected, t_ver, round_overhead_ms=round_overhead_ms)
    use_ar = rate < min_gain * batch / t_dec
    return torch.where(use_ar, 0, budget), use_ar


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

"""Expected accepted tokens of a kept set, and the goodput policy's choices from them.

:func:`expected_accepted_curve` prices every global budget of a grid, and :func:`goodput_best`,
:func:`goodput_budget` (device) and :func:`goodput_choice` (host) pick one. The engine's dense
verify (R rows at one width) makes the policy pick a verify width instead and fill every row to
it (:class:`RowFill`, :func:`width_fill_curve`, :func:`width_fill_keep`,
:func:`width_fill_choice`), priced from the calibrated curve by
:func:`~bole.speculative.budget.widths.width_priced_t_ver`. No host synchronisation."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Union

import torch
from torch import Tensor

from bole.speculative.budget.ranking import Ranking, _by_row, rank_nodes

__all__ = ["Expected", "expected_accepted_curve", "goodput_rates", "goodput_choice", "RowFill",
           "width_fill_curve", "width_fill_keep", "width_fill_could_widen", "WidthChoice",
           "width_fill_choice", "goodput_best", "goodput_budget"]

#: expected accepted tokens per budget: a callable, a table {N: tokens}, or a list indexed by N
Expected = Union[Callable[[int], float], Mapping[int, float], Sequence[float]]


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

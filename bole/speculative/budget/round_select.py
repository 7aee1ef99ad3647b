"""The device side of a select round: the batch-shared selection (or goodput's width choice)
inside the verify graph, its kept nodes compacted to the front of each row at the round's width."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bole.forest import DenseForest
from bole.speculative.budget.acceptance import AcceptanceCalibrator
from bole.speculative.budget.expected import width_fill_choice
from bole.speculative.budget.ranking import compact, rank_dense, select_dense

__all__ = ["Selected", "Goodput", "select"]


@dataclass
class Selected:
    """The compacted trees a verify forward takes: ``[R, W]`` tokens, the forest, each row's
    kept count before compaction ``[R]`` (what the next round's width follows; for goodput, the
    count at its chosen width, which may exceed this round's W), the kept
    nodes' rho ``[R, W]`` (what the acceptance calibrator learns from) and, for goodput, whether
    verifying the nodes past the fill could change its choice (0-d bool: what decides whether
    exploring can teach anything)."""

    tokens: torch.Tensor
    forest: DenseForest
    kept: torch.Tensor
    rho: torch.Tensor
    widen: torch.Tensor | None = None


@dataclass
class Goodput:
    """The goodput policy's device inputs for one batch bucket: the verify widths a round may
    take ``[Wn]`` (ascending, the last the whole tree), the verify forward's time at each
    ``[Wn]`` (ms, the profile's: :meth:`GoodputPolicy.t_ver_at_width
    <bole.speculative.budget.goodput.GoodputPolicy.t_ver_at_width>`) and a drafting round's
    draft, selection and accept time (0-d, ms, measured)."""

    widths: torch.Tensor
    t_ver: torch.Tensor
    overhead_ms: torch.Tensor

    @classmethod
    def on(cls, device, widths, t_ver) -> "Goodput":
        """Static inputs on ``device`` for the widths and their verify times (host sequences);
        the overhead 0 until a round writes it."""
        return cls(torch.tensor(list(widths), device=device),
                   torch.tensor(list(t_ver), dtype=torch.float64, device=device),
                   torch.zeros((), dtype=torch.float64, device=device))


def select(rho: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
           budget: torch.Tensor, active: torch.Tensor, root_floor: int, width: int,
           max_depth: int, goodput: Goodput | None = None,
           acceptance: AcceptanceCalibrator | None = None,
           row_width: int | None = None) -> Selected:
    """Keep the batch's best ``budget`` draft nodes (``[R, T]`` inputs, ``budget`` a 0-d device
    tensor, inactive rows keep their roots only), each row at most what a verify of
    ``row_width`` holds when that is given, and compact them to ``width`` slots a row.
    With ``goodput`` the verify width is chosen here instead, on the device, from the nodes'
    acceptance estimates (rho, mapped by ``acceptance`` when given), and every row is filled
    to it (to ``width`` where that is narrower)."""
    forest = DenseForest.from_parents(parents, valid, max_depth)
    rho = rho.masked_fill(~valid, 0.0)
    rank = rank_dense(rho, forest, root_floor, active)        # one ranking for both uses
    widen = None
    if goodput is None:
        keep = select_dense(rho, forest, budget, root_floor, active=active, rank=rank,
                            row_width=row_width)
        kept = keep.sum(1)
    else:
        choice = width_fill_choice(rank, rho.shape[0], goodput.widths, goodput.t_ver,
                                   max_width=width, acceptance=acceptance,
                                   round_overhead_ms=goodput.overhead_ms)
        keep, kept, widen = choice.keep, choice.kept, choice.could_widen
        if active is not None:
            idle = forest.valid[:, 0] & ~active
            keep[:, 0] |= idle
            kept = kept + idle
    c = compact(keep, tokens, forest.parents, width=width)
    return Selected(c.tokens, DenseForest.from_parents(c.parents, c.valid, max_depth),
                    kept, c.gather(rho), widen)

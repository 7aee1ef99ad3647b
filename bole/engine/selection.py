"""The batch-shared verification budget in the round: which drafted nodes a verify forward takes.

Policies (``SpecConfig.budget_policy``):

    fixed       every request verifies its whole tree (``budget`` node slots each)
    global      the batch's best ``shared_budget`` draft nodes by cumulative draft probability,
                roots always, at least ``root_floor`` root children per request (TETRIS-style
                fixed capacity)
    calibrated  the same selection with the budget ``B_ver(batch)`` of this GPU's calibration
                profile (:mod:`bole.speculative.calibration`)

The selection (:func:`bole.speculative.budget.select_dense`) runs on the device inside the verify
graph. The forward takes the kept nodes compacted to the front of each row, in a width W picked
from :data:`WIDTHS` by the host from the previous round's largest per-request count (known from
the round's one copy, so no extra synchronisation); a request that keeps more than W nodes this
round loses its lowest-ranked ones (a suffix of a topological order: still a tree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bole.forest import DenseForest
from bole.speculative.budget import compact, select_dense

POLICIES = ("fixed", "global", "calibrated")


def width_buckets(T: int) -> tuple[int, ...]:
    """The verify widths of a round whose trees have ``T`` node slots: powers of two, and T."""
    out, w = [], 2
    while w < T:
        out.append(w)
        w *= 2
    return tuple(out) + (T,)


@dataclass
class Selected:
    """The compacted trees a verify forward takes: ``[R, W]`` tokens, the forest, and each
    row's kept count before compaction ``[R]`` (what the next round's width follows)."""

    tokens: torch.Tensor
    forest: DenseForest
    kept: torch.Tensor


def select(rho: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
           budget: torch.Tensor, active: torch.Tensor, root_floor: int, width: int,
           max_depth: int) -> Selected:
    """Keep the batch's best ``budget`` draft nodes (``[R, T]`` inputs, ``budget`` a 0-d device
    tensor, inactive rows keep their roots only) and compact them to ``width`` slots a row."""
    forest = DenseForest.from_parents(parents, valid, max_depth)
    keep = select_dense(rho.masked_fill(~valid, 0.0), forest, budget, root_floor, active=active)
    c = compact(keep, tokens, forest.parents, width=width)
    return Selected(c.tokens, DenseForest.from_parents(c.parents, c.valid, max_depth),
                    keep.sum(1))


class BudgetPolicy:
    """The host side: the budget of a batch and the width of the next verify."""

    def __init__(self, spec, T: int, profile=None):
        if spec.budget_policy not in POLICIES:
            raise ValueError(f"budget_policy must be one of {POLICIES}, got "
                             f"{spec.budget_policy!r}")
        if spec.budget_policy == "global" and spec.shared_budget < 1:
            raise ValueError("the global policy needs shared_budget >= 1 (draft nodes verified "
                             "per round across the batch)")
        if spec.budget_policy == "calibrated" and profile is None:
            raise ValueError("the calibrated policy needs a calibration profile "
                             "(bole calibrate, or Engine(..., budget_profile=...))")
        self.policy, self.spec, self.T, self.profile = spec.budget_policy, spec, T, profile
        self.widths = width_buckets(T)
        self.last_kept: dict[int, int] = {}

    @property
    def shared(self) -> bool:
        return self.policy != "fixed"

    def budget(self, batch: int) -> int:
        """Draft nodes the batch may verify this round."""
        if self.policy == "global":
            return self.spec.shared_budget
        if self.policy == "calibrated":
            from bole.speculative.calibration import verification_budget
            return verification_budget(self.profile, batch)
        return batch * (self.T - 1)

    def width(self, R: int, batch: int) -> int:
        """The verify width for bucket R: the previous round's largest kept count, else an even
        share of the budget (at least the floor), rounded up to a bucket."""
        if not self.shared:
            return self.T
        need = self.last_kept.get(R)
        if need is None:
            need = 1 + max(self.spec.root_floor, -(-self.budget(batch) // max(batch, 1)))
        return next((w for w in self.widths if w >= need), self.T)

    def observe(self, R: int, kept: list[int]) -> None:
        self.last_kept[R] = max(kept, default=1)

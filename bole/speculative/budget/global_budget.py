"""The global policy: the batch's best ``shared_budget`` draft nodes by cumulative draft
probability, roots always, at least ``root_floor`` root children per request (TETRIS-style fixed
capacity)."""

from __future__ import annotations

from bole.speculative.budget.policy import PolicyBase

__all__ = ["GlobalPolicy"]


class GlobalPolicy(PolicyBase):
    """A fixed number of draft nodes shared by the batch."""

    name = "global"

    def __init__(self, spec, T: int, profile=None):
        if spec.shared_budget < 1:
            raise ValueError("the global policy needs shared_budget >= 1 (draft nodes verified "
                             "per round across the batch)")
        super().__init__(spec, T, profile)

    def budget(self, batch: int) -> int:
        return self.spec.shared_budget

"""The fixed policy: every request verifies its whole tree (``budget`` node slots each)."""

from __future__ import annotations

from bole.speculative.budget.policy import PolicyBase

__all__ = ["FixedPolicy"]


class FixedPolicy(PolicyBase):
    """No shared budget: every round verifies whole trees."""

    name = "fixed"
    shared = False

    def budget(self, batch: int) -> int:
        return batch * (self.T - 1)

"""The calibrated policy: the global selection with the budget ``B_ver(batch)`` of this GPU's
calibration profile (:mod:`bole.speculative.budget.profile`), each request holding at most what
the verify width that ``B_ver`` was measured at holds (:meth:`CalibratedPolicy.row_width`): the
profile priced ``B_ver`` nodes spread evenly at that width, and a request past it would widen
every row's verify."""

from __future__ import annotations

from bole.speculative.budget.policy import PolicyBase, check_profile
from bole.speculative.budget.profile import verification_budget
from bole.speculative.budget.widths import spread_width

__all__ = ["CalibratedPolicy"]


class CalibratedPolicy(PolicyBase):
    """The budget of a calibration profile, per batch."""

    name = "calibrated"

    def __init__(self, spec, T: int, profile=None):
        check_profile(self.name, profile, T)
        super().__init__(spec, T, profile)

    def budget(self, batch: int) -> int:
        return verification_budget(self.profile, batch)

    def row_width(self, R: int) -> int | None:
        """The verify width for bucket ``R``: the width bucket of ``B_ver`` spread evenly over
        the profile's measured batch (where the profile measured its time), at least a root and
        its floors."""
        rows = self.profile.batches[self.profile.row(R)]
        return max(spread_width(rows, self.budget(R), self.T),
                   self._bucket(1 + self.spec.root_floor))

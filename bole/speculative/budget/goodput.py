"""The goodput policy: each round, the verify width with the most expected tokens per ms.

Expected tokens are one per request plus the kept nodes' acceptance estimates; a round's time is
the profile's T_ver at that width plus the measured draft and accept time. The verify is dense,
so a width costs the same however full its rows are: at each width every request keeps its best
nodes up to the width (floors first, then rank order), which beats any global budget verified at
the same width. The choice weighs the round's time with the selection's own measured cost.

Whether to draft at all is decided on the host from what rounds deliver: tokens per request per
ms of wall time, averaged per batch bucket over drafting rounds against plain ones (before a
plain round of the bucket has run, the profile's T_dec plus a drafting round's accept and host
time stand for them; rounds that held a graph capture or paid for a dropped draft are left out;
a bucket's first :data:`FIRST_ROUNDS` rates are averaged by their median, and it falls back only
after that many drafting rounds). When drafting delivers less, the batch decodes plainly for
:data:`AR_ROUNDS` rounds, then drafts one round to look; a look that finds the same doubles the
stretch, up to :data:`AR_ROUNDS_MAX`. One uncertain tree does not stop drafting: a drafted tree
is already paid for, so its round verifies its best width.

A node's acceptance estimate starts at its rho and follows what the rounds observe: an
:class:`~bole.speculative.budget.acceptance.AcceptanceCalibrator` per model and drafter (binned
by rho, monotone), counted in the rounds that learn and refitted every :data:`FIT_EVERY` of
them, on the device. Nodes the choice drops are never verified, so their estimates could not
learn: one drafting round in :data:`EXPLORE_EVERY` verifies whole trees, or fewer where whole
trees' verify costs more than the last choice's (large batches): exploring adds at most
:data:`EXPLORE_SHARE` of the drafting rounds' time (:meth:`GoodputPolicy.explore_every`). It
explores only while the last choice could still change: a wider width must beat it if every node
past each row's fill were accepted as often as the row's last kept node (the estimates' own
model, acceptance non-decreasing in rho, allows no more). Estimates learn in select rounds and
exploring rounds only; a bucket that verifies whole trees anyway never explores (it never
chooses).

After a choice that kept every row's whole tree, :data:`WHOLE_ROUNDS` whole rounds follow before
it chooses again (a plain stretch or another batch bucket ends them); each such choice in a row
doubles the next stretch, up to :data:`WHOLE_ROUNDS_MAX`; a choice that drops nodes or a plain
stretch starts again from WHOLE_ROUNDS. With a device drafter the policy also picks how many
levels a whole round that does not explore grows
(:class:`~bole.speculative.budget.draft_depth.DraftDepth`, from the rows' accepted lengths and the
measured draft time per depth); select and exploring rounds grow every level.
"""

from __future__ import annotations

import math
import statistics

from bole.speculative.budget.draft_depth import DraftDepth, fill_depths
from bole.speculative.budget.policy import PolicyBase, check_profile
from bole.speculative.budget.round_select import Goodput
from bole.speculative.budget.widths import width_priced_t_ver
from bole.speculative.drafters.registry import drafter_info

__all__ = ["GoodputPolicy", "AR_ROUNDS", "AR_ROUNDS_MAX", "FIRST_ROUNDS", "RATE_WEIGHT",
           "LOOK_WEIGHT", "FIT_EVERY", "EXPLORE_EVERY", "EXPLORE_SHARE", "WHOLE_ROUNDS",
           "WHOLE_ROUNDS_MAX"]

#: rounds of plain decoding after the goodput policy finds drafting does not pay; doubled
#: after each look that finds the same, up to AR_ROUNDS_MAX (a look drafts a whole tree)
AR_ROUNDS = 8
AR_ROUNDS_MAX = 128
#: goodput: a batch bucket's first rates (drafting, plain) are averaged by their median, and it
#: falls back to plain decoding only once it has this many drafting rounds (one slow round, a
#: host pause or a dropped draft, is no evidence)
FIRST_ROUNDS = 3
#: weight of the newest round in the goodput policy's averages after the first rounds (a
#: look's: LOOK_WEIGHT)
RATE_WEIGHT = 0.1
LOOK_WEIGHT = 0.5
#: drafting rounds between refits of the goodput policy's acceptance estimates
FIT_EVERY = 8
#: the goodput policy verifies whole trees in one drafting round of this many (what its
#: acceptance estimates learn low-rho nodes from)
EXPLORE_EVERY = 8
#: goodput: the most that exploring rounds add to the drafting rounds' time (by the profile: a
#: whole round's verify beyond the last choice's), a share; where whole trees cost several
#: choices' forwards (large batches) the policy explores less often than every EXPLORE_EVERY
EXPLORE_SHARE = 0.03
#: goodput: whole rounds after a choice that kept every drafted node, before it chooses again;
#: doubled after each choice in a row that keeps every node again, up to WHOLE_ROUNDS_MAX (where
#: whole trees keep winning, the choice's own cost, a selection a stretch, fades)
WHOLE_ROUNDS = 7
WHOLE_ROUNDS_MAX = 56


class GoodputPolicy(PolicyBase):
    """The budget with the most expected tokens per ms, plain decoding when drafting does not
    pay (module docstring)."""

    name = "goodput"
    chooses_width = True

    def __init__(self, spec, T: int, profile=None):
        check_profile(self.name, profile, T)
        super().__init__(spec, T, profile)
        self.ar_rounds_left = 0                  # plain rounds before drafting again
        self.ar_stretch = AR_ROUNDS              # plain rounds after the next fallback
        # draft + accept time and accept + host time of drafting rounds (ms), the tokens per
        # request per ms that drafting and plain rounds delivered, averaged (rates per batch
        # bucket: tokens per request per ms depend on the batch)
        self.overhead_ms = self.plain_extra_ms = 0.0
        self.draft_rate: dict[int, float] = {}
        self.plain_rate: dict[int, float] = {}
        self.looking = False                     # the next drafting round is a look
        self.whole_left: dict[int, int] = {}     # whole rounds before choosing again
        self.whole_stretch: dict[int, int] = {}  # the next whole stretch's length
        self.since_explore: dict[int, int] = {}  # drafting rounds since exploring
        self.could_widen: dict[int, bool] = {}   # what past the fill could still pay
        self._first: dict[tuple[bool, int], list[float]] = {}   # (plain, R): first rates
        self.depth = self._depth_choice(spec, T)

    @staticmethod
    def _depth_choice(spec, T: int) -> DraftDepth | None:
        if spec.mode == "ar" or not drafter_info(spec.drafter).on_device:
            return None
        depths = fill_depths(1 if spec.mode == "chain" else spec.topk, spec.depth, T)
        return DraftDepth(depths) if len(depths) > 1 else None

    def budget(self, batch: int) -> int:
        return max(self.profile.node_grid)

    def _whole_pays(self, R: int) -> bool:
        """Whole trees' verify costs at most the profile's cheapest one plus the selection's
        measured cost, so that no selection's tokens per ms exceed theirs."""
        t_full = self.t_ver_at_width(R, self.T)
        cheapest = min((self.t_ver_at_width(R, w) for w in self.goodput_widths[:-1]),
                       default=t_full)
        return t_full <= cheapest + self.profile.t_select_at(R)

    def t_ver_at_width(self, R: int, width: int) -> float:
        """The profile's verify time (ms) of a round of bucket ``R`` at verify ``width``: its
        measured batch's rows at that width (:func:`~bole.speculative.budget.widths.
        width_priced_t_ver`)."""
        row = self.profile.row(R)
        return width_priced_t_ver(self.profile.batches[row], self.profile.node_grid,
                                  self.profile.t_ver[row], width)

    @property
    def goodput_widths(self) -> tuple[int, ...]:
        """The verify widths goodput chooses from: those that hold a root and its floors (a
        narrower one would be priced below the width its rows need)."""
        return tuple(w for w in self.widths if w >= 1 + self.spec.root_floor) or (self.T,)

    def goodput_inputs(self, R: int, device) -> Goodput:
        """Static device inputs of the goodput choice for bucket R."""
        widths = self.goodput_widths
        return Goodput.on(device, widths, [self.t_ver_at_width(R, w) for w in widths])

    def round_overhead_ms(self, R: int) -> float:
        """What a drafting round of bucket R adds to its verify forward (ms): the measured draft
        and accept time, and the profile's selection time where the bucket selects."""
        select_ms = 0.0 if self.whole_trees(R) else self.profile.t_select_at(R)
        return self.overhead_ms + select_ms

    # ---- exploring and plain stretches ----
    def exploring(self, R: int, since: int | None = None) -> bool:
        """Whether this round of bucket ``R`` (drafting) verifies whole trees for what they
        teach: the last of every :meth:`explore_every` drafting rounds of the bucket, while the
        last choice says that what lies past its fill could still change it. A look (the
        drafting round after a plain stretch) never does: it measures the rounds the policy
        would run. Nor does a round of a bucket that verifies whole trees anyway
        (:meth:`whole_trees`): it never chooses, so its rounds would pay for learning that no
        choice of theirs uses."""
        since = self.since_explore.get(R, 0) if since is None else since
        return (not self.looking and self.could_widen.get(R, True)
                and since >= self.explore_every(R) - 1 and not self.whole_trees(R))

    def _since_explore(self, R: int) -> int:
        return self.since_explore.get(R, 0)

    def explore_every(self, R: int) -> int:
        """Drafting rounds of bucket ``R`` per exploring round: :data:`EXPLORE_EVERY`, or more
        where a whole round's verify (the profile's, at every drafted node) exceeds the last
        choice's by more than :data:`EXPLORE_SHARE` of that many choosing rounds' time."""
        need = self.last_kept.get(R)
        if need is None or self.profile is None:
            return EXPLORE_EVERY
        t_choice = self.t_ver_at_width(R, self._bucket(need))
        extra = self.t_ver_at_width(R, self.T) - t_choice
        round_ms = t_choice + self.round_overhead_ms(R)
        if extra <= 0 or round_ms <= 0:
            return EXPLORE_EVERY
        return max(EXPLORE_EVERY, math.ceil(extra / (EXPLORE_SHARE * round_ms)))

    def plain_round(self) -> bool:
        return self.ar_rounds_left > 0

    def _stretch_whole(self, R: int) -> bool:
        return self.whole_left.get(R, 0) > 0

    def _count_down(self, R: int, kind: str) -> None:
        for other in [n for n in self.whole_left if n != R]:    # a stretch follows its batch
            del self.whole_left[other]
        if kind == "whole" and self.whole_left.get(R, 0) > 0:
            self.whole_left[R] -= 1

    def learns(self, kind: str, R: int) -> bool:
        """Select rounds, and whole rounds that explore."""
        return kind == "select" or (kind == "whole" and self.exploring(R))

    def variants(self, R: int) -> list[tuple[str, int, bool]]:
        cap = self.row_width(R) or self.T
        whole = self.whole_trees(R)
        out = [] if whole else [("select", W, True) for W in self.widths if W <= cap]
        # a bucket of whole trees never explores: no learning whole round
        learning = [] if whole else [("whole", self.T, True)]
        return [("plain", 1, False), ("whole", self.T, False)] + learning + out

    def _first_need(self, R: int) -> int | None:
        """A bucket's first select round follows the nearest bucket that has chosen (by ratio of
        rows, the larger on a tie: a batch that shrinks comes from there): its budget is the
        whole node grid, whose even share would verify whole trees at every batch up to 32
        rows. Its choice fills rows up to that width and reports what it wanted, which the
        next round's width follows."""
        if not self.last_kept:
            return None
        near = min(self.last_kept, key=lambda n: (abs(math.log2(n / R)), -n))
        return self.last_kept[near]

    # ---- after a round ----
    def _observe_choice(self, R: int, could_widen: bool | None) -> None:
        """``could_widen`` (select rounds): whether verifying the nodes past the fill could
        change the choice, at best (:func:`~bole.speculative.budget.expected.
        width_fill_could_widen`); while it is False the bucket does not explore."""
        if could_widen is not None:
            self.could_widen[R] = could_widen

    def _after_kept(self, R: int, kept: list[int]) -> None:
        """A choice keeping all T nodes of every row starts a stretch of whole rounds:
        :data:`WHOLE_ROUNDS`, doubled after each such choice in a row of the bucket, up to
        :data:`WHOLE_ROUNDS_MAX` (a choice that drops nodes, or a plain stretch, starts over; a
        bucket left for another keeps its length for its return)."""
        if min(kept) >= self.T:
            stretch = self.whole_stretch.get(R, WHOLE_ROUNDS)
            self.whole_left[R] = stretch
            self.whole_stretch[R] = min(2 * stretch, WHOLE_ROUNDS_MAX)
        else:
            self.whole_stretch.pop(R, None)

    def after_round(self, R: int, plain: bool, draft_ms: float, accept_ms: float,
                    rate: float, host_ms: float = 0.0, measured: bool = True) -> None:
        """After a round of bucket ``R`` that delivered ``rate`` tokens per request per ms of its
        wall time: count a plain stretch down, or average what drafting delivers at this bucket
        and start a stretch when plain decoding delivers more there (measured, or until a plain
        round of R has run, one decode forward of the profile plus a drafting round's accept and
        host time). ``measured`` False: the round's time holds something else (a graph capture,
        a dropped prelaunched draft) and is not averaged."""
        if plain:
            self.ar_rounds_left -= 1
            if measured:
                self._sample(True, R, rate, RATE_WEIGHT)
            return
        explored = self._explores.pop(R, False)
        self.since_explore[R] = 0 if explored else self.since_explore.get(R, 0) + 1
        if not measured:
            return
        self.overhead_ms = _average(self.overhead_ms, draft_ms + accept_ms)
        self.plain_extra_ms = _average(self.plain_extra_ms, accept_ms + host_ms)
        seen = self._sample(False, R, rate, LOOK_WEIGHT if self.looking else RATE_WEIGHT)
        plain_rate = self.plain_rate.get(R) or \
            1.0 / (self.profile.t_dec_at(R) + self.plain_extra_ms)
        self.looking = seen >= FIRST_ROUNDS and self.draft_rate[R] < plain_rate
        if self.looking:                     # plain for a stretch, then a look that chooses
            self.whole_left.clear()
            self.whole_stretch.clear()
            self.ar_rounds_left = self.ar_stretch
            self.ar_stretch = min(2 * self.ar_stretch, AR_ROUNDS_MAX)
        else:
            self.ar_stretch = AR_ROUNDS

    def _sample(self, plain: bool, R: int, rate: float, weight: float) -> int:
        """Average a round's rate into bucket R's plain or drafting rate: the median of the
        first :data:`FIRST_ROUNDS`, then an exponential average of ``weight``. Returns how
        many rounds the rate holds, up to FIRST_ROUNDS."""
        rates = self.plain_rate if plain else self.draft_rate
        first = self._first.setdefault((plain, R), [])
        if len(first) < FIRST_ROUNDS:
            first.append(rate)
            rates[R] = statistics.median(first)
        else:
            rates[R] = _average(rates[R], rate, weight)
        return len(first)

    def after_whole(self, R: int, depth: int, accepted: list[int], draft_ms: float,
                    rest_ms: float, measured: bool, hidden_ms: float = 0.0) -> None:
        """The depth choice after a whole round of bucket ``R`` grown ``depth`` levels: the
        draft tokens its full-tree rows accepted, its draft time, the rest of its wall time and
        the part of its draft hidden behind the host (ms)."""
        if self.depth is not None:
            self.depth.observe(R, depth, accepted, draft_ms, rest_ms, measured, hidden_ms)


def _average(mean: float | None, x: float, weight: float = RATE_WEIGHT) -> float:
    """An exponential moving average (``weight`` on the newest), started at its first value
    (``mean`` None or 0: nothing averaged yet)."""
    return (1.0 - weight) * mean + weight * x if mean else x

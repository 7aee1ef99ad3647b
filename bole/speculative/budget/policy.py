"""The batch-shared verification budget in the round: which drafted nodes a verify forward takes.

Each round is one of three kinds (:meth:`BudgetPolicy.plan`): "plain" (plain decoding, goodput
only), "select" or "whole". A select round runs the selection
(:func:`~bole.speculative.budget.round_select.select`) on the device inside the verify graph and
takes the kept nodes compacted to the front of each row, in a width W of
:func:`~bole.speculative.budget.widths.width_buckets` picked by the host from the previous select
round's largest per-request count (known from the round's one copy, so no extra
synchronisation). Under a global budget a request that keeps more than W nodes this round loses
those past its first W slots (a suffix of its topological slot order: still a tree); goodput
fills each row to the narrower of its choice and W in rank order, and the next round takes the
width of its choice. A whole round verifies every drafted node without selecting, in the batch
buckets where selecting cannot pay (:meth:`PolicyBase.whole_trees`): where a bucket's budget
covers every drafted node (global, calibrated), or where verifying whole trees costs no more than
the cheapest verify of the profile's grid plus the selection itself (goodput: the expected tokens
of whole trees are at least those of any selection, so their rate is too), when the drafter grows
full trees (host drafters' trees are often small, and compacting them narrows the verify); and
in goodput's exploring rounds and whole stretches (:mod:`~bole.speculative.budget.goodput`).

The round runner holds one policy (:func:`~bole.speculative.budget.registry.make_policy`) and
talks to it through :class:`BudgetPolicy`: before a round :meth:`~BudgetPolicy.plan`,
:meth:`~BudgetPolicy.width`, :meth:`~BudgetPolicy.round_depth` and :meth:`~BudgetPolicy.learns`,
after it :meth:`~BudgetPolicy.observe` (and goodput's timings). :class:`PolicyBase` holds what
every policy shares; a policy overrides the budget and the hooks its own rounds need.
"""

from __future__ import annotations

from typing import Protocol

from bole.speculative.budget.draft_depth import DraftDepth
from bole.speculative.budget.round_select import Goodput
from bole.speculative.budget.widths import width_bucket, width_buckets
from bole.speculative.drafters.registry import drafter_info

__all__ = ["BudgetPolicy", "PolicyBase", "check_profile"]


class BudgetPolicy(Protocol):
    """What the round runner asks of a budget policy (``R``: the round's batch bucket)."""

    name: str
    #: whether the batch shares a budget (every policy but fixed): rounds report kept counts
    shared: bool
    #: whether rounds learn acceptance estimates and the device chooses the verify width
    chooses_width: bool
    #: goodput: the next drafting round is a look after a plain stretch
    looking: bool

    def plan(self, R: int) -> str:
        """This round's kind: "plain", "select" or "whole"; call once per round."""

    def observe(self, R: int, kept: list[int], kind: str = "select",
                could_widen: bool | None = None) -> None:
        """A shared-budget round's kept counts per request (rows that drafted whole trees)."""

    def budget(self, batch: int) -> int:
        """Draft nodes the batch may verify this round."""

    def width(self, R: int, batch: int, kind: str | None = None) -> int:
        """The verify width of a round of ``kind``."""

    def row_width(self, R: int) -> int | None:
        """The most a row may keep (calibrated), or None."""

    def variants(self, R: int) -> list[tuple[str, int, bool]]:
        """Every ``(kind, width, learns)`` a round of bucket ``R`` can run (a graph each)."""

    def learns(self, kind: str, R: int) -> bool:
        """Whether a round of ``kind`` counts its nodes into the acceptance estimates."""

    def draft_depths(self) -> tuple[int, ...]:
        """The depths a device drafter may grow (a draft graph each)."""

    def round_depth(self, R: int) -> int:
        """The draft depth of the round :meth:`plan` gave bucket ``R`` last."""

    def next_depth(self, R: int) -> int:
        """The depth a draft queued before the round's synchronisation grows."""

    def takes_draft(self, R: int, depth: int) -> bool:
        """Whether plan's round may verify a draft queued at ``depth``."""

    def drafts(self, R: int, kind: str, depth: int) -> None:
        """Plan's round verifies a tree grown ``depth`` levels."""

    def goodput_inputs(self, R: int, device) -> Goodput | None:
        """The device inputs of the width choice of bucket ``R`` (None: the policy has none)."""


def check_profile(name: str, profile, T: int) -> None:
    """A calibration profile is given and was measured for trees of ``T`` nodes."""
    if profile is None:
        raise ValueError(f"the {name} policy needs a calibration profile "
                         "(bole calibrate, or Engine(..., budget_profile=...))")
    if profile.tree_nodes != T:
        raise ValueError(f"the budget profile was measured for trees of {profile.tree_nodes} "
                         f"nodes, and this engine's trees have {T}: its verify widths and "
                         "selection times do not apply. Calibrate for this tree (bole "
                         "calibrate with the same --depth, --topk and --budget), or pass a "
                         "profile measured for it")


class PolicyBase:
    """The host side every policy shares: the width of the next verify from the last kept
    counts, the round's kind and draft depth. Subclasses give :meth:`budget` and the hooks."""

    name = ""
    shared = True
    chooses_width = False
    looking = False

    def __init__(self, spec, T: int, profile=None):
        self.spec, self.T, self.profile = spec, T, profile
        self.widths = width_buckets(T)
        self._whole: dict[int, bool] = {}
        self.last_kept: dict[int, int] = {}
        #: goodput with a device drafter: the draft depth of whole rounds (draft_depth.py)
        self.depth: DraftDepth | None = None
        self.deepest = spec.depth if spec.mode != "ar" else 0
        self._round_depth: dict[int, int] = {}   # R: the depth of plan's round
        self._free_depth: set[int] = set()        # R: plan's round may take any depth
        self._explores: dict[int, bool] = {}     # whether plan's round explores (goodput)

    # ---- the budget ----
    def budget(self, batch: int) -> int:
        """Draft nodes the batch may verify this round."""
        raise NotImplementedError

    def row_width(self, R: int) -> int | None:
        """The most a row may keep in bucket ``R`` (None: no cap but the tree)."""
        return None

    def goodput_inputs(self, R: int, device) -> Goodput | None:
        return None

    def whole_trees(self, R: int) -> bool:
        """Whether rounds of bucket ``R`` verify whole trees, without the selection (module
        docstring)."""
        if R not in self._whole:
            self._whole[R] = self._whole_trees(R)
        return self._whole[R]

    def _whole_trees(self, R: int) -> bool:
        drafted = self.T - 1
        if not self.shared or drafted < 1:
            return True
        if not drafter_info(self.spec.drafter).on_device:
            # device drafters grow every tree to its full size, host trees are often small:
            # compacting them narrows the verify
            return False
        return self._whole_pays(R)

    def _whole_pays(self, R: int) -> bool:
        """With full trees: every batch of up to ``R`` requests may keep all its draft nodes
        (then the selection keeps them all)."""
        drafted = self.T - 1
        return all(self.budget(n) >= n * drafted for n in range(1, R + 1))

    # ---- the round's kind and depth ----
    def exploring(self, R: int, since: int | None = None) -> bool:
        """Whether this round verifies whole trees for what they teach (goodput)."""
        return False

    def plain_round(self) -> bool:
        """Whether this round decodes plainly (goodput found drafting does not pay)."""
        return False

    def _stretch_whole(self, R: int) -> bool:
        """Whether bucket ``R`` is inside a stretch of whole rounds (goodput)."""
        return False

    def _count_down(self, R: int, kind: str) -> None:
        """Plan's bookkeeping of stretches before a round of ``kind`` (goodput)."""

    def plan(self, R: int) -> str:
        """This round's kind for bucket ``R``: "plain", "select" or "whole" (see the module
        docstring). Call once per round, before it runs: a whole stretch counts down here."""
        kind = self._kind(R)
        self._explores[R] = kind == "whole" and self.exploring(R)
        self._count_down(R, kind)
        depth = self._depth_of(R, kind, self._explores[R])
        self._round_depth[R] = depth
        if self.depth is not None and kind == "whole" and not self._explores[R]:
            self._free_depth.add(R)
        else:
            self._free_depth.discard(R)
        return kind

    def _kind(self, R: int, since: int | None = None) -> str:
        """The kind :meth:`plan` gives bucket ``R`` now, without counting anything down
        (``since``: the drafting rounds since it explored, if not the count now)."""
        if self.plain_round():
            return "plain"
        if self._stretch_whole(R) or self.whole_trees(R) or self.exploring(R, since):
            return "whole"
        return "select"

    def _depth_of(self, R: int, kind: str, explores: bool) -> int:
        """The draft depth of a round of ``kind``: goodput's choice for a whole round that does
        not explore, else the deepest (a select round chooses from every level, an exploring
        round teaches the estimates of every level)."""
        if self.depth is None or kind != "whole" or explores:
            return self.deepest
        return self.depth.depth(R)

    def draft_depths(self) -> tuple[int, ...]:
        """The depths a device drafter may grow (a draft graph each)."""
        return self.depth.depths if self.depth is not None else (self.deepest,)

    def round_depth(self, R: int) -> int:
        """The draft depth of the round :meth:`plan` gave bucket ``R`` last."""
        return self._round_depth.get(R, self.deepest)

    def next_depth(self, R: int) -> int:
        """The draft depth of bucket ``R``'s next round if this drafting round changes nothing
        (what a draft queued before the round's synchronisation grows)."""
        since = 0 if self._explores.get(R, False) else self._since_explore(R) + 1
        kind = self._kind(R, since)
        return self._depth_of(R, kind, kind == "whole" and self.exploring(R, since))

    def _since_explore(self, R: int) -> int:
        return 0

    def takes_draft(self, R: int, depth: int) -> bool:
        """Whether plan's round of bucket ``R`` may verify a draft queued at ``depth``: one of its
        own depth, or any for a whole round that does not explore (every tree is verified
        exactly; a select round chooses from, and an exploring round learns, every level)."""
        return depth == self.round_depth(R) or R in self._free_depth

    def drafts(self, R: int, kind: str, depth: int) -> None:
        """Plan's round of bucket ``R`` verifies a tree grown ``depth`` levels (its own draft, or
        one queued before it): a whole round's counts towards the next probe."""
        if self.depth is not None and kind == "whole":
            self.depth.planned(R, depth)

    def learns(self, kind: str, R: int) -> bool:
        """Whether a round of this kind and bucket ``R`` counts its nodes into the acceptance
        estimates (goodput)."""
        return False

    # ---- the verify width ----
    def variants(self, R: int) -> list[tuple[str, int, bool]]:
        """Every ``(kind, width, learns)`` a round of bucket ``R`` can run (a graph each)."""
        cap = self.row_width(R) or self.T
        whole = self.whole_trees(R)
        out = [] if whole else [("select", W, False) for W in self.widths if W <= cap]
        return out or [("whole", self.T, False)]

    def width(self, R: int, batch: int, kind: str | None = None) -> int:
        """The verify width of a round of ``kind`` (None: the kind :meth:`plan` would give, its
        stretch not counted down): 1 plain, the tree whole, else the previous select round's
        largest kept count, or an even share of the budget (at least the floor), rounded up to
        a bucket (at most :meth:`row_width`)."""
        kind = kind or self._kind(R)
        if kind == "plain":
            return 1
        if kind == "whole":
            return self.T
        need = self.last_kept.get(R)
        if need is None:
            need = self._first_need(R)
        if need is None:
            need = 1 + max(self.spec.root_floor, -(-self.budget(batch) // max(batch, 1)))
        return min(self._bucket(need), self.row_width(R) or self.T)

    def _first_need(self, R: int) -> int | None:
        """The count a bucket's first select round follows, when not an even share (goodput)."""
        return None

    def _bucket(self, need: int) -> int:
        """The narrowest verify width that holds ``need`` nodes a row (the tree's, at most)."""
        return width_bucket(need, self.T)

    def observe(self, R: int, kept: list[int], kind: str = "select",
                could_widen: bool | None = None) -> None:
        """The kept counts of a round of bucket R, of the rows that drafted whole trees (the
        caller leaves out a request within a tree's depth of its token limit: its shallower
        tree says nothing of the next round's). A select round's set the next one's width.
        Whole rounds' counts say nothing of the next choice; nor does a select round with no
        counts (every row drafted a tree cut short by its token limit): the last ones stay."""
        if kind != "select" or not kept:
            return
        self._observe_choice(R, could_widen)
        self.last_kept[R] = max(kept)
        self._after_kept(R, kept)

    def _observe_choice(self, R: int, could_widen: bool | None) -> None:
        """Goodput: whether verifying past the fill could change the choice."""

    def _after_kept(self, R: int, kept: list[int]) -> None:
        """Goodput: a choice that kept whole trees starts a whole stretch."""

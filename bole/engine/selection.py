"""The batch-shared verification budget in the round: which drafted nodes a verify forward takes.

Policies (``SpecConfig.budget_policy``):

    fixed       every request verifies its whole tree (``budget`` node slots each)
    global      the batch's best ``shared_budget`` draft nodes by cumulative draft probability,
                roots always, at least ``root_floor`` root children per request (TETRIS-style
                fixed capacity)
    calibrated  the same selection with the budget ``B_ver(batch)`` of this GPU's calibration
                profile (:mod:`bole.speculative.calibration`), each request holding at most what
                the verify width that ``B_ver`` was measured at holds (:meth:`BudgetPolicy.
                row_width`): the profile priced ``B_ver`` nodes spread evenly at that width, and
                a request past it would widen every row's verify
    goodput     each round, the verify width that maximises expected tokens (one per request
                plus the kept nodes' acceptance estimates) per ms of the round (the profile's
                T_ver at that width, plus the measured draft and accept time). The verify is
                dense, so a width costs the same however full its rows are: at each width every
                request keeps its best nodes up to the width (floors first, then rank order),
                which beats any global budget verified at the same width. Whether to draft at all
                is decided on the host from what rounds deliver: tokens per request per ms of wall
                time, averaged per batch bucket over drafting rounds against plain ones (before a
                plain round of the bucket has run, the profile's T_dec plus a drafting round's
                accept and host time stand for them; rounds that held a graph capture or paid for
                a dropped draft are left out; a bucket's first :data:`FIRST_ROUNDS` rates are
                averaged by their median, and it falls back only after that many drafting rounds).
                When drafting delivers less, the batch decodes plainly for
                :data:`AR_ROUNDS` rounds, then drafts one round to look; a look that finds the same
                doubles the stretch, up to :data:`AR_ROUNDS_MAX`. One uncertain tree does not stop
                drafting: a drafted tree is already paid for, so its round verifies its best
                width. A node's acceptance estimate starts at its rho and follows what the rounds
                observe: an :class:`~bole.speculative.calibration.AcceptanceCalibrator` per model
                and drafter (binned by rho, monotone), counted in the rounds that learn (below)
                and refitted every :data:`FIT_EVERY` of them, on the device. Nodes the choice
                drops are never verified, so their estimates could not learn: one drafting round in
                :data:`EXPLORE_EVERY` verifies whole trees, or fewer where whole trees' verify
                costs more than the last choice's (large batches): exploring adds at most
                :data:`EXPLORE_SHARE` of the drafting rounds' time (:meth:`BudgetPolicy.
                explore_every`). It explores only while the last choice could still change:
                a wider width must beat it if every node past each row's fill were accepted as
                often as the row's last kept node (the estimates' own model, acceptance
                non-decreasing in rho, allows no more). The
                choice weighs the round's time with the selection's own measured cost.

Each round is one of three kinds (:meth:`BudgetPolicy.plan`): "plain" (goodput's plain decoding),
"select" or "whole". A select round runs the selection (:func:`bole.speculative.budget.
select_dense`, or goodput's :func:`~bole.speculative.budget.width_fill_keep`) on the device
inside the verify graph and takes the kept nodes compacted to the front of each row, in a width W
of :func:`width_buckets` picked by the host from the previous select round's largest per-request
count (known from the round's one copy, so no extra synchronisation). Under a global budget a
request that keeps more than W nodes this round loses those past its first W slots (a suffix of
its topological slot order: still a tree); goodput fills each row to the narrower of its choice
and W in rank order, and the next round takes the width of its choice. A whole round verifies
every drafted node without selecting:

- in the batch buckets where selecting cannot pay (:meth:`BudgetPolicy.whole_trees`): where a
  bucket's budget covers every drafted node (global, calibrated), or where verifying whole trees
  costs no more than the cheapest verify of the profile's grid plus the selection itself (goodput:
  the expected tokens of whole trees are at least those of any selection, so their rate is too),
  when the drafter grows full trees (host drafters' trees are often small, and compacting them
  narrows the verify);
- in goodput's exploring rounds;
- in goodput's :data:`WHOLE_ROUNDS` rounds after a choice that kept every row's whole tree (then
  it chooses again; a plain stretch or another batch bucket ends them). Each such choice in a
  row doubles the next stretch, up to :data:`WHOLE_ROUNDS_MAX`; a choice that drops nodes or a
  plain stretch starts again from WHOLE_ROUNDS.

Goodput's acceptance estimates learn in select rounds and exploring rounds only: counting every
whole round's nodes would cost each round what only the choice uses. A bucket that verifies whole
trees anyway never explores (it never chooses).

With a device drafter goodput also picks how many levels a whole round that does not explore
grows (:class:`~bole.engine.draft_depth.DraftDepth`, from the rows' accepted lengths and the
measured draft time per depth); select and exploring rounds grow every level.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from bole.engine.draft_depth import DraftDepth, fill_depths
from bole.forest import DenseForest
from bole.speculative.drafters.registry import drafter_info
from bole.speculative.calibration import AcceptanceCalibrator
from bole.speculative.budget import (compact, rank_dense, select_dense, spread_width,
                                     width_bucket, width_buckets, width_fill_choice,
                                     width_priced_t_ver)

POLICIES = ("fixed", "global", "calibrated", "goodput")
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
    ``[Wn]`` (ms, the profile's: :meth:`BudgetPolicy.t_ver_at_width`) and a drafting round's
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


class BudgetPolicy:
    """The host side: the budget of a batch and the width of the next verify."""

    def __init__(self, spec, T: int, profile=None):
        if spec.budget_policy not in POLICIES:
            raise ValueError(f"budget_policy must be one of {POLICIES}, got "
                             f"{spec.budget_policy!r}")
        if spec.budget_policy == "global" and spec.shared_budget < 1:
            raise ValueError("the global policy needs shared_budget >= 1 (draft nodes verified "
                             "per round across the batch)")
        if spec.budget_policy in ("calibrated", "goodput") and profile is None:
            raise ValueError(f"the {spec.budget_policy} policy needs a calibration profile "
                             "(bole calibrate, or Engine(..., budget_profile=...))")
        if spec.budget_policy in ("calibrated", "goodput") and profile.tree_nodes != T:
            raise ValueError(f"the budget profile was measured for trees of {profile.tree_nodes} "
                             f"nodes, and this engine's trees have {T}: its verify widths and "
                             "selection times do not apply. Calibrate for this tree (bole "
                             "calibrate with the same --depth, --topk and --budget), or pass a "
                             "profile measured for it")
        self.policy, self.spec, self.T, self.profile = spec.budget_policy, spec, T, profile
        self.widths = width_buckets(T)
        self._whole: dict[int, bool] = {}
        self.last_kept: dict[int, int] = {}
        self.ar_rounds_left = 0                  # goodput: plain rounds before drafting again
        self.ar_stretch = AR_ROUNDS              # goodput: plain rounds after the next fallback
        # goodput: draft + accept time and accept + host time of drafting rounds (ms), the tokens
        # per request per ms that drafting and plain rounds delivered, averaged
        # (rates per batch bucket: tokens per request per ms depend on the batch)
        self.overhead_ms = self.plain_extra_ms = 0.0
        self.draft_rate: dict[int, float] = {}
        self.plain_rate: dict[int, float] = {}
        self.looking = False                     # goodput: the next drafting round is a look
        self.whole_left: dict[int, int] = {}     # goodput: whole rounds before choosing again
        self.whole_stretch: dict[int, int] = {}  # goodput: the next whole stretch's length
        self.since_explore: dict[int, int] = {}  # goodput: drafting rounds since exploring
        self.could_widen: dict[int, bool] = {}   # goodput: what past the fill could still pay
        self._explores: dict[int, bool] = {}     # goodput: whether plan's round explores
        self._first: dict[tuple[bool, int], list[float]] = {}   # (plain, R): first rates
        #: goodput with a device drafter: the draft depth of whole rounds (draft_depth.py)
        self.depth = self._depth_choice(spec, T)
        self.deepest = spec.depth if spec.mode != "ar" else 0
        self._round_depth: dict[int, int] = {}   # R: the depth of plan's round
        self._free_depth: set[int] = set()        # R: plan's round may take any depth

    def _depth_choice(self, spec, T: int) -> DraftDepth | None:
        if (self.policy != "goodput" or spec.mode == "ar"
                or not drafter_info(spec.drafter).on_device):
            return None
        depths = fill_depths(1 if spec.mode == "chain" else spec.topk, spec.depth, T)
        return DraftDepth(depths) if len(depths) > 1 else None

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
        if self.policy == "goodput":
            return max(self.profile.node_grid)
        return batch * (self.T - 1)

    def row_width(self, R: int) -> int | None:
        """The calibrated policy's verify width for bucket ``R``: the width bucket of ``B_ver``
        spread evenly over the profile's measured batch (where the profile measured its time),
        at least a root and its floors; None for the other policies."""
        if self.policy != "calibrated":
            return None
        rows = self.profile.batches[self.profile.row(R)]
        return max(spread_width(rows, self.budget(R), self.T),
                   self._bucket(1 + self.spec.root_floor))

    def whole_trees(self, R: int) -> bool:
        """Whether rounds of bucket ``R`` verify whole trees, without the selection: every
        batch of up to ``R`` requests may keep all its draft nodes (global, calibrated: then the
        selection keeps them all), or (goodput) whole trees' verify costs at most the profile's
        cheapest one plus the selection's measured cost, so that no selection's tokens per ms
        exceed theirs."""
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
        if self.policy in ("global", "calibrated"):
            return all(self.budget(n) >= n * drafted for n in range(1, R + 1))
        t_full = self.t_ver_at_width(R, self.T)
        cheapest = min((self.t_ver_at_width(R, w) for w in self.goodput_widths[:-1]),
                       default=t_full)
        return t_full <= cheapest + self.profile.t_select_at(R)

    def t_ver_at_width(self, R: int, width: int) -> float:
        """The profile's verify time (ms) of a round of bucket ``R`` at verify ``width``: its
        measured batch's rows at that width (:func:`~bole.speculative.budget.
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

    def exploring(self, R: int, since: int | None = None) -> bool:
        """Whether this round of bucket ``R`` (goodput, drafting) verifies whole trees for what
        they teach: the last of every :meth:`explore_every` drafting rounds of the bucket, while
        the last choice says that what lies past its fill could still change it. A look (the
        drafting round after a plain stretch) never does: it measures the rounds the policy
        would run. Nor does a round of a bucket that verifies whole trees anyway
        (:meth:`whole_trees`): it never chooses, so its rounds would pay for learning that no
        choice of theirs uses."""
        since = self.since_explore.get(R, 0) if since is None else since
        return (self.policy == "goodput" and not self.looking and self.could_widen.get(R, True)
                and since >= self.explore_every(R) - 1 and not self.whole_trees(R))

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
        """Whether this round decodes plainly (goodput found drafting does not pay)."""
        return self.policy == "goodput" and self.ar_rounds_left > 0

    def after_round(self, R: int, plain: bool, draft_ms: float, accept_ms: float,
                    rate: float, host_ms: float = 0.0, measured: bool = True) -> None:
        """Goodput's host side after a round of bucket ``R`` that delivered ``rate`` tokens per
        request per ms of its wall time: count a plain stretch down, or average what drafting
        delivers at this bucket and start a stretch when plain decoding delivers more there
        (measured, or until a plain round of R has run, one decode forward of the profile plus
        a drafting round's accept and host time). ``measured`` False: the round's time holds
        something else (a graph capture, a dropped prelaunched draft) and is not averaged."""
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

    def plan(self, R: int) -> str:
        """This round's kind for bucket ``R``: "plain", "select" or "whole" (see the module
        docstring). Call once per round, before it runs: a whole stretch counts down here."""
        for other in [n for n in self.whole_left if n != R]:    # a stretch follows its batch
            del self.whole_left[other]
        kind = self._kind(R)
        self._explores[R] = kind == "whole" and self.exploring(R)
        if kind == "whole" and self.whole_left.get(R, 0) > 0:
            self.whole_left[R] -= 1
        depth = self._depth_of(R, kind, self._explores[R])
        self._round_depth[R] = depth
        if self.depth is not None and kind == "whole" and not self._explores[R]:
            self._free_depth.add(R)
        else:
            self._free_depth.discard(R)
        return kind

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
        since = 0 if self._explores.get(R, False) else self.since_explore.get(R, 0) + 1
        kind = self._kind(R, since)
        return self._depth_of(R, kind, kind == "whole" and self.exploring(R, since))

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

    def after_whole(self, R: int, depth: int, accepted: list[int], draft_ms: float,
                    rest_ms: float, measured: bool, hidden_ms: float = 0.0) -> None:
        """Goodput's depth choice after a whole round of bucket ``R`` grown ``depth`` levels: the
        draft tokens its full-tree rows accepted, its draft time, the rest of its wall time and
        the part of its draft hidden behind the host (ms)."""
        if self.depth is not None:
            self.depth.observe(R, depth, accepted, draft_ms, rest_ms, measured, hidden_ms)

    def _kind(self, R: int, since: int | None = None) -> str:
        """The kind :meth:`plan` gives bucket ``R`` now, without counting anything down
        (``since``: the drafting rounds since it explored, if not the count now)."""
        if self.plain_round():
            return "plain"
        if self.whole_left.get(R, 0) > 0 or self.whole_trees(R) or self.exploring(R, since):
            return "whole"
        return "select"

    def learns(self, kind: str, R: int) -> bool:
        """Whether a round of this kind and bucket ``R`` counts its nodes into goodput's
        acceptance estimates: select rounds, and whole rounds that explore."""
        return self.policy == "goodput" and (
            kind == "select" or (kind == "whole" and self.exploring(R)))

    def variants(self, R: int) -> list[tuple[str, int, bool]]:
        """Every ``(kind, width, learns)`` a round of bucket ``R`` can run (a graph each)."""
        goodput = self.policy == "goodput"
        cap = self.row_width(R) or self.T
        whole = self.whole_trees(R)
        out = [] if whole else [("select", W, goodput) for W in self.widths if W <= cap]
        if goodput:       # a bucket of whole trees never explores: no learning whole round
            learning = [] if whole else [("whole", self.T, True)]
            return [("plain", 1, False), ("whole", self.T, False)] + learning + out
        return out or [("whole", self.T, False)]

    def width(self, R: int, batch: int, kind: str | None = None) -> int:
        """The verify width of a round of ``kind`` (None: the kind :meth:`plan` would give, its
        stretch not counted down): 1 plain, the tree whole, else the previous select round's
        largest kept count, or an even share of the budget (at least the floor), rounded up to
        a bucket (for the calibrated policy, at most its :meth:`row_width`). Goodput's first
        select round in a bucket follows the nearest bucket that has chosen (by ratio of rows,
        the larger on a tie: a batch that shrinks comes from there): its budget is the whole
        node grid, whose even share would verify whole trees at every batch up to 32 rows.
        Its choice fills rows up to that width and reports what it wanted, which the next
        round's width follows."""
        kind = kind or self._kind(R)
        if kind == "plain":
            return 1
        if kind == "whole":
            return self.T
        need = self.last_kept.get(R)
        if need is None and self.policy == "goodput" and self.last_kept:
            near = min(self.last_kept, key=lambda n: (abs(math.log2(n / R)), -n))
            need = self.last_kept[near]
        if need is None:
            need = 1 + max(self.spec.root_floor, -(-self.budget(batch) // max(batch, 1)))
        return min(self._bucket(need), self.row_width(R) or self.T)

    def _bucket(self, need: int) -> int:
        """The narrowest verify width that holds ``need`` nodes a row (the tree's, at most)."""
        return width_bucket(need, self.T)

    def observe(self, R: int, kept: list[int], kind: str = "select",
                could_widen: bool | None = None) -> None:
        """The kept counts of a round of bucket R, of the rows that drafted whole trees (the
        caller leaves out a request within a tree's depth of its token limit: its shallower
        tree says nothing of the next round's). A select round's set the next one's width;
        goodput's choice keeping all T nodes of every such row starts a stretch of whole
        rounds: :data:`WHOLE_ROUNDS`, doubled after each such choice in a row of the bucket, up
        to :data:`WHOLE_ROUNDS_MAX` (a choice that drops nodes, or a plain stretch, starts
        over; a bucket left for another keeps its length for its return). ``could_widen``
        (goodput's select rounds): whether verifying the nodes past the fill could change the
        choice, at best (:func:`~bole.speculative.budget.
        width_fill_could_widen`); while it is False the bucket does not explore. Whole rounds'
        counts say nothing of the next choice; nor does a select round with no counts (every
        row drafted a tree cut short by its token limit): the last ones stay."""
        if kind != "select" or not kept:
            return
        if could_widen is not None:
            self.could_widen[R] = could_widen
        self.last_kept[R] = max(kept)
        if self.policy != "goodput":
            return
        if min(kept) >= self.T:
            stretch = self.whole_stretch.get(R, WHOLE_ROUNDS)
            self.whole_left[R] = stretch
            self.whole_stretch[R] = min(2 * stretch, WHOLE_ROUNDS_MAX)
        else:
            self.whole_stretch.pop(R, None)


def _average(mean: float | None, x: float, weight: float = RATE_WEIGHT) -> float:
    """An exponential moving average (``weight`` on the newest), started at its first value
    (``mean`` None or 0: nothing averaged yet)."""
    return (1.0 - weight) * mean + weight * x if mean else x

"""Goodput's draft depth: how many levels the device drafter grows for a whole round.

A whole round verifies every node the drafter grew. Its verify costs the same at every depth
whose tree still fills the request's node slots (the growth keeps the budget's best nodes of the
levels it grew), while the draft costs about one drafter step per level. So a level pays only
when the tokens it adds per round are worth more than the time it takes. Where the draft is a
large share of the round (a small target, whose forward costs little against the head's steps)
or deep levels are rarely accepted, fewer levels deliver more tokens per ms.

The estimates, on the host from what the rounds accept:

- each level's survival ``s_k``: of the rows that accepted ``k - 1`` draft tokens in a whole round
  grown at least ``k`` levels deep, the share that accepted a ``k``-th (a Laplace prior: one
  accepted, one not);
- the expected tokens of a round grown ``d`` levels: ``1 + sum_{k <= d} prod_{j <= k} s_j``
  (the bonus token, then each level reached);
- its time: the rest of the bucket's whole rounds (wall time less the draft's share of it,
  averaged) plus the draft at ``d`` less what of it hides behind the host (a draft queued before
  a round's synchronisation runs partly while the host reads the round's tokens: a shorter draft
  saves only its visible part). The draft at ``d`` is measured where rounds of that depth ran,
  else read off the line through the measured depths (proportional from a single one).

The chosen depth of a bucket maximises expected tokens per ms. Levels below it are observed in
every round; the levels past it only in probe rounds: one whole round in :data:`PROBE_EVERY`
of a bucket at a depth below the deepest grows one level more, so that a level that starts to
pay (the workload changed) is seen. A tree of any depth is verified exactly, so a whole round may
take a draft of another depth than its bucket's choice (one queued before the choice changed);
the probe counts the depth the round ran.
"""

from __future__ import annotations

#: whole rounds of a bucket per probe round (one level deeper than the choice)
PROBE_EVERY = 8
#: rows observed before the first choice below the deepest level
MIN_ROWS = 16
#: weight of the newest round in the time averages
TIME_WEIGHT = 0.1
#: the survival counts are halved when the first level's count passes this (so that they follow
#: a workload that changes)
MAX_COUNT = 8192.0


class DraftDepth:
    """The draft depth of each batch bucket's whole rounds.

    ``depths``: the depths the drafter may grow (ascending, the deepest last): those whose tree
    fills the request's node slots."""

    def __init__(self, depths: tuple[int, ...]):
        if not depths or list(depths) != sorted(set(depths)) or depths[0] < 1:
            raise ValueError(f"draft depths must be distinct ascending depths >= 1, got {depths}")
        self.depths = tuple(depths)
        self.deepest = depths[-1]
        D = self.deepest
        self.reach = [0.0] * (D + 1)          # [k]: rows that accepted k - 1, grown >= k levels
        self.passed = [0.0] * (D + 1)         # [k]: of those, rows that accepted a k-th
        self.draft_ms: dict[int, dict[int, float]] = {}     # R: {depth: averaged draft time}
        self.rest_ms: dict[int, float] = {}   # R: a whole round's wall time less its draft
        self.hidden_ms: dict[int, float] = {}  # R: draft time hidden behind the host
        self.chosen: dict[int, int] = {}      # R: the depth of its whole rounds
        self.since_probe: dict[int, int] = {}

    # ---- the choice ----
    def survival(self, k: int) -> float:
        """Level ``k``'s estimated survival (Laplace: (accepted + 1) / (reached + 2))."""
        return (self.passed[k] + 1.0) / (self.reach[k] + 2.0)

    def expected_tokens(self, depth: int) -> float:
        """Expected tokens a row emits in a whole round grown ``depth`` levels."""
        return self._expected()[depth]

    def _expected(self) -> list[float]:
        """Expected tokens of a whole round at every depth ``[0..deepest]``."""
        out, p = [1.0], 1.0
        for k in range(1, self.deepest + 1):
            p *= self.survival(k)
            out.append(out[-1] + p)
        return out

    def draft_time(self, R: int, depth: int) -> float | None:
        """Bucket ``R``'s draft time at ``depth`` (ms): measured, else from the measured depths
        (the least-squares line through two or more, proportional from one); None before any."""
        times = self.draft_times(R)
        return None if times is None else times[depth]

    def draft_times(self, R: int) -> dict[int, float] | None:
        """:meth:`draft_time` at every depth of :attr:`depths`."""
        seen = self.draft_ms.get(R)
        if not seen:
            return None
        if len(seen) == 1:
            (d0, ms0), = seen.items()
            line = lambda d: ms0 * d / d0              # noqa: E731
        else:
            n = len(seen)
            mx, my = sum(seen) / n, sum(seen.values()) / n
            slope = sum((d - mx) * (ms - my) for d, ms in seen.items()) / \
                sum((d - mx) ** 2 for d in seen)
            line = lambda d: max(0.0, my + slope * (d - mx))     # noqa: E731
        return {d: seen[d] if d in seen else line(d) for d in self.depths}

    def best(self, R: int) -> int:
        """The depth with the most expected tokens per ms for bucket ``R`` (the deepest until
        its times and :data:`MIN_ROWS` rows are known)."""
        rest, times = self.rest_ms.get(R), self.draft_times(R)
        if rest is None or times is None or self.reach[1] < MIN_ROWS:
            return self.deepest
        hidden = self.hidden_ms.get(R, 0.0)
        tokens = self._expected()
        best, best_rate = self.deepest, -1.0
        for d in reversed(self.depths):               # ties: the deeper
            rate = tokens[d] / max(rest + max(0.0, times[d] - hidden), 1e-9)
            if rate > best_rate:
                best, best_rate = d, rate
        return best

    # ---- the rounds ----
    def depth(self, R: int) -> int:
        """The depth of bucket ``R``'s next whole round (its choice, or one level more in a
        probe round); reads, counts nothing."""
        d = self.chosen.get(R, self.deepest)
        if d < self.deepest and self.since_probe.get(R, 0) >= PROBE_EVERY - 1:
            return self.depths[self.depths.index(d) + 1]
        return d

    def planned(self, R: int, depth: int) -> None:
        """A whole round of bucket ``R`` grows ``depth`` levels: count it towards the probe."""
        if depth > self.chosen.get(R, self.deepest):
            self.since_probe[R] = 0
        else:
            self.since_probe[R] = self.since_probe.get(R, 0) + 1

    def observe(self, R: int, depth: int, accepted: list[int], draft_ms: float,
                rest_ms: float, measured: bool = True, hidden_ms: float = 0.0) -> None:
        """A whole round of bucket ``R`` grown ``depth`` levels: the draft tokens each row whose
        tree was not cut short accepted, its draft time, the rest of its wall time and the part
        of the draft that ran hidden behind the host, outside any round's wall time (ms; not
        averaged when ``measured`` is False); then bucket ``R`` chooses again."""
        if accepted:
            at_least = [0] * (depth + 2)         # at_least[j]: rows that accepted >= j
            for a in accepted:
                at_least[min(max(a, 0), depth)] += 1
            for j in range(depth - 1, -1, -1):
                at_least[j] += at_least[j + 1]
            for k in range(1, depth + 1):
                self.reach[k] += at_least[k - 1]
                self.passed[k] += at_least[k]
            if self.reach[1] > MAX_COUNT:
                self.reach = [x / 2 for x in self.reach]
                self.passed = [x / 2 for x in self.passed]
        if measured:
            times = self.draft_ms.setdefault(R, {})
            times[depth] = _average(times.get(depth), draft_ms)
            self.rest_ms[R] = _average(self.rest_ms.get(R), rest_ms)
            self.hidden_ms[R] = _average(self.hidden_ms.get(R), hidden_ms)
        self.chosen[R] = self.best(R)


def fill_depths(topk: int, deepest: int, nodes: int) -> tuple[int, ...]:
    """The depths up to ``deepest`` whose EAGLE-2 growth (``topk`` children of the ``topk`` best
    frontier nodes a step) creates at least ``nodes`` nodes, the root included: a whole tree of
    any of them fills the request's node slots."""
    from bole.speculative.tree_growth import node_capacity
    return tuple(d for d in range(1, deepest + 1) if node_capacity(topk, d) >= nodes) or \
        (deepest,)


def _average(mean: float | None, x: float) -> float:
    """An exponential moving average (:data:`TIME_WEIGHT` on the newest), started at its first
    value (``mean`` None: nothing averaged yet; 0 is a value, as a hidden time often is)."""
    return x if mean is None else (1.0 - TIME_WEIGHT) * mean + TIME_WEIGHT * x

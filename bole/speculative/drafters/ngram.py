"""N-gram prompt lookup: a host drafter without a model."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from torch import Tensor

from bole.speculative.drafters.base import DrafterInfo, DrafterSetup
from bole.speculative.drafters.host_growth import BatchExpander, Expander, per_request


class NgramDrafter:
    """Prompt lookup: continue the longest recent n-gram (``max_n`` down to ``min_n`` tokens)
    that already occurred in the request's context; candidates are the tokens that followed it,
    scored by their share of those occurrences (the most recent wins ties). Keeps no state."""

    on_device = False

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, context: Sequence[int], k: int) -> list[tuple[int, float]]:
        ctx = list(context)
        for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
            suffix = ctx[-n:]
            follow: Counter[int] = Counter()
            last_seen: dict[int, int] = {}
            for j in range(len(ctx) - n):
                if ctx[j:j + n] == suffix:
                    tok = ctx[j + n]
                    follow[tok] += 1
                    last_seen[tok] = j
            if follow:
                total = sum(follow.values())
                best = sorted(follow, key=lambda t: (-follow[t], -last_seen[t]))[:k]
                return [(t, follow[t] / total) for t in best]
        return []

    def expander(self, history: Sequence[int]) -> Expander:
        """``history`` ends with the root token (the last emitted one)."""
        before = list(history[:-1])

        def expand(paths, k):
            return [self.lookup(before + list(path), k) for path in paths]
        return expand

    def tree_expander(self, slots: Sequence[int],
                      histories: Sequence[Sequence[int]]) -> BatchExpander:
        """One :meth:`expander` per request's ``history`` (prompt and output, root last)."""
        return per_request([self.expander(h) for h in histories])

    def start(self, slot: int, prompt: Tensor, continuation: Sequence[int] | None) -> None:
        pass

    def finish(self, slot: int) -> None:
        pass

    def observe(self, slot: int, tokens: Sequence[int]) -> None:
        pass


def build(setup: DrafterSetup) -> NgramDrafter:
    return NgramDrafter()


INFO = DrafterInfo("ngram", build, on_device=False, help="n-gram lookup in the request's own tokens")

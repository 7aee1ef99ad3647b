"""A round's timings, summed over rounds: per phase, per batch size, per verified node count
and per draft depth."""

from __future__ import annotations

from dataclasses import dataclass, field


__all__ = ["RoundTimings"]


@dataclass
class RoundTimings:
    """Per-phase time summed over rounds (ms): device time between events on a GPU, wall time
    on the CPU; ``host`` is the rest of a round's wall time (the GPU idles meanwhile)."""

    rounds: int = 0
    draft: float = 0.0
    verify: float = 0.0
    accept_commit: float = 0.0
    host: float = 0.0
    total: float = 0.0
    syncs: int = 0
    #: the goodput policy's plain rounds (no drafting)
    plain_rounds: int = 0
    #: draft nodes verified by the batch, over the drafting rounds of a shared budget
    draft_nodes: int = 0
    budget_rounds: int = 0
    #: per batch size (requests in the round): [rounds, tokens emitted, ms]
    by_batch: dict = field(default_factory=dict)
    #: shared budgets: rounds per count of verified draft nodes (kind "select" or "whole")
    by_nodes: dict = field(default_factory=dict)
    #: drafting rounds of the device drafters per draft depth
    by_depth: dict = field(default_factory=dict)

    def add(self, t: dict) -> None:
        self.rounds += 1
        for k in ("draft", "verify", "accept_commit", "host", "total", "syncs"):
            setattr(self, k, getattr(self, k) + t[k])
        self.plain_rounds += int(t.get("plain", 0))
        if t.get("draft_nodes") is not None:
            self.draft_nodes += t["draft_nodes"]
            key = (t.get("kind", "select"), t["draft_nodes"])
            self.by_nodes[key] = self.by_nodes.get(key, 0) + 1
            self.budget_rounds += 1
        if t.get("depth") is not None:
            self.by_depth[t["depth"]] = self.by_depth.get(t["depth"], 0) + 1
        if "requests" in t:
            row = self.by_batch.setdefault(t["requests"], [0, 0, 0.0])
            row[0] += 1
            row[1] += t["tokens"]
            row[2] += t["total"]

    def full_batch_rate(self) -> tuple[float, int] | None:
        """``(tokens/s, rounds)`` over the rounds that ran the most requests: what the batch
        decodes while every slot is busy (a static batch's last rounds run only the
        requests that are not done yet, a batch kept full never does). None before a round."""
        if not self.by_batch:
            return None
        rounds, tokens, ms = self.by_batch[max(self.by_batch)]
        return tokens / max(ms / 1e3, 1e-9), rounds

    def decode_split(self, decoded_tokens: int, elapsed_s: float) -> tuple[float, float]:
        """``(decoded_tokens`` over the rounds' time in tokens/s, the seconds of a run of
        ``elapsed_s`` spent outside rounds: admissions and prefills)."""
        round_s = self.total / 1e3
        return decoded_tokens / max(round_s, 1e-9), max(0.0, elapsed_s - round_s)

    def summary(self) -> dict:
        n = max(1, self.rounds)
        return dict(round_ms=self.total / n, draft_ms=self.draft / n, verify_ms=self.verify / n,
                    accept_commit_ms=self.accept_commit / n, host_ms=self.host / n,
                    syncs_per_round=self.syncs / n,
                    gpu_idle_share=self.host / max(self.total, 1e-9),
                    plain_round_share=self.plain_rounds / n,
                    draft_nodes_per_round=(self.draft_nodes / self.budget_rounds
                                           if self.budget_rounds else None))

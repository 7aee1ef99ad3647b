"""The speculative configuration of an engine: its mode, drafter, tree shape and budget policy,
and the documented limits of the tree."""

from __future__ import annotations

from dataclasses import dataclass

from bole.models.qwen3_hybrid import HybridModel
from bole.speculative.budget.registry import DEFAULT_POLICY, policy_info
from bole.speculative.drafters import registry as drafters
from bole.speculative.tree_growth import node_capacity

__all__ = ["MODES", "DRAFTERS", "MAX_TOPK", "MAX_DEPTH", "MAX_BUDGET", "default_drafter",
           "DEFAULT_TREE", "SpecConfig"]

MODES = ("ar", "bole", "tree-serial", "chain")
DRAFTERS = drafters.drafter_names()
#: documented limits of the tree shape (a wider tree costs more than it can gain)
MAX_TOPK = 16
MAX_DEPTH = 15
MAX_BUDGET = 256


def default_drafter(model: HybridModel, draft_model: HybridModel | None = None) -> str:
    """A separate draft model when one is given, else the checkpoint's MTP head when it has
    one, else n-gram lookup."""
    return drafters.default_drafter(model.has_mtp_head, draft_model is not None)


#: the default draft tree (depth, children per expanded node, nodes per request): the fastest
#: of the shapes swept on the bundled model at batch 1 and 8 (bench/NOTES.md)
DEFAULT_TREE = (6, 4, 16)


@dataclass(frozen=True)
class SpecConfig:
    mode: str = "bole"
    drafter: str = drafters.FALLBACK_DRAFTER
    depth: int = DEFAULT_TREE[0]
    topk: int = DEFAULT_TREE[1]
    budget: int = DEFAULT_TREE[2]
    #: the replay drafter's acceptance profile: a shipped name ("bundled", "qwen3-next-mtp")
    #: or a JSON file (bole/speculative/drafters/replay.py)
    acceptance: str | None = None
    #: which drafted nodes a verify takes (bole/speculative/budget/): "fixed" (every request its
    #: tree), "global" (the batch's best ``shared_budget`` draft nodes), "calibrated" (the
    #: budget of this GPU's calibration profile) or "goodput" (the budget that maximises
    #: expected tokens per ms, plain decoding when drafting does not pay); ``root_floor`` root
    #: children per request kept
    budget_policy: str = DEFAULT_POLICY
    shared_budget: int = 0
    root_floor: int = 1
    #: the MTP head drafts over this many most frequent tokens (0: the whole vocabulary;
    #: bole/speculative/drafters/draft_vocab.py); verification always uses the whole vocabulary
    draft_vocab: int = 0
    #: benchmarks only, with the replay drafter: greedy acceptance takes the known continuation
    #: as the target's choice (the verify forward still runs in full). Random weights in bf16
    #: have near-tied logits whose argmax flips between a decode and a tree verify; one flip
    #: makes the continuation stale and acceptance collapses. Output then equals plain
    #: decoding's by construction, so exactness is checked with this off (fp32 tests)
    forced_acceptance: bool = False
    #: the calibrated policy's tolerance: B_ver(b) = the most nodes with T_ver <= (1 + eps)
    #: T_dec, derived from the profile's measured curves (None: the eps it was calibrated at)
    budget_eps: float | None = None

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        drafter = drafters.drafter_info(self.drafter)
        policy = policy_info(self.budget_policy)
        if self.forced_acceptance and not drafter.replays_continuation:
            raise ValueError("forced_acceptance replays a known continuation: it needs the "
                             "replay drafter")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0: the whole vocabulary), got "
                             f"{self.draft_vocab}")
        if 0 < self.draft_vocab < self.topk:
            raise ValueError(f"a draft vocabulary of {self.draft_vocab} tokens cannot give "
                             f"top-{self.topk} proposals; make it at least topk")
        if self.draft_vocab and not drafter.takes_draft_vocab:
            raise ValueError(f"draft_vocab restricts the MTP head's proposals; the "
                             f"{self.drafter} drafter has none (leave it at 0)")
        if self.root_floor < 0:
            raise ValueError(f"root_floor must be >= 0, got {self.root_floor}")
        if self.budget_eps is not None:
            if not policy.takes_eps:
                raise ValueError(f"budget_eps is the calibrated policy's tolerance; the "
                                 f"{self.budget_policy} policy has none (leave it unset)")
            eps = self.budget_eps
            if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1e9:
                raise ValueError(f"budget_eps must be a finite number in [0, 1e9), got {eps!r}")
        if drafter.needs_acceptance_profile and self.mode != "ar" and not self.acceptance:
            raise ValueError(f"the {self.drafter} drafter needs an acceptance profile "
                             "(--acceptance bundled, qwen3-next-mtp or a JSON file)")
        if not (1 <= self.depth <= MAX_DEPTH and 1 <= self.topk <= MAX_TOPK
                and 2 <= self.budget <= MAX_BUDGET):
            raise ValueError(f"need 1 <= depth <= {MAX_DEPTH}, 1 <= topk <= {MAX_TOPK} and "
                             f"2 <= budget <= {MAX_BUDGET}; got depth={self.depth}, "
                             f"topk={self.topk}, budget={self.budget}")

    @property
    def nodes_per_request(self) -> int:
        """Node slots of a request's tree in a verify forward (no more than a tree of this
        depth and width can hold)."""
        if self.mode == "ar":
            return 1
        if self.mode == "chain":
            return self.depth + 1
        return min(self.budget, node_capacity(self.topk, self.depth))

    @property
    def gdn(self) -> str:
        """The GDN backend family: the in-place decode step for ar, the closed form for bole,
        serial snapshots otherwise."""
        if self.mode == "ar":
            return "decode"
        return "serial" if self.mode in ("tree-serial", "chain") else "closed"

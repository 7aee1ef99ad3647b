"""The speculative round for a batch of requests: draft -> verify -> accept -> commit.

Modes (DESIGN.md section 4), all with the same drafter and the same trees so that they differ only in
verification and state handling:

    ar           no speculation: one token per request per forward
    bole         draft trees; closed-form GDN verification, factors, one factored commit
    tree-serial  the same trees; node-by-node GDN with a state snapshot per node, copy commit
    chain        a single path of ``depth`` drafts (top-1), snapshot per position, copy commit

Requests run in slots of one cache; a request that stops (max tokens, EOS) frees its slot while the
others go on. The node budget here is per request; the calibrated batch-shared budget is separate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from bole.models.qwen3_hybrid import HybridModel
from bole.spec.accept import accept_forest
from bole.spec.draft_tree import build_draft_trees, per_request
from bole.spec.drafters import DraftModelDrafter, NgramDrafter
from bole.spec.mtp import MTPDrafter
from bole.spec.sampling import SamplingParams, target_probs
from bole.tree import DraftTree, PackedForest

MODES = ("ar", "bole", "tree-serial", "chain")
DRAFTERS = ("ngram", "mtp", "draft")


def default_drafter(model: HybridModel) -> str:
    """The checkpoint's MTP head when it has one, else n-gram lookup."""
    return "mtp" if model.has_mtp_head else "ngram"


@dataclass(frozen=True)
class SpecConfig:
    mode: str = "bole"
    drafter: str = "ngram"
    depth: int = 8
    topk: int = 4
    budget: int = 32

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.depth < 1 or self.topk < 1 or self.budget < 2:
            raise ValueError(f"need depth >= 1, topk >= 1, budget >= 2; got depth={self.depth}, "
                             f"topk={self.topk}, budget={self.budget}")


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 64
    sampling: SamplingParams = SamplingParams(temperature=0)
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()      # need the engine's tokenizer

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if any(not isinstance(t, str) or not t for t in self.stop_strings):
            raise ValueError("stop strings must be non-empty strings")
        self.sampling.validate()


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str                    # "length" or "stop"
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)   # tokens emitted per round

    @property
    def mean_accepted_tokens(self) -> float:
        return sum(self.accepted) / max(1, len(self.accepted))


@dataclass
class _Request:
    index: int
    prompt: list[int]
    params: GenerationParams
    slot: int
    out: list[int] = field(default_factory=list)
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)
    result: GenerationResult | None = None


class Engine:
    """Generates for a batch of token-id prompts with one of the four modes."""

    GDN_BACKEND = {"bole": ("torch", "triton"), "tree-serial": ("torch-serial", "triton-serial"),
                   "chain": ("torch-serial", "triton-serial"), "ar": ("torch", "triton")}

    def __init__(self, model: HybridModel, spec: SpecConfig = SpecConfig(), *,
                 max_slots: int = 8, max_len: int = 4096, tokenizer=None,
                 draft_model: HybridModel | None = None):
        spec.validate()
        self.model, self.spec, self.tokenizer = model, spec, tokenizer
        on_gpu = model.device.type == "cuda"
        model.gdn_backend = self.GDN_BACKEND[spec.mode][on_gpu]
        self.cache = model.new_cache(max_slots, max_len)
        self.ngram = NgramDrafter()
        self.mtp = MTPDrafter(model, max_slots, max_len) if spec.drafter == "mtp" else None
        self.draft = None
        if spec.drafter == "draft":
            if draft_model is None:
                raise ValueError("the draft drafter needs a draft_model (--draft-model)")
            self.draft = DraftModelDrafter(draft_model, model.config.vocab_size, max_slots, max_len)
        self.stats = dict(forward_s=0.0, rounds=0)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: GenerationParams | Sequence[GenerationParams] = GenerationParams(),
                 seed: int | None = None) -> list[GenerationResult]:
        if isinstance(params, GenerationParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} parameter sets for {len(prompts)} prompts")
        vocab = self.model.config.vocab_size
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            p.validate()
            if p.stop_strings and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer: build the Engine with one")
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; give at least one token")
            if any(not 0 <= int(t) < vocab for t in prompt):
                raise ValueError(f"prompt {i} holds token ids outside [0, {vocab})")
            need = len(prompt) + p.max_tokens + self.spec.depth + 1
            if need > self.cache.max_len:
                raise ValueError(
                    f"prompt {i} ({len(prompt)} tokens) plus max_tokens={p.max_tokens} needs "
                    f"{need} cache positions, more than the context of {self.cache.max_len}")
        if len(prompts) > self.cache.num_free:
            raise ValueError(f"{len(prompts)} prompts but only {self.cache.num_free} free slots")
        gen = torch.Generator(device=self.model.device)
        if seed is None:
            gen.seed()                        # non-deterministic, without touching the global RNG
        else:
            gen.manual_seed(seed)
        reqs = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                slot = self.cache.allocate(len(prompt) + p.max_tokens + self.spec.depth + 1)
                reqs.append(_Request(i, [int(t) for t in prompt], p, slot))
            for r in reqs:                    # prefill, then the first token from its logits
                logits, hidden = self.model.prefill(self.cache, r.slot, torch.tensor(r.prompt),
                                                    return_hidden=True)
                if self.mtp is not None:
                    self.mtp.reset(r.slot)
                    self.mtp.observe(r.slot, r.prompt, hidden, 0)
                if self.draft is not None:
                    self.draft.start(r.slot, r.prompt)
                first = self._sample(logits[-1][None], r.params.sampling, gen)[0]
                self._emit(r, [first], rounds=0)
            while any(r.result is None for r in reqs):
                self._round([r for r in reqs if r.result is None], gen)
        finally:
            for r in reqs:
                self.cache.free(r.slot)
                if self.draft is not None:
                    self.draft.finish(r.slot)
        return [r.result for r in reqs]

    # ---- one round ----
    def _round(self, active: list[_Request], gen: torch.Generator) -> None:
        trees, tokens = self._draft(active)
        forest = PackedForest.pack(trees)
        node_tokens = torch.cat(tokens)
        t0 = time.perf_counter()
        out = self.model.forward_tree(self.cache, [r.slot for r in active], forest, node_tokens)
        self.stats["forward_s"] += time.perf_counter() - t0
        self.stats["rounds"] += 1
        probs = torch.cat([
            target_probs(out.logits[int(forest.cu_nodes[i]):int(forest.cu_nodes[i + 1])],
                         r.params.sampling) for i, r in enumerate(active)])
        acc = accept_forest(probs, node_tokens, forest, generator=gen)
        if self.mtp is not None:
            starts = [int(self.cache.lengths[r.slot]) for r in active]
        self.model.commit(self.cache, out, acc.accepted)
        for i, r in enumerate(active):          # the drafters' caches follow the accepted paths
            nodes = [int(forest.cu_nodes[i]) + n for n in acc.path[i]]
            path_tokens = node_tokens[nodes].tolist()
            if self.mtp is not None:
                self.mtp.observe(r.slot, path_tokens, out.hidden[nodes], starts[i])
            if self.draft is not None:
                self.draft.observe(r.slot, path_tokens)
        for r, new in zip(active, acc.new_tokens):
            self._emit(r, new, rounds=1)

    def _draft(self, active: list[_Request]) -> tuple[list[DraftTree], list[torch.Tensor]]:
        """Draft every active request's tree; all requests' frontiers grow together, one batched
        drafter call per tree level."""
        roots = [r.out[-1] for r in active]
        if self.spec.mode == "ar":
            return [DraftTree.chain(1)] * len(active), [torch.tensor([t]) for t in roots]
        # never draft past max_tokens: the round emits at most depth + 1 tokens
        depths = [max(0, min(self.spec.depth, r.params.max_tokens - len(r.out) - 1)) for r in active]
        chain = self.spec.mode == "chain"
        topk = 1 if chain else self.spec.topk
        budget = self.spec.depth + 1 if chain else self.spec.budget
        if self.mtp is not None:
            expand = self.mtp.batch_expander([r.slot for r in active])
        elif self.draft is not None:
            expand = self.draft.batch_expander([r.slot for r in active])
        else:
            expand = per_request([self.ngram.expander(r.prompt + r.out) for r in active])
        results = build_draft_trees(roots, expand, depths=depths, topk=topk, budget=budget)
        return [res.tree for res in results], [res.tokens for res in results]

    def _sample(self, logits: torch.Tensor, sampling: SamplingParams, gen) -> list[int]:
        probs = target_probs(logits, sampling)
        return torch.multinomial(probs, 1, generator=gen)[:, 0].tolist()

    def _emit(self, r: _Request, new: list[int], rounds: int) -> None:
        """Append a round's tokens up to a stop token or max_tokens; finish the request there."""
        stop = set(r.params.stop_token_ids)
        before, reason = len(r.out), None
        for t in new:
            r.out.append(t)
            if t in stop:
                reason = "stop"
                break
            if len(r.out) >= r.params.max_tokens:
                reason = "length"
                break
        if r.params.stop_strings:
            cut = self._stop_string_cut(r)
            if cut is not None:
                del r.out[cut:]
                reason = "stop"
        if rounds:
            r.rounds += 1
            r.accepted.append(len(r.out) - before)
        if reason is not None:
            r.result = GenerationResult(list(r.out), reason, r.rounds, list(r.accepted))

    def _stop_string_cut(self, r: _Request) -> int | None:
        """Fewest output tokens whose text contains a stop string, or None."""
        text = self.tokenizer.decode(r.out)
        if not any(stop in text for stop in r.params.stop_strings):
            return None
        for m in range(1, len(r.out) + 1):
            if any(stop in self.tokenizer.decode(r.out[:m]) for stop in r.params.stop_strings):
                return m
        return len(r.out)

    def text(self, result: GenerationResult, params: GenerationParams) -> str:
        """Decoded output, cut before the first stop string (the stop string is not returned)."""
        text = self.tokenizer.decode(result.token_ids)
        hits = [text.find(s) for s in params.stop_strings if s in text]
        return text[: min(hits)] if hits else text

"""A request as the engine and its front ends see it: its parameters (:class:`SamplingParams`,
defined at the base floor in :mod:`bole.sampling_params` so that the speculative sampling code can
read it too, and importable from here), its host-side state while it runs, and its result
(tokens, logprobs, timings); what a front end knows of an engine (:class:`EngineInfo`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from bole.engine.spec import SpecConfig
from bole.sampling_params import SamplingParams

__all__ = ["SamplingParams", "TokenLogprob", "GenerationResult", "Request", "result_text",
           "EngineInfo"]


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability under the model's raw distribution, and the ``top``
    most likely tokens' ``(token id, logprob)``, most likely first (as many as asked)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str                    # "length" or "stop"
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)   # tokens emitted per round
    prefill_s: float = 0.0
    decode_s: float = 0.0
    #: one per token of token_ids when the request asked for logprobs, else None
    logprobs: list[TokenLogprob] | None = None
    #: prompt tokens restored from the prefix cache instead of computed
    cached_tokens: int = 0

    @property
    def mean_accepted_tokens(self) -> float:
        return sum(self.accepted) / max(1, len(self.accepted))


@dataclass
class Request:
    """A request's host-side state while it runs."""

    index: int
    prompt: list[int]
    params: SamplingParams
    slot: int
    out: list[int] = field(default_factory=list)
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)
    result: GenerationResult | None = None
    prefill_s: float = 0.0
    started: float = 0.0
    gen: torch.Generator | None = None        # this request's sampling draws
    continuation: list[int] | None = None     # plain decoding's output (the replay drafter's)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # one per out token, if asked
    cached_tokens: int = 0                    # prompt tokens the prefix cache restored
    #: every token that ends the output (params.all_stop_token_ids of the checkpoint's eos)
    stop_ids: frozenset[int] = frozenset()

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.out)


def result_text(tokenizer, result: GenerationResult, params: SamplingParams) -> str:
    """Decoded output, cut before the first stop string (the stop string is not returned); a
    multi-byte character that max_tokens cut in two is left out, not shown as U+FFFD."""
    text = tokenizer.decode(result.token_ids)
    if result.finish_reason == "length":
        text = text.rstrip("\ufffd")
    hits = [text.find(s) for s in params.stop if s in text]
    return text[: min(hits)] if hits else text


@dataclass(frozen=True)
class EngineInfo:
    """What a front end needs of an engine, in another process too: its settings and the
    limits a request must fit (``check_request``)."""

    spec: SpecConfig
    max_len: int
    scratch: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_tokenizer: bool

    def check_request(self, prompt: Sequence[int], params: SamplingParams,
                      name: str = "the prompt") -> None:
        """Raise a ValueError naming what is wrong with one request."""
        params.validate()
        if params.stop and not self.has_tokenizer:
            raise ValueError("stop strings need a tokenizer: build the Engine with one")
        if len(prompt) == 0:
            raise ValueError(f"{name} is empty; give at least one token")
        vocab = self.vocab_size
        if any(not 0 <= int(t) < vocab for t in prompt):
            raise ValueError(f"{name} holds token ids outside [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids hold token ids outside [0, {vocab})")
        need = len(prompt) + params.max_tokens + self.scratch
        if need > self.max_len:
            raise ValueError(
                f"{name} ({len(prompt)} tokens) plus max_tokens={params.max_tokens} needs {need} "
                f"cache positions (with {self.scratch} for a round's tree), more than the "
                f"context of {self.max_len}")

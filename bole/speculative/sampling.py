"""Sampling parameters and the target distribution they define (penalties, temperature, top-k,
top-p).

Acceptance must reproduce plain sampling from exactly this distribution, so one function,
:func:`target_probs`, defines it for plain decoding and for speculative verification alike, and
one function, :func:`apply_penalties`, defines the penalised logits it starts from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: the most alternatives a request can ask log-probabilities of at each token (OpenAI's limit)
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1``
    switch those filters off.

    Penalties change the logits before temperature, top-k and top-p (greedy takes the argmax of
    the penalised logits), as vLLM does: ``presence_penalty`` and ``frequency_penalty`` (OpenAI,
    in [-2, 2], 0 = off) over the tokens generated so far, ``repetition_penalty`` (> 0, 1 = off)
    over the prompt's and the generated tokens (see :func:`apply_penalties`).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def validate(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not -2 <= value <= 2:
                raise ValueError(f"{name} must lie in [-2, 2], got {value!r}")
        rep = self.repetition_penalty
        if isinstance(rep, bool) or not isinstance(rep, (int, float)) or not math.isfinite(rep) \
                or rep <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {rep!r}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """Penalised fp32 logits, elementwise (vLLM's order): a token seen in the prompt or the
    output has its logit divided by ``repetition`` where positive, multiplied where not; then
    ``frequency * count`` and ``presence * (count > 0)`` are subtracted.

    logits ``[..., V]``; counts ``[..., V]`` fp32 occurrences in the output so far; prompt
    ``[..., V]`` bool, True for the prompt's tokens; presence, frequency, repetition ``[...]``
    per row. All broadcast against ``logits``. Neutral values (0, 0, 1) return the logits
    unchanged, bit for bit. One element's result does not depend on the others, so a value
    recomputed on gathered elements equals the dense one.
    """
    x = logits.float()
    counts = counts.float()
    seen = counts > 0
    rep = torch.where(seen | prompt, repetition[..., None], 1.0)
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - frequency[..., None] * counts
    return x - presence[..., None] * seen.float()


def penalize_params(logits: torch.Tensor, output: list[int], prompt: list[int],
                    params: SamplingParams) -> torch.Tensor:
    """``logits [V]`` of one request penalised for its ``output`` and ``prompt`` tokens (host
    lists; plain decoding's first token and tests); unchanged when no penalty is on."""
    if not params.penalized:
        return logits
    V = logits.shape[-1]
    dev = logits.device
    counts = torch.zeros(V, device=dev).index_add_(
        0, torch.tensor(output, dtype=torch.int64, device=dev),
        torch.ones(len(output), device=dev))
    seen = torch.zeros(V, dtype=torch.bool, device=dev)
    seen[torch.tensor(prompt, dtype=torch.int64, device=dev)] = True
    row = lambda v: torch.tensor(float(v), device=dev)  # noqa: E731
    return apply_penalties(logits, counts, seen, row(params.presence_penalty),
                           row(params.frequency_penalty), row(params.repetition_penalty))


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[..., V]`` logits -> fp32 probabilities after temperature, top-k and top-p.

    Greedy gives a one-hot on the first argmax. Top-p keeps the smallest set of most likely tokens
    whose probability reaches ``top_p`` (the token that crosses it included).
    """
    params.validate()
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    x = logits / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p       # mass strictly before each token
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs

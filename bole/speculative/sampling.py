"""The target distribution that a request's :class:`~bole.sampling_params.SamplingParams` define
(penalties, temperature, top-k, top-p).

Acceptance must reproduce plain sampling from exactly this distribution, so one function,
:func:`target_probs`, defines it for plain decoding and for speculative verification alike, and
one function, :func:`apply_penalties`, defines the penalised logits it starts from.
"""

from __future__ import annotations

import torch

from bole.sampling_params import SamplingParams

__all__ = ["apply_penalties", "penalize_params", "target_probs"]


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

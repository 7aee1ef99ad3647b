"""Presence, frequency and repetition penalties at every node of a draft forest, on the device.

The target distribution at a tree node counts the tokens that would precede the token drawn from
that node's logits: the request's committed output (the root's token included: it was emitted by
the last round) and the node's path below the root, the node itself included. Acceptance uses
these penalised logits, so speculative output equals plain decoding with the same penalties.

Fixed shapes, no host synchronisation (CUDA-graph capturable):

* :class:`PenaltyCounts` holds per cache slot the output counts ``[S, V]`` (updated at commit)
  and the prompt's tokens ``[S, V]`` (set at admission);
* :func:`path_tokens` walks each node's parents ``max_depth`` steps: ``[R, T, max_depth]``;
* :func:`penalize_forest` penalises every node densely with the committed counts, then
  recomputes the few elements whose count the node's path raises (at most ``max_depth`` per
  node) with the same elementwise formula (:func:`bole.speculative.sampling.apply_penalties`).
"""

from __future__ import annotations

import torch

from bole.forest import DenseForest
from bole.speculative.sampling import apply_penalties

__all__ = ["PenaltyCounts", "path_tokens", "penalize_forest"]


class PenaltyCounts:
    """Per cache slot: ``counts [S, V]`` fp32 occurrences of each token in the output so far,
    and ``prompt [S, V]`` bool, the prompt's tokens."""

    def __init__(self, num_slots: int, vocab_size: int, device):
        self.counts = torch.zeros(num_slots, vocab_size, device=device)
        self.prompt = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)

    def start(self, slot: int, prompt: list[int], first: int) -> None:
        """A request admitted into ``slot`` with ``prompt`` emitted its ``first`` token."""
        dev = self.counts.device
        self.counts[slot].zero_()
        self.counts[slot, first] = 1.0
        self.prompt[slot].zero_()
        self.prompt[slot, torch.tensor(prompt, dtype=torch.int64, device=dev)] = True

    def add(self, slots: torch.Tensor, tokens: torch.Tensor, num: torch.Tensor) -> None:
        """Count each row's first ``num [R]`` of ``tokens [R, D]`` into slot ``slots [R]``
        (device tensors; the rest of a row adds nothing)."""
        R, D = tokens.shape
        V = self.counts.shape[1]
        keep = torch.arange(D, device=tokens.device)[None, :] < num[:, None]
        flat = slots.long()[:, None] * V + tokens.clamp(min=0)
        self.counts.view(-1).scatter_add_(0, flat.reshape(-1), keep.reshape(-1).float())


def path_tokens(tokens: torch.Tensor, forest: DenseForest) -> torch.Tensor:
    """``[R, T, max(max_depth, 1)]`` int64: node i's own token, its parent's, ... up to and
    excluding the root; -1 past the root (every entry -1 for roots and padding)."""
    R, T = tokens.shape
    parents = forest.parents
    cur = torch.arange(T, device=tokens.device).expand(R, T)
    out = []
    for _ in range(max(forest.max_depth, 1)):
        parent = torch.gather(parents, 1, cur)
        below_root = parent >= 0
        out.append(torch.where(below_root, torch.gather(tokens, 1, cur), -1))
        cur = torch.where(below_root, parent, cur)
    return torch.stack(out, dim=-1)


def penalize_forest(logits: torch.Tensor, tokens: torch.Tensor, forest: DenseForest,
                    counts: torch.Tensor, prompt: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Penalised fp32 logits ``[R, T, V]`` of every node of ``forest``.

    logits ``[R, T, V]`` (or ``[R * T, V]``); tokens ``[R, T]``; counts ``[R, V]`` fp32 (each
    row's committed output, root included) and prompt ``[R, V]`` bool; presence, frequency,
    repetition ``[R]``. Node i of row r counts ``counts[r]`` plus the tokens of
    :func:`path_tokens`.
    """
    R, T = tokens.shape
    V = logits.shape[-1]
    raw = logits.reshape(R, T, V).float()
    per_row = lambda t: t[:, None]  # noqa: E731      ([R] -> [R, 1], against [R, T, V])
    pres, freq, rep = per_row(presence), per_row(frequency), per_row(repetition)
    out = apply_penalties(raw, counts[:, None, :], prompt[:, None, :], pres, freq, rep)
    path = path_tokens(tokens, forest)                                       # [R, T, P]
    valid = path >= 0
    # an entry without a token rewrites entry 0's element (the node's own token), or for a root
    # (no entry at all) element 0 with its own value: every write to one element is the same
    first = path[:, :, :1].clamp(min=0)
    idx = torch.where(valid, path, first)                                   # [R, T, P]
    same = (idx[:, :, :, None] == idx[:, :, None, :]) & valid[:, :, None, :]
    count = torch.gather(counts[:, None, :].expand(R, T, V), 2, idx) + same.sum(-1).float()
    seen = torch.gather(prompt[:, None, :].expand(R, T, V), 2, idx)
    value = apply_penalties(torch.gather(raw, 2, idx), count, seen, pres, freq, rep)
    is_root = ~valid[:, :, :1]
    value = torch.where(is_root, torch.gather(out, 2, idx), value)
    return out.scatter(2, idx, value)

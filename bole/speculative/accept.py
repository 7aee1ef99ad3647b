"""Lossless acceptance of a verified draft forest (docs/design.md section 5), batched.

With deterministic (top-k) drafting, at node u with target distribution p the children are tried in
draft order: child x is accepted with probability p(x) / sum(p); on rejection x is removed from p
(p(x) = 0) before the next sibling; when every child fails, or u is a leaf, the bonus token is drawn
from what is left of p. This is speculative sampling with a point-mass draft per try, so the emitted
tokens are distributed exactly as plain sampling from the target. Greedy is the same procedure with
p one-hot on the argmax: follow the child equal to the argmax, emit the argmax at the first miss.

All requests advance together, one tree level per step, with tensor operations on the probabilities'
device; the loops are over depth and over sibling rank, not over requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bole.tree import PackedForest


@dataclass
class Acceptance:
    """accepted[r]: local index of the deepest accepted node (0 = only the root);
    path[r]: local nodes root..accepted; bonus[r]: the token drawn after it;
    new_tokens[r]: drafted tokens accepted below the root, then the bonus token."""

    accepted: list[int]
    path: list[list[int]]
    bonus: torch.Tensor
    new_tokens: list[list[int]]

    @property
    def mean_accepted_tokens(self) -> float:
        return sum(len(t) for t in self.new_tokens) / max(1, len(self.new_tokens))


def children_table(forest: PackedForest) -> torch.Tensor:
    """``[N, K]`` packed indices of each node's children in draft (index) order, -1 padded."""
    N = forest.num_nodes
    parents = forest.parent_global.cpu()
    kids = torch.nonzero(parents >= 0).flatten()
    if kids.numel() == 0:
        return torch.full((N, 1), -1, dtype=torch.int64)
    par = parents[kids]
    order = torch.argsort(par * N + kids)                      # by parent, then draft order
    kids, par = kids[order], par[order]
    counts = torch.bincount(par, minlength=N)
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(kids.numel()) - start[par]
    table = torch.full((N, int(counts.max())), -1, dtype=torch.int64)
    table[par, rank] = kids
    return table


def _remove_rejected(p: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                     rejected: torch.Tensor) -> None:
    """Zero the residual ``p [R, V]`` at each request's rejected draft token ``tokens [R]`` (where
    ``rejected [R]``), in place: the next sibling, and the bonus, are drawn without it."""
    p[rows[rejected], tokens[rejected]] = 0.0


def accept_forest(probs: torch.Tensor, tokens: torch.Tensor, forest: PackedForest,
                  generator: torch.Generator | None = None) -> Acceptance:
    """Walk every request's tree from its root with the lossless rule.

    probs: ``[N, V]`` target distribution at each node (:func:`bole.speculative.sampling.target_probs`),
    tokens: ``[N]`` node tokens (root = the previous bonus token, never tested).
    """
    N, V = probs.shape
    if tokens.shape != (N,) or forest.num_nodes != N:
        raise ValueError(f"probs {tuple(probs.shape)}, tokens {tuple(tokens.shape)} and a forest of "
                         f"{forest.num_nodes} nodes do not match")
    dev = probs.device
    table = children_table(forest).to(dev)
    tokens = tokens.to(dev)
    R = forest.num_requests
    cur = forest.cu_nodes[:-1].to(dev).clone()                 # current node of each request
    live = torch.ones(R, dtype=torch.bool, device=dev)
    bonus = torch.zeros(R, dtype=torch.int64, device=dev)
    rows = torch.arange(R, device=dev)
    paths = [[0] for _ in range(R)]
    for _ in range(forest.max_depth + 1):
        p = probs[cur].clone()                                  # [R, V] residual at the node
        moved = torch.zeros(R, dtype=torch.bool, device=dev)
        for j in range(table.shape[1]):
            child = table[cur, j]
            trying = live & ~moved & (child >= 0)
            x = tokens[child.clamp(min=0)]
            total = p.sum(-1)
            px = p[rows, x] / total.clamp_min(1e-30)
            u = torch.rand(R, device=dev, generator=generator)
            ok = trying & (u < px)
            cur = torch.where(ok, child, cur)
            moved |= ok
            _remove_rejected(p, rows, x, trying & ~ok)
        done = live & ~moved
        if bool(done.any()):
            draw = torch.multinomial(p[done] / p[done].sum(-1, keepdim=True), 1,
                                     generator=generator)[:, 0]
            bonus[done] = draw
        for r in torch.nonzero(moved & live).flatten().tolist():
            paths[r].append(int(cur[r]) - int(forest.cu_nodes[r]))
        live &= moved
        if not bool(live.any()):
            break
    lo = forest.cu_nodes.tolist()
    tok = tokens.tolist()
    new_tokens = [[tok[lo[r] + n] for n in paths[r][1:]] + [int(bonus[r])] for r in range(R)]
    return Acceptance([pth[-1] for pth in paths], paths, bonus, new_tokens)

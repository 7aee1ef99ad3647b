"""Dynamic draft trees (EAGLE-2 style): top-k expansion by cumulative draft probability, then a
rerank to a node budget.

A drafter scores a node's continuations; a node's score is rho = the product of the draft
probabilities along its path (root rho = 1). Each step expands the ``topk`` best frontier nodes into
their ``topk`` best children; after ``depth`` steps every created node competes for ``budget`` slots
by rho. rho never increases down a path, so the kept set is prefix-connected (ties broken parent
first); node 0 is the root, parents precede children, siblings in draft order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from bole.tree import DraftTree

#: expand(paths) -> for each path (tokens from the root, root included) up to k
#: ``(token, probability)`` pairs in descending probability.
Expander = Callable[[Sequence[Sequence[int]], int], Sequence[Sequence[tuple[int, float]]]]

#: The batched form: ``expand_batch(paths_per_request, k)`` gets one list of paths per request (empty
#: for a request with nothing to expand this step) and returns one list of proposals per request.
BatchExpander = Callable[[Sequence[Sequence[Sequence[int]]], int],
                         Sequence[Sequence[Sequence[tuple[int, float]]]]]


@dataclass
class DraftResult:
    tree: DraftTree
    tokens: torch.Tensor       # [T] int64, tokens[0] = the root token
    rho: torch.Tensor          # [T] float64 cumulative draft probability, rho[0] = 1


class _Growth:
    """One request's tree while it grows: parents, tokens, rho, depths and the frontier."""

    def __init__(self, root_token: int, budget: int):
        self.parents, self.tokens, self.rho, self.depths = [-1], [int(root_token)], [1.0], [0]
        self.frontier = [0] if budget > 1 else []     # budget 1: the root alone, nothing to draft

    def frontier_paths(self) -> list[list[int]]:
        return [_path_tokens(n, self.parents, self.tokens) for n in self.frontier]

    def grow(self, proposals, topk: int) -> None:
        if len(proposals) != len(self.frontier):
            raise ValueError(f"expand returned {len(proposals)} proposal lists for "
                             f"{len(self.frontier)} nodes")
        created = []
        for node, props in zip(self.frontier, proposals):
            seen = set()
            for tok, prob in list(props)[:topk]:
                tok = int(tok)
                if tok in seen or not 0.0 <= prob <= 1.0:
                    raise ValueError(f"expand proposed a repeated token or a probability outside "
                                     f"[0, 1] under one node: {props}")
                seen.add(tok)
                self.parents.append(node)
                self.tokens.append(tok)
                self.rho.append(self.rho[node] * float(prob))
                self.depths.append(self.depths[node] + 1)
                created.append(len(self.parents) - 1)
        # expand the topk best new nodes next (EAGLE-2), ties by creation order
        self.frontier = sorted(created, key=lambda i: (-self.rho[i], i))[:topk]

    def result(self, budget: int) -> DraftResult:
        """The root plus the budget - 1 best nodes; parents sort before their children."""
        parents, rho, depths = self.parents, self.rho, self.depths
        ranked = sorted(range(1, len(parents)), key=lambda i: (-rho[i], depths[i], i))[: budget - 1]
        keep = sorted([0] + ranked, key=lambda i: (depths[i], _sibling_key(i, parents, rho)))
        new_index = {old: n for n, old in enumerate(keep)}
        kept_parents = [-1 if parents[i] < 0 else new_index[parents[i]] for i in keep]
        return DraftResult(DraftTree.from_parents(kept_parents),
                           torch.tensor([self.tokens[i] for i in keep], dtype=torch.int64),
                           torch.tensor([rho[i] for i in keep], dtype=torch.float64))


def build_draft_trees(root_tokens: Sequence[int], expand_batch: BatchExpander, *,
                      depths: Sequence[int], topk: int, budget: int) -> list[DraftResult]:
    """Grow one tree per request, all requests' frontiers expanded together at each step (one
    ``expand_batch`` call per step, so a drafter can run them in one batched forward).

    Request ``i`` grows for ``depths[i]`` steps; ``budget`` counts the root.
    """
    if len(depths) != len(root_tokens):
        raise ValueError(f"{len(depths)} depths for {len(root_tokens)} requests")
    if any(d < 0 for d in depths) or topk < 1 or budget < 1:
        raise ValueError(f"need depth >= 0, topk >= 1 and budget >= 1; got depths={list(depths)}, "
                         f"topk={topk}, budget={budget}")
    trees = [_Growth(root, budget) for root in root_tokens]
    for step in range(max(depths, default=0)):
        live = [bool(t.frontier) and step < d for t, d in zip(trees, depths)]
        if not any(live):
            break
        paths = [t.frontier_paths() if ok else [] for t, ok in zip(trees, live)]
        proposals = expand_batch(paths, topk)
        if len(proposals) != len(trees):
            raise ValueError(f"expand_batch returned {len(proposals)} lists for {len(trees)} requests")
        for t, ok, props in zip(trees, live, proposals):
            if ok:
                t.grow(props, topk)
    return [t.result(budget) for t in trees]


def top_k_per_request(logits: torch.Tensor, paths_per_request, k: int) -> list[list]:
    """A batch expander's answer from the drafter's logits ``[N, V]`` of every path, in request
    order (request ``i`` owns the next ``len(paths_per_request[i])`` rows): the ``k`` most
    probable ``(token, probability)`` pairs of each path, one list per request."""
    top = torch.topk(torch.softmax(logits.float(), -1), k)
    flat = [list(zip(t, p)) for t, p in zip(top.indices.tolist(), top.values.tolist())]
    out, pos = [], 0
    for paths in paths_per_request:
        out.append(flat[pos: pos + len(paths)])
        pos += len(paths)
    return out


def per_request(expanders: Sequence[Expander]) -> BatchExpander:
    """A batch expander from one expander per request (no batching across requests)."""
    def expand_batch(paths, k):
        return [e(p, k) if p else [] for e, p in zip(expanders, paths)]
    return expand_batch


def _sibling_key(i: int, parents: list[int], rho: list[float]):
    """Order within a level: by the parent's place, then the draft order (descending rho)."""
    chain = []
    while i >= 0:
        chain.append((-rho[i], i))
        i = parents[i]
    return chain[::-1]


def _path_tokens(node: int, parents: list[int], tokens: list[int]) -> list[int]:
    out = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]

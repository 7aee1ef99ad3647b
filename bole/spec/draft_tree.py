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


@dataclass
class DraftResult:
    tree: DraftTree
    tokens: torch.Tensor       # [T] int64, tokens[0] = the root token
    rho: torch.Tensor          # [T] float64 cumulative draft probability, rho[0] = 1


def build_draft_tree(root_token: int, expand: Expander, *, depth: int, topk: int,
                     budget: int) -> DraftResult:
    """Grow a tree from ``root_token`` with ``expand`` and keep the ``budget`` best nodes.

    ``budget`` counts the root: budget 1 gives a lone root (plain decoding).
    """
    if depth < 0 or topk < 1 or budget < 1:
        raise ValueError(f"need depth >= 0, topk >= 1 and budget >= 1; got depth={depth}, "
                         f"topk={topk}, budget={budget}")
    parents, tokens, rho, depths = [-1], [int(root_token)], [1.0], [0]
    frontier = [0] if budget > 1 else []          # budget 1: the root alone, nothing to draft
    for _ in range(depth):
        if not frontier:
            break
        paths = [_path_tokens(n, parents, tokens) for n in frontier]
        proposals = expand(paths, topk)
        if len(proposals) != len(frontier):
            raise ValueError(f"expand returned {len(proposals)} proposal lists for {len(frontier)} nodes")
        created = []
        for node, props in zip(frontier, proposals):
            seen = set()
            for tok, prob in list(props)[:topk]:
                tok = int(tok)
                if tok in seen or not 0.0 <= prob <= 1.0:
                    raise ValueError(f"expand proposed a repeated token or a probability outside "
                                     f"[0, 1] under one node: {props}")
                seen.add(tok)
                parents.append(node)
                tokens.append(tok)
                rho.append(rho[node] * float(prob))
                depths.append(depths[node] + 1)
                created.append(len(parents) - 1)
        # expand the topk best new nodes next (EAGLE-2), ties by creation order
        frontier = sorted(created, key=lambda i: (-rho[i], i))[:topk]
    # rerank: the root plus the budget - 1 best nodes; parents sort before their children
    ranked = sorted(range(1, len(parents)), key=lambda i: (-rho[i], depths[i], i))[: budget - 1]
    keep = sorted([0] + ranked, key=lambda i: (depths[i], _sibling_key(i, parents, rho)))
    new_index = {old: n for n, old in enumerate(keep)}
    kept_parents = [-1 if parents[i] < 0 else new_index[parents[i]] for i in keep]
    tree = DraftTree.from_parents(kept_parents)
    return DraftResult(tree, torch.tensor([tokens[i] for i in keep], dtype=torch.int64),
                       torch.tensor([rho[i] for i in keep], dtype=torch.float64))


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

"""Hypothesis strategies for draft trees and GDN inputs shared by the property tests."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from bole.tree import DraftTree, PackedForest

SHAPES = ("chain", "star", "kary", "random", "deep", "wide")


@st.composite
def trees(draw, max_nodes: int = 128) -> DraftTree:
    """Chains, stars, full k-ary, random, deep (depth near T) and wide trees of <= max_nodes."""
    kind = draw(st.sampled_from(SHAPES))
    if kind == "chain":
        return DraftTree.chain(draw(st.integers(1, max_nodes)))
    if kind == "star":
        return DraftTree.star(draw(st.integers(1, max_nodes)))
    if kind == "kary":
        arity = draw(st.integers(1, 4))
        depth = draw(st.integers(0, 6))
        t = DraftTree.full_kary(arity, depth)
        while t.num_nodes > max_nodes:
            depth -= 1
            t = DraftTree.full_kary(arity, depth)
        return t
    n = draw(st.integers(1, max_nodes))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if kind == "deep":                      # mostly a chain with a few side branches
        parents = [-1] + [i - 1 if rng.random() < 0.85 else int(rng.integers(0, i))
                          for i in range(1, n)]
        return DraftTree.from_parents(parents)
    if kind == "wide":
        return DraftTree.random(n, max(1, min(3, n - 1)), rng)
    return DraftTree.random(n, draw(st.integers(1, max(1, n - 1))), rng)


def padded(forest: PackedForest, num_nodes: int) -> PackedForest:
    """``forest`` with padding nodes appended up to ``num_nodes`` (parent -1, request -1,
    ``valid == False``), as a fixed-shape caller would add them: the kernels must write zeros
    there and leave every real node alone."""
    extra = num_nodes - forest.num_nodes
    assert extra >= 0, (forest.num_nodes, num_nodes)
    minus = torch.full((extra,), -1, dtype=torch.int64)
    return PackedForest(
        parents=torch.cat([forest.parents, minus]), cu_nodes=forest.cu_nodes,
        request=torch.cat([forest.request, minus]),
        parent_global=torch.cat([forest.parent_global, minus]),
        depth=torch.cat([forest.depth, torch.zeros(extra, dtype=torch.int64)]),
        valid=torch.cat([forest.valid, torch.zeros(extra, dtype=torch.bool)]))


@st.composite
def forests(draw, max_requests: int = 3, max_nodes: int = 64, pad: bool = True) -> PackedForest:
    batch = [draw(trees(max_nodes)) for _ in range(draw(st.integers(1, max_requests)))]
    forest = PackedForest.pack(batch)
    if pad and draw(st.booleans()):
        forest = padded(forest, forest.num_nodes + draw(st.integers(1, 5)))
    return forest


GATE_REGIMES = ("mixed", "no_decay", "strong_decay", "beta_zero", "beta_one")


def gdn_inputs(forest: PackedForest, H_k: int, H_v: int, d_k: int, d_v: int, seed: int,
               regime: str = "mixed", dtype=torch.float64):
    """Random q, k, v, g, beta, state for a forest; keys unit-norm as after l2-normalisation."""
    gen = torch.Generator().manual_seed(seed)
    N, R = forest.num_nodes, forest.num_requests
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = rnd(1, N, H_k, d_k), rnd(1, N, H_k, d_k), rnd(1, N, H_v, d_v)
    k = k / k.norm(dim=-1, keepdim=True)
    u = torch.rand(1, N, H_v, generator=gen, dtype=torch.float64)
    g = {"mixed": -u * 3, "no_decay": -u * 1e-6, "strong_decay": -20 - u}.get(regime, -u * 2)
    if regime == "mixed":        # sprinkle extremes in
        g = torch.where(u < 0.1, torch.full_like(g, -20.0), g)
        g = torch.where(u > 0.9, -u * 1e-7, g)
    beta = torch.rand(1, N, H_v, generator=gen, dtype=torch.float64)
    if regime == "beta_zero":
        beta = beta * 1e-6
    elif regime == "beta_one":
        beta = 1 - beta * 1e-6
    state = rnd(R, H_v, d_k, d_v)
    cast = lambda t: t.to(dtype)  # noqa: E731
    return dict(q=cast(q), k=cast(k), v=cast(v), g=cast(g), beta=cast(beta),
                initial_state=state.to(torch.promote_types(dtype, torch.float32)))

"""Draft-tree construction and the n-gram drafter."""


import pytest
import torch
from hypothesis import given, settings, strategies as st

from bole.speculative.drafters.host_growth import build_draft_trees, per_request
from bole.speculative.drafters.ngram import NgramDrafter


def build_draft_tree(root, expand, *, depth, topk, budget):
    """One request's tree from the batched builder."""
    return build_draft_trees([root], per_request([expand]), depths=[depth], topk=topk,
                             budget=budget)[0]


def synthetic(seed: int, vocab: int = 7):
    """An expander with fixed pseudo-random distributions per path (deterministic)."""
    def dist(path):
        g = torch.Generator().manual_seed(hash((seed, tuple(path))) % 2**31)
        p = torch.softmax(torch.randn(vocab, generator=g) * 2, 0)
        order = torch.argsort(p, descending=True)
        return [(int(t), float(p[t])) for t in order]

    def expand(paths, k):
        return [dist(p)[:k] for p in paths]
    return expand, dist


@given(seed=st.integers(0, 10_000), depth=st.integers(0, 5), topk=st.integers(1, 4),
       budget=st.integers(1, 40))
@settings(max_examples=60)
def test_tree_is_prefix_connected_within_budget_and_best_by_rho(seed, depth, topk, budget):
    expand, dist = synthetic(seed)
    res = build_draft_tree(3, expand, depth=depth, topk=topk, budget=budget)
    t, rho = res.tree, res.rho
    assert t.num_nodes <= budget and res.tokens[0] == 3 and rho[0] == 1
    assert t.max_depth <= depth
    for i in range(1, t.num_nodes):
        p = int(t.parents[i])
        assert rho[i] <= rho[p] + 1e-15                         # rho never increases
        path = res.tokens[t.path(p)].tolist()
        probs = dict(dist(path))
        assert abs(rho[i] - rho[p] * probs[int(res.tokens[i])]) < 1e-12
    # siblings distinct and in draft order
    for i in range(t.num_nodes):
        kids = t.children(i).tolist()
        toks = [int(res.tokens[c]) for c in kids]
        assert len(set(toks)) == len(toks)
        assert [float(rho[c]) for c in kids] == sorted((float(rho[c]) for c in kids), reverse=True)


def eagle2_reference(root, dist, depth, topk, budget):
    """EAGLE-2's growth written out on token paths: each step gives each of the ``topk`` best
    nodes created by the step before (by rho) its ``topk`` most probable children; then the
    ``budget - 1`` best created nodes are kept. Returns {path: rho} of the kept nodes."""
    frontier, created = [((root,), 1.0)], {}
    for _ in range(depth):
        new = {}
        for path, rho in sorted(frontier, key=lambda x: -x[1])[:topk]:
            for tok, p in dist(list(path))[:topk]:
                new[path + (tok,)] = rho * p
        created.update(new)
        frontier = list(new.items())
    return dict(sorted(created.items(), key=lambda x: -x[1])[:budget - 1])


def paths_of(res):
    t = res.tree
    return {tuple(res.tokens[t.path(i)].tolist()): float(res.rho[i]) for i in range(1, t.num_nodes)}


@pytest.mark.parametrize("seed,depth,topk,budget", [(11, 3, 3, 8), (11, 3, 3, 10_000),
                                                    (5, 4, 2, 6), (7, 5, 4, 20), (3, 2, 4, 9)])
def test_keeps_the_highest_rho_nodes_of_the_expanded_tree(seed, depth, topk, budget):
    """The builder's nodes (as token paths) and their rho equal an independent EAGLE-2 growth
    and rerank over the same draft distributions."""
    expand, dist = synthetic(seed)
    res = build_draft_tree(0, expand, depth=depth, topk=topk, budget=budget)
    want = eagle2_reference(0, dist, depth, topk, budget)
    got = paths_of(res)
    assert got.keys() == want.keys()
    assert all(got[p] == pytest.approx(want[p], rel=1e-12) for p in want)


def test_budget_one_is_plain_decoding_and_bad_arguments():
    calls = []
    res = build_draft_tree(5, lambda paths, k: calls.append(paths) or [], depth=4, topk=2, budget=1)
    assert res.tree.num_nodes == 1 and not calls
    with pytest.raises(ValueError, match="budget"):
        build_draft_tree(5, lambda p, k: [], depth=1, topk=1, budget=0)
    with pytest.raises(ValueError, match="proposal lists"):
        build_draft_tree(5, lambda p, k: [], depth=1, topk=1, budget=3)
    with pytest.raises(ValueError, match="repeated token"):
        build_draft_tree(5, lambda p, k: [[(1, 0.5), (1, 0.4)]], depth=1, topk=2, budget=3)


def test_ngram_drafter_continues_repeated_text():
    d = NgramDrafter(max_n=3)
    history = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    res = build_draft_tree(history[-1], d.expander(history), depth=4, topk=2, budget=8)
    chain, node = [], 0
    while len(kids := res.tree.children(node)):
        node = int(kids[0])
        chain.append(int(res.tokens[node]))
    assert chain == [3, 4, 5, 1]
    assert d.lookup([7, 8, 9], 2) == []                       # nothing repeats: no proposal
    assert d.lookup([1, 2, 1, 3, 1], 2) == [(3, 0.5), (2, 0.5)]  # ties: most recent first
    with pytest.raises(ValueError):
        NgramDrafter(max_n=1, min_n=2)

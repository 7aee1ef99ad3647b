"""Draft-tree construction and the n-gram drafter."""


import pytest
import torch
from hypothesis import given, settings, strategies as st

from bole.speculative.draft_tree import build_draft_trees, per_request
from bole.speculative.drafters import NgramDrafter


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


def test_keeps_the_highest_rho_nodes_of_the_expanded_tree():
    expand, _ = synthetic(11)
    full = build_draft_tree(0, expand, depth=3, topk=3, budget=10_000)
    cut = build_draft_tree(0, expand, depth=3, topk=3, budget=8)
    best = sorted(full.rho.tolist()[1:], reverse=True)[:7]
    assert sorted(cut.rho.tolist()[1:], reverse=True) == pytest.approx(best)


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

"""Lossless acceptance: the whole tree procedure samples exactly from the target.

A small-vocabulary tree with fixed target distributions per node, 10^5 independent draws in one
batch, chi-square and total-variation distance against exact sequence probabilities computed
independently by enumeration; Bole's own rule with the removal of rejected tokens taken out must
fail the same test.
"""


import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from bole.speculative import accept
from bole.speculative.accept import accept_forest, children_table
from bole.sampling_params import SamplingParams
from bole.speculative.sampling import target_probs
from bole.tree import DraftTree, PackedForest

V = 5
# root(tok 0) -> children tokens 2, 0, 4 (draft order); node 1 (tok 2) -> 1, 3; node 2 (tok 0) -> 0
PARENTS = [-1, 0, 0, 0, 1, 1, 2]
TOKENS = [0, 2, 0, 4, 1, 3, 0]
DRAWS = 100_000


def node_probs(seed=0):
    rng = np.random.default_rng(seed)
    return torch.tensor(rng.dirichlet(np.ones(V) * 0.8, size=len(PARENTS)), dtype=torch.float32)


def exact_outcomes(probs):
    """P(emitted sequence) by enumeration: path tokens then a bonus that is not a child token."""
    kids = {i: [j for j, p in enumerate(PARENTS) if p == i] for i in range(len(PARENTS))}
    out = {}

    def walk(node, prefix, mass):
        child_tokens = {TOKENS[c]: c for c in kids[node]}
        for t in range(V):
            m = mass * float(probs[node, t])
            if t in child_tokens:
                walk(child_tokens[t], prefix + (t,), m)
            else:
                out[prefix + (t,)] = m
    walk(0, (), 1.0)
    return out


def run_batch(probs, generator):
    tree = DraftTree.from_parents(PARENTS)
    forest = PackedForest.pack([tree] * DRAWS)
    all_probs = probs.repeat(DRAWS, 1)
    tokens = torch.tensor(TOKENS).repeat(DRAWS)
    return accept_forest(all_probs, tokens, forest, generator=generator)


def goodness(seqs, exact):
    keys = sorted(exact)
    counts = {k: 0 for k in keys}
    other = 0
    for s in seqs:
        if s in counts:
            counts[s] += 1
        else:
            other += 1
    obs = np.array([counts[k] for k in keys] + [other], dtype=float)
    exp = np.array([exact[k] * len(seqs) for k in keys] + [0.0])
    tv = 0.5 * np.abs(obs / len(seqs) - exp / len(seqs)).sum()
    keep = exp > 0
    if other:                                   # an impossible sequence fails outright
        return 0.0, tv
    return chisquare(obs[keep], exp[keep]).pvalue, tv


def test_tree_acceptance_is_lossless():
    probs = node_probs()
    exact = exact_outcomes(probs)
    assert abs(sum(exact.values()) - 1) < 1e-6
    acc = run_batch(probs, torch.Generator().manual_seed(0))
    pvalue, tv = goodness([tuple(t) for t in acc.new_tokens], exact)
    assert pvalue > 1e-3 and tv < 0.01, (pvalue, tv)
    # the first emitted token alone is distributed as the root's target
    first = np.bincount([t[0] for t in acc.new_tokens], minlength=V) / DRAWS
    assert np.abs(first - probs[0].numpy()).max() < 0.01


def test_wrong_rule_fails_the_same_test(monkeypatch):
    """accept_forest with rejected tokens left in the residual (the classic mistake) samples the
    wrong distribution, and the goodness test above sees it."""
    monkeypatch.setattr(accept, "_remove_rejected", lambda p, rows, tokens, rejected: None)
    probs = node_probs()
    acc = run_batch(probs, torch.Generator().manual_seed(1))
    pvalue, tv = goodness([tuple(t) for t in acc.new_tokens], exact_outcomes(probs))
    assert pvalue < 1e-6, (pvalue, tv)


def test_greedy_follows_argmax_and_emits_it_at_the_first_miss():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(PARENTS), V, generator=gen)
    forest = PackedForest.pack([DraftTree.from_parents(PARENTS)])
    probs = target_probs(logits, SamplingParams(temperature=0))
    acc = accept_forest(probs, torch.tensor(TOKENS), forest, generator=gen)
    node, expect = 0, []
    kids = children_table(forest)
    while True:
        best = int(logits[node].argmax())
        nxt = [int(c) for c in kids[node] if c >= 0 and TOKENS[int(c)] == best]
        expect.append(best)
        if not nxt:
            break
        node = nxt[0]
    assert acc.new_tokens[0] == expect and acc.accepted[0] == node


def test_children_table():
    forest = PackedForest.pack([DraftTree.from_parents(PARENTS), DraftTree.chain(3)])
    t = children_table(forest)
    assert t[0].tolist() == [1, 2, 3] and t[1].tolist()[:2] == [4, 5] and t[2].tolist()[0] == 6
    assert t[7].tolist()[0] == 8 and (t[6] == -1).all()


# ---- the target distribution ----

def test_target_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    p = target_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.allclose(p[0, :2], torch.softmax(logits[0, :2], -1))
    full = torch.softmax(logits, -1)[0]
    p = target_probs(logits, SamplingParams(temperature=1.0,
                                            top_p=float(full[0]) + 1e-3))   # needs the top two
    assert (p[0] > 0).tolist() == [True, True, False, False, False]
    p = target_probs(logits, SamplingParams(temperature=1.0,
                                            top_p=float(full[0]) / 2))      # top one alone
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert target_probs(logits, SamplingParams(temperature=0))[0].tolist() == [1, 0, 0, 0, 0]


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_invalid_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw).validate()

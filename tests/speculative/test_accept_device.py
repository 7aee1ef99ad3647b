"""Device acceptance (bole.speculative.accept_device): the rule of accept_forest in fixed shapes.

* greedy: equal to accept_forest on one-hot greedy probabilities, over random padded forests;
* sampled: equal to a per-request pure-Python walk consuming the same uniforms;
* lossless: first token, first two tokens and whole emitted sequences follow the target
  (chi-square, many requests in one batch), for likely, unlikely, zero-probability and duplicate
  draft tokens;
* target_probs_rows equals target_probs row by row; sample_rows never draws a zero-probability
  token and is unbiased; nothing synchronises with the host (and, on CUDA, the round captures
  into a CUDA graph).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy.stats import chisquare

from bole.forest import DenseForest
from bole.speculative.accept import accept_forest
from bole.speculative.accept_device import (
    EMITTED_PAD, DeviceAcceptance, SamplingBatch, accept, accept_greedy, accept_sampled,
    children_slots, draw_uniforms, sample_rows, target_probs_rows)
from bole.sampling_params import SamplingParams
from bole.speculative.sampling import target_probs
from bole.tree import DraftTree, PackedForest
from tests.strategies import forests, padded

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ---------------------------------------------------------------- helpers

def with_single_node_request(forest: PackedForest) -> PackedForest:
    """The same forest plus a one-node request (padding of the packed form kept)."""
    trees = [forest.tree(r) for r in range(forest.num_requests)] + [DraftTree.chain(1)]
    packed = PackedForest.pack(trees)
    extra = forest.num_nodes - forest.num_valid_nodes
    return padded(packed, packed.num_nodes + extra)


def children_lists(dense: DenseForest, r: int) -> dict[int, list[int]]:
    """Host children lists of request r in draft (index) order."""
    parents, valid = dense.parents[r].tolist(), dense.valid[r].tolist()
    kids: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    for i, (p, v) in enumerate(zip(parents, valid)):
        if v and p >= 0:
            kids[p].append(i)
    return kids


def to_packed_rows(dense_rows: torch.Tensor, forest: PackedForest) -> torch.Tensor:
    """``[R, T, ...]`` dense per-node values -> ``[N, ...]`` in the packed forest's order."""
    sizes = forest.sizes().tolist()
    rows = torch.cat([dense_rows[r, :n] for r, n in enumerate(sizes)])
    pad = forest.num_nodes - rows.shape[0]
    return torch.cat([rows, rows[:1].expand(pad, *rows.shape[1:])]) if pad else rows


def check_layout(acc, dense: DenseForest, r: int, path: list[int], new_tokens: list[int]):
    """One request's DeviceAcceptance row against its expected path and emitted tokens."""
    n = len(path)
    D = dense.max_depth + 1
    assert int(acc.accepted[r]) == path[-1]
    assert int(acc.path_len[r]) == n and int(acc.num_emitted[r]) == n
    assert acc.path[r].tolist() == path + [path[-1]] * (D - n)
    assert acc.emitted[r].tolist() == new_tokens + [EMITTED_PAD] * (D - n)
    assert int(acc.bonus[r]) == new_tokens[-1]


def chi2_pvalue(observed: dict, expected: dict, n: int) -> float:
    """Chi-square p-value of outcome counts against exact probabilities; 0 when an impossible
    outcome occurs. Outcomes expected fewer than 5 times are pooled."""
    if any(expected.get(k, 0.0) == 0.0 for k in observed):
        return 0.0
    keys = [k for k in expected if expected[k] > 0]
    obs = np.array([observed.get(k, 0) for k in keys], dtype=float)
    exp = np.array([expected[k] * n for k in keys])
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    exp *= obs.sum() / exp.sum()                 # remove float drift of the exact probabilities
    return float(chisquare(obs, exp).pvalue)


# ---------------------------------------------------------------- (a) greedy

@settings(max_examples=60, derandomize=True)
@given(forest=forests(max_requests=4, max_nodes=20), extra=st.integers(0, 3),
       seed=st.integers(0, 2**31 - 1))
def test_greedy_matches_accept_forest(forest, extra, seed):
    forest = with_single_node_request(forest)
    dense = DenseForest.from_packed(forest, int(forest.sizes().max()) + extra)
    R, T = dense.parents.shape
    V = 6                                       # small: siblings sometimes repeat a token
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, T, V, generator=gen)
    argmax = logits.argmax(-1)
    tokens = torch.randint(0, V, (R, T), generator=gen)
    rng = np.random.default_rng(seed)
    for r in range(R):                          # put the argmax on a random child of most nodes
        for node, kids in children_lists(dense, r).items():
            if kids and rng.random() < 0.8:
                tokens[r, kids[rng.integers(len(kids))]] = argmax[r, node]
    ref = accept_forest(target_probs(to_packed_rows(logits, forest), SamplingParams(temperature=0)),
                        to_packed_rows(tokens, forest), forest, generator=gen)
    acc = accept_greedy(argmax, tokens, dense)
    for r in range(R):
        check_layout(acc, dense, r, ref.path[r], ref.new_tokens[r])
    # the same through accept() with an all-greedy batch
    batch = SamplingBatch.from_params([SamplingParams(temperature=0)] * R)
    mixed = accept(logits, tokens, dense, batch)
    assert torch.equal(mixed.emitted, acc.emitted) and torch.equal(mixed.path, acc.path)


@settings(max_examples=60, derandomize=True)
@given(forest=forests(max_requests=4, max_nodes=24), extra=st.integers(0, 3),
       seed=st.integers(0, 2**31 - 1), use_forced=st.booleans())
def test_fused_greedy_kernel_equals_the_torch_walk(forest, extra, seed, use_forced):
    """bole/ops/accept/kernel.py (one launch; the CPU interpreter here) against
    _greedy_walk + _finish: same accepted node, path (padding included), length, bonus and
    emitted row, with and without forced targets."""
    from bole.ops.accept.kernel import greedy_accept_fused
    forest = with_single_node_request(forest)
    dense = DenseForest.from_packed(forest, int(forest.sizes().max()) + extra)
    R, T = dense.parents.shape
    V = 5
    gen = torch.Generator().manual_seed(seed)
    argmax = torch.randint(0, V, (R, T), generator=gen)
    tokens = torch.randint(0, V, (R, T), generator=gen)
    rng = np.random.default_rng(seed)
    for r in range(R):
        for node, kids in children_lists(dense, r).items():
            if kids and rng.random() < 0.8:
                tokens[r, kids[rng.integers(len(kids))]] = argmax[r, node]
    forced = None
    if use_forced:
        forced = torch.where(torch.rand(R, T, generator=gen) < 0.5,
                             torch.randint(0, V, (R, T), generator=gen), -1)
    want = accept_greedy(argmax if forced is None else torch.where(forced >= 0, forced, argmax),
                         tokens, dense)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    accepted, path, path_len, bonus, emitted = greedy_accept_fused(
        argmax.to(dev), tokens.to(dev), dense.parents.to(dev), dense.valid.to(dev),
        dense.max_depth, None if forced is None else forced.to(dev), EMITTED_PAD)
    got = DeviceAcceptance(accepted, path, path_len, bonus, emitted, path_len)
    for name in ("accepted", "path", "path_len", "bonus", "emitted", "num_emitted"):
        # int64 too: the engine indexes and gathers with them
        assert getattr(got, name).dtype == torch.int64, name
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name


def test_greedy_accepts_every_path_length():
    """A chain whose argmax runs out at each possible depth."""
    T, V = 6, 7
    dense = DenseForest.from_parents(
        torch.tensor([[-1, 0, 1, 2, 3, 4]] * T), torch.ones(T, T, dtype=torch.bool), T - 1)
    argmax = torch.arange(1, T + 1).expand(T, T).clone()      # node i's argmax is token i + 1
    tokens = torch.arange(T).expand(T, T).clone()             # node i carries token i: a full match
    for r in range(T):
        tokens[r, r + 1:] = 0                                  # request r stops matching below r
    acc = accept_greedy(argmax, tokens, dense)
    for r in range(T):
        check_layout(acc, dense, r, list(range(r + 1)), list(range(1, r + 1)) + [r + 1])


# ---------------------------------------------------------------- (b) sampled, exact

def reference_sample(p: torch.Tensor, u: torch.Tensor) -> int:
    """Inverse CDF on one row: first positive token whose cumulative mass exceeds u * total."""
    cdf = torch.cumsum(p, 0)
    target = u * cdf[-1]
    positive = [i for i in range(p.shape[0]) if p[i] > 0]
    for i in positive:
        if cdf[i] > target:
            return i
    return positive[-1] if positive else 0


def reference_walk(probs: torch.Tensor, tokens: list[int], kids: dict[int, list[int]],
                   u: torch.Tensor, K: int) -> tuple[list[int], list[int]]:
    """One request: ``(path, emitted tokens)`` of the lossless rule, uniforms ``u [D+1, K+1]``."""
    node, path, emitted = 0, [0], []
    while True:
        d = len(path) - 1
        p = probs[node].clone()
        nxt = None
        for j, c in enumerate(kids[node][:K]):
            x = tokens[c]
            if u[d, j] < p[x] / p.sum().clamp_min(1e-30):
                nxt = c
                break
            p[x] = 0.0
        if nxt is None:
            return path, emitted + [reference_sample(p, u[d, K])]
        node = nxt
        path.append(node)
        emitted.append(tokens[node])


def random_batch(R: int, rng: np.random.Generator,
                 greedy_share: float = 0.0) -> list[SamplingParams]:
    params = []
    for _ in range(R):
        if rng.random() < greedy_share:
            params.append(SamplingParams(temperature=0))
            continue
        params.append(SamplingParams(temperature=float(rng.choice([0.5, 1.0, 1.7])),
                                     top_k=int(rng.choice([0, 0, 1, 3, 20])),
                                     top_p=float(rng.choice([1.0, 1.0, 0.5, 0.9]))))
    return params


@settings(max_examples=60, derandomize=True)
@given(forest=forests(max_requests=4, max_nodes=20), extra=st.integers(0, 3),
       slack=st.integers(-1, 2), seed=st.integers(0, 2**31 - 1))
def test_sampled_matches_reference_walk(forest, extra, slack, seed):
    forest = with_single_node_request(forest)
    dense = DenseForest.from_packed(forest, int(forest.sizes().max()) + extra)
    R, T = dense.parents.shape
    V = 8
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    batch = SamplingBatch.from_params(random_batch(R, rng))
    probs = target_probs_rows(torch.randn(R, T, V, generator=gen) * 2, batch)
    # some unnormalised rows with extra zeros
    holes = (torch.rand(R, T, V, generator=gen) < 0.3) & (probs < probs.amax(-1, keepdim=True))
    probs = torch.where(holes & (torch.rand(R, T, 1, generator=gen) < 0.5), 0.0, probs * 1.5)
    all_kids = [children_lists(dense, r) for r in range(R)]
    tokens = torch.randint(0, V, (R, T), generator=gen)
    for r in range(R):                          # mostly likely drafts, so paths go deep
        for node, kids in all_kids[r].items():
            for c in kids:
                if rng.random() < 0.7:
                    tokens[r, c] = int(torch.multinomial(probs[r, node], 1, generator=gen))
    K = max(0, max(len(k) for ks in all_kids for k in ks.values()) + slack)
    uniforms = draw_uniforms(R, dense.max_depth, K, gen)
    acc = accept_sampled(probs, tokens, dense, uniforms, max_children=K)
    for r in range(R):
        path, emitted = reference_walk(probs[r], tokens[r].tolist(), all_kids[r], uniforms[r], K)
        check_layout(acc, dense, r, path, emitted)


def test_children_slots():
    parents = torch.tensor([[-1, 0, 0, 1, 0, 1, -1], [-1, 0, 1, -1, -1, -1, -1]])
    valid = torch.tensor([[True] * 6 + [False], [True] * 3 + [False] * 4])
    table = children_slots(DenseForest.from_parents(parents, valid, 3), 2)
    assert table[0, 0].tolist() == [1, 2] and table[0, 1].tolist() == [3, 5]
    assert table[1, 0].tolist() == [1, -1] and table[1, 1].tolist() == [2, -1]
    assert (table[0, 2:] == -1).all() and (table[1, 2:] == -1).all()


# ---------------------------------------------------------------- (c) lossless

DIST_PARENTS = [-1, 0, 0, 0, 1, 1, 2]
DIST_V = 6
DIST_R = 30_000


def dist_probs() -> torch.Tensor:
    """Fixed target per node with zeros: token 5 is impossible everywhere, one more per odd node."""
    rng = np.random.default_rng(7)
    p = rng.dirichlet(np.ones(DIST_V), size=len(DIST_PARENTS))
    p[:, 5] = 0
    for node in range(1, len(DIST_PARENTS), 2):
        p[node, (node + 1) % 5] = 0
    return torch.tensor(p / p.sum(1, keepdims=True), dtype=torch.float32)


def dist_tokens(probs: torch.Tensor, kind: str) -> list[int]:
    """Draft tokens of every node, chosen against its parent's target."""
    kids = {i: [j for j, p in enumerate(DIST_PARENTS) if p == i] for i in range(len(DIST_PARENTS))}
    tokens = [0] * len(DIST_PARENTS)
    for node, cs in kids.items():
        by_mass = torch.argsort(probs[node], descending=True, stable=True).tolist()
        positive = [t for t in by_mass if probs[node, t] > 0]
        zero = [t for t in by_mass if probs[node, t] == 0]
        order = {"likely": positive, "unlikely": positive[::-1],
                 "zero": zero + positive, "duplicate": [positive[0]] * 2 + positive[1:]}[kind]
        for c, t in zip(cs, order):
            tokens[c] = t
    return tokens


def exact_sequences(probs: torch.Tensor, tokens: list[int]) -> dict[tuple, float]:
    """P(emitted sequence): accepted child tokens then a bonus (first child with a token wins)."""
    kids = {i: [j for j, p in enumerate(DIST_PARENTS) if p == i] for i in range(len(DIST_PARENTS))}
    out: dict[tuple, float] = {}

    def walk(node, prefix, mass):
        first = {}
        for c in kids[node]:
            first.setdefault(tokens[c], c)
        for t in range(DIST_V):
            m = mass * float(probs[node, t])
            if t in first:
                walk(first[t], prefix + (t,), m)
            else:
                out[prefix + (t,)] = out.get(prefix + (t,), 0.0) + m
    walk(0, (), 1.0)
    return out


def marginal(exact: dict[tuple, float], n: int) -> dict[tuple, float]:
    """Probabilities of the first n emitted tokens (shorter sequences kept whole)."""
    out: dict[tuple, float] = {}
    for seq, m in exact.items():
        out[seq[:n]] = out.get(seq[:n], 0.0) + m
    return out


def count(seqs: list[tuple], n: int) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for s in seqs:
        out[s[:n]] = out.get(s[:n], 0) + 1
    return out


@pytest.mark.parametrize("kind", ["likely", "unlikely", "zero", "duplicate"])
def test_emitted_tokens_follow_the_target(kind):
    probs = dist_probs()
    tokens = dist_tokens(probs, kind)
    T = len(DIST_PARENTS)
    dense = DenseForest.from_parents(torch.tensor([DIST_PARENTS] * DIST_R),
                                     torch.ones(DIST_R, T, dtype=torch.bool), 2)
    gen = torch.Generator().manual_seed(11)
    uniforms = draw_uniforms(DIST_R, 2, 3, gen)
    acc = accept_sampled(probs.expand(DIST_R, T, DIST_V), torch.tensor([tokens] * DIST_R),
                         dense, uniforms)
    n = acc.num_emitted.tolist()
    seqs = [tuple(row[:k]) for row, k in zip(acc.emitted.tolist(), n)]
    exact = exact_sequences(probs, tokens)
    assert abs(sum(exact.values()) - 1) < 1e-5
    first = chi2_pvalue(count(seqs, 1), marginal(exact, 1), DIST_R)
    pair = chi2_pvalue(count(seqs, 2), marginal(exact, 2), DIST_R)
    whole = chi2_pvalue(count(seqs, 3), exact, DIST_R)
    assert min(first, pair, whole) > 1e-3, (first, pair, whole)
    # the first token alone is the root's target, whatever was drafted
    freq = np.bincount([s[0] for s in seqs], minlength=DIST_V) / DIST_R
    assert np.abs(freq - probs[0].numpy()).max() < 0.015


def test_a_biased_rule_fails_the_same_test():
    """Sanity of the test: never removing rejected tokens from the residual is detected."""
    probs = dist_probs()
    tokens = dist_tokens(probs, "likely")
    rng = np.random.default_rng(3)
    kids = {i: [j for j, p in enumerate(DIST_PARENTS) if p == i] for i in range(len(DIST_PARENTS))}
    seqs = []
    for _ in range(DIST_R // 3):
        node, seq = 0, []
        while True:
            p = probs[node].double().numpy()
            p = p / p.sum()
            nxt = next((c for c in kids[node] if rng.random() < p[tokens[c]]), None)
            if nxt is None:
                seq.append(int(rng.choice(DIST_V, p=p)))
                break
            node = nxt
            seq.append(tokens[nxt])
        seqs.append(tuple(seq))
    assert chi2_pvalue(count(seqs, 3), exact_sequences(probs, tokens), len(seqs)) < 1e-6


# ---------------------------------------------------------------- (d) target distribution

def tricky_logits(R: int, T: int, V: int, gen: torch.Generator) -> torch.Tensor:
    """Gaussian logits, integer logits (top-k ties) and a power-of-two ladder (top-p boundaries)."""
    logits = torch.randn(R, T, V, generator=gen) * 3
    logits[1::3] = torch.randint(-2, 3, (len(range(1, R, 3)), T, V), generator=gen).float()
    ladder = torch.log(torch.tensor([2.0 ** -min(i, 8) for i in range(V)]))
    logits[2::3] = ladder[torch.randperm(V, generator=gen)]
    return logits


@pytest.mark.parametrize("device", DEVICES)
def test_target_probs_rows_equals_target_probs(device):
    gen = torch.Generator().manual_seed(5)
    rng = np.random.default_rng(5)
    R, T, V = 30, 4, 40
    params = random_batch(R, rng, greedy_share=0.2)
    params[2] = SamplingParams(temperature=1.0, top_p=0.75)   # 0.5 + 0.25: exactly on the boundary
    params[5] = SamplingParams(temperature=1.0, top_k=V)
    params[8] = SamplingParams(temperature=0.3, top_k=7, top_p=0.5)
    batch = SamplingBatch.from_params(params, device)
    logits = tricky_logits(R, T, V, gen).to(device)
    out3 = target_probs_rows(logits, batch)
    out2 = target_probs_rows(logits.reshape(R * T, V), batch, T)
    assert out3.dtype == torch.float32 and torch.equal(out2.reshape(R, T, V), out3)
    for r, p in enumerate(params):
        if p.greedy:
            continue
        # the reference on the same [R, T, V] tensor: the same kernels and reduction orders
        assert torch.equal(out3[r], target_probs(logits, p)[r]), (r, p)
        if device == "cpu":
            # CPU reductions do not depend on the number of rows: per request and per row too
            # (CUDA picks reduction splits from the shape, so there target_probs itself differs by
            # an ulp between a slice and the whole batch)
            assert torch.equal(out3[r], target_probs(logits[r], p)), (r, p)
            for t in range(T):
                assert torch.equal(out3[r, t], target_probs(logits[r, t], p)), (r, t, p)
    assert torch.isfinite(out3).all()                         # greedy rows too


def test_sampling_batch_flags():
    b = SamplingBatch.from_params([SamplingParams(temperature=0, top_k=5, top_p=0.5),
                                   SamplingParams(temperature=1.0, top_k=3)])
    assert (b.all_greedy, b.any_greedy, b.any_top_k, b.any_top_p, b.max_top_k) == \
        (False, True, True, False, 3)
    assert b.greedy.tolist() == [True, False] and b.top_k.dtype == torch.int64
    assert SamplingBatch.from_params([SamplingParams(temperature=0)]).all_greedy
    with pytest.raises(ValueError, match="top_p"):
        SamplingBatch.from_params([SamplingParams(temperature=1.0, top_p=0)])


# ---------------------------------------------------------------- (e) sample_rows

def test_sample_rows_never_draws_a_zero_probability_token():
    gen = torch.Generator().manual_seed(2)
    N, V = 4000, 64
    magnitude = torch.exp(torch.randn(N, V, generator=gen) * 8)          # widely spread masses
    probs = torch.where(torch.rand(N, V, generator=gen) < 0.8, 0.0, magnitude)
    probs[:, 0] = 0.0
    probs[:, -1] = 0.0
    probs[0] = 0.0
    probs[0, 5] = 1e-30                                                   # one tiny positive token
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    us = [torch.zeros(N), torch.full((N,), float(below_one)), torch.ones(N),
          torch.rand(N, generator=gen)]
    positive = probs > 0
    first = positive.float().argmax(-1)
    last = V - 1 - positive.flip(-1).float().argmax(-1)
    has = positive.any(-1)
    for i, u in enumerate(us):
        tok = sample_rows(probs, u)
        assert (positive.gather(1, tok[:, None])[:, 0] | ~has).all()
        if i == 0:
            assert torch.equal(tok[has], first[has])
        if i == 2:
            assert torch.equal(tok[has], last[has])
    assert int(sample_rows(torch.zeros(1, V), torch.zeros(1))[0]) == 0    # documented fallback


def test_sample_rows_survives_a_non_monotone_cumsum(monkeypatch):
    """A parallel scan (CUDA) may round a zero-probability token's running sum above its
    predecessor's; such a token must still never be drawn."""
    p = torch.tensor([[0.0, 0.2, 0.0, 0.3, 0.0, 0.0, 0.5, 0.0]]).expand(20_000, -1)
    real = torch.cumsum

    def rounding_up_at_zeros(x, dim):
        return real(x, dim) * torch.where(x == 0, 1.01, 1.0)
    monkeypatch.setattr(torch, "cumsum", rounding_up_at_zeros)
    tok = sample_rows(p, torch.rand(p.shape[0], generator=torch.Generator().manual_seed(8)))
    monkeypatch.undo()
    assert (p[0][tok] > 0).all()


def test_sample_rows_is_unbiased():
    p = torch.tensor([0.0, 0.1, 0.25, 0.0, 0.05, 0.3, 0.3, 0.0])
    N = 50_000
    gen = torch.Generator().manual_seed(4)
    tok = sample_rows(p.expand(N, -1) * 3.0, torch.rand(N, generator=gen))
    counts = torch.bincount(tok, minlength=p.numel())
    assert (counts[p == 0] == 0).all()
    keep = p > 0
    expected = p[keep].double().numpy()
    assert chisquare(counts[keep].numpy(), expected / expected.sum() * N).pvalue > 1e-3


# ---------------------------------------------------------------- (f) no host synchronisation

def mixed_round(device: str, R: int = 6, V: int = 12, seed: int = 0):
    """A mixed greedy / sampled round on a padded random forest."""
    rng = np.random.default_rng(seed)
    trees = [DraftTree.random(int(rng.integers(1, 9)), 3, rng) for _ in range(R)]
    dense = DenseForest.from_packed(PackedForest.pack(trees), 10, device=device)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, 10, V, generator=gen).to(device)
    tokens = torch.randint(0, V, (R, 10), generator=gen).to(device)
    batch = SamplingBatch.from_params(random_batch(R, rng, greedy_share=0.4), device)
    uniforms = draw_uniforms(R, dense.max_depth, 3, gen).to(device)
    return logits, tokens, dense, batch, uniforms


def run_all(logits, tokens, dense, batch, uniforms):
    probs = target_probs_rows(logits, batch)
    return (accept(logits, tokens, dense, batch, uniforms),
            accept_sampled(probs, tokens, dense, uniforms),
            accept_greedy(logits.argmax(-1), tokens, dense),
            sample_rows(probs[:, 0], uniforms[:, 0, 0]))


def test_no_host_sync(monkeypatch):
    inputs = mixed_round("cpu")

    def boom(*args, **kwargs):
        raise AssertionError("host synchronisation")
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                     "unique", "numpy", "cpu"):
            m.setattr(torch.Tensor, name, boom)
        for name in ("nonzero", "unique", "multinomial"):
            m.setattr(torch, name, boom)
        mixed, sampled, greedy, _ = run_all(*inputs)
    # the mixed round is the greedy or the sampled one, request by request
    g = inputs[3].greedy
    for field in ("accepted", "bonus", "emitted", "path"):
        want = torch.where(g.view(-1, *[1] * (getattr(mixed, field).dim() - 1)),
                           getattr(greedy, field), getattr(sampled, field))
        assert torch.equal(getattr(mixed, field), want), field


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_without_sync():
    logits, tokens, dense, batch, uniforms = mixed_round("cuda", R=16, V=300, seed=1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = run_all(logits, tokens, dense, batch, uniforms)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run_all(logits, tokens, dense, batch, uniforms)               # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run_all(logits, tokens, dense, batch, uniforms)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for new_seed in range(3):                    # new randomness and logits, same buffers
        gen = torch.Generator(device="cuda").manual_seed(new_seed)
        uniforms.copy_(torch.rand(uniforms.shape, generator=gen, device="cuda"))
        logits.copy_(torch.randn(logits.shape, generator=gen, device="cuda"))
        graph.replay()
        eager = run_all(logits, tokens, dense, batch, uniforms)
        for a, b in zip(captured[:3], eager[:3]):
            assert torch.equal(a.emitted, b.emitted) and torch.equal(a.path, b.path)
        assert torch.equal(captured[3], eager[3])


# ---------------------------------------------------------------- (g) edges a user would notice

def test_target_probs_rows_infers_or_checks_the_rows_per_request():
    """[N, V] logits without nodes_per_request are R requests of N / R rows each (what a caller
    of the documented default gets); a shape that is not R x T rows is refused, not misread."""
    gen = torch.Generator().manual_seed(9)
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=2.0, top_k=3)]
    batch = SamplingBatch.from_params(params)
    R, T, V = 2, 3, 11                      # V // R is not T
    logits = torch.randn(R, T, V, generator=gen, dtype=torch.float64).float()
    for r, p in enumerate(params):           # the reference: each request's rows on their own
        want = target_probs(logits[r], p)
        assert torch.equal(target_probs_rows(logits.reshape(R * T, V), batch)[r * T:(r + 1) * T],
                           want)
        assert torch.equal(target_probs_rows(logits, batch, nodes_per_request=T)[r], want)
    with pytest.raises(ValueError, match=r"logits \(3, 3, 11\) do not match 2 requests x None"):
        target_probs_rows(torch.zeros(3, T, V), batch)
    with pytest.raises(ValueError, match="do not match 2 requests x 2 nodes"):
        target_probs_rows(logits, batch, nodes_per_request=2)
    with pytest.raises(ValueError, match="7 rows are not 2 requests x 3 nodes"):
        target_probs_rows(torch.zeros(7, V), batch)
    with pytest.raises(ValueError, match="6 rows are not 2 requests x 2 nodes"):
        target_probs_rows(torch.zeros(6, V), batch, nodes_per_request=2)
    with pytest.raises(ValueError, match=r"got \(11,\)"):
        target_probs_rows(torch.zeros(V), batch)


def test_sample_rows_never_draws_a_zero_probability_token_when_only_token_0_is_possible():
    """u at (or rounding to) the top of the CDF, the only positive token first in the row: that
    token, not a later impossible one."""
    probs = torch.tensor([[0.7, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.25, 0.0, 0.5, 0.0]])
    for u in (1.0, float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))):
        tok = sample_rows(probs, torch.full((3,), u)).tolist()
        assert tok[0] == 0 and tok[1] == 0 and tok[2] == 2, (u, tok)


def test_draw_uniforms_follow_the_generator():
    """The uniforms are torch.rand of the given generator, in the documented shape: a request's
    own seeded generator fixes its acceptance draws (its samples)."""
    got = draw_uniforms(2, 3, 4, torch.Generator().manual_seed(17))
    want = torch.rand((2, 4, 5), generator=torch.Generator().manual_seed(17))
    assert got.shape == (2, 4, 5) and got.dtype == torch.float32 and torch.equal(got, want)
    torch.manual_seed(17)                    # the global generator, seeded alike, is not read
    other = draw_uniforms(2, 3, 4, torch.Generator().manual_seed(18))
    assert not torch.equal(other, want)


def test_a_zero_probability_draft_is_never_accepted_even_at_a_zero_uniform():
    """u = 0 (torch.rand can return it) against p(x) = 0: the ratio test is strict, so the
    impossible token is rejected and the bonus is drawn from the residual."""
    probs = torch.tensor([[[0.0, 0.6, 0.4], [0.2, 0.3, 0.5]]])          # token 0 impossible
    dense = DenseForest.from_parents(torch.tensor([[-1, 0]]), torch.ones(1, 2, dtype=torch.bool), 1)
    uniforms = torch.zeros(1, 2, 2)
    acc = accept_sampled(probs, torch.tensor([[7, 0]]), dense, uniforms)
    assert int(acc.accepted[0]) == 0 and int(acc.num_emitted[0]) == 1
    assert float(probs[0, 0, int(acc.bonus[0])]) > 0


@pytest.mark.parametrize("max_depth", [0, 1])
def test_sampled_acceptance_of_roots_alone_is_plain_sampling(max_depth):
    """Trees of one node (plain decoding through the acceptance, as `ar` runs it: T = 1): the
    emitted token is the inverse-CDF draw of the root's target with the bonus uniform."""
    gen = torch.Generator().manual_seed(21)
    R, V, K = 64, 5, 1
    probs = torch.softmax(torch.randn(R, 1, V, generator=gen, dtype=torch.float64), -1).float()
    dense = DenseForest.from_parents(torch.full((R, 1), -1), torch.ones(R, 1, dtype=torch.bool),
                                     max_depth)
    uniforms = draw_uniforms(R, max_depth, K, gen)
    acc = accept_sampled(probs, torch.randint(0, V, (R, 1), generator=gen), dense, uniforms)
    for r in range(R):
        check_layout(acc, dense, r, [0], [reference_sample(probs[r, 0].double(),
                                                           uniforms[r, 0, K].double())])


def test_uniforms_of_the_wrong_shape_are_refused():
    dense = DenseForest.from_parents(torch.tensor([[-1, 0, 0]] * 2),
                                     torch.ones(2, 3, dtype=torch.bool), 1)
    probs, tokens = torch.full((2, 3, 4), 0.25), torch.zeros(2, 3, dtype=torch.int64)
    for shape in ((3, 2, 3), (2, 3, 3), (2, 2)):
        with pytest.raises(ValueError, match=r"uniforms \(.*\) must be \[2, 2, max_children"):
            accept_sampled(probs, tokens, dense, torch.zeros(shape))
    with pytest.raises(ValueError, match=r"uniforms \(2, 2, 3\) are drawn for 2 children per "
                                         "node, not max_children=1"):
        accept_sampled(probs, tokens, dense, torch.zeros(2, 2, 3), max_children=1)
    acc = accept_sampled(probs, tokens, dense, torch.zeros(2, 2, 3), max_children=2)
    assert acc.accepted.tolist() == [1, 1]   # u = 0 < 1/4: the first child, token 0, accepted
    with pytest.raises(ValueError, match=r"tokens \(2, 2\) do not match a forest of 2 x 3 slots"):
        accept_greedy(torch.zeros(2, 3), tokens[:, :2], dense)


def test_sample_tokens_is_argmax_or_the_inverse_cdf_draw_row_by_row():
    gen = torch.Generator().manual_seed(23)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=4),
              SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0)]
    logits = torch.randn(4, 9, generator=gen)
    logits[0, 2] = logits[0, 6] = logits[0].max() + 1                    # a tie: the first
    u = torch.rand(4, generator=gen)
    from bole.speculative.accept_device import sample_tokens
    got = sample_tokens(logits, SamplingBatch.from_params(params), u).tolist()
    want = [2 if p.greedy and r == 0 else int(logits[r].argmax()) if p.greedy else
            reference_sample(target_probs(logits[r], p).double(), u[r].double())
            for r, p in enumerate(params)]
    assert got == want
    only_sampled = SamplingBatch.from_params(params[1:3])
    assert sample_tokens(logits[1:3], only_sampled, u[1:3]).tolist() == want[1:3]
    assert sample_tokens(logits[[0, 3]], SamplingBatch.from_params([params[0]] * 2),
                         u[:2]).tolist() == [want[0], want[3]]


def test_fused_greedy_kernel_reads_only_its_rows_slots():
    """The engine's buffers are slices of larger ones: what lies past a row's T slots (here a
    node that would match the root's argmax) is never walked into, for T below and at a power
    of two (the kernel's lanes past T are masked)."""
    from bole.ops.accept.kernel import greedy_accept_fused
    for T in (5, 8):
        R = 3
        parents = torch.tensor([[-1] + [0] * (T - 1)] * (R + 1))
        valid = torch.ones(R + 1, T, dtype=torch.bool)
        argmax = torch.full((R + 1, T), 3)
        tokens = torch.full((R + 1, T), 1)               # no child matches inside the rows
        parents[R, 0], tokens[R, 0] = 0, 3               # past the last row: a matching "child"
        got = greedy_accept_fused(argmax[:R], tokens[:R], parents[:R], valid[:R], 1, None,
                                  EMITTED_PAD)
        want = accept_greedy(argmax[:R], tokens[:R], DenseForest.from_parents(
            parents[:R], valid[:R], 1))
        assert got[0].tolist() == want.accepted.tolist() == [0] * R
        assert got[4].tolist() == want.emitted.tolist() == [[3, EMITTED_PAD]] * R


def test_sampling_batch_fields_against_their_definition():
    """inv_temperature is the double 1 / temperature rounded once to float32 (1 for greedy
    rows: what CUDA multiplies by); the flags describe the sampled rows (any_penalty every
    row); a batch whose only top-k is 1 samples the argmax alone."""
    temps = [0.0, 0.7, 1.0, 1.3, 3.0]
    b = SamplingBatch.from_params([SamplingParams(temperature=t) for t in temps])
    want = torch.tensor([1.0 / t if t > 0 else 1.0 for t in temps], dtype=torch.float64)
    assert b.inv_temperature.dtype == torch.float32
    assert torch.equal(b.inv_temperature, want.float())
    assert (b.all_greedy, b.any_greedy, b.any_top_k, b.any_top_p, b.max_top_k, b.any_penalty) \
        == (False, True, False, False, 0, False)
    sampled = SamplingBatch.from_params([SamplingParams(temperature=1.0, top_k=1),
                                         SamplingParams(temperature=0.5, presence_penalty=0.5)])
    assert (sampled.any_greedy, sampled.any_top_k, sampled.max_top_k, sampled.any_penalty) == \
        (False, True, 1, True)
    assert SamplingBatch.from_params([SamplingParams(temperature=0,
                                                     repetition_penalty=1.2)]).any_penalty
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(4))
    probs = target_probs_rows(logits, sampled)
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(-1), 11).float())
    with pytest.raises(ValueError, match="^a SamplingBatch needs at least one request$"):
        SamplingBatch.from_params([])


@pytest.mark.parametrize("device", DEVICES)
def test_accept_is_the_greedy_or_the_sampled_rule_row_by_row(device):
    """accept() on an all-greedy batch (on CUDA the fused kernel) and on a mixed one equals
    accept_greedy on the argmax and accept_sampled on target_probs_rows, request by request;
    forced targets (token 0 included) replace the argmax of greedy rows."""
    logits, tokens, dense, batch, uniforms = mixed_round(device, R=8, seed=3)
    greedy = accept_greedy(logits.argmax(-1), tokens, dense)
    sampled = accept_sampled(target_probs_rows(logits, batch), tokens, dense, uniforms)
    all_greedy = SamplingBatch.from_params([SamplingParams(temperature=0)] * 8, device)
    for got, rows in ((accept(logits, tokens, dense, all_greedy), torch.ones(8, dtype=torch.bool)),
                      (accept(logits, tokens, dense, batch, uniforms), batch.greedy)):
        for field in ("accepted", "path", "path_len", "bonus", "emitted", "num_emitted"):
            a, g, s = getattr(got, field), getattr(greedy, field), getattr(sampled, field)
            want = torch.where(rows.view(-1, *[1] * (a.dim() - 1)), g, s)
            assert a.dtype == torch.int64 and torch.equal(a, want), field
    forced = torch.full(tokens.shape, -1, device=device)
    forced[:, 0] = 0                                   # the root's target is token 0
    tokens[:, 1] = 0
    acc = accept(logits, tokens, dense, all_greedy, forced=forced)
    want = accept_greedy(torch.where(forced >= 0, forced, logits.argmax(-1)), tokens, dense)
    assert torch.equal(acc.emitted, want.emitted)
    first_child = (dense.parents[:, 1] == 0) & dense.valid[:, 1]
    assert (acc.emitted[first_child, 0] == 0).all() and first_child.any()


def test_accept_refuses_mismatched_inputs():
    logits, tokens, dense, batch, uniforms = mixed_round("cpu", R=2, seed=1)
    with pytest.raises(ValueError, match="3 sampling parameters for 2 requests"):
        accept(logits, tokens, dense,
               SamplingBatch.from_params([SamplingParams(temperature=0)] * 3))
    with pytest.raises(ValueError, match=r"forced must be \[R, T\] = \[2, 10\], got \(10,\)"):
        accept(logits, tokens, dense, batch, uniforms, forced=torch.zeros(10))
    with pytest.raises(ValueError,
                       match=r"^sampled requests need pre-drawn uniforms \(draw_uniforms\)$"):
        accept(logits, tokens, dense, batch)
    with pytest.raises(ValueError, match="not max_children=2"):
        accept(logits, tokens, dense, batch, uniforms, max_children=2)

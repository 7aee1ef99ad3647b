"""The replay drafter: its on-path proposals follow its acceptance profile, its trees are
well formed and the same whatever the batch, it never synchronises the host, greedy output with it
equals plain decoding's in every mode, and profiles are validated with clear errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from scipy.stats import chisquare

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.runner import ModelRunner
from bole.forest import DenseForest
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel
from bole.speculative.accept_device import accept_greedy
from bole.speculative.drafters.mtp import MTPDrafter
from bole.speculative.drafters.replay import (SHIPPED_PROFILES, AcceptanceProfile, ReplayDrafter,
                                     chain_accept_length)
from bole.speculative.tree_growth import TreeGrowth, node_capacity
from tests.no_sync import forbid_host_sync

PROFILE = AcceptanceProfile("test", "unit test", (0.45, 0.2, 0.1, 0.05, 0.05))


@pytest.fixture(scope="module")
def model():
    return HybridModel.random(preset_config("tiny"), dtype=torch.float32, mtp=True, seed=1,
                              gdn_backend="torch")


def _replay(model, max_slots=8, max_len=96, topk=4, depth=5, profile=PROFILE, seed=0):
    mtp = MTPDrafter(model, max_slots, max_len, node_capacity(topk, depth))
    return ReplayDrafter(mtp, profile, max_slots, max_len, seed=seed)


def _recording(step):
    """Wrap a step function; record ``(frontier, tokens, parents, depth, proposals)`` per call
    (the table as it was before the step)."""
    calls = []

    def wrapped(i, frontier, table):
        tokens, probs = step(i, frontier, table)
        calls.append((frontier.clone(), table.tokens.clone(), table.parents.clone(),
                      table.depth.clone(), tokens.clone(), probs.clone()))
        return tokens, probs
    return wrapped, calls


def _path(tokens, parents, node):
    """Tokens from the root to ``node`` (host lists of one row)."""
    out = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


def _frontier_nodes(calls, ctx, continuation):
    """Every live frontier node of the recorded calls: ``(on path, the continuation's next token
    or -1, its proposals)`` by host code, walking each node's whole path, from the continuation
    of each row (a dict position -> token)."""
    out = []
    for frontier, tokens, parents, _, proposals, _ in calls:
        frontier, tokens, parents = frontier.tolist(), tokens.tolist(), parents.tolist()
        proposals = proposals.tolist()
        for r, row in enumerate(frontier):
            for k, node in enumerate(row):
                if node < 0:
                    continue
                path = _path(tokens[r], parents[r], node)
                c = int(ctx[r])
                on = all(continuation[r].get(c + d) == t for d, t in enumerate(path) if d > 0)
                out.append((on, continuation[r].get(c + len(path), -1), proposals[r][k]))
    return out


def _random_continuations(n_rows, start, length, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n_rows)]


def _grow_rounds(replay, conts, start, rounds, topk, depth, budget):
    """Trees at ctx = start, start + 1, .. for every row (slot r holds row r's continuation);
    returns the recorded calls and ctx of each round."""
    R = len(conts)
    slots = torch.arange(R, dtype=torch.int32)
    out = []
    for j in range(rounds):
        ctx = torch.full((R,), start + j, dtype=torch.int64)
        roots = torch.tensor([c[j] for c in conts])            # the token at position ctx
        step, calls = _recording(replay.step_fn(slots, ctx, topk))
        forest = TreeGrowth(R, topk, depth, budget).grow(roots, torch.full((R,), depth), step)
        out.append((ctx, calls, forest))
    return out


# ---------------------------------------------------------------- (1) the profile's acceptance

@pytest.mark.parametrize("topk", [4, 2])
def test_on_path_rank_acceptance_matches_the_profile(model, topk):
    """Over many rounds the rank holding the true token at on-path nodes is distributed as
    p_1 .. p_topk (the rest of the mass: no rank), by a chi-square test."""
    R, start, rounds, depth = 8, 3, 40, 4
    replay = _replay(model, max_slots=R, topk=topk, depth=depth)
    vocab = model.config.vocab_size
    conts = _random_continuations(R, start, rounds + depth + 2, vocab, seed=11)
    for r, c in enumerate(conts):
        replay.set_continuation(r, c, start)
    seen = [0] * (topk + 1)                                   # rank 1 .. topk, none
    for ctx, calls, _ in _grow_rounds(replay, conts, start, rounds, topk, depth, 3 * topk):
        full = [{start + i: t for i, t in enumerate(c)} for c in conts]
        for on, true, props in _frontier_nodes(calls, ctx, full):
            if on and true >= 0:
                seen[props.index(true) if true in props else topk] += 1
    n = sum(seen)
    p = list(PROFILE.rank_acceptance[:topk])
    expected = [n * x for x in p] + [n * (1 - sum(p))]
    assert n > 500
    assert chisquare(seen, expected).pvalue > 1e-3, (seen, expected)


def test_draft_probs_are_the_profile_by_rank(model):
    """rho of a depth-d node is the product of its ranks' q (here q == p: non-increasing)."""
    replay = _replay(model, topk=3, depth=3)
    replay.set_continuation(0, list(range(10, 30)), 5)
    step = replay.step_fn(torch.tensor([0], dtype=torch.int32), torch.tensor([5]), 3)
    forest = TreeGrowth(1, 3, 3, 40).grow(torch.tensor([10]), torch.tensor([3]), step)
    q = torch.tensor(PROFILE.rank_acceptance[:3], dtype=torch.float32).double()
    table = forest.table
    for slot in range(1, 4):                                  # the root's children, by rank
        assert float(table.rho[0, slot]) == float(q[slot - 1])
    assert PROFILE.draft_probs(7) == (0.45, 0.2, 0.1, 0.05, 0.05, 0.0, 0.0)
    bumpy = AcceptanceProfile("b", "s", (0.3, 0.1, 0.2))
    assert bumpy.draft_probs(4) == (0.3, 0.1, 0.1, 0.0)


# ---------------------------------------------------------------- (5) well-formed proposals

@pytest.mark.parametrize("topk", [4, 8])
def test_siblings_distinct_and_no_wrong_token_is_the_true_one(model, topk):
    """Every node's proposals are distinct; at an on-path node the true token appears at most
    once (never as a wrong token), at an off-path node never; the tree growth accepts the trees.
    Continuations near the vocabulary's end exercise the wrap-around of wrong tokens."""
    R, start, rounds, depth = 4, 2, 12, 3
    vocab = model.config.vocab_size
    profile = AcceptanceProfile("wide", "unit test", (0.3,) * 3)
    replay = _replay(model, max_slots=R, topk=topk, depth=depth, profile=profile)
    gen = torch.Generator().manual_seed(5)
    conts = [(vocab - 1 - torch.randint(0, 3, (rounds + depth + 2,), generator=gen)).tolist()
             for _ in range(R)]
    for r, c in enumerate(conts):
        replay.set_continuation(r, c, start)
    full = [{start + i: t for i, t in enumerate(c)} for c in conts]
    checked = on_path = 0
    for ctx, calls, forest in _grow_rounds(replay, conts, start, rounds, topk, depth, 20):
        for on, true, props in _frontier_nodes(calls, ctx, full):
            assert len(set(props)) == topk and all(0 <= t < vocab for t in props)
            if on and true >= 0:
                assert props.count(true) <= 1
                on_path += 1
            elif true >= 0:
                assert true not in props
            checked += 1
        assert int(forest.valid.sum()) == R * 20
    assert checked > 100 and on_path > 30


# ---------------------------------------------------------------- (4) same trees in any batch

def test_same_seed_same_trees_whatever_the_batch(model):
    """Requests drafted together, alone, in other slots and in another order get the same trees;
    another seed gives other trees."""
    vocab = model.config.vocab_size
    starts, ctxs, roots = [4, 9, 6], [6, 9, 13], [3, 7, 11]
    conts = _random_continuations(3, 0, 30, vocab, seed=2)
    for r in range(3):                                    # a root that is the token at ctx
        conts[r][ctxs[r] - starts[r]] = roots[r]

    def grow(slot_of, order, seed=0):
        replay = _replay(model, max_slots=6, topk=3, depth=4, seed=seed)
        for r in order:
            replay.set_continuation(slot_of[r], conts[r], starts[r])
        slots = torch.tensor([slot_of[r] for r in order], dtype=torch.int32)
        step = replay.step_fn(slots, torch.tensor([ctxs[r] for r in order]), 3)
        out = TreeGrowth(len(order), 3, 4, 14).grow(torch.tensor([roots[r] for r in order]),
                                                    torch.full((len(order),), 4), step)
        return {r: (out.tokens[i], out.parents[i], out.rho[i]) for i, r in enumerate(order)}

    together = grow({0: 0, 1: 1, 2: 2}, [0, 1, 2])
    shuffled = grow({0: 5, 1: 3, 2: 0}, [2, 0, 1])
    for r in range(3):
        alone = grow({r: 4}, [r])
        for a, b, c in zip(together[r], alone[r], shuffled[r]):
            assert torch.equal(a, b) and torch.equal(a, c)
    other = grow({0: 0, 1: 1, 2: 2}, [0, 1, 2], seed=1)
    assert any(not torch.equal(together[r][0], other[r][0]) for r in range(3))


# ---------------------------------------------------------------- (6) no host synchronisation

def test_step_fn_has_no_host_synchronisation(model, monkeypatch):
    replay = _replay(model, max_slots=3, topk=3, depth=4)
    replay.set_continuation(0, list(range(5, 40)), 10)
    replay.set_continuation(1, list(range(50, 90)), 3)
    slots, ctx = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([10, 12, 1])

    with monkeypatch.context() as m:
        forbid_host_sync(m)
        out = TreeGrowth(3, 3, 4, 12).grow(torch.tensor([5, 59, 2]), torch.tensor([4, 4, 2]),
                                           replay.step_fn(slots, ctx, 3))
    assert int(out.valid.sum()) == 36 and int(out.tokens[0, 0]) == 5


# ---------------------------------------------------------------- (2) exact output, every mode

def _speculate(model, prompts, plain, mode, *, depth=4, topk=3, budget=10, max_tokens=24,
               profile=AcceptanceProfile("spec", "unit test", (0.6, 0.2, 0.1))):
    """Greedy generation with the replay drafter, a round at a time as the engine's round
    runs it (growth, verify forward, device acceptance, commit, the head's observe): each
    request's tokens and tokens per round."""
    chain = mode == "chain"
    topk, T = (1, depth + 1) if chain else (topk, budget)
    gdn = "torch" if mode == "bole" else "torch-serial"
    R, max_len = len(prompts), max(map(len, prompts)) + max_tokens + T + 2
    runner = ModelRunner(model, model.new_cache(R, max_len), gdn)
    replay = ReplayDrafter(MTPDrafter(model, R, max_len, node_capacity(topk, depth)), profile,
                           R, max_len, seed=3)
    outs, slots = [], []
    for p, cont in zip(prompts, plain):
        slot = runner.cache.allocate(len(p) + max_tokens + T)
        logits, hidden = runner.prefill(slot, torch.tensor(p))
        replay.observe_prompt(slot, torch.tensor(p), hidden)
        replay.set_continuation(slot, cont, start=len(p))
        outs.append([int(logits.argmax())])
        slots.append(slot)
    slot_t = torch.tensor(slots, dtype=torch.int32)
    per_round = [[] for _ in prompts]
    while any(len(o) < max_tokens for o in outs):
        remaining = torch.tensor([max_tokens - len(o) for o in outs])
        active = remaining > 0
        ctx = runner.cache.lengths[slot_t.long()]
        limit = torch.where(active, (remaining - 1).clamp(0, depth), 0)
        trees = TreeGrowth(R, topk, depth, T).grow(torch.tensor([o[-1] for o in outs]), limit,
                                                   replay.step_fn(slot_t, ctx, topk))
        forest = DenseForest.from_parents(trees.parents, trees.valid, depth)
        batch = runner.make_batch(trees.tokens.reshape(-1), forest, slot_t)
        out = runner.forward(batch)
        acc = accept_greedy(out.logits.view(R, T, -1).argmax(-1), trees.tokens, forest)
        path_len = torch.where(active, acc.path_len, 0)
        runner.commit(batch, out, acc.path, path_len)
        P = acc.path.shape[1]
        hidden = out.hidden[forest.global_index(acc.path).reshape(-1)].view(R, P, -1)
        replay.observe(slot_t, torch.gather(trees.tokens, 1, acc.path), hidden, ctx, path_len)
        runner.cache.advance(slots, path_len.tolist())
        for r, n in enumerate(path_len.tolist()):
            if n:
                outs[r] += acc.emitted[r, :n].tolist()
                per_round[r].append(n)
    return outs, per_round


def test_greedy_output_equals_plain_decoding_in_every_mode(model):
    prompts = [[1, 2, 3, 4, 5, 6], [9, 9, 9], [7, 100, 3, 3, 41, 8, 2, 77, 5]]
    max_tokens = 24
    ar = Engine(model, SpecConfig(mode="ar")).generate(
        prompts, SamplingParams(max_tokens=max_tokens), seed=0)
    plain = [r.token_ids for r in ar]
    rounds = {}
    for mode in ("bole", "tree-serial", "chain"):
        outs, rounds[mode] = _speculate(model, prompts, plain, mode, max_tokens=max_tokens)
        assert outs == plain, mode
    assert rounds["bole"] == rounds["tree-serial"]         # the same trees, the same acceptance
    # the profile's acceptance is replayed: far more than the random head's one token a round
    mean = sum(map(sum, rounds["bole"])) / sum(map(len, rounds["bole"]))
    assert mean > 2.0, rounds["bole"]
    # without a known continuation every proposal is arbitrary: still exact
    blind = [[] for _ in prompts]
    outs, _ = _speculate(model, prompts, blind, "bole", max_tokens=max_tokens)
    assert outs == plain


def test_forced_acceptance_follows_the_continuation(model):
    """forced_acceptance (benchmarks of bf16 random weights): in fp32, where the continuation is
    the target's own greedy output, the same outputs and acceptance as without it; given a
    continuation that is not the target's, the output follows that continuation instead, so
    the acceptance is the replay's whatever the target's argmax."""
    prompts = [[1, 2, 3, 4, 5, 6], [9, 9, 9]]
    params = SamplingParams(max_tokens=20)
    plain = [r.token_ids for r in Engine(model, SpecConfig(mode="ar")).generate(
        prompts, params, seed=0)]
    profile = "qwen3-next-mtp"
    runs = {}
    for forced in (False, True):
        spec = SpecConfig("bole", "replay", 4, 3, 10, profile, forced_acceptance=forced)
        res = Engine(model, spec).generate(prompts, params, seed=0, continuations=plain)
        runs[forced] = ([r.token_ids for r in res], [r.accepted for r in res])
    assert runs[True] == runs[False] and runs[True][0] == plain
    vocab = model.config.vocab_size
    other = [[t if i % 3 else (t + 1) % vocab for i, t in enumerate(c)] for c in plain]
    other = [[c[0]] + o[1:] for c, o in zip(plain, other)]    # the prefill's token is the model's
    spec = SpecConfig("bole", "replay", 4, 3, 10, profile, forced_acceptance=True)
    res = Engine(model, spec).generate(prompts, params, seed=0, continuations=other)
    assert [r.token_ids for r in res] == other
    with pytest.raises(ValueError, match="needs the replay drafter"):
        SpecConfig("bole", "mtp", forced_acceptance=True).validate()


# ---------------------------------------------------------------- (3) profiles

def _write(tmp_path, data, name="p.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("data,match", [
    ({"source": "s", "rank_acceptance": [0.5, -0.1]}, r"p_2\) = -0.1 lies outside \[0, 1\]"),
    ({"source": "s", "rank_acceptance": [1.5]}, r"p_1\) = 1.5 lies outside \[0, 1\]"),
    ({"source": "s", "rank_acceptance": [0.7, 0.2, 0.2]}, r"sums to 1.1 > 1"),
    ({"rank_acceptance": [0.5]}, r"missing 'source'"),
    ({"source": "  ", "rank_acceptance": [0.5]}, r"missing 'source'"),
    ({"source": "s", "rank_acceptance": []}, r"non-empty list"),
    ({"source": "s"}, r"non-empty list"),
    ({"source": "s", "rank_acceptance": [0.5, "x"]}, r"p_2\) must be a finite number"),
    ({"source": "s", "rank_acceptance": [float("nan")]}, r"p_1\) must be a finite number"),
    ([0.5], r"must be a JSON object"),
    ("{not json", r"not valid JSON"),
])
def test_invalid_profiles_are_clear_errors(tmp_path, data, match):
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=match) as err:
        AcceptanceProfile.load(path)
    assert str(path) in str(err.value)


def test_unknown_profile_name_and_direct_construction():
    with pytest.raises(ValueError, match=r"unknown acceptance profile 'qwen9'.*bundled"):
        AcceptanceProfile.load("qwen9")
    with pytest.raises(ValueError, match=r"sums to .* > 1"):
        AcceptanceProfile("x", "s", (0.9, 0.2))
    with pytest.raises(ValueError, match=r"missing 'source'"):
        AcceptanceProfile("x", "", (0.5,))
    ok = AcceptanceProfile("x", "s", (0.5, 0.5 + 1e-12))       # rounding slack on the sum
    assert ok.ranks == 2


def test_user_profile_by_path(tmp_path):
    path = _write(tmp_path, {"source": "my drafter", "rank_acceptance": [0.7, 0.1],
                             "measurement": {"anything": 1}})
    p = AcceptanceProfile.load(str(path))
    assert p.rank_acceptance == (0.7, 0.1) and p.source == "my drafter" and p.name == "p"


@pytest.mark.parametrize("name", SHIPPED_PROFILES)
def test_shipped_profiles_load(name):
    p = AcceptanceProfile.load(name)
    assert p.name == name and p.source and p.notes
    assert all(a >= b for a, b in zip(p.rank_acceptance, p.rank_acceptance[1:]))
    assert p.draft_probs(p.ranks) == p.rank_acceptance


def test_qwen3_next_profile_reproduces_the_published_accept_lengths():
    """p_1 is the least-squares fit of 1 + a + a^2 + a^3 to SGLang's four accept lengths: its
    chain length is their mean."""
    p = AcceptanceProfile.load("qwen3-next-mtp")
    published = [2.59, 3.13, 3.45, 3.52]
    assert math.isclose(chain_accept_length(p.rank_acceptance[0], 3), sum(published) / 4,
                        abs_tol=1e-5)

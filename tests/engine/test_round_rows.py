"""A round's rows after the batch changed inside one bucket (a request finished and a waiting
one took its place; a request joined a bucket with a free row, nobody leaving): each request's
greedy tokens equal plain decoding of its own prompt, a fresh forward per token. A round that
kept the old rows decodes the newcomer from another request's state, or not at all."""

from __future__ import annotations

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.runner import ModelRunner
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel

PROMPTS = [[5, 9, 17, 33, 2] * 3, [7, 7, 8, 9, 1, 2, 3], [100, 4, 31, 8], [3, 1, 4, 1, 5, 9]]
MAX_TOKENS = [12, 3, 9, 4]           # the second and fourth finish first: the others join


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel.random(preset_config("tiny"), dtype=torch.float32, mtp=True, seed=5,
                              gdn_backend="torch")


def plain_greedy(model: HybridModel, prompt: list[int], n: int) -> list[int]:
    """n argmax tokens, each from a forward over the whole sequence on a fresh cache."""
    seq = list(prompt)
    for _ in range(n):
        runner = ModelRunner(model, model.new_cache(1, 64), "torch")
        slot = runner.cache.allocate(len(seq) + 1)
        with torch.no_grad():
            last, _ = runner.prefill(slot, torch.tensor(seq))
        seq.append(int(last.argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("spec", [SpecConfig(mode="ar"),
                                  SpecConfig(mode="bole", drafter="mtp", depth=2, topk=2,
                                             budget=6)], ids=["ar", "bole"])
def test_requests_joining_a_running_bucket_decode_their_own_prompts(model, spec):
    engine = Engine(model, spec, max_slots=2, max_len=64)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    results = engine.generate(PROMPTS, params)
    for prompt, n, r in zip(PROMPTS, MAX_TOKENS, results):
        assert r.token_ids == plain_greedy(model, prompt, n), prompt


@pytest.mark.parametrize("spec", [SpecConfig(mode="ar"),
                                  SpecConfig(mode="bole", drafter="mtp", depth=2, topk=2,
                                             budget=6)], ids=["ar", "bole"])
def test_a_request_joining_a_bucket_with_a_free_row_decodes_its_prompt(model, spec):
    """Three requests run in the bucket of four rows; a fourth joins after two rounds and
    decodes from its first round on."""
    engine = Engine(model, spec, max_slots=4, max_len=64)
    reqs = [engine.new_request(i, p, SamplingParams(temperature=0, max_tokens=8))
            for i, p in enumerate(PROMPTS)]
    for r in reqs[:3]:
        engine.admit(r)
    running = reqs[:3]
    for step in range(40):
        if step == 2:
            engine.admit(reqs[3])
            running = running + [reqs[3]]
        running = [r for r in running if r.result is None]
        if not running:
            break
        before = [len(r.out) for r in running]
        engine.step(running)
        # every running request gets at least one token a round (none stalls on a stale row)
        assert all(len(r.out) > n for r, n in zip(running, before)), step
    for prompt, r in zip(PROMPTS, reqs):
        assert r.result is not None and r.result.token_ids == plain_greedy(model, prompt, 8)


def test_a_host_drafter_drafts_no_deeper_than_the_tokens_left(model, monkeypatch):
    """A request r tokens from its limit drafts min(depth, r - 1) levels: a round emits at most
    r tokens, and a shallower tree near the limit costs rounds (GenerationResult.rounds)."""
    import bole.engine.round as round_module
    asked = []
    real = round_module.build_draft_trees

    def spy(roots, expand, *, depths, **kwargs):
        asked.append(list(depths))
        return real(roots, expand, depths=depths, **kwargs)
    monkeypatch.setattr(round_module, "build_draft_trees", spy)
    D = 3
    engine = Engine(model, SpecConfig(mode="bole", drafter="ngram", depth=D, topk=2, budget=8),
                    max_slots=2, max_len=64)
    reqs = [engine.new_request(i, p, SamplingParams(temperature=0, max_tokens=n))
            for i, (p, n) in enumerate(zip(PROMPTS[:2], (7, 3)))]
    for r in reqs:
        engine.admit(r)
    want = []
    for _ in range(20):
        running = [r for r in reqs if r.result is None]
        if not running:
            break
        want.append([min(D, r.params.max_tokens - len(r.out) - 1) for r in running])
        engine.step(running)
    assert asked == want and any(0 < d < D for row in want for d in row)


def test_a_queued_draft_is_dropped_when_a_request_leaves_the_middle_of_its_bucket(model):
    """Four requests fill the bucket of four rows and each round queues the next round's draft;
    the second is cancelled: the other three move up a row, still in the same bucket, so the
    queued trees (grown from the old rows' roots and slots) belong to other requests. The round
    must rewrite the rows and draft again: every request still decodes its own prompt (a round
    that verified the stale trees feeds another request's root into each moved row)."""
    spec = SpecConfig(mode="bole", drafter="mtp", depth=2, topk=2, budget=6)
    engine = Engine(model, spec, max_slots=4, max_len=64)
    n = 14
    reqs = [engine.new_request(i, p, SamplingParams(temperature=0, max_tokens=n))
            for i, p in enumerate(PROMPTS)]
    for r in reqs:
        engine.admit(r)
    running = list(reqs)
    for step in range(40):
        if step == 2:
            assert engine.rounds._pending is not None       # a draft is queued for 4 rows
            engine.release(reqs[1])
            running = [r for r in running if r is not reqs[1]]
        running = [r for r in running if r.result is None]
        if not running:
            break
        engine.step(running, prelaunch=True)
    for i in (0, 2, 3):
        assert reqs[i].result.token_ids == plain_greedy(model, PROMPTS[i], n), i


def test_the_mtp_drafter_drafts_no_deeper_than_the_tokens_left(model):
    """The device drafter's trees obey the same limit as the host drafters': a request r tokens
    from its limit grows min(depth, r - 1) levels (a chain: that many draft nodes after the
    root), and one token from it drafts nothing. Deeper trees near the limit would verify and
    emit tokens past max_tokens."""
    D = 3
    engine = Engine(model, SpecConfig(mode="chain", drafter="mtp", depth=D), max_slots=2,
                    max_len=64)
    seen = []
    real = engine.rounds._draft

    def spy(b, depth):
        active = b.active.clone()
        remaining = b.remaining.clone()
        real(b, depth)
        drafted = (b.tree_valid.sum(1) - 1)[active].tolist()
        seen.extend(zip(remaining[active].tolist(), drafted))
    engine.rounds._draft = spy
    engine.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=n) for n in (9, 5)])
    assert seen and all(d == min(D, r - 1) for r, d in seen), seen
    assert {1, 2, D + 1} <= {r for r, _ in seen}        # at the limit, near it and far from it


@pytest.mark.parametrize("mode", ["bole", "ar"])
def test_padding_rows_commit_nothing(model, mode):
    """Three requests in the bucket of four: the padding row runs on the dummy slot every round
    and commits no token there (its length stays the one token it holds from the start, so it
    never fills up however long the engine serves), and the requests decode their own
    prompts."""
    spec = SpecConfig(mode, "mtp", 3, 2, 6) if mode != "ar" else SpecConfig(mode="ar")
    engine = Engine(model, spec, max_slots=3, max_len=96, cuda_graphs=False)
    prompts = [[5, 6, 7], [9, 8], [1, 2, 3, 4]]
    res = engine.generate(prompts, SamplingParams(max_tokens=30))
    assert [r.token_ids for r in res] == [plain_greedy(model, p, 30) for p in prompts]
    dummy = engine.cache.dummy_slot
    assert engine.cache.host_lengths[dummy] == 1 and int(engine.cache.lengths[dummy]) == 1

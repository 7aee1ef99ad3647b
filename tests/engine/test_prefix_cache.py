"""The prefix cache in the engine: output identical with the cache on and off in every mode
(greedy and seeded sampling), and the hits a user expects (fp32, CPU, tiny presets with an MTP
head drafting; 8-token blocks). Prompts longer than the batched admission's 64 tokens leave a
checkpoint at every block boundary; shorter ones at their last token but one (on the CPU; on a
GPU they skip the cache by default)."""

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.prefix_admission import PrefixCacheConfig
from bole.engine.scheduler import Scheduler
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel

MODES = ("ar", "chain", "tree-serial", "bole")
BLOCK = 8
SYSTEM = list(range(11, 81))                       # 70 tokens: eight whole blocks and a part


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def model(request):
    m = HybridModel.random(preset_config(request.param), dtype=torch.float32, seed=3, mtp=True)
    m.w["lm_head.weight"] = m.w["lm_head.weight"] * 50       # clear greedy margins
    return m


def spec(mode: str) -> SpecConfig:
    return SpecConfig(mode="ar") if mode == "ar" else \
        SpecConfig(mode, "mtp", depth=3, topk=2, budget=6)


def engine(model, mode, cache=True, capacity_gib=None, slots=4, min_tokens=None):
    """``min_tokens``: the cache's ``min_prompt_tokens`` (None: its default, 2 on the CPU)."""
    config = PrefixCacheConfig(capacity_gib, BLOCK) if min_tokens is None else \
        PrefixCacheConfig(capacity_gib, BLOCK, min_prompt_tokens=min_tokens)
    return Engine(model, spec(mode), max_slots=slots, max_len=128,
                  prefix_cache=config if cache else None)


def conversation():
    """A, B, A: two prompts sharing a system prompt, then A again."""
    a = SYSTEM + [40, 41, 42, 43, 44, 45]
    b = SYSTEM + [50, 51, 52]
    return [a, b, a]


def run_one_by_one(e, prompts, params):
    """Each prompt after the one before has finished; then a second turn of the first: its
    prompt, its answer and a new message."""
    results = [e.generate([p], params, seed=7)[0] for p in prompts]
    turn = prompts[0] + results[0].token_ids + [60, 61, 62]
    return results + [e.generate([turn], params, seed=7)[0]]


@pytest.mark.parametrize("mode", MODES)
def test_output_is_identical_with_the_cache_on_and_off(model, mode):
    """Greedy and seeded sampling, requests one after another (A, B, A, a longer A): the same
    tokens with the cache as without; hits where the user expects them."""
    for params in (SamplingParams(max_tokens=12),
                   SamplingParams(temperature=0.8, top_k=5, max_tokens=12)):
        off = run_one_by_one(engine(model, mode, cache=False), conversation(), params)
        on_engine = engine(model, mode)
        on = run_one_by_one(on_engine, conversation(), params)
        assert [r.token_ids for r in on] == [r.token_ids for r in off], (mode, params)
        cached = [r.cached_tokens for r in on]
        assert cached[0] == 0                                   # nothing before it
        assert cached[1] == 64                                  # the shared blocks of SYSTEM
        assert cached[2] == len(conversation()[2]) - 1          # the first repeat hits
        # the second turn: the first turn's prompt and answer up to its last committed token
        assert cached[3] == len(conversation()[0]) + len(on[0].token_ids) - 1
        assert all(r.cached_tokens == 0 for r in off)


def _admit(e, prompt):
    """Admit one request (its first token emitted) and return it, slot held."""
    r = e.new_request(0, prompt, SamplingParams(max_tokens=4, seed=0))
    e.admit_many([r])
    return r


SLOT_CASES = {   # (prompt admitted first, prompt compared, its cached tokens)
    "long-prefix-hit": (SYSTEM + [40, 41, 42, 43, 44, 45], SYSTEM + [50, 51, 52], 64),
    "short-new": ([9, 9, 9], [3, 1, 4, 1, 5, 9, 2, 6], 0),
    "short-repeat": ([3, 1, 4, 1, 5, 9, 2, 6], [3, 1, 4, 1, 5, 9, 2, 6], 7),
}


@pytest.mark.parametrize("case", SLOT_CASES)
@pytest.mark.parametrize("mode", ["bole", "ar"])
def test_a_restored_slot_holds_what_a_full_prefill_leaves(model, mode, case):
    """After admission through the cache (a restored prefix and the suffix's prefill, or a
    short prompt's batched head and last-token forward) the slot's KV rows, GDN and conv
    states, length, the MTP head's rows and last hidden state, and the first token equal a
    cache-off admission (to rounding: the cache moves where prefill chunks end)."""
    first, prompt, cached = SLOT_CASES[case]
    on, off = engine(model, mode), engine(model, mode, cache=False)
    on.release(_admit(on, first))                              # fills the cache
    got, want = _admit(on, prompt), _admit(off, prompt)
    assert got.cached_tokens == cached and got.out == want.out
    a, b, n = on.cache, off.cache, len(prompt)
    s, t = got.slot, want.slot
    assert a.host_lengths[s] == b.host_lengths[t] == n
    close = dict(atol=1e-5, rtol=1e-4)
    assert torch.allclose(a.k[:, s, :n], b.k[:, t, :n], **close)
    assert torch.allclose(a.v[:, s, :n], b.v[:, t, :n], **close)
    assert torch.allclose(a.gdn_state[:, s], b.gdn_state[:, t], **close)
    assert torch.allclose(a.conv_state[:, s], b.conv_state[:, t], **close)
    if mode != "ar":         # the head's row q - 1 holds token q's entry: rows 0 .. n - 2
        m1, m2 = on.rounds.device_drafter, off.rounds.device_drafter
        assert torch.allclose(m1.k[s, :n - 1], m2.k[t, :n - 1], **close)
        assert torch.allclose(m1.v[s, :n - 1], m2.v[t, :n - 1], **close)
        assert torch.allclose(m1.last_hidden[s], m2.last_hidden[t], **close)


def test_speculation_does_not_change_the_hit_rate(model):
    """The same prompts through ar and bole hit the same prompt tokens: only committed tokens
    are cached, so speculation changes nothing."""
    hits = {}
    for mode in ("ar", "bole"):
        e = engine(model, mode)
        run_one_by_one(e, conversation(), SamplingParams(max_tokens=10))
        hits[mode] = e.prefix.stats()
    assert hits["ar"]["hit_tokens"] == hits["bole"]["hit_tokens"] > 0
    assert hits["ar"]["query_tokens"] == hits["bole"]["query_tokens"]


def test_a_prompt_shorter_than_a_block_hits_when_repeated(model):
    e = engine(model, "bole")
    short = [3, 1, 4, 1, 5]
    first, again, _ = run_one_by_one(e, [short, short], SamplingParams(max_tokens=8))
    assert again.cached_tokens == 4 and first.token_ids == again.token_ids


def test_prompts_under_min_prompt_tokens_skip_the_cache_and_their_next_turn_hits(model,
                                                                                  monkeypatch):
    """With ``min_prompt_tokens=65`` (a GPU's default) the prompts the batched admission takes
    are admitted as without the cache: together, in one batched prefill, no lookup; a finished
    one is still recorded, so the next turn of its chat (longer) restores the first turn's
    prompt and answer."""
    default = engine(model, "bole").prefix.min_prompt_tokens
    assert default == (65 if model.device.type == "cuda" else 2)
    e, off = engine(model, "bole", min_tokens=65), engine(model, "bole", cache=False)
    batched = []
    prefill = e.rounds.prefill
    monkeypatch.setattr(e.rounds, "prefill",
                        lambda slots, *a, **k: batched.append(len(slots)) or prefill(slots, *a, **k))
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8], [3, 1, 4, 1, 5]]
    params = SamplingParams(max_tokens=8)
    on = e.generate(prompts, params, seed=7)
    assert batched == [3]
    assert [r.token_ids for r in on] == [r.token_ids for r in off.generate(prompts, params, seed=7)]
    assert [r.cached_tokens for r in on] == [0, 0, 0] and e.prefix.stats()["query_tokens"] == 0
    turn = prompts[0] + on[0].token_ids + list(range(20, 80))         # 73 + 8 tokens
    got = e.generate([turn], params, seed=7)[0]
    assert got.cached_tokens == len(prompts[0]) + len(on[0].token_ids) - 1
    assert got.token_ids == off.generate([turn], params, seed=7)[0].token_ids


def test_a_prefix_ending_mid_block_hits_its_last_full_block(model):
    e = engine(model, "bole")
    a = list(range(30, 110))                                  # 80 tokens
    b = a[:69] + [9, 8, 7]                                    # diverges inside the ninth block
    off = run_one_by_one(engine(model, "bole", cache=False), [a, b], SamplingParams(max_tokens=8))
    on = run_one_by_one(e, [a, b], SamplingParams(max_tokens=8))
    assert on[1].cached_tokens == 64
    assert [r.token_ids for r in on] == [r.token_ids for r in off]


def test_concurrent_requests_sharing_a_prefix_and_eviction_under_a_tiny_cap(model):
    """Many requests sharing the system prompt admitted together (some in the same step), on a
    cache too small to hold them all (entries evicted while requests that restored them run):
    outputs equal the cache-off run."""
    prompts = [SYSTEM + [40 + i, 41 + i, 42 + i] for i in range(6)] + conversation()
    params = SamplingParams(max_tokens=10)
    off = engine(model, "bole", cache=False).generate(prompts, params, seed=1)
    for capacity in (None, 2e-5):                             # about 20 KiB: a few entries
        e = engine(model, "bole", capacity_gib=capacity, slots=3)
        on = e.generate(prompts, params, seed=1)
        assert [r.token_ids for r in on] == [r.token_ids for r in off], capacity
        stats = e.prefix.stats()
        assert stats["bytes"] <= stats["capacity_bytes"]
        assert sum(r.cached_tokens for r in on) > 0
        if capacity is None:          # the first three are admitted in one step, one by one
            assert [r.cached_tokens for r in on[:3]] == [0, 64, 64]


@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_hits_with_short_rests_are_admitted_together(model, mode, monkeypatch):
    """Requests admitted in one step that hit the cache (SYSTEM's 70 tokens, a tail) with 1 to
    30 tokens left prefill their rests (all but the last token: 0, 4, 11, 29) in one forward
    per padded width (16: two rows, 32: one) and their last tokens in one more: outputs equal
    the cache-off run's and each restored slot holds what a full prefill leaves."""
    e, off = engine(model, mode, slots=4), engine(model, mode, cache=False, slots=4)
    params = SamplingParams(max_tokens=8)
    e.generate([SYSTEM + [9]], params)                      # the blocks of SYSTEM
    rows = []
    prefill_rows = e.runner.prefill_rows
    monkeypatch.setattr(e.runner, "prefill_rows",
                        lambda slots, *a: rows.append(len(slots)) or prefill_rows(slots, *a))
    prompts = [SYSTEM + list(range(20, 20 + n)) for n in (1, 5, 12, 30)]
    got = e.generate(prompts, params, seed=3)
    assert rows == [2, 1] and [r.cached_tokens for r in got] == [len(SYSTEM)] * 4
    assert [r.token_ids for r in got] == [r.token_ids for r in off.generate(prompts, params,
                                                                              seed=3)]
    others = [SYSTEM + list(range(40, 40 + n)) for n in (3, 9, 20, 2)]     # new rests
    held = [e.new_request(i, p, params) for i, p in enumerate(others)]
    want = [off.new_request(i, p, params) for i, p in enumerate(others)]
    e.admit_many(held)
    off.admit_many(want)
    assert rows == [2, 1, 3, 1] and all(r.cached_tokens == len(SYSTEM) for r in held)
    close = dict(atol=1e-5, rtol=1e-4)
    for a, b, p in zip(held, want, others):
        s, t, n = a.slot, b.slot, len(p)
        assert a.out == b.out and e.cache.host_lengths[s] == off.cache.host_lengths[t] == n
        assert torch.allclose(e.cache.k[:, s, :n], off.cache.k[:, t, :n], **close)
        assert torch.allclose(e.cache.gdn_state[:, s], off.cache.gdn_state[:, t], **close)
        assert torch.allclose(e.cache.conv_state[:, s], off.cache.conv_state[:, t], **close)
        if mode != "ar":
            m1, m2 = e.rounds.device_drafter, off.rounds.device_drafter
            assert torch.allclose(m1.k[s, :n - 1], m2.k[t, :n - 1], **close)
            assert torch.allclose(m1.last_hidden[s], m2.last_hidden[t], **close)


def test_a_request_cancelled_mid_prefill_frees_its_slot_and_leaves_the_cache_usable(model):
    e = engine(model, "bole", slots=1)
    scheduler = Scheduler(e)
    long = SYSTEM + list(range(60, 90))
    handle = scheduler.submit(long, SamplingParams(max_tokens=20))
    e.on_prefill_chunk = lambda done, total: scheduler.cancel(handle)
    scheduler.step()
    e.on_prefill_chunk = None
    scheduler.run_until_idle()
    assert handle.done.is_set() and e.cache.num_free == 1
    # cancelled during its prefill: no result (an abort) and at most its first token, not 20
    assert handle.result is None and len(handle.request.out) <= 1
    off = engine(model, "bole", cache=False).generate([long], SamplingParams(max_tokens=10))
    on = e.generate([long], SamplingParams(max_tokens=10))
    assert on[0].token_ids == off[0].token_ids


def test_bad_prefix_cache_settings_are_named():
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        PrefixCacheConfig(capacity_gib=-1)
    with pytest.raises(ValueError, match="block must be >= 1"):
        PrefixCacheConfig(block=0)
    with pytest.raises(ValueError, match="min_prompt_tokens must be >= 2"):
        PrefixCacheConfig(min_prompt_tokens=1)


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_host_drafters_and_the_draft_model_see_the_same_output(model, drafter):
    """The n-gram drafter (the whole prompt, host side) and a draft model (its own cache,
    prefilled whole): output identical with the cache on and off, hits as with the MTP head."""
    params = SamplingParams(max_tokens=12)
    runs = {}
    for cache in (False, True):
        e = Engine(model, SpecConfig("bole", drafter, depth=3, topk=2, budget=6), max_slots=2,
                   max_len=160, draft_model=model if drafter == "draft" else None,
                   prefix_cache=PrefixCacheConfig(None, BLOCK) if cache else None)
        runs[cache] = run_one_by_one(e, conversation(), params)
    assert [r.token_ids for r in runs[True]] == [r.token_ids for r in runs[False]]
    assert [r.cached_tokens for r in runs[True]][1:3] == [64, len(conversation()[2]) - 1]


def test_running_out_of_device_memory_shrinks_the_cache_not_the_request(model, monkeypatch):
    e = engine(model, "bole")
    store = e.prefix.store
    run_one_by_one(e, conversation()[:1], SamplingParams(max_tokens=6))
    held = store.bytes
    assert held > 0

    def oom(slot):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(store, "states", oom)                    # a finished request's
    monkeypatch.setattr(store.pools[0], "state", oom)            # a prefill's checkpoints
    got = e.generate([conversation()[1]], SamplingParams(max_tokens=6), seed=7)[0]
    want = engine(model, "bole", cache=False).generate([conversation()[1]],
                                                       SamplingParams(max_tokens=6), seed=7)[0]
    assert got.token_ids == want.token_ids and got.cached_tokens == 64
    assert store.capacity < held and store.bytes <= store.capacity

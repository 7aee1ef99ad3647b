"""Admission through the prefix cache (bole.engine.prefix_admission) where the engine-level tests
of test_prefix_cache.py do not reach: a hit followed by a long rest (restored, then prefilled
alone with checkpoints), the checkpoints it leaves, its progress reports, the settings' edges
and the wiring. Written for the mutation run (docs/testing.md): the tiny preset, fp32 on the
CPU, admission only (no rounds), a few seconds."""

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.prefix_admission import (GIB, PrefixAdmission, PrefixCacheConfig,
                                          default_capacity_bytes)
from bole.engine.prefix_cache import CachePools, MTPPools
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel

BLOCK = 8
SYSTEM = list(range(11, 81))                       # 70 tokens: eight whole blocks and a part
LONG = SYSTEM + list(range(40, 110))               # 140: a hit of 70, then 69 to prefill alone
CLOSE = dict(atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def model():
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, mtp=True)
    m.w["lm_head.weight"] = m.w["lm_head.weight"] * 50       # clear greedy margins
    return m


def engine(model, mode="bole", cache=True, config=None, slots=4, max_len=256):
    spec = SpecConfig(mode="ar") if mode == "ar" else \
        SpecConfig(mode, "mtp", depth=3, topk=2, budget=6)
    config = config or PrefixCacheConfig(None, BLOCK)
    return Engine(model, spec, max_slots=slots, max_len=max_len,
                  prefix_cache=config if cache else None)


def admit(e, prompt, index=0):
    """Admit one request (its first token emitted) and return it, slot held."""
    r = e.new_request(index, prompt, SamplingParams(max_tokens=4, seed=0))
    e.admit_many([r])
    return r


def assert_same_slot(on, off, got, want, n):
    """The slots hold the same n tokens: target KV rows, GDN and conv states, and (with the MTP
    head) its rows of tokens 1..n-1 and last hidden state; the same first token."""
    s, t = got.slot, want.slot
    assert got.out == want.out
    assert on.cache.host_lengths[s] == off.cache.host_lengths[t] == n
    assert torch.allclose(on.cache.k[:, s, :n], off.cache.k[:, t, :n], **CLOSE)
    assert torch.allclose(on.cache.v[:, s, :n], off.cache.v[:, t, :n], **CLOSE)
    assert torch.allclose(on.cache.gdn_state[:, s], off.cache.gdn_state[:, t], **CLOSE)
    assert torch.allclose(on.cache.conv_state[:, s], off.cache.conv_state[:, t], **CLOSE)
    m1, m2 = on.rounds.device_drafter, off.rounds.device_drafter
    if m1 is not None:
        assert torch.allclose(m1.k[s, :n - 1], m2.k[t, :n - 1], **CLOSE)
        assert torch.allclose(m1.v[s, :n - 1], m2.v[t, :n - 1], **CLOSE)
        assert torch.allclose(m1.last_hidden[s], m2.last_hidden[t], **CLOSE)


@pytest.mark.parametrize("mode", ["bole", "ar"])
def test_a_hit_with_a_long_rest_is_restored_then_prefilled_with_checkpoints(model, mode):
    """SYSTEM cached (blocks to 64, a tail at 70); a prompt of 140 tokens starting with it
    restores 70 tokens and prefills the other 70 alone (more than the batched admission takes),
    reporting its progress, and leaves a checkpoint at every block boundary past 70 and at 139.
    A third prompt then restores one of those (80) and prefills from there. Each slot equals a
    cache-off admission's."""
    on, off = engine(model, mode), engine(model, mode, cache=False)
    on.release(admit(on, SYSTEM + [9]))
    store = on.prefix.store
    assert store.stats()["hit_tokens"] == 0
    calls = []
    on.on_prefill_chunk = lambda done, total: calls.append((done, total))
    got = admit(on, LONG, index=1)
    on.on_prefill_chunk = None
    assert got.cached_tokens == 70
    assert calls[-1] == (70, 70) and calls[0] == (2, 70)          # the block at 72 first
    assert_same_slot(on, off, got, admit(off, LONG), len(LONG))
    assert store.stats()["hit_tokens"] == 70 and store.stats()["query_tokens"] == 70 + 139
    for n, at in ((71, 70), (72, 70), (73, 72), (80, 72), (81, 80), (139, 136), (140, 139)):
        assert store.lookup(LONG[:n], count=False).length == at, n
    third = LONG[:80] + list(range(30, 100))                      # 150: 80 hit, 69 alone
    got3 = admit(on, third, index=2)
    assert got3.cached_tokens == 80
    assert_same_slot(on, off, got3, admit(off, third), len(third))


def test_settings_take_their_edges_and_refuse_past_them_by_name():
    PrefixCacheConfig(capacity_gib=0, block=1, min_prompt_tokens=2)
    for kwargs, message in (
            (dict(capacity_gib=-0.5), "prefix cache capacity must be >= 0 GiB, got -0.5"),
            (dict(block=0), "prefix cache block must be >= 1 token, got 0"),
            (dict(min_prompt_tokens=1), "prefix cache min_prompt_tokens must be >= 2 (a prompt "
                                        "of one token has no prefix to restore), got 1")):
        with pytest.raises(ValueError) as e:
            PrefixCacheConfig(**kwargs)
        assert str(e.value) == message
    assert default_capacity_bytes(torch.device("cpu")) == GIB == 1 << 30


def test_the_engine_builds_the_store_its_settings_name(model):
    """Capacity in GiB, the block, min_prompt_tokens; the defaults on the CPU (1 GiB, the
    prefill's 64-token chunk, 2); the MTP head's pools held beside the target's when it drafts."""
    e = engine(model, config=PrefixCacheConfig(0.25, 16, 5))
    p = e.prefix
    assert p.config == PrefixCacheConfig(0.25, 16, 5)
    assert (p.store.capacity, p.store.block, p.block, p.min_prompt_tokens) == (GIB // 4, 16, 16, 5)
    assert [type(x) for x in p.store.pools] == [CachePools, MTPPools]
    assert p.store.pools[0].cache is e.cache and p.store.pools[1].d is e.rounds.device_drafter
    assert p.mtp is e.rounds.device_drafter is not None
    d = engine(model, "ar", config=PrefixCacheConfig()).prefix
    assert (d.store.capacity, d.block, d.store.block, d.min_prompt_tokens) == (GIB, 64, 64, 2)
    assert [type(x) for x in d.store.pools] == [CachePools] and d.mtp is None
    r = e.new_request(0, [1, 2, 3, 4], SamplingParams(max_tokens=1))
    assert not p.takes(r) and d.takes(r)
    assert p.takes(e.new_request(0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=1)))
    assert not d.takes(e.new_request(0, [1], SamplingParams(max_tokens=1)))
    assert d.takes(e.new_request(0, [1, 2], SamplingParams(max_tokens=1)))


def entry_bytes(e):
    """Bytes of one token's rows and of one checkpoint's state in ``e``'s prefix cache: the
    target's K and V rows and state pools, and the MTP head's K and V rows and hidden state."""
    row = 2 * e.cache.k[:, 0, 0].numel() * e.cache.k.element_size()
    state = sum(p[:, 0].numel() * p.element_size() for p in e.cache.pools.values())
    m = e.rounds.device_drafter
    if m is not None:
        row += 2 * m.k[0, 0].numel() * m.k.element_size()
        state += m.last_hidden[0].numel() * m.last_hidden.element_size()
    return row, state


@pytest.mark.parametrize("mode", ["bole", "ar"])
def test_a_long_prompt_holds_its_blocks_and_checkpoints_written_out(model, mode):
    """SYSTEM + [9] (71 tokens, prefilled alone): eight blocks with a state each and a tail of 6
    tokens at 70; the MTP head's rows and hidden state only when it drafts."""
    e = engine(model, mode)
    e.release(admit(e, SYSTEM + [9]))
    row, state = entry_bytes(e)
    assert (mode == "ar") == (e.rounds.device_drafter is None)
    assert e.prefix.stats() == dict(blocks=8, block_states=8, tails=1, tokens=70,
                                    bytes=70 * row + 9 * state, capacity_bytes=GIB,
                                    query_tokens=70, hit_tokens=0)


def test_the_batched_admission_takes_what_fits_and_the_rest_goes_alone(model, monkeypatch):
    """Fresh prompts of 2 to 64 tokens go together, 65 alone; hits with rests up to 63 tokens
    (all but the last) go together, in one forward per padded width (16, 32, 64), a rest of 64
    alone; every hit leaves a checkpoint at its last token but one."""
    e, off = engine(model, slots=5), engine(model, cache=False, slots=5)
    alone, together, rows = [], [], []
    prefill, batched, prefill_rows = e.runner.prefill, e.rounds.prefill, e.runner.prefill_rows
    monkeypatch.setattr(e.runner, "prefill",
                        lambda slot, p, **k: alone.append(p.numel()) or prefill(slot, p, **k))
    monkeypatch.setattr(e.rounds, "prefill",
                        lambda slots, *a: together.append(len(slots)) or batched(slots, *a))
    monkeypatch.setattr(e.runner, "prefill_rows", lambda slots, tokens, counts: rows.append(
        (tokens.shape[1], counts.tolist())) or prefill_rows(slots, tokens, counts))
    for group in ([[5, 6], list(range(1, 65))], [list(range(2, 67))]):
        held = [e.new_request(i, p, SamplingParams(max_tokens=4)) for i, p in enumerate(group)]
        want = [off.new_request(i, p, SamplingParams(max_tokens=4)) for i, p in enumerate(group)]
        e.admit_many(held)
        off.admit_many(want)
        for got, ref, p in zip(held, want, group):
            assert_same_slot(e, off, got, ref, len(p))
            e.release(got)
            off.release(ref)
    assert together == [2] and alone == [65]
    assert rows == [(64, [1, 63])]            # the batched admission's forward: all but the last
    e.release(admit(e, SYSTEM + [9]))
    assert alone == [65, 71]
    prompts = [SYSTEM + list(range(20, 84)), SYSTEM + list(range(21, 86)),
               SYSTEM + list(range(22, 38)), SYSTEM + list(range(23, 41)), SYSTEM + [9, 5]]
    held = [e.new_request(i, p, SamplingParams(max_tokens=4)) for i, p in enumerate(prompts)]
    e.admit_many(held)
    assert [r.cached_tokens for r in held] == [70] * 5
    assert alone == [65, 71, 65] and together == [2]
    assert sorted(rows[1:]) == [(16, [15, 1]), (32, [17]), (64, [63])]
    want = [off.new_request(i, p, SamplingParams(max_tokens=4)) for i, p in enumerate(prompts)]
    off.admit_many(want)
    for got, ref, p in zip(held, want, prompts):
        assert_same_slot(e, off, got, ref, len(p))
        assert e.prefix.store.lookup(p, count=False).length == len(p) - 1


def test_a_hit_whose_padded_rows_would_pass_the_slot_is_prefilled_alone(model, monkeypatch):
    """A slot of 82 tokens: a hit at 70 with one token to prefill (a row of 16 would reach
    position 85) goes alone and leaves its checkpoint at 71; the exact repeat (nothing to
    prefill) goes with the batched admission."""
    e, off = engine(model, max_len=82), engine(model, cache=False, max_len=82)
    e.release(admit(e, SYSTEM + [9]))
    alone, rows = [], []
    prefill, prefill_rows = e.runner.prefill, e.runner.prefill_rows
    monkeypatch.setattr(e.runner, "prefill",
                        lambda slot, p, **k: alone.append(p.numel()) or prefill(slot, p, **k))
    monkeypatch.setattr(e.runner, "prefill_rows",
                        lambda *a: rows.append(a[1].shape) or prefill_rows(*a))
    prompt = SYSTEM + [9, 5]
    got = admit(e, prompt, index=1)
    assert got.cached_tokens == 70 and alone == [2] and rows == []
    assert_same_slot(e, off, got, admit(off, prompt), len(prompt))
    assert e.prefix.store.lookup(prompt, count=False).length == 71
    e.release(got)
    again = admit(e, prompt, index=2)
    assert again.cached_tokens == 71 and alone == [2] and rows == []
    assert again.out == got.out


def test_a_finished_request_leaves_a_checkpoint_only_past_its_prompt(model):
    """Released right after admission (its prompt committed, the first token pending) a request
    adds nothing; after rounds, a checkpoint at its committed length."""
    e = engine(model)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    r = admit(e, prompt)
    before = e.prefix.stats()
    e.release(r)
    assert e.prefix.stats() == before
    r = admit(e, prompt, index=1)
    for _ in range(3):
        e.step([r])
    committed = e.cache.host_lengths[r.slot]
    tokens = prompt + r.out
    assert committed == len(tokens) - 1 > len(prompt)
    e.release(r)
    assert e.prefix.store.lookup(tokens[:committed] + [7], count=False).length == committed


def test_running_out_of_memory_halves_the_capacity_and_says_so(model, monkeypatch, caplog):
    e = engine(model)
    e.release(admit(e, SYSTEM + [9]))
    store = e.prefix.store
    held = store.bytes

    def oom(slot):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(store, "states", oom)
    with caplog.at_level("WARNING", logger="bole"):
        r = admit(e, [2, 7, 1, 8, 2, 8], index=1)
    assert r.cached_tokens == 0
    assert store.capacity == held // 2 and type(store.capacity) is int
    assert store.bytes <= held // 2
    assert [(x.name, x.levelname, x.getMessage()) for x in caplog.records] == [
        ("bole", "WARNING", f"the prefix cache ran out of device memory: its capacity is now "
                            f"{held // 2 / GIB:.2f} GiB (set --prefix-cache-gib lower to "
                            f"avoid this)")]


def test_the_default_capacity_on_a_gpu_is_a_tenth_of_its_memory_at_most_16_gib(monkeypatch):
    asked = []

    def props(device):
        asked.append(device)
        return type("Props", (), {"total_memory": memory})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    gpu = torch.device("cuda", 1)
    for memory, want in ((80 * GIB, 8 * GIB), (81 * GIB + 7, (81 * GIB + 7) // 10),
                         (160 * GIB, 16 * GIB), (170 * GIB, 16 * GIB)):
        got = default_capacity_bytes(gpu)
        assert got == want and type(got) is int
    assert asked == [gpu] * 4


def test_a_hit_evicted_by_an_earlier_request_of_the_same_admission_is_prefilled_alone(model):
    """Admitted together: SYSTEM + 60 tokens, which looks like a hit at 70 with 59 tokens to
    prefill (batched, after the long prefills), and a new 100-token prompt (prefilled alone
    first). With the capacity set so that the new prompt's entries push out exactly SYSTEM's
    tail at 70, the first request hits the block at 64 instead, with 65 tokens left: prefilled
    alone after all, from 64."""
    e, off = engine(model), engine(model, cache=False)
    e.release(admit(e, SYSTEM + [9]))
    row, state = entry_bytes(e)
    store = e.prefix.store
    assert store.bytes == 70 * row + 9 * state
    store.capacity = (70 + 99 - 6) * row + (9 + 13 - 1) * state
    prompts = [SYSTEM + list(range(20, 80)), list(range(27, 127))]
    held = [e.new_request(i, p, SamplingParams(max_tokens=4)) for i, p in enumerate(prompts)]
    e.admit_many(held)
    assert [r.cached_tokens for r in held] == [64, 0]
    assert store.stats()["hit_tokens"] == 64
    want = [off.new_request(i, p, SamplingParams(max_tokens=4)) for i, p in enumerate(prompts)]
    off.admit_many(want)
    for got, ref, p in zip(held, want, prompts):
        assert_same_slot(e, off, got, ref, len(p))


def test_the_replay_drafter_gets_each_continuation_through_the_cache(model):
    """The replay drafter under forced acceptance emits the continuation it was given (not the
    target's own output), which it knows only from admission: through the cache's every path
    (a long new prompt alone, a hit with one token to prefill, a hit with a long rest alone, a
    short new prompt batched), each request's continuation reaches it."""
    params = SamplingParams(max_tokens=12)
    spec = SpecConfig("bole", "replay", 4, 3, 10, "qwen3-next-mtp", forced_acceptance=True)
    e = Engine(model, spec, max_len=256, prefix_cache=PrefixCacheConfig(None, BLOCK))
    plain = engine(model, "ar", cache=False)
    vocab = model.config.vocab_size
    for prompt, cached in ((SYSTEM + [9], 0), (SYSTEM + [9, 5], 70), (LONG, 70),
                          ([3, 1, 4, 1, 5], 0)):
        own = plain.generate([prompt], params)[0].token_ids
        other = [own[0]] + [t if i % 3 else (t + 1) % vocab for i, t in enumerate(own)][1:]
        got = e.generate([prompt], params, continuations=[other])[0]
        assert (got.token_ids, got.cached_tokens) == (other, cached), len(prompt)


def test_the_defaults_follow_the_device_and_the_prefill_kernel():
    """Without a GPU here, the defaults read from a stand-in engine: the block is the prefill's
    chunk (1,024 tokens with a chunked linear-attention kernel, 64 without); on a GPU the cache
    takes prompts past the batched admission's 64 tokens, on the CPU every prompt of 2 or more."""
    from types import SimpleNamespace

    from bole.cache import CacheShape, HybridCache, StatePool
    cache = HybridCache(CacheShape(1, 1, 4, (StatePool("conv_state", 1, (4, 2)),)), 2, 32,
                        dtype=torch.float32)
    for device, chunked, block, shortest in (("cuda", True, 1024, 65), ("cuda", False, 64, 65),
                                             ("cpu", True, 1024, 2), ("cpu", False, 64, 2)):
        fake = SimpleNamespace(rounds=SimpleNamespace(device_drafter=None), cache=cache,
                               model=SimpleNamespace(device=torch.device(device),
                                                     chunked_prefill=chunked))
        p = PrefixAdmission(fake, PrefixCacheConfig(capacity_gib=1))
        assert (p.block, p.store.block, p.min_prompt_tokens) == (block, block, shortest), device
        p = PrefixAdmission(fake, PrefixCacheConfig(1, 8, 70))
        assert (p.block, p.min_prompt_tokens) == (8, 70)


@pytest.mark.parametrize("mode", ["bole", "ar"])
def test_a_one_token_hit_with_a_long_rest_continues_from_that_token(model, mode):
    """A two-token prompt leaves a checkpoint after its first token; a 71-token prompt starting
    with that token restores it and prefills 70 tokens alone: the slot equals a cache-off one."""
    e, off = engine(model, mode), engine(model, mode, cache=False)
    e.release(admit(e, [11, 12]))
    prompt = [11] + list(range(20, 90))
    got = admit(e, prompt, index=1)
    assert got.cached_tokens == 1
    assert_same_slot(e, off, got, admit(off, prompt), len(prompt))

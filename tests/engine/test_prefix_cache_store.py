"""The prefix cache's store (bole.engine.prefix_cache) on its own: what a lookup finds, what a
restore writes, what eviction drops. Slots hold random rows and states; a restore must give a
fresh slot exactly the source slot's rows below the hit and the state recorded there."""

import pytest
import torch

from bole.cache import CacheShape, HybridCache, StatePool
from bole.engine.prefix_cache import CachePools, PrefixCache

SHAPE = CacheShape(num_full_layers=2, num_kv_heads=2, head_dim=4,
                   pools=(StatePool("gdn_state", 3, (2, 4, 4), torch.float32),
                          StatePool("conv_state", 3, (8, 3))))
B = 8


def fresh(slots=4, max_len=64):
    cache = HybridCache(SHAPE, slots, max_len, dtype=torch.float32)
    return cache, PrefixCache([CachePools(cache)], capacity_bytes=1 << 30, block=B)


def fill(cache, slot, n, seed):
    """Random rows for positions < n and a random state; the slot then holds n tokens."""
    g = torch.Generator().manual_seed(seed)
    cache.k[:, slot, :n] = torch.randn(cache.k[:, slot, :n].shape, generator=g)
    cache.v[:, slot, :n] = torch.randn(cache.v[:, slot, :n].shape, generator=g)
    cache.gdn_state[:, slot] = torch.randn(cache.gdn_state[:, slot].shape, generator=g)
    cache.conv_state[:, slot] = torch.randn(cache.conv_state[:, slot].shape, generator=g)
    cache.host_lengths[slot] = n
    cache.lengths[slot] = n


def test_an_exact_repeat_restores_rows_and_the_state_before_the_last_token():
    cache, store = fresh()
    tokens = list(range(100, 121))                     # 21 tokens: blocks at 8, 16; tail at 20
    src = cache.allocate(64)
    fill(cache, src, 21, seed=1)
    cps = {8: store.states(src), 16: store.states(src), 20: store.states(src)}
    store.insert(tokens, src, cps)
    hit = store.lookup(tokens)
    assert hit is not None and hit.length == 20
    dst = cache.allocate(64)
    store.restore(hit, dst)
    assert cache.host_lengths[dst] == 20 and int(cache.lengths[dst]) == 20
    assert torch.equal(cache.k[:, dst, :20], cache.k[:, src, :20])
    assert torch.equal(cache.v[:, dst, :20], cache.v[:, src, :20])
    assert not cache.k[:, dst, 20:].any()
    assert torch.equal(cache.gdn_state[:, dst], cps[20][0][0])
    assert torch.equal(cache.conv_state[:, dst], cps[20][0][1])
    assert store.query_tokens == 20 and store.hit_tokens == 20
    used = [n.used for n in hit.path]
    assert store.lookup(tokens, count=False) == hit                 # a look changes nothing
    assert store.query_tokens == 20 and store.hit_tokens == 20
    assert [n.used for n in hit.path] == used


def test_a_prompt_shorter_than_a_block_hits_when_repeated():
    cache, store = fresh()
    src = cache.allocate(64)
    fill(cache, src, 4, seed=2)
    store.insert([5, 6, 7, 8, 9], src, {4: store.states(src)})
    assert store.lookup([5, 6, 7, 8, 9]).length == 4
    assert store.lookup([5, 6, 7, 8, 1]).length == 4        # the last token is recomputed
    assert store.lookup([5, 6, 7, 9, 9]) is None
    assert store.lookup([5, 6, 7, 8]) is None               # the checkpoint must leave a token


def test_a_prefix_ending_mid_block_hits_the_last_block_state_before_it():
    cache, store = fresh()
    a = list(range(30))
    src = cache.allocate(64)
    states = {}
    for p in (8, 16, 24, 29):
        fill(cache, src, p, seed=p)
        states[p] = store.states(src)
    store.insert(a, src, states)
    b = a[:20] + [99] * 10                                 # diverges inside the third block
    hit = store.lookup(b)
    assert hit.length == 16
    dst = cache.allocate(64)
    store.restore(hit, dst)
    assert torch.equal(cache.gdn_state[:, dst], states[16][0][0])
    assert torch.equal(cache.k[:, dst, :16], cache.k[:, src, :16])
    longer = a + [7, 7, 7]                                  # a later turn extends the prompt
    assert store.lookup(longer).length == 29


def test_blocks_are_shared_and_a_second_prompt_adds_only_its_own():
    cache, store = fresh()
    src = cache.allocate(64)
    fill(cache, src, 40, seed=3)
    a = list(range(40))
    store.insert(a, src, {32: store.states(src)})
    before = store.stats()
    assert before["blocks"] == 4 and before["block_states"] == 1 and before["tails"] == 0
    b = a[:16] + [1] * 24
    store.insert(b, src, {39: store.states(src)})
    after = store.stats()
    assert after["blocks"] == 4 + 2 and after["tails"] == 1 and after["tokens"] == 48 + 7


def test_lru_eviction_under_a_small_capacity_keeps_the_cache_consistent():
    cache, store = fresh()
    src = cache.allocate(64)
    prompts = [[i] * 20 for i in range(6)]
    for i, p in enumerate(prompts):
        fill(cache, src, 19, seed=10 + i)
        store.insert(p, src, {8: store.states(src), 19: store.states(src)})
    one = store.bytes // 6
    store.capacity = 3 * one
    store.lookup(prompts[0])                                 # the oldest becomes the newest
    store.evict()
    assert store.bytes <= 3 * one
    assert store.lookup(prompts[0]).length == 19
    assert store.lookup(prompts[1]) is None or store.lookup(prompts[1]).length < 19
    # whatever is left restores what was recorded
    for p in prompts:
        hit = store.lookup(p)
        if hit is not None:
            dst = cache.allocate(64)
            store.restore(hit, dst)
            assert cache.host_lengths[dst] == hit.length
            cache.free(dst)
    store.clear()
    assert store.bytes == 0 and store.stats()["blocks"] == 0 and store.lookup(prompts[0]) is None


def test_a_zero_capacity_keeps_nothing_and_bad_checkpoints_are_refused():
    cache = HybridCache(SHAPE, 2, 32, dtype=torch.float32)
    store = PrefixCache([CachePools(cache)], capacity_bytes=0, block=B)
    src = cache.allocate(32)
    fill(cache, src, 10, seed=4)
    store.insert(list(range(10)), src, {9: store.states(src)})
    assert store.bytes == 0 and store.lookup(list(range(10))) is None
    with pytest.raises(ValueError, match="checkpoints at"):
        store.insert([1, 2], src, {5: store.states(src)})
    with pytest.raises(ValueError, match="block must be"):
        PrefixCache([CachePools(cache)], capacity_bytes=1, block=0)

"""The prefix cache's store (bole.engine.prefix_cache) against values written out: the bytes it
holds, its stats, the MTP head's pools, what a lookup may return at block boundaries, which
entry eviction drops first. Written for the mutation run (docs/testing.md); fake pools, no
model, well under a second."""

import torch

from bole.cache import CacheShape, HybridCache, StatePool
from bole.engine.prefix_cache import CachePools, MTPPools, PrefixCache

SHAPE = CacheShape(num_full_layers=2, num_kv_heads=2, head_dim=4,
                   pools=(StatePool("gdn_state", 3, (2, 4, 4), torch.float32),
                          StatePool("conv_state", 3, (8, 3))))
B = 8
ROW = 2 * (2 * 2 * 4) * 4            # bytes a token: k and v, 2 layers x 2 heads x 4, fp32
STATE = 3 * 2 * 4 * 4 * 4 + 3 * 8 * 3 * 4      # gdn 384 + conv 288 bytes
GIB = 1 << 30


def fresh(slots=4, max_len=64, capacity=GIB, block=B):
    cache = HybridCache(SHAPE, slots, max_len, dtype=torch.float32)
    return cache, PrefixCache([CachePools(cache)], capacity_bytes=capacity, block=block)


def fill(cache, slot, n, seed):
    g = torch.Generator().manual_seed(seed)
    for t in (cache.k, cache.v, cache.gdn_state, cache.conv_state):
        t[:, slot] = torch.randn(t[:, slot].shape, generator=g)
    cache.host_lengths[slot] = n
    cache.lengths[slot] = n


def test_bytes_and_stats_are_the_entries_held_written_out():
    """21 tokens with checkpoints at 8, 16 (block states) and 20 (a tail of 4 tokens): two
    blocks' rows, two states, the tail's rows and state; inserting the same again adds nothing;
    two lookups count twice; evicting to what is held frees nothing, to 0 frees it all."""
    cache, store = fresh()
    src = cache.allocate(64)
    fill(cache, src, 21, seed=1)
    tokens = list(range(100, 121))
    cps = {p: store.states(src) for p in (8, 16, 20)}
    held = 16 * ROW + 2 * STATE + 4 * ROW + STATE
    assert held == 4576
    store.insert(tokens, src, cps)
    want = dict(blocks=2, block_states=2, tails=1, tokens=20, bytes=held, capacity_bytes=GIB,
                query_tokens=0, hit_tokens=0)
    assert store.stats() == want and type(store.bytes) is int
    store.insert(tokens, src, {p: store.states(src) for p in (8, 16, 20)})   # held already
    assert store.stats() == want
    for _ in range(2):
        assert store.lookup(tokens).length == 20
    assert store.lookup(tokens[:3] + [0] * 18) is None
    want.update(query_tokens=60, hit_tokens=40)
    assert store.stats() == want
    assert store.evict(held) == 0 and store.bytes == held          # at the target: kept
    assert store.evict(held - 1) == STATE + 4 * ROW                # the tail went first
    assert store.evict(0) == held - STATE - 4 * ROW
    assert store.bytes == 0 and store.stats()["blocks"] == 0 and store.lookup(tokens) is None


def test_a_block_without_its_state_counts_only_its_rows():
    cache, store = fresh()
    src = cache.allocate(64)
    fill(cache, src, 20, seed=2)
    store.insert(list(range(20)), src, {16: store.states(src)})     # block 8 has no state
    assert store.bytes == 16 * ROW + STATE
    assert store.stats()["block_states"] == 1 and store.lookup(list(range(20))).length == 16
    assert store.lookup(list(range(12))) is None                    # block 8 holds no state


def test_lookups_count_every_token_but_the_last():
    cache, store = fresh()
    assert store.lookup([]) is None and store.lookup([7]) is None
    assert store.stats()["query_tokens"] == 0
    store.lookup([7, 8, 9])
    assert store.stats()["query_tokens"] == 2 and store.stats()["hit_tokens"] == 0


def test_a_checkpoint_at_a_block_boundary_hits_only_from_a_longer_prompt():
    """A block state at 16 serves a prompt of 17 tokens or more, never one of exactly 16 (its last
    token is always computed again): that prompt gets the state at 8."""
    cache, store = fresh()
    src = cache.allocate(64)
    fill(cache, src, 16, seed=3)
    tokens = list(range(50, 66))
    store.insert(tokens, src, {8: store.states(src), 16: store.states(src)})
    assert store.lookup(tokens).length == 8
    assert store.lookup(tokens + [1]).length == 16
    assert store.lookup(tokens[:9]).length == 8
    assert store.lookup(tokens[:8]) is None


def test_checkpoints_at_one_token_and_at_the_whole_length_are_taken():
    """A checkpoint may sit after the first token and at the last token (a finished request's
    committed length)."""
    cache, store = fresh()
    src = cache.allocate(64)
    fill(cache, src, 5, seed=4)
    store.insert([4, 5, 6, 7, 8], src, {1: store.states(src), 5: store.states(src)})
    assert store.lookup([4, 9]).length == 1
    assert store.lookup([4, 5, 6, 7, 8, 0]).length == 5
    assert store.stats()["tails"] == 2 and store.bytes == 6 * ROW + 2 * STATE


def test_one_token_blocks_are_allowed():
    cache, store = fresh(block=1)
    src = cache.allocate(64)
    fill(cache, src, 3, seed=5)
    store.insert([1, 2, 3], src, {2: store.states(src)})
    assert store.stats()["blocks"] == 2 and store.stats()["block_states"] == 1
    hit = store.lookup([1, 2, 3])
    assert hit.length == 2 and len(hit.path) == 2


def _short(store, cache, src, first, seed):
    """A five-token prompt starting with ``first``: one tail of 4 tokens."""
    fill(cache, src, 4, seed=seed)
    store.insert([first, 1, 2, 3, 4], src, {4: store.states(src)})
    return [first, 1, 2, 3, 4]


def test_the_least_recently_used_entry_goes_first():
    """A, B, C inserted, A looked up: evicting to two entries drops B. Then C looked up twice and
    D inserted: evicting to one entry keeps D, the newest."""
    one = 4 * ROW + STATE
    cache, store = fresh()
    src = cache.allocate(64)
    a, b, c = (_short(store, cache, src, f, seed=f) for f in (10, 11, 12))
    assert store.bytes == 3 * one
    store.lookup(a)
    assert store.evict(2 * one) == one
    assert store.lookup(b) is None and store.lookup(a).length == 4
    store.lookup(c)
    store.lookup(c)
    d = _short(store, cache, src, 13, seed=13)
    store.evict(one)
    assert [store.lookup(p) is not None for p in (a, c, d)] == [False, False, True]


class _Head:
    """What MTPPools reads of the MTP drafter: its KV rows by position and last hidden state."""

    def __init__(self, slots, max_len):
        self.k = torch.zeros(slots, max_len, 2, 3)
        self.v = torch.zeros(slots, max_len, 2, 3)
        self.last_hidden = torch.zeros(slots, 6)


def test_the_mtp_heads_rows_and_hidden_state_are_restored_with_the_targets():
    cache = HybridCache(SHAPE, 4, 64, dtype=torch.float32)
    head = _Head(4, 64)
    store = PrefixCache([CachePools(cache), MTPPools(head)], capacity_bytes=GIB, block=B)
    src = cache.allocate(64)
    fill(cache, src, 13, seed=6)
    g = torch.Generator().manual_seed(7)
    head.k[src] = torch.randn(head.k[src].shape, generator=g)
    head.v[src] = torch.randn(head.v[src].shape, generator=g)
    hidden = {}
    cps = {}
    for p in (8, 12):
        head.last_hidden[src] = hidden[p] = torch.randn(6, generator=g)
        cps[p] = store.states(src)
    store.insert(list(range(13)), src, cps)
    mtp_row = 2 * 2 * 3 * 4
    assert store.bytes == 12 * (ROW + mtp_row) + 2 * (STATE + 6 * 4)
    for n, length in ((10, 8), (13, 12)):
        dst = cache.allocate(64)
        store.restore(store.lookup(list(range(n))), dst)
        assert torch.equal(head.k[dst, :length], head.k[src, :length])
        assert torch.equal(head.v[dst, :length], head.v[src, :length])
        assert not head.k[dst, length:].any() and not head.v[dst, length:].any()
        assert torch.equal(head.last_hidden[dst], hidden[length])
        assert torch.equal(cache.k[:, dst, :length], cache.k[:, src, :length])
        assert cache.host_lengths[dst] == length
        head.k[dst] = head.v[dst] = head.last_hidden[dst] = 0
        cache.free(dst)


class _BytePool:
    """A pool whose rows are one byte a token and whose state is empty."""

    def rows(self, slot, lo, hi):
        return [torch.ones(hi - lo, dtype=torch.uint8)]

    def put_rows(self, slot, lo, rows):
        pass

    def state(self, slot):
        return []

    def put_state(self, slot, state, length):
        pass


def test_clear_drops_every_entry_however_small():
    store = PrefixCache([_BytePool()], capacity_bytes=GIB, block=B)
    store.insert([5, 6], 0, {1: store.states(0)})
    assert store.bytes == 1 and store.lookup([5, 6]).length == 1
    store.clear()
    assert store.bytes == 0 and store.lookup([5, 6]) is None

"""Short prompts prefilled together (ModelRunner.prefill_batch) leave the cache exactly as each
prefilled alone, and the engine admits a round's arrivals in one such forward."""

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.runner import PREFILL_BATCH_MAX, ModelRunner
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel


@pytest.fixture(scope="module")
def model():
    return HybridModel.random(preset_config("tiny"), dtype=torch.float32, mtp=True, seed=3,
                              gdn_backend="torch")


def _both_ways(model, lengths, seed, backend, max_len):
    """The same prompts prefilled one at a time and together, in two runners: (prompts, the
    lone prefills' results, (logits, hidden) of the batch, both runners and their slots)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in lengths]
    alone, together = (ModelRunner(model, model.new_cache(len(lengths), max_len), backend)
                       for _ in range(2))
    slots_a = [alone.cache.allocate(max_len - 16) for _ in prompts]
    slots_t = [together.cache.allocate(max_len - 16) for _ in prompts]
    want = [alone.prefill(s, p) for s, p in zip(slots_a, prompts)]
    return prompts, want, together.prefill_batch(slots_t, prompts), alone, together, slots_a, slots_t


def test_batched_prefill_equals_one_at_a_time(model):
    prompts, want, (logits, hidden), alone, together, slots_a, slots_t = _both_ways(
        model, (7, 1, 19, 12), 0, "torch", 64)
    for r, (p, (lg, hd)) in enumerate(zip(prompts, want)):
        n = p.numel()
        torch.testing.assert_close(logits[r], lg, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden[r], hd, rtol=1e-5, atol=1e-5)
        a, t = alone.cache, together.cache
        assert a.host_lengths[slots_a[r]] == t.host_lengths[slots_t[r]] == n
        assert int(t.lengths[slots_t[r]]) == n
        torch.testing.assert_close(t.k[:, slots_t[r], :n], a.k[:, slots_a[r], :n],
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(t.v[:, slots_t[r], :n], a.v[:, slots_a[r], :n],
                                   rtol=1e-5, atol=1e-6)
        for pool in ("gdn_state", "conv_state"):
            torch.testing.assert_close(getattr(t, pool)[:, slots_t[r]],
                                       getattr(a, pool)[:, slots_a[r]], rtol=1e-5, atol=1e-6)


def test_prefill_batch_refuses_what_it_cannot_do(model):
    runner = ModelRunner(model, model.new_cache(3, 128), "torch")
    s = runner.cache.allocate(100)
    with pytest.raises(ValueError, match="prompts of 1 to"):
        runner.prefill_batch([s], [torch.zeros(PREFILL_BATCH_MAX + 1, dtype=torch.int64)])
    runner.prefill(s, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="fresh slots"):
        runner.prefill_batch([s], [torch.tensor([3])])
    with pytest.raises(ValueError, match="2 prompts for 1 slots"):
        runner.prefill_batch([s], [torch.tensor([3]), torch.tensor([4])])


@pytest.mark.parametrize("mode", ["ar", "bole", "tree-serial", "chain"])
def test_engine_outputs_with_batched_admission_equal_one_by_one(model, mode):
    """Arrivals admitted together (one prefill forward) give the tokens of requests admitted
    one at a time (max_slots 1 admits them one by one)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 3, 30, 70, 14)]
    params = SamplingParams(max_tokens=12)
    spec = SpecConfig(mode, "mtp", depth=3, topk=2, budget=6)
    together = Engine(model, spec, max_slots=5, max_len=160).generate(prompts, params, seed=0)
    one_by_one = Engine(model, spec, max_slots=1, max_len=160).generate(prompts, params, seed=0)
    assert [r.token_ids for r in together] == [r.token_ids for r in one_by_one]


def test_mtp_observes_prompts_together_as_one_at_a_time(model):
    from bole.speculative.drafters.mtp import MTPDrafter
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (5, 1, 17)]
    hidden = [torch.randn(p.numel(), model.config.hidden_size, generator=gen) for p in prompts]
    alone, together = (MTPDrafter(model, 4, 64, 8) for _ in range(2))
    for s, (p, h) in enumerate(zip(prompts, hidden)):
        alone.observe_prompt(s, p, h)
    together.observe_prompts([0, 1, 2], prompts, hidden)
    for s, p in enumerate(prompts):
        n = p.numel() - 1                      # position 0 has no MTP row
        torch.testing.assert_close(together.k[s, :n], alone.k[s, :n], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(together.v[s, :n], alone.v[s, :n], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(together.last_hidden[s], alone.last_hidden[s])
        assert not alone.k[s, n:-1].any()      # nothing past the prompt in either pool
        assert not together.k[s, n:-1].any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton prefill path needs a GPU")
def test_batched_prefill_on_the_gpu_agrees_with_chunked_prefill():
    """On a GPU the batch goes through the Triton closed form and a lone prompt through fla's
    chunk kernel (where installed): the same states to fp32 rounding (tf32 products inside)."""
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, mtp=True, seed=3,
                           device="cuda")
    _, want, (logits, hidden), alone, together, slots_a, slots_t = _both_ways(
        m, (40, 3, 64), 4, "triton", 96)
    for r, (lg, hd) in enumerate(want):
        torch.testing.assert_close(logits[r], lg, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(hidden[r], hd, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(together.cache.gdn_state[:, slots_t[r]],
                                   alone.cache.gdn_state[:, slots_a[r]], rtol=2e-3, atol=2e-3)


def test_rows_pad_to_a_bucket_no_wider_than_a_slot(model):
    """A 5-token prompt runs as a row of 16 slots (of 11 when the slot holds only 12: padding
    rows run on the dummy slot, which holds a token), and the padding changes nothing: the
    result equals the lone prefill."""
    from bole.engine.runner import prefill_bucket
    assert [prefill_bucket(n) for n in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    prompt = torch.arange(5) + 3
    for max_len in (12, 64):
        alone = ModelRunner(model, model.new_cache(1, max_len), "torch")
        together = ModelRunner(model, model.new_cache(1, max_len), "torch")
        lg, hd = alone.prefill(alone.cache.allocate(8), prompt)
        logits, hidden = together.prefill_batch([together.cache.allocate(8)], [prompt])
        torch.testing.assert_close(logits[0], lg, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden[0], hd, rtol=1e-5, atol=1e-5)
        assert together.prefill_tokens([prompt]).shape == (1, min(16, max_len - 1))


def test_rounds_pad_to_a_bucket_no_larger_than_the_engine(model):
    """An engine of 51 slots pads a round of 33-51 requests to 51 rows, not 64 (the memory of a
    computed max batch is the memory of that many rows); past the last bucket the engine's
    size is the bucket; more requests than slots have none."""
    from bole.engine.buckets import bucket_for
    assert [bucket_for(n, 51) for n in (1, 3, 17, 33, 51)] == [1, 4, 32, 51, 51]
    assert bucket_for(257, 300) == 300 and bucket_for(52, 51) is None
    assert bucket_for(3, 256) == 4 and bucket_for(300, 256) is None
    prompts = [[5, 9, 17, 33, 2], [7, 7, 8, 9, 1], [100, 3, 100]]
    params = SamplingParams(max_tokens=6)
    spec = SpecConfig("bole", "mtp", depth=3, topk=2, budget=6)
    engine = Engine(model, spec, max_slots=3, max_len=64)
    got = [r.token_ids for r in engine.generate(prompts, params, seed=0)]
    assert max(engine.rounds.buffers) == 3
    want = [r.token_ids for r in Engine(model, SpecConfig("ar"), max_slots=3, max_len=64)
            .generate(prompts, params, seed=0)]
    assert got == want


def test_padding_rows_stay_inside_the_dummy_slot_at_a_short_max_len(model):
    """Three prompts (a padding row) whose longest needs the 64-token width, in slots of 64
    positions: the width drops to 63, so the padding row on the dummy slot (which holds a
    token) stays inside it; outputs equal one-by-one admission."""
    prompts = [[1] * 40, [2] * 5, [3] * 7]
    params = SamplingParams(max_tokens=4)
    spec = SpecConfig("bole", "mtp", depth=2, topk=2, budget=4)
    together = Engine(model, spec, max_slots=4, max_len=64, cuda_graphs=False)
    assert together.rounds.prefill_widths() == (16, 32)
    got = together.generate(prompts, params, seed=0)
    want = Engine(model, spec, max_slots=1, max_len=64).generate(prompts, params, seed=0)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_admission_takes_at_most_a_row_cap_per_forward(model):
    """More arrivals than PREFILL_BATCH_ROWS go in groups; the round runner refuses more."""
    from bole.engine.runner import PREFILL_BATCH_ROWS
    n = PREFILL_BATCH_ROWS + 3
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (5,), generator=gen).tolist() for _ in range(n)]
    spec = SpecConfig("ar")
    engine = Engine(model, spec, max_slots=n, max_len=64)
    got = engine.generate(prompts, SamplingParams(max_tokens=3), seed=0)
    want = Engine(model, spec, max_slots=1, max_len=64).generate(
        prompts, SamplingParams(max_tokens=3), seed=0)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    slots = [engine.cache.allocate(16) for _ in range(n)]
    with pytest.raises(ValueError, match="at most"):
        engine.rounds.prefill(slots, [torch.tensor([1])] * n)


def test_warm_up_leaves_the_cache_as_it_was(model):
    """Engine.warm_up runs the admission path per bucket and frees every slot it took; the
    engine then generates what a fresh one does."""
    spec = SpecConfig("bole", "mtp", 3, 2, 6)
    fresh = Engine(model, spec, max_slots=3, max_len=160)
    warmed = Engine(model, spec, max_slots=3, max_len=160)
    warmed.warm_up()
    assert warmed.cache.num_free == 3 and not warmed.cache.used_slots
    prompts = [[5, 6, 7], list(range(20, 45))]
    params = SamplingParams(max_tokens=6)
    assert [r.token_ids for r in warmed.generate(prompts, params)] == \
        [r.token_ids for r in fresh.generate(prompts, params)]


def test_admission_prefill_pads_to_a_bucket_and_changes_nothing_else(model):
    """RoundRunner.prefill (what the engine's admission runs, a CUDA graph per batch bucket and
    width on a GPU): three prompts in a bucket of four rows leave the target's cache and the MTP
    head's pool as each prompt prefilled and observed alone; the padding row touches only the
    dummy slot, and other slots keep their state."""
    from bole.engine.round import RoundRunner
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (5, 1, 17)]
    spec = SpecConfig("bole", "mtp", depth=2, topk=2, budget=4)
    alone = Engine(model, spec, max_slots=5, max_len=64, cuda_graphs=False)
    rounds = RoundRunner(ModelRunner(model, model.new_cache(5, 64), "torch"), spec, max_slots=5)
    cache, mtp = rounds.cache, rounds.device_drafter
    bystander = cache.allocate(32)
    rounds.runner.prefill(bystander, torch.tensor([9, 8, 7]))
    before = {n: getattr(cache, n)[:, bystander].clone() for n in ("k", "gdn_state", "conv_state")}
    lengths = cache.lengths.clone()
    slots = [cache.allocate(32) for _ in prompts]
    logits = rounds.prefill(slots, prompts)
    assert logits.shape == (3, model.config.vocab_size)
    for r, p in enumerate(prompts):
        s = alone.cache.allocate(32)
        lg, hd = alone.runner.prefill(s, p)
        alone.rounds.device_drafter.observe_prompt(s, p, hd)
        torch.testing.assert_close(logits[r], lg, rtol=1e-5, atol=1e-5)
        n = p.numel()
        assert cache.host_lengths[slots[r]] == int(cache.lengths[slots[r]]) == n
        for name in ("k", "v"):
            torch.testing.assert_close(getattr(cache, name)[:, slots[r], :n],
                                       getattr(alone.cache, name)[:, s, :n], rtol=1e-5, atol=1e-6)
        for name in ("gdn_state", "conv_state"):
            torch.testing.assert_close(getattr(cache, name)[:, slots[r]],
                                       getattr(alone.cache, name)[:, s], rtol=1e-5, atol=1e-6)
        head = alone.rounds.device_drafter
        torch.testing.assert_close(mtp.k[slots[r], :n - 1], head.k[s, :n - 1],
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mtp.last_hidden[slots[r]], head.last_hidden[s],
                                   rtol=1e-5, atol=1e-6)
    for n, t in before.items():
        assert torch.equal(getattr(cache, n)[:, bystander], t)
    lengths[slots] += torch.tensor([p.numel() for p in prompts])
    assert torch.equal(cache.lengths, lengths)            # the dummy slot's included
    with pytest.raises(ValueError, match="fresh slots"):
        rounds.prefill([slots[0]], [torch.tensor([1])])
    with pytest.raises(ValueError, match="prompts of 1 to"):
        rounds.prefill([cache.allocate(8)], [torch.zeros(PREFILL_BATCH_MAX + 1, dtype=torch.int64)])


def test_copy_slot_gives_a_slot_another_slots_committed_state(model):
    """HybridCache.copy_slot (the benchmarks' batch of one context): every pool row, the
    device and host lengths; the source is untouched."""
    runner = ModelRunner(model, model.new_cache(2, 32), "torch")
    a, b = runner.cache.allocate(16), runner.cache.allocate(16)
    runner.prefill(a, torch.tensor([4, 8, 15, 16, 23]))
    c = runner.cache
    before = {n: getattr(c, n)[:, a].clone() for n in ("k", "v", "gdn_state", "conv_state")}
    c.copy_slot(a, b)
    for n, t in before.items():
        assert torch.equal(getattr(c, n)[:, b], t) and torch.equal(getattr(c, n)[:, a], t)
    assert int(c.lengths[b]) == c.host_lengths[b] == 5

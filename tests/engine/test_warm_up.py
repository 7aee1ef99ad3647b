"""Engine.warm_up: what it admits (every batched-prefill width, one and two requests at a time,
as far as the cache allows) and what it leaves behind (every slot free, nothing in the prefix
cache, the same output as a fresh engine)."""

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.prefix_admission import PrefixCacheConfig
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel

#: the batched admission's prompt widths (bole.engine.runner.prefill_bucket over 1..64)
WIDTHS = (16, 32, 64)
SPEC = SpecConfig("bole", "mtp", 2, 2, 4)


@pytest.fixture(scope="module")
def model():
    return HybridModel.random(preset_config("tiny"), dtype=torch.float32, mtp=True, seed=3,
                              gdn_backend="torch")


def _admissions(engine, monkeypatch) -> list[tuple]:
    """Run warm_up, recording each admission as (rows, prompt lengths, max_tokens, indices,
    free slots before it)."""
    seen = []
    admit = engine.admit_many

    def spy(requests):
        seen.append((len(requests), tuple(len(r.prompt) for r in requests),
                     tuple(r.params.max_tokens for r in requests),
                     tuple(r.index for r in requests), engine.cache.num_free))
        admit(requests)
    monkeypatch.setattr(engine, "admit_many", spy)
    engine.warm_up()
    return seen


def test_warm_up_admits_every_width_one_and_two_at_a_time(model, monkeypatch):
    engine = Engine(model, SPEC, max_slots=3, max_len=160, cuda_graphs=False)
    seen = _admissions(engine, monkeypatch)
    want = [(R, (T,) * R, (1,) * R, tuple(-1 - i for i in range(R)), 3)
            for T in WIDTHS for R in (1, 2)]
    assert seen == want
    assert engine.cache.num_free == 3 and not engine.cache.used_slots


def test_warm_up_skips_what_the_cache_cannot_hold(model, monkeypatch):
    """A width needs T + 1 + scratch rows of context, two rows need two slots."""
    scratch = Engine(model, SPEC, max_slots=1, max_len=64, cuda_graphs=False).scratch
    max_len = 32 + 1 + scratch            # exactly enough for 32 tokens, not for 64
    engine = Engine(model, SPEC, max_slots=1, max_len=max_len, cuda_graphs=False)
    assert _admissions(engine, monkeypatch) == [(1, (16,), (1,), (-1,), 1),
                                                (1, (32,), (1,), (-1,), 1)]
    assert engine.cache.num_free == 1
    short = Engine(model, SPEC, max_slots=2, max_len=max_len - 1, cuda_graphs=False)
    assert [a[:2] for a in _admissions(short, monkeypatch)] == [(1, (16,)), (2, (16, 16))]


def test_warm_up_releases_its_slots_when_an_admission_fails(model, monkeypatch):
    engine = Engine(model, SPEC, max_slots=3, max_len=160, cuda_graphs=False)

    def fail(requests):
        for r in requests:
            r.slot = engine.cache.allocate(len(r.prompt) + 1 + engine.scratch)
        raise RuntimeError("admission failed")
    monkeypatch.setattr(engine, "admit_many", fail)
    with pytest.raises(RuntimeError, match="admission failed"):
        engine.warm_up()
    assert engine.cache.num_free == 3


def test_warm_up_leaves_the_prefix_cache_empty_and_the_output_unchanged(model):
    cfg = PrefixCacheConfig(block=8)
    fresh = Engine(model, SPEC, max_slots=3, max_len=160, cuda_graphs=False, prefix_cache=cfg)
    warmed = Engine(model, SPEC, max_slots=3, max_len=160, cuda_graphs=False, prefix_cache=cfg)
    warmed.warm_up()
    stats = warmed.prefix.stats()
    assert stats["tokens"] == stats["bytes"] == stats["query_tokens"] == 0, stats
    prompts = [list(range(3, 40)), [0] * 16 + [9, 8, 7]]
    params = SamplingParams(max_tokens=5)
    assert [r.token_ids for r in warmed.generate(prompts, params)] == \
        [r.token_ids for r in fresh.generate(prompts, params)]
    assert warmed.prefix.stats() == fresh.prefix.stats()


def test_warm_up_does_nothing_where_admissions_are_captured(model, monkeypatch):
    engine = Engine(model, SPEC, max_slots=2, max_len=160, cuda_graphs=False)
    monkeypatch.setattr(engine.rounds.graphs, "enabled", True)
    assert _admissions(engine, monkeypatch) == []

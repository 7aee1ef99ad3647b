"""The replay drafter gets each request's continuation at admission, whichever way the prompt is
admitted: batched (up to 64 tokens), chunk by chunk (longer), or through the prefix cache. With
forced acceptance the output then follows the continuation given, token for token."""

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.prefix_admission import PrefixCacheConfig
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel


@pytest.fixture(scope="module")
def model():
    return HybridModel.random(preset_config("tiny"), dtype=torch.float32, mtp=True, seed=1,
                              gdn_backend="torch")


@pytest.mark.parametrize("cache", [None, PrefixCacheConfig(block=16)], ids=["plain", "cached"])
def test_forced_replay_emits_the_given_continuation_for_short_and_long_prompts(model, cache):
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 128, (n,), generator=gen).tolist() for n in (9, 70, 130)]
    params = SamplingParams(max_tokens=12)
    plain = [r.token_ids for r in Engine(model, SpecConfig(mode="ar"), max_len=256).generate(
        prompts, params, seed=0)]
    vocab = model.config.vocab_size
    # the first token is the prefill's (the model's own); the rest are not the model's
    other = [[c[0]] + [(t + 1 + i) % vocab for i, t in enumerate(c[1:])] for c in plain]
    assert all(o != p for o, p in zip(other, plain))
    spec = SpecConfig("bole", "replay", 3, 2, 8, "qwen3-next-mtp", forced_acceptance=True)
    engine = Engine(model, spec, max_len=256, prefix_cache=cache)
    res = engine.generate(prompts, params, seed=0, continuations=other)
    assert [r.token_ids for r in res] == other
    if cache is not None:                     # the second time, every prompt hits the cache
        res = engine.generate(prompts, params, seed=0, continuations=other)
        assert [r.token_ids for r in res] == other
        assert engine.prefix.stats()["hit_tokens"] > 0

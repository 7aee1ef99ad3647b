"""A prompt longer than a batched admission (PREFILL_BATCH_MAX tokens) is prefilled chunk by
chunk and handed to the drafters through RoundAdmission.on_prefill, not through the batched
prefill the short prompts of the other tests take: the host drafters must start on its slot with
its prompt and continuation there too. Checked by what the drafters' users see: the target as its
own draft model accepts every chain whole, and the replay drafter under forced acceptance emits
the continuation it was given."""

from __future__ import annotations

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.runner import PREFILL_BATCH_MAX
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel

LONG = [(7 * i + 3) % 97 + 1 for i in range(PREFILL_BATCH_MAX + 6)]


@pytest.fixture(scope="module")
def model() -> HybridModel:
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=1, mtp=True,
                           gdn_backend="torch")
    m.w["lm_head.weight"] = m.w["lm_head.weight"] * 50       # clear greedy margins
    return m


def test_the_target_as_its_own_draft_accepts_whole_chains_after_a_long_prompt(model):
    params = SamplingParams(max_tokens=21)
    ar = Engine(model, SpecConfig(mode="ar"), max_len=160).generate([LONG], params)[0]
    engine = Engine(model, SpecConfig(mode="chain", drafter="draft", depth=4), max_len=160,
                    draft_model=HybridModel(model.config, dict(model.w), gdn_backend="torch"))
    res = engine.generate([LONG], params)[0]
    assert res.token_ids == ar.token_ids
    # every round emits depth + 1 tokens: the draft model holds the prompt in its own slot
    assert res.accepted == [5, 5, 5, 5]


def test_forced_acceptance_follows_the_continuation_after_a_long_prompt(model):
    """As tests/speculative/test_replay.py's test_forced_acceptance_follows_the_continuation,
    with a prompt past the batched admission: the output is the given continuation (not the
    target's own), which the drafter knows only from its start at admission."""
    params = SamplingParams(max_tokens=16)
    plain = Engine(model, SpecConfig(mode="ar"), max_len=160).generate([LONG], params)[0]
    vocab = model.config.vocab_size
    other = [plain.token_ids[0]] + [t if i % 3 else (t + 1) % vocab
                                    for i, t in enumerate(plain.token_ids)][1:]
    assert other != plain.token_ids
    spec = SpecConfig("bole", "replay", 4, 3, 10, "qwen3-next-mtp", forced_acceptance=True)
    res = Engine(model, spec, max_len=160).generate([LONG], params, continuations=[other])[0]
    assert res.token_ids == other

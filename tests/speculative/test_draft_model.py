"""The separate draft-model drafter: exact with any draft model, all-accepting with the target."""

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.models.config import HybridConfig
from bole.models.presets import PRESETS, preset_config
from bole.models.qwen3_hybrid import HybridModel


def tiny(seed):
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=seed, gdn_backend="torch")
    m.w["lm_head.weight"] = m.w["lm_head.weight"] * 50
    return m


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]


def test_target_as_its_own_draft_accepts_whole_chains():
    target = tiny(1)
    draft = HybridModel(target.config, dict(target.w), gdn_backend="torch")
    params = SamplingParams(max_tokens=21)
    ar = Engine(target, SpecConfig(mode="ar")).generate(PROMPTS, params, seed=0)
    res = Engine(target, SpecConfig(mode="chain", drafter="draft", depth=4),
                 draft_model=draft).generate(PROMPTS, params, seed=0)
    assert [r.token_ids for r in res] == [r.token_ids for r in ar]
    # a perfect drafter: every round emits depth + 1 tokens (the last round is cut by max_tokens)
    assert all(a == 5 for r in res for a in r.accepted)


def test_a_different_draft_model_stays_exact():
    target, draft = tiny(1), tiny(2)
    params = SamplingParams(max_tokens=16)
    ar = Engine(target, SpecConfig(mode="ar")).generate(PROMPTS, params, seed=0)
    for mode in ("bole", "tree-serial"):
        res = Engine(target, SpecConfig(mode=mode, drafter="draft", depth=3, topk=2, budget=8),
                     draft_model=draft).generate(PROMPTS, params, seed=0)
        assert [r.token_ids for r in res] == [r.token_ids for r in ar]


def test_draft_model_errors():
    target = tiny(1)
    with pytest.raises(ValueError, match="needs a draft_model"):
        Engine(target, SpecConfig(drafter="draft"))
    other = HybridModel.random(HybridConfig.from_dict({**PRESETS["tiny"], "vocab_size": 64}),
                               dtype=torch.float32)
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(target, SpecConfig(drafter="draft"), draft_model=other)


def test_batched_draft_model_expansion_equals_each_request_alone():
    from bole.engine.runner import ModelRunner
    from bole.speculative.drafters.draft_model import DraftModelDrafter
    draft = tiny(2)
    drafter = DraftModelDrafter(draft, draft.config.vocab_size, max_slots=3, max_len=64,
                                make_runner=ModelRunner)
    for target_slot, prompt in zip((0, 2), PROMPTS):
        drafter.start(target_slot, prompt)
    paths = [[[5], [5, 3]], [[7], [7, 1], [7, 1, 2]]]
    batched = drafter.batch_expander([0, 2])(paths, 3)
    for slot, p, got in zip((0, 2), paths, batched):
        alone = drafter.expander(slot)(p, 3)
        for x, y in zip(got, alone):
            assert [t for t, _ in x] == [t for t, _ in y]
            assert torch.allclose(torch.tensor([q for _, q in x]), torch.tensor([q for _, q in y]),
                                  atol=1e-5)
    assert drafter.batch_expander([0, 2])([[], []], 3) == [[], []]

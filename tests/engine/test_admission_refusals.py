"""RoundRunner.prefill's refusals, each with its whole message (what a caller of the batched
admission reads), and on_prefill's default continuations (none given: the host drafters start
on the slot with its prompt and no continuation)."""

from __future__ import annotations

import pytest
import torch

from bole.engine import Engine, SpecConfig
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=2,
                              gdn_backend="torch")


def test_prefill_refuses_prompts_and_slots_that_do_not_pair_or_hold_tokens(model):
    engine = Engine(model, SpecConfig(mode="ar"), max_slots=4, max_len=64)
    rounds, cache = engine.rounds, engine.cache
    a, b = cache.allocate(32), cache.allocate(32)
    with pytest.raises(ValueError) as err:
        rounds.prefill([a, b], [torch.tensor([1, 2])])
    assert str(err.value) == "1 prompts for 2 slots"
    with pytest.raises(ValueError) as err:
        rounds.prefill([], [])
    assert str(err.value) == "0 prompts for 0 slots"
    rounds.prefill([a], [torch.tensor([1, 2])])
    with pytest.raises(ValueError) as err:
        rounds.prefill([a], [torch.tensor([3])])
    assert str(err.value) == "prefill fills fresh slots (no committed tokens)"
    assert cache.host_lengths[a] == 2 and cache.host_lengths[b] == 0


def test_on_prefill_without_continuations_starts_the_host_drafter(model):
    engine = Engine(model, SpecConfig(mode="chain", drafter="draft", depth=2), max_slots=2,
                    max_len=64, draft_model=model)
    slot = engine.cache.allocate(32)
    prompt = torch.tensor([3, 1, 4, 1, 5])
    _, hidden = engine.runner.prefill(slot, prompt)
    engine.rounds.on_prefill([slot], [prompt], [hidden])
    drafter = engine.rounds.drafter
    assert slot in drafter.slots
    assert drafter.cache.host_lengths[drafter.slots[slot]] == len(prompt)

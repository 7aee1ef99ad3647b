"""`ar` is the baseline every speedup is measured against: plain decoding, one token a row per
forward, the in-place decode recurrence, no drafter and no tree, whatever drafter and tree the
spec names."""

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel
from tests.engine.forward_spy import record_forwards


@pytest.fixture(scope="module")
def model():
    return HybridModel.random(preset_config("tiny"), dtype=torch.float32, mtp=True, seed=3,
                              gdn_backend="torch")


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_ar_rounds_are_plain_decoding(model, monkeypatch, drafter):
    engine = Engine(model, SpecConfig("ar", drafter, depth=3, topk=2, budget=6), max_slots=3,
                    max_len=96)
    forwards = record_forwards(engine, monkeypatch)
    prompts = [[5, 6, 7], [9, 8, 1, 2], [4]]
    res = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert engine.rounds.drafter is None and engine.rounds.device_drafter is None
    assert all(r.accepted == [1] * 11 for r in res), [r.accepted for r in res]
    # the three prompts admitted in one forward of 16 tokens a row, then 11 rounds of one token
    assert forwards == [(16, "torch")] + [(1, "torch-decode")] * 11, forwards

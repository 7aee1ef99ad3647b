"""The first token, which admission emits from the prefill's logits (not a round): a sampled
request's is a draw from the model's own softmax (its argmax no more often than the softmax
says), and a greedy request with a penalty takes the argmax of the penalised logits, each
computed here from a plain prefill."""

from __future__ import annotations

import math

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.runner import ModelRunner
from bole.models.qwen3_hybrid import HybridModel
from tests.engine.sampled_model import PROMPT, peaked_tiny_model


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return peaked_tiny_model()


def last_logits(model: HybridModel, prompt: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, model.new_cache(1, 64), "torch")
    slot = runner.cache.allocate(len(prompt) + 1)
    with torch.no_grad():
        last, _ = runner.prefill(slot, torch.tensor(prompt))
    return last.double()


def test_a_sampled_first_token_is_a_draw_from_the_models_softmax(model):
    N = 400
    p = torch.softmax(last_logits(model, PROMPT), dim=-1)
    top = int(p.argmax())
    assert 0.05 < float(p[top]) < 0.8                      # a draw, not a near-certainty
    engine = Engine(model, SpecConfig(mode="ar"), max_slots=32, max_len=64)
    res = engine.generate([PROMPT] * N, SamplingParams(temperature=1.0, max_tokens=1), seed=11)
    first = [r.token_ids[0] for r in res]
    assert all(float(p[t]) > 0 for t in first)
    expected, sd = N * float(p[top]), math.sqrt(N * float(p[top]) * (1 - float(p[top])))
    assert abs(first.count(top) - expected) < 4 * sd, (first.count(top), expected)
    assert len(set(first)) >= 5


def test_a_greedy_first_token_takes_the_argmax_of_the_penalised_logits(model):
    prompt = [7, 7, 8, 9, 1, 2, 3]
    for t in range(128):                   # a prompt whose likeliest next token it holds
        x = last_logits(model, prompt + [t])
        if int(x.argmax()) in prompt + [t]:
            prompt = prompt + [t]
            break
    else:
        pytest.fail("no prompt of this form holds its likeliest next token")
    seen = torch.zeros_like(x, dtype=torch.bool)
    seen[prompt] = True
    penalised = torch.where(seen, torch.where(x > 0, x / 2.0, x * 2.0), x)
    assert int(penalised.argmax()) != int(x.argmax())      # the penalty changes the choice
    engine = Engine(model, SpecConfig(mode="ar"), max_slots=2, max_len=64)
    (res,) = engine.generate([prompt], SamplingParams(repetition_penalty=2.0, max_tokens=1))
    assert res.token_ids == [int(penalised.argmax())]

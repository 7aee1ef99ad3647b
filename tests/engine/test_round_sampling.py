"""The round's sampling, fast: each request's second token (the first a round emits, in plain
decoding and with drafts accepted) is a draw from the model's own softmax given the prompt and
its first token, computed here by a plain forward in float64. A round that lost a request's
sampling parameters (every row greedy), gave sampled rows no randomness, or mixed up which rows
are sampled fails the randomized probability-integral transform (uniform under the right
distribution; Kolmogorov-Smirnov p > 1e-3) and the count of argmax draws (within 4 standard
deviations of its expectation; a round that turned greedy is 30 away). The slower
joint-distribution test of three tokens in every mode is test_user_visible's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import kstest

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.runner import ModelRunner
from bole.models.qwen3_hybrid import HybridModel
from tests.engine.sampled_model import PROMPT, peaked_tiny_model


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return peaked_tiny_model()


def next_token_probs(model: HybridModel, seq: list[int], temperature: float) -> np.ndarray:
    """softmax(logits / temperature) after ``seq``, from a plain forward on a fresh cache, fp64."""
    runner = ModelRunner(model, model.new_cache(1, 64), "torch")
    slot = runner.cache.allocate(len(seq) + 1)
    with torch.no_grad():
        last, _ = runner.prefill(slot, torch.tensor(seq))
    return torch.softmax(last.double() / temperature, dim=-1).numpy()


def second_token_checks(model, results, temperature: float,
                        rng: np.random.Generator) -> tuple[float, float]:
    """``(KS p-value of the randomized PIT F(t - 1) + v p(t) of each result's second token,
    the z-score of how often it is its reference's argmax against the expected count)``."""
    cache: dict[int, np.ndarray] = {}
    pits, hits, p_max = [], 0, []
    for r in results:
        first, second = r.token_ids[:2]
        if first not in cache:
            cache[first] = next_token_probs(model, PROMPT + [first], temperature)
        p = cache[first]
        pits.append(p[:second].sum() + rng.random() * p[second])
        hits += int(second == int(np.argmax(p)))
        p_max.append(p.max())
    p_max = np.array(p_max)
    z = (hits - p_max.sum()) / np.sqrt((p_max * (1 - p_max)).sum())
    return float(kstest(pits, "uniform").pvalue), float(z)


@pytest.mark.parametrize("mode", ["ar", "bole"])
def test_a_rounds_token_is_a_draw_from_the_models_softmax(model, mode):
    spec = SpecConfig(mode="ar") if mode == "ar" else \
        SpecConfig(mode=mode, drafter="draft", depth=2, topk=2, budget=6)
    engine = Engine(model, spec, max_slots=64, max_len=48,
                    draft_model=None if mode == "ar" else model)
    temperature = 0.8
    # a greedy request in the batch too: the rows keep their own parameters
    prompts = [PROMPT] * 160
    params = [SamplingParams(temperature=temperature, max_tokens=2)] * 159 + \
        [SamplingParams(temperature=0, max_tokens=2)]
    results = engine.generate(prompts, params, seed=11)
    pvalue, z = second_token_checks(model, results[:159], temperature, np.random.default_rng(0))
    assert pvalue > 1e-3 and abs(z) < 4, (mode, pvalue, z)
    if mode != "ar":                        # drafts were accepted: the round emitted both tokens
        assert sum(r.rounds == 1 for r in results) >= 10
    greedy = next_token_probs(model, PROMPT + results[-1].token_ids[:1], 1.0)
    assert results[-1].token_ids[1] == int(np.argmax(greedy))

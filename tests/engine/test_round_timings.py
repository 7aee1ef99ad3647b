"""The rounds' timings per batch size: what the full-batch rate reads, and that an engine's
rounds record every token they emit under the number of requests they ran."""

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.timings import RoundTimings
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel


def _round(requests, tokens, total):
    return dict(draft=0.0, verify=0.0, accept_commit=0.0, host=0.0, total=total, syncs=1,
                requests=requests, tokens=tokens)


def test_full_batch_rate_reads_the_rounds_of_the_most_requests():
    t = RoundTimings()
    assert t.full_batch_rate() is None
    for requests, tokens, ms in ((4, 20, 10.0), (4, 16, 10.0), (3, 9, 8.0), (1, 2, 5.0)):
        t.add(_round(requests, tokens, ms))
    rate, rounds = t.full_batch_rate()
    assert rounds == 2 and rate == pytest.approx(36 / 0.020)
    assert t.by_batch == {4: [2, 36, 20.0], 3: [1, 9, 8.0], 1: [1, 2, 5.0]}
    assert t.decode_split(47, 1.0)[0] == pytest.approx(47 / 0.033)


def test_an_engine_records_every_token_under_its_batch_size():
    model = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, mtp=True,
                               gdn_backend="torch")
    prompts = [[5, 9, 17, 33], [7, 7, 8], [100, 3, 100, 3, 100]]
    engine = Engine(model, SpecConfig("bole", "mtp", depth=3, topk=2, budget=6), max_slots=3)
    res = engine.generate(prompts, [SamplingParams(max_tokens=n) for n in (12, 5, 8)])
    by = engine.timings.by_batch
    assert max(by) == 3 and sum(row[0] for row in by.values()) == engine.timings.rounds
    # every token after each request's first comes from a round
    assert sum(row[1] for row in by.values()) == sum(len(r.token_ids) - 1 for r in res)

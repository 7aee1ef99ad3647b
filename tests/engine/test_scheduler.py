"""Continuous batching: requests joining mid-flight get the output they get alone, cancelled and
finished requests free their slots, a full queue refuses."""

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.scheduler import QueueFull, Scheduler
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel

PROMPTS = [[5, 9, 17, 33, 2] * 4, [7, 7, 8, 9, 1, 2, 3, 7, 7, 8], [100], [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.fixture(scope="module")
def model():
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, gdn_backend="torch")
    tensors = dict(m.w)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 50     # clear greedy margins
    return HybridModel(m.config, tensors, gdn_backend="torch")


def alone(model, prompt, max_tokens):
    engine = Engine(model, SpecConfig(mode="ar"), max_slots=1, max_len=128,
                    gdn_backend="torch-serial")
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0].token_ids


@pytest.mark.parametrize("mode", ["bole", "tree-serial", "chain", "ar"])
def test_requests_joining_mid_flight_equal_one_at_a_time(model, mode):
    engine = Engine(model, SpecConfig(mode=mode, depth=3, topk=2, budget=8), max_slots=2,
                    max_len=128)
    scheduler = Scheduler(engine, max_queue=8)
    events = {}

    def record(handle, tokens, finished):
        events.setdefault(handle.request.index, []).extend(tokens)
    lengths = [14, 9, 11, 6]
    handles = [scheduler.submit(PROMPTS[0], SamplingParams(max_tokens=lengths[0]),
                                on_event=record)]
    scheduler.step()                                   # the first request runs alone
    for p, n in zip(PROMPTS[1:], lengths[1:]):         # then three more arrive, one per round
        handles.append(scheduler.submit(p, SamplingParams(max_tokens=n), on_event=record))
        assert scheduler.num_running <= 2              # two slots: the rest wait
        scheduler.step()
    scheduler.run_until_idle()
    for h, p, n in zip(handles, PROMPTS, lengths):
        assert h.result.token_ids == alone(model, p, n)
        assert events[h.request.index] == h.result.token_ids     # streamed = final
        assert h.done.is_set()
    assert engine.cache.num_free == 2


def test_cancelled_requests_free_their_slots_within_a_round(model):
    engine = Engine(model, SpecConfig(depth=3, topk=2, budget=8), max_slots=2, max_len=128)
    scheduler = Scheduler(engine, max_queue=4)
    finals = []
    a = scheduler.submit(PROMPTS[0], SamplingParams(max_tokens=40),
                         on_event=lambda h, t, f: f and finals.append(h))
    b = scheduler.submit(PROMPTS[1], SamplingParams(max_tokens=40))
    waiting = scheduler.submit(PROMPTS[2], SamplingParams(max_tokens=40))
    scheduler.step()
    assert engine.cache.num_free == 0 and scheduler.num_waiting == 1
    scheduler.cancel(a)
    scheduler.cancel(waiting)
    scheduler.step()                                   # one round boundary later
    assert a.done.is_set() and a.result is None and finals == [a]
    assert waiting.done.is_set() and scheduler.num_waiting == 0
    assert scheduler.num_running == 1 and engine.cache.num_free == 1
    scheduler.run_until_idle()
    assert b.result is not None and engine.cache.num_free == 2


def test_a_request_cancelled_during_its_admission_runs_no_round(model):
    """A cancel that arrives while the request's prompt is prefilled (another thread, in a
    server) frees its slot before the step's round: the round runs only the others."""
    engine = Engine(model, SpecConfig(depth=3, topk=2, budget=8), max_slots=2, max_len=128)
    scheduler = Scheduler(engine, max_queue=4)
    rounds = []
    scheduler.on_round = rounds.append
    a = scheduler.submit(PROMPTS[0], SamplingParams(max_tokens=40))
    b = scheduler.submit(PROMPTS[1], SamplingParams(max_tokens=40))
    admit = engine.admit_many

    def admit_then_cancel(requests):
        admit(requests)
        scheduler.cancel(a)
    engine.admit_many = admit_then_cancel
    scheduler.step()
    assert a.done.is_set() and a.result is None and len(a.request.out) == 1
    assert rounds[-1].batch == 1 and rounds[-1].admitted == 2 and len(b.request.out) > 1
    assert scheduler.num_running == 1 and engine.cache.num_free == 1


def test_requests_that_finish_at_their_first_token_run_no_round(model):
    """max_tokens=1: admission emits the only token; the step runs no round, with or without
    a listener for round reports (the one it gets says so: batch 0, two admitted)."""
    engine = Engine(model, SpecConfig(depth=3, topk=2, budget=8), max_slots=2, max_len=128)
    for listen in (False, True):
        scheduler = Scheduler(engine, max_queue=4)
        rounds = []
        if listen:
            scheduler.on_round = rounds.append
        handles = [scheduler.submit(p, SamplingParams(max_tokens=1)) for p in PROMPTS[:2]]
        assert scheduler.step() is False
        assert [len(h.result.token_ids) for h in handles] == [1, 1]
        assert engine.cache.num_free == 2 and scheduler.num_running == 0
        assert [(r.batch, r.admitted) for r in rounds] == ([(0, 2)] if listen else [])


def test_a_full_queue_refuses_and_bad_requests_are_checked_first(model):
    engine = Engine(model, SpecConfig(depth=3, topk=2, budget=8), max_slots=1, max_len=64)
    scheduler = Scheduler(engine, max_queue=2)
    for _ in range(2):
        scheduler.submit(PROMPTS[2], SamplingParams(max_tokens=4))
    with pytest.raises(QueueFull, match="waiting"):
        scheduler.submit(PROMPTS[2], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="context"):
        scheduler.submit(PROMPTS[2], SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="token ids"):
        scheduler.submit([10_000], SamplingParams(max_tokens=4))
    scheduler.run_until_idle()
    assert engine.cache.num_free == 1


def test_generate_queues_more_prompts_than_slots(model):
    engine = Engine(model, SpecConfig(depth=3, topk=2, budget=8), max_slots=2, max_len=128)
    res = engine.generate(PROMPTS, SamplingParams(max_tokens=10), seed=0)
    assert [r.token_ids for r in res] == [alone(model, p, 10) for p in PROMPTS]
    assert engine.cache.num_free == 2


def test_a_round_queues_its_next_draft_unless_a_free_slot_waits_for_a_request(model):
    """The next round's draft is queued behind a round's acceptance when that round's rows will
    run again: nobody waits, or every slot is busy (only a finishing request frees one, and it
    changes the rows anyway). A free slot with requests waiting means the next step admits."""
    engine = Engine(model, SpecConfig(depth=3, topk=2, budget=8), max_slots=2, max_len=128)
    scheduler = Scheduler(engine, max_queue=8)
    seen = []
    real = engine.step

    def spy(requests, prelaunch=False):
        seen.append((len(requests), scheduler.num_waiting, prelaunch))
        return real(requests, prelaunch=prelaunch)
    engine.step = spy
    handles = [scheduler.submit(p, SamplingParams(max_tokens=1 if i == 0 else 10, seed=i))
               for i, p in enumerate(PROMPTS)]
    scheduler.run_until_idle()
    assert seen[0] == (1, 2, False)      # the first request ended at its prefill: a slot is free
    assert seen[1] == (2, 1, True)       # both slots busy, one request waiting
    assert all(prelaunch for _, _, prelaunch in seen[1:])
    assert [h.result.token_ids for h in handles[1:]] == [alone(model, p, 10)
                                                         for p in PROMPTS[1:]]

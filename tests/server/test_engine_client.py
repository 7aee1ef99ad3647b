"""The engine process's front end in this process (:class:`EngineClient`, the engine on the tiny
model in a spawned process): requests come back with the engine's own tokens, logprobs and
finish reasons, each through its event callback, with the rounds' reports; a cancel ends a
request with no result; a stop ends the process; an engine process that dies ends every
request it held and refuses new ones."""

from __future__ import annotations

import threading

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.scheduler import QueueFull
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel
from bole.server.engine_process import EngineClient
from tests.test_engine import prompts


def tiny_engine(max_slots: int, max_len: int = 128) -> Engine:
    """test_engine's tiny model (clear greedy margins) in bole mode; module level, so that the
    spawned process can import it."""
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, gdn_backend="torch")
    m.w["lm_head.weight"] = m.w["lm_head.weight"] * 50
    return Engine(m, SpecConfig(mode="bole", depth=3, topk=2, budget=8), max_slots=max_slots,
                  max_len=max_len)


#: the engine processes' context, and the max_tokens of the requests a test ends early (a
#: cancel, a killed process): hundreds of rounds before such a request could end by length
LONG_LEN = 4096
LONG = LONG_LEN - 64


class Events:
    """Each handle's events as the client delivers them: (tokens, finished)."""

    def __init__(self):
        self.by_handle: dict[int, list[tuple[list[int], bool]]] = {}
        self.lock = threading.Lock()

    def __call__(self, handle, tokens, finished) -> None:
        with self.lock:
            self.by_handle.setdefault(id(handle), []).append((list(tokens), finished))


@pytest.fixture(scope="module")
def client():
    c = EngineClient(tiny_engine, (2, LONG_LEN), max_queue=2, startup_timeout=300)
    yield c
    c.stop()


def test_requests_come_back_as_the_engine_generates_them(client: EngineClient):
    """Two concurrent requests (one with logprobs, one cut by a stop token): tokens, finish
    reasons and logprobs equal the engine's in this process; each handle's events add up to
    its tokens and end with one final event; the reports count the rounds' tokens; nothing is
    left running or waiting."""
    ref = Engine(tiny_engine(2).model, SpecConfig(mode="ar")).generate(
        prompts()[:1], SamplingParams(max_tokens=12))[0].token_ids
    params = [SamplingParams(max_tokens=12, logprobs=2),
              SamplingParams(max_tokens=12, stop_token_ids=(ref[4],))]
    want = Engine(tiny_engine(2).model, SpecConfig(mode="ar")).generate(
        prompts()[:1] * 2, params)
    assert want[1].finish_reason == "stop" and want[0].finish_reason == "length"
    events, reports = Events(), []
    client.on_round = reports.append
    handles = [client.submit(prompts()[0], q, on_event=events) for q in params]
    for h in handles:
        assert h.done.wait(120)
    client.on_round = None
    for h, w in zip(handles, want):
        view = h.request
        assert view.result is not None and view.result.token_ids == w.token_ids
        assert view.out == w.token_ids and view.result.finish_reason == w.finish_reason
        assert sum(view.accepted) == len(w.token_ids) - 1 and len(view.accepted) == view.rounds
        got = events.by_handle[id(h)]
        assert sum((t for t, _ in got), []) == w.token_ids
        assert [f for _, f in got] == [False] * (len(got) - 1) + [True]
    lp, want_lp = handles[0].request, want[0].logprobs
    assert [x.token_id for x in lp.logprobs] == [x.token_id for x in want_lp]
    for x, y in zip(lp.logprobs, want_lp):
        assert abs(x.logprob - y.logprob) < 1e-4 and [t for t, _ in x.top] == [t for t, _ in y.top]
    assert handles[1].request.logprobs == []
    assert sum(sum(r.emitted) for r in reports) == sum(len(w.token_ids) - 1 for w in want)
    assert client.num_running == 0 and client.num_waiting == 0 and client.healthy()


def test_a_cancel_ends_the_request_without_a_result(client: EngineClient):
    events = Events()
    h = client.submit(prompts()[0], SamplingParams(max_tokens=LONG), on_event=events)
    client.cancel(h)
    assert h.done.wait(120) and h.cancelled
    assert h.request.result is None and len(h.request.out) < LONG
    assert events.by_handle[id(h)][-1] == ([], True)


def test_a_cancel_that_comes_after_its_request_finished_changes_nothing(client: EngineClient):
    """A client that goes away as its request finishes cancels a request the engine process
    no longer holds: the process goes on serving, the next request gets its whole output."""
    done = client.submit(prompts()[2], SamplingParams(max_tokens=3))
    assert done.done.wait(120) and done.request.result is not None
    client.cancel(done)
    nxt = client.submit(prompts()[2], SamplingParams(max_tokens=3))
    assert nxt.done.wait(120) and nxt.request.result is not None
    assert nxt.request.result.token_ids == done.request.result.token_ids
    assert client.healthy()


def test_the_queue_bound_and_a_bad_request_are_refused_here(client: EngineClient):
    """More waiting requests than ``max_queue`` is a QueueFull at once; a request the engine
    cannot take is a ValueError before anything is sent."""
    with pytest.raises(ValueError, match="max_tokens|context"):
        client.submit([1, 2], SamplingParams(max_tokens=10 ** 6))
    first = [client.submit(prompts()[0], SamplingParams(max_tokens=4)) for _ in range(2)]
    with pytest.raises(QueueFull, match=r"^\d+ requests are waiting \(the most this server "
                                        r"queues\); retry shortly$"):
        client.submit(prompts()[0], SamplingParams(max_tokens=4))
    for h in first:
        assert h.done.wait(120) and h.request.result is not None


def test_an_engine_process_that_dies_ends_its_requests():
    """(With the smallest queue there is: one waiting request.)"""
    with pytest.raises(ValueError, match="max_queue"):
        EngineClient(tiny_engine, (1,), max_queue=0)
    c = EngineClient(tiny_engine, (1, LONG_LEN), max_queue=1, startup_timeout=300)
    try:
        events = Events()
        h = c.submit(prompts()[0], SamplingParams(max_tokens=LONG), on_event=events)
        c.process.kill()
        assert h.done.wait(60) and h.request.result is None
        assert events.by_handle[id(h)][-1] == ([], True)
        assert not c.healthy() and c.num_waiting == 0
        with pytest.raises(RuntimeError, match="engine process is gone"):
            c.submit(prompts()[0], SamplingParams(max_tokens=4))
    finally:
        c.stop()
    assert not c.process.is_alive()

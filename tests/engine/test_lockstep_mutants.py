"""The tensor-parallel lockstep scheduler (bole/engine/lockstep.py) in one process, over the
scripted engine (tests/server/scripted.py: no model) and an in-memory channel: what rank 0's
submissions and cancellations become (nothing until a step, then one broadcast of them, applied
in order), the seeds every rank samples alike with, the queue bound, a follower gone (every
request failed, nothing runs after), and a follower that replays rank 0's events and goes on past
a failed round. The channel itself over a one-rank gloo group. The two-process server is
tests/server/test_serve_tp.py."""

import logging
from dataclasses import replace
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

import bole.engine.lockstep as lockstep
from bole.engine.lockstep import Channel, LockstepScheduler, StepEvents, Submission
from bole.engine.request import SamplingParams
from bole.engine.scheduler import QueueFull
from tests.server.scripted import ScriptedEngine

PARAMS = SamplingParams(max_tokens=50, seed=11)


class Queue:
    """Rank 0's step events kept in order (``fail``: the next send raises as gloo does when a
    follower has closed its connection)."""

    def __init__(self):
        self.events, self.fail, self.closed = [], None, 0

    def send(self, events):
        if self.fail is not None:
            raise self.fail
        self.events.append(events)

    def recv(self):
        return self.events.pop(0)

    def close(self):
        self.closed += 1


def lead(max_slots=2, **kw):
    q = Queue()
    return LockstepScheduler(ScriptedEngine(max_slots=max_slots, round_s=0.0), q, **kw), q


def test_submissions_wait_in_the_inbox_until_a_step_broadcasts_them():
    s, q = lead()
    seen = []
    a = s.submit([5, 6], PARAMS, on_event=lambda h, new, final: seen.append((new, final)))
    b = s.submit((7,), replace(PARAMS, seed=3))
    assert (a.request.index, b.request.index) == (1, 2)
    assert s.num_waiting == 2 and not s.waiting and q.events == [] and not s.idle
    assert a.on_event is not None and a.request.prompt == [5, 6]
    assert s.step()
    (events,) = q.events
    assert events == StepEvents((Submission(1, [5, 6], PARAMS),
                                 Submission(2, [7], replace(PARAMS, seed=3))), ())
    assert type(events.submitted[1].prompt[0]) is int and events.stop is False
    assert [h.request.index for h in s.running] == [1, 2] and s.num_waiting == 0
    assert seen and seen[0][0]                                  # a's first token delivered
    s.cancel(b)
    assert not b.cancelled and not s.idle                       # at the next step boundary
    s.step()
    assert q.events[-1] == StepEvents((), (2,))
    assert b.cancelled and b.done.is_set() and b.result is None
    s.run_until_idle()
    assert a.result is not None and s.idle
    assert all(e == StepEvents() for e in q.events[2:])


def test_a_request_without_a_seed_gets_one_every_rank_uses(monkeypatch):
    s, q = lead()
    drawn = []
    monkeypatch.setattr(lockstep.random, "randrange", lambda n: drawn.append(n) or 1234)
    h = s.submit([1], replace(PARAMS, seed=None))
    assert drawn == [2 ** 63] and h.request.params.seed == 1234
    s.submit([1], PARAMS)                                       # a seed given is kept
    assert drawn == [2 ** 63]
    s.step()
    assert [sub.params.seed for sub in q.events[0].submitted] == [1234, 11]


def test_submit_checks_the_request_unless_told_and_bounds_the_queue():
    s, _ = lead(max_queue=2)
    too_long = [1] * 300                                        # past the engine's 256 tokens
    with pytest.raises(ValueError):
        s.submit(too_long, PARAMS)
    assert s.num_waiting == 0
    s.submit(too_long, PARAMS, checked=True)                    # the caller checked it
    s.submit([1], PARAMS)
    with pytest.raises(QueueFull) as e:
        s.submit([2], PARAMS)
    assert str(e.value) == "2 requests are waiting (the most this server queues); retry shortly"
    assert s.num_waiting == 2


def test_a_follower_gone_fails_every_request_and_the_server_stops_taking_them():
    s, q = lead(max_slots=1)
    finals = []
    on = lambda h, new, final: final and finals.append(h.request.index)  # noqa: E731
    running = s.submit([1], PARAMS, on_event=on)
    s.step()
    waiting = s.submit([2], PARAMS, on_event=on)
    s.step()                                                    # no slot: it waits
    assert [h.request.index for h in s.running] == [1] and len(s.waiting) == 1
    fresh = s.submit([3], PARAMS, on_event=on)
    s.cancel(running)
    q.fail = RuntimeError("Connection closed by peer")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        s.step()
    assert s.broken is q.fail and s.idle
    assert s.running == [] and not s.waiting and s._inbox == [] and s._cancels == []
    assert sorted(finals) == [1, 2, 3]
    assert all(h.done.is_set() for h in (running, waiting, fresh))
    with pytest.raises(RuntimeError) as e:
        s.submit([4], PARAMS)
    assert str(e.value) == ("the tensor-parallel ranks are gone (Connection closed by peer); "
                            "the server is stopping")
    s.close()
    assert q.closed == 1


def test_idle_counts_the_inbox_and_the_cancellations():
    s, _ = lead()
    assert s.idle
    h = s.submit([1], PARAMS)
    assert not s.idle
    s.step()
    s.run_until_idle()
    assert s.idle and h.result is not None
    s.cancel(h)                                                 # a late cancel is still news
    assert not s.idle
    s.step()
    assert s.idle


def test_a_follower_replays_the_events_and_survives_a_failed_round(caplog):
    events = Queue()
    follower = LockstepScheduler(ScriptedEngine(max_slots=2, round_s=0.0), events)
    engine = follower.engine
    events.events = [StepEvents((Submission(1, [5], PARAMS), Submission(2, [6], PARAMS)), ()),
                     StepEvents((), (2,)), StepEvents(), StepEvents(stop=True), StepEvents()]
    made = {}
    make = follower._request
    follower._request = lambda sub: made.setdefault(sub.serial, make(sub))
    real_step = engine.step
    calls = []

    def step(running, prelaunch=False):
        calls.append([r.index for r in running])
        if len(calls) == 2:
            raise RuntimeError("a round failed here")
        return real_step(running, prelaunch)
    engine.step = step
    with caplog.at_level(logging.ERROR, logger="bole.server"):
        follower.follow()
    assert events.events == [StepEvents()]                      # stopped at the stop event
    assert calls == [[1, 2], [1], [1]]                          # 2 cancelled, then a failure
    assert made[1].prompt == [5] and made[1].params == PARAMS and made[2].index == 2
    assert [r.getMessage() for r in caplog.records] == ["a round failed"]


def test_the_channel_over_one_gloo_rank(monkeypatch, caplog):
    import torch.distributed as dist
    from bole.distributed import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        ch = Channel(SimpleNamespace(rank=0))
        assert ch.rank == 0 and ch.closed is False and ch.group is not None
        # followers wait for the next step as long as the server idles (gloo's default: 30 min)
        assert dist.get_backend(ch.group) == "gloo"
        assert ch.group._get_backend(torch.device("cpu")).options._timeout == lockstep.IDLE_TIMEOUT
        assert lockstep.IDLE_TIMEOUT >= timedelta(days=1)
        ch.send(StepEvents(cancelled=(3,)))
        assert ch.recv() is None              # rank 0 is the source: its own box, unchanged
        box = []

        def record(objs, src=None, group=None):          # torch's defaults: rank 0, the world
            box.append((list(objs), 0 if src is None else src, group))
        monkeypatch.setattr(lockstep.dist, "broadcast_object_list", record)
        ch.send(StepEvents(cancelled=(4,)))
        assert box == [([StepEvents(cancelled=(4,))], 0, ch.group)]
        ch.close()
        ch.close()                                              # once
        assert ch.closed and box[1:] == [([StepEvents(stop=True)], 0, ch.group)]
        follower = Channel.__new__(Channel)
        follower.rank, follower.closed, follower.group = 1, False, ch.group
        with pytest.raises(RuntimeError) as e:
            follower.send(StepEvents())
        assert str(e.value) == "only rank 0 sends step events"
        follower.close()                                        # a follower sends nothing
        assert len(box) == 2 and follower.closed is False
        heard = []

        def deliver(objs, src=None, group=None):
            heard.append((0 if src is None else src, group))
            objs[0] = StepEvents(stop=True)
        monkeypatch.setattr(lockstep.dist, "broadcast_object_list", deliver)
        assert follower.recv() == StepEvents(stop=True)
        assert heard == [(0, ch.group)]                  # from rank 0, over the channel's group

        def gone(objs, src=None, group=None):
            raise RuntimeError("peer closed")
        monkeypatch.setattr(lockstep.dist, "broadcast_object_list", gone)
        other = Channel.__new__(Channel)
        other.rank, other.closed, other.group = 0, False, ch.group
        with caplog.at_level(logging.WARNING, logger="bole.server"):
            other.close()
        assert other.closed
        assert [r.getMessage() for r in caplog.records] == \
            ["could not stop the tensor-parallel followers: peer closed"]
    finally:
        dist.destroy_process_group()

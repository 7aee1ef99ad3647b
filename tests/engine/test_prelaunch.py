"""The next round's draft queued at the end of a round (RoundRunner.run's prelaunch): the tokens
are the same as drafting at the start of each round, greedy and sampled, also when the batch
changes under a queued draft (a request leaves or joins), and the queued draft is reused only
while the rows are unchanged."""

import time
from dataclasses import replace

import pytest
import torch

from bole.engine import Engine, SamplingParams, SpecConfig
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel

PROMPTS = [[5, 9, 17, 33, 2] * 3, [7, 7, 8, 9, 1, 2, 3], [100, 4], [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.fixture(scope="module")
def model():
    return HybridModel.random(preset_config("tiny"), dtype=torch.float32, mtp=True, seed=5,
                              gdn_backend="torch")


def drive(model, spec, prelaunch: bool, sampled: bool):
    """Rounds stepped by hand: requests 0-2 start, request 1 is cancelled after two rounds,
    request 3 joins after three; returns every request's tokens and the draft count."""
    engine = Engine(model, spec, max_slots=4, max_len=160)
    drafts = []
    real = engine.rounds._draft
    engine.rounds._draft = lambda b, d: (drafts.append(b.R), real(b, d))[1]
    params = SamplingParams(temperature=0.9, top_k=20, max_tokens=24) if sampled else \
        SamplingParams(temperature=0, max_tokens=24)
    reqs = [engine.new_request(i, p, replace(params, seed=i)) for i, p in enumerate(PROMPTS)]
    running = reqs[:3]
    for r in running:
        engine.admit(r)
    for step in range(60):
        if step == 2:                                   # a cancellation: the rows change
            engine.release(reqs[1])
            running = [reqs[0], reqs[2]]
        if step == 3:                                   # an arrival: the rows change again
            engine.admit(reqs[3])
            running = running + [reqs[3]]
        running = [r for r in running if r.result is None]
        if not running:
            break
        engine.step(running, prelaunch=prelaunch)
    assert all(r.result is not None for r in reqs if r is not reqs[1])
    return [r.out for r in reqs], len(drafts), engine


@pytest.mark.parametrize("mode", ["bole", "chain", "tree-serial"])
@pytest.mark.parametrize("sampled", [False, True])
def test_prelaunched_drafts_give_the_same_tokens(model, mode, sampled):
    spec = SpecConfig(mode, "mtp", depth=3, topk=2, budget=6)
    want, n_plain, _ = drive(model, spec, False, sampled)
    got, n_pre, engine = drive(model, spec, True, sampled)
    assert got == want
    assert n_plain == engine.timings.rounds        # one draft a round without the prelaunch
    # with it, the same count plus the two drafts queued for rows that then changed (the
    # cancellation, the arrival): every other queued draft was reused
    assert n_pre == n_plain + 2


def test_a_queued_draft_is_reused_only_for_the_same_rows(model):
    spec = SpecConfig("bole", "mtp", depth=3, topk=2, budget=6)
    engine = Engine(model, spec, max_slots=2, max_len=160)
    calls = []
    real = engine.rounds._draft
    engine.rounds._draft = lambda b, d: (calls.append(1), real(b, d))[1]
    r0, r1 = (engine.new_request(i, p, SamplingParams(max_tokens=30, seed=i))
              for i, p in enumerate(PROMPTS[:2]))
    engine.admit(r0)
    engine.step([r0], prelaunch=True)              # drafts, then queues the next draft
    assert len(calls) == 2 and engine.rounds._pending is not None
    engine.step([r0], prelaunch=True)              # reuses it, queues one more
    assert len(calls) == 3
    engine.admit(r1)
    engine.step([r0, r1], prelaunch=False)         # new rows (another bucket): drafts anew
    assert len(calls) == 4 and engine.rounds._pending is None
    near_end = engine.new_request(2, PROMPTS[2], SamplingParams(max_tokens=3, seed=2))
    engine.release(r1)
    engine.admit(near_end)
    engine.step([r0, near_end], prelaunch=True)    # near_end may finish: nothing is queued
    assert engine.rounds._pending is None


class FakeClock:
    """The round's clock (``bole.engine.round.time``): it stands still but where a test advances
    it; ``perf_counter`` reads it, anything else is the time module's."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name):
        return getattr(time, name)


#: what each phase takes on the fake clock (s): a draft, a verification, an acceptance
PHASES = {"_draft": 0.007, "_verify": 0.003, "_accept_commit": 0.002}


def test_a_queued_draft_counts_in_the_round_that_uses_it(model, monkeypatch):
    """The draft queued at the end of a round is the next round's draft time, and its time
    moves with it (on the CPU it runs inside the round that queues it): the rounds' total time
    stays the calls' wall time, so decode rates with and without the queue compare. The round's
    clock is a fake that only its phases advance (7, 3 and 2 ms), so the sums are exact."""
    from bole.engine import round as round_module
    clock = FakeClock()
    monkeypatch.setattr(round_module, "time", clock)
    spec = SpecConfig("bole", "mtp", depth=3, topk=2, budget=6)
    engine = Engine(model, spec, max_slots=1, max_len=200)
    for name, seconds in PHASES.items():
        real = getattr(engine.rounds, name)
        setattr(engine.rounds, name,
                lambda *a, real=real, s=seconds: (clock.advance(s), real(*a))[1])
    r = engine.new_request(0, PROMPTS[0], SamplingParams(max_tokens=60, seed=0))
    engine.admit(r)
    walls, timings = [], []
    for _ in range(4):
        t0 = clock.perf_counter()
        timings.append(engine.step([r], prelaunch=True))
        walls.append(1e3 * (clock.perf_counter() - t0))
    # the first call drafts at its start and queues the next draft; the others use the draft
    # queued before them and queue one more: each call ran one draft after its verification
    assert walls == pytest.approx([19, 12, 12, 12])
    # every round counts one draft (the first its own, the others the one queued for them),
    # one verification and one acceptance
    for t in timings:
        assert (t["draft"], t["verify"], t["accept_commit"]) == pytest.approx((7, 3, 2))
        assert t["total"] == pytest.approx(12) and t["host"] == pytest.approx(0, abs=1e-9)
    # what one round's total leaves out (the draft it queues), the next one's adds: the sum is
    # the calls' wall time less the draft the last call queued (no round has used it yet)
    (start, end), _, _ = engine.rounds._queued
    assert 1e3 * (end - start) == pytest.approx(PHASES["_draft"] * 1e3)
    assert timings[0]["total"] < walls[0]
    assert sum(t["total"] for t in timings) == pytest.approx(
        sum(walls) - 1e3 * (end - start))

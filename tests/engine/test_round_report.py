"""What a round tells the budget policy (RoundRunner._report): the goodput policy chooses plain
decoding or drafting, and the draft depth, from these numbers, so a wrong one changes the speed
a user gets (never the tokens). Checked against the definitions written out here: the rate is
tokens per request per ms of the round's wall time over the requests that could accept a whole
tree (every request in a plain round; in a drafting round those more than D tokens from their
limit), measured unless the round's time held a capture or no such request ran; a whole round
also reports each such request's accepted draft tokens (emitted - 1), its draft time and the rest
of its wall time (the hidden part of the draft not counted twice)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bole.engine.round import RoundPlan, RoundRunner


class Recorder:
    def __init__(self):
        self.calls = []

    def after_round(self, *args, **kwargs):
        self.calls.append(("after_round", args, kwargs))

    def after_whole(self, *args, **kwargs):
        self.calls.append(("after_whole", args, kwargs))


def report(kind, remaining, counts, timing, hidden=0.0, depth=3, unmeasured=False, D=3):
    policy = Recorder()
    runner = SimpleNamespace(policy=policy, D=D)
    requests = [SimpleNamespace(remaining=r) for r in remaining]
    plan = RoundPlan(requests, 4, kind, depth, 8, True, (), False, False, 0.0)
    RoundRunner._report(runner, plan, counts, dict(timing, plain=kind == "plain"), hidden, depth,
                        unmeasured)
    return policy.calls


TIMING = dict(draft=2.0, verify=5.0, accept_commit=1.5, host=0.75, total=10.0)


def test_a_drafting_round_reports_the_rate_of_its_full_tree_requests():
    # remaining 3 = D: that request drafted a shallower tree, its 1 token says nothing
    (call,) = report("select", [10, 3, 4], [4, 1, 2], TIMING)
    name, args, kwargs = call
    assert name == "after_round"
    assert args == (4, False, 2.0, 1.5, pytest.approx((4 + 2) / (2 * 10.0)))
    assert kwargs == dict(host_ms=0.75, measured=True)


def test_a_plain_round_counts_every_request():
    (call,) = report("plain", [10, 1], [1, 1], TIMING)
    assert call[1] == (4, True, 2.0, 1.5, pytest.approx(2 / (2 * 10.0)))
    assert call[2]["measured"] is True
    (call,) = report("plain", [10], [1], dict(TIMING, total=0.25))      # a sub-millisecond round
    assert call[1][4] == pytest.approx(1 / 0.25)


def test_a_round_without_full_trees_or_with_a_capture_is_not_averaged():
    (call,) = report("select", [2, 3], [1, 2], TIMING)
    assert call[1][4] == 0.0 and call[2]["measured"] is False
    (call,) = report("select", [10], [3], TIMING, unmeasured=True)
    assert call[1][4] == pytest.approx(3 / 10.0) and call[2]["measured"] is False


def test_a_whole_round_reports_accepted_draft_tokens_and_the_time_past_the_draft():
    calls = report("whole", [10, 9, 2], [4, 1, 2], TIMING, hidden=0.5, depth=2)
    assert [c[0] for c in calls] == ["after_round", "after_whole"]
    _, args, kwargs = calls[1]
    # the draft's hidden 0.5 ms ran outside the round's wall time: the rest is 10 - (2 - 0.5)
    assert args == (4, 2, [3, 0], 2.0, pytest.approx(8.5), True, 0.5) and kwargs == {}
    calls = report("whole", [10], [2], TIMING, unmeasured=True)
    assert calls[1][1][5] is False

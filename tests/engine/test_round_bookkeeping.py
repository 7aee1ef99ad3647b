"""What a round decides and tells the budget policy about its draft and its kept counts
(RoundRunner._start, RoundRunner._kept): the policy picks the next rounds' draft depth and verify
width from these, so a wrong one changes the speed a user gets (never the tokens). Checked
against the definitions written out here, with a policy that answers as told and records what it
hears:

- a draft queued by the last round is verified only when the rows are unchanged and the policy
  takes a draft of that depth for this round's bucket; the round's depth is then the queued one;
- a drafting round tells the policy its bucket, kind and the depth its trees have; a plain round
  tells nothing;
- a shared budget's drafting round hands the policy the kept counts of the requests more than D
  tokens from their limit (the others drafted shallower trees), whether a wider width could pay
  only when the device chose the width, and counts the draft nodes it verified past the roots;
  no shared budget, or a plain round: nothing is observed and no draft nodes are counted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bole.engine.round import RoundPlan, RoundRunner


class Policy:
    def __init__(self, shared=True, takes=()):
        self.shared, self.takes, self.calls = shared, set(takes), []

    def takes_draft(self, R, depth):
        return (R, depth) in self.takes

    def drafts(self, R, kind, depth):
        self.calls.append(("drafts", R, kind, depth))

    def observe(self, R, kept, kind="select", could_widen=None):
        self.calls.append(("observe", R, kept, kind, could_widen))


def plan(kind, requests=(), depth=3, width=8, chose=False, R=4):
    return RoundPlan(list(requests), R, kind, depth, width, False, (), chose, False, 0.0)


def start(kind, *, rewrote, pending_depth, takes, queued_draft=True):
    policy = Policy(takes=takes)
    b = SimpleNamespace(sampling=SimpleNamespace(all_greedy=True))
    marks = ((1.0, 2.0), 2.5, 3.0)
    runner = SimpleNamespace(policy=policy, _write_rows=lambda b_, requests: rewrote,
                             _queued=marks, _pending=b if queued_draft else None,
                             _pending_depth=pending_depth)
    out = RoundRunner._start(runner, plan(kind), b)
    assert out[0] == marks and runner._queued == () and runner._pending is None
    return out[1:], policy.calls


def test_a_queued_draft_of_a_depth_the_bucket_takes_is_verified_at_its_depth():
    (depth, drafted), calls = start("whole", rewrote=False, pending_depth=2, takes={(4, 2)})
    assert (depth, drafted) == (2, True)
    assert calls == [("drafts", 4, "whole", 2)]


def test_a_queued_draft_is_dropped_for_new_rows_or_a_depth_the_bucket_does_not_take():
    # the policy takes depth 2 for another bucket only: this round drafts its own depth
    (depth, drafted), calls = start("whole", rewrote=False, pending_depth=2, takes={(2, 2)})
    assert (depth, drafted) == (3, False) and calls == [("drafts", 4, "whole", 3)]
    (depth, drafted), calls = start("select", rewrote=True, pending_depth=2, takes={(4, 2)})
    assert (depth, drafted) == (3, False) and calls == [("drafts", 4, "select", 3)]
    (depth, drafted), calls = start("select", rewrote=False, pending_depth=2, takes={(4, 2)},
                                    queued_draft=False)
    assert (depth, drafted) == (3, False) and calls == [("drafts", 4, "select", 3)]


def test_a_plain_round_tells_the_policy_of_no_draft():
    _, calls = start("plain", rewrote=False, pending_depth=3, takes={(4, 3)})
    assert calls == []


def kept(kind, *, shared=True, chose=False, widen=True, D=3, width=8):
    policy = Policy(shared=shared)
    # remaining: 10 and 4 drafted whole trees (> D), 3 = D and 1 drafted shallower ones
    requests = [SimpleNamespace(remaining=r) for r in (10, 3, 4, 1)]
    b = SimpleNamespace(num_host=torch.tensor([4, 2, 3, 1, 0, 0, 0, 0]),
                        kept_host=torch.tensor([9, 3, 5, 1, 7, 7, 7, 7]),
                        widen_host=torch.tensor(widen))
    runner = SimpleNamespace(policy=policy, D=D)
    counts, draft_nodes = RoundRunner._kept(runner, plan(kind, requests, width=width,
                                                         chose=chose, R=8), b)
    assert counts == [4, 2, 3, 1]
    return draft_nodes, policy.calls


def test_a_select_round_hands_the_policy_the_whole_trees_kept_counts_and_its_choice():
    draft_nodes, calls = kept("select", chose=True, widen=True)
    assert calls == [("observe", 8, [9, 5], "select", True)]
    # past the roots, each row's count capped at the verify width: 7 + 2 + 4 + 0
    assert draft_nodes == 13
    _, calls = kept("select", chose=True, widen=False)
    assert calls == [("observe", 8, [9, 5], "select", False)]


def test_a_round_that_did_not_choose_its_width_says_nothing_of_widening():
    draft_nodes, calls = kept("select", chose=False, widen=True)
    assert calls == [("observe", 8, [9, 5], "select", None)]
    draft_nodes, calls = kept("whole", chose=False, widen=True, width=16)
    assert calls == [("observe", 8, [9, 5], "whole", None)] and draft_nodes == 8 + 2 + 4 + 0


def test_no_shared_budget_or_a_plain_round_observes_nothing():
    for kind, shared in (("select", False), ("whole", False), ("plain", True)):
        draft_nodes, calls = kept(kind, shared=shared)
        assert draft_nodes is None and calls == [], (kind, shared)


def test_the_next_draft_is_queued_only_where_no_request_can_finish_this_round():
    """A round of depth D emits at most D + 1 tokens: a request D + 1 tokens from its limit may
    finish in it (the batch changes and a queued draft would be dropped), one D + 2 away may
    not. Nor is a draft queued without a device drafter, after a plain round, or while goodput
    looks at plain decoding."""
    D = 3

    def may(remaining, plain=False, drafter=True, looking=False):
        runner = SimpleNamespace(D=D, device_drafter=object() if drafter else None,
                                 policy=SimpleNamespace(looking=looking))
        return RoundRunner._may_prelaunch(runner, [SimpleNamespace(remaining=r)
                                                   for r in remaining], plain)

    assert may([D + 2, 50]) is True
    assert may([D + 1, 50]) is False and may([50, D]) is False
    assert may([50], plain=True) is False
    assert may([50], drafter=False) is False
    assert may([50], looking=True) is False


def test_a_round_of_more_requests_than_slots_is_refused_with_both_counts():
    with pytest.raises(ValueError) as err:
        RoundRunner.plan(SimpleNamespace(max_slots=2), [object()] * 3)
    assert str(err.value) == "3 requests exceed the engine's 2 slots"

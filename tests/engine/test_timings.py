"""RoundTimings (bole/engine/timings.py) summed over rounds and summarised, against values written
out: every field a round adds to, the per-batch, per-node-count and per-depth tables, the
summary the benchmarks print, and the split of a run's time."""

import pytest

from bole.engine.timings import RoundTimings


def _round(total, **kw):
    return dict(draft=kw.pop("draft", 0.0), verify=kw.pop("verify", 0.0),
                accept_commit=kw.pop("accept_commit", 0.0), host=kw.pop("host", 0.0),
                total=total, syncs=kw.pop("syncs", 1), **kw)


def test_rounds_add_every_field_and_table():
    t = RoundTimings()
    t.add(_round(4.0, draft=1.0, verify=2.0, accept_commit=0.5, host=0.5, syncs=2, plain=True,
                 requests=2, tokens=3))
    t.add(_round(6.0, draft=2.0, verify=3.0, accept_commit=0.25, host=0.75, draft_nodes=6,
                 kind="whole", depth=3, requests=2, tokens=5))
    t.add(_round(2.0, draft_nodes=0, depth=0))                 # counted, though zero
    t.add(_round(8.0, draft_nodes=6, depth=3, requests=4, tokens=9, plain=False))
    t.add(_round(4.0, draft_nodes=6, depth=3, kind="whole"))
    assert (t.rounds, t.draft, t.verify, t.accept_commit, t.host, t.total, t.syncs) == \
        (5, 3.0, 5.0, 0.75, 1.25, 24.0, 6)
    assert t.plain_rounds == 1
    assert (t.draft_nodes, t.budget_rounds) == (18, 4)
    assert t.by_nodes == {("whole", 6): 2, ("select", 0): 1, ("select", 6): 1}
    assert t.by_depth == {3: 3, 0: 1}
    assert t.by_batch == {2: [2, 8, 10.0], 4: [1, 9, 8.0]}
    assert t.full_batch_rate() == (pytest.approx(9 / 0.008), 1)
    assert t.summary() == dict(
        round_ms=4.8, draft_ms=0.6, verify_ms=1.0, accept_commit_ms=0.15, host_ms=0.25,
        syncs_per_round=1.2, gpu_idle_share=1.25 / 24.0, plain_round_share=0.2,
        draft_nodes_per_round=4.5)


def test_a_round_without_a_budget_or_a_depth_adds_to_no_table():
    t = RoundTimings()
    t.add(_round(0.5, draft=0.125, verify=0.25, host=0.0625, draft_nodes=None, depth=None))
    assert (t.rounds, t.total, t.draft_nodes, t.budget_rounds, t.plain_rounds) == (1, 0.5, 0, 0, 0)
    assert t.by_nodes == {} and t.by_depth == {} and t.by_batch == {}
    assert t.full_batch_rate() is None
    assert t.summary() == dict(round_ms=0.5, draft_ms=0.125, verify_ms=0.25, accept_commit_ms=0.0,
                               host_ms=0.0625, syncs_per_round=1.0, gpu_idle_share=0.125,
                               plain_round_share=0.0, draft_nodes_per_round=None)


def test_summary_and_split_before_any_round():
    t = RoundTimings()
    assert t.summary() == dict(round_ms=0.0, draft_ms=0.0, verify_ms=0.0, accept_commit_ms=0.0,
                               host_ms=0.0, syncs_per_round=0.0, gpu_idle_share=0.0,
                               plain_round_share=0.0, draft_nodes_per_round=None)
    rate, outside = t.decode_split(0, 2.5)
    assert rate == 0.0 and outside == 2.5


def test_decode_split_and_rates_of_instant_rounds():
    t = RoundTimings()
    t.add(_round(250.0, requests=1, tokens=10))
    t.add(_round(750.0, requests=1, tokens=30))
    rate, outside = t.decode_split(40, 1.5)
    assert rate == pytest.approx(40.0) and outside == pytest.approx(0.5)
    assert t.decode_split(40, 0.5) == (pytest.approx(40.0), 0.0)   # never negative
    zero = RoundTimings()
    zero.add(_round(0.0, requests=2, tokens=2))                    # a round under the clock's tick
    assert zero.full_batch_rate() == (pytest.approx(2e9), 1)
    assert zero.decode_split(2, 0.0) == (pytest.approx(2e9), 0.0)
    assert zero.summary()["gpu_idle_share"] == 0.0

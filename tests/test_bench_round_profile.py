"""bench/round_profile.py's live hook: one replay per graph key of the batch's bucket, after
``skip`` of them, goes through the profiling function; every call still runs and returns."""

from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_live_profiler_takes_one_replay_per_key_after_skip(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    rp = load_script("bench/round_profile.py")

    class Graphs:
        def __init__(self):
            self.ran = []

        def run(self, key, fn):
            self.ran.append(key)
            return fn()

    profiled = []

    def fake_kernels(fn):
        profiled.append(len(graphs.ran))
        return fn(), [("k", 0.0, 2.0), ("k", 3.0, 1.0)]
    graphs = Graphs()
    live = rp.LiveProfiler(graphs, batch=8, skip=2, kernels_fn=fake_kernels)
    keys = [("draft", 8), ("verify", 8, 16, "whole"), ("accept", 8, 16), ("draft", 4),
            ("prefill", 8, 64)]
    for _ in range(4):
        for k in keys:
            assert graphs.run(k, lambda k=k: k) == k
    assert len(graphs.ran) == 20                     # every call ran
    assert set(live.kernels) == set(keys[:3])        # other buckets and phases pass through
    assert profiled == [10, 11, 12]                  # the third replay of each: after skip=2
    s = rp.summarise(keys[0], live.kernels[keys[0]])
    assert s["kernels"] == 2 and s["kernel_ms"] == 0.003 and s["span_ms"] == 0.004
    assert abs(s["idle_ms"] - 0.001) < 1e-12 and s["by_name"][0]["count"] == 2

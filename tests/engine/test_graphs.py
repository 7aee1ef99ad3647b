"""GraphRunner (bole/engine/graphs.py) on the CPU: graphs are off whatever is asked, every run is
eager and not counted as a fallback, and capture refuses. The bookkeeping of replays and counted
fallbacks, which the engine reports, is checked with a stand-in graph; capture itself needs CUDA
(tests/test_round_cuda.py)."""

import logging

import pytest
import torch

from bole.engine.graphs import GraphRunner

STATS = dict(graph_replays=0, eager_fallbacks=0, captures=0, capture_s=0.0)


@pytest.mark.parametrize("enabled", [True, False])
def test_on_the_cpu_every_run_is_eager_and_nothing_is_captured(enabled, caplog):
    g = GraphRunner("cpu", enabled=enabled)
    assert g.device == torch.device("cpu") and g.enabled is False and g.pool is None
    assert g.graphs == {} and g.results == {} and g.stats == STATS
    calls = []
    with caplog.at_level(logging.WARNING, logger="bole.graphs"):
        assert g.run("k", lambda: calls.append(1) or "out") == "out"
        assert g.run("k", lambda: calls.append(2) or "again") == "again"
    assert calls == [1, 2] and not g.has("k") and g.stats == STATS and not caplog.records
    with pytest.raises(RuntimeError) as e:
        g.capture("k", lambda: None)
    assert str(e.value) == "CUDA graphs are off (CPU or disabled): nothing to capture"
    assert g.graphs == {} and g.stats == STATS


def test_the_default_is_on_where_there_is_cuda():
    assert GraphRunner("cpu").enabled is False
    if torch.cuda.is_available():
        assert GraphRunner("cuda").enabled is True
        assert GraphRunner("cuda", enabled=False).enabled is False


class _Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_a_captured_key_replays_and_returns_its_capture_result_and_others_fall_back(caplog):
    """With graphs on, a key with a graph replays it (the function is not called) and returns
    what its capture returned; a key without one runs eagerly, counted and logged."""
    g = GraphRunner("cpu")
    g.enabled = True                               # as on a GPU: only the bookkeeping runs here
    graph, kept = _Graph(), torch.zeros(2)
    g.graphs[(4, "x")], g.results[(4, "x")] = graph, kept
    assert g.has((4, "x")) and not g.has((8, "x"))
    called = []
    for _ in range(3):
        assert g.run((4, "x"), lambda: called.append("eager")) is kept
    assert graph.replays == 3 and called == []
    with caplog.at_level(logging.WARNING, logger="bole.graphs"):
        assert g.run((8, "x"), lambda: called.append("eager") or 7) == 7
        assert g.run("y", lambda: called.append("eager") or 8) == 8
    assert called == ["eager", "eager"]
    assert g.stats == dict(STATS, graph_replays=3, eager_fallbacks=2)
    assert [r.getMessage() for r in caplog.records] == [
        "no CUDA graph for (8, 'x'): running eagerly", "no CUDA graph for y: running eagerly"]


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@cuda_only
@pytest.mark.parametrize("warmup", [0, 2])
def test_capture_warms_up_traces_once_and_each_run_replays(warmup, caplog):
    """On a GPU: capture calls the function ``warmup`` times on a side stream (run) and once
    under capture (traced, not run), keeps the graph and what the traced call returned, and
    counts it; each run replays the graph (the device counter moves, the Python one does not),
    in the runner's one memory pool; a key without a graph runs eagerly, counted and logged."""
    g = GraphRunner("cuda")
    assert g.enabled and g.pool is not None
    count, calls = torch.zeros((), dtype=torch.int64, device="cuda"), []

    def fn():
        calls.append(1)
        count.add_(1)
        return count * 10
    out = g.capture("k", fn, warmup=warmup)
    torch.cuda.synchronize()
    assert len(calls) == warmup + 1 and int(count) == warmup
    assert g.has("k") and g.results["k"] is out and set(g.graphs) == {"k"}
    assert g.graphs["k"].pool() == g.pool
    assert g.stats["captures"] == 1 and g.stats["capture_s"] > 0
    assert g.stats["graph_replays"] == 0 and g.stats["eager_fallbacks"] == 0
    for i in range(1, 4):
        assert g.run("k", lambda: pytest.fail("a captured key ran eagerly")) is out
        torch.cuda.synchronize()
        assert int(count) == warmup + i and int(out) == 10 * (warmup + i)
    assert len(calls) == warmup + 1 and g.stats["graph_replays"] == 3
    g.capture("j", lambda: count.add_(100), warmup=1)
    assert g.graphs["j"].pool() == g.pool and g.stats["captures"] == 2
    with caplog.at_level(logging.WARNING, logger="bole.graphs"):
        assert g.run("other", lambda: "eager") == "eager"
    assert g.stats["eager_fallbacks"] == 1 and g.stats["graph_replays"] == 3
    assert [r.getMessage() for r in caplog.records] == ["no CUDA graph for other: running eagerly"]

"""Budget calibration (bole/engine/calibrate.py) on the CPU, without timing anything: what each
timed function runs (the decode and verify forwards of ``b`` requests at the context, the nodes
spread over the rows at their width bucket; the selection over ``b`` whole trees), the median of
wall times on a set clock, the grid and arguments ``calibrate_model`` measures with and its
progress bar, and when ``load_or_calibrate`` takes a saved profile or calibrates again (each
message whole). The real measurement runs in tests/engine/test_budget_policy.py."""

import math
from types import SimpleNamespace

import pytest
import torch

import bole.engine.calibrate as cal
from bole.engine.buckets import buckets_upto
from bole.engine.runner import ModelRunner
from bole.engine.spec import SpecConfig
from bole.models.presets import preset_config
from bole.models.qwen3_hybrid import HybridModel
from bole.speculative.budget.profile import (ProfileFormatError, config_hash, gpu_name,
                                             runtime_versions)
from bole.speculative.budget.widths import spread_width, width_buckets

SPEC = SpecConfig("bole", "mtp", depth=3, topk=2, budget=8)      # 8 node slots a tree


@pytest.fixture(scope="module")
def model():
    return HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3,
                              gdn_backend="torch")


def test_captured_ms_is_the_median_of_timed_calls_after_a_warm_up(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(cal, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    steps = iter([0.5, 0.005, 0.001, 0.003, 0.1, 0.002])      # the first call is the warm-up

    def fn():
        clock[0] += next(steps)
    assert cal.captured_ms(fn, torch.device("cpu"), 5) == pytest.approx(3.0)
    assert next(steps, None) is None                            # reps + 1 calls
    steps = iter([9.0, 0.004, 0.001, 0.002, 0.010])
    assert cal.captured_ms(fn, torch.device("cpu"), 4) == pytest.approx(3.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_captured_ms_on_a_gpu_replays_one_graph_reps_times():
    """On a GPU: one eager warm-up, one call on a side stream, one capture (traced, not run),
    then ``reps`` replays, each timed by its own pair of events. A counter the function bumps
    on the device says how often it ran; the Python counter how often it was called."""
    device = torch.device("cuda")
    count, calls = torch.zeros((), dtype=torch.int64, device=device), []

    def fn():
        calls.append(1)
        count.add_(1)
    ms = cal.captured_ms(fn, device, 5)
    torch.cuda.synchronize()
    assert len(calls) == 3 and int(count) == 2 + 5
    assert math.isfinite(ms) and ms > 0
    assert int(count) == 7 and cal.captured_ms(fn, device, 1) > 0 and int(count) == 10


def _timed_batches(monkeypatch, reps_seen):
    """Each timed function called once (no clock); the forwards' batches recorded."""
    seen = []

    def once(fn, device, reps):
        reps_seen.append((device, reps))
        fn()
        return 1.5
    monkeypatch.setattr(cal, "captured_ms", once)
    forward = ModelRunner.forward

    def recording(self, batch, **kw):
        seen.append((self, batch))
        return forward(self, batch, **kw)
    monkeypatch.setattr(ModelRunner, "forward", recording)
    return seen


def test_forward_time_fn_times_decode_and_verify_forwards_at_the_context(model, monkeypatch):
    reps = []
    seen = _timed_batches(monkeypatch, reps)
    T, context = SPEC.nodes_per_request, 12
    time_fn = cal.forward_time_fn(model, SPEC, 4, context=context, reps=3, seed=1)
    assert seen == [] and reps == []
    runner = None
    for b, n in ((1, 0), (3, 0), (4, 0), (1, 5), (3, 7), (4, 28), (2, 1)):
        assert time_fn(b, n) == 1.5
        assert reps[-1] == (model.device, 3)
        runner, batch = seen[-1]
        R = batch.forest.parents.shape[0]
        W = batch.nodes_per_request
        assert R == b and batch.slots.tolist() == list(range(b))
        assert batch.ctx_lens.tolist() == [context] * b         # every slot holds the context
        assert batch.tokens.shape == (b * W,)
        assert int(batch.tokens.min()) >= 0 and int(batch.tokens.max()) < model.config.vocab_size
        if n == 0:                                              # ar's in-place decode step
            assert batch.backend == "torch-decode" and W == 1
            continue
        assert batch.backend == "torch"
        per_row = math.ceil(n / b)
        assert W == spread_width(b, n, T)
        nodes = batch.forest.valid.sum(dim=1).tolist()
        assert nodes == [min(W, per_row + 1)] * b, (b, n)       # a root and its share
        assert int(batch.forest.depth.max()) <= min(SPEC.depth, per_row)
    cache = runner.cache
    assert cache.max_len == context + T + 2 and cache.num_free == 0
    assert [cache.host_lengths[s] for s in range(4)] == [context] * 4
    assert torch.equal(cache.k[:, 1, :context], cache.k[:, 0, :context])


def test_selection_time_fn_selects_over_whole_random_trees(monkeypatch):
    from bole.speculative.budget import round_select
    reps, calls = [], []
    monkeypatch.setattr(cal, "captured_ms",
                        lambda fn, device, r: (reps.append((device, r)), fn(), 2.5)[2])

    def recording(*args, **kw):
        calls.append((args, kw))
        return round_select.select(*args, **kw)
    monkeypatch.setattr(cal, "select", recording)
    T, D = SPEC.nodes_per_request, SPEC.depth
    select_fn = cal.selection_time_fn(SPEC, torch.device("cpu"), reps=4, seed=2)
    for b in (1, 3):
        assert select_fn(b) == 2.5 and reps[-1] == (torch.device("cpu"), 4)
        (rho, tokens, parents, valid, budget, active, floor, width, depth), kw = calls[-1]
        assert rho.shape == tokens.shape == parents.shape == valid.shape == (b, T)
        assert rho.dtype == torch.float64 and tokens.dtype == torch.int64
        assert valid.all()                                      # whole trees of T nodes
        assert (parents[:, 0] == -1).all() and (parents[:, 1:] >= 0).all()
        assert rho[:, 0].tolist() == [1.0] * b
        assert ((rho[:, 1:] > 0) & (rho[:, 1:] < 1)).all()
        assert not tokens.any() and budget.shape == () and int(budget) == 0
        assert active.dtype == torch.bool and active.tolist() == [True] * b
        assert (floor, width, depth) == (SPEC.root_floor, T, D)
        assert kw["goodput"].widths.tolist() == list(width_buckets(T))
        assert kw["goodput"].t_ver.tolist() == [1.0] * len(width_buckets(T))
        assert kw["acceptance"] is not None


class _Saved:
    def __init__(self, path):
        self.path = path

    def save(self):
        return self.path


def test_calibrate_model_grid_arguments_and_progress(model, monkeypatch, tmp_path, capsys):
    got = {}

    def fake_calibrate(time_fn, batches, grid, eps, **kw):
        got.update(time_fn=time_fn, batches=batches, grid=grid, eps=eps, **kw)
        kw["progress"](3, 10)
        kw["progress"](10, 10)
        return _Saved(tmp_path / "budget.json")
    monkeypatch.setattr(cal, "calibrate", fake_calibrate)
    monkeypatch.setattr(cal, "plot_profile", lambda p, path: got.update(plot=(p, path)))
    made = {}
    monkeypatch.setattr(cal, "forward_time_fn", lambda m, spec, b, **kw: made.update(
        forward=(m, spec, b, kw)) or "time_fn")
    monkeypatch.setattr(cal, "selection_time_fn", lambda spec, device, **kw: made.update(
        select=(spec, device, kw)) or "select_fn")
    monkeypatch.setattr(cal, "time", SimpleNamespace(perf_counter=lambda: 100.0))
    profile = cal.calibrate_model(model, SPEC, [2, 1, 2], node_grid=(1, 2, 4, 8, 14, 16, 32),
                                  eps=0.25, context=20, reps=3)
    assert got["time_fn"] == "time_fn"
    assert profile.path == tmp_path / "budget.json"
    assert got["batches"] == [1, 2] and got["grid"] == [1, 2, 4, 8, 14]   # up to 2 x 7 nodes
    assert got["eps"] == 0.25 and got["tree_nodes"] == 8
    assert got["gpu"] == gpu_name(model.device) and got["config_hash"] == config_hash(model.config)
    assert got["dtype"] == model.dtype and got["versions"] == runtime_versions()
    assert got["model"] == "hidden 64, 4 layers" and got["select_fn"] == "select_fn"
    assert got["plot"] == (profile, tmp_path / "budget.png")
    assert made["forward"] == (model, SPEC, 2, dict(context=20, reps=3))
    assert made["select"] == (SPEC, model.device, dict(reps=3))
    err = capsys.readouterr().err
    bar = ("\r[bole] calibrating [" + "#" * 9 + "." * 21 + "] 3/10"
           "\r[bole] calibrating [" + "#" * 30 + "] 10/10\n")
    assert err.startswith(bar)
    assert err[len(bar):] == f"[bole] calibrated in 0 s: {profile.path}\n"
    cal.calibrate_model(model, SPEC, [3], node_grid=(1, 21, 30), progress=False)
    assert got["grid"] == [1, 21] and got["batches"] == [3] and got["eps"] == 0.1
    # what an engine's first use measures: a 1024-token context, the median of 10 replays
    assert made["forward"] == (model, SPEC, 3, dict(context=1024, reps=10))
    assert made["select"] == (SPEC, model.device, dict(reps=10))
    assert capsys.readouterr().err == ""


def _profile(batches, grid):
    return SimpleNamespace(batches=batches, node_grid=grid)


@pytest.mark.parametrize("found, fresh, message", [
    (_profile([1, 2, 4], [1, 64]), False, ""),
    (_profile([1, 2, 3], [1, 21]), False, ""),                  # covers exactly: taken
    (None, True, "[bole] no verification-budget profile for this GPU, model, dtype, versions and "
                 "tree size (8 nodes): calibrating now (bole calibrate does it ahead of time)\n"),
    (_profile([1, 2], [1, 64]), True,
     "[bole] the saved verification-budget profile reaches batch 2 and 64 draft nodes; this "
     "engine needs batch 3 and 21: calibrating again\n"),
    (_profile([1, 2, 4], [1, 20]), True,
     "[bole] the saved verification-budget profile reaches batch 4 and 20 draft nodes; this "
     "engine needs batch 3 and 21: calibrating again\n"),
    (ProfileFormatError("the profile is of format 1"), True,
     "[bole] the profile is of format 1: calibrating now\n"),
])
def test_load_or_calibrate_takes_a_profile_that_covers_the_engine(model, monkeypatch, capsys,
                                                                   found, fresh, message):
    """An engine of 3 slots with trees of 8 nodes needs a profile up to batch 3 and 3 x 7 draft
    nodes; anything less, none, or one of an older format is calibrated again, saying why."""
    keys, runs = [], []

    def find(*key):
        keys.append(key)
        if isinstance(found, Exception):
            raise found
        return found
    monkeypatch.setattr(cal, "find_profile", find)
    monkeypatch.setattr(cal, "calibrate_model",
                        lambda m, spec, b: runs.append((m, spec, b)) or "new")
    assert SPEC.nodes_per_request == 8
    got = cal.load_or_calibrate(model, SPEC, 3)
    assert keys == [(gpu_name(model.device), config_hash(model.config), model.dtype,
                     runtime_versions(), 8)]
    err = capsys.readouterr().err
    if not fresh:
        assert got is found and runs == [] and err == ""
    else:
        assert got == "new" and runs == [(model, SPEC, buckets_upto(3))] and err == message

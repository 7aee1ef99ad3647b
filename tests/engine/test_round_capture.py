"""What the round captures at start-up and how its rounds replay, on the CPU with stand-in graphs
(tests/engine/graph_standin.py: a replay reruns the function into the captured outputs, as a
CUDA graph rewrites them). Every variant the budget policy can run has its draft, verify and
accept graphs before the first round, plus the acceptance refit and the admission prefills;
captures run on the cache's dummy slot only; replayed rounds equal eager ones token for token,
and a sampling variant first met mid-run is captured then, once. On a GPU,
tests/test_round_cuda.py runs the same with real graphs."""

import logging
import re
import time

import pytest
import torch

import bole.engine.round as round_module
from bole.engine import Engine, SamplingParams, SpecConfig
from bole.engine.buckets import buckets_upto
from bole.engine.buffers import StaticSampling
from bole.engine.runner import PREFILL_BATCH_ROWS
from tests.engine.graph_standin import StandInGraphs
from tests.engine.test_budget_policy import PROMPTS, _knee_profile, _profile, model  # noqa: F401

SPECS = {
    "ar": (SpecConfig("ar"), None),
    "bole": (SpecConfig("bole", "mtp", depth=3, topk=2, budget=6), None),
    "tree-serial": (SpecConfig("tree-serial", "mtp", depth=3, topk=2, budget=6), None),
    "chain": (SpecConfig("chain", "mtp", depth=3, topk=2, budget=6), None),
    "ngram": (SpecConfig("bole", "ngram", depth=3, topk=2, budget=6), None),
    "global": (SpecConfig("bole", "mtp", depth=3, topk=2, budget=6, budget_policy="global",
                          shared_budget=8), None),
    "goodput": (SpecConfig("bole", "mtp", depth=3, topk=2, budget=6, budget_policy="goodput"),
                _profile(1000.0, T=6)),
}
MAX_SLOTS, MAX_LEN = 3, 80


@pytest.fixture
def standin(monkeypatch):
    """Engines built in the test get stand-in graphs (on where cuda_graphs is asked)."""
    made = []

    def graphs(device, enabled=True):
        made.append(StandInGraphs(device, enabled))
        return made[-1]
    monkeypatch.setattr(round_module, "GraphRunner", graphs)
    return made


def _engine(model, name, graphs=True, max_slots=MAX_SLOTS, **kw):
    spec, profile = SPECS[name]
    return Engine(model, spec, max_slots=max_slots, max_len=MAX_LEN, cuda_graphs=graphs,
                  budget_profile=profile, **kw)


def _expected_keys(rounds, max_slots=MAX_SLOTS) -> list:
    """Every graph a round or admission of these buckets can replay, per the policy (computed
    here from the policy, the drafter and the prefill widths, not from the capture code)."""
    keys = []
    greedy = StaticSampling.flags_for([])
    for R in sorted(set(buckets_upto(max_slots)), reverse=True):
        for kind, W, learn in rounds.policy.variants(R):
            if rounds.device_drafter is not None:
                keys += [("draft", R, d) for d in rounds.policy.draft_depths()]
            keys += [("verify", R, W, kind), ("accept", R, W, kind, greedy, learn)]
        if rounds.calibrator is not None:
            keys.append(("fit",))
        if R <= PREFILL_BATCH_ROWS:
            keys += [("prefill", R, T) for T in rounds.prefill_widths()]
    return list(dict.fromkeys(keys))                   # each once, in first-needed order


@pytest.mark.parametrize("name", list(SPECS))
def test_start_up_captures_every_variant_of_every_bucket_largest_first(model, standin, name):  # noqa: F811
    engine = _engine(model, name)
    g = engine.rounds.graphs
    assert g is standin[-1] and g.enabled
    want = _expected_keys(engine.rounds)
    assert g.captured == want
    assert g.warmups == [2] * len(want) and g.stats["captures"] == len(want)
    # each variant's verify forward replays once before its acceptance is captured (the
    # acceptance's warm-up reads real values of the dummy rows)
    assert g.replayed == [("verify", R, W, kind) for R in sorted(engine.rounds.buffers)[::-1]
                          for kind, W, _ in engine.rounds.policy.variants(R)]
    # captures ran on the dummy slot only: every request slot is still empty
    cache = engine.cache
    free = [s for s in range(cache.lengths.numel()) if s != cache.dummy_slot]
    assert cache.lengths[free].tolist() == [0] * len(free)
    assert all(b.rows == () for b in engine.rounds.buffers.values())
    # each verify graph verifies its width's node slots a row
    for key in (k for k in want if k[0] == "verify"):
        assert tuple(g.results[key][2].shape) == key[1:3], key


def test_admission_prefills_are_captured_up_to_their_largest_batch(model, standin):  # noqa: F811
    """Batched admission takes at most PREFILL_BATCH_ROWS prompts: buckets up to that one get
    prefill graphs, larger ones none."""
    engine = _engine(model, "ar", max_slots=2 * PREFILL_BATCH_ROWS)
    captured = engine.rounds.graphs.captured
    assert captured == _expected_keys(engine.rounds, 2 * PREFILL_BATCH_ROWS)
    prefilled = {k[1] for k in captured if k[0] == "prefill"}
    assert PREFILL_BATCH_ROWS in prefilled and max(prefilled) == PREFILL_BATCH_ROWS


def test_without_graphs_nothing_is_captured(model, standin):  # noqa: F811
    engine = _engine(model, "bole", graphs=False)
    assert not engine.rounds.graphs.enabled and engine.rounds.graphs.captured == []


def test_start_up_reports_its_progress(model, standin, capsys):  # noqa: F811
    """One line on stderr rewritten per bucket, largest first, then the count and the time."""
    t0 = time.perf_counter()
    engine = _engine(model, "bole", progress=True)
    wall = time.perf_counter() - t0
    err = capsys.readouterr().err
    buckets = sorted(set(buckets_upto(MAX_SLOTS)), reverse=True)
    lines = "".join(f"\r[bole] capturing CUDA graphs: batch {R} ({i + 1}/{len(buckets)})"
                    for i, R in enumerate(buckets))
    done = re.fullmatch(re.escape(lines) + r"\r\[bole\] captured (\d+) CUDA graphs for batches "
                        r"up to (\d+) in (\d+\.\d) s\n", err)
    assert done, err
    assert int(done[1]) == len(engine.rounds.graphs.graphs) and int(done[2]) == max(buckets)
    assert 0 <= float(done[3]) <= wall + 0.05         # the capture's time, within the call's


@pytest.mark.parametrize("name", list(SPECS))
def test_replayed_rounds_equal_eager_rounds(model, standin, name):  # noqa: F811
    """Greedy: the same tokens with graphs as without, every round phase replayed (none run
    eagerly) and nothing captured after start-up."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = [r.token_ids for r in _engine(model, name, graphs=False).generate(PROMPTS, params)]
    engine = _engine(model, name)
    g = engine.rounds.graphs
    before = list(g.captured)
    g.replayed.clear()
    got = [r.token_ids for r in engine.generate(PROMPTS, params)]
    assert got == want
    assert g.captured == before and g.stats["eager_fallbacks"] == 0
    assert {k[0] for k in g.replayed} >= {"verify", "accept"}
    assert g.stats["graph_replays"] == len(g.replayed)        # each through run()

def test_a_sampling_variant_met_mid_run_is_captured_once_and_logged(model, standin, caplog):  # noqa: F811
    """Sampled rows need another acceptance: its graphs are captured at the first round that
    needs them (logged: the round pays for it) and replayed after; the tokens are the eager
    engine's for the same seeds."""
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, ignore_eos=True)
    want = [r.token_ids for r in
            _engine(model, "bole", graphs=False).generate(PROMPTS, params, seed=5)]
    engine = _engine(model, "bole")
    g = engine.rounds.graphs
    before = set(g.captured)
    with caplog.at_level(logging.INFO, logger="bole.round"):
        got = [r.token_ids for r in engine.generate(PROMPTS, params, seed=5)]
    assert got == want
    new = [k for k in g.captured if k not in before]
    flags, greedy = StaticSampling.flags_for([params]), StaticSampling.flags_for([])
    assert new and all(k[0] == "accept" and k[4] == flags for k in new)
    assert all((*k[:4], greedy, k[5]) in before for k in new)     # the same rounds, sampled
    assert [r.getMessage() for r in caplog.records if "capturing" in r.getMessage()] == [
        f"capturing the {k[3]} round for batch {k[1]}, width {k[2]}, sampling variant {flags}"
        for k in new]
    assert g.stats["eager_fallbacks"] == 0


def test_replayed_goodput_rounds_learn_acceptance(model, standin):  # noqa: F811
    """Goodput's learning rounds count their verified draft nodes into the acceptance map from
    the replayed graphs too (the hits are the drafted tokens that were emitted), and the
    start-up's captures, on padding rows, count nothing."""
    from bole.models.qwen3_hybrid import HybridModel
    fresh = HybridModel(model.config, dict(model.w), gdn_backend="torch")   # nothing learnt
    spec, _ = SPECS["goodput"]
    engine = Engine(fresh, spec, max_slots=MAX_SLOTS, max_len=MAX_LEN, cuda_graphs=True,
                    budget_profile=_knee_profile(6))          # every round selects and learns
    calib = engine.rounds.calibrator
    hits, count = float(calib.hits.sum()), float(calib.count.sum())
    assert hits == count == 0.0                      # the captures' padding rows learn nothing
    res = engine.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    accepted = sum(n - 1 for r in res for n in r.accepted)
    assert float(calib.hits.sum()) - hits == accepted > 0
    assert float(calib.count.sum()) - count > accepted       # some drafted nodes were rejected
    assert engine.rounds.graphs.stats["eager_fallbacks"] == 0


def test_a_model_whose_forward_syncs_the_host_is_not_captured(model, standin, caplog):  # noqa: F811
    """The torch loop over the experts syncs the host, so an MoE model on it is never captured,
    whatever is asked; the warning that its rounds run eagerly is for a GPU (on the CPU every
    round runs eagerly anyway), and a graph-safe model asks for nothing."""
    from bole.models.presets import preset_config
    from bole.models.qwen3_hybrid import HybridModel
    moe = HybridModel.random(preset_config("tiny-moe"), dtype=torch.float32, seed=1,
                             gdn_backend="torch")
    assert not moe.graph_safe and model.graph_safe
    with caplog.at_level(logging.WARNING):
        eager = Engine(moe, SpecConfig("bole", "ngram", depth=3, topk=2, budget=6), max_slots=2,
                       max_len=MAX_LEN, cuda_graphs=True)
        captured = _engine(model, "bole")
    assert not eager.rounds.graphs.enabled and eager.rounds.graphs.captured == []
    assert captured.rounds.graphs.enabled and captured.rounds.graphs.captured
    assert [r.getMessage() for r in caplog.records] == []

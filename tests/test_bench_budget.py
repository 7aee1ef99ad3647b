"""bench/budget.py runs end to end on a tiny preset (CPU smoke run): every policy's record at
every batch, the oracle as the best capacity of its sweep run again, the calibration profile made
on first use."""

import json
from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_budget_smoke_run(tmp_path, monkeypatch):
    monkeypatch.setenv("BOLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    bench = load_script("bench/budget.py", "budget_bench")
    assert bench.main(["--models", "tiny", "--batches", "1", "2", "--device", "cpu",
                       "--max-tokens", "8", "--context", "16", "--depth", "3", "--topk", "2",
                       "--budget", "8", "--global-budget", "4", "--sweep", "2", "8",
                       "--sweep-widths", "--eps-sweep", "0.1", "1e9", "--repeats", "3",
                       "--out", str(tmp_path), "--tag=-t"]) == 0
    data = json.loads((next(tmp_path.glob("budget-*-tiny-t.json"))).read_text())
    recs = data["records"]
    for batch in (1, 2):
        mine = {r["policy"]: r for r in recs if r["batch"] == batch and r["policy"] != "sweep"}
        assert set(mine) == {"fixed", "global", "oracle", "calibrated", "calibrated-eps",
                             "goodput"}
        # eps 0.1 is the profile's own: run once; an unbounded eps keeps the grid's largest N
        cal = [r for r in recs if r["batch"] == batch and r["policy"].startswith("calibrated")]
        assert [r["eps"] for r in cal] == [0.1, 1e9]
        assert cal[1]["budget"] == max(data["meta"]["node_grid"])
        sweep = [r for r in recs if r["batch"] == batch and r["policy"] == "sweep"]
        # --sweep's capacities and those that fill each verify width (2, 4 and 8 slots a row)
        assert [r["budget"] for r in sweep] == sorted({2, 8} | {batch * (w - 1)
                                                               for w in (2, 4, 8)})
        best = max(sweep, key=lambda r: r["tokens_per_s"])
        assert mine["oracle"]["budget"] == best["budget"]
        assert mine["oracle"]["sweep_best_tokens_per_s"] == best["tokens_per_s"]
        assert mine["oracle"]["mean_accepted_tokens"] == best["mean_accepted_tokens"]
        assert mine["global"]["budget"] == 4
        for r in mine.values():           # the median of three runs
            assert r["host_ms"] >= 0.0
            assert len(r["tokens_per_s_runs"]) == 3
            assert r["tokens_per_s"] == sorted(r["tokens_per_s_runs"])[1]
    assert data["meta"]["b_ver"] and list((tmp_path / "cache").glob("budget-*.json"))
    assert list(tmp_path.glob("budget-*-tiny-t.png"))


def test_a_policy_that_does_not_fit_ends_the_run_with_a_message(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    budget = load_script("bench/budget.py", "budget_bench")
    with pytest.raises(SystemExit, match="goodput at batch 64 does not fit.*960.00 MiB"):
        budget.fitted(dict(fits=False, error="CUDA out of memory. Tried to allocate 960.00 MiB."),
                      "goodput at batch 64")
    assert budget.fitted(dict(fits=True, x=1), "ar")["x"] == 1

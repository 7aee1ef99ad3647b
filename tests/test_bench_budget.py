"""bench/budget.py runs end to end on a tiny preset (CPU smoke run): every policy's record at
every batch, the oracle as the best capacity of its sweep (on held-out prompts, or on the same
ones) run on the evaluation prompts, goodput from the prior and warmed on the held-out prompts,
the calibration profile made on first use."""

import json
from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_budget_smoke_run(tmp_path, monkeypatch):
    monkeypatch.setenv("BOLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    bench = load_script("bench/budget.py", "budget_bench")
    saved, restored = [], []            # goodput-warm: what its warm-up learnt, each repeat's start
    save, restore = bench.saved_acceptance, bench.restore_acceptance
    monkeypatch.setattr(bench, "saved_acceptance", lambda m: saved.append(save(m)) or saved[-1])
    monkeypatch.setattr(bench, "restore_acceptance",
                        lambda m, s: restored.append(s) or restore(m, s))
    assert bench.main(["--models", "tiny", "--batches", "1", "2", "--device", "cpu",
                       "--max-tokens", "8", "--context", "16", "--depth", "3", "--topk", "2",
                       "--budget", "8", "--global-budget", "4", "--sweep", "2", "8",
                       "--sweep-widths", "--eps-sweep", "0.1", "1e9", "--repeats", "3",
                       "--waves", "2", "--out", str(tmp_path), "--tag=-t"]) == 0
    data = json.loads((next(tmp_path.glob("budget-*-tiny-t.json"))).read_text())
    recs = data["records"]
    for batch in (1, 2):
        mine = {r["policy"]: r for r in recs if r["batch"] == batch and r["policy"] != "sweep"}
        assert set(mine) == {"fixed", "global", "oracle", "calibrated", "calibrated-eps",
                             "goodput", "goodput-warm"}
        # goodput-warm starts from what a goodput run on the selection prompts learnt (each
        # start is checked below; what it learnt, by test_saved_acceptance_restores_a_copy)
        assert mine["goodput-warm"]["warmed_on"] == "selection"
        # eps 0.1 is the profile's own: run once; an unbounded eps keeps every drafted node
        # (8-node trees)
        cal = [r for r in recs if r["batch"] == batch and r["policy"].startswith("calibrated")]
        assert [r["eps"] for r in cal] == [0.1, 1e9]
        assert cal[1]["budget"] == batch * 7
        sweep = [r for r in recs if r["batch"] == batch and r["policy"] == "sweep"]
        # --sweep's capacities and those that fill each verify width (2, 4 and 8 slots a row)
        assert [r["budget"] for r in sweep] == sorted({2, 8} | {batch * (w - 1)
                                                               for w in (2, 4, 8)})
        best = max(sweep, key=lambda r: r["tokens_per_s"])
        # chosen on the selection prompts, measured on the evaluation prompts
        assert {r["prompt_set"] for r in sweep} == {"selection"}
        assert mine["oracle"]["budget"] == best["budget"]
        assert mine["oracle"]["sweep_best_tokens_per_s"] == best["tokens_per_s"]
        assert mine["oracle"]["chosen_on"] == "selection"
        assert mine["global"]["budget"] == 4
        for r in mine.values():           # the median of three runs
            assert r["prompt_set"] == "evaluation" and r["requests"] == 2 * batch
            assert r["full_batch_tokens_per_s"] > 0 and r["batch_rounds"] >= r["full_batch_rounds"]
            assert r["host_ms"] >= 0.0
            assert len(r["tokens_per_s_runs"]) == 3
            assert r["tokens_per_s"] == sorted(r["tokens_per_s_runs"])[1]
    # each batch's warm-up saved once, and each of its three runs started from that state
    assert len(saved) == 2 and [id(s) for s in restored] == [id(saved[0])] * 3 + [id(saved[1])] * 3
    assert data["meta"]["b_ver"] and list((tmp_path / "cache").glob("budget-*.json"))
    assert data["meta"]["torch"] and "triton" in data["meta"] and "fla" in data["meta"]
    assert data["meta"]["commit"] not in ("", None)
    assert list(tmp_path.glob("budget-*-tiny-t.png"))
    table = bench.policy_table(recs)
    assert "| tiny | 2 | oracle (chosen on selection) |" in table
    assert "tiny: goodput >= the oracle at" in table and "of 2 batches" in table
    assert "tiny: goodput-warm >= the oracle at" in table
    # --oracle-on same: the sweep's best run again on the prompts it was chosen on
    assert bench.main(["--models", "tiny", "--batches", "2", "--device", "cpu", "--max-tokens",
                       "8", "--context", "16", "--depth", "3", "--topk", "2", "--budget", "8",
                       "--sweep", "2", "8", "--policies", "oracle", "--oracle-on", "same",
                       "--out", str(tmp_path), "--tag=-same"]) == 0
    same = json.loads((next(tmp_path.glob("budget-*-tiny-same.json"))).read_text())["records"]
    sweep = [r for r in same if r["policy"] == "sweep"]
    oracle = next(r for r in same if r["policy"] == "oracle")
    best = max(sweep, key=lambda r: r["tokens_per_s"])
    assert {r["prompt_set"] for r in same} == {"evaluation"} and oracle["chosen_on"] == "evaluation"
    assert oracle["mean_accepted_tokens"] == best["mean_accepted_tokens"]


def test_the_selection_prompts_are_held_out():
    """Random prompts: another seed; a model's own prompts: the odd-numbered half, the
    evaluation the even-numbered half, each cycled to the run's count."""
    bench = load_script("bench/budget.py", "budget_bench")
    model = type("M", (), {"config": type("C", (), {"vocab_size": 50})()})()
    ev, sel = bench.prompt_sets(model, None, 3, 4, seed=2)
    assert len(ev) == len(sel) == 3 and all(len(p) == 4 for p in ev + sel)
    assert not any(a == b for a in ev for b in sel)
    assert ev == bench.prompt_sets(model, None, 3, 4, seed=2)[0]
    given = [[1], [2], [3], [4], [5]]
    assert bench.prompt_sets(model, given, 4, 0, seed=1) == ([[1], [3], [5], [1]],
                                                             [[2], [4], [2], [4]])
    assert bench.prompt_sets(model, [[7]], 2, 0, seed=1) == ([[7], [7]], [[7], [7]])


def test_a_policy_that_does_not_fit_ends_the_run_with_a_message(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    budget = load_script("bench/budget.py", "budget_bench")
    with pytest.raises(SystemExit, match="goodput at batch 64 does not fit.*960.00 MiB"):
        budget.fitted(dict(fits=False, error="CUDA out of memory. Tried to allocate 960.00 MiB."),
                      "goodput at batch 64")
    assert budget.fitted(dict(fits=True, x=1), "ar")["x"] == 1


def _result_file(tmp_path, t_ver_b1, name="budget-x.json"):
    """A finished run's figures at batches 1 and 2 of 8-node trees (widths 2, 4, 8): the profile's
    curves in the meta, the sweep over each width's capacity and the oracle."""
    grid = [1, 2, 4, 8, 14]
    meta = dict(tree_nodes=8, node_grid=grid, t_dec_ms={"1": 1.0, "2": 1.0},
                t_ver_ms={"1": t_ver_b1, "2": [1.0, 1.0, 1.1, 1.5, 1.5]})
    rates = {1: {1: 50.0, 3: 90.0, 7: 100.0}, 2: {2: 60.0, 6: 100.0, 14: 80.0}}
    recs = [dict(batch=b, policy="sweep", budget=n, tokens_per_s=r)
            for b, at in rates.items() for n, r in at.items()]
    recs += [dict(batch=b, policy="oracle", budget=0, tokens_per_s=100.0) for b in rates]
    path = tmp_path / name
    path.write_text(json.dumps(dict(meta=meta, records=recs)))
    return path


def test_eps_table_finds_the_tolerances_where_every_batch_is_near_its_oracle(tmp_path,
                                                                            monkeypatch):
    """The calibrated rule's choice at each tolerance (the largest grid point within it, at its
    width's capacity) and its sweep rate; the tolerances good for every batch intersect."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    bench = load_script("bench/budget.py", "budget_bench")
    # batch 1: N = 1, 2, 4 cost 1.0, 1.05, 1.2 (capacities 1, 3, 7); batch 2: N = 1, 2, 4, 8
    # cost 1.0, 1.0, 1.1, 1.5, 1.5 (capacities 2, 2, 6, 14, 14)
    path = _result_file(tmp_path, [1.0, 1.05, 1.2, 1.2, 1.2])
    assert bench.rule_choices(json.loads(path.read_text())["meta"], 1) == \
        [(0.0, 1), (pytest.approx(0.05), 3), (pytest.approx(0.2), 7)]
    assert bench.rule_choices(json.loads(path.read_text())["meta"], 2) == \
        [(0.0, 2), (pytest.approx(0.1), 6), (pytest.approx(0.5), 14)]
    text = bench.eps_table([path])
    assert "| 2 | 0.100-0.500 | 6 | 1.000 | sweep |" in text
    assert "batch 1: within 0.95 of the oracle at eps 0.200-inf" in text
    assert "batch 2: within 0.95 of the oracle at eps 0.100-0.500" in text
    assert text.endswith("every batch within 0.95: eps 0.200-0.500")
    # batch 1's whole tree only from eps 0.6 on: no tolerance serves both
    late = _result_file(tmp_path, [1.0, 1.05, 1.6, 1.6, 1.6], "budget-late.json")
    assert bench.eps_table([late]).endswith("every batch within 0.95: eps none")
    assert bench.main(["--eps-table", str(late)]) == 0
    # a calibrated run at a capacity (another run: its rate against its own ar) replaces the sweep's
    cal = tmp_path / "budget-cal.json"
    cal.write_text(json.dumps(dict(meta={}, records=[
        dict(batch=2, policy="calibrated", budget=14, tokens_per_s=50.0, ar_tokens_per_s=0.5)])))
    text = bench.eps_table([path, cal])
    assert "| 2 | 0.500-inf | 14 | 1.000 | calibrated |" in text
    assert text.endswith("every batch within 0.95: eps 0.200-inf")
    # an oracle chosen on held-out prompts: the sweep (its own prompts) against the sweep's
    # best, the calibrated runs against the oracle's run on the evaluation prompts
    held = json.loads(path.read_text())
    for r in held["records"]:
        if r["policy"] == "sweep":
            r.update(prompt_set="selection", tokens_per_s=r["tokens_per_s"] / 2)
        else:
            r.update(chosen_on="selection")
    held["records"].append(dict(batch=2, policy="calibrated", budget=6, tokens_per_s=95.0,
                                prompt_set="evaluation"))
    (tmp_path / "budget-held.json").write_text(json.dumps(held))
    text = bench.eps_table([tmp_path / "budget-held.json"])
    assert "| 1 | 0.200-inf | 7 | 1.000 | sweep |" in text          # 50 / 50, not 50 / 100
    assert "| 2 | 0.100-0.500 | 6 | 0.950 | calibrated |" in text
    assert text.endswith("every batch within 0.95: eps 0.200-0.500")
    raw = json.loads(late.read_text())
    raw["records"] = [r for r in raw["records"] if r["policy"] != "oracle"]
    late.write_text(json.dumps(raw))
    with pytest.raises(SystemExit, match="batch 1 has no oracle"):
        bench.eps_table([late])

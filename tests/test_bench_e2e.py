"""bench/e2e.py runs end to end on a tiny preset (CPU smoke run): every mode's record, the best
shapes, output equal to plain decoding, the JSON and the plot; with ``--tp 2`` (two gloo ranks)
the same outputs and acceptance, rank 0 writing records marked tp 2."""

import json
from pathlib import Path

import pytest
import torch

from tests.scripts import load_script

SMOKE = ["--models", "tiny", "--device", "cpu", "--max-tokens", "10", "--context", "16",
         "--tree-shapes", "3,2,6"]


def _e2e():
    """bench/e2e.py as the module ``bench.e2e`` (registered, so that spawned ranks find it)."""
    return load_script("bench/e2e.py", "bench.e2e", register=True)


def _records(out: Path) -> tuple[dict, list[dict]]:
    data = json.loads(next(out.glob("e2e-*.json")).read_text())
    return data["meta"], data["records"]


def test_e2e_smoke_run(tmp_path):
    assert _e2e().main(SMOKE + ["--batches", "1", "2", "--chain-depths", "2", "3",
                                "--min-run-tokens", "16", "--out", str(tmp_path)]) == 0
    meta, recs = _records(tmp_path)
    # a run generates at least 16 tokens in waves of 10-token requests: two requests one after
    # the other at batch 1 (the second admitted when the first is done), one wave of two at 2
    assert {(r["batch"], r["requests"]) for r in recs} == {(1, 2), (2, 2)}
    ar1 = next(r for r in recs if r["mode"] == "ar" and r["batch"] == 1)
    assert ar1["full_batch_rounds"] == 2 * 9      # one slot: 9 rounds each, one after the other
    assert {(r["mode"], r["batch"]) for r in recs} == {
        (m, b) for m in ("ar", "chain", "tree-serial", "bole") for b in (1, 2)}
    for r in recs:
        assert r["profile"] == "qwen3-next-mtp" and r["tokens_per_s"] > 0 and r["tp"] == 1
        if r["mode"] != "ar":
            assert r["equal_to_ar"] and r["mean_accepted_tokens"] > 1.0
        # the rounds that ran every slot: all of ar's, some of the speculative modes'
        assert r["full_batch_rounds"] >= 1 and r["full_batch_tokens_per_s"] > 0
        # chain's best of two depths is run again for its figure; bole tried one shape
        assert ("sweep_best_decode_tokens_per_s" in r) == (r["mode"] == "chain")
    assert "replayed" in meta["acceptance_note"]
    assert meta["commit"] not in ("", None)             # the code the figures came from
    assert list(tmp_path.glob("e2e-*.png"))


def test_e2e_tunes_tree_serial_on_its_own(tmp_path):
    """--tune-tree-serial sweeps tree-serial over the tree shapes like bole: its record is its
    own best shape, run again for its figure."""
    assert _e2e().main(SMOKE[:-1] + ["3,2,6", "2,2,3", "--batches", "2", "--chain-depths", "2",
                                     "--tune-tree-serial", "--out", str(tmp_path)]) == 0
    _, recs = _records(tmp_path)
    by = {r["mode"]: r for r in recs}
    assert "sweep_best_decode_tokens_per_s" in by["tree-serial"]
    assert (by["tree-serial"]["shape"]["depth"], by["tree-serial"]["shape"]["budget"]) in \
        {(3, 6), (2, 3)}
    assert by["tree-serial"]["equal_to_ar"] and by["bole"]["equal_to_ar"]


def test_e2e_runs_the_budget_policies_as_modes(tmp_path, monkeypatch):
    """--budget-policies adds bole-<policy> records on the largest tree, equal to ar, the
    calibration profile made on first use."""
    monkeypatch.setenv("BOLE_CACHE", str(tmp_path / "cache"))
    assert _e2e().main(SMOKE + ["--batches", "2", "--chain-depths", "2", "--budget-policies",
                                "global", "goodput", "--out", str(tmp_path)]) == 0
    meta, recs = _records(tmp_path)
    by = {r["mode"]: r for r in recs}
    assert set(by) == {"ar", "chain", "tree-serial", "bole", "bole-global", "bole-goodput"}
    for mode in ("bole-global", "bole-goodput"):
        assert by[mode]["equal_to_ar"] and by[mode]["shape"] == dict(depth=3, topk=2, budget=6)
    saved = list((tmp_path / "cache").glob("budget-*.json"))
    assert saved
    # the curve goodput chose from is in the result file: its batches, grid and times
    (name, used), = meta["budget_profiles"].items()
    assert name == by["bole"]["model"] and "2" in used["t_ver_ms"] and used["tree_nodes"] == 6
    assert len(used["t_ver_ms"]["2"]) == len(used["node_grid"])
    assert used["node_grid"] == json.loads(saved[0].read_text())["node_grid"]


def test_e2e_with_two_ranks_equals_one(tmp_path):
    """One shape per mode, so that both runs measure the same configurations."""
    e2e = _e2e()
    base = SMOKE + ["--batches", "2", "--chain-depths", "2"]
    assert e2e.main(base + ["--out", str(tmp_path / "tp1")]) == 0
    assert e2e.main(base + ["--tp", "2", "--out", str(tmp_path / "tp2")]) == 0
    meta, tp2 = _records(tmp_path / "tp2")
    _, tp1 = _records(tmp_path / "tp1")
    assert meta["tp"] == 2 and len(tp2) == len(tp1) == 4
    for a, b in zip(tp2, tp1):
        assert a["tp"] == 2 and b["tp"] == 1 and (a["mode"], a["batch"]) == (b["mode"], b["batch"])
        for key in ("output_digest", "mean_accepted_tokens", "tokens_per_verified_node",
                    "shape", "equal_to_ar"):
            assert a.get(key) == b.get(key), (a["mode"], key)
    assert e2e.main(base + ["--tp", "3", "--out", str(tmp_path / "tp3")]) == 2


def test_confirm_max_batch_runs_the_batch_and_records_it(tmp_path):
    """--confirm-max-batch runs tree-serial's best shape at the (here given) batch and
    --max-context, and the JSON records whether it fit."""
    assert _e2e().main(SMOKE + ["--batches", "1", "--chain-depths", "2", "--max-context", "24",
                                "--confirm-max-batch", "--confirm-batch", "3",
                                "--out", str(tmp_path)]) == 0
    data = json.loads(next(tmp_path.glob("e2e-*.json")).read_text())
    [c] = data["max_batch_confirmed"]
    assert c["model"] == "tiny" and c["mode"] == "tree-serial" and c["computed"] == 3
    [run] = c["runs"]
    assert run["batch"] == 3 and run["context"] == 24 and run["ok"] and run["tokens"] == 3 * 4
    assert c["largest_run"] == 3


def test_a_max_batch_that_does_not_fit_is_retried_smaller(monkeypatch):
    """When the computed batch runs out of memory, 80% of it is tried, and so on: the record
    keeps every run and the largest that fit."""
    e2e = _e2e()
    monkeypatch.setattr(e2e, "confirm", lambda model, spec, ctx, n, dev: dict(
        batch=n, ok=n <= 35))
    got = e2e.confirm_max_batch(None, e2e.SpecConfig("tree-serial"), 8192, 51, "cuda")
    assert [r["batch"] for r in got["runs"]] == [51, 40, 32] and got["largest_run"] == 32
    monkeypatch.setattr(e2e, "confirm", lambda model, spec, ctx, n, dev: dict(batch=n, ok=False))
    got = e2e.confirm_max_batch(None, e2e.SpecConfig("tree-serial"), 8192, 51, "cuda")
    assert len(got["runs"]) == 4 and got["largest_run"] is None
    assert e2e._out_of_memory(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling ..."))
    assert e2e._out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not e2e._out_of_memory(RuntimeError("shape mismatch"))


def test_a_mode_that_does_not_fit_is_recorded_and_the_study_goes_on(tmp_path, monkeypatch):
    """A mode whose engine runs out of device memory (27B chain at batch 64 on one H200: its
    per-position state snapshots) gets a record saying so, with no figures; the other modes
    still run and the plot leaves it out."""
    e2e = _e2e()
    real = e2e.Engine

    def engine(model, spec, **kw):
        if spec.mode == "chain" and spec.depth == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 960.00 MiB.")
        return real(model, spec, **kw)

    monkeypatch.setattr(e2e, "Engine", engine)
    assert e2e.main(SMOKE + ["--batches", "2", "--chain-depths", "3", "--out",
                             str(tmp_path)]) == 0
    _, recs = _records(tmp_path)
    by = {r["mode"]: r for r in recs}
    assert set(by) == {"ar", "chain", "tree-serial", "bole"}
    assert by["chain"]["fits"] is False and by["chain"]["decode_tokens_per_s"] is None
    assert "960.00 MiB" in by["chain"]["error"] and by["chain"]["equal_to_ar"] is None
    assert all(by[m]["fits"] and by[m]["equal_to_ar"] for m in ("tree-serial", "bole"))
    # of two depths, the one that fits is picked and run again
    assert e2e.main(SMOKE + ["--batches", "2", "--chain-depths", "2", "3", "--out",
                             str(tmp_path)]) == 0
    _, recs = _records(tmp_path)
    chain = next(r for r in recs if r["mode"] == "chain")
    assert chain["fits"] and chain["shape"]["depth"] == 2 and chain["equal_to_ar"]
    assert "sweep_best_decode_tokens_per_s" not in chain      # one fitting candidate: not rerun


def test_a_run_that_fails_otherwise_still_raises(monkeypatch):
    """Other errors raise; so does running out of memory under tensor parallelism (a rank that
    went on alone would leave the others in a collective), also when the error that reaches
    the study is one raised while handling it."""
    e2e = _e2e()

    def engine(model, spec, **kw):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(e2e, "Engine", engine)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        e2e.run(None, e2e.SpecConfig("ar"), [[1, 2]], 4, None, "cpu")

    def out_of_memory(model, spec, **kw):
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except torch.OutOfMemoryError:
            raise RuntimeError("graph capture ended") from None

    monkeypatch.setattr(e2e, "Engine", out_of_memory)
    assert e2e.run(None, e2e.SpecConfig("ar"), [[1, 2]], 4, None, "cpu")["fits"] is False
    two_ranks = type("M", (), {"tp": type("TP", (), {"world": 2})()})()
    with pytest.raises(RuntimeError, match="graph capture ended"):
        e2e.run(two_ranks, e2e.SpecConfig("ar"), [[1, 2]], 4, None, "cpu")


def test_when_no_bole_tree_fits_its_followers_are_not_run(tmp_path, monkeypatch):
    """Tree-serial on bole's trees and the policies on bole's best tree are recorded as not
    run when no bole tree fits."""
    e2e = _e2e()
    real, built = e2e.Engine, []

    def engine(model, spec, **kw):
        built.append(spec.mode)
        if spec.mode == "bole" and spec.budget_policy == "fixed":
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return real(model, spec, **kw)

    monkeypatch.setattr(e2e, "Engine", engine)
    monkeypatch.setenv("BOLE_CACHE", str(tmp_path / "cache"))
    assert e2e.main(SMOKE + ["--batches", "2", "--chain-depths", "2", "--budget-policies",
                             "global", "--policy-tree", "best", "--out", str(tmp_path)]) == 0
    _, recs = _records(tmp_path)
    by = {r["mode"]: r for r in recs}
    assert not by["bole"]["fits"] and by["chain"]["fits"]
    for mode in ("tree-serial", "bole-global"):
        assert by[mode]["fits"] is False and by[mode]["error"] == "not run: no bole tree fits"
    assert "tree-serial" not in built


def test_the_table_prints_one_row_per_model_and_batch(tmp_path):
    """--table: rows sorted by batch within each model, multiples over each mode, a mode that
    did not fit named so and left out of the multiples."""
    e2e = _e2e()

    def rec(mode, batch, rate, fits=True, **kw):
        return dict(model="m", batch=batch, mode=mode, fits=fits, decode_tokens_per_s=rate,
                    shape=None if mode == "ar" else dict(depth=4, topk=2, budget=8),
                    peak_mem_gib=10.0, equal_to_ar=True if mode != "ar" else None,
                    mean_accepted_tokens=3.5, round_ms=2.0, draft_ms=0.5, verify_ms=1.2,
                    accept_commit_ms=0.2, host_ms=0.1, **kw)

    records = [rec("ar", 64, 100.0), rec("chain", 64, None, fits=False),
               rec("tree-serial", 64, 150.0), rec("bole", 64, 300.0),
               rec("ar", 8, 50.0), rec("chain", 8, 100.0), rec("tree-serial", 8, 120.0),
               rec("bole", 8, 200.0), rec("bole-goodput", 8, 210.0)]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(dict(meta={}, records=records)))
    lines = e2e.table([path]).splitlines()
    assert len(lines) == 4 and lines[1].count("---") == lines[0].count(" | ") + 1
    b8 = lines[2].split(" | ")
    assert b8[1:4] == ["8", "50", "100 (d4)"] and b8[6] == "210" and b8[8:11] == [
        "4.00", "1.67", "2.00"]
    b64 = lines[3].split(" | ")
    assert b64[1] == "64" and b64[3] == "does not fit" and b64[8:11] == ["3.00", "2.00", ""]
    assert b64[-1] == "2/2 |"


def test_the_budget_policies_can_choose_from_bole_s_best_tree(tmp_path, monkeypatch):
    """--policy-tree best: the policies run on the tree bole's sweep picked at that batch."""
    monkeypatch.setenv("BOLE_CACHE", str(tmp_path / "cache"))
    e2e = _e2e()
    # every sweep picks its last candidate: bole's best is then 2,2,3, not the largest tree
    monkeypatch.setattr(e2e, "fastest", lambda candidates, model: len(candidates) - 1)
    assert e2e.main(SMOKE[:-1] + ["3,2,6", "2,2,3", "--batches", "2", "--chain-depths", "2",
                                  "--budget-policies", "global", "--policy-tree", "best",
                                  "--out", str(tmp_path)]) == 0
    _, recs = _records(tmp_path)
    by = {r["mode"]: r for r in recs}
    assert by["bole"]["shape"] == dict(depth=2, topk=2, budget=3)
    assert by["bole-global"]["shape"] == by["bole"]["shape"] and by["bole-global"]["equal_to_ar"]


def test_a_batch_whose_plain_decoding_does_not_fit_records_only_that(tmp_path, monkeypatch):
    """ar out of memory at a batch leaves nothing to replay or compare there: one record saying
    so, and the study's other batches go on."""
    e2e = _e2e()
    real = e2e.Engine

    def engine(model, spec, max_slots, **kw):
        if spec.mode == "ar" and max_slots == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return real(model, spec, max_slots=max_slots, **kw)

    monkeypatch.setattr(e2e, "Engine", engine)
    assert e2e.main(SMOKE + ["--batches", "1", "2", "--chain-depths", "2", "--out",
                             str(tmp_path)]) == 0
    _, recs = _records(tmp_path)
    assert [(r["batch"], r["mode"], r["fits"]) for r in recs if r["batch"] == 2] == [
        (2, "ar", False)]
    assert {r["mode"] for r in recs if r["batch"] == 1} == {"ar", "chain", "tree-serial", "bole"}
    rows = e2e.table([next(tmp_path.glob("e2e-*.json"))]).splitlines()
    assert rows[3].startswith("| tiny | 2 | does not fit |")
    assert rows[3].count(" | ") == rows[0].count(" | ")


def test_the_warm_up_can_take_fewer_requests_than_slots(tmp_path, monkeypatch):
    """--warmup-requests 1: each run's warm-up generates for one prompt, the timed part for
    every one, and the outputs still equal ar's."""
    e2e = _e2e()
    real, sizes = e2e.Engine, []

    class Counting(real):
        def generate(self, prompts, *a, **kw):
            sizes.append(len(prompts))
            return super().generate(prompts, *a, **kw)

    monkeypatch.setattr(e2e, "Engine", Counting)
    assert e2e.main(SMOKE + ["--batches", "2", "--chain-depths", "2", "--warmup-requests", "1",
                             "--out", str(tmp_path)]) == 0
    assert sizes and sizes[0::2] == [1] * (len(sizes) // 2) and set(sizes[1::2]) == {2}
    with pytest.raises(SystemExit):
        e2e.main(SMOKE + ["--warmup-requests", "-1", "--out", str(tmp_path)])
    _, recs = _records(tmp_path)
    assert all(r["equal_to_ar"] for r in recs if r["mode"] != "ar")

"""bench/attention_splits.py's smoke run on the CPU (the Triton interpreter): every split count
agrees with one split, and the JSON records each point's timings, the default rule's choice and
the best split count."""

import json
from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_attention_splits_smoke_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    probe = load_script("bench/attention_splits.py")
    assert probe.main(["--device", "cpu", "--context", "48", "--batches", "1", "2", "--nodes",
                       "1", "3", "--splits", "1", "2", "--reps", "1",
                       "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("attention-splits-*.json")
    data = json.loads(path.read_text())
    assert data["meta"]["device"] == "cpu" and len(data["records"]) == 4
    for rec in data["records"]:
        assert set(rec["us"]) == {"default", "1", "2"} and rec["best_splits"] in (1, 2)
        assert rec["default_splits"] >= 1 and rec["best_us"] == rec["us"][str(rec["best_splits"])]
    assert path.with_suffix(".png").exists()

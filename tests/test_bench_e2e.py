"""bench/e2e.py runs end to end on a tiny preset (CPU smoke run): every mode's record, the best
shapes, output equal to plain decoding, the JSON and the plot."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_e2e_smoke_run(tmp_path):
    spec = importlib.util.spec_from_file_location("e2e", ROOT / "bench" / "e2e.py")
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    assert e2e.main(["--models", "tiny", "--batches", "1", "2", "--device", "cpu",
                     "--max-tokens", "10", "--context", "16", "--chain-depths", "2", "3",
                     "--tree-shapes", "3,2,6", "--out", str(tmp_path)]) == 0
    data = json.loads(next(tmp_path.glob("e2e-*.json")).read_text())
    recs = data["records"]
    assert {(r["mode"], r["batch"]) for r in recs} == {
        (m, b) for m in ("ar", "chain", "tree-serial", "bole") for b in (1, 2)}
    for r in recs:
        assert r["profile"] == "qwen3-next-mtp" and r["tokens_per_s"] > 0
        if r["mode"] != "ar":
            assert r["equal_to_ar"] and r["mean_accepted_tokens"] > 1.0
    assert "replayed" in data["meta"]["acceptance_note"]
    assert list(tmp_path.glob("e2e-*.png"))

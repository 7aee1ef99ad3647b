"""bench/tp.py on the CPU (tiny preset, tp 1 and 2 over gloo, spawned and torn down): a record
per tp size, batch and case, all-reduces counted and timed at tp 2, the ratios and the JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tp_smoke_run(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "tp.py"), "--device", "cpu", "--dtype", "fp32",
           "--preset", "tiny", "--context", "32", "--batches", "1", "2", "--nodes", "6",
           "--reps", "1", "--out", str(tmp_path)]
    res = subprocess.run(cmd, timeout=600, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(next(tmp_path.glob("tp-*-tiny.json")).read_text())
    records = data["records"]
    keys = {(r["tp"], r["batch"], r["case"]) for r in records}
    assert keys == {(t, b, c) for t in (1, 2) for b in (1, 2) for c in ("decode", "verify-6")}
    for r in records:
        assert r["total_ms"] > 0 and r["allreduces"] > 0 and not r["captured"]
        assert (r["allreduce_ms"] > 0) == (r["tp"] == 2)
    assert set(data["summary"]["ratios"]) == {f"tp2/b{b}/{c}" for b in (1, 2)
                                               for c in ("decode", "verify-6")}
    assert data["summary"]["target"]["met"] is None       # no verify-64 in this run
    assert (tmp_path / next(tmp_path.glob("tp-*.json")).with_suffix(".png").name).exists()
    assert not list(tmp_path.glob(".tp-*"))                # the ranks' hand-over file is gone


def test_tp_refuses_sizes_the_heads_cannot_split(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "tp.py"), "--device", "cpu", "--preset", "tiny",
           "--tp-sizes", "1", "7", "--out", str(tmp_path)]
    res = subprocess.run(cmd, timeout=120, capture_output=True, text=True)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "7" in res.stderr

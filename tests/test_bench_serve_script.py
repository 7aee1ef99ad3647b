"""bench/serve.py end to end on the CPU (smoke run): two real ``bole serve`` subprocesses (ar and
bole) under a small closed loop; the JSON's fields, the plot, and no server process left after,
also when the load fails half-way."""

import json
import os
from pathlib import Path

import pytest

from tests.scripts import load_script

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["--device", "cpu", "--dtype", "float32", "--requests", "8", "--concurrency", "4",
         "--max-tokens", "8"]


@pytest.fixture
def bench(monkeypatch):
    """bench/serve.py as a module; ``bench.started`` lists the pid of every server it starts."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    module = load_script("bench/serve.py", "serve_bench")
    module.started = []
    enter = module.Server.__enter__

    def recording_enter(self):
        out = enter(self)
        module.started.append(self.proc.pid)
        return out
    monkeypatch.setattr(module.Server, "__enter__", recording_enter)
    return module


def _no_server_left(pids: list[int]) -> None:
    """Every server's process group is empty (each server leads its own group)."""
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


def test_smoke_run_writes_every_field(bench, tmp_path, capsys):
    assert bench.main([*SMOKE, "--modes", "ar", "bole", "--out", str(tmp_path)]) == 0
    assert len(bench.started) == 2
    _no_server_left(bench.started)
    [path] = tmp_path.glob("serve-*-bundled-ar-bole.json")
    assert path.with_suffix(".png").is_file()
    data = json.loads(path.read_text())
    meta = data["meta"]
    for key in ("device", "torch", "triton", "date", "commit", "dtype", "drafter", "tree"):
        assert key in meta
    assert meta["dtype"] == "float32" and meta["drafter"] == "mtp"
    assert meta["settings"]["requests"] == 8
    assert meta["settings"]["concurrency"] == 4 and meta["settings"]["max_tokens"] == 8
    recs = {r["mode"]: r for r in data["records"]}
    assert list(recs) == ["ar", "bole"]
    for mode, r in recs.items():
        assert r["ok"] and r["error"] is None
        assert r["server"]["card"]["bole"]["mode"] == mode
        assert r["server"]["exit_code"] == 0 and r["server"]["startup_s"] > 0
        assert r["server"]["capture"]["seconds"] is None         # no CUDA graphs on the CPU
        assert r["loadgen"]["summary"]["completed"] == 8
        assert r["spec"]["output_tokens"] == r["loadgen"]["summary"]["output_tokens"] > 0
        assert r["output_tokens_per_s"] > 0 and r["goodput_rps"] >= 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert set(r[key]) == {"mean", "p50", "p90", "p99"}
            assert 0 < r[key]["p50"] <= r[key]["p90"] <= r[key]["p99"]
    assert recs["ar"]["mean_accepted_tokens"] == 1.0 and recs["ar"]["x_ar_tokens_per_s"] == 1.0
    assert recs["bole"]["mean_accepted_tokens"] > 1.0
    assert recs["bole"]["x_ar_tpot_p50"] == pytest.approx(
        recs["bole"]["tpot_ms"]["p50"] / recs["ar"]["tpot_ms"]["p50"])
    t = data["targets"]
    assert t["tokens_per_s_x"] == 1.8 and t["tpot_p50_x"] == 0.5
    assert t["hold"] == (t["tokens_ok"] and t["tpot_ok"])
    out = capsys.readouterr().out
    assert "| mode | output tok/s | x ar |" in out and "| bole |" in out and "both hold:" in out


def test_a_failed_load_stops_its_server(bench, tmp_path, monkeypatch):
    def broken(url, prompts, **options):
        raise RuntimeError("the load generator broke")
    monkeypatch.setattr(bench, "run_load", broken)
    assert bench.main([*SMOKE, "--modes", "ar", "--out", str(tmp_path),
                       "--log-dir", str(tmp_path / "logs")]) == 1
    assert len(bench.started) == 1
    _no_server_left(bench.started)
    [rec] = json.loads(next(tmp_path.glob("serve-*-bundled-ar.json")).read_text())["records"]
    assert not rec["ok"] and "the load generator broke" in rec["error"]
    assert rec["server"]["exit_code"] == 0
    assert "Application startup complete" in (tmp_path / "logs" / "serve-ar.log").read_text()

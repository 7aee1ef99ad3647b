"""``bole bench-serve`` (bole/bench/loadgen.py) against a fake OpenAI-compatible server.

The fake server (FastAPI, served by uvicorn on a thread, 127.0.0.1 and a free port) streams a
known token sequence with known delays, so the measured TTFT, TPOT and ITL can be checked against
them; it can also answer 503 + Retry-After. It is stopped and its thread joined at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import socket
import threading
import time
from dataclasses import dataclass, fields

import numpy as np
import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from bole.bench import loadgen  # noqa: E402
from bole.bench.loadgen import (LoadgenError, Prompt, load_prompts, poisson_arrivals,  # noqa: E402
                                 retry_after, run_load)
from bole.cli.parser import add_bench_serve  # noqa: E402

TTFT, ITL = 0.12, 0.04        # the fake server's delays: first delta, then per token
MODEL = "fake/tiny-model"


@dataclass
class Fake:
    """How the fake server answers (set by each test) and what it saw."""
    per_delta: int = 1            # tokens per SSE delta (a speculative server sends several)
    token_ids: bool = False       # put choices[0].token_ids in every chunk
    usage: bool = True            # send the usage chunk when asked for it
    busy: int = 0                 # answer the next this many POSTs with 503
    retry_after: str = "0.2"
    mode: str | None = "bole"     # the model card's bole.mode
    broken: bool = False          # send an error object after the first delta
    posts: int = 0
    in_flight: int = 0
    max_in_flight: int = 0


def _app(fake: Fake) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": MODEL, "object": "model", "owned_by": "test"}
        if fake.mode:
            card["bole"] = {"mode": fake.mode}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        fake.posts += 1
        if fake.busy > 0:
            fake.busy -= 1
            return JSONResponse({"error": {"message": "queue full", "type": "server_busy"}},
                                status_code=503, headers={"Retry-After": fake.retry_after})
        fake.in_flight += 1
        fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
        usage = bool((body.get("stream_options") or {}).get("include_usage")) and fake.usage
        return StreamingResponse(_tokens(fake, body["max_tokens"], usage),
                                 media_type="text/event-stream")
    return app


async def _tokens(fake: Fake, n: int, usage: bool):
    """Tokens " t0", " t1", ...: the first delta after TTFT, each next one ITL per token later."""
    try:
        await asyncio.sleep(TTFT)
        for start in range(0, n, fake.per_delta):
            ids = list(range(start, min(n, start + fake.per_delta)))
            if start:
                await asyncio.sleep(ITL * len(ids))
            choice = {"index": 0, "text": "".join(f" t{i}" for i in ids), "logprobs": None,
                      "finish_reason": "length" if ids[-1] == n - 1 else None}
            if fake.token_ids:
                choice["token_ids"] = ids
            yield f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n"
            if fake.broken:
                yield 'data: {"error": {"message": "boom", "type": "server_error"}}\n\n'
                return
        if usage:
            counts = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
            yield f"data: {json.dumps({'choices': [], 'usage': counts})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        fake.in_flight -= 1


@pytest.fixture(scope="module")
def served():
    """(state, url) of a fake server running for this module; stopped and joined after."""
    state = Fake()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_app(state), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "the fake server did not start"
    try:
        yield state, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
    assert not thread.is_alive(), "the fake server's thread is still running"


@pytest.fixture
def fake(served):
    """The fake server's state, reset to the defaults for each test; yields (state, url)."""
    state, url = served
    for f in fields(Fake):
        setattr(state, f.name, f.default)
    return state, url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(argv: list[str]) -> int:
    """Run ``bench-serve`` as ``bole`` would: the parser from add_bench_serve, then main."""
    parser = argparse.ArgumentParser(prog="bole")
    add_bench_serve(parser.add_subparsers(dest="command", required=True))
    return loadgen.main(parser.parse_args(["bench-serve", *argv]))


def test_latencies_match_the_servers_delays(fake):
    """Latencies against the fake server's delays. The server sleeps TTFT before the first
    delta and ITL before each next one, so every latency has a floor whatever the load; the
    summary's figures are checked against the per-request values they summarize (no upper
    bound on a wall-clock time: a loaded machine delays the client arbitrarily)."""
    state, url = fake
    report = run_load(url, ["a", "b"], num_requests=4, concurrency=2, max_tokens=6)
    s = report.summary
    assert (s["requests"], s["completed"], s["errors"], s["output_tokens"]) == (4, 4, 0, 24)
    assert report.meta["model"] == MODEL and report.meta["mode"] == "bole"
    eps = 1e-3                                          # clocks of one process, rounding
    for r in report.results:
        assert r.ok and r.output_tokens == 6 and r.finish_reason == "length"
        assert r.ttft_s >= TTFT - eps
        assert r.e2e_s >= TTFT + 5 * ITL - eps
        assert len(r.itl_s) == 5                         # the k-th delta's arrival has a floor
        assert all(r.ttft_s + sum(r.itl_s[:k]) >= TTFT + k * ITL - eps for k in range(6))
        assert sum(r.itl_s) <= r.e2e_s - r.ttft_s + eps   # the stream ends after its last delta
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 5, abs=eps)
    ttft = [1e3 * r.ttft_s for r in report.results]
    tpot = [1e3 * r.tpot_s for r in report.results]
    itl = [1e3 * g for r in report.results for g in r.itl_s]
    assert s["ttft_ms"]["p50"] == pytest.approx(float(np.percentile(ttft, 50)), rel=1e-6)
    assert s["tpot_ms"]["p50"] == pytest.approx(float(np.percentile(tpot, 50)), rel=1e-6)
    assert s["itl_ms"]["p50"] == pytest.approx(float(np.percentile(itl, 50)), rel=1e-6)
    assert s["itl_ms"]["n"] == 20 and s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"]
    for slo_ms in (10.0, 100.0, max(tpot)):             # goodput counts TPOT within the SLO
        want = sum(t <= slo_ms for t in tpot)
        assert loadgen.summarize(report.results, s["elapsed_s"], slo_ms)["goodput_requests"] \
            == want
    strict_ttft = loadgen.summarize(report.results, s["elapsed_s"], 1e9, 1e3 * TTFT / 2)
    assert strict_ttft["goodput_requests"] == 0         # every TTFT is at least the server's
    assert s["requests_per_s"] == pytest.approx(4 / s["elapsed_s"])


def test_tokens_per_delta_from_chunks_tokenizer_or_deltas(fake):
    """8 tokens in 4 deltas of 2: exact per-token ITL from token_ids or a tokenizer; without
    either (and without usage) each delta counts as one token."""
    state, url = fake
    state.per_delta, state.token_ids = 2, True
    r = run_load(url, ["a"], num_requests=2, concurrency=2, max_tokens=8).results[0]
    assert (r.count_source, r.output_tokens, len(r.itl_s)) == ("chunk", 8, 6)
    _split_evenly(r, per_delta=2, tokens=8)

    state.token_ids, state.usage = False, False
    r = run_load(url, ["a"], num_requests=1, max_tokens=8).results[0]
    assert (r.count_source, r.output_tokens, len(r.itl_s)) == ("deltas", 4, 3)
    _split_evenly(r, per_delta=1, tokens=4)

    class Words:                                        # a tokenizer: one token per word
        def encode(self, text: str, add_special_tokens: bool = True) -> list[str]:
            return text.split()
    r = run_load(url, ["a"], num_requests=1, max_tokens=8, tokenizer=Words()).results[0]
    assert (r.count_source, r.output_tokens, len(r.itl_s)) == ("tokenizer", 8, 6)
    _split_evenly(r, per_delta=2, tokens=8)


def _split_evenly(r, per_delta: int, tokens: int) -> None:
    """After the first delta, a delta of k tokens gives k equal ITL samples (its gap / k); the
    samples add up to the time from the first delta to the last, within the stream's time
    after its first delta, and TPOT is that time over tokens - 1 (relations between the
    measured times, not wall-clock figures)."""
    groups = [r.itl_s[i:i + per_delta] for i in range(0, len(r.itl_s), per_delta)]
    assert all(g == pytest.approx([g[0]] * per_delta, abs=1e-9) for g in groups)
    assert 0 < sum(r.itl_s) <= r.e2e_s - r.ttft_s + 1e-6
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / (tokens - 1), abs=1e-6)


def test_poisson_arrivals_are_seeded_and_followed(fake):
    state, url = fake
    times = poisson_arrivals(2000, 10.0, seed=0)
    assert times == poisson_arrivals(2000, 10.0, seed=0) and times[0] == 0.0
    assert np.mean(np.diff(times)) == pytest.approx(0.1, rel=0.1)
    report = run_load(url, ["a", "b", "c"], num_requests=8, rate=20.0, seed=3, max_tokens=3)
    assert state.posts == 8 and report.summary["completed"] == 8
    assert report.meta["arrival"] == "poisson"
    starts = sorted(r.start_s for r in report.results)
    # a request is never sent before its arrival (a loaded machine may send it later)
    assert all(s >= a - 1e-3 for s, a in zip(starts, poisson_arrivals(8, 20.0, seed=3)))


def test_fixed_concurrency_issues_every_request_and_caps_in_flight(fake):
    state, url = fake
    report = run_load(url, ["a"], num_requests=7, concurrency=3, max_tokens=3)
    assert state.posts == 7 and report.summary["completed"] == 7
    assert state.max_in_flight == 3 and report.meta["clients"] == 3
    assert [r.index for r in report.results] == list(range(7))


def test_busy_answers_are_retried_after_retry_after_and_counted(fake):
    state, url = fake
    assert (retry_after("1", 30), retry_after("100", 2), retry_after(None, 30)) == (1, 2, 1)
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT", 30) == 1.0   # a date: the default
    state.busy = 2
    report = run_load(url, ["a"], num_requests=2, concurrency=1, max_tokens=3)
    first = report.results[0]
    assert state.posts == 4 and report.summary["completed"] == 2
    assert report.summary["retries"] == 2 and first.retries == 2
    assert first.retry_wait_s == pytest.approx(0.4) and first.ttft_s >= 0.4 + TTFT

    state.busy = 5
    report = run_load(url, ["a"], num_requests=1, max_tokens=3, max_retries=1)
    r, s = report.results[0], report.summary
    assert (s["completed"], s["errors"], s["retries"], s["errors_by_status"]) == (0, 1, 1,
                                                                                 {"503": 1})
    assert r.status == 503 and "queue full" in r.error and state.posts == 4 + 2


def test_a_broken_stream_is_an_error_not_a_crash(fake):
    state, url = fake
    state.broken = True
    report = run_load(url, ["a"], num_requests=2, concurrency=2, max_tokens=4)
    assert report.summary["errors"] == 2 and report.summary["errors_by_status"] == {"200": 2}
    assert all("boom" in r.error and not r.ok for r in report.results)


def test_the_duration_caps_the_run(fake):
    state, url = fake
    t0 = time.perf_counter()
    report = run_load(url, ["a"], num_requests=1000, concurrency=2, max_tokens=6, duration=0.6)
    s = report.summary
    # all 1000 requests would take 160 s (0.32 s each, two at a time)
    assert time.perf_counter() - t0 < 30 and s["elapsed_s"] < 10
    assert 2 <= s["requests"] < 10 and s["cancelled"] >= 1
    assert s["completed"] + s["cancelled"] + s["errors"] == s["requests"]
    assert all(r.cancelled == (not r.ok) for r in report.results)


def test_cli_writes_the_json_and_the_plot(fake, tmp_path, capsys):
    state, url = fake
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f():", "max_tokens": 3}\n\n{"prompt": "import os"}\n')
    out = tmp_path / "results"
    argv = ["--url", url + "/v1/", "--num-requests", "3", "--concurrency", "2", "--max-tokens",
            "5", "--prompts", str(prompts), "--out", str(out)]
    started = _dt.date.today().isoformat()
    assert _cli(argv) == 0
    printed = capsys.readouterr().out
    # the name has the date the run ended: the day it started, or the next past midnight
    date = next((d for d in (started, _dt.date.today().isoformat())
                 if (out / f"serve-{d}-fake_tiny-model-bole.json").exists()), started)
    path = out / f"serve-{date}-fake_tiny-model-bole.json"
    png = out / f"serve-{date}-fake_tiny-model-bole.png"
    assert f"wrote {path.resolve()}" in printed and f"wrote {png.resolve()}" in printed
    assert "TTFT ms" in printed and "goodput" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(path.read_text())
    assert set(doc) == {"meta", "summary", "requests"}
    assert {"url", "model", "mode", "date", "arrival", "rate", "concurrency", "num_requests",
            "max_tokens", "temperature", "seed", "slo_tpot_ms", "slo_ttft_ms"} <= set(doc["meta"])
    assert doc["meta"]["url"] == url and doc["meta"]["mode"] == "bole"
    assert {"requests", "completed", "errors", "cancelled", "retries", "elapsed_s",
            "requests_per_s", "output_tokens", "output_tokens_per_s", "goodput_requests",
            "goodput_rps", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "output_tokens_per_request",
            "errors_by_status", "count_sources"} <= set(doc["summary"])
    assert set(doc["summary"]["tpot_ms"]) == {"mean", "p50", "p90", "p99", "n"}
    assert [r["output_tokens"] for r in doc["requests"]] == [3, 5, 3]   # JSONL max_tokens wins
    assert {"index", "start_s", "ok", "status", "ttft_s", "tpot_s", "output_tokens",
            "count_source", "retries"} <= set(doc["requests"][0])
    assert "itl_s" not in doc["requests"][0]

    assert _cli(argv) == 0                              # a second run does not overwrite
    assert len(list(out.glob("serve-*.json"))) == 2
    state.mode = None                                   # no mode from the server: --tag names it
    assert _cli(argv + ["--tag", "ar"]) == 0
    assert (out / f"serve-{date}-fake_tiny-model-ar.json").is_file()


def test_bad_arguments_and_an_unreachable_server_exit_2(fake, tmp_path, capsys):
    state, url = fake
    port = _free_port()                                 # nothing listens there
    cases = [(["--url", f"http://127.0.0.1:{port}"], "cannot reach the server"),
             (["--url", "ftp://example.org"], "is not an http(s) URL"),
             (["--url", url, "--rate", "0"], "--rate must be > 0"),
             (["--url", url, "--num-requests", "0"], "--num-requests must be >= 1"),
             (["--url", url, "--prompts", str(tmp_path / "missing.jsonl")], "missing.jsonl")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"prompt": 3}\n')
    cases.append((["--url", url, "--prompts", str(bad)], "line 2"))
    for argv, message in cases:
        assert _cli(argv + ["--out", str(tmp_path)]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("bole bench-serve: ") and message in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert state.posts == 0                             # no bad run sent a request
    assert not list(tmp_path.glob("serve-*"))


def test_load_prompts(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a"}\n{"prompt": "b", "max_tokens": 7}\n')
    assert load_prompts(good) == [Prompt("a"), Prompt("b", 7)]
    for text in ('{"prompt": ""}', '{"prompt": null}', '{"prompt": "a", "max_tokens": 0}', '["a"]', "not json",
                 '{"prompt": "a", "max_tokens": 1.5}'):
        (tmp_path / "x.jsonl").write_text(text + "\n")
        with pytest.raises(LoadgenError, match="line 1"):
            load_prompts(tmp_path / "x.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(LoadgenError, match="no prompts"):
        load_prompts(tmp_path / "empty.jsonl")

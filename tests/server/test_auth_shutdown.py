"""`bole serve` as a process: the API key (flag or BOLE_API_KEY; /health and /metrics stay
open; a warning when a non-loopback address is served without one), and SIGTERM's drain: new
requests get 503, in-flight ones finish within --shutdown-timeout or end with finish_reason
"abort", and the process exits with nothing left behind."""

import json
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests.server.served import Served  # noqa: E402
from tests.server.test_api import bundled  # noqa: E402,F401

KEY = "s3cret-key"


def test_the_api_key_from_the_environment_guards_every_route_but_health_and_metrics(
        tmp_path, monkeypatch):
    monkeypatch.setenv("BOLE_API_KEY", KEY)
    with Served(tmp_path, "--host", "0.0.0.0") as served:
        url = served.url
        ok = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert ok.completions.create(model="bundled", prompt="x", max_tokens=2).choices
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="guess", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as err:
            wrong.completions.create(model="bundled", prompt="x", max_tokens=2)
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        for res in (httpx.get(url + "/v1/models"),
                    httpx.post(url + "/v1/chat/completions", json={}),
                    httpx.get(url + "/v1/models", headers={"Authorization": KEY}),
                    httpx.get(url + "/nowhere")):
            assert res.status_code == 401
            assert set(res.json()["error"]) == {"message", "type", "param", "code"}
        assert httpx.get(url + "/health").status_code == 200
        assert "vllm:num_requests_running" in httpx.get(url + "/metrics").text
    assert "without an API key" not in served.output


def test_serving_a_public_address_without_a_key_warns(tmp_path, monkeypatch):
    monkeypatch.delenv("BOLE_API_KEY", raising=False)
    with Served(tmp_path, "--host", "0.0.0.0") as served:
        assert httpx.get(served.url + "/v1/models").status_code == 200
    assert "without an API key" in served.output


def _stream(url: str, out: dict, started: threading.Event) -> None:
    """A long streamed completion: its text and finish reason into ``out``."""
    text, finish = "", None
    with httpx.stream("POST", url + "/v1/completions", timeout=120, headers={
            "Authorization": f"Bearer {KEY}"}, json={
            "model": "bundled", "prompt": "def f(x):", "max_tokens": 3500, "temperature": 0,
            "stream": True}) as res:
        for line in res.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                started.set()
            out["done"] = line == "data: [DONE]" or out.get("done", False)
    out.update(text=text, finish=finish)


def _whole(url: str, out: dict, max_tokens: int) -> None:
    res = httpx.post(url + "/v1/completions", timeout=120, headers={
        "Authorization": f"Bearer {KEY}"}, json={
        "model": "bundled", "prompt": "import os\n", "max_tokens": max_tokens,
        "temperature": 0})
    out.update(status=res.status_code, body=res.json())


def _running(url: str, n: int) -> None:
    deadline = time.time() + 60
    while httpx.get(url + "/health", timeout=30).json()["running"] < n:
        assert time.time() < deadline, "the requests did not start"
        time.sleep(0.05)


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(tmp_path):
    """The two requests of 3,500 tokens would take about 40 s on two CPU cores; the shutdown
    timeout of 8 s is the time the test has, after SIGTERM, to see the server refuse."""
    with Served(tmp_path, "--api-key", KEY, "--shutdown-timeout", "8", "--max-len",
                "4096") as served:
        url = served.url
        streamed, whole, started = {}, {}, threading.Event()
        threads = [threading.Thread(target=_stream, args=(url, streamed, started)),
                   threading.Thread(target=_whole, args=(url, whole, 3500))]
        for t in threads:
            t.start()
        assert started.wait(60)
        _running(url, 2)
        served.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 30             # until the server has taken the signal
        while (health := httpx.get(url + "/health", timeout=30)).status_code == 200:
            assert time.time() < deadline, "/health still says ok after SIGTERM"
            time.sleep(0.05)
        assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
        refused = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                             json={"model": "bundled", "prompt": "x", "max_tokens": 2},
                             timeout=30)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        for t in threads:
            t.join(60)
        served.proc.wait(60)
    assert streamed["finish"] == "abort" and streamed["done"] and streamed["text"]
    assert whole["status"] == 200, whole
    choice = whole["body"]["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["text"]
    assert whole["body"]["usage"]["completion_tokens"] < 3500
    assert served.returncode == 0 and not served.left
    assert "aborting 2 requests" in served.output


def test_sigterm_lets_in_flight_requests_finish_within_the_timeout(tmp_path):
    with Served(tmp_path, "--api-key", KEY, "--shutdown-timeout", "60") as served:
        whole = {}
        thread = threading.Thread(target=_whole, args=(served.url, whole, 48))
        thread.start()
        _running(served.url, 1)
        t0 = time.time()
        served.proc.send_signal(signal.SIGTERM)
        thread.join(60)
        served.proc.wait(60)
        took = time.time() - t0
    assert whole["status"] == 200
    assert whole["body"]["choices"][0]["finish_reason"] in ("length", "stop")
    assert took < 50                       # it stopped once the request was done, not at 60 s
    assert served.returncode == 0 and not served.left
    assert "aborting" not in served.output


def test_an_aborted_drain_frees_every_engine_slot(bundled):  # noqa: F811
    """In one process: the drain aborts a long stream and a long plain request, their responses
    say "abort", and every cache slot is free again."""
    import asyncio

    from bole.engine import Engine, SpecConfig
    from bole.server.api import BoleServer, ServerConfig, drain
    from tests.server.test_api import Running
    model, tok = bundled
    engine = Engine(model, SpecConfig("bole", "mtp", depth=4, topk=3, budget=12), max_slots=2,
                    max_len=4096, tokenizer=tok)
    server = BoleServer(engine, "bundled", config=ServerConfig(shutdown_timeout=0.5))
    streamed, whole, started = {}, {}, threading.Event()
    with Running(server) as running:
        url = running.url
        threads = [threading.Thread(target=_stream, args=(url, streamed, started)),
                   threading.Thread(target=_whole, args=(url, whole, 3500))]
        for t in threads:
            t.start()
        assert started.wait(60)
        _running(url, 2)
        asyncio.run_coroutine_threadsafe(drain(server, running.uv), server.event_loop).result(30)
        for t in threads:
            t.join(30)
        assert engine.cache.num_free == 2 and server.scheduler.idle and not server.inflight
    assert streamed["finish"] == "abort" and streamed["done"]
    assert whole["status"] == 200 and whole["body"]["choices"][0]["finish_reason"] == "abort"

"""A round that raises on the server's engine thread: the request it was running gets OpenAI's
error body (500), its slot is freed, and the server goes on serving (health ok, the next
request answered as plain decoding would)."""

from __future__ import annotations

import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests.server.test_api import NAME, Running, _server, bundled  # noqa: E402,F401


def test_a_failed_round_fails_its_request_and_the_server_goes_on(bundled):  # noqa: F811
    server = _server(bundled, max_batch=2)
    step, calls = server.engine.step, []

    def failing_once(running, prelaunch=False):
        calls.append(len(running))
        if len(calls) == 2:
            raise RuntimeError("injected round failure")
        return step(running, prelaunch=prelaunch)

    server.engine.step = failing_once
    body = dict(model=NAME, prompt="def fibonacci(n):", max_tokens=24, temperature=0)
    with Running(server) as live:
        failed = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
        assert failed.status_code == 500, failed.text
        assert "cancelled by the server" in failed.json()["error"]["message"]
        assert httpx.get(live.url + "/health", timeout=10).json() == dict(
            status="ok", running=0, waiting=0)
        ok = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
        assert ok["choices"][0]["finish_reason"] == "length"
        assert ok["usage"]["completion_tokens"] == 24
        # the slot is freed after the round's final events went out: wait for it
        deadline = time.time() + 10
        while server.engine.cache.num_free != 2 and time.time() < deadline:
            time.sleep(0.01)
        assert server.engine.cache.num_free == 2

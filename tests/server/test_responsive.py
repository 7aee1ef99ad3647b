"""The HTTP server stays responsive under load: /health answers quickly while 64 streams run,
4 MB prompts are refused (over --max-prompt-bytes: before they are tokenized) and 900 KB prompts
are tokenized (off the event loop) and refused for the context."""

import statistics
import subprocess
import sys
import textwrap
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests.server.served import Served  # noqa: E402

#: the load, in a process of its own so that its client work does not slow this process's
#: probes: 64 streams and, while they run, 4 MB and 900 KB prompts in turn
LOAD = textwrap.dedent("""
    import asyncio, sys, httpx
    url = sys.argv[1]
    async def stream(c, i):
        async with c.stream("POST", url + "/v1/completions", json={
                "model": "bundled", "prompt": f"def f{i}(x):", "max_tokens": 48,
                "temperature": 0, "stream": True}) as r:
            async for _ in r.aiter_lines():
                pass
    async def big(c):
        for i in range(10 ** 6):
            size, why = ((4 << 20), "max-prompt-bytes") if i % 2 else (900_000, "context")
            r = await c.post(url + "/v1/completions", json={
                "model": "bundled", "prompt": "x = 1\\n" * (size // 6), "max_tokens": 4})
            assert r.status_code == 400 and why in r.text, r.text
            print("rejected", size, r.elapsed.total_seconds(), flush=True)
    async def main():
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=100)) as c:
            big_task = asyncio.ensure_future(big(c))
            await asyncio.gather(*(stream(c, i) for i in range(64)))
            big_task.cancel()
        print("done", flush=True)
    asyncio.run(main())
""")


def test_health_answers_fast_while_64_streams_run_and_4mb_prompts_are_refused(tmp_path):
    with Served(tmp_path, "--max-batch", "8") as served:
        load = subprocess.Popen([sys.executable, "-c", LOAD, served.url], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            latencies = []
            with httpx.Client(timeout=10) as client:
                deadline = time.time() + 120
                while len(latencies) < 40:
                    assert time.time() < deadline and load.poll() is None, \
                        f"the load ended early: {load.stdout.read()}"
                    t0 = time.perf_counter()
                    res = client.get(served.url + "/health")
                    dt = time.perf_counter() - t0
                    body = res.json()
                    if body["running"] == 0:         # the streams have not started yet
                        time.sleep(0.05)
                        continue
                    latencies.append(dt)
                    time.sleep(0.05)
            out, _ = load.communicate(timeout=300)
        finally:
            if load.poll() is None:
                load.kill()
        rejected = {}
        for line in out.splitlines():
            if line.startswith("rejected"):
                rejected.setdefault(int(line.split()[1]), []).append(float(line.split()[2]))
        assert load.returncode == 0 and out.rstrip().endswith("done"), out
        assert len(rejected) == 2, "the big prompts were not refused while the streams ran"
    # 40 probes, each one HTTP request over loopback while the server streams to 64 clients and
    # tokenizes big prompts back to back. Seen on two CPU cores: median 8 ms, slowest 32 ms; on
    # the same cores shared with three other test runs, a tenth of the probes took 50-100 ms
    # (the server process waits for a core). So the median is held to 50 ms, the slowest to
    # 1 s: a tokenizer on the event loop (1 s per 900 KB prompt, here back to back) fails both
    latencies.sort()
    assert statistics.median(latencies) < 0.05, latencies
    assert latencies[-1] < 1.0, latencies
    # refused before tokenizing (tokenizing 4 MB took 3.7 s)
    assert statistics.median(rejected[4 << 20]) < 0.5, rejected

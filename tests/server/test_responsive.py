"""The HTTP server stays responsive under load: /health answers quickly while 64 streams run
and 4 MB prompts are being refused (tokenizing runs off the event loop, and a prompt over
--max-prompt-bytes is refused before it is tokenized)."""

import subprocess
import sys
import textwrap
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests.server.served import Served  # noqa: E402

#: the load, in a process of its own so that its client work does not slow this process's
#: probes: 64 streams and, once they run, 4 MB prompts one after another until told to stop
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
        while True:
            r = await c.post(url + "/v1/completions", json={
                "model": "bundled", "prompt": "x" * (4 << 20), "max_tokens": 4})
            assert r.status_code == 400, r.text
            print("rejected", r.elapsed.total_seconds(), flush=True)
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
                                text=True)
        try:
            latencies = []
            with httpx.Client(timeout=10) as client:
                deadline = time.time() + 120
                while len(latencies) < 40:
                    assert time.time() < deadline and load.poll() is None, "the load ended early"
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
        rejected = [float(line.split()[1]) for line in out.splitlines()
                    if line.startswith("rejected")]
        assert load.returncode == 0 and out.rstrip().endswith("done"), out
        assert rejected, "no 4 MB prompt was refused while the streams ran"
    # 40 probes, each one HTTP request over loopback while the server streams to 64 clients
    # (seen on two shared CPU cores: median 8 ms, slowest 32 ms): 36 of them under 50 ms is the
    # claim; the slowest few may meet the OS scheduler of a busy machine, but not a tokenizer
    # holding the event loop (which cost 2.7 s a probe)
    latencies.sort()
    assert latencies[int(0.9 * len(latencies)) - 1] < 0.05, latencies
    assert latencies[-1] < 0.5, latencies
    assert max(rejected) < 2.0, rejected       # refused before tokenizing (tokenizing: 3.7 s)

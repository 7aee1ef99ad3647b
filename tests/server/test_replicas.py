"""`bole serve --replicas N` (Ray Serve replicas) on the CPU, and what it checks without Ray.

With Ray (``pip install "bole[ray]"``; skipped without it): two replicas of the bundled model
answer 64 concurrent greedy requests, half streamed, with the output of one engine, and both
served some; /metrics sums the replicas (``?by=replica``: each apart); a replica killed mid-run
fails only streams that had begun (every other request is sent again or waits, and finishes with
one engine's output), Ray starts a new replica; the ingress's re-sending against a stand-in
handle; SIGTERM stops every process; replicas of two tensor-parallel
ranks (gloo) answer as one engine; the Python deployment serves. Without Ray: the metrics merge
and the one-line errors (Ray missing, --replicas 0, --replica-cpus 0)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from bole.assets import BUNDLED_MODEL, code_prompts  # noqa: E402
from bole.server.replica_metrics import merge_metrics  # noqa: E402
from tests.server.served import MAX_TOKENS, Served, alive, children, offline  # noqa: E402
from tests.server.test_replicas_mutants import FakeStream  # noqa: E402

NEEDS_RAY = "needs Ray Serve: pip install \"bole[ray]\""
REQUESTS = 64
BATCH = 2                      # Served's --max-batch: a replica holds at most this many requests


def _ray_installed() -> bool:
    try:
        from ray import serve  # noqa: F401
    except ImportError:
        return False
    return True


ray_only = pytest.mark.skipif(not _ray_installed(), reason=NEEDS_RAY)


# ---- without Ray ----

class _Queue:
    def __init__(self, running: int, waiting: int):
        self.num_running, self.num_waiting = running, waiting


def _page(running: int, waiting: int, finished: int) -> bytes:
    from bole.server.metrics import ServerMetrics
    m = ServerMetrics(_Queue(running, waiting), "bundled", slots=4)
    for _ in range(finished):
        m.finished("length")
    m.ttft.observe(0.01 * finished)
    return m.render()


def _samples(text: str | bytes) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = text.decode() if isinstance(text, bytes) else text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_merged_metrics_sum_counts_and_queues_and_average_cache_usage():
    pages = {"a": _page(running=3, waiting=1, finished=2), "b": _page(1, 5, 7)}
    s = _samples(merge_metrics(pages))
    model = (("model_name", "bundled"),)
    assert s[("vllm:num_requests_running", model)] == 4
    assert s[("vllm:num_requests_waiting", model)] == 6
    assert s[("bole_waiting_requests", ())] == 6
    assert s[("vllm:gpu_cache_usage_perc", model)] == pytest.approx((3 / 4 + 1 / 4) / 2)
    assert s[("bole_requests_total", (("status", "length"),))] == 9
    assert s[("vllm:time_to_first_token_seconds_count", model)] == 2
    assert s[("vllm:time_to_first_token_seconds_sum", model)] == pytest.approx(0.09)
    assert s[("bole_replicas", ())] == 2
    apart = _samples(merge_metrics(pages, by_replica=True))
    assert apart[("vllm:num_requests_running",
                  (("model_name", "bundled"), ("replica", "a")))] == 3
    assert apart[("bole_requests_total", (("replica", "b"), ("status", "length")))] == 7
    assert apart[("bole_replicas", ())] == 2


def test_without_ray_replicas_is_a_one_line_error_naming_the_extra(monkeypatch, capsys):
    import sys

    from bole.cli import main
    monkeypatch.setitem(sys.modules, "ray", None)            # import ray raises ImportError
    assert main(["serve", "--device", "cpu", "--replicas", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ('bole serve: --replicas needs Ray Serve, which is not installed (ray): '
                   'pip install "bole[ray]"')


@pytest.mark.parametrize("flags, says", [
    (["--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["--replicas", "2", "--replica-cpus", "0"], "--replica-cpus must be >= 1, got 0"),
])
def test_bad_replica_flags_are_usage_errors(flags, says, capsys):
    from bole.cli import main
    assert main(["serve", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@ray_only
def test_a_ray_address_where_nothing_answers_is_a_usage_error(capsys):
    from bole.cli import main
    from bole.distributed import free_port
    address = f"127.0.0.1:{free_port()}"
    assert main(["serve", "--device", "cpu", "--replicas", "1", "--ray-address", address]) == 2
    err = capsys.readouterr().err
    assert f"--ray-address {address}: no Ray cluster answers there" in err
    assert "Traceback" not in err


# ---- with Ray: bole serve --replicas 2 as a process ----

def _prompts(tok) -> list[list[int]]:
    return [tok.encode(p).ids for p in code_prompts()]


@pytest.fixture(scope="module")
def expected():
    """The bundled prompts' token ids and greedy output (ids, text) on one offline engine."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    prompts = _prompts(tok)
    ids, texts = offline(prompts, tok)
    return prompts, ids, texts


def _complete(url: str, prompt: list[int], stream: bool) -> dict:
    """One greedy completion: its status, token ids (streamed) or text, whether it ended with
    [DONE], and when its response and its first chunk came (monotonic; None: never)."""
    body = dict(model="bundled", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                stream=stream)
    out: dict = dict(started=None, first_chunk=None, status=None, ids=[], text="", done=False,
                     error=None)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as res:
            out["started"], out["status"] = time.monotonic(), res.status_code
            if not stream:
                res.read()
                if res.status_code == 200:
                    out["text"] = res.json()["choices"][0]["text"]
                    out["done"] = True
                return out
            for line in res.iter_lines():
                if line.startswith("data: ") and out["first_chunk"] is None:
                    out["first_chunk"] = time.monotonic()
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out["error"] = chunk["error"]
                    for c in chunk.get("choices", []):
                        out["ids"] += c.get("token_ids") or []
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    return out


def _scrape(url: str, by_replica: bool = False) -> dict[tuple, float]:
    return _samples(httpx.get(url + "/metrics" + ("?by=replica" if by_replica else ""),
                              timeout=30).text)


def _replica_pids(server_pid: int) -> set[int]:
    """The engine replicas' processes among the server's descendants (not the ingress's)."""
    pids = set()
    for pid in children(server_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "ServeReplica" in cmd and ":engine" in cmd and alive(pid):
            pids.add(pid)
    return pids


@ray_only
def test_two_replicas_answer_64_requests_like_one_engine(tmp_path, expected):
    prompts, want_ids, want_texts = expected
    jobs = [(i % len(prompts), i % 2 == 0) for i in range(REQUESTS)]
    with Served(tmp_path, "--replicas", "2", timeout=240) as served:
        with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
            results = list(pool.map(lambda j: _complete(served.url, prompts[j[0]], j[1]), jobs))
        for (p, stream), r in zip(jobs, results):
            assert r["status"] == 200 and r["done"] and r["error"] is None, r
            if stream:
                assert r["ids"] == want_ids[p]
            else:
                assert r["text"] == want_texts[p]
        total, apart = _scrape(served.url), _scrape(served.url, by_replica=True)
        assert len(_replica_pids(served.proc.pid)) == 2
    assert total[("bole_replicas", ())] == 2
    assert total[("bole_requests_total", (("status", "length"),))] == REQUESTS
    per_replica = {dict(labels)["replica"]: v for (name, labels), v in apart.items()
                   if name == "bole_requests_total"}
    assert len(per_replica) == 2 and sum(per_replica.values()) == REQUESTS
    assert all(v > 0 for v in per_replica.values()), f"one replica served all: {per_replica}"
    assert served.returncode == 0, served.output
    assert not served.left, f"processes left behind after SIGTERM: {served.left}"


@ray_only
def test_a_killed_replica_loses_only_streams_that_had_begun(tmp_path, expected):
    """64 greedy requests, one in four streamed, on two replicas; one replica stopped then
    killed mid-run (SIGSTOP, SIGKILL). Every non-streamed request, and every streamed one that
    had received no chunk when the replica was killed, finishes with one engine's output: those
    the dead replica was running are sent again by the ingress. Only streams that had begun may
    fail, with an error event and no [DONE]. Ray starts a new replica."""
    prompts, want_ids, want_texts = expected
    jobs = [(i % len(prompts), i % 4 == 0) for i in range(REQUESTS)]
    with Served(tmp_path, "--replicas", "2", timeout=240) as served:
        victims = sorted(_replica_pids(served.proc.pid))
        assert len(victims) == 2
        with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
            futures = [pool.submit(_complete, served.url, prompts[p], stream)
                       for p, stream in jobs]
            deadline = time.time() + 120
            while sum(f.done() for f in futures) < 8:         # mid-run: some done, most not
                assert time.time() < deadline, "no request finished"
                time.sleep(0.05)
            os.kill(victims[0], signal.SIGSTOP)
            waiting = sum(not f.done() for f in futures)
            time.sleep(1.0)
            killed = time.monotonic()
            os.kill(victims[0], signal.SIGKILL)
            results = [f.result(timeout=300) for f in futures]
        assert waiting >= 16, "the kill came too late to leave requests waiting"
        failed = {i for i, r in enumerate(results) if not (r["status"] == 200 and r["done"])}
        begun = {i for i, ((_, stream), r) in enumerate(zip(jobs, results))
                 if stream and r["first_chunk"] is not None and r["first_chunk"] < killed}
        assert failed <= begun, [(jobs[i], results[i]) for i in failed - begun]
        for i in failed:                        # the stream ended with an error event
            assert results[i]["error"] is not None and results[i]["ids"], results[i]
        for i, ((p, stream), r) in enumerate(zip(jobs, results)):
            if i not in failed:
                assert r["error"] is None, r
                assert (r["ids"] if stream else r["text"]) == \
                    (want_ids[p] if stream else want_texts[p]), r
        resent = _scrape(served.url).get(("bole_resent_requests_total", ()), 0)
        # the killed replica was running requests: each was sent again, or was a stream that
        # had begun and failed
        assert resent + len(failed) >= 1, "the killed replica was running no request"
        deadline = time.time() + 180                          # Ray replaces the dead replica
        while True:
            pids = _replica_pids(served.proc.pid)
            if len(pids) == 2 and victims[0] not in pids and \
                    _scrape(served.url).get(("bole_replicas", ())) == 2:
                break
            assert time.time() < deadline, f"no new replica: {pids}"
            time.sleep(1.0)
        assert _complete(served.url, prompts[0], True)["ids"] == want_ids[0]
    print(f"replica killed: {resent:.0f} requests sent again, {len(failed)} begun streams "
          f"failed, {len(begun)} streams had begun")
    assert served.returncode == 0, served.output
    assert not served.left, f"processes left behind after SIGTERM: {served.left}"


class _FakeEngine:
    """The engine deployment's handle: each ``generate`` call answers the next script."""

    def __init__(self, scripts: list[list]):
        self.scripts, self.calls = scripts, 0
        self.generate = self

    def options(self, stream: bool = False):
        return self

    def remote(self, body, chat):
        self.calls += 1
        return FakeStream(self.scripts.pop(0))


HEAD = (200, [("content-type", "text/event-stream; charset=utf-8")])


@ray_only
@pytest.mark.parametrize("stream", [False, True])
def test_the_ingress_resends_a_request_whose_replica_died_before_its_first_byte(monkeypatch,
                                                                                stream):
    """A replica that dies before the first body chunk (after its headers, or at once): the
    request goes again, and the response is the next replica's; after RESENDS deaths, a 503."""
    import asyncio

    from ray.exceptions import ActorDiedError

    from bole.server import replica_ingress
    from bole.server.replica_ingress import RESENDS, BoleIngress
    monkeypatch.setattr(replica_ingress, "RESEND_BACKOFF_S", 0.0)

    async def body_of(res) -> bytes:
        if not stream:
            return res.body
        return b"".join([c.encode() if isinstance(c, str) else c
                         async for c in res.body_iterator])

    engine = _FakeEngine([[HEAD, ActorDiedError()], [ActorDiedError()], [HEAD, "data: 1\n\n"]])
    ingress = BoleIngress(engine)
    res = asyncio.run(ingress.generate(b"{}", stream, chat=False))
    assert engine.calls == 3 and res.status_code == 200
    assert asyncio.run(body_of(res)) == b"data: 1\n\n"
    assert ingress.resent._value.get() == 2

    engine = _FakeEngine([[ActorDiedError()] for _ in range(RESENDS + 1)])
    res = asyncio.run(BoleIngress(engine).generate(b"{}", stream, chat=False))
    assert engine.calls == RESENDS + 1 and res.status_code == 503


@ray_only
def test_a_stream_whose_replica_dies_after_its_first_chunk_ends_with_an_error_event():
    import asyncio

    from ray.exceptions import ActorDiedError

    from bole.server.replica_ingress import BoleIngress
    engine = _FakeEngine([[HEAD, "data: 1\n\n", ActorDiedError(), "data: [DONE]\n\n"]])

    async def run() -> list[str]:
        res = await BoleIngress(engine).generate(b"{}", True, chat=False)
        return [c async for c in res.body_iterator]
    chunks = asyncio.run(run())
    assert engine.calls == 1 and chunks[0] == "data: 1\n\n" and len(chunks) == 2
    assert json.loads(chunks[1][6:])["error"]["type"] == "server_error"


@ray_only
def test_replicas_of_two_tensor_parallel_ranks(tmp_path, expected):
    """--replicas 2 --tp 2: two replicas, each rank 0 of two gloo ranks (its follower spawned
    in it); 8 concurrent greedy requests, half streamed, equal one engine's output."""
    prompts, want_ids, want_texts = expected
    jobs = [(i % len(prompts), i % 2 == 0) for i in range(8)]
    with Served(tmp_path, "--replicas", "2", "--tp", "2", timeout=240) as served:
        replicas = _replica_pids(served.proc.pid)
        assert len(replicas) == 2
        assert all(children(pid) for pid in replicas), "a replica without its follower rank"
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda j: _complete(served.url, prompts[j[0]], j[1]), jobs))
        for (p, stream), r in zip(jobs, results):
            assert r["status"] == 200 and r["done"] and r["error"] is None, r
            assert (r["ids"] if stream else r["text"]) == \
                (want_ids[p] if stream else want_texts[p])
    assert served.returncode == 0, served.output
    assert not served.left, f"processes left behind after SIGTERM: {served.left}"


@ray_only
def test_the_python_deployment_for_a_ray_cluster(expected):
    """docs/multi-node.md's Python deployment, on a Ray instance of this process: replica_app
    with bole serve's flags, serve.run, one streamed greedy request."""
    from ray import serve

    from bole.cli.serve import replica_app
    from bole.distributed import free_port
    from bole.server.replicas import RayCluster
    from tests.server.served import SHAPE
    prompts, want_ids, _ = expected
    port = free_port()
    cluster = RayCluster(num_cpus=2)
    try:
        cluster.start("127.0.0.1", port)
        serve.run(replica_app(["--device", "cpu", "--replicas", "1", "--max-batch", "2",
                               "--max-len", "256", "--mode", "bole", "--drafter", "mtp",
                               *[f"--{k}={v}" for k, v in SHAPE.items()]]),
                  name="bole", route_prefix="/")
        r = _complete(f"http://127.0.0.1:{port}", prompts[1], True)
        assert r["status"] == 200 and r["done"] and r["ids"] == want_ids[1], r
    finally:
        cluster.stop("bole")


def _broken_build():
    raise ValueError("no such checkpoint")


@ray_only
def test_replicas_that_cannot_start_are_a_clean_error(capsys):
    """A replica whose engine cannot be built: Ray Serve retries, then serve_replicas raises
    DeployFailed (bole serve prints it as one line), and Ray is shut down."""
    import ray

    from bole.distributed import free_port
    from bole.server.replicas import (DeployFailed, RayCluster, ReplicaOptions,
                                      serve_replicas)
    with pytest.raises(DeployFailed, match="the replicas did not start"):
        serve_replicas(ReplicaOptions(1), _broken_build, (), RayCluster(num_cpus=2),
                       "127.0.0.1", free_port())
    assert not ray.is_initialized()
    assert "no such checkpoint" in capsys.readouterr().err

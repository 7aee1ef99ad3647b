"""``bole serve --replicas`` in this process, for the mutation run of ``replica_metrics.py``,
``replica_ingress.py`` and ``replicas.py`` (tests/server/test_replicas.py starts the server in
subprocesses, which mutmut cannot see): the metrics merge against pages written out; the ingress
(:class:`~bole.server.replica_ingress.BoleIngress`) against a stand-in engine handle (re-sends and
their backoff, the 503s, the relay of a stream, a client gone away, the metrics broadcast) and its
FastAPI app driven in-process; an engine replica (:class:`~bole.server.replicas.BoleReplica`)
around the scripted engine (tests/server/scripted.py); the deployment options; and
``serve_replicas`` with a stand-in cluster and ``serve.run``. Tests that import Ray skip without
it (``pip install "bole[ray]"``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys

import pytest

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bole.server import replica_ingress  # noqa: E402
from bole.server.replica_ingress import BoleIngress  # noqa: E402
from bole.server.replica_metrics import merge_metrics  # noqa: E402
from bole.server.replicas import ReplicaOptions  # noqa: E402


def _ray_installed() -> bool:
    try:
        from ray import serve  # noqa: F401
    except ImportError:
        return False
    return True


ray_only = pytest.mark.skipif(not _ray_installed(),
                              reason='needs Ray Serve: pip install "bole[ray]"')


def _samples(text: str | bytes) -> dict[tuple, float]:
    text = text.decode() if isinstance(text, bytes) else text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


# ---- merge_metrics ----

PAGE_A = """\
# HELP req_total Requests
# TYPE req_total counter
req_total{status="stop"} 3.0
req_total{status="length"} 1.0
# HELP req_created Requests
# TYPE req_created gauge
req_created{status="stop"} 100.0
req_created{status="length"} 50.0
# HELP vllm:gpu_cache_usage_perc Cache
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
# HELP bole_cache_usage_ratio Cache
# TYPE bole_cache_usage_ratio gauge
bole_cache_usage_ratio 0.25
# HELP running Running
# TYPE running gauge
running 2.0
"""

PAGE_B = """\
# HELP req_total Requests
# TYPE req_total counter
req_total{status="stop"} 4.0
# HELP req_created Requests
# TYPE req_created gauge
req_created{status="stop"} 70.0
# HELP vllm:gpu_cache_usage_perc Cache
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 1.0
# HELP bole_cache_usage_ratio Cache
# TYPE bole_cache_usage_ratio gauge
bole_cache_usage_ratio 0.75
# HELP running Running
# TYPE running gauge
running 5.0
# HELP lat Latency
# TYPE lat histogram
lat_bucket{le="0.1"} 1.0
lat_bucket{le="+Inf"} 2.0
lat_count 2.0
lat_sum 0.5
"""

PAGE_C = """\
# HELP lat Latency
# TYPE lat histogram
lat_bucket{le="0.1"} 3.0
lat_bucket{le="+Inf"} 3.0
lat_count 3.0
lat_sum 0.25
"""

INGRESS = """\
# HELP bole_http_responses_total HTTP responses
# TYPE bole_http_responses_total counter
bole_http_responses_total{code="200",route="/health"} 7.0
# HELP running Running
# TYPE running gauge
running 1.0
"""


def test_merged_page_is_the_sum_the_mean_of_the_cache_shares_and_the_earliest_created():
    """Replica b's page comes first in the dictionary: the merge reads them in the replicas'
    order; the whole page, written out."""
    page = merge_metrics({"b": PAGE_B.encode(), "a": PAGE_A, "c": PAGE_C})
    assert page.decode() == """\
# HELP req_total Requests
# TYPE req_total counter
req_total{status="stop"} 7.0
req_total{status="length"} 1.0
# HELP req_created Requests
# TYPE req_created gauge
req_created{status="stop"} 70.0
req_created{status="length"} 50.0
# HELP vllm:gpu_cache_usage_perc Cache
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.75
# HELP bole_cache_usage_ratio Cache
# TYPE bole_cache_usage_ratio gauge
bole_cache_usage_ratio 0.5
# HELP running Running
# TYPE running gauge
running 7.0
# HELP lat Latency
# TYPE lat histogram
lat_bucket{le="0.1"} 4.0
lat_bucket{le="+Inf"} 5.0
lat_count 5.0
lat_sum 0.75
# HELP bole_replicas Replicas whose metrics this page holds
# TYPE bole_replicas gauge
bole_replicas 3.0
"""


def test_a_sample_only_some_replicas_have_is_averaged_over_those():
    s = _samples(merge_metrics({"a": PAGE_A, "b": "# TYPE x gauge\nx 1.0\n"}))
    assert s[("bole_cache_usage_ratio", ())] == 0.25
    assert s[("bole_replicas", ())] == 2


def test_the_ingress_page_is_merged_but_not_counted_as_a_replica():
    s = _samples(merge_metrics({"a": PAGE_A, "b": PAGE_B}, extra={"ingress": INGRESS.encode()}))
    assert s[("running", ())] == 8.0
    assert s[("bole_http_responses_total", (("code", "200"), ("route", "/health")))] == 7.0
    assert s[("bole_replicas", ())] == 2.0
    assert _samples(merge_metrics({}, extra={"ingress": INGRESS}))[("bole_replicas", ())] == 0.0
    assert _samples(merge_metrics({}))[("bole_replicas", ())] == 0.0


def test_by_replica_labels_every_sample_with_its_replica():
    page = merge_metrics({"b": PAGE_B, "a": PAGE_A}, by_replica=True,
                         extra={"ingress": INGRESS})
    s = _samples(page)
    assert s[("req_total", (("replica", "a"), ("status", "stop")))] == 3.0
    assert s[("req_total", (("replica", "b"), ("status", "stop")))] == 4.0
    assert s[("req_created", (("replica", "a"), ("status", "length")))] == 50.0
    assert s[("running", (("replica", "a"),))] == 2.0
    assert s[("running", (("replica", "b"),))] == 5.0
    assert s[("running", (("replica", "ingress"),))] == 1.0
    assert s[("bole_cache_usage_ratio", (("replica", "b"),))] == 0.75
    assert s[("lat_count", (("replica", "b"),))] == 2.0
    assert s[("bole_replicas", ())] == 2.0
    assert ("running", ()) not in s
    assert len(s) == 7 + 9 + 2 + 1      # a's, b's and the ingress's samples apart, the count
    # the replicas in order, the labels sorted
    assert page.decode().splitlines()[2:5] == [
        'req_total{replica="a",status="stop"} 3.0',
        'req_total{replica="a",status="length"} 1.0',
        'req_total{replica="b",status="stop"} 4.0',
    ]


# ---- ReplicaOptions ----

def test_replica_options_are_refused_just_outside_their_bounds():
    ReplicaOptions(1, num_cpus=0.01, num_gpus=0.0, max_ongoing_requests=1,
                   max_queued_requests=1, shutdown_timeout=0.0)
    for kwargs, says in [
        (dict(replicas=0), "replicas must be >= 1, got 0"),
        (dict(replicas=1, max_ongoing_requests=0), "max_ongoing_requests must be >= 1, got 0"),
        (dict(replicas=1, max_queued_requests=0), "max_queued_requests must be >= 1, got 0"),
        (dict(replicas=1, num_cpus=0.0),
         "a replica needs num_cpus > 0 and num_gpus >= 0, got 0.0 and 0.0"),
        (dict(replicas=1, num_gpus=-0.5),
         "a replica needs num_cpus > 0 and num_gpus >= 0, got 1.0 and -0.5"),
        (dict(replicas=1, shutdown_timeout=-0.5), "shutdown_timeout must be >= 0, got -0.5"),
    ]:
        with pytest.raises(ValueError) as info:
            ReplicaOptions(**kwargs)
        assert str(info.value) == says


def test_replica_options_defaults_and_deployment_options():
    o = ReplicaOptions(2)
    assert (o.num_cpus, o.num_gpus, o.max_ongoing_requests, o.max_queued_requests,
            o.shutdown_timeout, o.health_check_period_s, o.access_log, o.name) == \
        (1.0, 0.0, 16, 256, 30.0, 2.0, False, "bole")
    o = ReplicaOptions(3, num_cpus=2.0, num_gpus=1.0, max_ongoing_requests=4,
                       max_queued_requests=10, shutdown_timeout=7.0, health_check_period_s=3.0,
                       access_log=True)
    assert o.deployment_options() == dict(
        name="engine", num_replicas=3, ray_actor_options={"num_cpus": 2.0, "num_gpus": 1.0},
        max_ongoing_requests=4, max_queued_requests=10, graceful_shutdown_timeout_s=7.0,
        health_check_period_s=3.0, logging_config={"enable_access_log": True})
    assert o.ingress_options() == dict(
        name="ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10 + 3 * 4 + 64, graceful_shutdown_timeout_s=7.0,
        logging_config={"enable_access_log": True})


# ---- the ingress against a stand-in engine handle ----

class FakeStream:
    """A DeploymentResponseGenerator of these items; an exception among them is raised."""

    def __init__(self, items: list):
        self.items, self.cancelled, self.taken = list(items), False, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        self.taken += 1
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeBroadcast:
    def __init__(self, results):
        self.results, self.asked = results, None

    async def results_async(self, **kwargs):
        self.asked = kwargs
        if isinstance(self.results, BaseException):
            raise self.results
        return self.results


class FakeEngine:
    """The engine deployment's handle: each ``generate`` call answers the next script."""

    def __init__(self, scripts: list[list] = (), card=None, health=(200, {"status": "ok"}),
                 metrics=()):
        self.scripts, self.calls, self.streams, self.options_asked = list(scripts), [], [], []
        self.card, self.card_calls, self.metrics = card or {"id": "m", "object": "model"}, 0, \
            metrics
        self.broadcasts: list = []
        self.generate = Remote(self._generate)
        self.model_card = Remote(self._card)

        async def health_():
            return health
        self.health = Remote(health_)

    def options(self, **kwargs):
        self.options_asked.append(kwargs)
        return self

    def _generate(self, body, chat):
        self.calls.append((body, chat))
        s = FakeStream(self.scripts.pop(0))
        self.streams.append(s)
        return s

    async def _card(self):
        self.card_calls += 1
        return self.card

    def broadcast(self, name):
        b = FakeBroadcast(self.metrics)
        self.broadcasts.append((name, b))
        return b


HEAD = (200, [("content-type", "text/event-stream; charset=utf-8")])


@pytest.fixture
def sleeps(monkeypatch):
    """The backoffs asked for (none waited)."""
    asked = []

    async def sleep(s):
        asked.append(s)
    monkeypatch.setattr(replica_ingress.asyncio, "sleep", sleep)
    return asked


def test_start_takes_the_head_and_first_chunk_of_a_stream_and_every_item_of_a_whole():
    engine = FakeEngine([[HEAD, "a", "b", "c"], [HEAD, "a", "b", "c"]])
    ingress = BoleIngress(engine)
    items, rest = asyncio.run(ingress._start(b"{1}", True, whole=False))
    assert items == [HEAD, "a"] and rest is engine.streams[0] and rest.items == ["b", "c"]
    assert engine.calls == [(b"{1}", True)] and engine.options_asked == [{"stream": True}]
    items, rest = asyncio.run(ingress._start(b"{2}", False, whole=True))
    assert items == [HEAD, "a", "b", "c"] and rest.items == []
    assert engine.calls[1] == (b"{2}", False) and engine.options_asked[1] == {"stream": True}


@ray_only
def test_start_resends_after_a_death_with_a_growing_backoff_and_says_so(sleeps, caplog):
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import ReplicaUnavailableError
    engine = FakeEngine([[HEAD, ActorDiedError()], [ReplicaUnavailableError("r")],
                         [ActorDiedError()], [HEAD, "x", "y"]])
    ingress = BoleIngress(engine)
    with caplog.at_level(logging.WARNING, logger="bole.server"):
        items, rest = asyncio.run(ingress._start(b"{}", False, whole=False))
    assert items == [HEAD, "x"] and rest is engine.streams[3] and len(engine.calls) == 4
    assert sleeps == [0.5, 1.0, 1.5]
    assert ingress.resent._value.get() == 3
    assert not any(s.cancelled for s in engine.streams)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "the replica of a request died before its first byte (ActorDiedError): sending it "
        "again (1 of 3)",
        "the replica of a request died before its first byte (ReplicaUnavailableError): "
        "sending it again (2 of 3)",
        "the replica of a request died before its first byte (ActorDiedError): sending it "
        "again (3 of 3)"]


@ray_only
def test_start_gives_up_after_three_resends_and_never_resends_a_request_error(sleeps):
    from ray.exceptions import ActorDiedError
    engine = FakeEngine([[ActorDiedError()] for _ in range(5)])
    ingress = BoleIngress(engine)
    with pytest.raises(ActorDiedError):
        asyncio.run(ingress._start(b"{}", False, whole=True))
    assert len(engine.calls) == 4 and sleeps == [0.5, 1.0, 1.5]
    assert ingress.resent._value.get() == 3
    engine = FakeEngine([[HEAD, ValueError("bad")], [HEAD, "x"]])
    with pytest.raises(ValueError, match="bad"):
        asyncio.run(BoleIngress(engine)._start(b"{}", False, whole=True))
    assert len(engine.calls) == 1


def test_start_cancels_its_stream_when_it_is_cancelled():
    engine = FakeEngine([[HEAD, asyncio.CancelledError()]])
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(BoleIngress(engine)._start(b"{}", False, whole=True))
    assert engine.streams[0].cancelled


@ray_only
def test_replica_died_tells_a_dead_replica_from_an_error_of_the_request():
    from ray.exceptions import ActorDiedError, RayActorError, RayTaskError
    from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError

    from bole.server.replica_ingress import replica_died
    assert replica_died(RayActorError())
    assert replica_died(ActorDiedError())
    assert replica_died(ReplicaUnavailableError("r"))
    assert replica_died(RayTaskError("f", "tb", ActorDiedError()))
    assert not replica_died(RayTaskError("f", "tb", ValueError("x")))
    assert not replica_died(ValueError("x"))
    assert not replica_died(BackPressureError(num_queued_requests=3, max_queued_requests=3))


def _run(coro):
    return asyncio.run(coro)


async def _body(res) -> list:
    return [c async for c in res.body_iterator]


@ray_only
def test_a_whole_response_is_the_replicas_status_headers_and_body(sleeps):
    from ray.exceptions import ActorDiedError
    head = (400, [("content-type", "application/json"), ("x-bole", "1")])
    engine = FakeEngine([[HEAD, ActorDiedError()], [head, '{"a":', b' 1}']])
    res = _run(BoleIngress(engine).generate(b'{"q": 1}', False, chat=True))
    assert res.status_code == 400 and res.body == b'{"a": 1}'
    assert res.headers["x-bole"] == "1" and res.headers["content-type"] == "application/json"
    assert res.headers["content-length"] == "8"
    assert engine.calls == [(b'{"q": 1}', True), (b'{"q": 1}', True)]


@ray_only
def test_a_full_queue_is_a_503_to_retry_in_a_second():
    from ray.serve.exceptions import BackPressureError
    exc = BackPressureError(num_queued_requests=3, max_queued_requests=3)
    engine = FakeEngine([[exc]])
    res = _run(BoleIngress(engine).generate(b"{}", True, chat=False))
    assert res.status_code == 503 and res.headers["retry-after"] == "1"
    assert json.loads(res.body) == {"error": {
        "message": f"every replica is busy and the queue is full: {exc}", "type": "server_busy",
        "param": None, "code": None}}
    assert len(engine.calls) == 1


@ray_only
def test_replicas_dying_four_times_is_a_503_to_retry_in_five_seconds(sleeps):
    from ray.exceptions import ActorDiedError
    engine = FakeEngine([[ActorDiedError()] for _ in range(4)])
    res = _run(BoleIngress(engine).generate(b"{}", False, chat=False))
    assert res.status_code == 503 and res.headers["retry-after"] == "5"
    assert json.loads(res.body) == {"error": {
        "message": "the replicas serving this request died 4 times (ActorDiedError); retry "
                   "later", "type": "server_error", "param": None, "code": None}}
    engine = FakeEngine([[KeyError("k")]])
    with pytest.raises(KeyError):
        _run(BoleIngress(engine).generate(b"{}", False, chat=False))


@ray_only
def test_a_stream_is_relayed_whole_without_its_content_length():
    head = (201, [("content-type", "text/event-stream"), ("content-length", "99"),
                  ("x-bole", "2")])
    engine = FakeEngine([[head, "data: 1\n\n", b"data: 2\n\n", "data: [DONE]\n\n"]])

    async def go():
        res = await BoleIngress(engine).generate(b"{}", True, chat=False)
        return res, await _body(res)
    res, chunks = _run(go())
    assert res.status_code == 201 and res.headers["x-bole"] == "2"
    assert "content-length" not in res.headers
    assert res.headers["content-type"] == "text/event-stream"
    assert chunks == ["data: 1\n\n", b"data: 2\n\n", "data: [DONE]\n\n"]
    assert not engine.streams[0].cancelled


@ray_only
def test_a_client_gone_away_cancels_the_replicas_stream():
    engine = FakeEngine([[HEAD, "data: 1\n\n", "data: 2\n\n", "data: 3\n\n"]])

    async def go():
        res = await BoleIngress(engine).generate(b"{}", True, chat=False)
        it = res.body_iterator
        first = [await it.__anext__(), await it.__anext__()]
        assert not engine.streams[0].cancelled
        await it.aclose()
        return first
    assert _run(go()) == ["data: 1\n\n", "data: 2\n\n"]
    assert engine.streams[0].cancelled and engine.streams[0].items == ["data: 3\n\n"]


@ray_only
@pytest.mark.parametrize("dies", [True, False])
def test_a_stream_that_fails_after_its_first_chunk_ends_with_an_error_event(dies, caplog):
    from ray.exceptions import ActorDiedError
    exc = ActorDiedError() if dies else RuntimeError("boom")
    engine = FakeEngine([[HEAD, "data: 1\n\n", "data: 2\n\n", exc, "data: [DONE]\n\n"]])

    async def go():
        res = await BoleIngress(engine).generate(b"{}", True, chat=False)
        return await _body(res)
    with caplog.at_level(logging.ERROR, logger="bole.server"):
        chunks = _run(go())
    assert chunks[:2] == ["data: 1\n\n", "data: 2\n\n"] and len(chunks) == 3
    name = type(exc).__name__
    assert chunks[2] == "data: " + json.dumps({"error": {
        "message": f"the replica serving this request stopped ({name}); retry the request",
        "type": "server_error", "param": None, "code": None}}) + "\n\n"
    assert not engine.streams[0].cancelled and len(engine.calls) == 1
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert logged == ([] if dies else ["a streamed request failed"])


def test_the_card_is_asked_once():
    engine = FakeEngine(card={"id": "x"})
    ingress = BoleIngress(engine)

    async def go():
        return [await ingress.card(), await ingress.card()]
    assert _run(go()) == [{"id": "x"}, {"id": "x"}] and engine.card_calls == 1


def _replica_page(n: int) -> bytes:
    return f"# TYPE running gauge\nrunning {n}.0\n".encode()


def test_all_metrics_merges_the_replicas_that_answered_and_the_ingress():
    engine = FakeEngine(metrics=[("r1", _replica_page(2)), RuntimeError("down"),
                                 ("r2", _replica_page(3)), None])
    ingress = BoleIngress(engine)
    ingress.http.labels("/health", "200").inc(4)
    ingress.resent.inc(2)
    s = _samples(_run(ingress.all_metrics(False)))
    assert [n for n, _ in engine.broadcasts] == ["replica_metrics"]
    assert engine.broadcasts[0][1].asked == {"timeout_s": 5.0, "return_exceptions": True}
    assert s[("running", ())] == 5.0 and s[("bole_replicas", ())] == 2.0
    assert s[("bole_http_responses_total", (("code", "200"), ("route", "/health")))] == 4.0
    assert s[("bole_resent_requests_total", ())] == 2.0
    apart = _samples(_run(ingress.all_metrics(True)))
    assert apart[("running", (("replica", "r1"),))] == 2.0
    assert apart[("running", (("replica", "r2"),))] == 3.0
    assert apart[("bole_resent_requests_total", (("replica", "ingress"),))] == 2.0


def test_the_ingress_counters_help_is_the_engines():
    """The ingress's HTTP counter is the engines' family (one HELP line whichever page the merge
    reads first); its re-send counter says what it counts."""
    from bole.server.metrics import ServerMetrics

    class Queue:
        num_running = num_waiting = 0

    def helps(page: bytes) -> dict:
        return {f.name: f.documentation
                for f in text_string_to_metric_families(page.decode())}
    engine_page = ServerMetrics(Queue(), "m", slots=4).render()
    ingress = BoleIngress(FakeEngine(metrics=[("r1", engine_page)]))
    ingress.http.labels("/health", "200").inc()
    ingress_help = helps(_run(ingress.all_metrics(False)))
    assert ingress_help["bole_http_responses"] == helps(engine_page)["bole_http_responses"]
    assert ingress_help["bole_resent_requests"] == (
        "Requests sent again because their replica died before their first byte")


def test_all_metrics_without_an_answer_in_time_is_the_ingress_page_alone():
    engine = FakeEngine(metrics=TimeoutError())
    ingress = BoleIngress(engine)
    ingress.resent.inc()
    s = _samples(_run(ingress.all_metrics(False)))
    assert s[("bole_replicas", ())] == 0.0 and s[("bole_resent_requests_total", ())] == 1.0


@contextlib.contextmanager
def bare_root():
    """The root logger as a fresh process has it (no handler, WARNING), put back after (in the
    test's body: pytest adds its handlers to the root logger after the fixtures' set-up)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = []
    root.setLevel(logging.WARNING)
    try:
        yield root
    finally:
        root.handlers = handlers
        root.setLevel(level)


def _log_lines(root) -> tuple[int, list[str]]:
    record = logging.makeLogRecord({"msg": "hello %s", "args": ("there",)})
    return root.level, [h.format(record) for h in root.handlers]


def test_the_ingress_logs_its_info_lines_marked_as_its_own():
    with bare_root() as root:
        BoleIngress(FakeEngine())
        assert _log_lines(root) == (logging.INFO, ["[bole ingress] hello there"])


# ---- the ingress's app, in-process ----

@pytest.fixture
def app_of():
    def make(engine, api_key=None, calls=None):
        ingress = BoleIngress(engine, api_key)
        if calls is not None:
            from fastapi.responses import JSONResponse

            async def generate(body, stream, chat):
                calls.append((body, stream, chat))
                return JSONResponse({"ok": len(calls)}, status_code=202)
            ingress.generate = generate
        return ingress, TestClient(ingress.__serve_build_asgi_app__())
    return make


def test_app_is_titled_as_the_single_servers(app_of):
    _, client = app_of(FakeEngine())
    assert client.get("/openapi.json").json()["info"]["title"] == "Bole"


def test_app_health_is_the_engines(app_of):
    _, client = app_of(FakeEngine(health=(503, {"error": "down"})))
    r = client.get("/health")
    assert r.status_code == 503 and r.json() == {"error": "down"}
    _, client = app_of(FakeEngine(health=(200, {"status": "ok", "running": 1})))
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "running": 1}


def test_app_models_and_a_model_by_id(app_of):
    card = {"id": "org/model", "object": "model", "owned_by": "bole"}
    _, client = app_of(FakeEngine(card=card))
    assert client.get("/v1/models").json() == {"object": "list", "data": [card]}
    assert client.get("/v1/models/org/model").json() == card
    r = client.get("/v1/models/other")
    assert r.status_code == 404
    assert r.json() == {"error": {
        "message": "unknown model 'other'; this server serves 'org/model'",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}


def test_app_metrics_merged_or_by_replica_and_the_http_counter(app_of):
    engine = FakeEngine(metrics=[("r1", _replica_page(2)), ("r2", _replica_page(3))])
    ingress, client = app_of(engine)
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == \
        "text/plain; version=0.0.4; charset=utf-8"
    s = _samples(r.text)
    assert s[("running", ())] == 5.0 and s[("bole_replicas", ())] == 2.0
    r = client.get("/metrics?by=replica")
    s = _samples(r.text)
    assert s[("running", (("replica", "r2"),))] == 3.0 and ("running", ()) not in s
    assert s[("bole_http_responses_total",
              (("code", "200"), ("replica", "ingress"), ("route", "/metrics")))] == 1.0
    assert ("running", ()) in _samples(client.get("/metrics?by=other").text)


def test_app_sends_the_raw_body_and_the_stream_flag(app_of):
    calls: list = []
    _, client = app_of(FakeEngine(), calls=calls)
    raw = b'{"model": "m", "prompt": "hi",   "stream": true}'
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 202 and r.json() == {"ok": 1}
    raw2 = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    r = client.post("/v1/chat/completions", content=raw2,
                    headers={"content-type": "application/json"})
    assert r.status_code == 202
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": False})
    assert calls[0] == (raw, True, False) and calls[1] == (raw2, False, True)
    assert calls[2][1:] == (False, False)
    r = client.post("/v1/completions", json={"model": "m"})      # no prompt: validated here
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and len(calls) == 3


def test_app_asks_for_the_api_key_but_on_health_and_metrics(app_of):
    calls: list = []
    ingress, client = app_of(FakeEngine(metrics=[]), api_key="sesame", calls=calls)
    r = client.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 401 and calls == []
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    good = {"Authorization": "Bearer sesame"}
    assert client.get("/v1/models", headers=good).status_code == 200
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=good)
    assert r.status_code == 202 and len(calls) == 1
    counts = {(s.labels["route"], s.labels["code"]): s.value
              for s in ingress.http.collect()[0].samples if s.name.endswith("_total")}
    assert counts == {("unmatched", "401"): 2, ("/health", "200"): 1, ("/metrics", "200"): 1,
                      ("/v1/models", "200"): 1, ("/v1/completions", "202"): 1}


# ---- an engine replica around the scripted engine ----

@pytest.fixture
def replica(monkeypatch):
    """A BoleReplica of the scripted engine's server (its engine thread started); stopped
    after the test, torch's threads and the switch interval put back."""
    import torch

    from bole.server.api import BoleServer
    from bole.server.replicas import BoleReplica
    from tests.server.scripted import ScriptedEngine
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    made = []

    def build(name, max_slots):
        made.append((name, max_slots))
        return BoleServer(ScriptedEngine(max_slots=max_slots), name)
    rep = BoleReplica(build, ("scripted", 3), num_threads=None)
    rep.made = made
    try:
        yield rep
    finally:
        rep.server.engine.go()
        rep.__del__()
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)


def test_a_replica_builds_its_server_and_starts_its_engine_thread(replica):
    from bole.server.api import GIL_SWITCH_INTERVAL
    assert replica.made == [("scripted", 3)]
    assert replica.server.loop.thread.is_alive() and replica.others_alive is None
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL)


def test_a_replica_sets_torchs_threads_when_told():
    import torch

    from bole.server.replicas import BoleReplica, ReplicaServer

    class Loop:
        started = stopped = 0

        def start(self):
            Loop.started += 1

        def stop(self):
            Loop.stopped += 1

    class Pool:
        def shutdown(self, **kw):
            self.kw = kw

    class Server:
        loop, text_pool = Loop(), Pool()
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    try:
        alive = lambda: False  # noqa: E731
        rep = BoleReplica(lambda: ReplicaServer(Server(), alive), num_threads=1)
        assert torch.get_num_threads() == 1 and Loop.started == 1
        assert isinstance(rep.server, Server) and rep.others_alive is alive
        rep.__del__()
        assert Loop.stopped == 1 and rep.server.text_pool.kw == dict(wait=False,
                                                                     cancel_futures=True)
        BoleReplica(lambda: Server(), num_threads=0)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)


def test_a_replica_logs_its_info_lines_marked_as_its_own():
    from bole.server.replicas import BoleReplica

    class Loop:
        def start(self):
            pass

    class Server:
        loop = Loop()
    interval = sys.getswitchinterval()
    try:
        with bare_root() as root:
            rep = BoleReplica(lambda: Server())
            assert _log_lines(root) == (logging.INFO, ["[bole replica] hello there"])
        rep.server = None
    finally:
        sys.setswitchinterval(interval)


def test_a_replica_whose_build_failed_goes_away_quietly():
    """Ray Serve collects a replica whose constructor raised: nothing to stop, no error."""
    from bole.server.replicas import BoleReplica
    BoleReplica.__new__(BoleReplica).__del__()


def _collect(replica, body: dict, chat: bool, take: int | None = None) -> list:
    async def go():
        gen = replica.generate(json.dumps(body).encode(), chat)
        out = []
        async for item in gen:
            out.append(item)
            if take is not None and len(out) == take:
                await gen.aclose()
                break
        return out
    return asyncio.run(go())


def test_a_replica_answers_a_whole_completion_as_status_headers_then_body(replica):
    items = _collect(replica, {"model": "scripted", "prompt": "hi", "max_tokens": 4}, False)
    assert len(items) == 2
    status, headers = items[0]
    assert status == 200 and ("content-type", "application/json") in headers
    body = json.loads(items[1])
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4
    assert dict(headers)["content-length"] == str(len(items[1]))
    assert replica.server.event_loop is not None


def test_a_whole_response_outlasting_the_disconnect_poll_completes(replica):
    """Under Ray Serve a client gone away cancels the call: the replica's connection stand-in
    never says it went away, however long the response takes (here held for 0.3 s, three of
    respond's 0.1 s polls)."""
    import threading
    engine = replica.server.engine
    engine.hold()
    timer = threading.Timer(0.3, engine.go)
    timer.start()
    try:
        items = _collect(replica, {"model": "scripted", "prompt": "hi", "max_tokens": 4}, False)
    finally:
        timer.cancel()
        engine.go()
    assert items[0][0] == 200 and json.loads(items[1])["usage"]["completion_tokens"] == 4


def test_a_replica_streams_a_chat_as_sse_chunks(replica):
    items = _collect(replica, {"model": "scripted", "max_tokens": 3, "stream": True,
                               "messages": [{"role": "user", "content": "hi"}]}, True)
    status, headers = items[0]
    assert status == 200 and dict(headers)["content-type"].startswith("text/event-stream")
    chunks = [c.decode() if isinstance(c, bytes) else c for c in items[1:]]
    assert chunks[-1] == "data: [DONE]\n\n"
    first = json.loads(chunks[0][6:])
    assert first["object"] == "chat.completion.chunk"


def test_a_replica_answers_a_bad_request_with_its_400(replica):
    items = _collect(replica, {"model": "scripted", "prompt": "hi", "max_tokens": 10 ** 6},
                     False)
    assert items[0][0] == 400 and json.loads(items[1])["error"]["type"] == \
        "invalid_request_error"


def test_a_stream_closed_early_frees_its_slot(replica):
    import time
    replica.server.engine.hold()
    items = _collect(replica, {"model": "scripted", "prompt": "hi", "max_tokens": 200,
                               "stream": True}, False, take=2)
    assert items[0][0] == 200
    replica.server.engine.go()
    deadline = time.monotonic() + 10
    while replica.server.scheduler.num_running or replica.server.scheduler.num_waiting:
        assert time.monotonic() < deadline, "the closed stream's request still runs"
        time.sleep(0.01)
    assert replica.server.engine.cache.num_free == 3


def test_a_replica_health_card_and_health_check(replica):
    from bole.engine.spec import SpecConfig
    assert replica.health() == (200, {"status": "ok", "running": 0, "waiting": 0})
    spec = replica.server.info.spec
    assert spec == SpecConfig("bole", "mtp", depth=3, topk=2, budget=8)
    assert replica.model_card() == {
        "id": "scripted", "object": "model", "created": 0, "owned_by": "bole",
        "max_model_len": 256,
        "bole": {"mode": "bole", "drafter": "mtp", "depth": 3, "topk": 2, "budget": 8}}
    replica.check_health()
    replica.others_alive = lambda: True
    replica.check_health()
    replica.others_alive = lambda: False
    with pytest.raises(RuntimeError, match="^a tensor-parallel rank exited$"):
        replica.check_health()
    replica.others_alive = None
    loop = replica.server.loop
    loop.stop()
    assert replica.health()[0] == 200           # stopped, no error: still healthy
    loop.error = RuntimeError("round failed")
    assert replica.health() == (503, {"error": {
        "message": "the engine stopped; restart the server", "type": "server_error",
        "param": None, "code": None}})
    with pytest.raises(RuntimeError, match="^the engine stopped$"):
        replica.check_health()


def test_a_replica_counts_what_it_runs_and_queues():
    from bole.server.replicas import BoleReplica

    class Loop:
        def start(self):
            pass

        def healthy(self):
            return True

    class Sched:
        num_running, num_waiting = 2, 5

    class Server:
        loop, scheduler = Loop(), Sched()
    interval = sys.getswitchinterval()
    try:
        rep = BoleReplica(lambda: Server())
        rep.server = None                                   # __del__ has nothing to stop
        rep.server = Server()
        assert rep.health() == (200, {"status": "ok", "running": 2, "waiting": 5})
        rep.server = None
    finally:
        sys.setswitchinterval(interval)


@ray_only
def test_replica_metrics_is_its_id_and_its_page(replica, monkeypatch):
    from types import SimpleNamespace

    from ray import serve
    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(
        replica_id=SimpleNamespace(unique_id="abc")))
    rid, page = replica.replica_metrics()
    assert rid == "abc" and page == replica.server.metrics.render()
    assert b"bole_replicas" not in page and b"vllm:num_requests_running" in page


def test_connected_is_never_gone():
    from bole.server.replicas import _Connected
    assert asyncio.run(_Connected().is_disconnected()) is False


# ---- the application, serve_replicas and its signals, without a cluster ----

@ray_only
def test_replica_app_deploys_the_engine_behind_the_ingress(monkeypatch):
    from ray import serve

    from bole.server.replicas import BoleReplica, replica_app
    made = []

    class Deployment:
        def __init__(self, options, cls):
            self.options, self.cls = options, cls

        def bind(self, *args):
            return ("bound", self.options["name"], self.cls, args)

    def deployment(**options):
        return lambda cls: Deployment(options, cls)

    def ingress():
        def wrap(cls):
            made.append(cls)
            return cls
        return wrap
    monkeypatch.setattr(serve, "deployment", deployment)
    monkeypatch.setattr(serve, "ingress", ingress)

    def build():
        pass
    o = ReplicaOptions(2, num_cpus=3.5)
    app = replica_app(o, build, ("x",), api_key="k")
    assert app == ("bound", "ingress", BoleIngress,
                   (("bound", "engine", BoleReplica, (build, ("x",), 3)), "k"))
    assert made == [BoleIngress]
    app = replica_app(ReplicaOptions(1, num_cpus=0.5), build)
    assert app[3] == (("bound", "engine", BoleReplica, (build, (), 1)), None)
    app = replica_app(ReplicaOptions(1, num_cpus=4, num_gpus=1), build)
    assert app[3][0][3] == (build, (), None)


def test_require_ray_names_the_extra(monkeypatch):
    from bole.server.replicas import RayMissing, require_ray
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(RayMissing) as info:
        require_ray()
    assert str(info.value) == ('--replicas needs Ray Serve, which is not installed (ray): '
                               'pip install "bole[ray]"')


class FakeCluster:
    def __init__(self):
        self.events = []

    def start(self, host, port):
        self.events.append(("start", host, port))

    def stop(self, name):
        self.events.append(("stop", name, signal.getsignal(signal.SIGINT),
                            signal.getsignal(signal.SIGTERM)))


@pytest.fixture
def handlers():
    """SIGINT's and SIGTERM's handlers, put back after the test."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield before
    for s, h in before.items():
        signal.signal(s, h)


def _mark(signum, frame):
    pass


@ray_only
def test_serve_replicas_runs_until_interrupted_then_stops_the_cluster(monkeypatch, handlers,
                                                                     caplog):
    import time

    from ray import serve

    from bole.server import replicas
    signal.signal(signal.SIGTERM, _mark)
    seen = {}
    monkeypatch.setattr(replicas, "replica_app", lambda *a: ("app", a))

    def run(app, name, route_prefix):
        seen["run"] = (app, name, route_prefix)
        handler = signal.getsignal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            handler(signal.SIGTERM, None)
    slept = []

    def sleep(s):
        slept.append(s)
        if len(slept) == 3:
            raise KeyboardInterrupt
    monkeypatch.setattr(serve, "run", run)
    monkeypatch.setattr(time, "sleep", sleep)
    cluster = FakeCluster()
    o = ReplicaOptions(2, name="appname")
    with caplog.at_level(logging.INFO, logger="bole.server"):
        replicas.serve_replicas(o, "build", ("a",), cluster, "h", 9, api_key="k")
    assert [r.getMessage() for r in caplog.records if r.name == "bole.server"] == [
        "serving 2 replicas on http://h:9", "stopping the replicas"]
    assert seen["run"] == (("app", (o, "build", ("a",), "k")), "appname", "/")
    assert slept == [1.0, 1.0, 1.0]
    assert cluster.events == [("start", "h", 9),
                              ("stop", "appname", signal.SIG_IGN, signal.SIG_IGN)]
    assert signal.getsignal(signal.SIGTERM) is _mark
    assert signal.getsignal(signal.SIGINT) is handlers[signal.SIGINT]


@ray_only
def test_serve_replicas_that_fail_to_deploy_raise_deploy_failed_and_stop(monkeypatch, handlers):
    from ray import serve

    from bole.server import replicas
    monkeypatch.setattr(replicas, "replica_app", lambda *a: "app")

    def run(app, name, route_prefix):
        raise RuntimeError("retries exhausted")
    monkeypatch.setattr(serve, "run", run)
    cluster = FakeCluster()
    with pytest.raises(replicas.DeployFailed) as info:
        replicas.serve_replicas(ReplicaOptions(1), "build", (), cluster, "h", 9)
    assert str(info.value) == ("the replicas did not start: retries exhausted (the replicas' "
                               "errors are in the log above)")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert [e[:2] for e in cluster.events] == [("start", "h"), ("stop", "bole")]
    assert signal.getsignal(signal.SIGTERM) is handlers[signal.SIGTERM]


def test_signals_only_change_in_the_main_thread(handlers):
    import threading

    from bole.server.replicas import _Signals
    signal.signal(signal.SIGTERM, _mark)
    done = {}

    def elsewhere():
        s = _Signals()
        s.interrupt_on_sigterm()
        s.ignore()
        done["main"] = s.main
        done["term"] = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    assert done == {"main": False, "term": _mark}
    s = _Signals()
    assert s.main and s.before == {signal.SIGINT: handlers[signal.SIGINT],
                                   signal.SIGTERM: _mark}
    s.ignore()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    s.before[signal.SIGINT] = None               # set outside Python: left as it is
    s.restore()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is _mark


@ray_only
def test_ending_processes_waits_then_kills_those_left():
    import subprocess

    import ray  # noqa: F401
    import psutil

    from bole.server.replicas import _end
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        procs = [psutil.Process(quick.pid), psutil.Process(slow.pid)]
        _end(procs, grace=0.5)
        assert [p.returncode for p in procs] == [0, -signal.SIGKILL]
    finally:
        slow.kill()
        slow.wait()


@ray_only
def test_stopping_a_cluster_that_never_started_does_nothing():
    import ray

    from bole.server.replicas import RayCluster
    assert not ray.is_initialized()
    RayCluster().stop("bole")
    assert not ray.is_initialized()


def _child_with_grandchild():
    """A child process (a shell) and the pid of its own child (a sleep)."""
    import subprocess
    child = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE,
                             text=True)
    return child, int(child.stdout.readline())


def _kill(child, grandchild):
    import os
    try:
        os.kill(grandchild, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.kill()
    child.wait()
    child.stdout.close()


@ray_only
def test_a_ray_cluster_starts_its_own_instance_or_joins_one(monkeypatch):
    import ray
    from ray import serve

    from bole.server.replicas import RayCluster
    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(serve, "start", lambda **kw: calls.append(("serve", kw)))
    child, grandchild = _child_with_grandchild()
    try:
        own = RayCluster(num_cpus=3, num_gpus=1)
        own.start("h", 9)
        assert {child.pid, grandchild} <= own._before      # not Ray's: left alone at stop
        assert calls == [("init", dict(address="local", num_cpus=3, num_gpus=1,
                                       include_dashboard=False, log_to_driver=True)),
                         ("serve", dict(http_options={"host": "h", "port": 9}))]
        calls.clear()
        RayCluster(address="auto").start("0.0.0.0", 8)
        assert calls == [("init", dict(address="auto", log_to_driver=True)),
                         ("serve", dict(http_options={"host": "0.0.0.0", "port": 8}))]
    finally:
        _kill(child, grandchild)


@ray_only
@pytest.mark.parametrize("fails", [False, True])
def test_a_ray_cluster_of_its_own_stops_serve_then_ray_then_its_processes(monkeypatch, fails):
    import ray
    from ray import serve

    from bole.server import replicas
    calls = []

    def serve_shutdown():
        calls.append("serve.shutdown")
        if fails:
            raise RuntimeError("controller gone")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(serve, "shutdown", serve_shutdown)
    monkeypatch.setattr(serve, "delete", lambda name: calls.append(("delete", name)))
    monkeypatch.setattr(replicas, "_end",
                        lambda procs: calls.append(("end", sorted(p.pid for p in procs))))
    before = _child_with_grandchild()
    cluster = replicas.RayCluster(_before={before[0].pid, before[1]})
    after = _child_with_grandchild()
    try:
        if fails:
            with pytest.raises(RuntimeError, match="controller gone"):
                cluster.stop("bole")
        else:
            cluster.stop("bole")
        assert calls == ["serve.shutdown", "ray.shutdown",
                         ("end", sorted([after[0].pid, after[1]]))]
    finally:
        _kill(*before)
        _kill(*after)


@ray_only
def test_a_joined_ray_cluster_deletes_only_its_application(monkeypatch):
    import ray
    from ray import serve

    from bole.server import replicas
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(serve, "delete", lambda name: calls.append(("delete", name)))
    monkeypatch.setattr(replicas, "_end", lambda procs: calls.append(("end", list(procs))))
    child = _child_with_grandchild()
    try:
        replicas.RayCluster(address="auto").stop("myapp")
    finally:
        _kill(*child)
    assert calls == [("delete", "myapp"), "ray.shutdown", ("end", [])]

"""The front of ``bole serve --replicas N``: one Ray Serve ingress deployment (the FastAPI app:
routes, API key, request validation, the HTTP counters) in front of the engine deployment
(:class:`bole.server.replicas.BoleReplica`), reached through a ``DeploymentHandle`` whose
router picks the engine replica (power of two choices).

Every generation goes to the engine as a stream (``handle.options(stream=True)``): the response's
status and headers first, then its body, whole or chunk by chunk (SSE). The ingress sends the
client nothing before the first body chunk has arrived, so a request whose engine replica dies
before that (``ActorDiedError`` and its kin) is re-sent, up to :data:`RESENDS` times, to a replica
that is alive (the router drops the dead one), or to its replacement. A non-streamed response is
one body chunk: it is re-sent whenever its replica dies. Once a chunk has reached the client, a
death ends the stream with an error event, without ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from fastapi import Request as HTTPRequest

# at module level: FastAPI resolves the routes' annotations here
from bole.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("bole.server")

__all__ = ["RESENDS", "BoleIngress", "replica_died"]

#: how many times a request whose replica died before its first byte is sent again
RESENDS = 3
#: seconds before a re-send, times the attempt (the controller notices the death meanwhile)
RESEND_BACKOFF_S = 0.5
#: seconds a /metrics page waits for the replicas' pages
METRICS_TIMEOUT_S = 5.0


def replica_died(exc: BaseException) -> bool:
    """The engine replica running the request is gone (its process died or cannot be
    reached), as opposed to an error of the request itself."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve.exceptions import ReplicaUnavailableError
    if isinstance(exc, (RayActorError, ReplicaUnavailableError)):
        return True
    return isinstance(exc, RayTaskError) and isinstance(getattr(exc, "cause", None),
                                                        RayActorError)


def _sse_error(message: str) -> str:
    from bole.server.protocol import error_body
    return f"data: {json.dumps(error_body(message, 'server_error'))}\n\n"


class BoleIngress:
    """The ingress deployment: ``engine`` is the handle of the engine deployment;
    ``api_key``: required as ``Authorization: Bearer`` (None: open)."""

    def __init__(self, engine: Any, api_key: str | None = None):
        from prometheus_client import CollectorRegistry, Counter
        logging.basicConfig(level=logging.INFO, format="[bole ingress] %(message)s")
        self.engine, self.api_key = engine, api_key
        self.registry = CollectorRegistry(auto_describe=True)
        # the same family as an engine's ServerMetrics.http: /metrics sums them
        self.http = Counter("bole_http_responses", "HTTP responses by route and status code",
                            ["route", "code"], registry=self.registry)
        self.resent = Counter("bole_resent_requests",
                              "Requests sent again because their replica died before their "
                              "first byte", registry=self.registry)
        self._card: dict | None = None

    async def card(self) -> dict:
        """The served model's card (the same on every replica; asked once)."""
        if self._card is None:
            self._card = await self.engine.model_card.remote()
        return self._card

    async def _start(self, body: bytes, chat: bool, whole: bool) -> tuple[list, Any]:
        """The engine's first items (status and headers, then the first body chunk; ``whole``:
        every item) and the stream of the rest; re-sent while the replica dies first."""
        for attempt in range(RESENDS + 1):
            stream = self.engine.options(stream=True).generate.remote(body, chat)
            items: list = []
            try:
                async for item in stream:
                    items.append(item)
                    if not whole and len(items) == 2:
                        break
                return items, stream
            except Exception as exc:
                if not replica_died(exc) or attempt == RESENDS:
                    raise
                log.warning("the replica of a request died before its first byte (%s): "
                            "sending it again (%d of %d)", type(exc).__name__, attempt + 1,
                            RESENDS)
                self.resent.inc()
                await asyncio.sleep(RESEND_BACKOFF_S * (attempt + 1))
            except BaseException:
                stream.cancel()
                raise
        raise AssertionError("unreachable")

    async def generate(self, body: bytes, stream: bool, chat: bool):
        """The response to a validated completion or chat request (its raw JSON ``body``)."""
        from fastapi.responses import Response, StreamingResponse
        from ray.serve.exceptions import BackPressureError

        from bole.server.errors import error
        try:
            items, rest = await self._start(body, chat, whole=not stream)
        except BackPressureError as exc:
            return error(503, f"every replica is busy and the queue is full: {exc}",
                         "server_busy", headers={"Retry-After": "1"})
        except Exception as exc:
            if not replica_died(exc):
                raise
            return error(503, f"the replicas serving this request died {RESENDS + 1} times "
                         f"({type(exc).__name__}); retry later", "server_error",
                         headers={"Retry-After": "5"})
        (status, headers), chunks = items[0], items[1:]
        if not stream:
            return Response(b"".join(c.encode() if isinstance(c, str) else c for c in chunks),
                            status_code=status, headers=dict(headers))

        async def relay() -> AsyncIterator:
            finished = False
            try:
                for chunk in chunks:
                    yield chunk
                async for chunk in rest:
                    yield chunk
                finished = True
            except Exception as exc:
                if not replica_died(exc):
                    log.exception("a streamed request failed")
                finished = True
                yield _sse_error(f"the replica serving this request stopped "
                                 f"({type(exc).__name__}); retry the request")
            finally:
                if not finished:                # the client went away: free its slots
                    rest.cancel()
        return StreamingResponse(relay(), status_code=status,
                                 headers={k: v for k, v in headers if k != "content-length"})

    async def all_metrics(self, by_replica: bool) -> bytes:
        """Every engine replica's metrics (those that answer within METRICS_TIMEOUT_S) and this
        ingress's HTTP counters, merged."""
        from prometheus_client import generate_latest

        from bole.server.replica_metrics import merge_metrics
        try:
            results = await self.engine.broadcast("replica_metrics").results_async(
                timeout_s=METRICS_TIMEOUT_S, return_exceptions=True)
        except TimeoutError:
            results = []
        pages = dict(r for r in results if isinstance(r, tuple))
        return merge_metrics(pages, by_replica, extra={"ingress": generate_latest(self.registry)})

    def __serve_build_asgi_app__(self):
        """The app: the routes of ``bole serve``, generations forwarded to the engines."""
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, Response

        from bole.server import errors
        from bole.server.errors import error
        from bole.server.gate import Gate

        app = FastAPI(title="Bole")
        errors.install(app)
        app.add_middleware(Gate, api_key=self.api_key,
                           count=lambda route, code: self.http.labels(route, str(code)).inc())

        @app.get("/health")
        async def health():
            status, body = await self.engine.health.remote()
            return JSONResponse(body, status_code=status)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [await self.card()]}

        @app.get("/v1/models/{model:path}")
        async def model(model: str):
            card = await self.card()
            if model != card["id"]:
                return error(404, f"unknown model {model!r}; this server serves "
                             f"{card['id']!r}", param="model", code="model_not_found")
            return card

        @app.get("/metrics")
        async def metrics(by: str = ""):
            return Response(await self.all_metrics(by == "replica"),
                            media_type="text/plain; version=0.0.4")

        @app.post("/v1/completions")
        async def completions(req: CompletionRequest, http: HTTPRequest):
            return await self.generate(await http.body(), bool(req.stream), chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(req: ChatCompletionRequest, http: HTTPRequest):
            return await self.generate(await http.body(), bool(req.stream), chat=True)

        return app

"""The OpenAI-compatible HTTP server (FastAPI): completions and chat, streamed or not, models,
health and Prometheus metrics, over the continuous-batching scheduler.

The scheduler runs on one engine thread (:class:`EngineLoop`), or in an engine process of its
own (``bole serve --engine-process``, :mod:`bole.server.engine_process`); a request handler
submits its request and waits on an asyncio queue that the engine's events feed after every
round. A client
that disconnects cancels its request, which frees its slot at the next round boundary. Every
error a client can cause is a 4xx with OpenAI's error body; a full waiting queue is a 503 with
Retry-After; an unexpected error is a 500 and the server goes on. Under tensor parallelism this
is rank 0; the other ranks step in lockstep with it (:mod:`bole.server.lockstep`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from bole.engine import Engine, GenerationParams
from bole.engine.engine import result_text
from bole.engine.scheduler import Handle, QueueFull, Scheduler
from bole.server.chat import ChatTemplate
from bole.server.engine_process import EngineClient
from bole.server.lockstep import Channel, LockstepScheduler
from bole.server.metrics import ServerMetrics
from bole.server.protocol import (ChatCompletionRequest, CompletionRequest, completion_body,
                                  completion_chunk, error_body, new_id, usage)
from bole.speculative.sampling import SamplingParams

log = logging.getLogger("bole.server")


class EngineLoop:
    """Runs the scheduler's rounds on a thread of its own until stopped; ``on_exit`` runs on that
    thread as it ends (tensor parallelism: stop the followers)."""

    def __init__(self, scheduler: Scheduler, on_exit: Callable[[], None] | None = None):
        self.scheduler = scheduler
        self.on_exit = on_exit
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bole-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self.thread.start()

    def healthy(self) -> bool:
        return self.error is None or self.thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self.scheduler.wake()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.scheduler.wait_for_work(0.05):
                    continue
                try:
                    self.scheduler.step()
                except Exception as exc:              # keep serving; fail what was running
                    log.exception("a round failed")
                    self.error = exc
                    for h in list(self.scheduler.running) + list(self.scheduler.waiting):
                        self.scheduler.cancel(h)
        finally:
            if self.on_exit is not None:
                self.on_exit()


class EventPump:
    """Hands the engine thread's request events to the event loop with one wake-up per batch:
    a round's events for every running request cost the engine thread one
    ``call_soon_threadsafe`` (one write to the loop's self-pipe) rather than one per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: list[tuple[asyncio.Queue, bool]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, finished: bool) -> None:
        """Any thread: queue ``finished`` for ``queue``; the loop flushes once per batch."""
        with self._lock:
            self._pending.append((queue, finished))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._pending, self._scheduled = self._pending, [], False
        for queue, finished in items:
            queue.put_nowait(finished)


class TextStream:
    """Incremental detokenisation: the text of the tokens so far, holding back an incomplete
    UTF-8 sequence and anything that could still become a stop string."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.sent = 0

    def delta(self, ids: list[int], final_text: str | None) -> str:
        if final_text is not None:
            text = final_text
        else:
            text = self.tokenizer.decode(ids)
            keep = len(text)
            if text.endswith("\ufffd"):                       # an incomplete multi-byte char
                keep = len(text.rstrip("\ufffd"))
            if self.stops:
                keep = min(keep, len(text) - (max(len(s) for s in self.stops) - 1))
            text = text[:max(keep, self.sent)]
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out


class BoleServer:
    """The app's state: engine, scheduler, metrics and the served model's name. ``channel``: rank
    0's link to the other tensor-parallel ranks, which then step in lockstep with it."""

    def __init__(self, engine: Engine | None, model_name: str, *, max_queue: int = 256,
                 max_batch: int | None = None, chat_template: ChatTemplate | None = None,
                 channel: Channel | None = None, client: EngineClient | None = None,
                 tokenizer=None):
        """``engine``: run in this process on a thread of its own; or ``client``: the engine in
        its own process (``tokenizer``: the checkpoint's, for this process's text)."""
        if (engine is None) == (client is None):
            raise ValueError("give the server an engine or an engine process's client")
        self.tokenizer = engine.tokenizer if engine is not None else tokenizer
        if self.tokenizer is None:
            raise ValueError("the server needs the checkpoint's tokenizer (Engine(tokenizer=...))")
        self.engine, self.model_name = engine, model_name
        if client is not None:
            self.scheduler = client
            self.info = client.info
            self.loop = client
        else:
            if channel is None:
                self.scheduler = Scheduler(engine, max_queue=max_queue, max_batch=max_batch)
            else:
                self.scheduler = LockstepScheduler(engine, channel, max_queue=max_queue,
                                                   max_batch=max_batch)
            self.info = engine.info
            self.loop = EngineLoop(self.scheduler, on_exit=channel.close if channel else None)
        self.metrics = ServerMetrics(self.scheduler)
        self.scheduler.on_round = self.metrics.observe_round
        self.chat = chat_template or ChatTemplate.for_checkpoint("")
        self._pump: EventPump | None = None

    def text(self, result, params: GenerationParams) -> str:
        return result_text(self.tokenizer, result, params)

    # ---- requests ----
    def _params(self, req, max_tokens: int) -> GenerationParams:
        eos = self.info.eos_token_ids
        return GenerationParams(max_tokens=max_tokens, stop_token_ids=eos,
                                stop_strings=req.stop_strings,
                                sampling=SamplingParams(req.temperature, req.top_k, req.top_p))

    def prepare(self, req, chat: bool) -> tuple[list[int], GenerationParams]:
        """Token ids and parameters of a request; a ValueError says what is wrong."""
        if req.model != self.model_name:
            raise ValueError(f"unknown model {req.model!r}; this server serves "
                             f"{self.model_name!r} (GET /v1/models)")
        if chat:
            text = self.chat.render([m.model_dump() for m in req.messages])
            ids, limit = self.tokenizer.encode(text).ids, req.token_limit
        elif isinstance(req.prompt, str):
            ids, limit = self.tokenizer.encode(req.prompt).ids, req.max_tokens
        else:
            ids, limit = list(req.prompt), req.max_tokens
        room = self.info.max_len - self.info.scratch - len(ids)
        if limit is None:
            limit = max(1, min(room, 4096))
        params = self._params(req, limit)
        self.info.check_request(ids, params)
        return ids, params

    def pump(self, loop: asyncio.AbstractEventLoop) -> EventPump:
        """The event pump into ``loop`` (one per loop: the server's, or a test's)."""
        if self._pump is None or self._pump.loop is not loop:
            self._pump = EventPump(loop)
        return self._pump

    def submit(self, ids, params, seed, queue: asyncio.Queue, loop, stream: bool = True) -> Handle:
        """Queue a request whose events reach ``queue`` on ``loop``: every round's (``stream``)
        or only the last."""
        pump = self.pump(loop)

        def on_event(handle, tokens, finished):
            if stream or finished:
                pump.post(queue, finished)
        handle = self.scheduler.submit(ids, params, seed=seed, on_event=on_event)
        self.metrics.prompt_tokens.inc(len(ids))
        return handle

    def finished(self, handle: Handle) -> None:
        r = handle.request
        status = "cancelled" if r.result is None else r.result.finish_reason
        self.metrics.requests.labels(status).inc()
        if r.result is not None:
            self.metrics.output_tokens.inc(len(r.result.token_ids))

    def usage_of(self, handle: Handle) -> dict:
        r = handle.request
        res = r.result
        n = len(res.token_ids) if res else len(r.out)
        return usage(len(r.prompt), n, r.rounds, sum(r.accepted))


def _error(status: int, message: str, type_: str = "invalid_request_error", param=None,
           headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param), status_code=status, headers=headers)


def create_app(server: BoleServer) -> FastAPI:
    """The FastAPI app over ``server``; the engine thread starts and stops with the app."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        yield
        server.loop.stop()

    app = FastAPI(title="Bole", lifespan=lifespan)
    app.state.bole = server

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return _error(400, f"{where or 'request'}: {first.get('msg', 'invalid request')}",
                      param=where)

    @app.exception_handler(Exception)
    async def crashed(request, exc: Exception):
        log.exception("request failed")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.get("/health")
    async def health():
        if not server.loop.healthy():
            return _error(503, "the engine stopped; restart the server", "server_error")
        return {"status": "ok", "running": server.scheduler.num_running,
                "waiting": server.scheduler.num_waiting}

    @app.get("/v1/models")
    async def models():
        spec = server.info.spec
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": 0, "owned_by": "bole",
            "max_model_len": server.info.max_len,
            "bole": {"mode": spec.mode, "drafter": spec.drafter, "depth": spec.depth,
                     "topk": spec.topk, "budget": spec.budget}}]}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: HTTPRequest):
        return await _serve(server, req, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: HTTPRequest):
        return await _serve(server, req, http, chat=True)

    return app


async def _serve(server: BoleServer, req, http: HTTPRequest, chat: bool):
    try:
        ids, params = server.prepare(req, chat)
    except ValueError as exc:
        return _error(400, str(exc))
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    try:
        handle = server.submit(ids, params, req.seed, queue, loop, stream=bool(req.stream))
    except QueueFull as exc:
        server.metrics.requests.labels("rejected").inc()
        return _error(503, str(exc), "server_busy", headers={"Retry-After": "1"})
    except ValueError as exc:
        return _error(400, str(exc))
    rid = new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(server, handle, queue, params, rid, chat, include_usage),
                                 media_type="text/event-stream")
    # only the final event arrives; a client that goes away meanwhile cancels its request (one
    # getter kept across the polls, so that the event cannot be lost to a timeout)
    getter = asyncio.ensure_future(queue.get())
    while not (getter.done() and getter.result()):
        done, _ = await asyncio.wait({getter}, timeout=0.1)
        if done and not getter.result():
            getter = asyncio.ensure_future(queue.get())
        elif not done and await http.is_disconnected():
            getter.cancel()
            server.scheduler.cancel(handle)
            server.metrics.requests.labels("cancelled").inc()
            return Response(status_code=499)
    server.finished(handle)
    res = handle.request.result
    if res is None:
        return _error(500, "the request was cancelled by the server", "server_error")
    text = server.text(res, params)
    return completion_body(rid, server.model_name, text, res.finish_reason, chat,
                           server.usage_of(handle))


async def _stream(server: BoleServer, handle: Handle, queue: asyncio.Queue,
                  params: GenerationParams, rid: str, chat: bool,
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks of text deltas, the finish reason, optionally the usage, then ``[DONE]``."""
    text = TextStream(server.tokenizer, params.stop_strings)
    finished, first, counted = False, True, 0
    try:
        while not finished:
            finished = await queue.get()
            while not (finished or queue.empty()):   # events that piled up: one chunk for all
                finished = queue.get_nowait()
            r = handle.request
            out = list(r.out)
            final = server.text(r.result, params) if r.result is not None else None
            delta = text.delta(out, final)
            if delta or (first and chat):
                yield _sse(completion_chunk(rid, server.model_name, delta, None, chat, first,
                                            token_ids=out[counted:]))
                first, counted = False, len(out)
        res = handle.request.result
        if res is None:
            yield _sse(error_body("the request was cancelled by the server", "server_error"))
        else:
            yield _sse(completion_chunk(rid, server.model_name, "", res.finish_reason, chat))
            if include_usage:
                body = completion_chunk(rid, server.model_name, "", None, chat)
                body["choices"], body["usage"] = [], server.usage_of(handle)
                yield _sse(body)
        yield "data: [DONE]\n\n"
    finally:
        if not handle.done.is_set():           # the client went away: free the slot
            server.scheduler.cancel(handle)
        server.finished(handle) if handle.request.result is not None else \
            server.metrics.requests.labels("cancelled").inc()


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


#: how long a thread may hold the GIL while another waits for it (s): the engine's thread, back
#: from a round's synchronisation, otherwise waits up to Python's default 5 ms for the HTTP
#: event loop's thread to let go
GIL_SWITCH_INTERVAL = 2e-4


def serve(server: BoleServer, host: str = "127.0.0.1", port: int = 8000,
          alive: Callable[[], bool] | None = None, access_log: bool = False) -> None:
    """Run the app with uvicorn until interrupted, or until ``alive()`` turns False (checked
    twice a second: a tensor-parallel rank died). ``access_log``: a log line per request."""
    import sys

    import uvicorn
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    uv = uvicorn.Server(uvicorn.Config(create_app(server), host=host, port=port,
                                       log_level="info", access_log=access_log))
    if alive is not None:
        threading.Thread(target=_watch, args=(uv, alive), name="bole-watch", daemon=True).start()
    t0 = time.perf_counter()
    log.info("serving %s on http://%s:%d", server.model_name, host, port)
    try:
        uv.run()
    except KeyboardInterrupt:                 # uvicorn re-raises the signal it stopped on
        pass
    if not uv.started:
        raise SystemExit(3)                   # as uvicorn.run: the app did not start
    log.info("stopped after %.0f s", time.perf_counter() - t0)


def _watch(uv, alive: Callable[[], bool]) -> None:
    while not uv.should_exit:
        if not alive():
            log.error("a tensor-parallel rank exited; stopping the server")
            uv.should_exit = True
            return
        time.sleep(0.5)

"""The OpenAI-compatible HTTP server (FastAPI): completions and chat, streamed or not, models,
health and Prometheus metrics, over the continuous-batching scheduler.

The scheduler runs on one engine thread (:class:`EngineLoop`), or in an engine process of its
own (``bole serve --engine-process``, :mod:`bole.server.engine_process`); a request handler
submits its request and waits on an asyncio queue that the engine's events feed after every
round. A client
that disconnects cancels its request, which frees its slot at the next round boundary. Every
error a client can cause is a 4xx with OpenAI's error body (:mod:`bole.server.errors`); a full
waiting queue is a 503 with Retry-After; an unexpected error is a 500 and the server goes on.
Tokenizing and detokenizing run on a small thread pool, never on the event loop, and a prompt
over ``--max-prompt-bytes`` is refused before it is tokenized. A request with several prompts or
``n`` > 1 runs one sequence per choice through the scheduler. The first SIGTERM drains: new
requests get 503, in-flight ones get ``--shutdown-timeout`` seconds, then the rest end with
finish_reason ``abort``. Under tensor parallelism this
is rank 0; the other ranks step in lockstep with it (:mod:`bole.engine.lockstep`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import Response

from bole.engine import Engine, SamplingParams
from bole.engine.lockstep import Channel, LockstepScheduler
from bole.engine.request import GenerationResult, result_text
from bole.engine.scheduler import Handle, Scheduler
from bole.server import errors
from bole.server.chat import ChatTemplate
from bole.server.engine_process import EngineClient
from bole.server.errors import error
from bole.server.gate import Gate
from bole.server.metrics import RequestTimer, ServerMetrics
from bole.server.protocol import (ChatCompletionRequest, CompletionRequest, RequestError,
                                  choice_seed, engine_params, logprobs_body, usage)
from bole.server.responses import respond

__all__ = ["EngineLoop", "EventPump", "ServerConfig", "default_prompt_bytes", "Sequence",
           "BoleServer", "create_app", "GIL_SWITCH_INTERVAL", "drain", "serve"]

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
        self._pending: list[tuple[asyncio.Queue, object]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item) -> None:
        """Any thread: queue ``item`` for ``queue``; the loop flushes once per batch."""
        with self._lock:
            self._pending.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._pending, self._scheduled = self._pending, [], False
        for queue, item in items:
            queue.put_nowait(item)


@dataclass
class ServerConfig:
    """The HTTP side's settings. ``max_prompt_bytes``: prompts (or a chat's messages) longer
    than this many UTF-8 bytes are refused before tokenizing (None: :func:`default_prompt_bytes`
    of the engine's context); ``api_key``: required as ``Authorization: Bearer`` on every route
    but /health and /metrics; ``shutdown_timeout``: seconds a SIGTERM lets in-flight requests
    finish before the rest are aborted."""

    max_prompt_bytes: int | None = None
    api_key: str | None = None
    shutdown_timeout: float = 30.0
    text_threads: int = 2

    def __post_init__(self):
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key is empty: pass a key, or None to serve without one")


def default_prompt_bytes(max_len: int) -> int:
    """1 MiB, or 32 bytes per token of the context when that is more: far above any prompt the
    context can hold, far below what stalls a tokenizer thread for long."""
    return max(1 << 20, 32 * max_len)


@dataclass(eq=False)
class Sequence:
    """One choice of a request: its prompt, parameters (with the choice's seed), its engine
    handle, latency timer, and whether the server aborted it (shutdown)."""

    index: int
    prompt_index: int
    ids: list[int]
    params: SamplingParams
    echo: str = ""
    handle: Handle | None = None
    timer: RequestTimer | None = None
    aborted: bool = False

    def text(self, tokenizer) -> str:
        """The output text so far: the result's, or (aborted) the tokens it had."""
        r = self.handle.request
        res = r.result or GenerationResult(list(r.out), "length")
        return result_text(tokenizer, res, self.params)

    @property
    def finish_reason(self) -> str:
        res = self.handle.request.result
        return res.finish_reason if res is not None else "abort"

    def logprobs(self, tokenizer, chat: bool) -> dict | None:
        """The choice's OpenAI ``logprobs`` (None unless asked for): the result's, or
        (aborted) those of the tokens it had."""
        if self.params.logprobs is None:
            return None
        r = self.handle.request
        entries = r.result.logprobs if r.result is not None else r.logprobs[:len(r.out)]
        return logprobs_body(entries or [], lambda t: tokenizer.decode([t]), chat,
                             len(self.echo))


class BoleServer:
    """The app's state: engine, scheduler, metrics and the served model's name. ``channel``: rank
    0's link to the other tensor-parallel ranks, which then step in lockstep with it."""

    def __init__(self, engine: Engine | None, model_name: str, *, max_queue: int = 256,
                 max_batch: int | None = None, chat_template: ChatTemplate | None = None,
                 channel: Channel | None = None, client: EngineClient | None = None,
                 tokenizer=None, config: ServerConfig | None = None):
        """``engine``: run in this process on a thread of its own; or ``client``: the engine in
        its own process (``tokenizer``: the checkpoint's, for this process's text)."""
        if (engine is None) == (client is None):
            raise ValueError("give the server an engine or an engine process's client")
        self.tokenizer = engine.tokenizer if engine is not None else tokenizer
        if self.tokenizer is None:
            raise ValueError("the server needs the checkpoint's tokenizer (Engine(tokenizer=...))")
        self.engine, self.model_name = engine, model_name
        self.config = config or ServerConfig()
        if client is not None:
            self.scheduler = client
            self.info = client.info
            self.loop = client
            slots = max_batch or 1
        else:
            if channel is None:
                self.scheduler = Scheduler(engine, max_queue=max_queue, max_batch=max_batch)
            else:
                self.scheduler = LockstepScheduler(engine, channel, max_queue=max_queue,
                                                   max_batch=max_batch)
            self.info = engine.info
            self.loop = EngineLoop(self.scheduler, on_exit=channel.close if channel else None)
            slots = self.scheduler.max_batch
        self.max_prompt_bytes = (self.config.max_prompt_bytes or
                                 default_prompt_bytes(self.info.max_len))
        self.metrics = ServerMetrics(self.scheduler, model_name, slots)
        self.scheduler.on_round = self.metrics.observe_round
        self.chat = chat_template or ChatTemplate.for_checkpoint("")
        # tokenizing and detokenizing run here, off the event loop
        self.text_pool = ThreadPoolExecutor(self.config.text_threads,
                                            thread_name_prefix="bole-text")
        self.inflight: set[Sequence] = set()
        self.draining = False
        self.event_loop: asyncio.AbstractEventLoop | None = None    # the app's, once started
        self._pump: EventPump | None = None

    # ---- requests ----
    def check_size(self, req, chat: bool) -> None:
        """Refuse a prompt over ``max_prompt_bytes`` before anything tokenizes it."""
        if chat:
            texts, field = [m.for_template()["content"] for m in req.messages], "messages"
        else:
            texts, field = [p for p in req.prompts if isinstance(p, str)], "prompt"
        size = sum(len(t) for t in texts)            # characters: a lower bound of the bytes
        if size <= self.max_prompt_bytes:
            size = sum(len(t.encode("utf-8")) for t in texts)
        if size > self.max_prompt_bytes:
            raise RequestError(f"the {field} is {size} bytes or more, over this server's limit "
                               f"of {self.max_prompt_bytes} (bole serve --max-prompt-bytes); "
                               "shorten it", field)

    def prepare(self, req, chat: bool) -> list[Sequence]:
        """The request's sequences (tokenized, checked): one per prompt and choice, in the
        order of their indices. Raises RequestError (or ValueError) saying what is wrong."""
        if req.model != self.model_name:
            raise RequestError(f"unknown model {req.model!r}; this server serves "
                               f"{self.model_name!r} (GET /v1/models)", "model")
        if chat:
            prompts = [self.chat.render([m.for_template() for m in req.messages])]
        else:
            prompts = req.prompts
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(self.tokenizer.encode_batch(texts) if texts else [])   # off the GIL
        sequences = []
        for i, prompt in enumerate(prompts):
            ids = next(encoded).ids if isinstance(prompt, str) else [int(t) for t in prompt]
            echo = ""
            if getattr(req, "echo", False):
                echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
            limit = req.token_limit
            if limit is None:
                limit = max(1, min(self.info.max_len - self.info.scratch - len(ids), 4096))
            params = engine_params(req, limit)
            name = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            try:
                self.info.check_request(ids, params, name)
            except ValueError as exc:
                raise RequestError(str(exc), "messages" if chat else "prompt") from None
            for j in range(req.n):
                index = i * req.n + j
                sequences.append(Sequence(index, i, ids,
                                          replace(params, seed=choice_seed(req.seed, index)),
                                          echo))
        return sequences

    def pump(self, loop: asyncio.AbstractEventLoop) -> EventPump:
        """The event pump into ``loop`` (one per loop: the server's, or a test's)."""
        if self._pump is None or self._pump.loop is not loop:
            self._pump = EventPump(loop)
        return self._pump

    def submit(self, sequences: list[Sequence], queue: asyncio.Queue, loop,
               stream: bool = True, arrived: float | None = None) -> None:
        """Queue the sequences; ``(index, finished)`` reaches ``queue`` on ``loop`` after every
        round (``stream``) or only at the end. All or none: QueueFull cancels those queued.
        ``arrived``: when the request came in (``time.perf_counter()``; default now), for the
        latency metrics."""
        pump = self.pump(loop)
        arrived = time.perf_counter() if arrived is None else arrived
        prompts_counted: set[int] = set()
        for seq in sequences:
            seq.timer = RequestTimer(self.metrics, arrived)

            def on_event(handle, tokens, finished, seq=seq):
                seq.timer.tokens_arrived(len(tokens))
                if finished:
                    res = handle.request.result
                    seq.timer.finished(res.finish_reason if res is not None else "abort",
                                       res.prefill_s if res is not None else None)
                    if res is not None:
                        self.metrics.prefix_queries.inc(len(seq.ids))
                        self.metrics.prefix_hits.inc(res.cached_tokens)
                if stream or finished:
                    pump.post(queue, (seq.index, finished))
            try:
                seq.handle = self.scheduler.submit(seq.ids, seq.params, on_event=on_event)
            except BaseException:
                self.release(sequences)
                raise
            self.inflight.add(seq)
            if seq.prompt_index not in prompts_counted:
                prompts_counted.add(seq.prompt_index)
                self.metrics.prompt_tokens.inc(len(seq.ids))

    def cancel(self, sequences: list[Sequence]) -> None:
        for seq in sequences:
            if seq.handle is not None and not seq.handle.done.is_set():
                self.scheduler.cancel(seq.handle)

    def release(self, sequences: list[Sequence]) -> None:
        """The handler is done with these sequences (their response is written)."""
        self.cancel(sequences)
        self.inflight.difference_update(sequences)

    def live(self) -> list[Sequence]:
        """The sequences the engine has not finished."""
        return [s for s in self.inflight if s.handle is not None and not s.handle.done.is_set()]

    def abort_all(self) -> int:
        """Shutdown: end every sequence still running (finish_reason ``abort``); how many."""
        live = self.live()
        for seq in live:
            seq.aborted = True
            self.scheduler.cancel(seq.handle)
        return len(live)

    def usage_of(self, sequences: list[Sequence]) -> dict:
        first = {s.prompt_index: s for s in reversed(sequences)}.values()
        prompt = sum(len(s.ids) for s in first)
        # a prompt's cached tokens as its first sequence saw them (the n choices of a prompt
        # run as n requests; the later ones find the first one's prompt in the cache)
        cached = sum(s.handle.request.result.cached_tokens for s in first
                     if s.handle.request.result is not None)
        out = rounds = accepted = 0
        for s in sequences:
            r = s.handle.request
            out += len(r.result.token_ids) if r.result is not None else len(r.out)
            rounds += r.rounds
            accepted += sum(r.accepted)
        return usage(prompt, out, rounds, accepted, cached)


def create_app(server: BoleServer) -> FastAPI:
    """The FastAPI app over ``server``; the engine thread starts and stops with the app."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        server.event_loop = asyncio.get_running_loop()
        server.loop.start()
        yield
        server.loop.stop()
        server.text_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="Bole", lifespan=lifespan)
    errors.install(app)
    app.add_middleware(Gate, api_key=server.config.api_key,
                       count=lambda route, code: server.metrics.http.labels(route,
                                                                            str(code)).inc())

    @app.get("/health")
    async def health():
        if not server.loop.healthy():
            return error(503, "the engine stopped; restart the server", "server_error")
        if server.draining:
            return error(503, "the server is shutting down", "server_error")
        return {"status": "ok", "running": server.scheduler.num_running,
                "waiting": server.scheduler.num_waiting}

    def model_card() -> dict:
        spec = server.info.spec
        return {"id": server.model_name, "object": "model", "created": 0, "owned_by": "bole",
                "max_model_len": server.info.max_len,
                "bole": {"mode": spec.mode, "drafter": spec.drafter, "depth": spec.depth,
                         "topk": spec.topk, "budget": spec.budget}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != server.model_name:
            return error(404, f"unknown model {model!r}; this server serves "
                         f"{server.model_name!r}", param="model", code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: HTTPRequest):
        return await respond(server, req, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: HTTPRequest):
        return await respond(server, req, http, chat=True)

    return app


#: how long a thread may hold the GIL while another waits for it (s): the engine's thread, back
#: from a round's synchronisation, otherwise waits up to Python's default 5 ms for the HTTP
#: event loop's thread to let go
GIL_SWITCH_INTERVAL = 2e-4


def _draining_uvicorn(server: BoleServer, config):
    """A uvicorn server whose first SIGTERM / SIGINT drains (:func:`drain`) instead of stopping
    at once; a second signal stops at once."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            loop = server.event_loop
            if server.draining or loop is None or not self.started:
                return super().handle_exit(sig, frame)
            server.draining = True
            loop.call_soon_threadsafe(lambda: loop.create_task(drain(server, self)))
    return Draining(config)


async def drain(server: BoleServer, uv) -> None:
    """Shutdown: new requests already get 503 (``server.draining``); wait up to the shutdown
    timeout for the in-flight ones, abort what is left (finish_reason ``abort``), let their
    responses go out, then stop uvicorn."""
    server.draining = True
    timeout = server.config.shutdown_timeout
    log.info("shutting down: %d requests in flight get up to %.0f s", len(server.inflight),
             timeout)
    deadline = time.monotonic() + timeout
    while server.live() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if server.live():
        log.warning("shutdown timeout: aborting %d requests", server.abort_all())
    # the engine ends the aborted ones within a round; then their responses go out
    deadline = time.monotonic() + 10
    while server.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    uv.should_exit = True


def serve(server: BoleServer, host: str = "127.0.0.1", port: int = 8000,
          alive: Callable[[], bool] | None = None, access_log: bool = False) -> None:
    """Run the app with uvicorn until interrupted (drained first: :func:`drain`), or until
    ``alive()`` turns False (checked twice a second: a tensor-parallel rank died).
    ``access_log``: a log line per request."""
    import sys

    import uvicorn
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    if not server.config.api_key and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who can reach this address can "
                    "use the model (pass --api-key or set BOLE_API_KEY)", host)
    app = create_app(server)
    uv = _draining_uvicorn(server, uvicorn.Config(app, host=host, port=port, log_level="info",
                                                  access_log=access_log,
                                                  timeout_graceful_shutdown=10))
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

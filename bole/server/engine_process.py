"""The engine in a process of its own (``bole serve --engine-process``), as vLLM and SGLang run
theirs: the HTTP process tokenizes, detokenizes and streams, the engine process only schedules
and runs rounds, so neither waits for the other's Python under one GIL.

The two talk over one pipe. The front end (:class:`EngineClient`, the scheduler interface the
server uses) sends ``submit`` and ``cancel`` messages; the engine process (:func:`engine_main`)
drains them between steps, steps its :class:`~bole.engine.scheduler.Scheduler`, and sends after
each step one message with every request's new tokens (and its result when it finished), the
step's report for the metrics, and its running and waiting counts. The waiting queue's bound is
kept by the front end, which answers 503 at once. The engine process exits when the front end
says stop or its end of the pipe closes (the front end died), and dies with its parent.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from bole.engine.request import EngineInfo, GenerationResult, SamplingParams
from bole.engine.scheduler import EventFn, Handle, QueueFull, RoundReport, Scheduler

log = logging.getLogger("bole.server")

#: how long the engine process waits for a message when it has no work (s)
IDLE_POLL = 0.05


@dataclass(eq=False)
class RequestView:
    """The front end's mirror of a request (what the server reads of ``Handle.request``)."""

    index: int
    prompt: list[int]
    params: SamplingParams
    out: list[int] = field(default_factory=list)
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)
    result: GenerationResult | None = None
    logprobs: list = field(default_factory=list)     # one TokenLogprob per out token, if asked


# ---- the engine process ----

def engine_main(conn, factory: Callable[..., Any], factory_args: tuple) -> None:
    """The engine process: build the engine (``factory(*factory_args)``), report ready with its
    :class:`EngineInfo` (or the error that stopped the build), then serve the pipe."""
    from bole.distributed import die_with_parent
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="[bole engine] %(message)s")
    try:
        engine = factory(*factory_args)
    except BaseException as exc:                   # the front end reports it and exits
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    scheduler = Scheduler(engine, max_queue=1 << 30)
    serial_of: dict[int, int] = {}                 # id(handle) -> the front end's serial
    handles: dict[int, Handle] = {}
    events: list[tuple] = []
    reports: list[RoundReport] = []

    def on_event(handle: Handle, tokens: list, finished: bool) -> None:
        r = handle.request
        lps = r.logprobs[len(r.out) - len(tokens):len(r.out)] if tokens else []
        events.append((serial_of[id(handle)], list(tokens), finished, r.rounds,
                       list(r.accepted), r.result if finished else None, lps))
        if finished:
            handles.pop(serial_of.pop(id(handle)), None)
    scheduler.on_round = reports.append
    conn.send(("ready", engine.info))
    while True:
        try:
            timeout = IDLE_POLL if scheduler.idle else 0.0
            while conn.poll(timeout):
                msg = conn.recv()
                if msg[0] == "submit":
                    _, serial, prompt, params = msg
                    try:
                        handle = scheduler.submit(prompt, params, on_event=on_event, checked=True)
                    except Exception:              # fail this request, keep the process
                        log.exception("a submitted request could not start")
                        events.append((serial, [], True, 0, [], None, []))
                        timeout = 0.0
                        continue
                    serial_of[id(handle)], handles[serial] = serial, handle
                elif msg[0] == "cancel" and msg[1] in handles:
                    scheduler.cancel(handles[msg[1]])
                elif msg[0] == "stop":
                    return
                timeout = 0.0
        except (EOFError, OSError):                # the front end is gone
            return
        if not scheduler.idle:
            try:
                scheduler.step()
            except Exception:                      # keep serving; fail what was running
                log.exception("a round failed")
                for h in list(scheduler.running) + list(scheduler.waiting):
                    scheduler.cancel(h)            # the next step retires them
        if events or reports:
            try:
                conn.send(("events", events[:], reports[:], scheduler.num_running,
                           scheduler.num_waiting))
            except (BrokenPipeError, OSError):
                return
            events.clear()
            reports.clear()


# ---- the front end ----

class EngineClient:
    """The server's scheduler when the engine runs in its own process: ``submit``, ``cancel``,
    the running and waiting counts and ``on_round``, as :class:`Scheduler` has them; ``info``
    is the engine's :class:`EngineInfo`. Starts the process and waits until its engine is built
    (``startup_timeout`` seconds); a build error is raised here."""

    def __init__(self, factory: Callable[..., Any], factory_args: tuple, *, max_queue: int = 256,
                 startup_timeout: float = 1800.0):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self._send_lock = threading.Lock()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=engine_main, args=(child, factory, factory_args),
                                   name="bole-engine", daemon=True)
        self.process.start()
        child.close()
        if not self._conn.poll(startup_timeout):
            self.stop(timeout=1.0)                 # still building: it reads no pipe yet
            raise RuntimeError(f"the engine process did not start in {startup_timeout:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self.stop()
            raise RuntimeError(f"the engine process exited while starting (exit code "
                               f"{self.process.exitcode})") from None
        if kind != "ready":
            self.stop()
            raise RuntimeError(f"the engine could not start: {payload}")
        self.info: EngineInfo = payload
        self.max_queue = max_queue
        self.on_round: Callable[[RoundReport], None] | None = None
        self._lock = threading.Lock()
        self._handles: dict[int, Handle] = {}
        self._waiting: set[int] = set()            # submitted, no token yet
        self._serial = 0
        self._running = 0
        self.error: str | None = None
        self._reader = threading.Thread(target=self._read, name="bole-engine-reader",
                                        daemon=True)
        self._reader.start()

    # ---- what the server calls ----
    def submit(self, prompt: Sequence[int], params: SamplingParams, *,
               on_event: EventFn | None = None, checked: bool = False) -> Handle:
        if not checked:
            self.info.check_request(prompt, params)
        if self.error is not None:
            raise RuntimeError(f"the engine process is gone ({self.error})")
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the most this "
                                f"server queues); retry shortly")
            self._serial += 1
            serial = self._serial
            handle = Handle(RequestView(serial, [int(t) for t in prompt], params), on_event)
            self._handles[serial] = handle
            self._waiting.add(serial)
        self._send(("submit", serial, handle.request.prompt, params))
        return handle

    def cancel(self, handle: Handle) -> None:
        handle.cancelled = True
        self._send(("cancel", handle.request.index))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return self._running

    def healthy(self) -> bool:
        return self.error is None and self.process.is_alive()

    def start(self) -> None:
        """Nothing to do: the process runs from construction (the app's lifespan calls it)."""

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the engine process to stop, then end it if it does not."""
        try:
            self._send(("stop",))
        except OSError:                            # already gone
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    # ---- the pipe ----
    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _read(self) -> None:
        """Deliver the engine's events to the requests (their callbacks run here) until the
        pipe closes; then every unfinished request ends with no result."""
        try:
            while True:
                kind, events, reports, running, waiting = self._conn.recv()
                self._running = running
                for serial, tokens, finished, rounds, accepted, result, lps in events:
                    with self._lock:
                        self._waiting.discard(serial)
                        handle = self._handles.pop(serial) if finished else \
                            self._handles.get(serial)
                    if handle is None:
                        continue
                    view = handle.request
                    view.out.extend(tokens)
                    view.logprobs.extend(lps)
                    view.rounds, view.accepted = rounds, accepted
                    if finished:
                        view.result = result
                    if handle.on_event is not None:
                        handle.on_event(handle, tokens, finished)
                    if finished:
                        handle.done.set()
                if self.on_round is not None:
                    for report in reports:
                        self.on_round(report)
        except (EOFError, OSError) as exc:
            self.error = f"the engine process exited ({type(exc).__name__})"
        with self._lock:
            left, self._handles, self._waiting = list(self._handles.values()), {}, set()
        for handle in left:
            if handle.on_event is not None:
                handle.on_event(handle, [], True)
            handle.done.set()


"""Continuous batching: a bounded waiting queue, admission between rounds, cancellation.

Between two rounds the scheduler retires cancelled requests (their slots are freed at once),
admits waiting requests into free slots (each is prefilled and emits its first token), runs one
speculative round over the running ones and retires the finished ones. ``submit`` and ``cancel``
may be called from other threads (the server's event loop); ``step`` runs on one thread only
(the engine's). The offline :meth:`Engine.generate` is a client of this same scheduler.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from bole.engine.request import GenerationResult, Request, SamplingParams


class SteppedEngine(Protocol):
    """What the scheduler drives: an :class:`~bole.engine.engine.Engine` (whose ``generate``
    runs this scheduler, so the scheduler knows it only by these methods)."""

    spec: Any
    cache: Any

    def check_request(self, prompt: Sequence[int], params: SamplingParams,
                      name: str = "the prompt") -> None: ...

    def new_request(self, index: int, prompt: Sequence[int],
                    params: SamplingParams) -> Request: ...

    def admit_many(self, requests: Sequence[Request]) -> None: ...

    def release(self, r: Request) -> None: ...

    def step(self, running: list[Request], prelaunch: bool = False) -> dict: ...


class QueueFull(RuntimeError):
    """The waiting queue holds ``max_queue`` requests: the caller retries later (HTTP 503)."""


#: ``on_event(handle, new_tokens, finished)``: tokens appended since the last event; ``finished``
#: once the request has its result (or was cancelled). Called on the engine's thread.
EventFn = Callable[["Handle", list, bool], None]


@dataclass(eq=False)
class Handle:
    """A submitted request: its state, its event callback, and whether it was cancelled."""

    request: Request
    on_event: EventFn | None = None
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    delivered: int = 0                      # output tokens passed to on_event so far

    @property
    def result(self) -> GenerationResult | None:
        return self.request.result


@dataclass
class RoundReport:
    """What one step did, for metrics: running requests, tokens each one emitted, the node slots
    verified (batch rows x node slots per tree), the round's timings (ms), the requests admitted
    before it and the admission's wall time (s), and the whole step's wall time (s). A step
    whose admitted requests all finished at their first token runs no round: batch 0."""

    batch: int
    emitted: list[int]
    verified_node_slots: int
    timings: dict
    admitted: int = 0
    admit_s: float = 0.0
    step_s: float = 0.0


class Scheduler:
    """Admission, rounds and retirement over one engine."""

    def __init__(self, engine: SteppedEngine, max_queue: int = 256, max_batch: int | None = None,
                 on_round: Callable[[RoundReport], None] | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.max_batch = min(max_batch or engine.cache.max_slots, engine.cache.max_slots)
        self.on_round = on_round
        self.waiting: deque[Handle] = deque()
        self.running: list[Handle] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._serial = 0

    # ---- any thread ----
    def submit(self, prompt: Sequence[int], params: SamplingParams, *,
               on_event: EventFn | None = None, checked: bool = False) -> Handle:
        """Queue a request (checked first unless the caller did, ``checked``: a ValueError names
        what is wrong); QueueFull when ``max_queue`` requests are already waiting."""
        if not checked:
            self.engine.check_request(prompt, params)
        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (the most this server "
                                f"queues); retry shortly")
            self._serial += 1
            handle = Handle(self.engine.new_request(self._serial, prompt, params), on_event)
            self.waiting.append(handle)
            self._wake.notify_all()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Stop a request: it leaves at the next round boundary and its slot is freed."""
        with self._lock:
            handle.cancelled = True
            self._wake.notify_all()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def wait_for_work(self, timeout: float) -> bool:
        """Block until a request is queued (or ``timeout`` seconds pass); True if there is work."""
        with self._wake:
            if self.idle:
                self._wake.wait(timeout)
            return not self.idle

    def wake(self) -> None:
        with self._lock:
            self._wake.notify_all()

    # ---- the engine's thread ----
    def step(self) -> bool:
        """Retire cancelled requests, admit waiting ones, run one round; True while work remains."""
        t0 = time.perf_counter()
        self._retire(cancelled_only=True)
        admitted = self._admit()
        if admitted:                    # cancelled while their prompts were prefilled: no round
            self._retire(cancelled_only=True)
        admit_s = time.perf_counter() - t0
        if self.running:
            requests = [h.request for h in self.running]
            before = [len(r.out) for r in requests]
            # the next round likely runs the same requests (its draft can be queued behind this
            # round's acceptance) when nobody waits, or when no slot is free for those who do:
            # only a request finishing frees one, and that changes the rows anyway
            timings = self.engine.step(requests, prelaunch=not self.waiting or self._room() <= 0)
            for h in self.running:
                self._deliver(h)
            self._retire(cancelled_only=False)
            if self.on_round is not None:
                self.on_round(RoundReport(
                    len(requests), [len(r.out) - n for r, n in zip(requests, before)],
                    len(requests) * self.engine.spec.nodes_per_request, timings, admitted,
                    admit_s, time.perf_counter() - t0))
        elif admitted and self.on_round is not None:     # every admitted request finished
            self.on_round(RoundReport(0, [], 0, {}, admitted, admit_s, admit_s))
        return not self.idle

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def _admit(self) -> int:
        """Admit as many waiting requests as slots allow, prefilled together; returns how many."""
        admitted = []
        room = self._room()
        while len(admitted) < room:
            with self._lock:
                if not self.waiting:
                    break
                handle = self.waiting.popleft()
            if handle.cancelled:
                self._finish(handle)
            else:
                admitted.append(handle)
        if not admitted:
            return 0
        try:
            self.engine.admit_many([h.request for h in admitted])
        except Exception:
            for h in admitted:
                self.engine.release(h.request)
                self._finish(h)
            raise
        for handle in admitted:
            self._deliver(handle)
            if handle.request.result is not None:
                self.engine.release(handle.request)
                self._finish(handle)
            else:
                self.running.append(handle)
        return len(admitted)

    def _room(self) -> int:
        """Requests the running batch can take now: free places in it, and free cache slots."""
        return min(self.max_batch - len(self.running), self.engine.cache.num_free)

    def _retire(self, cancelled_only: bool) -> None:
        with self._lock:
            dropped = [h for h in self.waiting if h.cancelled]
            for h in dropped:
                self.waiting.remove(h)
        for h in dropped:
            self._finish(h)
        keep = []
        for h in self.running:
            if h.cancelled or (not cancelled_only and h.request.result is not None):
                self.engine.release(h.request)
                self._finish(h)
            else:
                keep.append(h)
        self.running = keep

    def _deliver(self, handle: Handle) -> None:
        out = handle.request.out
        new = out[handle.delivered:]
        handle.delivered = len(out)
        if handle.on_event is not None and (new or handle.request.result is not None):
            handle.on_event(handle, list(new), handle.request.result is not None)

    def _finish(self, handle: Handle) -> None:
        if handle.request.result is None and handle.on_event is not None:
            handle.on_event(handle, [], True)             # cancelled: an empty final event
        handle.done.set()

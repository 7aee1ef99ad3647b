"""Tensor-parallel serving: every rank runs the scheduler's steps in lockstep.

Rank 0 serves HTTP. Its scheduler (:class:`LockstepScheduler`) holds submissions and
cancellations in an inbox; each step first broadcasts them (a pickled :class:`StepEvents`: the
admitted requests' prompt ids and parameters, seed included, the cancelled requests' serials)
over a CPU gloo group of its own, then applies them and steps. Every other rank
(:meth:`follow`) receives the same events, applies them to its own scheduler and steps it, so
all ranks admit, batch, sample and retire alike and the model's collectives pair up. Rank 0's
engine thread sends a ``stop`` event when it ends; the followers then return.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

from bole.distributed import TensorParallel
from bole.engine.engine import Engine
from bole.engine.request import SamplingParams
from bole.engine.scheduler import EventFn, Handle, QueueFull, Scheduler

log = logging.getLogger("bole.server")

#: followers wait for rank 0's next step as long as the server idles
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class Submission:
    """A request as every rank builds it: serial, prompt ids, parameters (their seed set)."""

    serial: int
    prompt: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class StepEvents:
    """What rank 0's next step applies before it runs: new requests, cancellations, or stop."""

    submitted: tuple[Submission, ...] = ()
    cancelled: tuple[int, ...] = ()
    stop: bool = False


class Channel:
    """Rank 0's step events to every rank, over a gloo group of its own (on the CPU whatever the
    model's backend; all ranks create it together, right after joining the group)."""

    def __init__(self, tp: TensorParallel):
        self.rank = tp.rank
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.closed = False

    def send(self, events: StepEvents) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends step events")
        dist.broadcast_object_list([events], src=0, group=self.group)

    def recv(self) -> StepEvents:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        """Tell the followers to stop (once; a follower already gone is only logged)."""
        if self.closed or self.rank != 0:
            return
        self.closed = True
        try:
            self.send(StepEvents(stop=True))
        except RuntimeError as exc:                  # gloo: a peer closed its connection
            log.warning("could not stop the tensor-parallel followers: %s", exc)


class LockstepScheduler(Scheduler):
    """A scheduler whose submissions and cancellations take effect at step boundaries only, the
    same on every rank: rank 0 broadcasts them, the others replay them (:meth:`follow`)."""

    def __init__(self, engine: Engine, channel: Channel, **kw):
        super().__init__(engine, **kw)
        self.channel = channel
        self._inbox: list[tuple[Handle, Submission]] = []
        self._cancels: list[Handle] = []
        #: why rank 0 can no longer reach the followers (nothing runs after that)
        self.broken: Exception | None = None

    # ---- any thread (rank 0) ----
    def submit(self, prompt: Sequence[int], params: SamplingParams, *,
               on_event: EventFn | None = None, checked: bool = False) -> Handle:
        """Queue a request for the next step; a seed is drawn here when ``params.seed`` is None,
        so that every rank samples alike."""
        if self.broken is not None:
            raise RuntimeError(f"the tensor-parallel ranks are gone ({self.broken}); the server "
                               "is stopping")
        if not checked:
            self.engine.check_request(prompt, params)
        if params.seed is None:
            params = replace(params, seed=random.randrange(2 ** 63))
        with self._lock:
            if self.num_waiting >= self.max_queue:
                raise QueueFull(f"{self.num_waiting} requests are waiting (the most this server "
                                f"queues); retry shortly")
            self._serial += 1
            sub = Submission(self._serial, [int(t) for t in prompt], params)
            handle = Handle(self._request(sub), on_event)
            self._inbox.append((handle, sub))
            self._wake.notify_all()
        return handle

    def cancel(self, handle: Handle) -> None:
        with self._lock:
            self._cancels.append(handle)
            self._wake.notify_all()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._inbox)

    @property
    def idle(self) -> bool:
        return self.broken is not None or not (self.waiting or self.running or self._inbox
                                               or self._cancels)

    # ---- the engine's thread ----
    def step(self) -> bool:
        """Broadcast the inbox, apply it, run the step (rank 0)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        events = StepEvents(tuple(s for _, s in inbox), tuple(h.request.index for h in cancels))
        try:
            self.channel.send(events)
        except RuntimeError as exc:              # gloo: a follower closed its connection
            self._break(exc, [h for h, _ in inbox])
            raise
        self._apply([h for h, _ in inbox], events.cancelled)
        return super().step()

    def _break(self, exc: Exception, inbox: list[Handle]) -> None:
        """A follower is gone: fail every request (their clients get an error), run nothing."""
        self.broken = exc
        with self._lock:
            handles = [*inbox, *self.waiting, *self.running, *(h for h, _ in self._inbox)]
            self.waiting.clear()
            self._inbox.clear()
            self._cancels.clear()
        self.running = []
        for h in handles:
            self._finish(h)

    def close(self) -> None:
        self.channel.close()

    def follow(self) -> None:
        """A follower's loop: rank 0's events applied, then the same step, until ``stop``."""
        while True:
            events = self.channel.recv()
            if events.stop:
                return
            self._apply([Handle(self._request(s)) for s in events.submitted], events.cancelled)
            try:
                super().step()
            except Exception:                     # as rank 0's engine loop: rank 0 cancels next
                log.exception("a round failed")

    def _request(self, sub: Submission):
        return self.engine.new_request(sub.serial, sub.prompt, sub.params)

    def _apply(self, handles: list[Handle], cancelled: Sequence[int]) -> None:
        gone = set(cancelled)
        with self._lock:
            self.waiting.extend(handles)
            for h in (*self.waiting, *self.running):
                if h.request.index in gone:
                    h.cancelled = True

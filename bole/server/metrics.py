"""The server's Prometheus metrics (prometheus-client), one registry per server instance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from bole.engine.scheduler import RoundReport, Scheduler


_SECONDS = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2, 0.128, 0.256, 0.512, 1.0)


class ServerMetrics:
    """Requests, tokens, rounds, accepted tokens per round, round time, batch and queue."""

    def __init__(self, scheduler: Scheduler):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("bole_requests", "Requests by outcome", ["status"], registry=r)
        self.prompt_tokens = Counter("bole_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.output_tokens = Counter("bole_output_tokens", "Tokens generated", registry=r)
        self.rounds = Counter("bole_rounds", "Speculative rounds run", registry=r)
        self.accepted = Histogram("bole_accepted_tokens_per_round",
                                  "Tokens a request emitted in one round",
                                  buckets=(1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32), registry=r)
        self.round_seconds = Histogram("bole_round_seconds", "Wall time of a round",
                                       buckets=_SECONDS, registry=r)
        self.verified = Histogram("bole_verified_node_slots_per_round",
                                  "Tree node slots verified in a round (rows x slots per tree)",
                                  buckets=(1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096),
                                  registry=r)
        self.admissions = Histogram("bole_admission_seconds",
                                    "Wall time of admitting waiting requests before a round "
                                    "(their prefill and first token)", buckets=_SECONDS,
                                    registry=r)
        self.admitted = Counter("bole_admitted_requests", "Requests admitted into the batch",
                                registry=r)
        self.step_seconds = Histogram("bole_step_seconds",
                                      "Wall time of a scheduler step: admission, round, delivery",
                                      buckets=_SECONDS, registry=r)
        running = Gauge("bole_running_requests", "Requests in the running batch", registry=r)
        waiting = Gauge("bole_waiting_requests", "Requests in the waiting queue", registry=r)
        running.set_function(lambda: scheduler.num_running)
        waiting.set_function(lambda: scheduler.num_waiting)

    def observe_round(self, report: RoundReport) -> None:
        """The scheduler's ``on_round`` hook (engine thread)."""
        if report.admitted:
            self.admissions.observe(report.admit_s)
            self.admitted.inc(report.admitted)
        self.step_seconds.observe(report.step_s)
        if not report.batch:                    # admissions only, no round
            return
        self.rounds.inc()
        self.round_seconds.observe(report.timings.get("total", 0.0) / 1e3)
        self.verified.observe(report.verified_node_slots)
        for n in report.emitted:
            self.accepted.observe(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)

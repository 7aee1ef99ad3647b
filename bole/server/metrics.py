"""The server's Prometheus metrics (prometheus-client), one registry per server instance.

Bole's own (``bole_*``) and, for routers and dashboards built for vLLM, the same quantities
under the names vLLM exports (``vllm:*``, labelled ``model_name``). Per-request latencies are
measured by a :class:`RequestTimer` on the thread that delivers the engine's events:

- time to first token: from the request's arrival (after validation) to its first token;
- time per output token: (last token's time - first token's time) / (tokens - 1);
- inter-token latency: the gap between two deliveries of tokens to a request (one per round:
  a speculative round delivers several tokens at once);
- end-to-end latency: from arrival to the final event;
- queue time: time to first token less the request's prefill (its wait for a slot).

``vllm:gpu_cache_usage_perc`` is the share (0..1) of the cache slots in use; the speculative
counters count draft tokens verified (tree nodes below the root) and draft tokens accepted
(tokens a round emitted beyond its first).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from bole.engine.scheduler import RoundReport, Scheduler

_SECONDS = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2, 0.128, 0.256, 0.512, 1.0)
#: request latencies (s): vLLM's buckets for time to first token and end to end
_LATENCY = (1e-3, 5e-3, 1e-2, 2e-2, 4e-2, 6e-2, 8e-2, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_PER_TOKEN = (1e-3, 2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2, 6e-2, 8e-2, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
              0.75, 1.0, 2.5, 5.0)


class _Twin:
    """One quantity under Bole's name and vLLM's (labelled with the model's name)."""

    def __init__(self, bole, vllm, model: str):
        self.bole, self.vllm = bole, vllm.labels(model_name=model)

    def observe(self, value: float) -> None:
        self.bole.observe(value)
        self.vllm.observe(value)

    def inc(self, value: float = 1) -> None:
        self.bole.inc(value)
        self.vllm.inc(value)


class ServerMetrics:
    """Requests, tokens, latencies, rounds, accepted tokens per round, batch and queue."""

    def __init__(self, scheduler: Scheduler, model: str = "", slots: int = 1):
        self.registry = r = CollectorRegistry()
        m = ["model_name"]

        def hist(name: str, vllm: str, doc: str, buckets) -> _Twin:
            return _Twin(Histogram(name, doc, buckets=buckets, registry=r),
                         Histogram(vllm, doc, m, buckets=buckets, registry=r), model)

        def count(name: str, vllm: str, doc: str) -> _Twin:
            return _Twin(Counter(name, doc, registry=r), Counter(vllm, doc, m, registry=r),
                         model)

        self.requests = Counter("bole_requests", "Requests by outcome", ["status"], registry=r)
        self.http = Counter("bole_http_responses", "HTTP responses by route and status code",
                            ["route", "code"], registry=r)
        self._success = Counter("vllm:request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self.model = model
        self.prompt_tokens = count("bole_prompt_tokens", "vllm:prompt_tokens",
                                   "Prompt tokens admitted")
        self.output_tokens = count("bole_output_tokens", "vllm:generation_tokens",
                                   "Tokens generated")
        self.prefix_queries = count("bole_prefix_cache_queries", "vllm:prefix_cache_queries",
                                    "Prompt tokens of admitted sequences (looked up in the "
                                    "prefix cache)")
        self.prefix_hits = count("bole_prefix_cache_hits", "vllm:prefix_cache_hits",
                                 "Prompt tokens the prefix cache restored instead of computed")
        self.drafted = count("bole_draft_tokens", "vllm:spec_decode_num_draft_tokens",
                             "Draft tokens verified (tree nodes below the root)")
        self.draft_accepted = count("bole_accepted_draft_tokens",
                                    "vllm:spec_decode_num_accepted_tokens",
                                    "Draft tokens accepted (a round's tokens beyond its first)")
        self.ttft = hist("bole_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
                         "Time from a request's arrival to its first token", _LATENCY)
        self.tpot = hist("bole_time_per_output_token_seconds",
                         "vllm:time_per_output_token_seconds",
                         "A request's time per output token after its first", _PER_TOKEN)
        self.itl = hist("bole_inter_token_latency_seconds", "vllm:inter_token_latency_seconds",
                        "Gap between two deliveries of tokens to a request", _PER_TOKEN)
        self.e2e = hist("bole_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds",
                        "Time from a request's arrival to its end", _LATENCY)
        self.queue = hist("bole_request_queue_time_seconds", "vllm:request_queue_time_seconds",
                          "Time a request waited for a slot", _LATENCY)
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
        gauges = (
            ("bole_running_requests", "vllm:num_requests_running", "Requests in the running batch",
             lambda: scheduler.num_running),
            ("bole_waiting_requests", "vllm:num_requests_waiting", "Requests in the waiting queue",
             lambda: scheduler.num_waiting),
            ("bole_cache_usage_ratio", "vllm:gpu_cache_usage_perc",
             "Share of the cache slots in use (0..1)",
             lambda: min(1.0, scheduler.num_running / max(1, slots))))
        for name, vllm, doc, fn in gauges:
            Gauge(name, doc, registry=r).set_function(fn)
            Gauge(vllm, doc, m, registry=r).labels(model_name=model).set_function(fn)

    def finished(self, reason: str) -> None:
        """A request's end: ``stop``, ``length`` or ``abort``."""
        self.requests.labels(reason).inc()
        self._success.labels(model_name=self.model, finished_reason=reason).inc()

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
        self.drafted.inc(max(0, report.verified_node_slots - report.batch))
        self.draft_accepted.inc(sum(max(0, n - 1) for n in report.emitted))
        for n in report.emitted:
            self.accepted.observe(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One sequence's latencies, from its arrival: fed by the thread delivering its events."""

    def __init__(self, metrics: ServerMetrics, arrived: float | None = None):
        self.metrics = metrics
        self.arrived = time.perf_counter() if arrived is None else arrived
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0

    def tokens_arrived(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrived)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.tokens += n

    def finished(self, reason: str, prefill_s: float | None) -> None:
        """The final event: ``prefill_s`` (the engine's, when known) gives the queue time."""
        now = time.perf_counter()
        self.metrics.e2e.observe(now - self.arrived)
        self.metrics.finished(reason)
        self.metrics.output_tokens.inc(self.tokens)
        if self.first is not None:
            if self.tokens > 1:
                self.metrics.tpot.observe((self.last - self.first) / (self.tokens - 1))
            if prefill_s is not None:
                self.metrics.queue.observe(max(0.0, self.first - self.arrived - prefill_s))

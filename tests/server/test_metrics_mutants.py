"""The server's metrics without a server: a request's latencies on a clock the test sets (no
timing assertions), a round's counters from a report written out by hand, and the gauges, each
under Bole's name and vLLM's, read back from the registry."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from bole.engine.scheduler import RoundReport
from bole.server import metrics as metrics_module
from bole.server.metrics import RequestTimer, ServerMetrics

MODEL = "tiny"


class Clock:
    """``time.perf_counter`` as the test sets it."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock(100.0)
    monkeypatch.setattr(metrics_module.time, "perf_counter", c)
    return c


def _get(m: ServerMetrics, name: str, **labels) -> float:
    value = m.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _both(m: ServerMetrics, name: str, suffix: str) -> tuple[float, float]:
    """A histogram's ``_sum`` or ``_count`` under both names."""
    return (_get(m, f"bole_{name}{suffix}"),
            _get(m, f"vllm:{name}{suffix}", model_name=MODEL))


def _close(pair: tuple[float, float], want: float) -> bool:
    return all(math.isclose(x, want, abs_tol=1e-9) for x in pair)


def test_a_requests_latencies(clock: Clock):
    """Arrival at 10, no tokens at 10.5, 1 token at 11, 3 at 11.5, 2 at 12.5, the end at 13
    after a 0.25 s prefill: TTFT 1, gaps 0.5 and 1, TPOT 1.5 / 5, queue 0.75, end to end 3,
    six output tokens and one finished request by its reason."""
    m = ServerMetrics(SimpleNamespace(num_running=0, num_waiting=0), MODEL)
    timer = RequestTimer(m, arrived=10.0)
    for now, n in ((10.5, 0), (11.0, 1), (11.5, 3), (12.5, 2)):
        clock.now = now
        timer.tokens_arrived(n)
    clock.now = 13.0
    timer.finished("length", prefill_s=0.25)
    assert _close(_both(m, "time_to_first_token_seconds", "_sum"), 1.0)
    assert _close(_both(m, "time_to_first_token_seconds", "_count"), 1)
    assert _close(_both(m, "inter_token_latency_seconds", "_sum"), 1.5)
    assert _close(_both(m, "inter_token_latency_seconds", "_count"), 2)
    assert _close(_both(m, "time_per_output_token_seconds", "_sum"), 0.3)
    assert _close(_both(m, "request_queue_time_seconds", "_sum"), 0.75)
    assert _close(_both(m, "e2e_request_latency_seconds", "_sum"), 3.0)
    assert _get(m, "bole_output_tokens_total") == 6
    assert _get(m, "vllm:generation_tokens_total", model_name=MODEL) == 6
    assert _get(m, "bole_requests_total", status="length") == 1
    assert _get(m, "vllm:request_success_total", model_name=MODEL,
                finished_reason="length") == 1
    assert _get(m, "bole_requests_total", status="stop") == 0


def test_short_requests_skip_what_they_cannot_measure(clock: Clock):
    """No token: end to end only. One token: no TPOT (no second token). No prefill time: no
    queue time. A prefill longer than the wait: queue time 0. Arrival defaults to now."""
    m = ServerMetrics(SimpleNamespace(num_running=0, num_waiting=0), MODEL)
    RequestTimer(m, arrived=1.0).finished("abort", prefill_s=None)
    assert _close(_both(m, "e2e_request_latency_seconds", "_sum"), 99.0)
    one = RequestTimer(m)
    clock.now = 102.0
    one.tokens_arrived(1)
    one.finished("stop", prefill_s=5.0)
    assert _close(_both(m, "time_to_first_token_seconds", "_sum"), 2.0)
    assert _close(_both(m, "time_per_output_token_seconds", "_count"), 0)
    assert _close(_both(m, "request_queue_time_seconds", "_count"), 1)
    assert _close(_both(m, "request_queue_time_seconds", "_sum"), 0.0)
    two = RequestTimer(m, arrived=100.0)
    two.tokens_arrived(2)
    two.finished("stop", prefill_s=None)
    assert _close(_both(m, "request_queue_time_seconds", "_count"), 1)
    assert _close(_both(m, "time_per_output_token_seconds", "_sum"), 0.0)
    assert _close(_both(m, "time_per_output_token_seconds", "_count"), 1)
    assert _get(m, "bole_requests_total", status="abort") == 1
    assert _get(m, "bole_requests_total", status="stop") == 2
    assert _get(m, "bole_output_tokens_total") == 3


def test_a_rounds_counters():
    """A step that admitted one request (20 ms) and ran a round of two rows over 10 node slots,
    emitting 3 and 1 tokens in 4 ms: 8 drafted, 2 accepted beyond the first tokens; a step of
    admissions only counts no round; a report without a total time counts a round of 0 s."""
    m = ServerMetrics(SimpleNamespace(num_running=0, num_waiting=0), MODEL)
    m.observe_round(RoundReport(2, [3, 1], 10, {"total": 4.0}, admitted=1, admit_s=0.02,
                                step_s=0.05))
    assert _get(m, "bole_admission_seconds_count") == 1
    assert math.isclose(_get(m, "bole_admission_seconds_sum"), 0.02)
    assert _get(m, "bole_admitted_requests_total") == 1
    assert math.isclose(_get(m, "bole_step_seconds_sum"), 0.05)
    assert _get(m, "bole_rounds_total") == 1
    assert math.isclose(_get(m, "bole_round_seconds_sum"), 0.004)
    assert _get(m, "bole_verified_node_slots_per_round_sum") == 10
    assert _get(m, "bole_draft_tokens_total") == 8
    assert _get(m, "vllm:spec_decode_num_draft_tokens_total", model_name=MODEL) == 8
    assert _get(m, "bole_accepted_draft_tokens_total") == 2
    assert _get(m, "vllm:spec_decode_num_accepted_tokens_total", model_name=MODEL) == 2
    assert _get(m, "bole_accepted_tokens_per_round_count") == 2
    assert _get(m, "bole_accepted_tokens_per_round_sum") == 4
    assert _get(m, "bole_accepted_tokens_per_round_bucket", le="1.0") == 1
    m.observe_round(RoundReport(0, [], 0, {}, admitted=2, admit_s=0.5, step_s=0.5))
    assert _get(m, "bole_rounds_total") == 1 and _get(m, "bole_step_seconds_count") == 2
    assert _get(m, "bole_admitted_requests_total") == 3
    m.observe_round(RoundReport(3, [1, 0, 1], 2, {}, step_s=0.1))
    assert _get(m, "bole_rounds_total") == 2 and _get(m, "bole_round_seconds_count") == 2
    assert math.isclose(_get(m, "bole_round_seconds_sum"), 0.004)
    assert _get(m, "bole_admission_seconds_count") == 2
    assert _get(m, "bole_draft_tokens_total") == 8
    assert _get(m, "bole_accepted_draft_tokens_total") == 2


def test_gauges_read_the_scheduler_when_scraped():
    sched = SimpleNamespace(num_running=3, num_waiting=5)
    m = ServerMetrics(sched, MODEL, slots=4)
    for bole, vllm, want in (("bole_running_requests", "vllm:num_requests_running", 3),
                             ("bole_waiting_requests", "vllm:num_requests_waiting", 5),
                             ("bole_cache_usage_ratio", "vllm:gpu_cache_usage_perc", 0.75)):
        assert _get(m, bole) == want and _get(m, vllm, model_name=MODEL) == want, bole
    sched.num_running = 6                           # more than the slots: the share stays 1
    assert _get(m, "vllm:gpu_cache_usage_perc", model_name=MODEL) == 1.0
    empty = ServerMetrics(SimpleNamespace(num_running=1, num_waiting=0), MODEL, slots=0)
    assert _get(empty, "bole_cache_usage_ratio") == 1.0
    text = m.render().decode()
    assert 'vllm:num_requests_waiting{model_name="tiny"} 5.0' in text


def test_counters_the_server_feeds_under_both_names():
    """What the HTTP side and the admission count (responses by route and code, prompt
    tokens, prefix-cache lookups and hits) reads back under Bole's names and vLLM's."""
    m = ServerMetrics(SimpleNamespace(num_running=0, num_waiting=0), MODEL)
    m.http.labels("/v1/completions", "400").inc()
    m.http.labels("/v1/completions", "200").inc(2)
    m.prompt_tokens.inc(7)
    m.prefix_queries.inc(64)
    m.prefix_hits.inc(48)
    assert _get(m, "bole_http_responses_total", route="/v1/completions", code="400") == 1
    assert _get(m, "bole_http_responses_total", route="/v1/completions", code="200") == 2
    for name, want in (("prompt_tokens", 7), ("prefix_cache_queries", 64),
                       ("prefix_cache_hits", 48)):
        assert _get(m, f"bole_{name}_total") == want, name
        assert _get(m, f"vllm:{name}_total", model_name=MODEL) == want, name

"""/metrics: request latencies (TTFT, TPOT, inter-token, end to end, queue time), responses by
status code (400s included), requests by finish reason and the speculative counters, under
Bole's names and under the names vLLM exports, so that routers and dashboards built for vLLM
read them."""

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests.server.test_api import NAME, Running, _server, bundled  # noqa: E402,F401

VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:gpu_cache_usage_perc", "vllm:time_to_first_token_seconds",
              "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_success_total", "vllm:spec_decode_num_draft_tokens_total",
              "vllm:spec_decode_num_accepted_tokens_total", "vllm:prompt_tokens_total",
              "vllm:generation_tokens_total")


def _samples(url: str) -> dict[str, list]:
    """Every sample of /metrics by its name: [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _value(samples, name: str, **labels) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x
                                                              for k, x in labels.items()))


def test_latencies_outcomes_and_speculation_under_both_names(bundled):  # noqa: F811
    server = _server(bundled, max_batch=2)
    with Running(server) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0,
                               timeout=120)
        res = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=12,
                                        temperature=0, n=2)
        tokens = res.usage.completion_tokens
        list(client.completions.create(model=NAME, prompt="import os\n", max_tokens=8,
                                       temperature=0, stream=True))
        for _ in range(3):
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model=NAME, prompt="x", max_tokens=-1)
        s = _samples(live.url)
    for name in VLLM_NAMES:
        assert name in s or name + "_count" in s, name
    assert all(lab.get("model_name") == NAME for n in VLLM_NAMES
               for lab, _ in s.get(n, s.get(n + "_count", [])))
    # three sequences, each counted once with its finish reason, under both names
    assert _value(s, "vllm:request_success_total", finished_reason="length") == 3
    assert _value(s, "bole_requests_total", status="length") == 3
    assert _value(s, "bole_http_responses_total", route="/v1/completions", code="400") == 3
    assert _value(s, "bole_http_responses_total", route="/v1/completions", code="200") == 2
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "time_per_output_token_seconds"):
        assert _value(s, f"vllm:{name}_count") == 3, name
        assert _value(s, f"bole_{name}_count") == 3, name
        assert _value(s, f"vllm:{name}_sum") > 0 or name == "request_queue_time_seconds"
    assert _value(s, "vllm:inter_token_latency_seconds_count") >= 3
    assert _value(s, "vllm:generation_tokens_total") == tokens + 8
    assert _value(s, "vllm:prompt_tokens_total") == res.usage.prompt_tokens + \
        len(bundled[1].encode("import os\n").ids)
    drafted = _value(s, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _value(s, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafted > accepted > 0                    # the MTP tree: some drafts accepted
    assert _value(s, "bole_draft_tokens_total") == drafted
    assert _value(s, "vllm:num_requests_running") == 0
    assert _value(s, "vllm:gpu_cache_usage_perc") == 0.0

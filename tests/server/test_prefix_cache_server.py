"""The prefix cache through the server: ``usage.prompt_tokens_details.cached_tokens`` and the
prefix-cache metrics (Bole's and vLLM's names), read with the official openai client; output
equal with the cache on and off (bundled model, fp32, CPU)."""

from __future__ import annotations

import re

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from bole.engine import Engine, SpecConfig  # noqa: E402
from bole.engine.prefix_admission import PrefixCacheConfig  # noqa: E402
from bole.server.api import BoleServer  # noqa: E402
from tests.server.test_api import NAME, Running, bundled  # noqa: E402,F401

SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and say when you do "
          "not know. ") * 3


def _serve(bundled, cache: bool) -> Running:
    model, tok = bundled
    engine = Engine(model, SpecConfig("bole", "mtp", depth=4, topk=3, budget=12), max_slots=2,
                    max_len=512, tokenizer=tok,
                    prefix_cache=PrefixCacheConfig(block=16) if cache else None)
    return Running(BoleServer(engine, NAME, max_queue=16))


def _metric(text: str, name: str) -> float:
    """A sample's value from /metrics (the first series of ``name``)."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _ask(client, prompt: str, stream: bool = False):
    if stream:
        chunks = list(client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    return r.choices[0].text, r.usage


def test_cached_tokens_in_usage_and_metrics(bundled):
    model, tok = bundled
    prompts = [SYSTEM + "What is the capital of France?", SYSTEM + "Name a prime number.",
               SYSTEM + "What is the capital of France?"]
    n = [len(tok.encode(p).ids) for p in prompts]
    with _serve(bundled, cache=False) as off_server:
        client = openai.OpenAI(base_url=off_server.url + "/v1", api_key="none")
        want = [_ask(client, p)[0] for p in prompts]
    with _serve(bundled, cache=True) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        got = [_ask(client, p, stream=(i == 2)) for i, p in enumerate(prompts)]
        metrics = httpx.get(server.url + "/metrics").text
    assert [text for text, _ in got] == want
    cached = [usage.prompt_tokens_details.cached_tokens for _, usage in got]
    assert cached[0] == 0
    assert 16 <= cached[1] < n[1]                    # the shared system prompt's whole blocks
    assert cached[2] == n[2] - 1                     # the repeat: all but its last token
    for prefix in ("bole_prefix_cache", "vllm:prefix_cache"):
        assert _metric(metrics, f"{prefix}_queries_total") == sum(n)
        assert _metric(metrics, f"{prefix}_hits_total") == sum(cached)

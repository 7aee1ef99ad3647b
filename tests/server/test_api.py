"""The OpenAI-compatible server, driven by the official openai client over loopback: completions,
chat, streaming, stop strings, errors, metrics, disconnects, and a bounded soak test."""

import asyncio
import contextlib
import socket
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from bole.assets import BUNDLED_MODEL, code_prompts  # noqa: E402
from bole.engine import Engine, SamplingParams, SpecConfig  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402
from bole.server.api import BoleServer, create_app  # noqa: E402

NAME = "bundled"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bundled():
    from tokenizers import Tokenizer
    model = HybridModel.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    return model, tok


def _server(bundled, max_batch=4, max_queue=64) -> BoleServer:
    model, tok = bundled
    engine = Engine(model, SpecConfig("bole", "mtp", depth=6, topk=3, budget=16),
                    max_slots=max_batch, max_len=512, tokenizer=tok)
    return BoleServer(engine, NAME, max_queue=max_queue)


class Running:
    """A uvicorn server on a thread, on 127.0.0.1 and a free port; stopped and joined after."""

    def __init__(self, server: BoleServer):
        self.server = server
        self.port = _free_port()
        config = uvicorn.Config(create_app(server), host="127.0.0.1", port=self.port,
                                log_level="warning")
        self.uv = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uv.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.uv.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.uv.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        assert not self.server.loop.thread.is_alive()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def live(bundled):
    with Running(_server(bundled)) as running:
        yield running


def offline(bundled, prompts, max_tokens):
    model, tok = bundled
    engine = Engine(model, SpecConfig("ar"), max_slots=len(prompts), max_len=512, tokenizer=tok)
    params = SamplingParams(max_tokens=max_tokens)     # stops at eos, as the server
    return [engine.text(r, params) for r in engine.generate(
        [tok.encode(p).ids for p in prompts], params)]


def test_completions_chat_streaming_and_stop(live, bundled):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)
    prompt = code_prompts()[0]
    want = offline(bundled, [prompt], 24)[0]
    res = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
    assert res.choices[0].text == want
    # the count and the reason plain decoding gives (24 tokens, or fewer ended by eos)
    model, tok = bundled
    ids = tok.encode(prompt).ids
    plain = Engine(model, SpecConfig("ar"), max_slots=1, max_len=512).generate(
        [ids], SamplingParams(max_tokens=24))[0]
    assert res.usage.completion_tokens == len(plain.token_ids)
    assert res.choices[0].finish_reason == plain.finish_reason
    assert res.usage.prompt_tokens == len(ids)
    assert res.usage.total_tokens == len(ids) + len(plain.token_ids)
    extra = res.usage.model_extra
    # every token after the prefill's first came from a round; the MTP tree beats one per round
    assert extra["mean_accepted_tokens"] == pytest.approx(
        (res.usage.completion_tokens - 1) / extra["rounds"])
    assert extra["mean_accepted_tokens"] > 1
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == res.usage.completion_tokens
    stop = want[len(want) // 2: len(want) // 2 + 3]
    cut = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == want[:want.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], stream=True))
    assert streamed == cut.choices[0].text
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "write a function"}], max_tokens=12,
        temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    parts = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "write a function"}], max_tokens=12,
        temperature=0, stream=True)
    assert "".join(p.choices[0].delta.content or "" for p in parts) == \
        chat.choices[0].message.content


def test_models_health_and_metrics(live):
    from prometheus_client.parser import text_string_to_metric_families
    models = httpx.get(live.url + "/v1/models").json()
    assert models["data"][0]["id"] == NAME and models["data"][0]["bole"]["mode"] == "bole"
    assert httpx.get(live.url + "/health").json()["status"] == "ok"
    httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "x = ",
                                                   "max_tokens": 4, "temperature": 0},
               timeout=60)
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(live.url + "/metrics").text)}
    for name in ("bole_requests", "bole_rounds", "bole_accepted_tokens_per_round",
                 "bole_round_seconds", "bole_running_requests", "bole_waiting_requests",
                 "bole_verified_node_slots_per_round", "bole_output_tokens"):
        assert name in families, name
    rounds = next(s.value for s in families["bole_rounds"].samples if s.name == "bole_rounds_total")
    assert rounds >= 1


@pytest.mark.parametrize("body,needle", [
    ("{not json", "json"),
    ({"model": NAME, "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": 100000}, "context"),
    ({"model": NAME, "prompt": "x " * 3000, "max_tokens": 8}, "context"),
    ({"model": NAME, "prompt": "x", "n": 1000}, "less than or equal to 16"),
    ({"model": "gpt-9", "prompt": "x"}, "unknown model"),
    ({"model": NAME, "prompt": ""}, "empty"),
    ({"model": NAME, "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": NAME, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": NAME}, "prompt"),
])
def test_bad_requests_get_400_with_an_openai_error(live, body, needle):
    kw = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, str) else {"json": body}
    res = httpx.post(live.url + "/v1/completions", **kw)
    assert res.status_code == 400, res.text
    err = res.json()["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"].lower() + \
        str(err.get("param")).lower()
    assert httpx.get(live.url + "/health").json()["status"] == "ok"      # still serving


def test_a_full_queue_gets_503_with_retry_after(bundled):
    server = _server(bundled, max_batch=1, max_queue=1)
    server.scheduler.submit([1, 2, 3], SamplingParams(max_tokens=4))   # the queue is full
    app = create_app(server)                   # no lifespan: the engine thread never drains it

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as c:
            return await c.post("/v1/completions", json={"model": NAME, "prompt": "x"})
    res = asyncio.run(post())
    assert res.status_code == 503 and res.headers["retry-after"] == "1"
    assert res.json()["error"]["type"] == "server_busy"


def test_a_client_that_disconnects_frees_its_slot(bundled):
    server = _server(bundled, max_batch=2)
    with Running(server) as running:
        with httpx.stream("POST", running.url + "/v1/completions", timeout=60,
                          json={"model": NAME, "prompt": code_prompts()[1], "max_tokens": 400,
                                "temperature": 0, "stream": True}) as res:
            for line in res.iter_lines():
                if line.startswith("data: ") and "text" in line:
                    break                      # one chunk, then hang up
        deadline = time.time() + 20
        while server.scheduler.num_running or server.engine.cache.num_free != 2:
            assert time.time() < deadline, "the slot was not freed"
            time.sleep(0.02)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_soak(bundled):
    """Two rounds of 200 requests, at most 32 at a time, mixing streaming, non-streaming, chat,
    cancellations and bad requests: every good one completes with the offline engine's output,
    every slot is free at the end, memory stays flat after warm-up; bounded in count and time."""
    prompts = code_prompts()
    want = dict(zip(prompts, offline(bundled, prompts, 8)))
    server = _server(bundled, max_batch=8, max_queue=256)
    results = {"ok": 0, "bad": 0, "cancelled": 0}

    async def one(client, i: int, sem):
        async with sem:
            kind = i % 5
            p = prompts[i % len(prompts)]
            if kind == 0:                                         # streaming
                text = ""
                async for c in await client.completions.create(
                        model=NAME, prompt=p, max_tokens=8, temperature=0, stream=True):
                    text += c.choices[0].text if c.choices else ""
                assert text == want[p]
            elif kind == 1:                                       # non-streaming
                res = await client.completions.create(model=NAME, prompt=p, max_tokens=8,
                                                      temperature=0)
                assert res.choices[0].text == want[p]
            elif kind == 2:                                       # chat
                res = await client.chat.completions.create(
                    model=NAME, messages=[{"role": "user", "content": p}], max_tokens=8,
                    temperature=0)
                assert res.choices[0].finish_reason in ("length", "stop")
            elif kind == 3:                                       # cancelled mid-stream
                stream = await client.completions.create(
                    model=NAME, prompt=p, max_tokens=64, temperature=0, stream=True)
                # the client's chunk iterator is an async generator: close it here, in the
                # loop, rather than leave it to a garbage collection in another thread
                async with contextlib.aclosing(stream.__aiter__()) as chunks:
                    async for _ in chunks:
                        break
                await stream.close()
                results["cancelled"] += 1
                return
            else:                                                 # bad request
                with pytest.raises(openai.BadRequestError):
                    await client.completions.create(model=NAME, prompt=p, max_tokens=-1)
                results["bad"] += 1
                return
            results["ok"] += 1

    async def run(n: int, base: str):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                                    timeout=120)
        sem = asyncio.Semaphore(32)
        await asyncio.gather(*(one(client, i, sem) for i in range(n)))
        await client.close()

    with Running(server) as running:
        t0 = time.time()
        asyncio.run(run(40, running.url))                     # warm-up
        rss0 = _rss()
        rss = []
        for _ in range(2):
            asyncio.run(run(200, running.url))
            rss.append(_rss())
        assert time.time() - t0 < 600
        deadline = time.time() + 20
        while server.scheduler.num_running or server.scheduler.num_waiting:
            assert time.time() < deadline
            time.sleep(0.05)
        assert server.engine.cache.num_free == 8
        # a leak grows with every 200 requests; resident memory may jump once past the warm-up
        # on a busier machine (seen: +5.5% over the first 200, then flat over five more)
        assert rss[1] <= rss[0] * 1.05 and rss[1] <= rss0 * 1.15, (rss0, rss)
    per_kind = (40 + 2 * 200) // 5
    assert results == {"ok": 3 * per_kind, "bad": per_kind, "cancelled": per_kind}

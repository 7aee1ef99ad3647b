"""The server's HTTP contract as a client reads it, on the tiny preset behind a two-letters-per-
token tokenizer (fast and deterministic): every finish reason streamed and not, ``usage``, the
raw SSE framing ending in ``data: [DONE]``, stop strings, and sampled output that follows the
model's own distribution. Streams are read line by line with httpx, not through a client
library that could hide a missing terminator."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")

from bole.engine import Engine, SpecConfig  # noqa: E402
from bole.models.presets import preset_config  # noqa: E402
from bole.models.qwen3_hybrid import HybridModel  # noqa: E402
from bole.server.api import BoleServer  # noqa: E402
from tests.engine.test_user_visible import (  # noqa: E402
    PROMPT, check_fit, reference_levels)
from tests.server.stream_reading import read_sse  # noqa: E402
from tests.server.test_api import Running  # noqa: E402

NAME = "tiny"
LETTERS, CASES = "ABCDEFGHIJKLMNOP", "abcdefgh"


def pair_tokenizer():
    """A real ``tokenizers.Tokenizer`` in which token t is the two letters
    ``LETTERS[t % 16] + CASES[t // 16]`` (distinct for the tiny preset's 128 tokens): text splits
    into two-character pieces, anything else is token 127, and decoding concatenates."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    vocab = {LETTERS[t % 16] + CASES[t // 16]: t for t in range(128)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=LETTERS[15] + CASES[7]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("..?"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


TOKENIZER = pair_tokenizer()


def ids_of(text: str) -> list[int]:
    assert len(text) % 2 == 0
    return TOKENIZER.encode(text).ids


def tiny_model(eos: tuple[int, ...]) -> HybridModel:
    m = HybridModel.random(preset_config("tiny"), dtype=torch.float32, seed=3, gdn_backend="torch")
    tensors = dict(m.w)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 8
    return HybridModel(dataclasses.replace(m.config, eos_token_id=eos), tensors,
                       gdn_backend="torch")


def serve(model: HybridModel, max_batch: int = 4, mode: str = "bole") -> Running:
    spec = SpecConfig("ar") if mode == "ar" else SpecConfig(mode, "ngram", depth=3, topk=3,
                                                             budget=10)
    engine = Engine(model, spec, max_slots=max_batch, max_len=128, tokenizer=TOKENIZER)
    return Running(BoleServer(engine, NAME, max_queue=1024))


def greedy_ids(model: HybridModel, n: int) -> list[int]:
    """Plain greedy decoding of PROMPT with the engine's own ``ar`` mode, no stop tokens."""
    from bole.engine import SamplingParams
    engine = Engine(model, SpecConfig("ar"),
                    max_slots=1, max_len=128)
    return engine.generate([PROMPT], SamplingParams(max_tokens=n))[0].token_ids


@pytest.fixture(scope="module")
def plain():
    """A server whose eos never comes up in these prompts' greedy output, and that output."""
    model = tiny_model(eos=())
    want = greedy_ids(model, 24)
    with serve(model) as running:
        yield running, want


def sse(url: str, body: dict) -> tuple[list[dict], list[str]]:
    """POST with ``stream: true``; the JSON events and every raw non-empty line."""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as res:
        assert res.status_code == 200
        assert res.headers["content-type"].startswith("text/event-stream")
        return read_sse(res)


def text_of(events: list[dict], chat: bool) -> str:
    return "".join((c["choices"][0]["delta"].get("content") or "") if chat
                   else c["choices"][0]["text"] for c in events if c.get("choices"))


def check_stream(events: list[dict], lines: list[str], finish: str, usage: bool) -> None:
    """The framing: ``[DONE]`` last and once; exactly one chunk with a finish reason, after every
    text chunk; with ``include_usage`` one usage chunk (no choices) right before ``[DONE]``."""
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    with_choices = [e for e in events if e.get("choices")]
    reasons = [e["choices"][0]["finish_reason"] for e in with_choices]
    assert reasons[-1] == finish and all(r is None for r in reasons[:-1]), reasons
    if usage:
        assert "usage" in events[-1] and events[-1]["choices"] == []
        assert all("usage" not in e or e["usage"] is None for e in events[:-1])
    else:
        assert all(e.get("usage") is None for e in events)


def check_envelope(bodies: list[dict], chat: bool, stream: bool) -> None:
    """OpenAI's envelope on every body: one id for the whole response (``cmpl-`` or
    ``chatcmpl-``), the object type, the served model's name, a creation time in seconds, and
    choice 0 with its ``logprobs`` (none asked for)."""
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else \
        "text_completion"
    assert len({b["id"] for b in bodies}) == 1
    assert bodies[0]["id"].startswith("chatcmpl-" if chat else "cmpl-")
    for b in bodies:
        assert b["object"] == kind and b["model"] == NAME
        assert isinstance(b["created"], int) and abs(b["created"] - time.time()) < 600
        for c in b["choices"]:
            assert c["index"] == 0 and c["logprobs"] is None
            if chat and not stream:
                assert c["message"]["role"] == "assistant"


def check_usage(use: dict, prompt_tokens: int, completion_tokens: int) -> None:
    assert use["prompt_tokens"] == prompt_tokens
    assert use["completion_tokens"] == completion_tokens
    assert use["total_tokens"] == prompt_tokens + completion_tokens
    # every token after the prefill's first came from a round
    assert use["accepted_tokens"] == completion_tokens - 1
    assert use["mean_accepted_tokens"] == pytest.approx(use["accepted_tokens"] / use["rounds"])


@pytest.mark.parametrize("stream", [False, True])
def test_length(plain, stream):
    running, want = plain
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 9, "temperature": 0}
    if stream:
        events, lines = sse(running.url + "/v1/completions",
                            {**body, "stream_options": {"include_usage": True}})
        check_stream(events, lines, "length", usage=True)
        check_envelope(events, chat=False, stream=True)
        text, use = text_of(events, chat=False), events[-1]["usage"]
        # the token_ids extension lists each chunk's tokens: together, the whole output
        assert [t for e in events if e.get("choices")
                for t in e["choices"][0].get("token_ids") or []] == want[:9]
    else:
        res = httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()
        assert res["choices"][0]["finish_reason"] == "length"
        check_envelope([res], chat=False, stream=False)
        text, use = res["choices"][0]["text"], res["usage"]
    assert ids_of(text) == want[:9]
    check_usage(use, len(PROMPT), 9)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_first_match(plain, stream):
    """Two stop strings, the one listed first matching later: the text ends before the earliest
    match (which straddles a token boundary), finish reason ``stop``; the usage counts the
    tokens generated up to the one that completed the match."""
    running, want = plain
    full = TOKENIZER.decode(want)
    early = full[7:10]                        # from inside token 3 into token 4
    late = full[14:17]
    assert full.find(early) == 7 and full.find(late) > 7
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "stop": [late, early]}
    if stream:
        events, lines = sse(running.url + "/v1/completions",
                            {**body, "stream_options": {"include_usage": True}})
        check_stream(events, lines, "stop", usage=True)
        text, use = text_of(events, chat=False), events[-1]["usage"]
        # the tokens cut with the stop string still stream their ids
        assert [t for e in events if e.get("choices")
                for t in e["choices"][0].get("token_ids") or []] == want[:5]
    else:
        res = httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()
        assert res["choices"][0]["finish_reason"] == "stop"
        text, use = res["choices"][0]["text"], res["usage"]
    assert text == full[:7]
    check_usage(use, len(PROMPT), 5)


def test_streamed_ids_and_logprobs_add_up_to_the_whole_response():
    """Plain decoding (a token an event) cut by a stop string: the streamed token ids and
    logprob entries are the whole response's, every one of them."""
    model = tiny_model(eos=())
    want = greedy_ids(model, 24)
    full = TOKENIZER.decode(want)
    with serve(model, max_batch=1, mode="ar") as running:
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                "stop": [full[7:10]], "logprobs": 1}
        events, lines = sse(running.url + "/v1/completions", body)
        whole = httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()
    check_stream(events, lines, "stop", usage=False)
    streamed = [t for e in events if e.get("choices")
                for t in e["choices"][0].get("token_ids") or []]
    assert streamed == want[:5]
    entries = [lp for e in events if e.get("choices") and e["choices"][0].get("logprobs")
               for lp in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert len(entries) == len(whole["choices"][0]["logprobs"]["token_logprobs"]) == 5


@pytest.mark.parametrize("seed", [1 << 64, -(1 << 63) - 1])
def test_a_seed_outside_torchs_range_is_a_400(plain, seed):
    running, _ = plain
    res = httpx.post(running.url + "/v1/completions", json={
        "model": NAME, "prompt": PROMPT, "max_tokens": 2, "seed": seed}, timeout=60)
    assert res.status_code == 400 and res.json()["error"]["param"] == "seed"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_length_and_usage(plain, stream):
    running, _ = plain
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "temperature": 0}
    url = running.url + "/v1/chat/completions"
    if stream:
        events, lines = sse(url, {**body, "stream_options": {"include_usage": True}})
        check_stream(events, lines, "length", usage=True)
        check_envelope(events, chat=True, stream=True)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        text, use = text_of(events, chat=True), events[-1]["usage"]
    else:
        res = httpx.post(url, json=body, timeout=60).json()
        assert res["choices"][0]["finish_reason"] == "length"
        check_envelope([res], chat=True, stream=False)
        text, use = res["choices"][0]["message"]["content"], res["usage"]
    assert len(ids_of(text)) == 6 and use["completion_tokens"] == 6
    assert use["total_tokens"] == use["prompt_tokens"] + 6 and use["prompt_tokens"] > 0


def test_one_token_request_has_no_rounds(plain):
    """max_tokens 1: the prefill's token alone, no round: usage says 0 rounds and a mean of 0."""
    running, want = plain
    res = httpx.post(running.url + "/v1/completions", json={
        "model": NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}, timeout=60).json()
    assert res["choices"][0]["finish_reason"] == "length"
    assert ids_of(res["choices"][0]["text"]) == want[:1]
    use = res["usage"]
    assert (use["completion_tokens"], use["rounds"], use["accepted_tokens"]) == (1, 0, 0)
    assert use["mean_accepted_tokens"] == 0.0 and use["total_tokens"] == len(PROMPT) + 1


def test_stream_without_usage_ends_in_done(plain):
    running, want = plain
    events, lines = sse(running.url + "/v1/completions",
                        {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    check_stream(events, lines, "length", usage=False)
    assert ids_of(text_of(events, chat=False)) == want[:4]


@pytest.mark.parametrize("stream", [False, True])
def test_eos_stops_with_stop(stream):
    """The model's eos token ends the output with finish reason ``stop``, counted in the
    usage."""
    model = tiny_model(eos=())
    want = greedy_ids(model, 24)
    eos = want[4]
    n = want.index(eos) + 1
    with serve(tiny_model(eos=(eos,)), max_batch=1) as running:
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        if stream:
            events, lines = sse(running.url + "/v1/completions",
                                {**body, "stream_options": {"include_usage": True}})
            check_stream(events, lines, "stop", usage=True)
            text, use = text_of(events, chat=False), events[-1]["usage"]
        else:
            res = httpx.post(running.url + "/v1/completions", json=body, timeout=60).json()
            assert res["choices"][0]["finish_reason"] == "stop"
            text, use = res["choices"][0]["text"], res["usage"]
    # nothing after the eos; its own letters show (this tokenizer has no special tokens)
    assert ids_of(text) == want[:n]
    check_usage(use, len(PROMPT), n)


def test_sampled_output_follows_the_models_distribution():
    """768 seeded requests at temperature 0.7, top-k 6, top-p 0.8 through HTTP: the first three
    tokens fit the joint distribution of plain forwards and a reference filter (as the engine's
    test), so the server passes each request's sampling parameters through."""
    case = (0.7, 6, 0.8)
    model = tiny_model(eos=())
    levels = reference_levels(model, PROMPT, 3, case)
    N = 768

    async def run(url):
        sem = asyncio.Semaphore(48)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def one(seed):
                async with sem:
                    res = await client.post("/v1/completions", json={
                        "model": NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": case[0],
                        "top_k": case[1], "top_p": case[2], "seed": seed})
                    body = res.json()
                    assert body["choices"][0]["finish_reason"] == "length"
                    return tuple(ids_of(body["choices"][0]["text"]))
            return await asyncio.gather(*(one(s) for s in range(N)))

    with serve(model, max_batch=32) as running:
        samples = asyncio.run(run(running.url))
    pvalues = check_fit(samples, levels)
    assert len(pvalues) >= 2 and min(pvalues) > 1e-3, pvalues

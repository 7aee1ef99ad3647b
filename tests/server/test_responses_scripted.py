"""The HTTP layer against a scripted engine (tests/server/scripted.py: the real scheduler and
engine thread, the engine's own finishing rules, scripted tokens), in this process: what a
client reads (texts, finish reasons, usage, logprobs, the SSE framing, errors and their
status codes) for a known output, each expected value computed here from the tokenizer. Fast
(no model), so every branch of ``api.py`` and ``responses.py`` is reached in seconds."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from bole.server.api import BoleServer, ServerConfig, create_app  # noqa: E402
from bole.server.engine_process import EngineClient  # noqa: E402
from bole.server.protocol import choice_seed  # noqa: E402
from tests.server.scripted import (EOS, FAILING_PROMPT, ScriptedEngine, logprob_of,  # noqa: E402
                                   tokenizer)
from tests.server.stream_reading import read_sse  # noqa: E402

NAME = "scripted"
PROMPT = "def fibonacci(n):"


def make(max_slots: int = 4, max_queue: int = 64, per_round: int = 3, max_len: int = 256,
         **config):
    engine = ScriptedEngine(max_slots=max_slots, max_len=max_len, per_round=per_round)
    server = BoleServer(engine, NAME, max_queue=max_queue,
                        config=ServerConfig(**config) if config else None)
    return engine, server


def make_in_process(engine_args: tuple = ()) -> BoleServer:
    """A server whose scripted engine, ``ScriptedEngine(*engine_args)``, runs in an engine
    process of its own (as ``bole serve --engine-process``)."""
    c = EngineClient(ScriptedEngine, engine_args, max_queue=8, startup_timeout=300)
    return BoleServer(None, NAME, client=c, tokenizer=tokenizer(), max_batch=4)


@pytest.fixture
def live():
    """(engine, server, client) with the app's lifespan running, the engine on its thread."""
    engine, server = make()
    with TestClient(create_app(server)) as client:
        try:
            yield engine, server, client
        finally:
            engine.go()                  # a failed test's held rounds must not hang the exit


@pytest.fixture(scope="module")
def in_process():
    """The server with the scripted engine in an engine process of its own (``bole serve
    --engine-process``), one for the module (the app's lifespan ends the process)."""
    server = make_in_process()
    with TestClient(create_app(server)) as client:
        yield ScriptedEngine(), server, client       # the engine here: expected outputs only


@pytest.fixture(params=["thread", "process"])
def served(request):
    """The request-only tests run against both: the engine on the server's thread, and in a
    process of its own."""
    return request.getfixturevalue("live" if request.param == "thread" else "in_process")


def text_of(engine: ScriptedEngine, ids: list[int], stops=()) -> str:
    """What a response should say for output ``ids``: the decoded text cut before the first
    stop string, an incomplete character at the end left out."""
    text = engine.tokenizer.decode(ids)
    hits = [text.find(s) for s in stops if s in text]
    return text[:min(hits)] if hits else text.rstrip("\ufffd")


def sse(response) -> tuple[list[dict], list[str]]:
    """The JSON events of a streamed response and its raw ``data:`` payloads, in order (every
    non-empty line a ``data:`` line)."""
    events, lines = read_sse(response)
    return events, [line[len("data: "):] for line in lines]


def post(client, path: str, **body):
    return client.post(path, json=dict(model=NAME, **body))


def stream(client, path: str, **body):
    with client.stream("POST", path, json=dict(model=NAME, stream=True, **body)) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events, raw = sse(r)
    check_framing(events, raw, chat="chat" in path)
    return events, raw


def check_framing(events: list[dict], raw: list[str], chat: bool) -> None:
    """What every stream holds to: one ``[DONE]``, last; one id and the model's name on every
    chunk; each choice's chunks carry text or token ids (chat's first: the role), then one
    finish chunk with no text, and nothing after it."""
    assert raw[-1] == "[DONE]" and raw.count("[DONE]") == 1
    chunks = [e for e in events if "error" not in e]
    assert len({e["id"] for e in chunks}) == 1
    kind = "chat.completion.chunk" if chat else "text_completion"
    assert all(e["model"] == NAME and e["object"] == kind for e in chunks)
    started, finished, textless = set(), set(), set()
    for e in chunks:
        if not e["choices"]:                               # the usage chunk
            continue
        c = e["choices"][0]
        i = c["index"]
        assert i not in finished, "a chunk after the choice's finish"
        text = c["delta"]["content"] if chat else c["text"]
        if c["finish_reason"] is not None:
            assert text == "" and "token_ids" not in c
            finished.add(i)
            continue
        elif chat and i not in started:
            assert c["delta"]["role"] == "assistant"
        elif not text:
            # tokens that add no text come with the final event only (an end-of-sequence
            # token, a stop string's): the finish follows at once
            assert c.get("token_ids"), f"an empty chunk: {e}"
            textless.add(i)
            started.add(i)
            continue
        assert i not in textless, "a chunk after a text-less one before the finish"
        started.add(i)


def prompt_len(engine, prompt: str = PROMPT) -> int:
    return len(engine.tokenizer.encode(prompt).ids)


def check_usage_so_far(events: list[dict], total: int) -> None:
    """A stream of one choice with continuous usage stats: every chunk's usage counts at least
    the token ids sent up to it and at most those sent up to the next chunk with token ids (the
    usage is read as its chunk goes out, when the engine may have emitted tokens that the next
    chunk carries); from the last chunk with token ids on, all ``total``. Holds however the
    rounds' events were merged into chunks; with three or more chunks of tokens, a usage that
    counted the whole output from the start breaks it."""
    sent, rows = 0, []                          # (token ids sent up to the chunk, its usage)
    for e in events:
        ids = e["choices"][0].get("token_ids") if e["choices"] else None
        sent += len(ids or [])
        rows.append((sent, e["usage"]["completion_tokens"], ids is not None))
    assert sent == total, events
    for k, (low, used, _) in enumerate(rows):
        high = next((s for s, _, tokens in rows[k + 1:] if tokens), total)
        assert low <= used <= high, (k, rows)


# ---- whole responses ----

def test_a_completion_says_the_scripted_text_with_length_and_its_usage(served):
    engine, server, client = served
    r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=10, temperature=0)
    assert r.status_code == 200
    body = r.json()
    ids = engine.expected(None, 10)
    assert body["object"] == "text_completion" and body["model"] == NAME
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": text_of(engine, ids),
                                "finish_reason": "length", "logprobs": None}]
    rounds = 3                                          # 1 at admission, then 3 + 3 + 3
    assert body["usage"] == {
        "prompt_tokens": prompt_len(engine), "completion_tokens": 10,
        "total_tokens": prompt_len(engine) + 10, "prompt_tokens_details": {"cached_tokens": 0},
        "rounds": rounds, "accepted_tokens": 9, "mean_accepted_tokens": 3.0}
    assert not server.inflight
    wait_until(lambda: engine.cache.num_free == 4)     # freed as the round's events go out


def test_a_chat_completion_is_the_assistant_message(served):
    engine, _, client = served
    r = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
             max_completion_tokens=7, seed=5)
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "finish_reason": "length", "logprobs": None,
                                "message": {"role": "assistant",
                                            "content": text_of(engine,
                                                               engine.expected(5, 7))}}]
    assert body["usage"]["completion_tokens"] == 7


def test_a_stop_string_cuts_before_its_first_match_and_finishes_with_stop(served):
    engine, _, client = served
    ids = engine.expected(None, 30)
    full = engine.tokenizer.decode(ids)
    r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=30, stop=["o", "lazy"])
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full[:full.index("o")] == " The quick br"


def test_a_stop_token_id_finishes_with_stop(served):
    engine, _, client = served
    ids = engine.expected(None, 12)
    r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=12, stop_token_ids=[ids[4]])
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 5         # the stop token is an output token
    assert body["choices"][0]["text"] == text_of(engine, ids[:5])


def test_n_choices_and_several_prompts_come_back_in_index_order_with_their_own_seeds(served):
    engine, _, client = served
    prompts = [PROMPT, "import torch"]
    r = post(client, "/v1/completions", prompt=prompts, n=2, max_tokens=4, seed=11)
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for c in body["choices"]:
        assert c["text"] == text_of(engine, engine.expected(choice_seed(11, c["index"]), 4))
    assert body["choices"][0]["text"] != body["choices"][1]["text"]
    lengths = [prompt_len(engine, p) for p in prompts]
    assert body["usage"]["prompt_tokens"] == sum(lengths)          # once per prompt, not per n
    assert body["usage"]["completion_tokens"] == 16
    # each choice: its first token at admission, then one round of 3; the usage adds them up
    assert body["usage"]["rounds"] == 4 and body["usage"]["accepted_tokens"] == 12


def test_token_id_prompts_and_echo(served):
    engine, _, client = served
    ids = engine.tokenizer.encode(PROMPT).ids
    body = post(client, "/v1/completions", prompt=ids, max_tokens=3, echo=True).json()
    assert body["choices"][0]["text"] == PROMPT + text_of(engine, engine.expected(None, 3))
    assert body["usage"]["prompt_tokens"] == len(ids)
    two = post(client, "/v1/completions", prompt=[ids, ids[:2]], max_tokens=2).json()
    assert two["usage"]["prompt_tokens"] == len(ids) + 2


def test_completion_logprobs_list_each_token_its_alternatives_and_text_offsets(served):
    engine, _, client = served
    body = post(client, "/v1/completions", prompt=PROMPT, max_tokens=5, logprobs=2,
                echo=True).json()
    ids = engine.expected(None, 5)
    lp = body["choices"][0]["logprobs"]
    tokens = [engine.tokenizer.decode([t]) for t in ids]
    assert lp["tokens"] == tokens
    assert lp["token_logprobs"] == [logprob_of(t) for t in ids]
    assert lp["top_logprobs"] == [{engine.tokenizer.decode([t]): logprob_of(t),
                                   engine.tokenizer.decode([t + 1]): logprob_of(t) - 1}
                                  for t in ids]
    offsets = [len(PROMPT) + sum(len(x) for x in tokens[:k]) for k in range(5)]
    assert lp["text_offset"] == offsets


def test_chat_logprobs_are_content_entries_with_bytes(served):
    engine, _, client = served
    body = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
                max_tokens=3, logprobs=True, top_logprobs=1).json()
    ids = engine.expected(None, 3)
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [engine.tokenizer.decode([t]) for t in ids]
    assert [e["logprob"] for e in content] == [logprob_of(t) for t in ids]
    assert [e["bytes"] for e in content] == [list(engine.tokenizer.decode([t]).encode())
                                             for t in ids]
    assert [len(e["top_logprobs"]) for e in content] == [1, 1, 1]


# ---- streamed responses ----

def test_a_stream_adds_up_to_the_whole_text_and_ends_with_the_finish_then_done(served):
    engine, _, client = served
    events, raw = stream(client, "/v1/completions", prompt=PROMPT, max_tokens=32)
    assert raw[-1] == "[DONE]" and raw.count("[DONE]") == 1
    ids = engine.expected(None, 32)
    assert "".join(e["choices"][0]["text"] for e in events) == text_of(engine, ids)
    assert all(e["object"] == "text_completion" for e in events)
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("cmpl-")
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1]["choices"][0] == {"index": 0, "text": "", "finish_reason": "length",
                                        "logprobs": None}
    # token ids: every output token once, in order, on the chunks that carry text
    got = [t for e in events for t in e["choices"][0].get("token_ids", [])]
    assert got == ids
    # no chunk shows half a character: the emoji's four byte tokens arrive as one delta
    assert all("\ufffd" not in e["choices"][0]["text"] for e in events)
    assert "\U0001F642" in [e["choices"][0]["text"].strip() for e in events] or any(
        "\U0001F642" in e["choices"][0]["text"] for e in events)


def test_a_streamed_stop_string_never_shows_and_finishes_with_stop(served):
    engine, _, client = served
    events, raw = stream(client, "/v1/completions", prompt=PROMPT, max_tokens=30,
                         stop=["lazy dog"])
    text = "".join(e["choices"][0]["text"] for e in events)
    assert text == " The quick brown fox jumps over the "
    assert events[-1]["choices"][0]["finish_reason"] == "stop" and raw[-1] == "[DONE]"


def test_a_streamed_chat_starts_with_the_role_and_ends_with_its_finish(served):
    engine, _, client = served
    events, raw = stream(client, "/v1/chat/completions",
                         messages=[{"role": "user", "content": "hi"}], max_tokens=6)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:])
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["id"].startswith("chatcmpl-")
    text = "".join(e["choices"][0]["delta"]["content"] for e in events)
    assert text == text_of(engine, engine.expected(None, 6))
    assert events[-1]["choices"][0]["finish_reason"] == "length" and raw[-1] == "[DONE]"


def test_stream_usage_last_or_on_every_chunk(served):
    engine, _, client = served
    events, _ = stream(client, "/v1/completions", prompt=PROMPT, max_tokens=7,
                       stream_options={"include_usage": True})
    assert all("usage" not in e for e in events[:-1])
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 7
    assert events[-1]["usage"]["prompt_tokens"] == prompt_len(engine)
    events, _ = stream(client, "/v1/chat/completions", max_tokens=7,
                       messages=[{"role": "user", "content": "hi"}],
                       stream_options={"include_usage": True})
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 7
    events, _ = stream(client, "/v1/completions", prompt=PROMPT, max_tokens=16,
                       stream_options={"continuous_usage_stats": True})
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 16
    check_usage_so_far(events, 16)


def test_streamed_echo_comes_first_and_several_choices_each_finish(served):
    engine, _, client = served
    events, raw = stream(client, "/v1/completions", prompt=PROMPT, max_tokens=5, echo=True,
                         n=2, seed=3)
    assert events[0]["choices"][0]["text"] == PROMPT
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == PROMPT + text_of(
            engine, engine.expected(choice_seed(3, index), 5))
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
    assert raw[-1] == "[DONE]"


def test_streamed_logprobs_add_up_to_the_whole_responses(served):
    engine, _, client = served
    whole = post(client, "/v1/completions", prompt=PROMPT, max_tokens=9, logprobs=1,
                 echo=True).json()["choices"][0]["logprobs"]
    events, _ = stream(client, "/v1/completions", prompt=PROMPT, max_tokens=9, logprobs=1,
                       echo=True)
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in p[key]] == whole[key], key


class PacedEngine(ScriptedEngine):
    """A scripted engine whose rounds wait (at most 30 s) while the stream has not put every
    token emitted so far into a chunk (``chunked``, counted by the test): each round's events
    then make a chunk of their own, however slowly the client reads. ``paced``: off for
    requests that are not streamed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.paced, self.chunked = True, 0
        self._chunks = threading.Condition()

    def chunk(self, tokens: int) -> None:
        with self._chunks:
            self.chunked += tokens
            self._chunks.notify_all()

    def step(self, running, prelaunch: bool = False) -> dict:
        if self.paced:
            with self._chunks:
                self._chunks.wait_for(
                    lambda: self.chunked >= sum(len(r.out) for r in running), 30)
        return super().step(running, prelaunch)


def test_an_end_of_sequence_token_that_adds_no_text_still_comes_with_its_id_and_logprob(
        monkeypatch):
    """The end-of-sequence token decodes to nothing and arrives alone in a round (admission
    emits token 0, the rounds 1-3 and then the end; the rounds paced so that the end's round
    is a chunk of its own): a chunk still carries its id and logprob, just before the finish,
    and the text is that of the tokens before it."""
    from bole.server import responses
    plain = ScriptedEngine()
    script = plain.script[:4] + [EOS] + plain.script[4:]
    engine = PacedEngine(script=script)
    assert engine.tokenizer.decode([EOS]) == ""
    chunk = responses.completion_chunk

    def counted(*args, token_ids=None, **kwargs):
        engine.chunk(len(token_ids or []))
        return chunk(*args, token_ids=token_ids, **kwargs)
    monkeypatch.setattr(responses, "completion_chunk", counted)
    server = BoleServer(engine, NAME)
    with TestClient(create_app(server)) as client:
        events, _ = stream(client, "/v1/completions", prompt=PROMPT, max_tokens=10,
                           logprobs=0)
        engine.paced = False
        # the one chunk that holds the end ends with it and comes just before the finish
        holding = [e for e in events if EOS in e["choices"][0].get("token_ids", [])]
        assert holding == [events[-2]] and holding[0]["choices"][0]["token_ids"][-1] == EOS
        assert "token_ids" not in events[-1]["choices"][0]
        # (paced: the end's round is a chunk of its own, with no text)
        assert holding[0]["choices"][0]["token_ids"] == [EOS]
        assert holding[0]["choices"][0]["text"] == ""
        got = [t for e in events for t in e["choices"][0].get("token_ids", [])]
        assert got == script[:5]
        lps = [x for e in events if e["choices"][0]["logprobs"]
               for x in e["choices"][0]["logprobs"]["token_logprobs"]]
        assert lps == [logprob_of(t) for t in script[:5]]
        assert "".join(e["choices"][0]["text"] for e in events) == text_of(engine, script[:4])
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        body = post(client, "/v1/completions", prompt=PROMPT, max_tokens=10,
                    ignore_eos=True).json()
        assert body["usage"]["completion_tokens"] == 10
        assert body["choices"][0]["finish_reason"] == "length"


def test_a_stream_of_one_token_a_round_holds_back_half_characters_and_sends_no_empty_chunk(
        live):
    """Rounds that end inside the emoji's four byte tokens add no text: they send their token
    ids only (chat: nothing), and the emoji arrives whole."""
    engine, _, client = live
    engine.per_round = 1
    for path, body, field in (("/v1/completions", dict(prompt=PROMPT), "text"),
                              ("/v1/chat/completions",
                               dict(messages=[{"role": "user", "content": "hi"}]), "delta")):
        events, _ = stream(client, path, max_tokens=30, **body)
        texts = [e["choices"][0]["text"] if field == "text" else
                 e["choices"][0]["delta"]["content"] for e in events]
        assert "".join(texts) == text_of(engine, engine.expected(None, 30))
        assert not any("\ufffd" in t for t in texts)
        assert any("\U0001F642" in t for t in texts)


def test_streamed_chat_logprobs_add_up_to_the_whole_responses(served):
    engine, _, client = served
    body = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=8, logprobs=True,
                top_logprobs=2)
    whole = post(client, "/v1/chat/completions", **body).json()["choices"][0]["logprobs"]
    events, _ = stream(client, "/v1/chat/completions", **body)
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert [x for p in parts for x in p["content"]] == whole["content"]
    assert all(p["refusal"] is None for p in parts)


# ---- refusals and failures ----

def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_an_unknown_model_or_an_oversized_prompt_is_a_400_naming_the_field():
    engine, server = make(max_prompt_bytes=64)
    with TestClient(create_app(server)) as client:
        err = error_of(client.post("/v1/completions", json=dict(model="other", prompt="x")), 400)
        assert err["param"] == "model" and "'other'" in err["message"]
        err = error_of(post(client, "/v1/completions", prompt="x" * 65), 400)
        assert err["param"] == "prompt" and "64" in err["message"]
        assert err["message"].endswith("(bole serve --max-prompt-bytes); shorten it")
        assert post(client, "/v1/completions", prompt="x" * 64, max_tokens=1).status_code == 200
        err = error_of(post(client, "/v1/chat/completions",
                            messages=[{"role": "user", "content": "\u00e9" * 33}]), 400)
        assert err["param"] == "messages"                 # 33 characters, 66 bytes
        err = error_of(post(client, "/v1/completions", prompt=PROMPT, max_tokens=250), 400)
        assert err["param"] == "prompt" and "context of 256" in err["message"]
        assert err["message"].startswith(f"the prompt ({prompt_len(engine)} tokens) plus ")
        err = error_of(post(client, "/v1/chat/completions", max_tokens=250,
                            messages=[{"role": "user", "content": "hi"}]), 400)
        assert err["param"] == "messages" and "context of 256" in err["message"]
        err = error_of(post(client, "/v1/completions", prompt=[PROMPT, "a"], max_tokens=250),
                       400)
        assert "prompt 0" in err["message"]
        assert not server.inflight and engine.cache.num_free == 4      # none was admitted


def test_without_max_tokens_a_request_runs_to_its_context_or_4096_tokens():
    engine, server = make()
    with TestClient(create_app(server)) as client:
        body = post(client, "/v1/chat/completions",
                    messages=[{"role": "user", "content": "hi"}]).json()
        prompt = body["usage"]["prompt_tokens"]
        assert body["usage"]["completion_tokens"] == 256 - 8 - prompt     # max_len - scratch
        assert body["choices"][0]["finish_reason"] == "length"
        one_left = post(client, "/v1/completions", prompt=[1] * (256 - 8 - 1),
                        max_tokens=None).json()
        assert one_left["usage"]["completion_tokens"] == 1
    engine = ScriptedEngine(max_len=8192, per_round=1024, round_s=0.0)
    with TestClient(create_app(BoleServer(engine, NAME))) as client:
        body = post(client, "/v1/completions", prompt=PROMPT, max_tokens=None).json()
        assert body["usage"]["completion_tokens"] == 4096


def test_a_full_queue_is_a_503_with_retry_after_and_counts_as_rejected():
    engine, server = make(max_slots=1, max_queue=1)
    engine.hold()
    with TestClient(create_app(server)) as client:
        results = {}

        def first(key, **body):
            results[key] = post(client, "/v1/completions", prompt=PROMPT, **body)

        a = threading.Thread(target=first, args=("running",), kwargs=dict(max_tokens=4))
        a.start()
        wait_until(lambda: server.scheduler.num_running == 1)
        b = threading.Thread(target=first, args=("waiting",), kwargs=dict(max_tokens=4))
        b.start()
        wait_until(lambda: server.scheduler.num_waiting == 1)
        r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=4)
        err = error_of(r, 503)
        assert err["type"] == "server_busy" and r.headers["retry-after"] == "1"
        assert err["message"].startswith("1 requests are waiting")
        engine.go()
        a.join(30), b.join(30)
        assert results["running"].status_code == results["waiting"].status_code == 200
        metrics = client.get("/metrics").text
        assert 'bole_requests_total{status="rejected"} 1.0' in metrics
        assert not server.inflight


def test_n_choices_that_do_not_all_fit_the_queue_leave_none_queued():
    engine, server = make(max_slots=1, max_queue=1)
    engine.hold()
    with TestClient(create_app(server)) as client:
        r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=4, n=3)
        assert error_of(r, 503)["type"] == "server_busy"
        engine.go()
        wait_until(lambda: server.scheduler.idle)
        assert not server.inflight and engine.cache.num_free == 1
        assert post(client, "/v1/completions", prompt=PROMPT, max_tokens=2).status_code == 200


def test_a_failed_round_is_a_500_for_its_request_and_the_next_one_is_served(live):
    engine, server, client = live
    engine.fail_next = True
    err = error_of(post(client, "/v1/completions", prompt=PROMPT, max_tokens=6), 500)
    assert err["type"] == "server_error"
    assert err["message"] == "the request was cancelled by the server"
    assert client.get("/health").json() == {"status": "ok", "running": 0, "waiting": 0}
    engine.fail_next = True
    events, raw = stream(client, "/v1/completions", prompt=PROMPT, max_tokens=6)
    assert events[-1]["error"]["type"] == "server_error" and raw[-1] == "[DONE]"
    assert events[-1]["error"]["message"] == "the request was cancelled by the server"
    body = post(client, "/v1/completions", prompt=PROMPT, max_tokens=6).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert not server.inflight
    wait_until(lambda: engine.cache.num_free == 4)


def test_a_failed_round_in_an_engine_process_is_a_500_and_the_process_goes_on(in_process):
    """A round that raises inside the engine process fails the requests it ran (a 500 each)
    and the one waiting behind them; the process goes on serving the next request."""
    engine, server, client = in_process
    err = error_of(post(client, "/v1/completions", prompt=FAILING_PROMPT, max_tokens=6), 500)
    assert err["message"] == "the request was cancelled by the server"
    body = post(client, "/v1/completions", prompt=PROMPT, max_tokens=6).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == text_of(engine, engine.expected(None, 6))
    assert client.get("/health").json()["status"] == "ok"


def test_abort_all_ends_running_requests_with_abort_and_their_tokens_so_far(live):
    """Aborted (shutdown) responses, one running and one waiting, say ``abort`` and hold the
    tokens they had, with their logprobs when asked for."""
    engine, server, client = live
    engine.script = engine.tokenizer.encode(" \U0001F642 and more").ids   # 4 tokens: half of it
    results = {}
    engine.hold()

    def whole():
        results["whole"] = post(client, "/v1/completions", prompt=PROMPT, max_tokens=40,
                                logprobs=1)

    def streamed():
        results["stream"] = stream(client, "/v1/chat/completions", max_tokens=40,
                                   messages=[{"role": "user", "content": "hi"}])

    threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
    threads[0].start()
    wait_until(lambda: server.scheduler.num_running == 1)     # its round is held
    threads[1].start()
    wait_until(lambda: server.scheduler.num_waiting == 1)
    assert len(server.live()) == 2
    # one of the four slots in use
    assert 'vllm:gpu_cache_usage_perc{model_name="scripted"} 0.25' in client.get("/metrics").text
    assert server.abort_all() == 2
    engine.go()
    for t in threads:
        t.join(30)
    body = results["whole"].json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "abort"
    # the token of its admission and those of the round in flight when it was aborted
    ids = engine.expected(None, 4)
    assert choice["text"] == text_of(engine, ids) == " "     # no half character
    assert choice["logprobs"]["token_logprobs"] == [logprob_of(t) for t in ids]
    assert body["usage"]["completion_tokens"] == 4
    events, _ = results["stream"]                              # aborted while it waited
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, "abort"]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert server.live() == [] and not server.inflight


def test_the_engine_thread_serves_requests_that_come_after_it_idled(live):
    engine, server, client = live
    assert post(client, "/v1/completions", prompt=PROMPT, max_tokens=2).status_code == 200
    time.sleep(0.3)                      # several of the engine thread's waits for work
    assert server.loop.thread.is_alive()
    body = post(client, "/v1/completions", prompt=PROMPT, max_tokens=2).json()
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_draining_server_refuses_with_503_and_health_says_so(live):
    engine, server, client = live
    server.draining = True
    r = post(client, "/v1/completions", prompt=PROMPT, max_tokens=2)
    err = error_of(r, 503)
    assert err["type"] == "server_error" and r.headers["retry-after"] == "5"
    assert err["message"] == ("the server is shutting down; send the request to another "
                              "replica or retry after it restarts")
    assert client.get("/health").status_code == 503
    server.draining = False
    assert client.get("/health").status_code == 200


def test_health_reports_a_dead_engine_thread(live):
    engine, server, client = live
    server.loop.error = RuntimeError("gone")
    server.loop._stop.set()
    server.loop.thread.join(10)
    r = client.get("/health")
    assert error_of(r, 503)["message"].startswith("the engine stopped")


#: the context of the cancelled streams' engines, and their requests' max_tokens: at a token a
#: round of 10 ms, over ten minutes of rounds before such a request could end by length
LONG_LEN = 1 << 16
LONG = LONG_LEN - 64


def test_a_stream_closed_early_cancels_its_request_and_frees_its_slot():
    engine, server = make(per_round=1, max_len=LONG_LEN)
    with TestClient(create_app(server)) as client:
        with client.stream("POST", "/v1/completions",
                           json=dict(model=NAME, prompt=PROMPT, max_tokens=LONG,
                                     stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        wait_until(lambda: server.scheduler.idle and not server.inflight, timeout=60)
    assert engine.cache.num_free == 4
    assert engine.rounds < LONG - 1                     # cancelled, not run to its length


def finished(client, status: str) -> float:
    """How many requests ended with ``status`` (the server's counter)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'bole_requests_total{{status="{status}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture(params=["thread", "process"])
def long_served(request):
    """(server, client) whose engine (on the server's thread, or in a process of its own)
    emits a token a round and holds LONG_LEN tokens a request."""
    if request.param == "thread":
        _, server = make(per_round=1, max_len=LONG_LEN)
    else:
        server = make_in_process((4, LONG_LEN, 1))
    with TestClient(create_app(server)) as client:
        yield server, client


def test_a_stream_closed_early_ends_its_request_as_aborted_not_run_out(long_served):
    """Through the engine process too: the cancel reaches the engine, which ends the request
    with no result (counted ``abort``) instead of running it to its LONG tokens (``length``)."""
    server, client = long_served
    before = finished(client, "abort"), finished(client, "length")
    with client.stream("POST", "/v1/completions",
                       json=dict(model=NAME, prompt=PROMPT, max_tokens=LONG, stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    wait_until(lambda: finished(client, "abort") + finished(client, "length") > sum(before),
               timeout=60)
    assert (finished(client, "abort"), finished(client, "length")) == (before[0] + 1, before[1])
    wait_until(lambda: server.scheduler.num_running == 0 and server.scheduler.num_waiting == 0,
               timeout=60)


def test_models_list_and_card_and_an_unknown_model_is_a_404(served):
    engine, server, client = served
    listed = client.get("/v1/models").json()
    card = client.get(f"/v1/models/{NAME}").json()
    assert listed == {"object": "list", "data": [card]}
    assert card == {"id": NAME, "object": "model", "created": 0, "owned_by": "bole",
                    "max_model_len": 256, "bole": {"mode": "bole", "drafter": "mtp", "depth": 3,
                                                   "topk": 2, "budget": 8}}
    assert client.get("/openapi.json").json()["info"]["title"] == "Bole"
    err = error_of(client.get("/v1/models/other"), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


def test_metrics_count_prompt_tokens_once_per_prompt_and_the_requests(live):
    engine, server, client = live
    post(client, "/v1/completions", prompt=PROMPT, n=3, max_tokens=2)
    text = client.get("/metrics").text
    assert f"bole_prompt_tokens_total {float(prompt_len(engine))}" in text
    assert "bole_output_tokens_total 6.0" in text
    assert 'bole_requests_total{status="length"} 3.0' in text
    assert 'bole_http_responses_total{code="200",route="/v1/completions"} 1.0' in text
    assert f'vllm:prompt_tokens_total{{model_name="{NAME}"}} {float(prompt_len(engine))}' in text
    # the queue time of each of the three finished requests (the engine's prefill time known)
    assert "bole_request_queue_time_seconds_count 3.0" in text
    rounds = [line for line in text.splitlines() if line.startswith("bole_rounds_total ")]
    assert rounds and float(rounds[0].split()[-1]) >= 1        # the rounds' hook is wired


def rounds_total(client) -> float:
    text = client.get("/metrics").text
    return float(next(line for line in text.splitlines()
                      if line.startswith("bole_rounds_total ")).split()[-1])


def test_an_engine_process_reports_its_rounds_to_the_metrics(in_process):
    """The engine process sends each round's report with its events: /metrics counts the
    rounds it ran (7 tokens at 3 a round: the first at admission, then 2 rounds)."""
    engine, server, client = in_process
    before = rounds_total(client)
    body = post(client, "/v1/completions", prompt=PROMPT, max_tokens=7).json()
    assert body["usage"]["completion_tokens"] == 7
    wait_until(lambda: rounds_total(client) >= before + 2)


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


# ---- the server's state, without HTTP ----

class Gone:
    """An HTTP request whose client has gone away."""

    async def is_disconnected(self) -> bool:
        return True


def test_a_whole_response_whose_client_left_is_a_499_and_frees_its_slot():
    from bole.server.protocol import CompletionRequest
    from bole.server.responses import respond
    engine, server = make()
    engine.hold()
    server.loop.start()
    try:
        req = CompletionRequest(model=NAME, prompt=PROMPT, max_tokens=50)
        r = asyncio.run(asyncio.wait_for(respond(server, req, Gone(), chat=False), 10))
        assert r.status_code == 499
        assert not server.inflight
        engine.go()
        wait_until(lambda: server.scheduler.idle)
        assert engine.cache.num_free == 4
        assert engine.rounds <= 2                       # cancelled, not run to 50 tokens
    finally:
        engine.go()
        server.loop.stop()


def test_live_lists_the_sequences_the_engine_has_not_finished():
    from bole.server.protocol import CompletionRequest
    engine, server = make()
    server.loop.start()
    try:
        async def run():
            loop = asyncio.get_running_loop()
            short = server.prepare(CompletionRequest(model=NAME, prompt=PROMPT, max_tokens=1),
                                   chat=False)
            engine.hold()
            long = server.prepare(CompletionRequest(model=NAME, prompt=PROMPT, max_tokens=40),
                                  chat=False)
            queue: asyncio.Queue = asyncio.Queue()
            server.submit(short + long, queue, loop, stream=False)
            wait_until(lambda: short[0].handle.done.is_set()
                       and server.scheduler.num_running == 1)
            assert server.inflight == set(short + long)
            assert server.live() == long
            assert server.abort_all() == 1 and long[0].aborted and not short[0].aborted
            engine.go()
            for _ in range(2):
                await asyncio.wait_for(queue.get(), 10)
            assert server.live() == []
            use = server.usage_of(short + long)
            assert use["prompt_tokens"] == prompt_len(engine)          # one prompt, counted once
            assert use["completion_tokens"] == 1 + len(long[0].handle.request.out)
            server.release(short + long)
            assert not server.inflight
        asyncio.run(run())
    finally:
        engine.go()
        server.loop.stop()


def test_an_engine_process_queues_every_request_its_front_end_takes():
    """The front end bounds the queue (``max_queue``, here over the scheduler's default of
    256); the engine process takes everything it is sent: 300 requests at once all finish."""
    # one slot, a round of 10 ms a token: the 300 wait in the engine process together
    c = EngineClient(ScriptedEngine, (1, 256, 1, (EOS,), 0.01), max_queue=400,
                     startup_timeout=300)
    try:
        assert (c.num_running, c.num_waiting) == (0, 0) and c.healthy()
        from bole.engine.request import SamplingParams
        done = threading.Semaphore(0)
        finals: dict[int, int] = {}

        def on_event(handle, tokens, finished):
            if finished:
                finals[id(handle)] = finals.get(id(handle), 0) + 1
                done.release()
        handles = [c.submit([1, 2, 3], SamplingParams(max_tokens=2), on_event=on_event)
                   for _ in range(300)]
        for _ in handles:
            assert done.acquire(timeout=120)
        assert all(h.request.result is not None for h in handles)
        assert all(h.request.result.finish_reason == "length" for h in handles)
    finally:
        c.stop()
    c._reader.join(10)
    # the process's end finishes what it held: nothing, here; a request ends once
    assert sorted(set(finals.values())) == [1] and len(finals) == 300


def test_an_api_key_is_asked_for_and_a_template_refusal_is_a_400():
    from bole.server.chat import ChatTemplate
    engine = ScriptedEngine()
    template = ChatTemplate("{% if messages[-1]['role'] != 'user' %}"
                            "{{ raise_exception('the last message must be the user\\'s') }}"
                            "{% endif %}{{ messages[-1]['content'] }}")
    server = BoleServer(engine, NAME, chat_template=template,
                        config=ServerConfig(api_key="sesame"))
    with TestClient(create_app(server)) as client:
        body = dict(model=NAME, prompt=PROMPT, max_tokens=2)
        assert error_of(client.post("/v1/completions", json=body), 401)
        key = {"Authorization": "Bearer sesame"}
        assert client.post("/v1/completions", json=body, headers=key).status_code == 200
        chat = dict(model=NAME, max_tokens=2, messages=[{"role": "assistant", "content": "x"}])
        err = error_of(client.post("/v1/chat/completions", json=chat, headers=key), 400)
        assert err["message"] == "the last message must be the user's"
        chat["messages"] = [{"role": "user", "content": "x"}]
        assert client.post("/v1/chat/completions", json=chat, headers=key).status_code == 200


def test_the_server_batches_at_most_max_batch_requests():
    """``max_batch`` under the cache's slots: the scheduler runs that many, the rest wait."""
    engine = ScriptedEngine(max_slots=4)
    server = BoleServer(engine, NAME, max_batch=2)
    engine.hold()
    server.loop.start()
    try:
        from bole.engine.request import SamplingParams
        for _ in range(3):
            server.scheduler.submit([1, 2], SamplingParams(max_tokens=8))
        engine.go()
        wait_until(lambda: server.scheduler.num_running == 2 or server.scheduler.idle)
        assert server.scheduler.max_batch == 2
        peak = 0
        while not server.scheduler.idle:
            peak = max(peak, server.scheduler.num_running)
            time.sleep(0.001)
        assert peak <= 2
    finally:
        engine.go()
        server.loop.stop()


@pytest.mark.parametrize("factory, args, timeout, message", [
    (int, ("x",), 300, "^the engine could not start: ValueError: invalid literal"),
    (os._exit, (3,), 300, r"^the engine process exited while starting \(exit code 3\)$"),
    (time.sleep, (120,), 5, "^the engine process did not start in 5 s$")])
def test_an_engine_process_that_cannot_start_says_why(factory, args, timeout, message):
    """A build that raises, a process that exits, one that hangs past ``startup_timeout``:
    each a RuntimeError saying which."""
    with pytest.raises(RuntimeError, match=message):
        EngineClient(factory, args, startup_timeout=timeout)

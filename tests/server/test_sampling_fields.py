"""Penalties, logprobs, ignore_eos and stop_token_ids through the server, with the official openai
client: each equals the engine's plain decoding with the same parameters."""

import math

import pytest

openai = pytest.importorskip("openai")

from bole.engine import Engine, SpecConfig  # noqa: E402
from bole.server.protocol import (ChatCompletionRequest, CompletionRequest,  # noqa: E402
                                  engine_params)
from tests.server.test_api import NAME, Running, _server, bundled  # noqa: E402,F401

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def live(bundled):  # noqa: F811
    with Running(_server(bundled)) as running:
        yield running


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def plain(bundled):  # noqa: F811
    """Plain decoding (ar) of a completions request's first sequence."""
    model, tok = bundled
    engine = Engine(model, SpecConfig("ar", "mtp"), max_slots=1, max_len=512, tokenizer=tok)

    def run(**fields):
        req = CompletionRequest(model=NAME, prompt=PROMPT, **fields)
        params = engine_params(req, req.max_tokens)
        return engine.generate([tok.encode(PROMPT).ids], params)[0], tok
    return run


def test_penalties_equal_plain_decoding(client, plain):
    """Greedy with each penalty: the server's (bole mode) text equals plain decoding's, and
    the penalty changed it."""
    base, tok = plain(max_tokens=24, temperature=0)
    for pen in (dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
                dict(repetition_penalty=1.5)):
        want, _ = plain(max_tokens=24, temperature=0, **pen)
        got = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24,
                                        temperature=0, extra_body=pen)
        assert want.token_ids != base.token_ids, pen
        assert got.choices[0].text == tok.decode(want.token_ids), pen


def test_chat_logprobs_shape_and_values(client, bundled):  # noqa: F811
    """Chat: one content entry per token with its logprob (the raw distribution's, equal to
    plain decoding's), UTF-8 bytes and the asked number of alternatives, most likely first."""
    model, tok = bundled
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Count to five."}], max_tokens=12,
        temperature=0, logprobs=True, top_logprobs=3)
    choice = out.choices[0]
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens
    if not any("\ufffd" in c.token for c in content):
        assert "".join(c.token for c in content) == choice.message.content
    for c in content:
        assert c.logprob <= 0 and bytes(c.bytes).decode("utf-8", "replace") == c.token
        assert len(c.top_logprobs) == 3
        values = [t.logprob for t in c.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert c.logprob <= values[0] + 1e-6
    # streamed: the chunks' entries are the whole response's
    entries = []
    for chunk in client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Count to five."}], max_tokens=12,
            temperature=0, logprobs=True, top_logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            entries += chunk.choices[0].logprobs.content
    assert [e.token for e in entries] == [c.token for c in content]
    assert all(math.isclose(e.logprob, c.logprob, abs_tol=1e-5) and
               [t.token for t in e.top_logprobs] == [t.token for t in c.top_logprobs]
               for e, c in zip(entries, content))
    # without logprobs: null
    bare = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
    assert bare.choices[0].logprobs is None


def test_completions_logprobs_streamed_equal_whole_and_plain(client, plain):
    want, tok = plain(max_tokens=16, temperature=0, logprobs=2)
    whole = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                      logprobs=2)
    lp = whole.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in want.token_ids]
    for got, ref in zip(lp.token_logprobs, want.logprobs):
        assert math.isclose(got, ref.logprob, abs_tol=1e-4)
    for top, ref in zip(lp.top_logprobs, want.logprobs):
        expected = {tok.decode([t]): v for t, v in ref.top}
        assert list(top) == list(expected)
        assert all(math.isclose(top[k], expected[k], abs_tol=1e-4) for k in top)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
    tokens, values, offsets = [], [], []
    for chunk in client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16,
                                           temperature=0, logprobs=2, stream=True):
        c = chunk.choices[0]
        if c.logprobs is not None:
            tokens += c.logprobs.tokens
            values += c.logprobs.token_logprobs
            offsets += c.logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(values, lp.token_logprobs))


def test_stop_token_ids_and_ignore_eos(client, plain):
    base, tok = plain(max_tokens=16, temperature=0)
    stop = base.token_ids[5]
    cut = base.token_ids[:base.token_ids.index(stop) + 1]
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"stop_token_ids": [stop], "ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == tok.decode(cut) and out.usage.completion_tokens == len(cut)
    eos = (7, 8)
    req = CompletionRequest(model=NAME, prompt="x", ignore_eos=True, stop_token_ids=[3])
    assert engine_params(req, 4).all_stop_token_ids(eos) == (3,)
    req = CompletionRequest(model=NAME, prompt="x", stop_token_ids=[3])
    assert engine_params(req, 4).all_stop_token_ids(eos) == (7, 8, 3)


@pytest.mark.parametrize("body, needle", [
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_fields_get_400(client, body, needle):
    with pytest.raises(openai.BadRequestError, match=needle):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, extra_body=body)


def test_request_models_map_logprobs():
    chat = ChatCompletionRequest(model=NAME, messages=[{"role": "user", "content": "x"}],
                                 logprobs=True, top_logprobs=4)
    assert engine_params(chat, 4).logprobs == 4
    assert engine_params(ChatCompletionRequest(model=NAME, messages=[
        {"role": "user", "content": "x"}]), 4).logprobs is None
    assert engine_params(CompletionRequest(model=NAME, prompt="x", logprobs=0),
                         4).logprobs == 0


def test_engine_process_streams_logprobs_and_penalties(tmp_path, plain):
    """`bole serve --engine-process`: the logprobs cross the process boundary with the tokens,
    streamed and not, and a penalised greedy completion equals plain decoding."""
    from tests.server.served import Served
    want, tok = plain(max_tokens=12, temperature=0, logprobs=1, frequency_penalty=1.0)
    with Served(tmp_path, "--engine-process") as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0,
                               timeout=120)
        kwargs = dict(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1,
                      frequency_penalty=1.0)
        whole = client.completions.create(**kwargs).choices[0]
        streamed = []
        for chunk in client.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                streamed += chunk.choices[0].logprobs.token_logprobs
    assert served.returncode == 0, served.output
    assert whole.text == tok.decode(want.token_ids)
    assert len(whole.logprobs.token_logprobs) == len(streamed) == len(want.token_ids)
    for a, b, ref in zip(whole.logprobs.token_logprobs, streamed, want.logprobs):
        assert math.isclose(a, ref.logprob, abs_tol=1e-4) and math.isclose(b, a, abs_tol=1e-5)

"""What an OpenAI client sends, against the real server over loopback (the official openai
client, raw httpx where it cannot send it): chat content as text parts, several prompts, n
choices with seeds per choice, echo, max_completion_tokens, /v1/models/{id}, and a 400 naming
every field the server does not implement."""

import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from bole.server.protocol import UNSUPPORTED, ChatCompletionRequest  # noqa: E402
from tests.server.test_api import NAME, Running, _server, bundled  # noqa: E402,F401
from tests.server.test_responses_scripted import check_usage_so_far  # noqa: E402


@pytest.fixture(scope="module")
def live(bundled):  # noqa: F811
    with Running(_server(bundled, max_batch=4)) as running:
        yield running


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_chat_content_as_text_parts_equals_the_joined_string(client):
    parts = client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                  {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"},
                                               {"type": "text", "text": "    return"}]}])
    plain = client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "def add(a, b):\n    return"}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_content_part_of_another_type_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, max_tokens=4, messages=[
            {"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert "'image_url'" in err.value.body["message"]
    assert err.value.body["param"].startswith("messages")


def test_several_prompts_get_one_choice_each_in_order(client):
    prompts = ["def add(a, b):", "import os\n", "class Stack:"]
    one = [client.completions.create(model=NAME, prompt=p, max_tokens=6, temperature=0)
           for p in prompts]
    many = client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [r.choices[0].text for r in one]
    assert many.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in one)
    assert many.usage.completion_tokens == sum(r.usage.completion_tokens for r in one)
    # token-id prompts, one and several
    ids = [[65, 289, 626], [262, 275]]
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0)
    first = client.completions.create(model=NAME, prompt=ids[0], max_tokens=4, temperature=0)
    assert len(by_ids.choices) == 2 and by_ids.choices[0].text == first.choices[0].text
    assert by_ids.usage.prompt_tokens == 5


def test_n_choices_are_seeded_per_choice_and_streamed_by_index(client):
    kw = dict(model=NAME, prompt="def parse(line):", max_tokens=12, temperature=1.5, seed=7)
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    single = client.completions.create(n=1, **kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.text for c in b.choices]           # reproducible under one seed
    assert len(set(texts)) > 1                             # each choice draws its own tokens
    assert texts[0] == single.choices[0].text              # choice 0 keeps the request's seed
    streamed = {0: "", 1: "", 2: ""}
    finish = {}
    for chunk in client.completions.create(n=3, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [streamed[i] for i in range(3)] == texts
    assert set(finish) == {0, 1, 2}
    chat = client.chat.completions.create(
        model=NAME, n=2, max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": "def f():"}])
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content     # greedy


def test_n_above_the_maximum_is_a_400(client):
    from bole.server.protocol import MAX_N, MAX_SEQUENCES
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt="x", n=MAX_N + 1, max_tokens=2)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt=["x"] * 8, n=MAX_SEQUENCES // 8 + 1,
                                  max_tokens=2)
    assert err.value.body["param"] == "n" and str(MAX_SEQUENCES) in err.value.body["message"]


def test_echo_prepends_the_prompt(client, live):
    plain = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=6,
                                      temperature=0)
    echoed = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=6,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == "def add(a, b):" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="def add(a, b):", max_tokens=6, temperature=0, echo=True,
        stream=True) if c.choices)
    assert streamed == echoed.choices[0].text
    res = httpx.post(live.url + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "x"}], "echo": True})
    assert res.status_code == 400 and res.json()["error"]["param"] == "echo"


def test_max_completion_tokens_bounds_a_chat(client):
    res = client.chat.completions.create(
        model=NAME, max_completion_tokens=3, temperature=0,
        messages=[{"role": "user", "content": "write a long function"}])
    assert res.usage.completion_tokens <= 3


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),
    ("response_format", {"type": "json_object"}),
    ("logit_bias", {"42": 5}),
    ("functions", [{"name": "f"}]),
    ("best_of", 3),
    ("a_field_nobody_defined", 1),
] + [(name, {"not": "neutral"}) for name in sorted(UNSUPPORTED)
       if name not in ChatCompletionRequest.model_fields])
def test_a_field_the_server_does_not_implement_is_a_400_naming_it(live, field, value):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            field: value}
    res = httpx.post(live.url + "/v1/chat/completions", json=body)
    assert res.status_code == 400, res.text
    err = res.json()["error"]
    assert err["param"] == field and repr(field) in err["message"]
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [("tools", []), ("presence_penalty", 0),
                                         ("logprobs", None), ("response_format", {"type": "text"}),
                                         ("user", "someone")])
def test_a_neutral_value_of_such_a_field_is_accepted(live, field, value):
    body = {"model": NAME, "prompt": "x", "max_tokens": 2, field: value}
    res = httpx.post(live.url + "/v1/completions", json=body, timeout=120)
    assert res.status_code == 200, res.text


def test_a_message_field_the_server_does_not_take_is_a_400(live):
    res = httpx.post(live.url + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "assistant", "content": "x",
                                     "tool_calls": [{"id": "1"}]}]})
    assert res.status_code == 400
    assert res.json()["error"]["param"] == "messages.0.tool_calls"


def test_models_by_id(client, live):
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-9")
    assert "'gpt-9'" in err.value.body["message"]
    assert json.loads(httpx.get(live.url + "/v1/models/gpt-9").text)["error"]["code"] == \
        "model_not_found"


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(live):
    with httpx.stream("POST", live.url + "/v1/completions", timeout=120, json={
            "model": NAME, "prompt": "def f(x):", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as res:
        chunks = [json.loads(line[6:]) for line in res.iter_lines()
                  if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c.get("usage") for c in chunks) and counts == sorted(counts)
    assert counts[-1] == 40 and chunks[-1]["choices"] == []
    check_usage_so_far(chunks, 40)          # however the rounds were merged into chunks

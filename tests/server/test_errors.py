"""Every error the server answers has OpenAI's body ({"error": {"message", "type", "param",
"code"}}) and a message that names the problem: malformed or undecodable JSON, text that is
not Unicode, unknown routes and methods, wrong types, an over-long prompt; none is a 500."""

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests.server.test_api import NAME, Running, _server, bundled  # noqa: E402,F401


@pytest.fixture(scope="module")
def live(bundled):  # noqa: F811
    with Running(_server(bundled, max_batch=2)) as running:
        yield running


def _openai_error(res: httpx.Response, status: int) -> dict:
    assert res.status_code == status, res.text
    body = res.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _raw(live, content: bytes, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(live.url + path, content=content,
                      headers={"content-type": "application/json"})


def test_malformed_json_says_so_and_where(live):
    err = _openai_error(_raw(live, b'{"model": "bundled", "prompt": "x",,}'), 400)
    assert err["message"].startswith("the request body is not valid JSON")
    assert "at character" in err["message"] and err["param"] is None


def test_a_body_that_is_not_utf8_is_a_400(live):
    err = _openai_error(_raw(live, b'{"model": "bundled", "prompt": "x\xff"}'), 400)
    assert "UTF-8" in err["message"]


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", '{"model": "bundled", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"model": "bundled", "prompt": ["ok", "\\udfff"]}', "prompt[1]"),
    ("/v1/completions", '{"model": "bundled", "prompt": "x", "stop": ["\\ud800"]}', "stop[0]"),
    ("/v1/chat/completions",
     '{"model": "bundled", "messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages[0].content"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(live, path, body, field):
    err = _openai_error(_raw(live, body.encode(), path), 400)
    assert "surrogate" in err["message"] and field in err["message"]


def test_unknown_routes_and_methods_get_openai_errors(live):
    err = _openai_error(httpx.post(live.url + "/v1/embeddings", json={}), 404)
    assert "/v1/embeddings" in err["message"] and "/v1/completions" in err["message"]
    err = _openai_error(httpx.get(live.url + "/v1/completions"), 405)
    assert "GET" in err["message"] and "POST" in err["message"]


@pytest.mark.parametrize("body,needle,param", [
    ([1, 2], "JSON object", None),
    ({"model": NAME}, "prompt: this field is required", "prompt"),
    ({"model": NAME, "prompt": 5}, "a list of token ids", "prompt"),
    ({"model": NAME, "prompt": [[1], []]}, "empty prompt", "prompt"),
    ({"model": NAME, "prompt": "x", "max_tokens": "many"}, "max_tokens", "max_tokens"),
    ({"model": NAME, "prompt": "x", "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x: unknown field", "stream_options.x"),
])
def test_wrong_shapes_name_the_field(live, body, needle, param):
    err = _openai_error(httpx.post(live.url + "/v1/completions", json=body), 400)
    assert needle in err["message"] and err["param"] == param


def test_a_prompt_over_the_byte_limit_is_refused_before_tokenizing(live):
    limit = live.server.max_prompt_bytes
    err = _openai_error(httpx.post(live.url + "/v1/completions", timeout=60, json={
        "model": NAME, "prompt": "é" * (limit // 2 + 1), "max_tokens": 2}), 400)
    assert "--max-prompt-bytes" in err["message"] and err["param"] == "prompt"
    err = _openai_error(httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
        "model": NAME, "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x" * limit},
                                                  {"type": "text", "text": "y"}]}]}), 400)
    assert err["param"] == "messages"


def test_no_error_was_a_500(live):
    """Runs last in this file: the server's own count of responses by status code."""
    from prometheus_client.parser import text_string_to_metric_families
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(live.url + "/metrics").text)}
    codes = {s.labels["code"] for s in families["bole_http_responses"].samples
             if s.name == "bole_http_responses_total"}
    assert "400" in codes and "404" in codes and "405" in codes
    assert not any(c.startswith("5") for c in codes), codes

"""The server's error layer without a model: ``validation_message`` on each kind of validation
error pydantic reports, the handlers ``errors.install`` registers (404, 405, 400, 500 and any
other HTTP status, each with OpenAI's body), and the ``Gate`` middleware (the API key, the
open routes, and the count of every response by route and status, a crash counted once)."""

import asyncio

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fastapi import FastAPI, HTTPException  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402

from bole.server import errors  # noqa: E402
from bole.server.errors import ROUTES, error, validation_message  # noqa: E402
from bole.server.gate import Gate  # noqa: E402


def _message(*errs) -> tuple[str, str | None]:
    return validation_message(RequestValidationError(list(errs)))


# ---- validation_message ----

def test_malformed_json_names_the_reason_and_the_character():
    assert _message({"type": "json_invalid", "loc": ("body", 17), "msg": "JSON decode error",
                     "ctx": {"error": "Expecting value"}}) == (
        "the request body is not valid JSON: Expecting value at character 17", None)
    assert _message({"type": "json_invalid", "loc": ("body",), "msg": "x"}) == (
        "the request body is not valid JSON: malformed JSON", None)
    assert _message({"type": "json_invalid", "loc": ("body", "p"), "ctx": {}}) == (
        "the request body is not valid JSON: malformed JSON", None)


def test_a_field_error_names_the_field_without_pydantics_member_types():
    assert _message({"type": "int_parsing", "loc": ("body", "max_tokens"),
                     "msg": "Input should be a valid integer"}) == (
        "max_tokens: Input should be a valid integer", "max_tokens")
    for member in ("str", "int", "bool", "list[int]", "list[list[int]]"):
        assert _message({"type": "string_type", "loc": ("body", "prompt", member),
                         "msg": "bad"}) == ("prompt: bad", "prompt")
    # a list index stays; a field named like a type but not last stays
    assert _message({"type": "t", "loc": ("body", "messages", 2, "content"), "msg": "m"}) == (
        "messages.2.content: m", "messages.2.content")
    assert _message({"type": "t", "loc": ("body", "stop", 0), "msg": "m"}) == (
        "stop.0: m", "stop.0")
    assert _message({"type": "t", "loc": ("body", "strx"), "msg": "m"}) == ("strx: m", "strx")


def test_value_errors_lose_pydantics_prefix_only_at_the_start():
    assert _message({"type": "value_error", "loc": ("body", "n"),
                     "msg": "Value error, n must be >= 1"}) == ("n: n must be >= 1", "n")
    assert _message({"type": "value_error", "loc": ("body", "n"),
                     "msg": "n is wrong. Value error, "}) == ("n: n is wrong. Value error, ", "n")


def test_each_kind_of_problem_has_its_own_message():
    assert _message({"type": "extra_forbidden", "loc": ("body", "frobnicate"),
                     "msg": "Extra inputs are not permitted"}) == (
        "frobnicate: unknown field; leave it out", "frobnicate")
    assert _message({"type": "missing", "loc": ("body", "model"), "msg": "Field required"}) == (
        "model: this field is required", "model")
    assert _message({"type": "model_attributes_type", "loc": ("body",), "msg": "m"}) == (
        "the request body must be a JSON object", None)
    assert _message({"type": "dict_type", "loc": ("body",), "msg": "m"}) == (
        "the request body must be a JSON object", None)
    # a dict expected inside the body is that field's problem, in pydantic's words
    assert _message({"type": "dict_type", "loc": ("body", "logit_bias"),
                     "msg": "Input should be a valid dictionary"}) == (
        "logit_bias: Input should be a valid dictionary", "logit_bias")


def test_what_pydantic_leaves_out_has_a_default():
    assert _message() == ("invalid request", None)
    assert _message({"loc": ("body", "x")}) == ("x: invalid request", "x")
    assert _message({"type": "json_invalid"}) == (
        "the request body is not valid JSON: malformed JSON", None)
    assert _message({"msg": "only a message"}) == ("only a message", None)


# ---- the handlers ----

def _app() -> FastAPI:
    app = FastAPI()
    errors.install(app)

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.get("/teapot")
    async def teapot():
        raise HTTPException(418, "short and stout")

    @app.get("/gone")
    async def gone():
        raise HTTPException(503, "not now", headers={"Retry-After": "3"})

    @app.get("/unreadable")
    async def unreadable():
        raise HTTPException(400, "There was an error parsing the body")

    @app.get("/crash")
    async def crash():
        raise ValueError("boom")
    return app


def _get(method: str, path: str) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=_app(), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.request(method, path)
    return asyncio.run(go())


def _body(res: httpx.Response, status: int) -> dict:
    assert res.status_code == status, res.text
    body = res.json()
    assert set(body) == {"error"}
    return body["error"]


def test_error_is_openais_body_with_its_status_and_headers():
    res = error(429, "slow down", "rate_limit", param="n", code="c", headers={"Retry-After": "2"})
    assert res.status_code == 429 and res.headers["retry-after"] == "2"
    import json
    assert json.loads(res.body) == {"error": {"message": "slow down", "type": "rate_limit",
                                              "param": "n", "code": "c"}}
    plain = json.loads(error(400, "bad").body)["error"]
    assert plain == {"message": "bad", "type": "invalid_request_error", "param": None,
                     "code": None}


def test_an_unknown_route_is_a_404_listing_the_routes():
    err = _body(_get("GET", "/v2/nothing"), 404)
    assert err == {"message": f"no route GET /v2/nothing; this server answers "
                              f"{', '.join(ROUTES)}",
                   "type": "invalid_request_error", "param": None, "code": None}
    assert "POST /v1/chat/completions" in err["message"]


def test_a_wrong_method_is_a_405_naming_the_allowed_one():
    res = _get("DELETE", "/v1/models")
    err = _body(res, 405)
    assert err["message"] == "DELETE is not allowed on /v1/models; use GET"
    assert err["type"] == "invalid_request_error" and res.headers["allow"] == "GET"


def test_other_http_errors_keep_their_status_detail_and_headers():
    err = _body(_get("GET", "/unreadable"), 400)
    assert err["message"] == ("the request body could not be read: There was an error "
                              "parsing the body (send UTF-8 JSON)")
    assert _body(_get("GET", "/teapot"), 418) == {
        "message": "short and stout", "type": "invalid_request_error", "param": None,
        "code": None}
    res = _get("GET", "/gone")
    assert _body(res, 503)["type"] == "server_error" and res.headers["retry-after"] == "3"


def test_a_crash_is_a_500_naming_the_exception():
    assert _body(_get("GET", "/crash"), 500) == {
        "message": "internal error: ValueError: boom", "type": "server_error", "param": None,
        "code": None}


def test_a_validation_error_is_a_400_with_the_field_as_param():
    from pydantic import BaseModel

    class Body(BaseModel):
        n: int

    app = _app()

    @app.post("/v1/completions")
    async def completions(body: Body):
        return {}

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/completions", json={"n": "many"})
    err = _body(asyncio.run(go()), 400)
    assert err["param"] == "n" and err["message"].startswith("n: Input should be a valid")


# ---- the gate ----

class _Counts(list):
    def __call__(self, route, status):
        self.append((route, status))


class _Route:
    path = "/v1/completions"


def _call(gate: Gate, path: str = "/v1/completions", headers=(), route=True,
          type_: str = "http") -> list[dict]:
    sent = []
    scope = {"type": type_, "path": path, "headers": list(headers), "method": "POST"}
    if route:
        scope["route"] = _Route()

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)
    asyncio.run(gate(scope, receive, send))
    return sent


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def test_the_gate_counts_each_response_once_by_route_and_status():
    counts = _Counts()
    sent = _call(Gate(_ok, None, counts))
    assert counts == [("/v1/completions", 200)]
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    counts.clear()
    _call(Gate(_ok, None, counts), route=False)
    assert counts == [("unmatched", 200)]


def test_the_gate_counts_a_crash_before_the_response_as_a_500_once():
    async def crash(scope, receive, send):
        raise RuntimeError("boom")

    async def crash_after_start(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("boom")
    counts = _Counts()
    with pytest.raises(RuntimeError):
        _call(Gate(crash, None, counts))
    assert counts == [("/v1/completions", 500)]
    counts.clear()
    with pytest.raises(RuntimeError):
        _call(Gate(crash_after_start, None, counts))
    assert counts == [("/v1/completions", 200)]


def test_the_gate_asks_for_the_key_except_on_health_and_metrics():
    counts = _Counts()
    gate = Gate(_ok, "s3cret", counts)
    good = [(b"authorization", b"Bearer s3cret")]
    assert _call(gate, headers=good)[0]["status"] == 200
    for headers in ((), [(b"authorization", b"Bearer wrong")], [(b"authorization", b"s3cret")],
                    [(b"authorization", b"")]):
        sent = _call(gate, headers=headers)
        assert sent[0]["status"] == 401
        import json
        body = json.loads(sent[1]["body"])["error"]
        assert body == {"message": "missing or wrong API key: send the header "
                                   "'Authorization: Bearer <key>' with the key the server was "
                                   "started with", "type": "invalid_request_error",
                        "param": None, "code": "invalid_api_key"}
    for path in ("/health", "/metrics"):
        assert _call(gate, path=path)[0]["status"] == 200
    assert counts == [("/v1/completions", 200)] + [("/v1/completions", 401)] * 4 + \
        [("/v1/completions", 200)] * 2
    assert Gate(_ok, None, counts).authorized({"path": "/v1/completions"})
    assert Gate(_ok, "", counts).authorized({"path": "/v1/completions"})


def test_the_gate_lets_other_scopes_through_uncounted():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])
    counts = _Counts()
    _call(Gate(app, "key", counts), type_="lifespan")
    assert seen == ["lifespan"] and counts == []

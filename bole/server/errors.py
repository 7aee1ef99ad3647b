"""OpenAI's error body for every error the server answers: validation (FastAPI's 422, here a
400), undecodable or malformed JSON, unknown routes (404), wrong methods (405) and crashes
(500, logged; the server goes on)."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from bole.server.protocol import error_body

log = logging.getLogger("bole.server")

#: the routes a client can call, for the 404's message
ROUTES = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
          "GET /v1/models/{model}", "GET /health", "GET /metrics")


def error(status: int, message: str, type_: str = "invalid_request_error",
          param: str | None = None, code: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status,
                        headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first problem of a request that failed validation, and the field it names."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    loc = [x for x in first.get("loc", ()) if x != "body"]
    if kind == "json_invalid":
        pos = loc[0] if loc else None
        reason = (first.get("ctx") or {}).get("error", "malformed JSON")
        where = f" at character {pos}" if isinstance(pos, int) else ""
        return f"the request body is not valid JSON: {reason}{where}", None
    # a union's members each report; name the field, not pydantic's member types
    while loc and isinstance(loc[-1], str) and (
            loc[-1] in ("str", "int", "bool") or "[" in loc[-1]):
        loc.pop()
    where = ".".join(str(x) for x in loc) or None
    msg = first.get("msg", "invalid request")
    msg = msg.removeprefix("Value error, ")
    if kind == "extra_forbidden":
        msg = "unknown field; leave it out"
    elif kind == "missing":
        msg = "this field is required"
    elif kind == "model_attributes_type" or (kind == "dict_type" and not loc):
        msg = "the request body must be a JSON object"
    return (f"{where}: {msg}" if where else msg), where


def install(app: FastAPI) -> None:
    """Register the handlers that give every error OpenAI's body."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            message = (f"no route {method} {path}; this server answers "
                       f"{', '.join(ROUTES)}")
        elif exc.status_code == 405:
            allowed = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow", "")
            message = f"{method} is not allowed on {path}" + (f"; use {allowed}" if allowed
                                                               else "")
        elif exc.status_code == 400:
            message = f"the request body could not be read: {exc.detail} (send UTF-8 JSON)"
        else:
            message = str(exc.detail)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error(exc.status_code, message, type_, headers=exc.headers)

    @app.exception_handler(Exception)
    async def crashed(request, exc: Exception):
        log.exception("request failed")
        return error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

"""The ASGI layer in front of the routes: API-key authentication (``Authorization: Bearer``,
compared in constant time; ``/health`` and ``/metrics`` stay open for probes and scrapers) and
the count of responses by route and status code."""

from __future__ import annotations

import hmac
from typing import Callable

from bole.server.errors import error

#: routes that answer without the API key: load balancers' probes and metrics scrapers
OPEN_PATHS = frozenset({"/health", "/metrics"})


class Gate:
    """ASGI middleware: refuses (401) requests without the key when ``api_key`` is set, and
    calls ``count(route, status)`` for every response."""

    def __init__(self, app, api_key: str | None, count: Callable[[str, int], None]):
        self.app, self.count = app, count
        self._expected = f"Bearer {api_key}".encode() if api_key else None

    def authorized(self, scope) -> bool:
        if self._expected is None or scope["path"] in OPEN_PATHS:
            return True
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        return hmac.compare_digest(given, self._expected)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        def count(status: int) -> None:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.count(route, status)

        async def record(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                count(message["status"])        # counted before the client can see it
            await send(message)
        try:
            if self.authorized(scope):
                await self.app(scope, receive, record)
            else:
                await error(401, "missing or wrong API key: send the header "
                            "'Authorization: Bearer <key>' with the key the server was started "
                            "with", code="invalid_api_key")(scope, receive, record)
        finally:
            if not started:                     # an exception: the 500 goes out further out
                count(500)

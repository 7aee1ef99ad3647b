"""Reading a streamed response: every non-empty line a ``data:`` line, the JSON events and the
raw lines, for the server's stream tests (over loopback or in this process)."""

from __future__ import annotations

import json


def read_sse(response) -> tuple[list[dict], list[str]]:
    """The JSON events of an HTTP response streaming server-sent events, and every non-empty
    line as sent (``data: [DONE]`` included)."""
    events, lines = [], []
    for line in response.iter_lines():
        if not line:
            continue
        lines.append(line)
        assert line.startswith("data: "), line
        if line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events, lines

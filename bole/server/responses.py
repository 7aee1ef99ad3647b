"""A request's response: refused, whole, or streamed as server-sent events of each choice's
text deltas (:class:`TextStream`), from the events the engine's rounds feed its queue."""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

from bole.engine.scheduler import QueueFull
from bole.server.errors import error
from bole.server.protocol import (RequestError, StreamOptions, check_supported, completion_body,
                                  completion_choice, completion_chunk, error_body,
                                  logprobs_body, new_id)

__all__ = ["TextStream", "respond"]


class TextStream:
    """Incremental detokenisation: the text of the tokens so far, holding back an incomplete
    UTF-8 sequence and anything that could still become a stop string. Each call decodes only
    the tokens since the last complete text and those of the call before (a window, so that a
    tokenizer that treats a decode's first token apart, a leading space, gives the same text
    as a whole decode): a stream costs its tokens once, not once per chunk."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.sent = 0             # characters sent
        self.text = ""            # the text of ids[:read]
        self.prefix = 0           # the window's first token
        self.read = 0             # tokens whose text is in self.text

    def delta(self, ids: list[int], final_text: str | None) -> str:
        if final_text is not None:
            text = final_text
        else:
            if len(ids) > self.read:
                decode = self.tokenizer.decode      # a few tokens: microseconds
                before, after = decode(ids[self.prefix:self.read]), decode(ids[self.prefix:])
                if len(after) > len(before) and not after.endswith("\ufffd"):
                    self.text += after[len(before):]       # complete characters only
                    self.prefix, self.read = self.read, len(ids)
            text = self.text
            if self.stops:
                keep = len(text) - (max(len(s) for s in self.stops) - 1)
                text = text[:max(keep, self.sent)]
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out


async def respond(server: BoleServer, req, http: HTTPRequest, chat: bool):
    arrived = time.perf_counter()
    if server.draining:
        return error(503, "the server is shutting down; send the request to another replica "
                     "or retry after it restarts", "server_error", headers={"Retry-After": "5"})
    loop = asyncio.get_running_loop()
    try:
        check_supported(req)
        server.check_size(req, chat)
        sequences = await loop.run_in_executor(server.text_pool, server.prepare, req, chat)
    except RequestError as exc:
        return error(400, str(exc), param=exc.param)
    except ValueError as exc:
        return error(400, str(exc))
    queue: asyncio.Queue = asyncio.Queue()
    try:
        server.submit(sequences, queue, loop, stream=bool(req.stream), arrived=arrived)
    except QueueFull as exc:
        server.metrics.requests.labels("rejected").inc()
        return error(503, str(exc), "server_busy", headers={"Retry-After": "1"})
    except ValueError as exc:
        return error(400, str(exc))
    rid = new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        options = req.stream_options or StreamOptions()
        return StreamingResponse(_stream(server, sequences, queue, rid, chat, options),
                                 media_type="text/event-stream")
    try:
        return await _whole(server, sequences, queue, http, rid, chat)
    finally:
        server.release(sequences)


async def _whole(server: BoleServer, sequences: list[Sequence], queue: asyncio.Queue,
                 http: HTTPRequest, rid: str, chat: bool):
    """A non-streamed response: only final events arrive; a client that goes away meanwhile
    cancels its request (one getter kept across the polls, so that no event is lost to a
    timeout)."""
    pending = len(sequences)
    getter = asyncio.ensure_future(queue.get())
    while pending:
        done, _ = await asyncio.wait({getter}, timeout=0.1)
        if done:
            pending -= bool(getter.result()[1])
            if pending:
                getter = asyncio.ensure_future(queue.get())
        elif await http.is_disconnected():
            getter.cancel()
            return Response(status_code=499)
    if any(s.handle.request.result is None and not s.aborted for s in sequences):
        return error(500, "the request was cancelled by the server", "server_error")
    loop = asyncio.get_running_loop()
    texts = await loop.run_in_executor(server.text_pool, lambda: [
        (s.echo + s.text(server.tokenizer), s.logprobs(server.tokenizer, chat))
        for s in sequences])
    choices = [completion_choice(s.index, t, s.finish_reason, chat, lp)
               for s, (t, lp) in zip(sequences, texts)]
    return completion_body(rid, server.model_name, choices, chat, server.usage_of(sequences))


async def _stream(server: BoleServer, sequences: list[Sequence], queue: asyncio.Queue, rid: str,
                  chat: bool, options: StreamOptions) -> AsyncIterator[str]:
    """SSE chunks of each choice's text deltas (the echoed prompt first), its finish reason,
    optionally the usage (on the last chunk, or so far on every chunk), then ``[DONE]``."""
    by_index = {s.index: s for s in sequences}
    streams = {s.index: TextStream(server.tokenizer, s.params.stop) for s in sequences}
    first = {s.index: True for s in sequences}
    counted = {s.index: 0 for s in sequences}
    offset = {s.index: len(s.echo) for s in sequences}      # completions' text_offset
    model = server.model_name

    def sse(body: dict) -> str:
        if options.continuous_usage_stats:
            body["usage"] = server.usage_of(sequences)
        return _sse(body)

    def deltas(ready: dict[int, bool]) -> list[tuple[int, str, list[int], bool, dict | None]]:
        """Each ready choice's new text and tokens, whether it ended, and the logprobs of its
        tokens since the last chunk (None unless asked for). On the event loop: a chunk decodes
        only its new tokens (a thread hop per chunk cost more than the decode, and its thread
        took the GIL from the engine's rounds)."""
        out = []
        for i, finished in ready.items():
            seq = by_index[i]
            request = seq.handle.request
            ids = list(request.out)
            final = seq.text(server.tokenizer) if finished else None
            lp = None
            if seq.params.logprobs is not None:
                # the engine thread appends a token, then its entry: read tokens with entries only
                ids = ids[:len(request.logprobs)]
                lp = logprobs_body(request.logprobs[counted[i]:len(ids)],
                                   lambda t: server.tokenizer.decode([t]), chat, offset[i])
            out.append((i, streams[i].delta(ids, final), ids, finished, lp))
        return out

    try:
        for s in sequences:
            if s.echo:
                yield sse(completion_chunk(rid, model, s.echo, None, chat, index=s.index))
        left = len(sequences)
        while left:
            i, finished = await queue.get()
            ready = {i: finished}
            while not queue.empty():            # events that piled up: one chunk for all
                j, f = queue.get_nowait()
                ready[j] = ready.get(j, False) or f
            for i, delta, ids, finished, lp in deltas(ready):
                seq = by_index[i]
                # tokens that add no text (an end-of-sequence token, a stop string's) still
                # carry their ids and logprobs
                if delta or (first[i] and chat) or (finished and len(ids) > counted[i]):
                    yield sse(completion_chunk(rid, model, delta, None, chat, first[i],
                                               token_ids=ids[counted[i]:], index=i,
                                               logprobs=lp))
                    first[i], counted[i] = False, len(ids)
                    if lp is not None and not chat:
                        offset[i] += sum(len(t) for t in lp["tokens"])
                if finished:
                    left -= 1
                    if seq.handle.request.result is None and not seq.aborted:
                        yield _sse(error_body("the request was cancelled by the server",
                                              "server_error"))
                    else:
                        yield sse(completion_chunk(rid, model, "", seq.finish_reason, chat,
                                                   index=i))
        if options.include_usage:
            body = completion_chunk(rid, model, "", None, chat)
            body["choices"], body["usage"] = [], server.usage_of(sequences)
            yield _sse(body)
        yield "data: [DONE]\n\n"
    finally:                                    # a client that went away frees its slots
        server.release(sequences)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"

"""OpenAI-compatible request and response bodies (the fields Bole serves), and error bodies.

Requests are validated by pydantic; anything a client gets wrong becomes a 400 with OpenAI's
error body ``{"error": {"message", "type", "param", "code"}}`` (see :func:`error_body`).
Extra fields that OpenAI clients send are accepted and ignored; known fields are type-checked.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("n > 1 is not supported: send one request per completion")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops) or len(stops) > 8:
            raise ValueError("stop must be up to 8 non-empty strings")
        return stops

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("one prompt per request (a list of several is not supported)")
            prompt = prompt[0]
        if isinstance(prompt, (str, list)) and len(prompt) == 0:
            raise ValueError("the prompt is empty")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, rounds: int, accepted: int) -> dict:
    """OpenAI's usage plus the request's speculative statistics."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "rounds": rounds,
            "accepted_tokens": accepted,
            "mean_accepted_tokens": accepted / rounds if rounds else 0.0}


def completion_chunk(rid: str, model: str, text: str, finish: str | None, chat: bool,
                     first: bool = False, token_ids: list[int] | None = None) -> dict:
    """One streamed chunk (``text_completion`` or ``chat.completion.chunk``); ``token_ids``
    (an extension) lists the tokens the chunk's round emitted, so that a client can time
    tokens, not rounds."""
    if chat:
        delta = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        kind = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": [choice]}


def completion_body(rid: str, model: str, text: str, finish: str, chat: bool,
                    use: dict) -> dict:
    """A whole (non-streamed) response."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish, "logprobs": None}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": [choice], "usage": use}

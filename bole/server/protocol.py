"""OpenAI-compatible request and response bodies (the fields Bole serves), and error bodies.

Requests are validated by pydantic; anything a client gets wrong becomes a 400 with OpenAI's
error body ``{"error": {"message", "type", "param", "code"}}`` (see :func:`error_body`). A field
this server does not implement is never ignored in silence: :func:`check_supported` refuses it
with a 400 naming it, unless it holds its neutral value (``"tools": []``, ``"logit_bias": {}``),
which asks for nothing. :func:`engine_params` is the one place where request fields become the
engine's :class:`~bole.sampling_params.SamplingParams`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bole.engine.request import SamplingParams, TokenLogprob
from bole.sampling_params import MAX_LOGPROBS

#: the most choices (``n``) one request may ask for per prompt
MAX_N = 16
#: the most prompts of one completions request
MAX_PROMPTS = 64
#: the most sequences one request may start (prompts x n)
MAX_SEQUENCES = 64

#: OpenAI (and vLLM) request fields this server does not implement, with the values that ask for
#: nothing (null always does); any other value is refused with a 400 naming the field
UNSUPPORTED: dict[str, tuple] = {
    "tools": ([],), "tool_choice": ("none", "auto"), "parallel_tool_calls": (False, True),
    "functions": ([],), "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},), "logit_bias": ({},),
    "top_logprobs": (0,), "min_tokens": (0,),
    "best_of": (1,), "suffix": ("",), "store": (False,), "metadata": ({},),
    "modalities": (["text"],), "audio": (), "prediction": (), "reasoning_effort": (),
    "web_search_options": (), "service_tier": ("auto", "default"),
}
#: fields accepted and ignored because they change nothing in the output
IGNORED = frozenset({"user"})


class RequestError(ValueError):
    """A request the server refuses (400); ``param``: the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _check_unicode(value: Any, path: str) -> None:
    """Refuse strings that cannot be UTF-8 (JSON's ``"\\ud800"``: a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{path or 'the body'} holds a lone UTF-16 surrogate (such as "
                             "\\ud800), which is not text; send valid UTF-8") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k, path)
            _check_unicode(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_unicode(v, f"{path}[{i}]")


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with the usage; ``continuous_usage_stats`` (vLLM's): the
    usage so far on every chunk; ``include_obfuscation`` is accepted and ignored (no padding)."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63)  # torch's seed range
    # penalties (null: off), exact under speculation
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data):
        _check_unicode(data, "")
        return data

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

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per token the response lists logprobs of; None: no logprobs."""
        return None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    #: each token's logprob and this many alternatives' (OpenAI's legacy completions field)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt):
        ok = isinstance(prompt, str) or (isinstance(prompt, list) and all(
            isinstance(p, (str, int)) or (isinstance(p, list) and all(
                isinstance(t, int) for t in p)) for p in prompt))
        if not ok or (isinstance(prompt, list) and any(isinstance(p, bool) for p in prompt)):
            raise ValueError("the prompt must be a string, a list of strings, a list of token "
                             "ids or a list of token-id lists")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _prompts_present(cls, prompt):
        if isinstance(prompt, (str, list)) and len(prompt) == 0:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            if any(len(p) == 0 for p in prompt):
                raise ValueError("the prompt list holds an empty prompt")
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"{len(prompt)} prompts in one request; at most {MAX_PROMPTS}")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


def _content_text(content: str | list) -> str:
    """A message's text: the string, or its text parts joined by newlines (as vLLM does)."""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        if isinstance(content, str):
            return content
        for part in content:
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported; this server "
                                 "takes text only (a string, or parts of type 'text')")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise ValueError("a text content part is {\"type\": \"text\", \"text\": \"...\"}")
        return content

    def for_template(self) -> dict:
        out = {"role": self.role, "content": _content_text(self.content)}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def check_supported(req: _Sampling) -> None:
    """Refuse (RequestError) a field this server does not implement, unless neutral; and more
    sequences than :data:`MAX_SEQUENCES`."""
    if isinstance(req, ChatCompletionRequest) and "echo" in (req.model_extra or {}):
        raise RequestError("'echo' is a completions field; chat completions do not take it",
                           "echo")
    for name, value in (req.model_extra or {}).items():
        if name in IGNORED or value is None:
            continue
        if name not in UNSUPPORTED:
            raise RequestError(f"unknown field {name!r}; see the server's documentation "
                               "(docs/serving.md) for the fields it takes", name)
        if value not in UNSUPPORTED[name]:
            raise RequestError(f"{name!r} is not supported by this server; leave it out",
                               name)
    prompts = len(req.prompts) if isinstance(req, CompletionRequest) else 1
    if prompts * req.n > MAX_SEQUENCES:
        raise RequestError(f"{prompts} prompts x n={req.n} asks for {prompts * req.n} "
                           f"sequences; at most {MAX_SEQUENCES} per request", "n")


def engine_params(req: _Sampling, max_tokens: int) -> SamplingParams:
    """The engine's parameters for one sequence of ``req``: the one place where request fields
    become :class:`SamplingParams`. Every field is passed explicitly, so the server's defaults
    are OpenAI's (``temperature`` 1.0, from the request body's default), not the Python API's.
    The seed is the request's; each choice gets its own (:func:`choice_seed`)."""
    return SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed, max_tokens=max_tokens, stop=req.stop_strings,
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=bool(req.ignore_eos),
        logprobs=req.logprob_count)


def _token_entry(text_of, token_id: int, logprob: float) -> dict:
    text = text_of(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def logprobs_body(entries: list[TokenLogprob], text_of, chat: bool,
                  offset: int = 0) -> dict:
    """OpenAI's ``logprobs`` of a choice (or a chunk) for the tokens ``entries``;
    ``text_of(token id)``: a token's text (its bytes are that text's UTF-8); ``offset``: the
    completions text offset of the first entry. Chat: ``{"content": [{token, logprob, bytes,
    top_logprobs: [...]}]}``; completions: ``{tokens, token_logprobs, top_logprobs,
    text_offset}``. Log-probabilities are the model's raw distribution (before penalties and
    temperature)."""
    if chat:
        return {"content": [
            {**_token_entry(text_of, e.token_id, e.logprob),
             "top_logprobs": [_token_entry(text_of, t, v) for t, v in e.top]}
            for e in entries], "refusal": None}
    tokens = [text_of(e.token_id) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text_of(t): v for t, v in e.top} for e in entries],
            "text_offset": offsets}


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s sampling seed: ``seed`` itself for the first, distinct ones after."""
    if seed is None or index == 0:
        return seed
    return (seed * 1_000_003 + index) % (1 << 63)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, rounds: int, accepted: int,
          cached_tokens: int = 0) -> dict:
    """OpenAI's usage (``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache
    restored) plus the request's speculative statistics."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}, "rounds": rounds,
            "accepted_tokens": accepted,
            "mean_accepted_tokens": accepted / rounds if rounds else 0.0}


def completion_chunk(rid: str, model: str, text: str, finish: str | None, chat: bool,
                     first: bool = False, token_ids: list[int] | None = None,
                     index: int = 0, logprobs: dict | None = None) -> dict:
    """One streamed chunk (``text_completion`` or ``chat.completion.chunk``) of choice ``index``;
    ``token_ids`` (an extension) lists the tokens the chunk's round emitted, so that a client
    can time tokens, not rounds."""
    if chat:
        delta = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
        kind = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": [choice]}


def completion_choice(index: int, text: str, finish: str, chat: bool,
                      logprobs: dict | None = None) -> dict:
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "finish_reason": finish, "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def completion_body(rid: str, model: str, choices: list[dict], chat: bool, use: dict) -> dict:
    """A whole (non-streamed) response of ``choices`` (:func:`completion_choice`)."""
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": use}

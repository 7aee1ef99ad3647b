"""The request-to-engine mapping and the response's logprobs, without a server: what each
request field becomes in :class:`SamplingParams`, the chat and completions ``logprobs``
bodies against values written out by hand (UTF-8 bytes, text offsets), and the choices'
seeds."""

from __future__ import annotations

import pytest

from bole.engine.request import SamplingParams, TokenLogprob
from bole.server.protocol import (ChatCompletionRequest, CompletionRequest, choice_seed,
                                  engine_params, logprobs_body)

TEXT = {1: "a", 2: "é", 3: "日本", 4: " x"}           # 1, 2, 6 and 2 UTF-8 bytes
ENTRIES = [TokenLogprob(2, -0.25, ((2, -0.25), (1, -1.5))),
           TokenLogprob(3, -2.0, ((1, -0.5), (3, -2.0))),
           TokenLogprob(4, -0.125, ())]


def test_chat_logprobs_list_tokens_bytes_and_alternatives():
    body = logprobs_body(ENTRIES, TEXT.__getitem__, chat=True)
    assert body == {"refusal": None, "content": [
        {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9], "top_logprobs": [
            {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]},
            {"token": "a", "logprob": -1.5, "bytes": [0x61]}]},
        {"token": "日本", "logprob": -2.0, "bytes": [0xE6, 0x97, 0xA5, 0xE6, 0x9C, 0xAC],
         "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [0x61]},
                          {"token": "日本", "logprob": -2.0,
                           "bytes": [0xE6, 0x97, 0xA5, 0xE6, 0x9C, 0xAC]}]},
        {"token": " x", "logprob": -0.125, "bytes": [0x20, 0x78], "top_logprobs": []}]}
    assert logprobs_body([], TEXT.__getitem__, chat=True) == {"content": [], "refusal": None}


def test_completions_logprobs_offsets_count_characters_from_the_given_offset():
    """``text_offset``: each token's start in the choice's text, in characters, from
    ``offset`` (a stream's later chunk continues where the text so far ends)."""
    body = logprobs_body(ENTRIES, TEXT.__getitem__, chat=False, offset=7)
    assert body == {"tokens": ["é", "日本", " x"], "token_logprobs": [-0.25, -2.0, -0.125],
                    "top_logprobs": [{"é": -0.25, "a": -1.5}, {"a": -0.5, "日本": -2.0}, {}],
                    "text_offset": [7, 8, 10]}
    assert logprobs_body(ENTRIES[:1], TEXT.__getitem__, chat=False)["text_offset"] == [0]


def test_choice_seeds_reproduce_the_first_and_differ_for_the_others():
    """Choice 0 of a seeded request samples with the request's seed (so n=1 and the first of
    n>1 agree); the others get distinct, reproducible seeds in torch's range; no seed stays no
    seed for every choice."""
    for seed in (0, 7, -5, (1 << 63) - 1, -(1 << 63)):
        seeds = [choice_seed(seed, i) for i in range(16)]
        assert seeds[0] == seed and len(set(seeds)) == 16, seed
        assert seeds == [choice_seed(seed, i) for i in range(16)]
        assert all(0 <= s < 1 << 63 for s in seeds[1:]), seed
    assert [choice_seed(None, i) for i in range(3)] == [None] * 3


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                 **fields)


@pytest.mark.parametrize("request_, max_tokens, want, stops", [
    (CompletionRequest(model="m", prompt="x"), 16,
     SamplingParams(temperature=1.0, max_tokens=16), (5, 6)),
    (CompletionRequest(model="m", prompt="x", temperature=0.5, top_k=7, top_p=0.75,
                       presence_penalty=-1.5, frequency_penalty=0.25, repetition_penalty=1.25,
                       stop=["\n\n", "END"], stop_token_ids=[9, 3], logprobs=3, seed=-4), 40,
     SamplingParams(temperature=0.5, top_p=0.75, top_k=7, presence_penalty=-1.5,
                    frequency_penalty=0.25, repetition_penalty=1.25, seed=-4, max_tokens=40,
                    stop=("\n\n", "END"), stop_token_ids=(9, 3), logprobs=3), (5, 6, 9, 3)),
    (CompletionRequest(model="m", prompt="x", ignore_eos=True, stop_token_ids=[9],
                       repetition_penalty=0.5, stop="."), 3,
     SamplingParams(temperature=1.0, repetition_penalty=0.5, max_tokens=3, stop=(".",),
                    stop_token_ids=(9,), ignore_eos=True), (9,)),
    (_chat(temperature=0, logprobs=True, top_logprobs=2, presence_penalty=2.0,
           ignore_eos=False), 8,
     SamplingParams(temperature=0.0, presence_penalty=2.0, max_tokens=8, logprobs=2), (5, 6)),
    (_chat(logprobs=True, frequency_penalty=-2.0, ignore_eos=True), 8,
     SamplingParams(temperature=1.0, frequency_penalty=-2.0, max_tokens=8, ignore_eos=True,
                    logprobs=0), ()),
])
def test_engine_params_take_every_request_field(request_, max_tokens, want, stops):
    """Each field lands in its place; absent penalties are neutral; OpenAI's temperature
    default (1.0) is passed explicitly; the checkpoint's end-of-sequence tokens (5, 6 here)
    stop unless ``ignore_eos``, then the request's own (the engine adds them)."""
    got = engine_params(request_, max_tokens)
    assert got == want
    assert got.all_stop_token_ids((5, 6)) == stops
    got.validate()

"""What every front end checks a request against before it runs (EngineInfo.check_request): each
token id range taken at its edges and refused just outside, the context's bound exactly, and
the whole message a caller reads."""

from __future__ import annotations

import pytest

from bole.engine.request import EngineInfo, SamplingParams
from bole.engine.spec import SpecConfig

VOCAB, MAX_LEN, SCRATCH = 100, 64, 8


def info(has_tokenizer: bool = True) -> EngineInfo:
    return EngineInfo(SpecConfig(), MAX_LEN, SCRATCH, VOCAB, (0,), has_tokenizer)


def test_token_ids_at_both_ends_of_the_vocabulary_and_a_request_filling_the_context_are_taken():
    info().check_request([0, VOCAB - 1], SamplingParams(max_tokens=4, stop_token_ids=(0, VOCAB - 1)))
    # prompt + max_tokens + scratch == max_len exactly
    info().check_request([1] * 6, SamplingParams(max_tokens=MAX_LEN - SCRATCH - 6))
    info(has_tokenizer=False).check_request([1], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("prompt, params, name, message", [
    ([], SamplingParams(), "the prompt", "the prompt is empty; give at least one token"),
    ([1, VOCAB], SamplingParams(max_tokens=4), "prompt 2",
     f"prompt 2 holds token ids outside [0, {VOCAB})"),
    ([-1], SamplingParams(max_tokens=4), "the prompt",
     f"the prompt holds token ids outside [0, {VOCAB})"),
    ([1], SamplingParams(max_tokens=4, stop_token_ids=(VOCAB,)), "the prompt",
     f"stop_token_ids hold token ids outside [0, {VOCAB})"),
    ([1], SamplingParams(max_tokens=4, stop_token_ids=(-1,)), "the prompt",
     f"stop_token_ids hold token ids outside [0, {VOCAB})"),
    ([1] * 6, SamplingParams(max_tokens=MAX_LEN - SCRATCH - 5), "the prompt",
     f"the prompt (6 tokens) plus max_tokens={MAX_LEN - SCRATCH - 5} needs {MAX_LEN + 1} cache "
     f"positions (with {SCRATCH} for a round's tree), more than the context of {MAX_LEN}"),
    ([1], SamplingParams(max_tokens=0), "the prompt", "max_tokens must be an integer >= 1, got 0"),
])
def test_a_request_outside_a_limit_is_refused_with_its_whole_message(prompt, params, name, message):
    with pytest.raises(ValueError) as err:
        info().check_request(prompt, params, name)
    assert str(err.value) == message


def test_the_default_name_is_the_prompt_and_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError) as err:
        info().check_request([], SamplingParams())
    assert str(err.value) == "the prompt is empty; give at least one token"
    with pytest.raises(ValueError) as err:
        info(has_tokenizer=False).check_request([1], SamplingParams(max_tokens=4, stop="x"))
    assert str(err.value) == "stop strings need a tokenizer: build the Engine with one"
    info().check_request([1], SamplingParams(max_tokens=4, stop="x"))

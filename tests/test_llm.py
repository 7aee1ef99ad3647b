"""bole.LLM / bole.SamplingParams: the engine's results as text, defaults, seeds and errors."""

import pytest
import torch

from bole import LLM, SamplingParams
from bole.engine import Engine, SpecConfig
from bole.engine.spec import DEFAULT_TREE


@pytest.fixture(scope="module")
def llm():
    return LLM(max_batch=2, max_len=512)


def test_defaults_follow_the_cli(llm):
    assert llm.spec.mode == "bole" and llm.spec.drafter == "mtp"       # the bundled MTP head
    assert llm.model.dtype == torch.float32 or torch.cuda.is_available()
    assert (llm.spec.depth, llm.spec.topk, llm.spec.budget) == DEFAULT_TREE


def test_generate_is_the_engines_output_as_text(llm):
    prompt = "def add(a, b):"
    out = llm.generate(prompt, SamplingParams(max_tokens=12))[0]
    ids = llm.tokenizer.encode(prompt).ids
    engine = Engine(llm.model, SpecConfig("ar", "mtp"), max_slots=1, max_len=512,
                    tokenizer=llm.tokenizer)
    ar = engine.generate([ids], SamplingParams(max_tokens=12))[0]     # stops at eos too
    assert out.prompt == prompt and out.prompt_token_ids == ids
    assert out.token_ids == ar.token_ids                  # greedy bole == plain decoding
    assert out.text == llm.tokenizer.decode(ar.token_ids)
    assert out.finish_reason == ar.finish_reason and out.rounds >= 1


def test_a_seeded_request_samples_the_same_in_any_batch(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, seed=11)
    alone = llm.generate(["x = ["], sp)[0]
    batched = llm.generate(["import os", "x = ["], [SamplingParams(max_tokens=5), sp])[1]
    assert alone.token_ids == batched.token_ids


def test_stop_strings_cut_the_text(llm):
    full = llm.generate("def add(a, b):", SamplingParams(max_tokens=16))[0]
    stop = full.text[3:6]
    cut = llm.generate("def add(a, b):", SamplingParams(max_tokens=16, stop=stop))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="/nonexistent/folder"), "does not exist"),
    (dict(device="tpu"), "unknown device"),
    (dict(device="meta"), "not supported"),
    (dict(dtype="int8"), "not supported"),
    (dict(mode="fast"), "mode must be one of"),
    (dict(topk=1000), "topk"),
    (dict(drafter="draft"), "needs draft_model"),
    (dict(max_len=10 ** 6), "context"),
])
def test_bad_arguments_are_refused_before_loading(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(**kwargs)


def test_bad_requests_name_the_problem(llm):
    with pytest.raises(ValueError, match="top_p"):
        llm.generate("x", SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("x", SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["x"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="context"):
        llm.generate("x", SamplingParams(max_tokens=600))

"""The one per-request parameter type: the same class from every import path, its defaults, the
normalised stop fields, the end-of-sequence rule and validate's messages."""

import pytest

import bole
from bole.sampling_params import MAX_LOGPROBS, SamplingParams


def test_every_entry_point_takes_the_same_class():
    from bole.engine import SamplingParams as from_engine
    from bole.engine.request import SamplingParams as from_request
    from bole.llm import SamplingParams as from_llm
    assert bole.SamplingParams is from_llm is from_engine is from_request is SamplingParams


def test_defaults_are_greedy_and_neutral():
    p = SamplingParams()
    assert p.greedy and not p.penalized and p.temperature == 0
    assert (p.top_p, p.top_k, p.max_tokens, p.stop, p.stop_token_ids) == (1.0, 0, 64, (), ())
    assert (p.seed, p.ignore_eos, p.logprobs) == (None, False, None)
    p.validate()
    with pytest.raises(TypeError):
        SamplingParams(0.5)                     # keyword arguments only


def test_stop_fields_are_tuples():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4]) == \
        SamplingParams(stop=("a", "b"), stop_token_ids=(3, 4))
    hash(SamplingParams(stop=["a"], stop_token_ids=[1]))


def test_end_of_sequence_tokens_stop_unless_ignored():
    assert SamplingParams(stop_token_ids=[9]).all_stop_token_ids((1, 2)) == (1, 2, 9)
    assert SamplingParams(stop_token_ids=[9], ignore_eos=True).all_stop_token_ids((1, 2)) == (9,)


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=True), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(seed="7"), "seed"),
    (dict(max_tokens=0), "max_tokens"), (dict(stop=[""]), "stop"), (dict(stop=5), "stop"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"), (dict(logprobs=True), "logprobs"),
])
def test_validate_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw).validate()

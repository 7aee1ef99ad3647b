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


@pytest.mark.parametrize("kw", [
    dict(temperature=0), dict(temperature=1e-6), dict(temperature=100.0),
    dict(top_p=1), dict(top_p=1e-9), dict(top_k=0), dict(top_k=1),
    dict(presence_penalty=-2), dict(presence_penalty=2.0), dict(frequency_penalty=-2.0),
    dict(frequency_penalty=2), dict(repetition_penalty=1e-6), dict(repetition_penalty=5),
    dict(seed=0), dict(seed=-3), dict(seed=-(1 << 63)), dict(seed=(1 << 64) - 1),
    dict(max_tokens=1), dict(stop=("a", "bc")),
    dict(stop_token_ids=(0, 7)), dict(logprobs=0), dict(logprobs=MAX_LOGPROBS),
])
def test_validate_takes_every_value_at_the_edges_of_its_range(kw):
    SamplingParams(**kw).validate()


#: a value just outside each field's range, and the whole message validate gives for it
OUTSIDE = [
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    (dict(temperature="1"), "temperature must be a finite number >= 0, got '1'"),
    (dict(top_p=1.0001), "top_p must lie in (0, 1], got 1.0001"),
    (dict(top_p="0.5"), "top_p must lie in (0, 1], got '0.5'"),
    (dict(top_k=1.5), "top_k must be an integer >= 0 (0 = off), got 1.5"),
    (dict(top_k=-1), "top_k must be an integer >= 0 (0 = off), got -1"),
    (dict(presence_penalty=-2.01), "presence_penalty must lie in [-2, 2], got -2.01"),
    (dict(presence_penalty=float("nan")), "presence_penalty must lie in [-2, 2], got nan"),
    (dict(frequency_penalty=2.01), "frequency_penalty must lie in [-2, 2], got 2.01"),
    (dict(frequency_penalty="1"), "frequency_penalty must lie in [-2, 2], got '1'"),
    (dict(repetition_penalty=-1.0),
     "repetition_penalty must be a finite number > 0, got -1.0"),
    (dict(repetition_penalty=float("inf")),
     "repetition_penalty must be a finite number > 0, got inf"),
    (dict(repetition_penalty=True), "repetition_penalty must be a finite number > 0, got True"),
    (dict(seed=1.5), "seed must be None or an integer in [-2**63, 2**64) (a torch generator's "
                     "seeds), got 1.5"),
    (dict(seed=1 << 64), "seed must be None or an integer in [-2**63, 2**64) (a torch "
                         f"generator's seeds), got {1 << 64}"),
    (dict(seed=-(1 << 63) - 1), "seed must be None or an integer in [-2**63, 2**64) (a torch "
                                f"generator's seeds), got {-(1 << 63) - 1}"),
    (dict(max_tokens=2.0), "max_tokens must be an integer >= 1, got 2.0"),
    (dict(max_tokens=-1), "max_tokens must be an integer >= 1, got -1"),
    (dict(stop=["a", ""]),
     "stop must be a non-empty string or a sequence of non-empty strings, got ('a', '')"),
    (dict(stop=["a", 3]),
     "stop must be a non-empty string or a sequence of non-empty strings, got ('a', 3)"),
    (dict(stop=5), "stop must be a non-empty string or a sequence of non-empty strings, got 5"),
    (dict(stop_token_ids=[1, True]),
     "stop_token_ids must be a sequence of integers, got (1, True)"),
    (dict(stop_token_ids=7), "stop_token_ids must be a sequence of integers, got 7"),
    (dict(logprobs=-1), f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got -1"),
    (dict(logprobs=1.0), f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got 1.0"),
]


@pytest.mark.parametrize("kw, message", OUTSIDE)
def test_validate_refuses_a_value_just_outside_with_its_whole_message(kw, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kw).validate()
    assert str(err.value) == message


def test_validate_names_the_first_bad_field_sampling_then_stopping_then_logprobs():
    bad = SamplingParams(temperature=-1, max_tokens=0, logprobs=-1)
    with pytest.raises(ValueError, match="^temperature"):
        bad.validate()
    with pytest.raises(ValueError, match="^max_tokens"):
        SamplingParams(max_tokens=0, logprobs=-1).validate()


def test_stop_fields_take_any_iterable():
    p = SamplingParams(stop=(s for s in ["x", "y"]), stop_token_ids=iter([4, 5]))
    assert p.stop == ("x", "y") and p.stop_token_ids == (4, 5)
    p.validate()
    assert SamplingParams(stop=[]).stop == () and SamplingParams(stop_token_ids=[]).stop_token_ids == ()


@pytest.mark.parametrize("kw, penalized", [
    (dict(), False), (dict(presence_penalty=0.5), True), (dict(frequency_penalty=-0.5), True),
    (dict(repetition_penalty=1.1), True), (dict(repetition_penalty=0.9), True),
    (dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0), False),
])
def test_penalized_is_any_penalty_on(kw, penalized):
    assert SamplingParams(**kw).penalized is penalized


def test_only_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1.0, top_k=1).greedy

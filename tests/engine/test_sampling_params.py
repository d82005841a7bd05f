import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsserve.engine.sampling_params import SamplingParams, SamplingParamsError, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.logprobs) == (16, 0, False, None)
    assert p.skip_special_tokens and not p.include_stop_str_in_output
    assert p.sampling_type is SamplingType.RANDOM


def test_normalisation():
    p = SamplingParams(stop="END", stop_token_ids=[5, 3, 5], top_k=-1, seed=-1, logprobs=True)
    assert p.stop == ["END"] and p.stop_token_ids == [5, 3] and p.top_k == 0 and p.seed is None
    assert p.logprobs == 1
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(seed=7).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []


def test_greedy_resets_filters():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.sampling_type is SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


def test_tiny_temperature_is_raised():
    assert SamplingParams(temperature=1e-3).temperature == pytest.approx(1e-2)


def test_stop_buffer_and_stop_ids():
    assert SamplingParams(stop=["a", "abcd"]).stop_buffer_length == 3
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True).stop_buffer_length == 0
    # vLLM masks EOS during min_tokens even with ignore_eos
    assert SamplingParams(stop_token_ids=[9], ignore_eos=True).all_stop_token_ids(1) == {1, 9}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.1), "frequency_penalty"),
        (dict(n=0), "n"),
        (dict(logprobs=-1), "logprobs"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
        (dict(temperature=0.0, n=2), "n"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logit_bias=[5]), "logit_bias"),
    ],
)
def test_invalid_values_raise_clear_errors(kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.field == field
    msg = str(err)
    assert field in msg and "must" in msg
    assert repr(kwargs[field]) in msg or repr(err.value) in msg


def test_from_dict():
    p = SamplingParams.from_dict({"temperature": 0.5, "stop": "x", "max_tokens": 4})
    assert p.temperature == 0.5 and p.stop == ["x"] and p.max_tokens == 4
    with pytest.raises(SamplingParamsError, match=r"best_of=2.*unknown field.*temperature"):
        SamplingParams.from_dict({"best_of": 2})
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams.from_dict({"top_p": 2})


def test_logit_bias_and_seed_ranges():
    p = SamplingParams(logit_bias={3: -100, 7: 100.0}, seed=2**64 - 1)
    assert p.logit_bias == {3: -100, 7: 100.0} and p.seed == 2**64 - 1
    assert SamplingParams(logit_bias={}).logit_bias is None
    p.check_vocab(8)
    with pytest.raises(SamplingParamsError, match=r"\[0, 7\); got \[7\]"):
        p.check_vocab(7)
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_max_tokens_none_means_unbounded():
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


valid = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(1, 4),
        "temperature": st.floats(0.01, 2.0),
        "top_p": st.floats(0.01, 1.0),
        "top_k": st.integers(-1, 100),
        "min_p": st.floats(0.0, 1.0),
        "repetition_penalty": st.floats(0.1, 3.0),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "seed": st.none() | st.integers(0, 2**31),
        "stop": st.lists(st.text(min_size=1, max_size=5), max_size=3),
        "max_tokens": st.integers(1, 64),
        "logprobs": st.none() | st.integers(0, 20),
    },
)


@settings(max_examples=60, deadline=None)
@given(valid)
def test_valid_params_roundtrip(d):
    p = SamplingParams.from_dict(d)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert p.clone() == p

"""SamplingParams refuses bad values with a typed error naming the field and its bounds;
SequenceSampling picks the sampler path and the ids banned before min_tokens."""

import pytest

from jaxinfer.errors import RequestError
from jaxinfer.sampling_params import (
    FLOAT32_MAX,
    SamplingParams,
    SequenceSampling,
    banned_before_min_tokens,
)

REFUSED = [
    (dict(n=0), "n", (1, None)),
    (dict(temperature=-0.5), "temperature", (0, FLOAT32_MAX)),
    (dict(temperature=float("nan")), "temperature", (0, FLOAT32_MAX)),
    (dict(top_p=0.0), "top_p", (0, 1)),
    (dict(top_k=-2), "top_k", (-1, None)),
    (dict(min_p=1.5), "min_p", (0, 1)),
    (dict(presence_penalty=2.5), "presence_penalty", (-2, 2)),
    (dict(frequency_penalty=-3), "frequency_penalty", (-2, 2)),
    (dict(repetition_penalty=0), "repetition_penalty", (0, FLOAT32_MAX)),
    (dict(seed=-1), "seed", (0, 2**63 - 1)),
    (dict(stop=[""]), "stop", None),
    (dict(stop_token_ids=[-1]), "stop_token_ids", (0, None)),
    (dict(max_tokens=0), "max_tokens", (1, None)),
    (dict(min_tokens=-1), "min_tokens", (0, None)),
    (dict(min_tokens=5, max_tokens=4), "min_tokens", (0, 4)),
    (dict(logprobs=21), "logprobs", (0, 20)),
    (dict(prompt_logprobs=True), "prompt_logprobs", (0, 20)),
]


@pytest.mark.parametrize("kwargs, field, limit", REFUSED)
def test_bad_values_raise_a_request_error_naming_field_and_limit(kwargs, field, limit):
    with pytest.raises(RequestError, match=f"^{field} ") as refused:
        SamplingParams(**kwargs)
    assert (refused.value.field, refused.value.limit, refused.value.code) == (field, limit, "invalid_value")


def test_the_edges_of_each_range_are_accepted():
    SamplingParams(n=1, temperature=0, top_p=1, top_k=-1, min_p=1, presence_penalty=-2, frequency_penalty=2,
                   seed=2**63 - 1, stop_token_ids=[0], max_tokens=1, min_tokens=1, logprobs=20, prompt_logprobs=0)


@pytest.mark.parametrize(
    "kwargs, needs_full",
    [
        (dict(temperature=0), False),
        (dict(temperature=0.7), False),
        (dict(temperature=0, top_k=5), False),  # greedy ignores truncation
        (dict(temperature=0.7, top_k=5), True),
        (dict(temperature=0.7, top_p=0.9), True),
        (dict(temperature=0.7, min_p=0.1), True),
        (dict(temperature=0, repetition_penalty=1.1), True),
        (dict(temperature=0, presence_penalty=0.1), True),
        (dict(temperature=0, frequency_penalty=-0.1), True),
        (dict(temperature=0, logprobs=0), True),
        (dict(temperature=0, min_tokens=1), True),
        (dict(temperature=0, logit_bias={5: 1.0}), True),
    ],
)
def test_the_basic_sampler_path_serves_greedy_and_plain_temperature_only(kwargs, needs_full):
    sampling = SequenceSampling(SamplingParams(**kwargs), seed=0, max_tokens=16)
    assert sampling.needs_full_sampler is needs_full


def test_banned_before_min_tokens_is_eos_and_stop_ids_unless_eos_is_ignored():
    eos = frozenset({2, 9})
    assert banned_before_min_tokens(SamplingParams(stop_token_ids=[7, 2]), eos) == (2, 7, 9)
    assert banned_before_min_tokens(SamplingParams(stop_token_ids=[7], ignore_eos=True), eos) == (7,)
    assert banned_before_min_tokens(SamplingParams(ignore_eos=True), eos) == ()


def test_structured_outputs_params_need_exactly_one_constraint():
    from jaxinfer import StructuredOutputsParams

    assert StructuredOutputsParams(choice=["yes", "no"]).choice == ("yes", "no")
    assert StructuredOutputsParams(json_object=True).kinds() == ["json_object"]
    for bad in ({}, {"regex": "a+", "choice": ["a"]}, {"choice": []}, {"choice": "yes"}, {"regex": ""}, {"json": 3}):
        with pytest.raises(RequestError, match="structured_outputs"):
            StructuredOutputsParams(**bad)


def test_logit_bias_keys_may_be_json_strings_and_values_are_bounded():
    assert SamplingParams(logit_bias={"42": 5, 7: -100}).logit_bias == {42: 5, 7: -100}
    for bad in ({"x": 1}, {1: 101}, {-1: 0}, {1: float("nan")}):
        with pytest.raises(RequestError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(RequestError, match="bad_words"):
        SamplingParams(bad_words=[""])

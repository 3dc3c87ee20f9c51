"""Tool calling and JSON-schema output end to end: the default model (SmolLM2-135M-Instruct, whose
chat template knows no tools) behind the server, through the ``openai`` SDK, with the engine's
grammar-constrained sampler. Calls and JSON are valid by construction, whatever the model's skill."""

import json
import re

import jsonschema
import openai
import pytest
import requests

from jaxinfer import LLM
from jaxinfer.server.background import BackgroundServer

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3}},
    "required": ["name", "age", "languages"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    llm = LLM(dtype="float32", warm_up=False, use_tqdm=False, max_model_len=1024, max_num_seqs=8,
              max_num_batched_tokens=128, num_pages=128)
    with BackgroundServer(llm.engine, served_model_name="smollm2-135m-instruct", warmup=False) as s:
        yield s
    llm.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=600)


def check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_tool_choice_returns_valid_calls(client):
    # One call each: with parallel calls allowed, a 135M model tends to repeat calls until max_tokens.
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=MESSAGES, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=0,
                                       n=2, max_tokens=120)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            check_call(call.function.name, call.function.arguments)


def test_named_tool_choice_streamed(client):
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}}, temperature=1.0, seed=1, max_tokens=120,
        stream=True)
    calls, finish_reason = {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    assert finish_reason == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["add"]
    check_call("add", calls[0]["arguments"])


def test_tool_round_trip_then_answer(client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, tools=TOOLS,
                                       tool_choice="none", temperature=0, max_tokens=24)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_json_schema_outputs_validate(client):
    r = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        temperature=1.0, seed=2, n=4, max_tokens=200)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    r = client.completions.create(model="smollm2-135m-instruct", prompt="Is the sky blue? Answer:", max_tokens=8,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, temperature=1.0)
    assert r.choices[0].text in ("yes", "no")


def test_unsupported_schema_keyword_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}})
    assert e.value.body["param"] == "structured_outputs.json"


def test_regex_logit_bias_and_bad_words_reach_the_sampler(client, server):
    r = client.completions.create(model="smollm2-135m-instruct", prompt="My phone number is", max_tokens=12,
                                  temperature=1.0, seed=3, extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text
    greedy = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                       max_tokens=4, temperature=0, logprobs=0)
    first = greedy.choices[0].logprobs.tokens[0]
    tokens = requests.post(server.base_url + "/tokenize", json={"prompt": first, "add_special_tokens": False},
                           timeout=30).json()["tokens"]
    biased = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=4,
                                       temperature=0, logprobs=0, logit_bias={str(tokens[0]): -100})
    assert biased.choices[0].logprobs.tokens[0] != first
    word = greedy.choices[0].text.split()[0]
    banned = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=4,
                                       temperature=0, extra_body={"bad_words": [word]})
    assert word not in banned.choices[0].text

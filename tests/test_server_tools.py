"""Tool calling and structured outputs on the HTTP API, against FakeEngine with a scripted reply:
what reaches SamplingParams, the prompt the template renders, the OpenAI response shapes (whole
and streamed, through the ``openai`` SDK), and the 400s."""

import dataclasses
import json

import jsonschema
import openai
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.errors import RequestError
from jaxinfer.sampling_params import StructuredOutputsParams
from jaxinfer.server import protocol
from jaxinfer.server.errors import APIError
from jaxinfer.tool_parsers.grammar import tool_call_grammar
from tests.fake_engine import FakeEngine, RunningServer, load_tiny_tokenizer

WEATHER_PARAMETERS = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
USER = [{"role": "user", "content": "Weather in Paris?"}]


@dataclasses.dataclass
class Script:
    """FakeEngine's scripted reply, and what each request reached the engine with."""

    reply: str = "Hello."
    refusal: RequestError | None = None
    seen: list = dataclasses.field(default_factory=list)  # (prompt text, SamplingParams)

    def __call__(self, prompt_token_ids, params):
        self.seen.append((TOKENIZER.decode(prompt_token_ids, skip_special_tokens=False), params))
        if self.refusal is not None:
            raise self.refusal
        return self.reply


TOKENIZER, _ = load_tiny_tokenizer()


@pytest.fixture(scope="module")
def script():
    return Script()


@pytest.fixture(scope="module")
def server(script):
    with RunningServer(FakeEngine(max_model_len=4096, max_num_seqs=4, script=script)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=30)


@pytest.fixture(autouse=True)
def reset(script):
    script.reply, script.refusal = "Hello.", None
    script.seen.clear()


def test_required_tool_choice_returns_calls_enforced_by_a_grammar(client, server, script):
    script.reply = WEATHER_CALL
    r = client.chat.completions.create(model=server.model, messages=USER, tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    assert arguments == {"city": "Paris", "unit": "celsius"}
    prompt, params = script.seen[-1]
    functions = [t["function"] for t in TOOLS]
    assert params.structured_outputs == StructuredOutputsParams(grammar=tool_call_grammar("hermes", functions, True))
    # The default-like template has no tools: they went into the system message, Hermes format.
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and "<tool_call>" in prompt


def test_named_function_is_one_call_of_it(client, server, script):
    script.reply = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    r = client.chat.completions.create(model=server.model, messages=USER, tools=TOOLS, parallel_tool_calls=True,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
    grammar = script.seen[-1][1].structured_outputs.grammar
    assert grammar == tool_call_grammar("hermes", [TOOLS[1]["function"]], parallel=False)


def test_auto_parses_free_text_and_none_leaves_tools_out(client, server, script):
    script.reply = "I will look.\n" + WEATHER_CALL
    r = client.chat.completions.create(model=server.model, messages=USER, tools=TOOLS)
    assert r.choices[0].message.content == "I will look."
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert script.seen[-1][1].structured_outputs is None  # "auto": no grammar
    script.reply = "It is sunny."
    r = client.chat.completions.create(model=server.model, messages=USER, tools=TOOLS, tool_choice="auto")
    assert r.choices[0].message.content == "It is sunny." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    script.reply = WEATHER_CALL
    r = client.chat.completions.create(model=server.model, messages=USER, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == WEATHER_CALL and not r.choices[0].message.tool_calls
    assert "<tools>" not in script.seen[-1][0]


def test_streamed_tool_calls_arrive_in_fragments(client, server, script):
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    script.reply = "Checking.\n" + WEATHER_CALL + "\n" + time_call
    chunks = list(client.chat.completions.create(model=server.model, messages=USER, tools=TOOLS,
                                                 tool_choice="auto", stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    content, calls, num_argument_chunks = "", {}, 0
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
            num_argument_chunks += bool(d.function.arguments)
    assert content.strip() == "Checking."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "UTC"})]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert num_argument_chunks > 5  # arguments were split across chunks
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_round_trip_renders_calls_and_results(client, server, script):
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ]
    script.reply = "It is 21 degrees and sunny."
    r = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS)
    assert r.choices[0].message.content == "It is 21 degrees and sunny."
    prompt = script.seen[-1][0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>\n<tool_response>\nsunny\n</tool_response>' in prompt


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("extra,expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_PARAMETERS}}},
     StructuredOutputsParams(json=WEATHER_PARAMETERS)),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"guided_json": json.dumps(WEATHER_PARAMETERS)}, StructuredOutputsParams(json=WEATHER_PARAMETERS)),
    ({"guided_grammar": 'start: "a"+'}, StructuredOutputsParams(grammar='start: "a"+')),
    ({"guided_choice": ["x"], "logit_bias": {"17": -100, 5: 2.5}, "bad_words": ["cat"]},
     StructuredOutputsParams(choice=["x"])),
])
def test_output_constraints_reach_sampling_params(server, script, endpoint, extra, expected):
    body = {"model": server.model, "max_tokens": 8, **extra}
    body.update(prompt="hi") if endpoint == "completions" else body.update(messages=USER)
    r = requests.post(f"{server.base_url}/v1/{'completions' if endpoint == 'completions' else 'chat/completions'}",
                      json=body, timeout=30)
    assert r.status_code == 200, r.text
    params = script.seen[-1][1]
    assert params.structured_outputs == expected
    if "logit_bias" in extra:
        assert params.logit_bias == {17: -100, 5: 2.5} and params.bad_words == ["cat"]


def test_engine_refusing_a_grammar_is_a_400_naming_the_field(server, script):
    script.refusal = RequestError("structured_outputs.json uses the keyword 'patternProperties', not supported",
                                  field="structured_outputs.json")
    for stream in (False, True):
        r = requests.post(server.base_url + "/v1/chat/completions", timeout=30, json={
            "model": server.model, "messages": USER, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "structured_outputs.json" and "patternProperties" in error["message"]


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_time"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a" * 65}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}}], "tool_choice": "required"},
     "tools[1].function.parameters"),
    ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{not json"}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": "f()"}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "tool", "tool_call_id": 7, "content": "x"}]}, "messages[0].tool_call_id"),
])
def test_bad_tool_and_constraint_fields_are_400_naming_them(server, body, param):
    r = requests.post(server.base_url + "/v1/chat/completions", timeout=30,
                      json={"model": server.model, "messages": USER, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


QWEN25_STYLE = """{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are helpful.' }}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA31_STYLE = """{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>

Respond with {"name": function name, "parameters": dictionary of arguments}. Functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for tc in message.tool_calls %}<|python_tag|>{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}<|eom_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

SMOLLM2 = json.load(open("tests/golden/smollm2-135m-instruct.json"))["chat_template"]
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."}, *USER,
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
]


def render(template: str, body: dict, parser: str | None = None):
    tokenizer = dataclasses.replace(TOKENIZER, chat_template=template)
    parsed = protocol.parse_chat({"messages": ROUND_TRIP, **body}, tokenizer, 8192, "m", parser)
    return tokenizer.decode(parsed.prompts[0].token_ids, skip_special_tokens=False), parsed


@pytest.mark.parametrize("template,parser,call_text", [
    (QWEN25_STYLE, "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (LLAMA31_STYLE, "llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    (SMOLLM2, "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
])
def test_templates_render_tools_calls_and_results(template, parser, call_text):
    text, parsed = render(template, {"tools": TOOLS, "tool_choice": "required"})
    assert parsed.tools.parser.name == parser
    assert call_text in text  # the assistant's call, arguments as an object
    assert "21C" in text and "Be brief." in text
    assert json.dumps(TOOLS[0]["function"]["parameters"]) in text  # the tool definitions
    functions = [t["function"] for t in TOOLS]
    assert parsed.params[0].structured_outputs.grammar == tool_call_grammar(parser, functions, True)
    if template is SMOLLM2:  # no tool support: one system message holding the client's and the tools'
        assert text.count("<|im_start|>system") == 1 and "SmolLM" not in text
        assert text.index("Be brief.") < text.index("<tools>")


def test_tool_call_parser_flag_overrides_the_template_markers():
    _, parsed = render(QWEN25_STYLE, {"tools": TOOLS}, parser="mistral")
    assert parsed.tools.parser.name == "mistral" and parsed.params[0].skip_special_tokens is False
    _, parsed = render(SMOLLM2, {"tools": TOOLS}, parser="mistral")  # no tool support: always Hermes
    assert parsed.tools.parser.name == "hermes"


def test_parse_logit_bias_checks_the_vocabulary():
    body = {"messages": USER, "logit_bias": {str(TOKENIZER.vocab_size): 1}}
    with pytest.raises(APIError, match="logit_bias"):
        protocol.parse_chat(body, TOKENIZER, 4096, "m")
    parsed = protocol.parse_chat({"messages": USER, "logit_bias": {"3": -1}}, TOKENIZER, 4096, "m")
    assert parsed.params[0].logit_bias == {3: -1}


json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=3), max_leaves=6)
functions = st.fixed_dictionaries({}, optional={"name": st.sampled_from(["f", "get_time", "a b", ""]) | json_values,
                                               "description": json_values,
                                               "parameters": st.sampled_from([{"type": "object"}, {}]) | json_values})
tool_lists = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "x"])},
                                            optional={"function": functions | json_values}), max_size=3)
calls = st.lists(st.fixed_dictionaries({}, optional={
    "id": json_values, "type": json_values,
    "function": st.fixed_dictionaries({}, optional={"name": st.just("f") | json_values,
                                                    "arguments": st.sampled_from(['{"a": 1}', "{}", "[", ""])
                                                    | json_values})}), max_size=2)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "system"])},
                                          optional={"content": st.none() | st.text(max_size=8),
                                                    "tool_calls": calls | json_values,
                                                    "tool_call_id": json_values}), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(tools=tool_lists | json_values, choice=st.sampled_from(["auto", "required", "none"]) | json_values
       | st.fixed_dictionaries({"type": st.just("function"), "function": json_values}),
       messages=messages, template=st.sampled_from(["plain", "qwen"]))
def test_fuzzed_tool_fields_are_answered_or_refused_never_a_crash(tools, choice, messages, template):
    tokenizer = dataclasses.replace(TOKENIZER, chat_template=QWEN25_STYLE if template == "qwen" else SMOLLM2)
    try:
        protocol.parse_chat({"messages": messages, "tools": tools, "tool_choice": choice}, tokenizer, 8192, "m")
    except APIError as e:
        assert e.status == 400 and e.param, e

"""Tool-call parsers: each format whole and streamed (every split of the text), the registry, the
partial-JSON scanner, and the grammars that enforce tool_choice (checked with llguidance)."""

import json

import pytest

from jaxinfer.tool_parsers import (PARSERS, StreamingToolParser, get_parser, parser_for_template,
                                   template_supports_tools)
from jaxinfer.tool_parsers.grammar import tool_call_grammar
from jaxinfer.tool_parsers.partial_json import Span, array_items, object_members, value_end

WEATHER = {"city": "Paris", "unit": "celsius", "days": [1, 2], "note": "a \"quoted\" }{ ] string\\"}
HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER)
              + '}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
CASES = [
    # (parser, text, expected content, expected [(name, arguments)])
    ("hermes", HERMES_TWO, "Let me check.", [("get_weather", WEATHER), ("now", {})]),
    ("hermes", '<tool_call>{"name": "now"}</tool_call>', None, [("now", {})]),
    ("hermes", "Just text, with < and <tool but no call.", "Just text, with < and <tool but no call.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}", None,
     [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", {"x": 1}), ("b", {})]),
    ("llama3_json", "The weather is {fine}.", "The weather is {fine}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER)
     + '}, {"name": "now", "arguments": {}}]', "Sure", [("get_weather", WEATHER), ("now", {})]),
    ("mistral", "No [TOOL_CALLS here.", "No [TOOL_CALLS here.", []),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse_whole_text(name, text, content, calls):
    got_content, got_calls = get_parser(name).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


def stream(name: str, text: str, pieces: list[int]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Feed ``text`` growing to each length in ``pieces`` (then whole and final): the concatenated
    content, each call's name and concatenated arguments, and every content fragment sent."""
    parser = StreamingToolParser(get_parser(name))
    content, fragments, calls = "", [], []
    for i, end in enumerate([*pieces, len(text)]):
        new_content, deltas = parser.feed(text[:end], is_final=i == len(pieces))
        content += new_content
        fragments.append(new_content)
        for d in deltas:
            if d.name is not None:
                assert d.index == len(calls), "a call's name comes first, in order"
                calls.append([d.name, ""])
            calls[d.index][1] += d.arguments
    return content, [tuple(c) for c in calls], fragments


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_one_character_at_a_time_matches_the_whole_parse(name, text, content, calls):
    streamed_content, streamed_calls, _ = stream(name, text, list(range(1, len(text))))
    assert [(n, json.loads(a)) for n, a in streamed_calls] == calls
    if calls:
        assert streamed_content.strip() == (content or "")
    else:
        assert streamed_content == text


@pytest.mark.parametrize("name,text,content,calls", [c for c in CASES if c[3] and c[3][0][1]])
def test_arguments_arrive_in_several_fragments(name, text, content, calls):
    parser = StreamingToolParser(get_parser(name))
    num_fragments = 0
    for end in range(1, len(text) + 1):
        _, deltas = parser.feed(text[:end], is_final=end == len(text))
        num_fragments += sum(1 for d in deltas if d.index == 0 and d.arguments)
    assert num_fragments > 3  # the first call's arguments were streamed, not sent whole at the end


def test_streaming_holds_back_what_may_start_a_marker_and_releases_it_when_it_does_not():
    _, _, fragments = stream("hermes", "Hi <tool", [3, 5, 8])
    assert fragments == ["Hi ", "", "", "<tool"]  # "<", "<tool" held back until the end
    _, _, fragments = stream("hermes", "Hi <b>", [3, 5, 6])
    assert fragments == ["Hi ", "<b", ">", ""]  # "<b" cannot start "<tool_call>": sent at once
    _, _, fragments = stream("llama3_json", '{"answer": 42}', [1, 5])
    assert fragments == ["", "", '{"answer": 42}']  # a JSON answer that is no call is content at the end


def test_malformed_call_is_content():
    text = "<tool_call>\n[1, 2]\n</tool_call>"
    assert get_parser("hermes").parse(text) == (text, [])
    content, calls, _ = stream("hermes", text, list(range(1, len(text))))
    assert content == text and calls == []


def test_cut_off_call_parses_as_content_but_streams_what_arrived():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert get_parser("hermes").parse(text) == (text, [])
    _, calls, _ = stream("hermes", text, list(range(1, len(text))))
    assert calls == [("get_weather", '{"city": "Par')]


QWEN_LIKE = ("{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
             "</tools>\nReturn calls in <tool_call></tool_call> tags.<|im_end|>\n{%- endif %}...")
LLAMA31_LIKE = ("{%- if tools is not none %}Respond in the format {\"name\": function name, \"parameters\": ...}"
                "{%- endif %}{%- if builtin_tools %}<|python_tag|>{%- endif %}")
MISTRAL_LIKE = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{%- endif %}[TOOL_CALLS]"
SMOLLM2 = json.load(open("tests/golden/smollm2-135m-instruct.json"))["chat_template"]


def test_parser_from_the_template_markers():
    assert parser_for_template(QWEN_LIKE).name == "hermes"
    assert parser_for_template(LLAMA31_LIKE).name == "llama3_json"
    assert parser_for_template(MISTRAL_LIKE).name == "mistral"
    assert parser_for_template(SMOLLM2).name == "hermes"
    assert [template_supports_tools(t) for t in (QWEN_LIKE, LLAMA31_LIKE, MISTRAL_LIKE, SMOLLM2, None)] == \
        [True, True, True, False, False]
    assert sorted(PARSERS) == ["hermes", "llama3_json", "mistral"]
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'.*hermes"):
        get_parser("xml")


def test_partial_json_spans():
    text = '{"a": "x\\"}", "b": [1, {"c": 2}], "d": 12'
    members, end = object_members(text, 0)
    assert end is None
    assert {k: text[s.start:s.end] for k, s in members.items() if s.end} == {"a": '"x\\"}"', "b": '[1, {"c": 2}]'}
    assert members["d"] == Span(text.index("12"), None)  # a number at the end may still grow
    assert value_end('{"a": [}', 0) is None
    items, end = array_items('[{"x": 1}, {"y"', 0)
    assert [i.end is None for i in items] == [False, True] and end is None
    with pytest.raises(ValueError):
        object_members('{"a" 1}', 0)


FUNCTIONS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}},
             {"name": "now"}]


@pytest.mark.parametrize("name,parallel,text,accepted", [
    ("hermes", False, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', True),
    ("hermes", False, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', True),
    ("hermes", False, '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius"}}\n</tool_call>', False),
    ("hermes", False, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n<tool_call>', False),
    ("hermes", True, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
                     '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', True),
    ("hermes", False, 'Sure! <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', False),
    ("llama3_json", True, '{"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "X"}}',
     True),
    ("llama3_json", False, '{"name": "later", "parameters": {}}', False),
    ("mistral", False, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "X", "unit": "celsius"}}]', True),
])
def test_tool_call_grammar_accepts_exactly_the_calls(name, parallel, text, accepted):
    matcher, tokenizer = matcher_for(tool_call_grammar(name, FUNCTIONS, parallel))
    consumed = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
    assert (consumed and not matcher.is_error() and matcher.is_accepting()) == accepted
    if accepted:  # and what the grammar produces, the format's parser reads back
        _, calls = get_parser(name).parse(text)
        assert calls and all(c.name in {"get_weather", "now"} for c in calls)


def test_mistral_grammar_writes_the_marker_as_its_special_token():
    # The tiny tokenizer has no [TOOL_CALLS]: another special token of it stands in for the marker.
    _, tokenizer = matcher_for('start: "x"')
    marker = tokenizer.token_to_id("<|start_header_id|>")
    grammar = tool_call_grammar("mistral", FUNCTIONS, False, marker_token_id=marker)
    body = tokenizer.encode('[{"name": "now", "arguments": {}}]', add_special_tokens=False)
    matcher, _ = matcher_for(grammar)
    assert matcher.consume_tokens([marker] + body) and matcher.is_accepting()
    matcher, _ = matcher_for(grammar)  # the marker spelled as text is not it
    assert not matcher.consume_tokens(tokenizer.encode("[TOOL_CALLS]", add_special_tokens=False)[:1])


def matcher_for(lark: str):
    """An llguidance matcher of ``lark`` over the tiny test tokenizer, and that tokenizer."""
    llguidance = pytest.importorskip("llguidance")
    from tests.fake_engine import load_tiny_tokenizer

    tokenizer, _ = load_tiny_tokenizer()
    lltok = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=tokenizer.vocab_size,
                                   eos_token=tokenizer.eos_token_ids[0])
    grammar = llguidance.grammar_from("lark", lark)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    return llguidance.LLMatcher(lltok, grammar, log_level=0), tokenizer

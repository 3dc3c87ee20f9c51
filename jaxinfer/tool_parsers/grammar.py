"""Grammars that make a model call a tool: ``tool_choice="required"`` or a named function.

Each builder returns a Lark grammar in llguidance's dialect (``%json { schema }`` inlines a JSON
schema as a rule) that accepts exactly the calls of one format: for each allowed function its
name as a literal and its ``parameters`` schema for the arguments. With ``parallel`` the model may
write one or more calls, without it exactly one. The grammar ends where the calls end, so the
engine allows EOS there and nowhere before.
"""

from __future__ import annotations

import json

from jaxinfer.tool_parsers.hermes import CLOSE, OPEN
from jaxinfer.tool_parsers.mistral import MARKER

# What a tool without "parameters" takes: no arguments (an empty object is the only value).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _literal(text: str) -> str:
    # A JSON string literal is also a valid Lark one: both escape quotes and backslashes the same way.
    return json.dumps(text)


def _functions(functions: list[dict], argument_key: str) -> list[str]:
    """One rule per function: ``fn_i: "{\\"name\\": \\"NAME\\", \\"KEY\\": " args_i "}"`` and its schema."""
    rules = []
    for i, function in enumerate(functions):
        schema = function.get("parameters") or NO_PARAMETERS
        prefix = f'{{"name": {json.dumps(function["name"])}, {json.dumps(argument_key)}: '
        rules.append(f'fn_{i}: {_literal(prefix)} args_{i} "}}"')
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    return ["call_body: " + " | ".join(f"fn_{i}" for i in range(len(functions)))] + rules


def hermes_grammar(functions: list[dict], parallel: bool) -> str:
    """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, once or (parallel) repeated."""
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    call = f"call: {_literal(OPEN + chr(10))} call_body {_literal(chr(10) + CLOSE)}"
    return "\n".join([start, call, *_functions(functions, "arguments")]) + "\n"


def llama3_json_grammar(functions: list[dict], parallel: bool) -> str:
    """``{"name": ..., "parameters": ...}``, once or (parallel) several joined by ``; ``."""
    start = 'start: call_body ("; " call_body)*' if parallel else "start: call_body"
    return "\n".join([start, *_functions(functions, "parameters")]) + "\n"


def mistral_grammar(functions: list[dict], parallel: bool, marker_token_id: int | None = None) -> str:
    """``[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]``. The marker is the tokenizer's own
    special token when it has one (``marker_token_id``: llguidance's ``<[id]>``), as the model was
    trained to write it; else it is spelled as text."""
    items = 'call_body (", " call_body)*' if parallel else "call_body"
    marker = _literal(MARKER) if marker_token_id is None else f"<[{marker_token_id}]>"
    start = f'start: {marker} "[" {items} "]"'
    return "\n".join([start, *_functions(functions, "arguments")]) + "\n"


GRAMMARS = {"hermes": hermes_grammar, "llama3_json": llama3_json_grammar, "mistral": mistral_grammar}


def tool_call_grammar(parser_name: str, functions: list[dict], parallel: bool,
                      marker_token_id: int | None = None) -> str:
    """The grammar of calls to ``functions`` (OpenAI ``function`` objects: ``name``, ``parameters``)
    in the format ``parser_name`` reads; ``marker_token_id``: the id of the format's marker when it
    is one special token (Mistral's ``[TOOL_CALLS]``)."""
    if not functions:
        raise ValueError("a tool-call grammar needs at least one function")
    if parser_name == "mistral":
        return mistral_grammar(functions, parallel, marker_token_id)
    return GRAMMARS[parser_name](functions, parallel)

"""The tool-calling fields of a chat request: ``tools``, ``tool_choice``, ``parallel_tool_calls``,
the tool fields of messages, and rendering them through the model's chat template.

- ``tool_choice`` ``"none"`` (or no tools) leaves tools out of the prompt entirely;
  ``"auto"`` (the default with tools) lets the model write text or calls, parsed afterwards;
  ``"required"`` and a named function are enforced by a grammar in the model's call format
  (:mod:`jaxinfer.tool_parsers.grammar`), so the output is calls by construction.
- A template that reads ``tools`` gets them (and messages with ``tool_calls`` whose arguments are
  objects, as Hugging Face templates expect); one that does not (SmolLM2's) gets the tools in its
  system message and the Hermes format (:mod:`jaxinfer.tool_parsers.prompt`).
"""

from __future__ import annotations

import dataclasses
import json
import re

from jaxinfer.errors import RequestError
from jaxinfer.sampling_params import StructuredOutputsParams
from jaxinfer.structured_output.grammar import check_grammar
from jaxinfer.tool_parsers import PARSERS, ToolParser, get_parser, parser_for_template, template_supports_tools
from jaxinfer.tool_parsers.grammar import tool_call_grammar
from jaxinfer.tool_parsers.prompt import messages_for_plain_template
from jaxinfer.server.errors import bad_request

MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """The tools a chat request offers and how it asks for them to be used."""

    tools: list[dict]  # validated OpenAI tool objects: {"type": "function", "function": {...}}
    choice: str  # "auto", "required" or "function" (a named one)
    function_name: str | None  # the function that tool_choice names
    parallel: bool  # parallel_tool_calls: more than one call allowed
    parser: ToolParser
    marker_token_id: int | None = None  # the parser's marker as one token of this tokenizer, if it is

    def grammar(self) -> str | None:
        """The grammar that enforces the choice: None for "auto"; one call of the named function;
        one call (or, parallel, several) of any of them for "required"."""
        if self.choice == "auto":
            return None
        functions = [t["function"] for t in self.tools]
        if self.choice == "function":
            functions = [f for f in functions if f["name"] == self.function_name]
        _check_parameters(self.tools, {f["name"] for f in functions})
        return tool_call_grammar(self.parser.name, functions, self.parallel and self.choice == "required",
                                 self.marker_token_id)


def _check_parameters(tools: list[dict], names: set[str]) -> None:
    """400 naming the tool whose parameters schema the grammar cannot enforce: the engine would
    name only the grammar the tools became."""
    for i, tool in enumerate(tools):
        function = tool["function"]
        if function["name"] in names and function.get("parameters"):
            try:
                check_grammar(StructuredOutputsParams(json=function["parameters"]))
            except RequestError as e:
                where = f"tools[{i}].function.parameters"
                raise bad_request(str(e).replace("structured_outputs.json", where), param=where) from None


def choose_parser(template: str | None, configured: str | None) -> ToolParser:
    """The call format: Hermes for a template without tools (what its system message teaches),
    else ``--tool-call-parser`` or the format the template's markers show."""
    if not template_supports_tools(template):
        return PARSERS["hermes"]
    return get_parser(configured) if configured else parser_for_template(template)


def parse_tool_request(body: dict, parser: ToolParser, marker_token_id: int | None = None) -> ToolRequest | None:
    """The request's tools and choice; None when it offers none or chose "none"."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise bad_request("'functions' and 'function_call' are deprecated; use 'tools' and 'tool_choice'",
                          param="functions")
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if not tools:
        if tools is not None and not isinstance(tools, list):
            raise bad_request("'tools' must be a list of tools", param="tools")
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    tools = _tools(tools)
    names = [t["function"]["name"] for t in tools]
    if choice is None or choice in ("auto", "required"):
        return ToolRequest(tools, choice or "auto", None, parallel, parser, marker_token_id)
    if choice == "none":
        return None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if name not in names:
        raise bad_request(f"'tool_choice' names the function {name!r}, which is not in 'tools' ({names})"[:300],
                          param="tool_choice")
    return ToolRequest(tools, "function", name, parallel, parser, marker_token_id)


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tools", param="tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' may hold at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}", param=where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise bad_request(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}"[:300],
                              param=f"{where}.function.name")
        if name in seen:
            raise bad_request(f"{where}.function.name {name!r} is not unique", param=f"{where}.function.name")
        seen.add(name)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise bad_request(f"{where}.function.description must be a string", param=f"{where}.function.description")
        parameters = function.get("parameters")
        is_object_schema = isinstance(parameters, dict) and parameters.get("type", "object") == "object"
        if parameters is not None and not is_object_schema:
            raise bad_request(f"{where}.function.parameters must be a JSON schema of an object "
                              "({'type': 'object', 'properties': {...}})", param=f"{where}.function.parameters")
        kept = {k: function[k] for k in ("name", "description", "parameters") if function.get(k) is not None}
        out.append({"type": "function", "function": kept})
    return out


def message_tool_fields(message: dict, i: int) -> dict:
    """A message's tool fields, checked: an assistant's ``tool_calls`` (arguments as JSON text),
    a tool result's ``tool_call_id`` and ``name``."""
    role = message.get("role")
    fields = {}
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = message["tool_calls"]
        where = f"messages[{i}].tool_calls"
        if not isinstance(calls, list):
            raise bad_request(f"{where} must be a list", param=where)
        fields["tool_calls"] = [_tool_call(call, f"{where}[{j}]") for j, call in enumerate(calls)]
    if role == "tool":
        for key in ("tool_call_id", "name"):
            value = message.get(key)
            if value is not None and not isinstance(value, str):
                raise bad_request(f"messages[{i}].{key} must be a string", param=f"messages[{i}].{key}")
            if value is not None:
                fields[key] = value
    return fields


def _tool_call(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                          "'arguments': ...}}}}", param=where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    try:
        if not isinstance(arguments, str) or not isinstance(json.loads(arguments), dict):
            raise ValueError
    except ValueError:
        raise bad_request(f"{where}.function.arguments must be a JSON object (as text)",
                          param=f"{where}.function.arguments") from None
    return {"id": call.get("id") if isinstance(call.get("id"), str) else "", "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def template_inputs(template: str | None, messages: list[dict],
                    tool_request: ToolRequest | None) -> tuple[list[dict], dict]:
    """The messages and extra variables (``tools``) to render ``template`` with."""
    tools = tool_request.tools if tool_request is not None else None
    if not template_supports_tools(template):
        return messages_for_plain_template(messages, tools), {}
    rendered = []
    for message in messages:
        if message.get("tool_calls"):
            # Hugging Face templates write arguments with `| tojson`: they expect an object.
            message = dict(message, tool_calls=[
                {**call, "function": {"name": call["function"]["name"],
                                      "arguments": json.loads(call["function"]["arguments"])}}
                for call in message["tool_calls"]])
        rendered.append(message)
    return rendered, ({"tools": tools} if tools else {})

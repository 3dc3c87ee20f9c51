"""Tool calling: reading the calls a model writes, in the format of its family, and constraining
it to write them.

- ``hermes`` (Hermes, Qwen2.5, and any model whose template does not know tools),
  ``llama3_json`` (Llama 3.1/3.2) and ``mistral``: one :class:`ToolParser` each, with a
  non-streaming ``parse`` and a :class:`StreamingToolParser` for streamed responses.
- :func:`parser_for_template` picks the format from the chat template's source;
  ``jaxinfer serve --tool-call-parser NAME`` overrides it.
- :mod:`jaxinfer.tool_parsers.grammar` builds the grammar that enforces ``tool_choice``
  ``"required"`` or a named function; :mod:`jaxinfer.tool_parsers.prompt` puts tools into the
  system message of a template that has no place for them.
"""

from __future__ import annotations

import re

from jaxinfer.tool_parsers.base import PartialCall, Scan, StreamingToolParser, ToolCall, ToolCallDelta, ToolParser
from jaxinfer.tool_parsers.hermes import HermesParser
from jaxinfer.tool_parsers.llama3_json import Llama3JsonParser
from jaxinfer.tool_parsers.mistral import MistralParser

# Checked in this order: a template may mention several markers (a Qwen template documents
# <tool_call> and never [TOOL_CALLS], but be safe about which wins).
PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), MistralParser(), Llama3JsonParser())}
DEFAULT_PARSER = "hermes"

_USES_TOOLS = re.compile(r"\btools\b")


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[name]


def template_supports_tools(template: str | None) -> bool:
    """Whether the chat template renders the ``tools`` it is given (it reads the variable)."""
    return bool(template) and _USES_TOOLS.search(template) is not None


def parser_for_template(template: str | None) -> ToolParser:
    """The format a model writes calls in, from its chat template's source: the first parser whose
    marker the template holds; Hermes when none does (what a template without tools is taught)."""
    for parser in PARSERS.values():
        if template and any(marker in template for marker in parser.template_markers):
            return parser
    return PARSERS[DEFAULT_PARSER]


__all__ = ["PARSERS", "DEFAULT_PARSER", "PartialCall", "Scan", "StreamingToolParser", "ToolCall", "ToolCallDelta",
           "ToolParser", "get_parser", "parser_for_template", "template_supports_tools"]

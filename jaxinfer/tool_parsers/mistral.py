"""Mistral tool calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

Content is the text before ``[TOOL_CALLS]``. The marker is a special token in Mistral's
tokenizers, so requests parsed with this format keep special tokens in the output text.
"""

from __future__ import annotations

from jaxinfer.tool_parsers.base import Scan, ToolParser, call_in_object, content_end
from jaxinfer.tool_parsers.partial_json import array_items, skip_whitespace

MARKER = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    template_markers = (MARKER,)
    marker_token = MARKER

    def scan(self, text: str, is_final: bool) -> Scan:
        first = text.find(MARKER)
        if first < 0:
            return Scan(text[:content_end(text, MARKER, is_final)], [])
        content = text[:first]
        pos = skip_whitespace(text, first + len(MARKER))
        if pos >= len(text):
            return Scan(content, [])
        if text[pos] == "{":  # a single call written without the list around it
            call, _ = call_in_object(text, pos, ("arguments", "parameters"))
            return Scan(content, [call])
        items, _ = array_items(text, pos)
        calls = [call_in_object(text, item.start, ("arguments", "parameters"))[0] for item in items]
        return Scan(content, calls)

"""Hermes / Qwen2.5 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

Content is the text before the first block; several blocks are several calls. This is also the
format jaxinfer teaches a model whose chat template knows nothing of tools
(:mod:`jaxinfer.tool_parsers.prompt`).
"""

from __future__ import annotations

from jaxinfer.tool_parsers.base import Scan, ToolParser, call_in_object, content_end
from jaxinfer.tool_parsers.partial_json import skip_whitespace

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    template_markers = (OPEN,)

    def scan(self, text: str, is_final: bool) -> Scan:
        first = text.find(OPEN)
        if first < 0:
            return Scan(text[:content_end(text, OPEN, is_final)], [])
        calls = []
        pos = first
        while pos >= 0:
            body = skip_whitespace(text, pos + len(OPEN))
            if body >= len(text):
                break
            call, end = call_in_object(text, body, ("arguments", "parameters"))
            calls.append(call)
            if end is None:
                break
            close = text.find(CLOSE, end)
            pos = -1 if close < 0 else text.find(OPEN, close + len(CLOSE))
        return Scan(text[:first], calls)

"""Llama 3.1 / 3.2 JSON tool calls: ``{"name": ..., "parameters": {...}}``, maybe after
``<|python_tag|>``, several separated by ``;``.

The output is a call only if it starts (after whitespace) with ``{`` or the tag; anything else is
plain content, as Meta's prompt format has the model answer either with a call or with text.
``<|python_tag|>`` is a special token, usually dropped from the text by the detokenizer, so the
``{`` is what is seen in practice.
"""

from __future__ import annotations

from jaxinfer.tool_parsers.base import Scan, ToolParser, call_in_object
from jaxinfer.tool_parsers.partial_json import skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    template_markers = (PYTHON_TAG,)

    def scan(self, text: str, is_final: bool) -> Scan:
        start = skip_whitespace(text, 0)
        rest = text[start:]
        if not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG):
            # Nothing yet says whether this is a call or content.
            return Scan(text if is_final else "", [])
        if rest.startswith(PYTHON_TAG):
            pos = skip_whitespace(text, start + len(PYTHON_TAG))
        elif rest.startswith("{"):
            pos = start
        else:
            return Scan(text, [])
        calls = []
        while pos < len(text):
            call, end = call_in_object(text, pos, ("parameters", "arguments"))
            calls.append(call)
            if end is None:
                break
            pos = skip_whitespace(text, end)
            if text[pos:pos + 1] != ";":
                break
            pos = skip_whitespace(text, pos + 1)
        return Scan("", calls)

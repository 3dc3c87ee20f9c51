"""Where the JSON values of a possibly unfinished text begin and end, without parsing them.

A streamed tool call arrives a few characters at a time: ``{"name": "get_weather", "argu``. The
streaming parsers need to know, at every point, whether the ``name`` string is complete and how
much of the ``arguments`` value has arrived, so that they can send the name once and then the
argument text as it grows. These scanners find the spans of values in such a prefix; a span whose
end has not arrived yet has ``end=None``. They never decode the values (``json.loads`` does that
once a span is complete), and they raise ``ValueError`` on text that cannot be the start of JSON.
"""

from __future__ import annotations

import dataclasses
import json

_WHITESPACE = " \t\r\n"
_SCALAR_CHARS = set("0123456789+-.eEtrufalsn")


@dataclasses.dataclass(frozen=True)
class Span:
    start: int
    end: int | None  # one past the value's last character; None: the text ends inside the value


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int | None:
    """One past the closing quote of the string whose opening quote is at ``pos``."""
    i = pos + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, pos: int) -> int | None:
    """One past the end of the JSON value starting at ``pos`` (no leading whitespace), or None when
    the text ends first. A number or literal at the very end of the text may still grow, so it
    counts as unfinished."""
    if pos >= len(text):
        return None
    c = text[pos]
    if c == '"':
        return _string_end(text, pos)
    if c in "{[":
        depth, i = 0, pos
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    if c in _SCALAR_CHARS:
        i = pos
        while i < len(text) and text[i] in _SCALAR_CHARS:
            i += 1
        return None if i == len(text) else i
    raise ValueError(f"no JSON value starts at {text[pos:pos + 20]!r}")


def object_members(text: str, pos: int) -> tuple[dict[str, Span], int | None]:
    """The members of the JSON object whose ``{`` is at ``pos``: key -> span of its value, for every
    key whose string has arrived, and one past the closing ``}`` (None while it has not)."""
    if text[pos:pos + 1] != "{":
        raise ValueError(f"expected a JSON object at {text[pos:pos + 20]!r}")
    members: dict[str, Span] = {}
    i = skip_whitespace(text, pos + 1)
    if text[i:i + 1] == "}":
        return members, i + 1
    while i < len(text):
        if text[i] != '"':
            raise ValueError(f"expected a key at {text[i:i + 20]!r}")
        key_end = _string_end(text, i)
        if key_end is None:
            return members, None
        key = json.loads(text[i:key_end])
        i = skip_whitespace(text, key_end)
        if i >= len(text):
            return members, None
        if text[i] != ":":
            raise ValueError(f"expected ':' after key {key!r}")
        i = skip_whitespace(text, i + 1)
        if i >= len(text):
            return members, None
        end = value_end(text, i)
        members[key] = Span(i, end)
        if end is None:
            return members, None
        i = skip_whitespace(text, end)
        if i >= len(text):
            return members, None
        if text[i] == "}":
            return members, i + 1
        if text[i] != ",":
            raise ValueError(f"expected ',' or '}}' after the value of {key!r}")
        i = skip_whitespace(text, i + 1)
    return members, None


def array_items(text: str, pos: int) -> tuple[list[Span], int | None]:
    """The items of the JSON array whose ``[`` is at ``pos`` (the last one maybe unfinished), and
    one past the closing ``]`` (None while it has not arrived)."""
    if text[pos:pos + 1] != "[":
        raise ValueError(f"expected a JSON array at {text[pos:pos + 20]!r}")
    items: list[Span] = []
    i = skip_whitespace(text, pos + 1)
    if text[i:i + 1] == "]":
        return items, i + 1
    while i < len(text):
        end = value_end(text, i)
        items.append(Span(i, end))
        if end is None:
            return items, None
        i = skip_whitespace(text, end)
        if i >= len(text):
            return items, None
        if text[i] == "]":
            return items, i + 1
        if text[i] != ",":
            raise ValueError("expected ',' or ']' between array items")
        i = skip_whitespace(text, i + 1)
    return items, None

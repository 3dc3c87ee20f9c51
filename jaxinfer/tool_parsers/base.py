"""What every tool-call parser shares: the call types, the non-streaming ``parse`` and the
streaming ``StreamingToolParser`` that turns growing text into OpenAI deltas.

A format (``hermes``, ``llama3_json``, ``mistral``) implements one method, ``scan(text, is_final)``:
given everything the model has written so far, the content that may be sent (text before the first
tool call, minus a tail that could still turn into a call marker) and the calls seen so far, each
with its name once the name's string is complete and the raw text of its arguments as far as it
has arrived. Both ``parse`` and the streaming parser are built on it, so a streamed response and a
whole one read the text the same way.
"""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar

from jaxinfer.tool_parsers.partial_json import object_members


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One complete call: a function name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class PartialCall:
    """A call as far as the text goes."""

    name: str | None  # None until the name's closing quote has arrived
    arguments: str  # the raw JSON text of the arguments so far; only ever grows
    is_complete: bool  # the call's JSON object has closed


@dataclasses.dataclass(frozen=True)
class Scan:
    content: str  # a prefix of the text that is content for sure (grows with the text)
    calls: list[PartialCall]


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed call: the first one for a call carries its name."""

    index: int  # which call of the choice (OpenAI's ``tool_calls[].index``)
    name: str | None
    arguments: str


def call_in_object(text: str, pos: int, argument_keys: tuple[str, ...]) -> tuple[PartialCall, int | None]:
    """The call written as a JSON object at ``pos`` (``{"name": ..., "<argument key>": {...}}``),
    and one past its closing brace (None while it is unfinished)."""
    members, end = object_members(text, pos)
    name = None
    span = members.get("name")
    if span is not None and span.end is not None:
        name = json.loads(text[span.start:span.end])
        if not isinstance(name, str):
            raise ValueError("a tool call's name must be a string")
    arguments = ""
    for key in argument_keys:
        if key in members:
            span = members[key]
            arguments = text[span.start:len(text) if span.end is None else span.end]
            break
    return PartialCall(name, arguments, end is not None), end


def content_end(text: str, marker: str, is_final: bool) -> int:
    """How much of ``text`` (holding no ``marker``) is content for sure: all but a tail that is the
    start of ``marker`` and could become it with the next characters. All of it once final."""
    if not is_final:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                return len(text) - k
    return len(text)


class ToolParser:
    """A tool-call format. Subclasses set the class attributes and implement :meth:`scan`."""

    name: ClassVar[str]
    # Strings whose presence in a chat template's source says the model writes this format.
    template_markers: ClassVar[tuple[str, ...]]
    # The format's marker when it is one special token, which the detokenizer must then keep in
    # the text and a grammar can name by id.
    marker_token: ClassVar[str | None] = None

    @property
    def needs_special_tokens(self) -> bool:
        return self.marker_token is not None

    def scan(self, text: str, is_final: bool) -> Scan:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output. Text that does not hold well-formed calls (a
        name and an object of arguments each) is all content, with no calls, so a model that
        writes something else is answered as if it had not tried to call a tool."""
        try:
            scan = self.scan(text, is_final=True)
        except ValueError:
            return text, []
        calls = []
        for call in scan.calls:
            if not call.is_complete or call.name is None:
                return text, []
            try:
                arguments = json.loads(call.arguments) if call.arguments else {}
            except ValueError:
                return text, []
            if not isinstance(arguments, dict):
                return text, []
            calls.append(ToolCall(call.name, json.dumps(arguments, ensure_ascii=False)))
        if not calls:
            return text, []
        return scan.content.strip() or None, calls


class StreamingToolParser:
    """One choice's stream: fed the whole text so far after each step, it returns what is new as
    (content, tool-call deltas). A call's name goes out once it is complete, then its argument text
    in fragments as it arrives; a tail that could start a call marker is held back until it is
    known not to. If the text turns out to hold no well-formed call, what was held back is sent as
    content at the end."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self._content_sent = 0  # characters of the text sent as content (it is a prefix)
        self._arguments_sent: list[int] = []  # per call whose name went out: argument characters sent
        self._is_malformed = False

    @property
    def num_calls(self) -> int:
        return len(self._arguments_sent)

    def feed(self, text: str, is_final: bool) -> tuple[str, list[ToolCallDelta]]:
        if not self._is_malformed:
            try:
                scan = self.parser.scan(text, is_final)
            except ValueError:
                self._is_malformed = True
        if self._is_malformed:
            # Calls already sent cannot be taken back; without any, the text is all content.
            return (self._take_content(text) if not self._arguments_sent else ""), []
        content = self._take_content(scan.content)
        deltas = []
        for index, call in enumerate(scan.calls):
            if index == len(self._arguments_sent):
                if call.name is None:
                    break
                self._arguments_sent.append(0)
                name = call.name
            else:
                name = None
            arguments = call.arguments[self._arguments_sent[index]:]
            if call.is_complete and not call.arguments and self._arguments_sent[index] == 0:
                arguments = "{}"  # a call written without arguments takes none
            self._arguments_sent[index] += len(arguments)
            if name is not None or arguments:
                deltas.append(ToolCallDelta(index, name, arguments))
        if is_final and not self._arguments_sent:
            content += self._take_content(text)
        return content, deltas

    def _take_content(self, content: str) -> str:
        new = content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(content))
        return new

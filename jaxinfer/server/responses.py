"""OpenAI response bodies: completions and chat, whole or as stream chunks, with usage and logprobs.

The engine reports cumulative text and token ids per sample; :class:`ResponseBuilder` keeps how
much of each choice it has sent, so a stream chunk carries only the new part. Choice index is
``prompt_index * n + sample_index``, as OpenAI numbers them.

A chat request that offered tools has its text read by the tool-call parser of the model's format
(:mod:`jaxinfer.tool_parsers`): calls become ``message.tool_calls`` (streamed: ``delta.tool_calls``,
the name first, then argument fragments) and a choice that ended on them says
``finish_reason: "tool_calls"``; text around them stays ``content``.
"""

from __future__ import annotations

import functools
import json
import re
import time
import uuid

from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.server.protocol import ParsedRequest
from jaxinfer.tool_parsers import StreamingToolParser, ToolCall, ToolCallDelta

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (one printable character per byte), inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish_reason(finish_reason: str | None, num_calls: int) -> str | None:
    # A choice that stopped (EOS or a stop string) after calling tools ended to have them run;
    # one cut off by max_tokens stays "length", as OpenAI reports it.
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


class ResponseBuilder:
    def __init__(self, parsed: ParsedRequest, response_id: str, tokenizer):
        self.parsed = parsed
        self.id = response_id
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.n = parsed.params[0].n
        self.is_chat = parsed.kind == "chat"
        self._sent_text: dict[int, int] = {}
        self._sent_tokens: dict[int, int] = {}
        self._finished: set[int] = set()
        self._role_sent: set[int] = set()
        self._last: dict[int, RequestOutput] = {}
        self._prompt_texts: dict[int, str] = {}
        self._tool_streams: dict[int, StreamingToolParser] = {}  # per choice, with tools
        self._tool_call_ids: dict[tuple[int, int], str] = {}  # (choice, call index) -> id

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_bytes(self, token_id: int, text: str) -> list[int]:
        """The token's own UTF-8 bytes, as OpenAI's ``bytes`` field promises, so a client can join
        the tokens of a character split over several. A token holding part of a character decodes
        alone to U+FFFD, whose bytes are not the token's: read them from the vocabulary entry
        (byte-fallback ``<0xE3>`` or byte-level BPE) instead."""
        if "\ufffd" not in text:
            return list(text.encode())
        raw = self.tokenizer.id_to_token(token_id) or ""
        match = _BYTE_TOKEN.fullmatch(raw)
        if match:
            return [int(match.group(1), 16)]
        decoder = _byte_level_decoder()
        if raw and all(c in decoder for c in raw):
            return [decoder[c] for c in raw]
        return list(text.encode())

    def _logprobs(self, sample: CompletionOutput, start: int, end: int | None, text_offset: int):
        """Logprobs of the sample's tokens ``start:end``, in the endpoint's format."""
        if sample.logprobs is None:
            return None
        ids, entries = sample.token_ids[start:end], sample.logprobs[start:end]
        if self.is_chat:
            k = self.parsed.top_logprobs or 0
            content = []
            for token_id, entry in zip(ids, entries):
                token = self._token_text(token_id)
                top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
                content.append({
                    "token": token, "logprob": entry.get(token_id, 0.0), "bytes": self._token_bytes(token_id, token),
                    "top_logprobs": [{"token": self._token_text(t), "logprob": lp,
                                      "bytes": self._token_bytes(t, self._token_text(t))} for t, lp in top]})
            return {"content": content}
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in zip(ids, entries):
            token = self._token_text(token_id)
            tokens.append(token)
            token_logprobs.append(entry.get(token_id, 0.0))
            top_logprobs.append(self._legacy_top(entry, token_id))
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _legacy_top(self, entry: dict[int, float], token_id: int) -> dict[str, float]:
        """vLLM's shape of one legacy ``top_logprobs`` entry: the top k plus the token itself."""
        k = self.parsed.params[0].logprobs or 0
        top = dict(sorted(entry.items(), key=lambda kv: -kv[1])[:k])
        top.setdefault(token_id, entry.get(token_id, 0.0))
        return {self._token_text(t): lp for t, lp in top.items()}

    def _wants_echo_logprobs(self) -> bool:
        return not self.is_chat and self.parsed.echo and self.parsed.params[0].logprobs is not None

    def _echo_logprobs(self, prompt_index: int, out: RequestOutput, generated: dict | None) -> dict:
        """echo + logprobs (OpenAI's legacy format): the prompt's tokens, then ``generated``'s.

        The first prompt token has nothing before it: its logprob and top_logprobs are null.
        ``text_offset`` counts from the start of the echoed prompt text; a prompt token's width is
        its text as the echo shows it (special tokens such as BOS, left out of it, take none).
        """
        ids = self.parsed.prompts[prompt_index].token_ids
        entries = out.prompt_logprobs or [None] * len(ids)
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = 0
        for token_id, entry in zip(ids, entries):
            tokens.append(self._token_text(token_id))
            token_logprobs.append(None if entry is None else entry.get(token_id, 0.0))
            top_logprobs.append(None if entry is None else self._legacy_top(entry, token_id))
            offsets.append(offset)
            offset += len(self.tokenizer.decode([token_id], skip_special_tokens=True))
        result = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                  "text_offset": offsets}
        for key, values in (generated or {}).items():
            result[key] = result[key] + values
        return result

    def _vllm_prompt_logprobs(self, out: RequestOutput) -> list | None:
        """vLLM's ``prompt_logprobs`` of a completion choice: per prompt token None (the first) or
        ``{token_id: {"logprob", "decoded_token"}}`` for the token and the top k (no ``rank``)."""
        if out.prompt_logprobs is None:
            return None
        k = self.parsed.prompt_logprobs or 0
        result = []
        for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs):
            if entry is None:
                result.append(None)
                continue
            top = dict(sorted(entry.items(), key=lambda kv: -kv[1])[:k])
            top = {token_id: entry[token_id], **top}
            result.append({str(t): {"logprob": lp, "decoded_token": self._token_text(t)} for t, lp in top.items()})
        return result

    def _prompt_text(self, prompt_index: int) -> str:
        if prompt_index not in self._prompt_texts:  # decoded once: streams ask for it every chunk
            prompt = self.parsed.prompts[prompt_index]
            self._prompt_texts[prompt_index] = (prompt.text if prompt.text is not None
                                                else self.tokenizer.decode(prompt.token_ids))
        return self._prompt_texts[prompt_index]

    def stream_chunks(self, prompt_index: int, out: RequestOutput) -> list[str]:
        """SSE events for what is new in ``out`` since the last call."""
        self._last[prompt_index] = out
        events = []
        for sample in out.outputs:
            index = prompt_index * self.n + sample.index
            if index in self._finished:
                continue
            text_start = self._sent_text.get(index, 0)
            token_start = self._sent_tokens.get(index, 0)
            # The engine's text only grows (it holds back what a stop string spanning tokens could
            # still cut), so concatenated deltas equal the non-streamed text.
            text_end = max(text_start, len(sample.text))
            delta = sample.text[text_start:text_end]
            # The engine's token and logprob lists are live (they grow while the engine thread runs
            # the next step) and it appends a token before its logprobs: count only tokens whose
            # logprobs are there, or the ones between would never be sent.
            token_end = len(sample.token_ids) if sample.logprobs is None else min(len(sample.token_ids),
                                                                                  len(sample.logprobs))
            new_tokens = token_end > token_start
            first = index not in self._role_sent
            if not (delta or new_tokens or sample.finish_reason or first):
                continue
            self._sent_text[index] = text_end
            self._sent_tokens[index] = token_end
            # With echo, generated text (and its offsets) follows the prompt's text.
            echo_width = len(self._prompt_text(prompt_index)) if self.parsed.echo and not self.is_chat else 0
            logprobs = (self._logprobs(sample, token_start, token_end, echo_width + text_start)
                        if new_tokens else None)
            if first and self._wants_echo_logprobs():
                logprobs = self._echo_logprobs(prompt_index, out, logprobs)
            if sample.finish_reason:
                self._finished.add(index)
            if self.is_chat and self.parsed.tools is not None:
                choice = self._tool_choice_chunk(index, sample.text[:text_end], sample.finish_reason, first, logprobs)
                if choice is None:
                    continue
            elif self.is_chat:
                message = {"content": delta}
                if first:
                    message = {"role": "assistant", "content": delta}
                choice = {"index": index, "delta": message, "logprobs": logprobs,
                          "finish_reason": sample.finish_reason}
            else:
                if first and self.parsed.echo:
                    delta = self._prompt_text(prompt_index) + delta
                choice = {"index": index, "text": delta, "logprobs": logprobs,
                          "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason}
                if first and self.parsed.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out)
            self._role_sent.add(index)
            events.append(sse(self._envelope([choice], chunk=True)))
        return events

    def _tool_choice_chunk(self, index: int, text: str, finish_reason: str | None, first: bool,
                           logprobs: dict | None) -> dict | None:
        """A stream chunk's choice for a request with tools: new content and call deltas; None when
        there is nothing to send (the new text is held back, it may start a call)."""
        stream = self._tool_streams.setdefault(index, StreamingToolParser(self.parsed.tools.parser))
        content, deltas = stream.feed(text, is_final=finish_reason is not None)
        message: dict = {"content": content} if content or first else {}
        if first:
            message = {"role": "assistant", **message}
        if deltas:
            message["tool_calls"] = [self._tool_call_delta(index, d) for d in deltas]
        if not (message or logprobs or finish_reason):
            return None
        return {"index": index, "delta": message, "logprobs": logprobs,
                "finish_reason": _finish_reason(finish_reason, stream.num_calls)}

    def _tool_call_delta(self, index: int, delta: ToolCallDelta) -> dict:
        if delta.name is None:
            return {"index": delta.index, "function": {"arguments": delta.arguments}}
        call_id = self._tool_call_ids.setdefault((index, delta.index), tool_call_id())
        return {"index": delta.index, "id": call_id, "type": "function",
                "function": {"name": delta.name, "arguments": delta.arguments}}

    def _chat_choice(self, index: int, sample: CompletionOutput, logprobs: dict | None) -> dict:
        """A whole response's chat choice; with tools, the calls parsed out of the text."""
        message = {"role": "assistant", "content": sample.text}
        calls: list[ToolCall] = []
        if self.parsed.tools is not None:
            content, calls = self.parsed.tools.parser.parse(sample.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": [
                    {"id": tool_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]}
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": _finish_reason(sample.finish_reason, len(calls))}

    def _envelope(self, choices: list[dict], chunk: bool, usage: dict | None = None) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.is_chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.parsed.model, "choices": choices}
        if not chunk or self.parsed.include_usage:
            body["usage"] = usage
        return body

    def usage(self, outputs: dict[int, RequestOutput] | None = None) -> dict:
        outputs = self._last if outputs is None else outputs
        prompt_tokens = sum(len(p.token_ids) for p in self.parsed.prompts)
        completion_tokens = sum(len(s.token_ids) for out in outputs.values() for s in out.outputs)
        cached = sum(out.num_cached_tokens for out in outputs.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def usage_chunk(self) -> str:
        return sse(self._envelope([], chunk=True, usage=self.usage()))

    def full_response(self, outputs: dict[int, RequestOutput]) -> dict:
        choices = []
        for prompt_index in sorted(outputs):
            for sample in outputs[prompt_index].outputs:
                index = prompt_index * self.n + sample.index
                echo_text = self._prompt_text(prompt_index) if self.parsed.echo and not self.is_chat else ""
                logprobs = self._logprobs(sample, 0, None, len(echo_text))
                if self._wants_echo_logprobs():
                    logprobs = self._echo_logprobs(prompt_index, outputs[prompt_index], logprobs)
                if self.is_chat:
                    choices.append(self._chat_choice(index, sample, logprobs))
                else:
                    choice = {"index": index, "text": echo_text + sample.text, "logprobs": logprobs,
                              "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason}
                    if self.parsed.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = self._vllm_prompt_logprobs(outputs[prompt_index])
                    choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return self._envelope(choices, chunk=False, usage=self.usage(outputs))

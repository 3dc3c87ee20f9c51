"""OpenAI response bodies: completions and chat, whole or as stream chunks, with usage and logprobs.

The engine reports cumulative text and token ids per sample; :class:`ResponseBuilder` keeps how
much of each choice it has sent, so a stream chunk carries only the new part. Choice index is
``prompt_index * n + sample_index``, as OpenAI numbers them.
"""

from __future__ import annotations

import functools
import json
import re
import time

from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.server.protocol import ParsedRequest

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
        k = self.parsed.params[0].logprobs or 0
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in zip(ids, entries):
            token = self._token_text(token_id)
            tokens.append(token)
            token_logprobs.append(entry.get(token_id, 0.0))
            # vLLM's shape: the top k plus the sampled token.
            top = dict(sorted(entry.items(), key=lambda kv: -kv[1])[:k])
            top.setdefault(token_id, entry.get(token_id, 0.0))
            top_logprobs.append({self._token_text(t): lp for t, lp in top.items()})
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _prompt_text(self, prompt_index: int) -> str:
        prompt = self.parsed.prompts[prompt_index]
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

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
            logprobs = self._logprobs(sample, token_start, token_end, text_start) if new_tokens else None
            if sample.finish_reason:
                self._finished.add(index)
            if self.is_chat:
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
            self._role_sent.add(index)
            events.append(sse(self._envelope([choice], chunk=True)))
        return events

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
                logprobs = self._logprobs(sample, 0, None, 0)
                if self.is_chat:
                    choices.append({"index": index, "message": {"role": "assistant", "content": sample.text},
                                    "logprobs": logprobs, "finish_reason": sample.finish_reason})
                else:
                    text = (self._prompt_text(prompt_index) if self.parsed.echo else "") + sample.text
                    choices.append({"index": index, "text": text, "logprobs": logprobs,
                                    "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason})
        choices.sort(key=lambda c: c["index"])
        return self._envelope(choices, chunk=False, usage=self.usage(outputs))

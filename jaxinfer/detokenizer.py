"""Incremental detokenization and stop strings, one per generated sample.

Text grows token by token. A stop string may span token boundaries, so every new piece
of text is searched together with the tail of what came before; the stop string itself
is cut from the output unless the request asks to keep it. For streaming, the last
``longest stop - 1`` characters are held back until they cannot start a stop string.
"""

from __future__ import annotations

from typing import Sequence

from jaxinfer.tokenizer import Tokenizer


class Detokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.token_ids: list[int] = []
        self.text = ""  # the output text so far (stop string cut once found)
        self.stopped_by: str | None = None
        self._num_streamed = 0
        self._hold_back = max((len(s) for s in self.stop), default=1) - 1

    def add_token(self, token_id: int) -> str | None:
        """Append a token; returns the stop string if one now appears in the text."""
        if self.stopped_by is not None:
            return self.stopped_by
        self.token_ids.append(token_id)
        previous_len = len(self.text)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        # A partial UTF-8 sequence decodes to U+FFFD; wait for the rest before exposing it.
        self.text = full
        if not self.stop:
            return None
        search_from = max(0, previous_len - self._hold_back)
        best = None
        for s in self.stop:
            i = full.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = full[: i + len(s)] if self.include_stop_str_in_output else full[:i]
        self.stopped_by = s
        return s

    def stream_delta(self, finished: bool) -> str:
        """Text not yet streamed that is safe to show (all of it once finished)."""
        end = len(self.text)
        if not finished and self.stopped_by is None:
            end = max(self._num_streamed, end - self._hold_back)
            if self.text[end - 1 : end] == "\ufffd":  # an incomplete multi-byte character
                end -= 1
        delta = self.text[self._num_streamed : end]
        self._num_streamed = max(self._num_streamed, end)
        return delta

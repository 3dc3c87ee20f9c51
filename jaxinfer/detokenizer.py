"""Incremental detokenization and stop strings, one per generated sample.

Text grows token by token through ``tokenizers``' ``DecodeStream``, which decodes only a
short window around the new token (O(1) per token, not a decode of the whole output)
and holds back a token until its bytes form complete characters. A stop string may
span token boundaries, so every new piece of text is searched together with the tail of
what came before; the stop string itself is cut from the output unless the request asks
to keep it. What consumers see (``visible_text``) holds back the last ``longest stop - 1``
characters of an unfinished sample, which a later token could turn into a stop string and
cut: so the text a stream shows only ever grows, and ends as the final text.

A sample that ends inside a character (its last tokens hold the first bytes of a multi-byte
character) keeps those bytes: ``finish`` appends their lossy decoding (U+FFFD), as
``tokenizer.decode`` of the whole output would, instead of dropping them, and a stop string
that this tail completes is cut like any other.

A sample that needs no text until it ends (``defer=True``: a request that asked for its final
output only, with no stop strings to search for) only records its tokens, and feeds them through
the same ``DecodeStream`` when its text is first read: the same calls in the same order, so the
same text, without a Python call per token on the engine's step (at 1000 running sequences
that call was a tenth of the host's work per step).
"""

from __future__ import annotations

from typing import Sequence

from tokenizers.decoders import DecodeStream

from jaxinfer.tokenizer import Tokenizer


class Detokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        defer: bool = False,
        token_source: list[int] | None = None,
    ):
        """``defer``: with no stop strings, feed tokens to the stream only when the text is read.
        ``token_source`` (with ``defer``, no stop strings): the list the caller appends the
        sample's tokens to, read from when the text is; ``add_token`` is then not called."""
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._text = ""  # the output text so far (stop string cut once found)
        self.stopped_by: str | None = None
        self.skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # tokens since the last piece of text (an unfinished character)
        self._hold_back = max((len(s) for s in self.stop), default=1) - 1
        # Deferred tokens (those from _num_fed on are not yet fed to the stream); None when every
        # token is fed as it comes.
        self._deferred: list[int] | None = None
        if defer and not self.stop:
            self._deferred = token_source if token_source is not None else []
        elif token_source is not None:
            raise ValueError("token_source needs defer=True and no stop strings")
        self._num_fed = 0

    @property
    def text(self) -> str:
        """The output text so far (stop string cut once found)."""
        if self._deferred is not None and len(self._deferred) > self._num_fed:
            self._feed_deferred()
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text = value

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token; returns the stop string if one now appears in the text.

        ``check_stop=False`` (before ``min_tokens`` outputs, as in vLLM) only extends the text:
        a stop string wholly inside that text never stops the sample later either.
        """
        if self._deferred is not None:  # no stop strings: nothing to find, the text can wait
            self._deferred.append(token_id)
            return None
        if self.stopped_by is not None:
            return self.stopped_by
        piece = self._stream.step(self.tokenizer.tokenizer, token_id)
        if not piece:  # an incomplete character (or a skipped special token): nothing new yet
            self._pending.append(token_id)
            return None
        self._pending.clear()
        previous_len = len(self._text)
        self._text += piece
        return self._cut_at_stop(previous_len) if check_stop else None

    def finish(self, check_stop: bool = True) -> str | None:
        """The sample ended: add the lossy text of trailing bytes that never formed a character.

        Returns the stop string if that tail completes one (the text is then cut there too,
        so no stop string ever reaches the final text)."""
        if self._deferred is not None and len(self._deferred) > self._num_fed:
            self._feed_deferred()
        pending, self._pending = self._pending, []
        if not pending or self.stopped_by is not None:
            return None
        previous_len = len(self._text)
        self._text += self.tokenizer.tokenizer.decode(pending, skip_special_tokens=self.skip_special_tokens)
        return self._cut_at_stop(previous_len) if check_stop else None

    def _feed_deferred(self) -> None:
        """Feed the deferred tokens through the stream, as ``add_token`` would have one by one."""
        tokens = self._deferred[self._num_fed :]
        self._num_fed = len(self._deferred)
        stream, tokenizer, pending = self._stream, self.tokenizer.tokenizer, self._pending
        pieces = []
        for token_id in tokens:
            piece = stream.step(tokenizer, token_id)
            if piece:
                pending.clear()
                pieces.append(piece)
            else:
                pending.append(token_id)
        self._text += "".join(pieces)

    def _cut_at_stop(self, previous_len: int) -> str | None:
        """Find the earliest stop string that ends in the text added after ``previous_len``."""
        if not self.stop:
            return None
        search_from = max(0, previous_len - self._hold_back)
        best = None
        for s in self.stop:
            i = self._text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self._text = self._text[: i + len(s)] if self.include_stop_str_in_output else self._text[:i]
        self.stopped_by = s
        return s

    def visible_text(self, finished: bool) -> str:
        """The text to show now: all of it once the sample is finished or stopped, else without
        the tail that could still become the start of a stop string."""
        if finished or self.stopped_by is not None or not self._hold_back:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold_back)]

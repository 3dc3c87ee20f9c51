"""One grammar matcher per constrained sequence, advanced token by token; the step's bitmask.

The engine owns one :class:`GrammarMatchers`. A constrained sequence enters with the future of
its grammar (``compiler.py``) and waits here, outside the scheduler, until it is compiled
(:meth:`take_ready`); it then gets its own copy of the template matcher. Each sampled token of
the sequence is consumed once (:meth:`advance`), in order, and before every step that samples
for it the matcher's mask of allowed next tokens fills the sequence's row of the step's bitmask
(:meth:`fill_bitmask`, on llguidance's own threads: ``LLExecutor``).

A matcher that has reached the end of its grammar allows only end-of-sequence tokens, and one
that consumed an end-of-sequence token is done: the engine finishes the sequence ("stop"),
``ignore_eos`` or not, since no further token could be valid.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Iterable

import numpy as np

from jaxinfer.sequence import Sequence
if TYPE_CHECKING:
    import llguidance

from jaxinfer.structured_output.bitmask import ALL_ALLOWED, BITS_PER_WORD, bitmask_width, ids_below, set_only


class GrammarMatchers:
    def __init__(self, tokenizer_vocab_size: int, model_vocab_size: int, eos_ids: Iterable[int]):
        self.model_vocab_size = model_vocab_size
        self.eos_ids = frozenset(eos_ids)
        self._eos_in_vocab = sorted(i for i in self.eos_ids if i < tokenizer_vocab_size)
        real_ids = ids_below(tokenizer_vocab_size, model_vocab_size)  # [W]: the tokenizer's ids set
        boundary = tokenizer_vocab_size // BITS_PER_WORD
        # (word, its bits of real ids) when the last real id and padded ids share a word
        self._boundary_word = (boundary, real_ids[boundary]) if tokenizer_vocab_size % BITS_PER_WORD else None
        self._executor = None  # llguidance's thread pool, made at the first fill
        self._waiting: dict[int, tuple[Sequence, concurrent.futures.Future]] = {}
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._done: set[int] = set()  # sequences whose matcher consumed an end-of-sequence token

    def add(self, seq: Sequence, template: concurrent.futures.Future) -> None:
        """Hold ``seq`` until ``template`` (a future ``LLMatcher``) is compiled."""
        self._waiting[seq.seq_id] = (seq, template)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_constrained(self) -> int:
        """Sequences with a matcher (their grammar compiled): none, and the per-row checks are skipped."""
        return len(self._matchers)

    def is_waiting(self, seq: Sequence) -> bool:
        return seq.seq_id in self._waiting

    def take_ready(self) -> list[tuple[Sequence, BaseException | None]]:
        """The waiting sequences whose grammar is compiled (now with a matcher each) or failed (with the error)."""
        ready = []
        for seq_id, (seq, template) in list(self._waiting.items()):
            if not template.done():
                continue
            del self._waiting[seq_id]
            error = template.exception()
            if error is None:
                self._matchers[seq_id] = template.result().deep_copy()
            ready.append((seq, error))
        return ready

    def wait(self, timeout: float) -> None:
        """Block until a waiting grammar is compiled, or ``timeout`` seconds."""
        futures = [template for _, template in self._waiting.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def is_constrained(self, seq: Sequence) -> bool:
        return seq.seq_id in self._matchers

    def matcher_of(self, seq: Sequence) -> llguidance.LLMatcher | None:
        """``seq``'s matcher (None while its grammar compiles, or without one)."""
        return self._matchers.get(seq.seq_id)

    def drop(self, seq: Sequence) -> None:
        """Forget ``seq`` (finished or aborted), waiting or not."""
        self._waiting.pop(seq.seq_id, None)
        self._matchers.pop(seq.seq_id, None)
        self._done.discard(seq.seq_id)

    def advance(self, sampled: list[tuple[Sequence, int]], token_ids) -> None:
        """Consume each constrained sequence's sampled token (``token_ids[row]``), in row order.

        Called once per launched step. A matcher already done (it consumed EOS) ignores the
        samples still in flight after it: the engine drops them with the finished sequence.
        """
        if not self._matchers:
            return
        for seq, row in sampled:
            matcher = self._matchers.get(seq.seq_id)
            if matcher is None or seq.is_finished or self._is_done(seq.seq_id, matcher):
                continue
            token = int(token_ids[row])
            matcher.consume_token(token)
            if token in self.eos_ids:
                self._done.add(seq.seq_id)

    def is_done(self, seq: Sequence) -> bool:
        """Whether ``seq``'s grammar consumed an end-of-sequence token (or failed): nothing may follow."""
        matcher = self._matchers.get(seq.seq_id)
        return matcher is not None and self._is_done(seq.seq_id, matcher)

    def _is_done(self, seq_id: int, matcher: llguidance.LLMatcher) -> bool:
        return seq_id in self._done or matcher.is_error()

    def fill_bitmask(self, sampled: list[tuple[Sequence, int]], num_rows: int) -> np.ndarray:
        """[num_rows, ceil(V / 32)] int32: each constrained row's allowed next tokens, every other row all ones."""
        bitmask = np.empty((num_rows, bitmask_width(self.model_vocab_size)), np.int32)
        to_fill, rows = [], []
        for seq, row in sampled:
            matcher = self._matchers.get(seq.seq_id)
            if matcher is None:
                continue
            rows.append(row)
            if self._is_done(seq.seq_id, matcher):
                # Its sample is dropped; any valid id does. EOS keeps the row's softmax finite.
                set_only(bitmask, row, self._eos_in_vocab)
            else:
                to_fill.append((matcher, row))
        # Only the unconstrained rows need setting: llguidance writes every word of the others
        # (at batch 256 and V = 128k, a 4 MB memset is most of a millisecond).
        unconstrained = np.ones(num_rows, bool)
        unconstrained[rows] = False
        bitmask[unconstrained] = ALL_ALLOWED
        if to_fill:
            import llguidance
            import llguidance.numpy as llguidance_numpy

            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance_numpy.fill_next_token_bitmask_par(self._executor, to_fill, bitmask)
        if rows and self._boundary_word is not None:
            # Padded ids past the tokenizer's never have a bit set by llguidance (they have no
            # bytes; tests/test_structured_output.py checks it), except possibly in the word
            # the tokenizer's last id shares with them: clear that one.
            word, keep = self._boundary_word
            bitmask[rows, word] &= keep
        return bitmask

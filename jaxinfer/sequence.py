"""Sequence: the host-side state of one sample of a request.

A request with ``n`` samples becomes ``n`` sequences that share a ``request_id`` (and, through
the prefix cache, the pages of their common prompt). A sequence's life:

1. WAITING in the scheduler's queue, ``num_computed_tokens == 0``.
2. RUNNING once the scheduler admits it: the allocator attaches the cached pages of its longest
   known prefix (``num_cached_tokens``) and fresh pages for the first chunk. Each step computes
   the K/V of ``num_new_tokens`` more tokens; the step whose chunk reaches the end of the known
   tokens samples one new token, which the engine appends.
3. Preempted (back to WAITING, pages freed, ``num_computed_tokens = 0``) when pages run out; it
   later recomputes prompt + generated tokens as a prefill and carries on where it stopped.
4. FINISHED (stop, length, abort): pages freed.

Async scheduling: the host prepares step n+1 before step n's sampled tokens reach it, so the
engine appends ``PLACEHOLDER_TOKEN`` for a token still on the device and fills it in with
``set_token`` a step later. The runner feeds the device-side sampled token wherever the host
copy is a placeholder; the allocator never hashes a page that holds one.
"""

from __future__ import annotations

import enum
import time
from typing import Any

PLACEHOLDER_TOKEN = -1  # a sampled token that is still on the device


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: Any = None,
        arrival_time: float | None = None,
        max_tokens: int | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError(f"sequence {seq_id} of request {request_id!r} has an empty prompt")
        if PLACEHOLDER_TOKEN in prompt_token_ids:
            raise ValueError(f"prompt token ids must be known; got {PLACEHOLDER_TOKEN}")
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"sequence {seq_id}: max_tokens must be >= 0 or None, got {max_tokens}")
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + generated
        self.num_prompt_tokens = len(prompt_token_ids)
        # Opaque to the scheduler and allocator: the engine's SequenceSampling (jaxinfer.sampling_params).
        self.sampling = sampling
        # Most tokens this sequence may generate (None: up to the context length). The engine
        # enforces it; the scheduler's admission reads it to reserve pages for the growth.
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0  # tokens whose K/V are in this sequence's pages
        self.num_cached_tokens = 0  # prefix-cache hit at the latest admission (metrics)
        self.num_preemptions = 0
        # Physical page of each logical page. Only ever grown in place (``extend``) or replaced by
        # a new list, never shrunk or overwritten in place: the runner keeps each running
        # sequence's row of the page-table array between steps (``jaxinfer.page_table_rows``) and
        # writes only rows whose list was replaced or grew.
        self.page_table: list[int] = []
        # Owned by the allocator: chained hashes of leading full pages (a memo, a pure function
        # of the tokens, so it survives preemption) and how many leading pages of page_table
        # it has already offered to the prefix cache.
        self.page_hashes: list[bytes] = []
        self.num_registered_pages = 0
        # Set by the speculator before each schedule (jaxinfer.spec_decode): tokens proposed to
        # follow token_ids, verified by the next step. Never part of token_ids.
        self.draft_token_ids: list[int] = []
        # Drafts of this sequence's step in flight that may still be accepted (an asynchronous
        # verify step, docs/SPECULATIVE.md): the device may place its next tokens up to this many
        # positions past the host's count, so the scheduler allocates (and rollback keeps) as many
        # slots more.
        self.num_lookahead_slots = 0
        self._num_placeholders = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def has_placeholder(self) -> bool:
        return self._num_placeholders > 0

    @property
    def num_placeholders(self) -> int:
        return self._num_placeholders

    @property
    def first_placeholder_index(self) -> int:
        """Index of the earliest placeholder: the oldest token still on the device (placeholders trail)."""
        if not self._num_placeholders:
            raise ValueError(f"sequence {self.seq_id} has no placeholder")
        return len(self.token_ids) - self._num_placeholders

    def append_token(self, token_id: int) -> None:
        """Append a sampled token, or ``PLACEHOLDER_TOKEN`` for one still on the device."""
        self.token_ids.append(token_id)
        if token_id == PLACEHOLDER_TOKEN:
            self._num_placeholders += 1

    def append_placeholder(self) -> None:
        """Append ``PLACEHOLDER_TOKEN`` for a token being sampled on the device (``append_token``'s
        case at every launch, without its test)."""
        self.token_ids.append(PLACEHOLDER_TOKEN)
        self._num_placeholders += 1

    def set_token(self, index: int, token_id: int) -> None:
        """Fill in the placeholder at ``index`` once the device's sampled token arrives."""
        if self.token_ids[index] != PLACEHOLDER_TOKEN:
            raise ValueError(f"token {index} of sequence {self.seq_id} is not a placeholder")
        if token_id == PLACEHOLDER_TOKEN:
            raise ValueError("cannot fill a placeholder with a placeholder")
        self.token_ids[index] = token_id
        self._num_placeholders -= 1

    def fill_next_token(self, token_id: int) -> None:
        """Fill the earliest placeholder with a sampled token or, with none left (the later tokens
        of a verify step's accepted run), append it. The output processor's call for every token."""
        if token_id < 0:
            raise ValueError(f"sampled token ids are >= 0, got {token_id}")
        num_placeholders = self._num_placeholders
        if num_placeholders:  # placeholders trail: the earliest is num_placeholders from the end
            self.token_ids[-num_placeholders] = token_id
            self._num_placeholders = num_placeholders - 1
        else:
            self.token_ids.append(token_id)

    def insert_placeholders(self, index: int, count: int) -> None:
        """Insert ``count`` placeholders before ``index``: the accepted drafts of an asynchronous
        verify step, which come before the placeholder of the step after it."""
        if count < 0 or not 0 < index <= len(self.token_ids) or self.token_ids[index - 1] != PLACEHOLDER_TOKEN:
            raise ValueError(f"placeholders go right after a placeholder; got index {index}, count {count}")
        self.token_ids[index:index] = [PLACEHOLDER_TOKEN] * count
        self._num_placeholders += count

    def drop_placeholders(self) -> None:
        """Remove trailing placeholders (samples in flight for a finished sequence)."""
        # The prompt holds no placeholders, so this never pops into it.
        while self.token_ids[-1] == PLACEHOLDER_TOKEN:
            self.token_ids.pop()
            self._num_placeholders -= 1

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_prompt_tokens={self.num_prompt_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, pages={len(self.page_table)})"
        )

"""StepBatch: the explicit metadata of one forward step over a ragged token batch.

Everything the forward needs to know about the step travels in this pytree (no module
globals): the packed tokens of all sequences, their positions, and where each sequence's
queries and pages are. Shapes are padded to buckets by the runner; padded sequence slots
have zero query and KV length, padded token rows lie past ``cu_q_lens[-1]``.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    token_ids: jax.Array  # [T] int32: the new tokens of every sequence, one sequence after another
    positions: jax.Array  # [T] int32: each token's position in its sequence (RoPE)
    cu_q_lens: jax.Array  # [B + 1] int32: sequence b's tokens are rows cu_q_lens[b]:cu_q_lens[b+1]
    kv_lens: jax.Array  # [B] int32: tokens of sequence b in the cache after this step
    page_tables: jax.Array  # [B, pages_per_seq] int32: physical page of each logical page
    logits_indices: jax.Array  # [B] int32: row whose logits sequence b samples from (its last token)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.shape[0]


def build_step_batch(
    chunks: list[tuple[list[int], int, list[int]]],
    *,
    num_tokens: int,
    num_seqs: int,
    pages_per_seq: int,
    padding_page: int = 0,
) -> StepBatch:
    """Pack ``(new_token_ids, start_position, page_table)`` per sequence into numpy arrays.

    ``num_tokens``/``num_seqs``/``pages_per_seq`` are the padded (bucket) sizes. Unused page
    table entries point at ``padding_page``; kernels never read past a sequence's length.
    """
    if len(chunks) > num_seqs:
        raise ValueError(f"{len(chunks)} sequences exceed the batch bucket of {num_seqs}")
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    cu_q_lens = np.zeros(num_seqs + 1, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    page_tables = np.full((num_seqs, pages_per_seq), padding_page, np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    n = len(chunks)
    if n == 0:
        return StepBatch(token_ids, positions, cu_q_lens, kv_lens, page_tables, logits_indices)
    # Whole-batch array operations rather than a loop of small ones: this runs every step.
    q_lens = np.fromiter((len(c[0]) for c in chunks), np.int32, n)
    starts = np.fromiter((c[1] for c in chunks), np.int32, n)
    num_pages = np.fromiter((len(c[2]) for c in chunks), np.int32, n)
    ends = np.cumsum(q_lens, dtype=np.int32)
    total = int(ends[-1])
    if total > num_tokens:
        raise ValueError(f"{total} tokens exceed the token bucket of {num_tokens}")
    if int(num_pages.max()) > pages_per_seq:
        b = int(num_pages.argmax())
        raise ValueError(f"sequence {b} needs {int(num_pages[b])} pages; the page table holds {pages_per_seq}")
    token_ids[:total] = np.fromiter(itertools.chain.from_iterable(c[0] for c in chunks), np.int32, total)
    first_row = ends - q_lens
    positions[:total] = np.arange(total, dtype=np.int32) + np.repeat(starts - first_row, q_lens)
    kv_lens[:n] = starts + q_lens
    logits_indices[:n] = ends - 1
    cu_q_lens[1 : n + 1] = ends
    cu_q_lens[n + 1 :] = total
    total_pages = int(num_pages.sum())
    rows = np.repeat(np.arange(n), num_pages)
    columns = np.arange(total_pages) - np.repeat(np.cumsum(num_pages) - num_pages, num_pages)
    page_tables[rows, columns] = np.fromiter(itertools.chain.from_iterable(c[2] for c in chunks), np.int32, total_pages)
    return StepBatch(token_ids, positions, cu_q_lens, kv_lens, page_tables, logits_indices)

"""StepBatch: the explicit metadata of one forward step over a ragged token batch.

Everything the forward needs to know about the step travels in this pytree (no module
globals): the packed tokens of all sequences, their positions, and where each sequence's
queries and pages are. Shapes are padded to buckets by the runner; padded sequence slots
have zero query and KV length, padded token rows lie past ``cu_q_lens[-1]``.
"""

from __future__ import annotations

import dataclasses

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
    row = 0
    for b, (new_tokens, start, pages) in enumerate(chunks):
        n = len(new_tokens)
        if row + n > num_tokens:
            raise ValueError(f"{row + n} tokens exceed the token bucket of {num_tokens}")
        if len(pages) > pages_per_seq:
            raise ValueError(f"sequence {b} needs {len(pages)} pages; the page table holds {pages_per_seq}")
        token_ids[row : row + n] = new_tokens
        positions[row : row + n] = np.arange(start, start + n)
        kv_lens[b] = start + n
        page_tables[b, : len(pages)] = pages
        logits_indices[b] = row + n - 1
        row += n
        cu_q_lens[b + 1] = row
    cu_q_lens[len(chunks) + 1 :] = row
    return StepBatch(token_ids, positions, cu_q_lens, kv_lens, page_tables, logits_indices)

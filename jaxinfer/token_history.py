"""Token pages: the token id held at every KV slot, on the device, for the sampling penalties.

Repetition, presence and frequency penalties need each sequence's prompt and output tokens.
Rather than send that history from the host every step (``[batch, context]`` ids: hundreds
of MB at long contexts), the runner keeps a ``[num_pages, page_size]`` int32 array beside
the KV cache. Each step writes its input tokens to the slots their K/V go to, through the
same page tables, so shared prefix pages, chunked prefill and preemption need nothing
extra; a step that applies penalties gathers each row's history through its page table.
The previous step's sampled token is written on the device before it is read, so
penalties also run under async scheduling without waiting for the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.batch import StepBatch
from pallas_kernels.paged_attention.reference import token_positions


def write_tokens(token_pages: jax.Array, token_ids: jax.Array, batch: StepBatch) -> jax.Array:
    """Store the step's input tokens [T] at their slots of ``token_pages`` [P, S]; padding is dropped."""
    num_pages, page_size = token_pages.shape
    num_tokens = token_ids.shape[0]
    seq, position = token_positions(batch.cu_q_lens, batch.kv_lens, num_tokens)
    safe_seq = jnp.minimum(seq, batch.page_tables.shape[0] - 1)
    safe_position = jnp.maximum(position, 0)
    page = batch.page_tables[safe_seq, safe_position // page_size]
    slot = page * page_size + safe_position % page_size
    # Padding rows get distinct out-of-range slots: dropped, and the indices stay unique.
    slot = jnp.where(position >= 0, slot, num_pages * page_size + jnp.arange(num_tokens, dtype=slot.dtype))
    flat = token_pages.reshape(-1).at[slot].set(token_ids, mode="drop", unique_indices=True)
    return flat.reshape(token_pages.shape)


def gather_history(
    token_pages: jax.Array, page_tables: jax.Array, kv_lens: jax.Array, num_prompt_tokens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Each row's tokens so far, through its page table: ids [B, L] (-1 past the end) and is-output [B, L].

    ``L = pages_per_seq * page_size``; a row's history is its first ``kv_lens[b]`` slots
    (this step's input tokens included), outputs being those at or past ``num_prompt_tokens[b]``.
    """
    num_seqs, pages_per_seq = page_tables.shape
    page_size = token_pages.shape[1]
    history = token_pages[page_tables].reshape(num_seqs, pages_per_seq * page_size)  # [B, L]
    index = jnp.arange(pages_per_seq * page_size, dtype=jnp.int32)[None, :]
    valid = index < kv_lens[:, None]
    return jnp.where(valid, history, -1), valid & (index >= num_prompt_tokens[:, None])

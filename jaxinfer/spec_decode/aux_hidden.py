"""Auxiliary hidden states: the target's features an EAGLE-3 head drafts from, kept per KV slot.

An EAGLE-3 head (``jaxinfer.spec_decode.eagle3``) reads, for every token it catches up on, the
target's residual stream entering three of its layers. The target computes them in its own
step, the head needs them later (at the next drafting round, or several rounds later for a
prompt prefilled in chunks), so the runner keeps them on the device beside the KV cache: an
``aux_pages`` array ``[num_pages, page_size, W]`` (``W = 3 * hidden_size``) written through the
same page tables as the K/V, exactly as ``jaxinfer.token_history`` keeps token ids. So chunked
prefill, prefix-cached pages (written by the sequence that computed them, for the same tokens
at the same positions), rollback (slots past a sequence's length are overwritten later) and
preemption need nothing extra, and no host copy is ever made.

Memory: ``W`` values per token in the model's dtype: 24 KiB a token for Llama-3.1-8B in
bfloat16, beside its 128 KiB of K/V (allocated after the pool is sized: leave it room).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.batch import StepBatch
from pallas_kernels.paged_attention.reference import token_positions


def create_aux_pages(num_pages: int, page_size: int, width: int, dtype) -> jax.Array:
    """A zeroed ``[num_pages, page_size, width]`` store, made by a jitted function like the cache."""
    return jax.jit(lambda: jnp.zeros((num_pages, page_size, width), dtype))()


def _token_slots(batch: StepBatch, num_pages: int, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Each token row's flat slot (page * page_size + offset) and whether the row is a real token."""
    num_tokens = batch.token_ids.shape[0]
    seq, position = token_positions(batch.cu_q_lens, batch.kv_lens, num_tokens)
    is_real = position >= 0
    safe_seq = jnp.minimum(seq, batch.page_tables.shape[0] - 1)
    safe_position = jnp.maximum(position, 0)
    page = batch.page_tables[safe_seq, safe_position // page_size]
    return page * page_size + safe_position % page_size, is_real


def write_aux_hidden(aux_pages: jax.Array, aux: jax.Array, batch: StepBatch) -> jax.Array:
    """Store the step's auxiliary hidden states ``aux`` [T, W] at their tokens' slots; padding is dropped."""
    num_pages, page_size, width = aux_pages.shape
    slot, is_real = _token_slots(batch, num_pages, page_size)
    # Padding rows get distinct out-of-range slots: dropped, and the indices stay unique.
    slot = jnp.where(is_real, slot, num_pages * page_size + jnp.arange(slot.shape[0], dtype=slot.dtype))
    flat = aux_pages.reshape(num_pages * page_size, width)
    return flat.at[slot].set(aux.astype(aux_pages.dtype), mode="drop", unique_indices=True).reshape(aux_pages.shape)


def gather_aux_hidden(aux_pages: jax.Array, batch: StepBatch) -> jax.Array:
    """The stored auxiliary hidden states [T, W] of the tokens of ``batch`` (zeros for padding rows)."""
    num_pages, page_size, width = aux_pages.shape
    slot, is_real = _token_slots(batch, num_pages, page_size)
    rows = aux_pages.reshape(num_pages * page_size, width)[slot]  # [T, W]
    return jnp.where(is_real[:, None], rows, jnp.zeros_like(rows))

"""Plain-JAX ragged paged attention: the oracle for every kernel (the engine's CPU path is `cpu.py`).

Cache layout (owned by this package, shared by every backend and by the model)
------------------------------------------------------------------------------
One pair of arrays per layer::

    k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim]

A page holds ``page_size`` consecutive tokens of one sequence for one KV head, stored
contiguously (``page_size * head_dim`` elements), so a kernel serving one KV head reads
each page as one contiguous tile. Sequence ``b``'s token at position ``p`` lives in page
``page_tables[b, p // page_size]`` at row ``p % page_size``. Page tables map logical pages
to physical ones, as an OS maps virtual memory; two sequences sharing a prefix point at
the same physical pages. Splitting the cache across devices splits axis 0 (KV heads).
Pages hold K/V values in their dtype, except ``uint8`` pages, which hold ``float8_e4m3fn``
bit patterns (how a CPU keeps FP8 pages: ``page_storage.py`` says why).

Ragged batch
------------
The query tokens of all sequences are packed one sequence after another::

    q:          [num_tokens, num_q_heads, head_dim]
    k_new/v_new:[num_tokens, num_kv_heads, head_dim]   this step's keys and values
    cu_q_lens:  [max_num_seqs + 1] int32   queries of sequence b: q[cu_q_lens[b]:cu_q_lens[b+1]]
    kv_lens:    [max_num_seqs] int32       tokens of sequence b in the cache *after* this step
    page_tables:[max_num_seqs, pages_per_seq] int32

Sequence ``b`` has ``q_len = cu_q_lens[b+1] - cu_q_lens[b]`` new tokens at positions
``kv_lens[b] - q_len .. kv_lens[b] - 1``: a decode step has ``q_len == 1``, a prefill chunk
continuing a cached prefix has ``q_len > 1`` and ``kv_lens[b] > q_len``. Attention is causal
inside each sequence. Padded sequence slots have ``q_len == 0`` and ``kv_len == 0`` and cost
nothing; token rows past ``cu_q_lens[-1]`` are padding: their output is zero and their K/V
are not written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.page_storage import page_values, to_page_storage
from pallas_kernels.precision import matmul_precision


def token_sequence_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Index of the sequence each packed token belongs to; padding tokens get ``num_seqs``."""
    token_index = jnp.arange(num_tokens, dtype=jnp.int32)
    # searchsorted(side="right") - 1 picks the last sequence whose start is <= the token.
    # compare_all: one [tokens, seqs] comparison, no loop. The default method is a loop, which
    # XLA:GPU runs as host-launched iterations inside every step program (session 4's H200
    # traces show two while loops a step, ~0.2 ms of host time each: most likely these two).
    seq = jnp.searchsorted(cu_q_lens, token_index, side="right", method="compare_all").astype(jnp.int32) - 1
    num_seqs = cu_q_lens.shape[0] - 1
    return jnp.where(token_index < cu_q_lens[-1], seq, num_seqs)


def token_positions(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(sequence id, position in its sequence) of each packed token; padding gets position -1."""
    seq = token_sequence_ids(cu_q_lens, num_tokens)
    safe_seq = jnp.minimum(seq, kv_lens.shape[0] - 1)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    offset_in_chunk = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[safe_seq]
    position = kv_lens[safe_seq] - q_lens[safe_seq] + offset_in_chunk
    is_padding = seq >= kv_lens.shape[0]
    return seq, jnp.where(is_padding, -1, position)


def kv_slots(page_tables: jax.Array, cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int, num_pages: int,
             page_size: int) -> jax.Array:
    """Each packed token's row in the flattened pages (``page * page_size + offset``), [T] int32.

    A padding token gets a row past the pool (``num_pages * page_size`` + its index), so writes
    drop it; each its own, so every slot is distinct (a scatter may promise unique indices: on
    the GPU, no atomics or serialisation)."""
    seq, position = token_positions(cu_q_lens, kv_lens, num_tokens)
    safe_seq = jnp.minimum(seq, page_tables.shape[0] - 1)
    safe_position = jnp.maximum(position, 0)
    page = page_tables[safe_seq, safe_position // page_size]
    slot = page * page_size + safe_position % page_size
    out_of_range = num_pages * page_size + jnp.arange(num_tokens, dtype=slot.dtype)
    return jnp.where(position >= 0, slot, out_of_range).astype(jnp.int32)


def write_kv_reference(
    k_new: jax.Array,
    v_new: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's K/V into their pages; padding tokens are dropped."""
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    slot = kv_slots(page_tables, cu_q_lens, kv_lens, k_new.shape[0], num_pages, page_size)
    return scatter_rows(k_pages, k_new, slot), scatter_rows(v_pages, v_new, slot)


def scatter_rows(pages: jax.Array, new: jax.Array, slot: jax.Array) -> jax.Array:
    """``new`` [T, Hkv, D] stored at rows ``slot`` [T] (``kv_slots``) of ``pages`` [Hkv, P, page, D]."""
    num_kv_heads, num_pages, page_size, head_dim = pages.shape
    flat = pages.reshape(num_kv_heads, num_pages * page_size, head_dim)
    new = to_page_storage(new.swapaxes(0, 1), pages.dtype)  # [Hkv, T, D]
    flat = flat.at[:, slot].set(new, mode="drop", unique_indices=True)
    return flat.reshape(pages.shape)


def attend_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    tokens_per_chunk: int = 32,
) -> jax.Array:
    """Causal attention of packed queries over their sequences' pages (already written).

    Tokens are processed ``tokens_per_chunk`` at a time (``lax.map``), each gathering its
    own sequence's pages, so memory stays bounded by chunk x context, not tokens x context.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    max_kv_len = page_tables.shape[1] * page_size
    seq, position = token_positions(cu_q_lens, kv_lens, num_tokens)
    safe_seq = jnp.minimum(seq, page_tables.shape[0] - 1)
    kv_position = jnp.arange(max_kv_len, dtype=jnp.int32)
    # From q's dtype, not the float32 the operands are cast to: bfloat16 attention keeps JAX's default.
    precision = matmul_precision(q.dtype)

    def one_token(args):
        q_t, seq_t, position_t = args  # [Hq, D], (), ()
        pages = page_tables[seq_t]  # [pages_per_seq]
        k = page_values(k_pages[:, pages]).reshape(num_kv_heads, max_kv_len, head_dim).astype(jnp.float32)
        v = page_values(v_pages[:, pages]).reshape(num_kv_heads, max_kv_len, head_dim).astype(jnp.float32)
        qg = q_t.reshape(num_kv_heads, group, head_dim).astype(jnp.float32)
        scores = jnp.einsum("hgd,hld->hgl", qg, k, precision=precision) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        visible = kv_position <= position_t  # padding (position -1) sees nothing
        if sliding_window is not None:
            visible &= kv_position > position_t - sliding_window
        scores = jnp.where(visible, scores, -jnp.inf)
        row_max = jnp.max(scores, axis=-1, keepdims=True)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        weights = jnp.exp(scores - row_max)  # masked entries are exactly 0
        denom = jnp.sum(weights, axis=-1, keepdims=True)
        # where(), not multiplication by a zero weight: NaN in unused pages must not leak.
        v = jnp.where(visible[None, :, None], v, 0.0)
        out = jnp.einsum("hgl,hld->hgd", weights, v, precision=precision) / jnp.where(denom > 0, denom, 1.0)
        return out.reshape(num_q_heads, head_dim).astype(q.dtype)

    return jax.lax.map(one_token, (q, safe_seq, position), batch_size=min(tokens_per_chunk, num_tokens))


def ragged_paged_attention_reference(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write this step's K/V into the paged cache, then attend. Returns (out, k_pages, v_pages).

    Shapes are in the module docstring. ``out`` has ``q``'s shape and dtype; rows of
    padding tokens are zero. Materialises every sequence's full page range, so it is
    the oracle, not a fast path (the CPU runs ``cpu.py``, whose work follows each token's context).
    """
    k_pages, v_pages = write_kv_reference(k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
    out = attend_reference(
        q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )
    return out, k_pages, v_pages

"""Ragged paged attention for the CPU: the reference's contract, work bounded by each token's context.

The reference gathers every token's whole page-table row (the step's page bucket, up to
max_model_len positions) and attends over all of it, padding tokens included: on a 2-core
CPU, a batch-1 decode of SmolLM2-135M at a 20-token context spent ~40% of its step there,
gathering 16 padded tokens x 1024 positions of K and V (~0.75 GB) a step for 20 positions of real context. Here each token walks its own
pages in chunks of ``chunk_len`` positions with an online softmax, in a loop whose trip count
is its own ``position // chunk_len + 1`` (padding tokens: none), so the work follows the
context actually cached, not the bucket. A ``while`` loop with a data-dependent trip count
costs a CPU nothing more than any other op; on a GPU it would sync with the host, which is
why only the CPU takes this path (``jaxinfer.attention.resolve_impl``).

The result equals the reference's up to float reassociation (the softmax is accumulated
chunk by chunk); the K/V write is the reference's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.page_storage import page_values
from pallas_kernels.paged_attention.reference import token_positions, write_kv_reference
from pallas_kernels.precision import matmul_precision


def attend_chunked(
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
    chunk_len: int = 128,
    tokens_per_block: int = 8,
) -> jax.Array:
    """Causal attention of packed queries over their sequences' pages (already written).

    Tokens run ``tokens_per_block`` at a time (``lax.map``, vmapped inside a block), so a
    block loops as long as its longest context and a block of padding not at all.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    pages_per_chunk = max(1, chunk_len // page_size)
    chunk_len = pages_per_chunk * page_size
    # Pad the page tables to whole chunks so that a chunk's dynamic slice never clamps.
    num_chunks = -(-page_tables.shape[1] // pages_per_chunk)
    page_tables = jnp.pad(page_tables, ((0, 0), (0, num_chunks * pages_per_chunk - page_tables.shape[1])))
    seq, position = token_positions(cu_q_lens, kv_lens, num_tokens)
    safe_seq = jnp.minimum(seq, page_tables.shape[0] - 1)
    chunk_position = jnp.arange(chunk_len, dtype=jnp.int32)
    precision = matmul_precision(q.dtype)  # from the operands' dtype, as the reference does

    def one_token(args):
        q_t, seq_t, position_t = args  # [Hq, D], (), ()
        qg = q_t.reshape(num_kv_heads, group, head_dim).astype(jnp.float32)
        table = page_tables[seq_t]  # [pages_per_seq]

        def chunk(c, carry):
            row_max, denom, acc = carry  # [Hkv, G, 1], [Hkv, G, 1], [Hkv, G, D]
            pages = jax.lax.dynamic_slice_in_dim(table, c * pages_per_chunk, pages_per_chunk)
            # Bit pages (FP8 on a CPU) are bitcast here, a chunk at a time, never as a whole pool.
            k = page_values(k_pages[:, pages]).reshape(num_kv_heads, chunk_len, head_dim).astype(jnp.float32)
            v = page_values(v_pages[:, pages]).reshape(num_kv_heads, chunk_len, head_dim).astype(jnp.float32)
            scores = jnp.einsum("hgd,hld->hgl", qg, k, precision=precision) * sm_scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            kv_position = c * chunk_len + chunk_position
            visible = kv_position <= position_t
            if sliding_window is not None:
                visible &= kv_position > position_t - sliding_window
            scores = jnp.where(visible, scores, -jnp.inf)
            new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1, keepdims=True))
            safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
            weights = jnp.exp(scores - safe_max)  # masked entries are exactly 0
            rescale = jnp.exp(row_max - safe_max)  # 0 while nothing was visible (row_max = -inf)
            # where(), not multiplication by a zero weight: NaN in unused pages must not leak.
            v = jnp.where(visible[None, :, None], v, 0.0)
            denom = denom * rescale + jnp.sum(weights, axis=-1, keepdims=True)
            acc = acc * rescale + jnp.einsum("hgl,hld->hgd", weights, v, precision=precision)
            return new_max, denom, acc

        init = (jnp.full((num_kv_heads, group, 1), -jnp.inf, jnp.float32),
                jnp.zeros((num_kv_heads, group, 1), jnp.float32),
                jnp.zeros((num_kv_heads, group, head_dim), jnp.float32))
        # Chunks past the token's position see nothing; padding (position -1) runs none.
        _, denom, acc = jax.lax.fori_loop(0, (position_t + chunk_len) // chunk_len, chunk, init)
        out = acc / jnp.where(denom > 0, denom, 1.0)
        return out.reshape(num_q_heads, head_dim).astype(q.dtype)

    # Whole blocks in every program (padding rows have position -1 and loop zero times), so a
    # token's arithmetic has the same shapes whatever the step's bucket: the prompt scorer's
    # logprobs and the engine's agree exactly, as they do with the reference.
    num_padded = -(-num_tokens // tokens_per_block) * tokens_per_block
    pad = (0, num_padded - num_tokens)
    out = jax.lax.map(
        one_token,
        (jnp.pad(q, (pad, (0, 0), (0, 0))), jnp.pad(safe_seq, pad), jnp.pad(position, pad, constant_values=-1)),
        batch_size=tokens_per_block,
    )
    return out[:num_tokens]


def ragged_paged_attention_cpu(
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

    Same arguments and results as ``ragged_paged_attention_reference`` (shapes in its module).
    """
    k_pages, v_pages = write_kv_reference(k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
    out = attend_chunked(
        q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )
    return out, k_pages, v_pages

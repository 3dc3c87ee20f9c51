"""A step's new K and V written into their pages in one Pallas-Triton launch, in place.

``write_kv_reference`` is two XLA scatters, one per array (jax has no scatter of two arrays at
once), each its own launch: at batch 1 two launches a layer of ~2 us for a few rows, and at 4k
prefill rows 14 us for 16 MB of K/V (~2.3 TB/s read and written; H200, session 18 traces). Here one
program owns ``BLOCK_TOKENS`` tokens of one KV head: it loads their K and V rows (``head_dim``
contiguous elements each) and stores them at their slots (``reference.kv_slots``: padding tokens
point past the pool and are masked off), so K and V go in one launch. Same contract as
``write_kv_reference``: the pages are donated by the caller's jit and updated in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.page_storage import to_page_storage
from pallas_kernels.paged_attention.reference import kv_slots

BLOCK_TOKENS = 32  # 32 tokens x 128 x 2 bytes x (K + V) = 16 KB a program


def write_kv_gpu(k_new: jax.Array, v_new: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array,
                 cu_q_lens: jax.Array, kv_lens: jax.Array, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``write_kv_reference``'s result: ``k_new``/``v_new`` [T, Hkv, D] stored at their slots of
    ``k_pages``/``v_pages`` [Hkv, num_pages, page_size, D] (cast to the page dtype), padding dropped."""
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    num_tokens = k_new.shape[0]
    num_rows = num_pages * page_size
    slot = kv_slots(page_tables, cu_q_lens, kv_lens, num_tokens, num_pages, page_size)
    k_new, v_new = to_page_storage(k_new, k_pages.dtype), to_page_storage(v_new, v_pages.dtype)
    # Flattening the pages is a bitcast: row page * page_size + r is token r of that page.
    k_flat = k_pages.reshape(num_kv_heads, num_rows, head_dim)
    v_flat = v_pages.reshape(num_kv_heads, num_rows, head_dim)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))  # noqa: E731
    k_flat, v_flat = pl.pallas_call(
        functools.partial(_write_kernel, num_tokens=num_tokens, num_rows=num_rows),
        grid=(pl.cdiv(num_tokens, BLOCK_TOKENS), num_kv_heads),
        in_specs=[whole(slot.shape), whole(k_new.shape), whole(v_new.shape), whole(k_flat.shape),
                  whole(v_flat.shape)],
        out_specs=[whole(k_flat.shape), whole(v_flat.shape)],
        out_shape=[jax.ShapeDtypeStruct(k_flat.shape, k_flat.dtype), jax.ShapeDtypeStruct(v_flat.shape, v_flat.dtype)],
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="write_kv",
    )(slot, k_new, v_new, k_flat, v_flat)
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)


def _write_kernel(slot_ref, k_new_ref, v_new_ref, k_in_ref, v_in_ref, k_out_ref, v_out_ref, *, num_tokens: int,
                  num_rows: int):
    del k_in_ref, v_in_ref  # the same buffers as the outputs
    block, kv_head = pl.program_id(0), pl.program_id(1)
    token = block * BLOCK_TOKENS + jnp.arange(BLOCK_TOKENS, dtype=jnp.int32)
    in_step = token < num_tokens
    slot = plgpu.load(slot_ref.at[jnp.minimum(token, num_tokens - 1)], mask=in_step, other=num_rows)
    is_written = in_step & (slot < num_rows)
    head_dim = k_new_ref.shape[-1]
    shape = (BLOCK_TOKENS, head_dim)
    lane = jnp.broadcast_to(jnp.arange(head_dim, dtype=jnp.int32)[None, :], shape)
    source = jnp.broadcast_to(jnp.minimum(token, num_tokens - 1)[:, None], shape)
    # Masked rows keep an index out of range (never clamped onto a real row: the interpreter's
    # masked store writes a row's old value back, which would race with that row's own write).
    dest = jnp.broadcast_to(jnp.where(is_written, slot, num_rows)[:, None], shape)
    mask = jnp.broadcast_to(is_written[:, None], shape)
    head = jnp.full(shape, kv_head, jnp.int32)
    for new_ref, out_ref in ((k_new_ref, k_out_ref), (v_new_ref, v_out_ref)):
        rows = plgpu.load(new_ref.at[source, head, lane], mask=mask)
        plgpu.store(out_ref.at[head, dest, lane], rows, mask=mask)

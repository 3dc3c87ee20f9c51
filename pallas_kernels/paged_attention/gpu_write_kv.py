"""A step's new K and V written into their pages in one Pallas-Triton launch, in place.

``write_kv_reference`` is two XLA scatters, one per array (jax has no scatter of two arrays at
once), each its own launch: at batch 1 two launches a layer of ~2 us for a few rows, and at 4k
prefill rows 14 us for 16 MB of K/V (~2.3 TB/s read and written; H200, session 18 traces). Here one
program owns ``BLOCK_TOKENS`` tokens of one KV head: it loads their K and V rows (``head_dim``
contiguous elements each) and stores them at their slots (``reference.kv_slots``' arithmetic, done
in the program: padding tokens are masked off), so K and V go in one launch and no XLA op precedes
it. Same contract as ``write_kv_reference``: the pages are donated by the caller's jit and updated
in place.

Opt-in (``write_kv(kv_write="pallas")``, the GPU kernels' ``kv_write``), measured in the engine on
an H200 (session 22, ``benchmarks/results/session22_h200.md``): at batch 1 the launch takes 48-73 µs
a step against the two scatters' 125, but XLA fuses each scatter with its producer (K's RoPE, V's
cast), which the custom call cannot take, so those come back as ~84 µs of fusions: 4.40 ms a
token either way, and the 256-sequence decode step 1.9% slower. To pay it would have to take
over what the scatters fuse (K's rotary embedding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.page_storage import to_page_storage
from pallas_kernels.paged_attention.reference import write_kv_reference
from pallas_kernels.paged_attention.v_layout import write_kv_dim_major_v
from pallas_kernels.paged_attention.work_tiles import next_power_of_2

BLOCK_TOKENS = 32  # 32 tokens x 128 x 2 bytes x (K + V) = 16 KB a program


KV_WRITES = ("pallas", "xla")  # this write, or write_kv_reference's two XLA scatters


def write_kv(k_new: jax.Array, v_new: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array,
             cu_q_lens: jax.Array, kv_lens: jax.Array, *, kv_write: str = "xla",
             interpret: bool = False, v_layout: str = "token_major") -> tuple[jax.Array, jax.Array]:
    """The GPU kernels' K/V write: ``write_kv_reference``'s scatters (``kv_write="xla"``, their
    default: XLA fuses each with its producer) or :func:`write_kv_gpu` (``"pallas"``, one launch);
    same result, in place. Dim-major V pages (``v_layout.py``) take XLA's scatters whatever
    ``kv_write`` says (the Pallas write stores token-major rows)."""
    if kv_write not in KV_WRITES:
        raise ValueError(f"kv_write must be one of {KV_WRITES}, got {kv_write!r}")
    if v_layout == "dim_major":
        return write_kv_dim_major_v(k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
    if kv_write == "xla":
        return write_kv_reference(k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
    return write_kv_gpu(k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, interpret=interpret)


def write_kv_gpu(k_new: jax.Array, v_new: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array,
                 cu_q_lens: jax.Array, kv_lens: jax.Array, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``write_kv_reference``'s result: ``k_new``/``v_new`` [T, Hkv, D] stored at their slots of
    ``k_pages``/``v_pages`` [Hkv, num_pages, page_size, D] (cast to the page dtype), padding dropped.

    Each program finds its tokens' slots itself (``reference.kv_slots``' arithmetic on
    ``cu_q_lens``, ``kv_lens`` and the page tables, a few hundred integers from L2): computed by
    XLA, they were a fusion of their own in every layer, which cost what the one launch saved
    (session 22's H200 traces)."""
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    num_tokens = k_new.shape[0]
    num_rows = num_pages * page_size
    k_new, v_new = to_page_storage(k_new, k_pages.dtype), to_page_storage(v_new, v_pages.dtype)
    # Flattening the pages is a bitcast: row page * page_size + r is token r of that page.
    k_flat = k_pages.reshape(num_kv_heads, num_rows, head_dim)
    v_flat = v_pages.reshape(num_kv_heads, num_rows, head_dim)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))  # noqa: E731
    schedule = (cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32), page_tables.astype(jnp.int32))
    k_flat, v_flat = pl.pallas_call(
        functools.partial(_write_kernel, num_tokens=num_tokens, num_rows=num_rows, page_size=page_size),
        grid=(pl.cdiv(num_tokens, BLOCK_TOKENS), num_kv_heads),
        in_specs=[*(whole(a.shape) for a in schedule), whole(k_new.shape), whole(v_new.shape),
                  whole(k_flat.shape), whole(v_flat.shape)],
        out_specs=[whole(k_flat.shape), whole(v_flat.shape)],
        out_shape=[jax.ShapeDtypeStruct(k_flat.shape, k_flat.dtype), jax.ShapeDtypeStruct(v_flat.shape, v_flat.dtype)],
        input_output_aliases={5: 0, 6: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="write_kv",
    )(*schedule, k_new, v_new, k_flat, v_flat)
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)


def _token_slots(cu_q_lens_ref, kv_lens_ref, page_tables_ref, token, *, num_tokens: int, num_rows: int,
                 page_size: int):
    """(row in the flattened pages, whether it is written) of each of ``token`` [BLOCK_TOKENS]:
    ``reference.kv_slots`` with its searchsorted as one [tokens, sequence slots] comparison."""
    num_seqs, pages_per_seq = page_tables_ref.shape
    slots = jnp.arange(max(16, next_power_of_2(num_seqs)), dtype=jnp.int32)
    ends = plgpu.load(cu_q_lens_ref.at[jnp.minimum(slots + 1, num_seqs)])
    ends = jnp.where(slots < num_seqs, ends, jnp.iinfo(jnp.int32).max)  # slots past the table end never
    # The sequences that end at or before a token come before its own (empty ones included).
    seq = jnp.sum((ends[None, :] <= token[:, None]).astype(jnp.int32), axis=1)
    is_live = (token < cu_q_lens_ref[num_seqs]) & (seq < num_seqs)
    safe_seq = jnp.minimum(seq, num_seqs - 1)
    start = plgpu.load(cu_q_lens_ref.at[safe_seq])
    q_len = plgpu.load(cu_q_lens_ref.at[safe_seq + 1]) - start
    position = plgpu.load(kv_lens_ref.at[safe_seq]) - q_len + (token - start)
    page_index = jnp.clip(position // page_size, 0, pages_per_seq - 1)
    page = plgpu.load(page_tables_ref.at[safe_seq, page_index])
    slot = page * page_size + jnp.maximum(position, 0) % page_size
    is_written = is_live & (token < num_tokens) & (position >= 0) & (slot >= 0) & (slot < num_rows)
    return slot, is_written


def _write_kernel(cu_q_lens_ref, kv_lens_ref, page_tables_ref, k_new_ref, v_new_ref, k_in_ref, v_in_ref, k_out_ref,
                  v_out_ref, *, num_tokens: int, num_rows: int, page_size: int):
    del k_in_ref, v_in_ref  # the same buffers as the outputs
    block, kv_head = pl.program_id(0), pl.program_id(1)
    token = block * BLOCK_TOKENS + jnp.arange(BLOCK_TOKENS, dtype=jnp.int32)
    slot, is_written = _token_slots(cu_q_lens_ref, kv_lens_ref, page_tables_ref, token, num_tokens=num_tokens,
                                    num_rows=num_rows, page_size=page_size)
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

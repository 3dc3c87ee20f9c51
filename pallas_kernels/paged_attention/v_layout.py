"""V pages stored dim-major: a cache layout under measurement for float8 pages (opt-in, GPU kernels only).

The decode kernel's second product, P·V, contracts over V's tokens. The engine stores a token's
``head_dim`` values contiguously (``[Hkv, pages, page_size, D]``, "token_major"), so in a V tile
the tokens are strided and the MMA's B operand needs the tile transposed. For 16-bit pages
``ldmatrix.trans`` transposes on the way out of shared memory; sm_90 has no 8-bit form, so over
float8 pages Triton builds the operand one byte per value (Nsight Compute, ``docs/KERNELS.md``:
``LDS.U8`` is 13% of the kernel's instructions, which are twice bf16 pages' for half the bytes).
Stored "dim_major" (``[Hkv, pages, D, page_size]``), each of a page's dims holds its tokens
contiguously: the V tile is loaded transposed, ``[D, BK]``, and P·V takes it as K is taken in
Q·K^T, with vectorised operand loads. The kernel reads a block a page at a time, each page
addressed by a scalar page id, which is what lets Triton vectorise the V^T tile's global loads.

The Pallas-Triton kernel reads this layout (``gpu.attend_gpu`` / ``ragged_paged_attention_gpu`` /
the fresh-prefill paths, ``v_layout="dim_major"``) and :func:`write_kv_dim_major_v` writes it
(XLA's scatters). The engine stores it only when asked, ``JAXINFER_V_LAYOUT=dim_major``
(``jaxinfer.kv_cache.engine_v_layout``), until a GPU run shows it pays. The reference, the CPU
paths, the TPU kernel and the fused-write kernel read token-major pages only
(``jaxinfer.attention.check_v_layout`` refuses the rest); prefix sharing and preemption move whole
pages and are indifferent to the layout.

Measured on an H100 (sessions 26 and 28, ``benchmarks/results/session2{6,8}_h100.md``): first slower
(0.67x the token-major kernel at 384 x 1k), because the V^T tile's columns came from jnp's ``%``, whose
select hid their contiguity from Triton, so the tile was loaded a byte a value, unpipelined. With the
columns a plain range, level with token-major (full call 0.97-1.03x at B >= 32, 1.21x at 1 x 16k) and
in fp8 throughput-1k (13,262 against 13,242 tok/s, two runs each): its decode steps 1-3% shorter, its
prompt-carrying steps ~5 ms longer, which is the byte-a-value write. Pages a step fills whole are now
written whole (:func:`write_kv_dim_major_v`); the GPU timing of that is next (plan s28b).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.page_storage import to_page_storage
from pallas_kernels.paged_attention.reference import kv_slots, scatter_rows

V_LAYOUTS = ("token_major", "dim_major")


def check_v_layout_name(v_layout: str) -> None:
    """Refuse a layout that is not one of ``V_LAYOUTS``, naming them."""
    if v_layout not in V_LAYOUTS:
        raise ValueError(f"v_layout must be one of {V_LAYOUTS}, got {v_layout!r}")


def v_pages_shape(k_pages_shape: tuple[int, ...], v_layout: str) -> tuple[int, ...]:
    """The V pages' shape beside K pages ``[Hkv, P, page_size, D]``: the same, or ``[Hkv, P, D, page_size]``."""
    check_v_layout_name(v_layout)
    num_kv_heads, num_pages, page_size, head_dim = k_pages_shape
    return (num_kv_heads, num_pages, head_dim, page_size) if v_layout == "dim_major" else tuple(k_pages_shape)


def to_dim_major(v_pages: jax.Array) -> jax.Array:
    """Token-major V pages ``[Hkv, P, page_size, D]`` as dim-major ``[Hkv, P, D, page_size]`` (a copy)."""
    return jnp.swapaxes(v_pages, 2, 3)


def write_kv_dim_major_v(k_new: jax.Array, v_new: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                         page_tables: jax.Array, cu_q_lens: jax.Array,
                         kv_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``reference.write_kv_reference`` with V pages dim-major ``[Hkv, P, D, page_size]``.

    The same slots and padding rule: token ``(page, r)`` of V is column ``r`` of its page's ``D``
    rows; a padding token's slot is past the pool, so its page index is out of range and dropped.

    A token's values land ``page_size`` bytes apart, so a scatter writes them one value at a time
    (on an H100, 8,192 prompt rows took 181 µs a layer against 30 for token-major pages:
    ``benchmarks/results/kv_write_gpu.session28_s28a_h100.md``). In a step with more rows than
    sequences (one that can carry a prompt), pages the step fills whole are written whole instead:
    their rows gathered, transposed and stored a page at a time; the scatter takes only the rest
    (decode rows, a prompt's first and last partial pages).
    """
    num_pages, page_size = k_pages.shape[1:3]
    want = v_pages_shape(k_pages.shape, "dim_major")
    if v_pages.shape != want:
        raise ValueError(f"dim-major v_pages must be [Hkv, P, D, page_size] = {want}, got {v_pages.shape}")
    num_tokens = k_new.shape[0]
    slot = kv_slots(page_tables, cu_q_lens, kv_lens, num_tokens, num_pages, page_size)
    new_v = to_page_storage(v_new, v_pages.dtype)  # [T, Hkv, D]: the two index arrays' axis goes first
    v_slot = slot
    # Static: a decode step (as many rows as sequences) fills no page whole; skip the gather there.
    if num_tokens > page_tables.shape[0] and num_tokens >= page_size:
        v_pages, v_slot = _write_whole_pages(v_pages, new_v, slot, page_size)
    v_pages = v_pages.at[:, v_slot // page_size, :, v_slot % page_size].set(new_v, mode="drop", unique_indices=True)
    return scatter_rows(k_pages, k_new, slot), v_pages


def _write_whole_pages(v_pages: jax.Array, new_v: jax.Array, slot: jax.Array,
                       page_size: int) -> tuple[jax.Array, jax.Array]:
    """Store the pages whose every slot this step writes, whole; return the pages and the slots
    left for the scatter (a row already stored gets its own slot past the pool, so it is dropped).

    A page is filled whole by rows ``t .. t + page_size - 1`` when row ``t`` is its slot 0 and row
    ``t + page_size - 1`` its last: a sequence's rows are packed in order and a page belongs to one
    sequence, so the rows between fill the slots between. At most ``T // page_size`` pages are.
    """
    num_pages = v_pages.shape[1]
    num_tokens = new_v.shape[0]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    in_pool = slot < num_pages * page_size  # padding rows' slots lie past the pool
    offset = slot % page_size
    page_last = slot[jnp.minimum(rows + page_size - 1, num_tokens - 1)]
    starts_page = in_pool & (offset == 0) & (rows + page_size <= num_tokens) & (page_last == slot + page_size - 1)
    max_pages = num_tokens // page_size
    first_rows = jnp.nonzero(starts_page, size=max_pages, fill_value=num_tokens)[0].astype(jnp.int32)
    found = first_rows < num_tokens
    safe_first = jnp.minimum(first_rows, num_tokens - 1)
    # A slot left unfound gets its own page index past the pool: dropped, and the indices stay distinct.
    page = jnp.where(found, slot[safe_first] // page_size, num_pages + jnp.arange(max_pages, dtype=jnp.int32))
    block = new_v[jnp.minimum(safe_first[:, None] + jnp.arange(page_size, dtype=jnp.int32), num_tokens - 1)]
    block = block.transpose(2, 0, 3, 1)  # [pages, page_size, Hkv, D] -> [Hkv, pages, D, page_size]
    v_pages = v_pages.at[:, page].set(block, mode="drop", unique_indices=True)
    page_first = rows - offset
    stored = in_pool & (page_first >= 0) & starts_page[jnp.maximum(page_first, 0)]
    return v_pages, jnp.where(stored, num_pages * page_size + rows, slot)

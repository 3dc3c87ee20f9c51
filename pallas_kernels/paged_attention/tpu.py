"""Ragged paged attention for TPU, in Pallas with the Mosaic TPU lowering.

NOT RUN ON TPU HARDWARE: there was no TPU here. It passes the kernel tests under
``pltpu.force_tpu_interpret_mode()`` on CPU and lowers for the TPU platform from a CPU
machine (tests/test_paged_attention_tpu.py); its speed is unmeasured.

Same work tiles as the GPU kernel (``work_tiles``): one program per (tile, KV head), the
tile's query heads of that KV head stacked as rows. The metadata and the page tables ride
in scalar prefetch (SMEM), so the program knows which physical pages to fetch before any
vector work. K/V pages stay in HBM (``memory_space=ANY``); the program copies
``block_kv // page_size`` pages per step into a VMEM double buffer with one DMA per page,
starting step i+1's copies before computing step i, and runs an online softmax in f32.
Pages past the tile's last query are never fetched; stale buffer rows are masked with
``where`` (never multiplied by zero), so NaN left in VMEM or in unused pages cannot leak.

The new tokens' K/V are written by an XLA scatter into the donated cache (in place)
before the kernel reads it. Tile sizes come from ``block_sizes.tpu_block_sizes`` (untuned).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention import work_tiles as wt
from pallas_kernels.paged_attention.block_sizes import BlockSizes, tpu_block_sizes
from pallas_kernels.paged_attention.reference import write_kv_reference
from pallas_kernels.paged_attention.validation import check_inputs
from pallas_kernels.precision import matmul_precision

_MASK_VALUE = -1e30


def _div(a, b):
    """Floor division of non-negative ints as truncation: jnp's // lowers through sign(), which
    Mosaic only lowers knowing the TPU generation (unknown when lowering from a CPU machine)."""
    return lax.div(a, jnp.asarray(b, jnp.int32))


def _cdiv(a, b):
    return _div(a + b - 1, b)


def _attention_kernel(
    meta_ref,  # SMEM [W * NUM_META] int32 (scalar prefetch)
    page_tables_ref,  # SMEM [S * pages_per_seq] int32 (scalar prefetch)
    q_ref,  # VMEM [rows, D]
    k_hbm,  # HBM [Hkv, num_pages, page_size, D]
    v_hbm,
    out_ref,  # VMEM [rows, D]
    k_buf,  # VMEM [2, pages_per_step, page_size, D]
    v_buf,
    sems,  # DMA semaphores [2 (K, V), 2 (buffer slot)]
    *, sm_scale: float, soft_cap: float | None, sliding_window: int | None,
    pages_per_seq: int, pages_per_step: int, group_padded: int, precision,
):
    tile, kv_head = pl.program_id(0), pl.program_id(1)
    _, page_size, head_dim = k_buf.shape[1:]
    block_kv = pages_per_step * page_size
    seq = meta_ref[tile * wt.NUM_META + wt.SEQ]
    first_pos = meta_ref[tile * wt.NUM_META + wt.FIRST_POS]
    tile_q_len = meta_ref[tile * wt.NUM_META + wt.TILE_Q_LEN]
    kv_end = first_pos + tile_q_len  # causal: nothing past the tile's last query is read
    kv_start = jnp.int32(0) if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    step_lo = _div(kv_start, block_kv)
    step_hi = _cdiv(kv_end, block_kv)
    num_seq_pages = _cdiv(kv_end, page_size)

    def page_copies(step, slot):
        """(is_needed, K copy, V copy) for each page of a step; pages past the end are skipped."""
        copies = []
        for i in range(pages_per_step):
            logical = step * pages_per_step + i
            page = page_tables_ref[seq * pages_per_seq + jnp.minimum(logical, pages_per_seq - 1)]
            copies.append((
                logical < num_seq_pages,
                pltpu.make_async_copy(k_hbm.at[kv_head, page], k_buf.at[slot, i], sems.at[0, slot]),
                pltpu.make_async_copy(v_hbm.at[kv_head, page], v_buf.at[slot, i], sems.at[1, slot]),
            ))
        return copies

    def start_fetch(step, slot):
        for is_needed, k_copy, v_copy in page_copies(step, slot):
            @pl.when(is_needed)
            def _():
                k_copy.start()
                v_copy.start()

    def wait_fetch(step, slot):
        for is_needed, k_copy, v_copy in page_copies(step, slot):
            @pl.when(is_needed)
            def _():
                k_copy.wait()
                v_copy.wait()

    q = q_ref[...]  # [rows, D]
    rows = q.shape[0]
    row_pos = first_pos + _div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group_padded)  # [rows, 1]

    @pl.when(step_hi > step_lo)
    def _():
        start_fetch(step_lo, 0)

    def step(i, carry):
        acc, row_max, denom = carry  # [rows, D], [rows, 1], [rows, 1]
        slot = lax.rem(i - step_lo, jnp.int32(2))

        @pl.when(i + 1 < step_hi)
        def _():
            start_fetch(i + 1, 1 - slot)

        wait_fetch(i, slot)
        # FP8 pages are fetched as stored (half the bytes) and widened here to q's dtype;
        # their scales are applied outside the kernel (jaxinfer.attention). A no-op otherwise.
        k = k_buf[slot].reshape(block_kv, head_dim).astype(q.dtype)
        v = v_buf[slot].reshape(block_kv, head_dim).astype(q.dtype)
        kv_pos = i * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)  # [1, BK]
        scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
        scores = scores * sm_scale  # [rows, BK]
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        visible = (kv_pos <= row_pos) & (kv_pos < kv_end)
        if sliding_window is not None:
            visible &= kv_pos > row_pos - sliding_window
        scores = jnp.where(visible, scores, _MASK_VALUE)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=1, keepdims=True))
        correction = jnp.exp(row_max - new_max)
        weights = jnp.where(visible, jnp.exp(scores - new_max), 0.0)
        denom = denom * correction + jnp.sum(weights, axis=1, keepdims=True)
        v_pos = i * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
        v = jnp.where(v_pos < kv_end, v, jnp.zeros_like(v))  # unfetched rows hold stale data
        pv = lax.dot_general(weights.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        return acc * correction + pv, new_max, denom

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows, 1), _MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
    )
    acc, _, denom = lax.fori_loop(step_lo, step_hi, step, init)
    out_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)).astype(out_ref.dtype)


def attend_tpu(
    q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *, sm_scale, sliding_window=None,
    soft_cap=None, sizes: BlockSizes, interpret=False,
):
    """Attention of packed queries over their (already written) pages; returns out [T, Hq, D]."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group_padded = wt.next_power_of_2(num_q_heads // num_kv_heads)
    block_q = sizes.block_q
    rows = block_q * group_padded
    if sizes.block_kv % page_size:
        raise ValueError(f"block_kv ({sizes.block_kv}) must be a multiple of page_size ({page_size}) on TPU")
    tiles = wt.plan_work_tiles(cu_q_lens, kv_lens, num_tokens, block_q)
    q_tiles = wt.gather_query_tiles(q, tiles, num_kv_heads, block_q, group_padded)  # [W, Hkv, rows, D]
    num_tiles = q_tiles.shape[0]
    pages_per_step = sizes.block_kv // page_size
    kernel = functools.partial(
        _attention_kernel, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        pages_per_seq=page_tables.shape[1], pages_per_step=pages_per_step, group_padded=group_padded,
        # HIGHEST asks Mosaic for a float32 contraction (contract_precision<fp32>) instead of its default.
        precision=matmul_precision(q.dtype),
    )
    tile_spec = pl.BlockSpec((None, None, rows, head_dim), lambda w, h, *_: (w, h, 0, 0))
    buffer = pltpu.VMEM((2, pages_per_step, page_size, head_dim), k_pages.dtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(num_tiles, num_kv_heads),
        in_specs=[tile_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=tile_spec,
        scratch_shapes=[buffer, buffer, pltpu.SemaphoreType.DMA((2, 2))],
    )
    out_tiles = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )(tiles.meta.reshape(-1), page_tables.reshape(-1), q_tiles, k_pages, v_pages)
    return wt.scatter_output_tiles(out_tiles, tiles, cu_q_lens, num_tokens, num_q_heads, block_q)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_q", "block_kv", "interpret"),
    donate_argnames=("k_pages", "v_pages"),
)
def ragged_paged_attention_tpu(
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
    block_q: int | None = None,
    block_kv: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Same contract as ``ragged_paged_attention_reference``; the cache is donated and updated in place.

    ``block_kv`` must be a multiple of the page size (one DMA per page). ``interpret=True``
    (or ``pltpu.force_tpu_interpret_mode()``) runs it on CPU through the TPU interpreter.
    """
    check_inputs(q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    tuned = tpu_block_sizes(
        num_tokens=num_tokens, max_num_seqs=kv_lens.shape[0], max_kv_len=page_tables.shape[1] * page_size,
        num_kv_heads=num_kv_heads, group=num_q_heads // num_kv_heads, head_dim=head_dim,
        page_size=page_size, itemsize=q.dtype.itemsize,
    )
    sizes = BlockSizes(block_q=block_q or tuned.block_q, block_kv=block_kv or tuned.block_kv, num_splits=1)
    k_pages, v_pages = write_kv_reference(k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
    out = attend_tpu(
        q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, sizes=sizes, interpret=interpret,
    )
    return out, k_pages, v_pages

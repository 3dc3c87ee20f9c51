"""Opt-in variant: ragged paged attention with the K/V write fused in (Pallas-Triton, NVIDIA Hopper).

Not the engine's default: GPU run 2 (H200) measured it 17-32% slower than the default kernel
(``gpu.py``: separate XLA scatter, then attention) at B=256, and not reliably faster elsewhere;
``docs/KERNELS.md`` has the numbers. Selected only by ``attention_impl="pallas_gpu_fused"``
(``jaxinfer.attention``) or by calling ``ragged_paged_attention_gpu_fused``; its sizes come
from ``gpu_block_sizes(..., fused=True)`` (the measured table, whose entries were timed on this
kernel).

The tile walk (one program per work tile, KV head and split; K/V rows gathered through the
page table; online softmax in f32; masked loads past the sequence) is the default kernel's,
described in ``gpu.py``; the code both kernels share is in ``gpu_tile.py``.

Decode-like batches split each sequence's KV range across ``num_splits`` programs
(flash-decoding) and merge the partial results with their log-sum-exps in a second small
kernel (``gpu_merge``); prefill-like batches use large query tiles and no split. Sizes come
from ``block_sizes.gpu_block_sizes`` (a measured table when present, else heuristics).

The new tokens' K/V are written by the same kernel, in place in the donated cache (its
inputs aliased to its outputs): program split 0 of each tile stores its own tokens' rows.
No program reads the cache at this step's positions (every position from the sequence's
first new token on is read from ``k_new``/``v_new``), so the writes race with no read. A
float8_e4m3fn cache is loaded as such and widened in registers as in ``gpu.py`` (to float16 for
bf16 queries, ``fp8_tile_dtype``); the dispatcher quantizes the new K/V and applies the scales
outside the kernel.

Lowering choice: Pallas-Triton, as for the default kernel (``gpu.py``'s docstring has the
measurement against the Mosaic GPU prototype).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention import gpu_tile as tile_lib
from pallas_kernels.paged_attention import work_tiles as wt
from pallas_kernels.paged_attention.block_sizes import BlockSizes, gpu_block_sizes
from pallas_kernels.paged_attention.gpu_merge import merge_splits_gpu
from pallas_kernels.paged_attention.validation import check_inputs
from pallas_kernels.precision import matmul_precision

def _tile_scalars(sched_refs, tile, *, block_q: int, plan_in_kernel: bool):
    """(sequence, first query position, queries in the tile, first token, first new position) of a tile.

    From the XLA-planned ``meta`` rows, or, with ``plan_in_kernel``, computed here from
    ``cu_q_lens``: each program redoes the plan's prefix sum over the sequence slots (a few
    hundred integers, from L2) instead of the batch paying the two or three small XLA kernels
    that ``plan_work_tiles`` compiles to, which are a fixed cost on every call.
    """
    cu_q_lens_ref, kv_lens_ref = sched_refs[0], sched_refs[1]
    num_seqs = kv_lens_ref.shape[0]
    if plan_in_kernel:
        slots = jnp.arange(max(16, wt.next_power_of_2(num_seqs)), dtype=jnp.int32)
        is_slot = slots < num_seqs
        starts = plgpu.load(cu_q_lens_ref.at[jnp.minimum(slots, num_seqs)])
        ends = plgpu.load(cu_q_lens_ref.at[jnp.minimum(slots + 1, num_seqs)])
        tiles_per_seq = jnp.where(is_slot, (ends - starts + block_q - 1) // block_q, 0)
        tile_end = jnp.cumsum(tiles_per_seq)
        # Same as plan_work_tiles' searchsorted(side="right"): the first slot whose tiles end past this one.
        seq = jnp.sum((tile_end <= tile).astype(jnp.int32))
        tile_start = jnp.sum(jnp.where(slots < seq, tiles_per_seq, 0))
        is_live = seq < num_seqs
        seq = jnp.minimum(seq, num_seqs - 1)
        cu_start = cu_q_lens_ref[seq]
        q_len = cu_q_lens_ref[seq + 1] - cu_start
        q_offset = (tile - tile_start) * block_q
        new_start = kv_lens_ref[seq] - q_len
        tile_q_len = jnp.where(is_live, jnp.clip(q_len - q_offset, 0, block_q), 0)
        first_pos = jnp.where(is_live, new_start + q_offset, 0)
        token_start = jnp.where(is_live, cu_start + q_offset, 0)
        return seq, first_pos, tile_q_len, token_start, new_start
    meta_ref = sched_refs[2]
    seq = meta_ref[tile, wt.SEQ]
    new_start = kv_lens_ref[seq] - (cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq])
    return seq, meta_ref[tile, wt.FIRST_POS], meta_ref[tile, wt.TILE_Q_LEN], meta_ref[tile, wt.TOKEN_START], new_start


def _attention_kernel(
    *refs,
    # Inputs: cu_q_lens [S + 1], kv_lens [S], (meta [W, NUM_META] unless plan_in_kernel), page_tables
    # [S, pages_per_seq], q [T, Hq, D], k/v cache [pages * page_size, D] (this KV head, pages flattened),
    # k/v new [T, D] (this KV head). Outputs: out [T + 1, Hq, D] (or, split, f32 out and lse [T + 1, Hq]
    # of this split), then the k/v cache again (aliased to the inputs: the new rows are written there).
    sm_scale: float, soft_cap: float | None, sliding_window: int | None,
    page_size: int, block_kv: int, block_q: int, group: int, group_padded: int, num_splits: int, precision,
    prefetch_pages: bool, plan_in_kernel: bool,
):
    num_sched = 2 if plan_in_kernel else 3
    sched_refs = refs[:num_sched]
    page_tables_ref, q_ref, k_cache_ref, v_cache_ref, k_new_ref, v_new_ref = refs[num_sched:num_sched + 6]
    out_refs = refs[num_sched + 6:]
    k_out_ref, v_out_ref = out_refs[-2:]
    # Tiles launch in reverse: a sequence's later tiles walk more of its (causal) context, so in a
    # prefill the longest programs start first and the short ones fill in the tail.
    tile = pl.num_programs(0) - 1 - pl.program_id(0)
    kv_head, split = pl.program_id(1), pl.program_id(2)
    seq, first_pos, tile_q_len, token_start, new_start = _tile_scalars(
        sched_refs, tile, block_q=block_q, plan_in_kernel=plan_in_kernel)
    kv_end, my_lo, my_hi = tile_lib.split_block_range(
        first_pos, tile_q_len, split, block_kv=block_kv, num_splits=num_splits, sliding_window=sliding_window)

    num_tokens, _, head_dim = q_ref.shape
    pages_per_seq = page_tables_ref.shape[1]
    cache_rows = k_cache_ref.shape[0]
    # bf16 queries over fp8 pages compute in f16: e4m3 widens to it in one instruction (gpu.py's docstring).
    compute_dtype = tile_lib.fp8_tile_dtype(q_ref.dtype, k_cache_ref.dtype)
    rows = tile_lib.query_rows(token_start, first_pos, tile_q_len, kv_head, block_q=block_q, group=group,
                               group_padded=group_padded, head_dim=head_dim, num_tokens=num_tokens)
    num_rows = block_q * group_padded
    row, row_token, row_head, lane_2d = rows.row, rows.row_token, rows.row_head, rows.lane_2d
    q = tile_lib.load_queries(q_ref, rows, compute_dtype)  # clipped to f16's range, so no row becomes inf

    # The K/V write, fused: split 0 of each tile stores its own queries' new rows (tiles never
    # share a token, so each row is written once). Nothing in this call reads those cache rows:
    # every program takes positions >= new_start from k_new/v_new instead (below), so the
    # write needs no ordering against the reads of other programs.
    writes = (row_head == 0) & (row_token < tile_q_len) & (split == 0)  # one row per query token
    write_pos = first_pos + row_token
    write_page = plgpu.load(page_tables_ref.at[seq, jnp.minimum(write_pos // page_size, pages_per_seq - 1)])
    # Masked lanes get distinct out-of-range rows: never stored (and dropped by the interpreter's scatter).
    write_slot = jnp.where(writes, write_page * page_size + write_pos % page_size, cache_rows + row)
    write_slot_2d = jnp.broadcast_to(write_slot[:, None], (num_rows, head_dim))
    write_token = jnp.minimum(token_start + row_token, num_tokens - 1)
    write_token_2d = jnp.broadcast_to(write_token[:, None], (num_rows, head_dim))
    write_mask = jnp.broadcast_to(writes[:, None], (num_rows, head_dim))
    for new_ref, out_cache_ref in ((k_new_ref, k_out_ref), (v_new_ref, v_out_ref)):
        new_rows = plgpu.load(new_ref.at[write_token_2d, lane_2d], mask=write_mask, other=0.0)
        plgpu.store(out_cache_ref.at[write_slot_2d, lane_2d], new_rows.astype(out_cache_ref.dtype), mask=write_mask)

    scale = tile_lib.score_scale(sm_scale, soft_cap)
    new_token_base = token_start - first_pos  # token index of position p among the new rows: base + p
    kv_lane_2d = jnp.broadcast_to(jnp.arange(head_dim, dtype=jnp.int32)[None, :], (block_kv, head_dim))

    def page_ids(i):
        return tile_lib.block_page_ids(page_tables_ref, seq, i, block_kv=block_kv, page_size=page_size)

    def load_block(cache_ref, new_ref, kv_pos, pages, source: str):
        """[BK, D] rows of K or V at ``kv_pos``, in the compute dtype: cached rows, new rows or both (masked)."""
        if source == "new":
            x = plgpu.load(new_ref.at[jnp.broadcast_to((new_token_base + kv_pos)[:, None], (block_kv, head_dim)),
                                      kv_lane_2d])
            # Through the cache's dtype, as the reference writes then reads it (fp8 caches round here).
            return x.astype(cache_ref.dtype).astype(compute_dtype)
        slot = pages * page_size + kv_pos % page_size  # [BK] row in the flattened pages
        slot_2d = jnp.broadcast_to(slot[:, None], (block_kv, head_dim))
        if source == "cache":
            return plgpu.load(cache_ref.at[slot_2d, kv_lane_2d]).astype(compute_dtype)
        in_cache = jnp.broadcast_to((kv_pos < jnp.minimum(new_start, kv_end))[:, None], (block_kv, head_dim))
        is_new = jnp.broadcast_to(((kv_pos >= new_start) & (kv_pos < kv_end))[:, None], (block_kv, head_dim))
        new_token = jnp.clip(new_token_base + kv_pos, 0, num_tokens - 1)
        cached = plgpu.load(cache_ref.at[slot_2d, kv_lane_2d], mask=in_cache, other=0.0)
        fresh = plgpu.load(new_ref.at[jnp.broadcast_to(new_token[:, None], (block_kv, head_dim)), kv_lane_2d],
                           mask=is_new, other=0.0)
        return jnp.where(is_new, fresh.astype(cache_ref.dtype).astype(compute_dtype), cached.astype(compute_dtype))

    def step(i, carry, source: str):
        acc, row_max, denom, pages = carry  # [rows, D], [rows], [rows] (max in log2 units), [BK] page ids of block i
        if prefetch_pages:
            next_pages = page_ids(i + 1)  # issued before this block's K/V loads: off their critical path
        else:
            pages, next_pages = page_ids(i), pages
        kv_pos = i * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # [BK]
        k = load_block(k_cache_ref, k_new_ref, kv_pos, pages, source)  # [BK, D]
        acc, row_max, denom = tile_lib.softmax_step(
            q, k, lambda: load_block(v_cache_ref, v_new_ref, kv_pos, pages, source), kv_pos, rows.row_pos,
            lambda: kv_pos < kv_end,
            (acc, row_max, denom), masked=source == "mixed", scale=scale, soft_cap=soft_cap,
            sliding_window=sliding_window, precision=precision)
        return acc, row_max, denom, next_pages

    # Blocks by kind, in walk order: masked edges (a sliding window's start; the block holding
    # the first new position, which mixes cached and new rows; the causal end) and, between them,
    # blocks every row sees in full, read unmasked either from the cache (before the new
    # positions) or from k_new/v_new (a prefill's own earlier tokens). Unmasked blocks skip the
    # bounds masks on their loads and all mask arithmetic: the bulk of any long walk.
    full_lo, full_hi = tile_lib.unmasked_block_range(my_lo, my_hi, first_pos, kv_end, block_kv=block_kv,
                                                     sliding_window=sliding_window)
    cache_hi = jnp.clip(new_start // block_kv, full_lo, full_hi)
    new_lo = jnp.clip(pl.cdiv(new_start, block_kv), cache_hi, full_hi)
    carry = (
        *tile_lib.initial_carry(num_rows, head_dim),
        page_ids(my_lo) if prefetch_pages else jnp.zeros((block_kv,), jnp.int32),
    )
    for lo, hi, source in ((my_lo, full_lo, "mixed"), (full_lo, cache_hi, "cache"), (cache_hi, new_lo, "mixed"),
                           (new_lo, full_hi, "new"), (full_hi, my_hi, "mixed")):
        carry = lax.fori_loop(lo, hi, functools.partial(step, source=source), carry)
    acc, row_max, denom, _ = carry
    tile_lib.store_outputs(out_refs, rows, acc, row_max, denom, num_splits=num_splits)


def attend_and_write_gpu(
    q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *, sm_scale, sliding_window=None,
    soft_cap=None, sizes: BlockSizes, interpret: bool = False,
):
    """One kernel call: writes this step's K/V into the cache in place and attends. Returns (out, k_pages, v_pages).

    The cache outputs alias the inputs; without donation by the caller's jit, XLA copies the cache
    first (``ragged_paged_attention_gpu`` donates).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    group_padded = wt.next_power_of_2(group)
    block_q, splits = sizes.block_q, sizes.num_splits
    num_tiles = wt.num_work_tiles(num_tokens, kv_lens.shape[0], block_q)
    sched = [cu_q_lens, kv_lens]
    if not sizes.plan_in_kernel:
        sched.append(wt.plan_work_tiles(cu_q_lens, kv_lens, num_tokens, block_q).meta)
    # Flattening pages is a bitcast: row page * page_size + r is token r of that page.
    cache_shape = (num_kv_heads, num_pages * page_size, head_dim)
    k_flat, v_flat = k_pages.reshape(cache_shape), v_pages.reshape(cache_shape)
    # HIGHEST makes Triton's dot IEEE float32 for float32 inputs; at the default it rounds them to TF32.
    precision = matmul_precision(q.dtype)

    kernel = functools.partial(
        _attention_kernel, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        page_size=page_size, block_kv=sizes.block_kv, block_q=block_q, group=group, group_padded=group_padded,
        num_splits=splits, precision=precision, prefetch_pages=sizes.prefetch_pages,
        plan_in_kernel=sizes.plan_in_kernel,
    )
    whole = lambda shape: pl.BlockSpec(shape, lambda w, h, s: (0,) * len(shape))  # noqa: E731
    cache_spec = pl.BlockSpec((None, num_pages * page_size, head_dim), lambda w, h, s: (h, 0, 0))
    new_spec = pl.BlockSpec((num_tokens, None, head_dim), lambda w, h, s: (0, h, 0))
    # Outputs have one extra token row that masked rows write to. They start uninitialised (no
    # memset launches): every live token's row is written by every split, and padding tokens'
    # rows are zeroed after the call.
    out_rows = (num_tokens + 1, num_q_heads)
    if splits == 1:
        out_shapes = [jax.ShapeDtypeStruct((*out_rows, head_dim), q.dtype)]
        out_specs = [whole((*out_rows, head_dim))]
    else:
        out_shapes = [jax.ShapeDtypeStruct((splits, *out_rows, head_dim), jnp.float32),
                      jax.ShapeDtypeStruct((splits, *out_rows), jnp.float32)]
        out_specs = [pl.BlockSpec((None, *out_rows, head_dim), lambda w, h, s: (s, 0, 0, 0)),
                     pl.BlockSpec((None, *out_rows), lambda w, h, s: (s, 0, 0))]
    out_shapes += [jax.ShapeDtypeStruct(cache_shape, k_pages.dtype)] * 2
    out_specs += [cache_spec, cache_spec]
    in_specs = [whole(x.shape) for x in sched] + [whole(page_tables.shape), whole(q.shape), cache_spec, cache_spec,
                                                  new_spec, new_spec]
    k_index = len(sched) + 2
    results = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shapes,
        input_output_aliases={k_index: len(out_shapes) - 2, k_index + 1: len(out_shapes) - 1},
        compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages),
        interpret=interpret,
        name="ragged_paged_attention_fused",
    )(*sched, page_tables, q, k_flat, v_flat, k_new, v_new)
    is_token = (jnp.arange(num_tokens, dtype=jnp.int32) < cu_q_lens[-1])[:, None, None]
    if splits == 1:
        out = jnp.where(is_token, results[0][:num_tokens], 0)
    elif sizes.merge_kernel:
        out = merge_splits_gpu(results[0], results[1], cu_q_lens, num_tokens=num_tokens, dtype=q.dtype,
                               interpret=interpret)
    else:
        out = jnp.where(is_token, wt.combine_splits(results[0][:, :num_tokens], results[1][:, :num_tokens]), 0)
    return out.astype(q.dtype), results[-2].reshape(k_pages.shape), results[-1].reshape(v_pages.shape)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_q", "block_kv", "num_splits",
                     "num_warps", "num_stages", "prefetch_pages", "plan_in_kernel",
                     "merge_kernel", "interpret"),
    donate_argnames=("k_pages", "v_pages"),
)
def ragged_paged_attention_gpu_fused(
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
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch_pages: bool | None = None,
    plan_in_kernel: bool | None = None,
    merge_kernel: bool | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Same contract as ``ragged_paged_attention_reference``; the cache is donated and updated in place.

    Tile sizes default to the tuned table; any of them can be forced for sweeps and tests.
    ``interpret=True`` runs the kernel through Pallas's interpreter (CPU tests).
    """
    check_inputs(q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"the GPU kernel needs a power-of-two head_dim (Triton tiles), got {head_dim}")
    tuned = gpu_block_sizes(
        num_tokens=num_tokens, max_num_seqs=kv_lens.shape[0], max_kv_len=page_tables.shape[1] * page_size,
        num_kv_heads=num_kv_heads, group=num_q_heads // num_kv_heads, head_dim=head_dim,
        page_size=page_size, itemsize=q.dtype.itemsize, fused=True,
    )
    sizes = BlockSizes(
        block_q=block_q or tuned.block_q,
        block_kv=block_kv or tuned.block_kv,
        num_splits=num_splits or tuned.num_splits,
        num_warps=num_warps or tuned.num_warps,
        num_stages=num_stages or tuned.num_stages,
        prefetch_pages=tuned.prefetch_pages if prefetch_pages is None else prefetch_pages,
        plan_in_kernel=tuned.plan_in_kernel if plan_in_kernel is None else plan_in_kernel,
        merge_kernel=tuned.merge_kernel if merge_kernel is None else merge_kernel,
    )
    return attend_and_write_gpu(
        q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, sizes=sizes, interpret=interpret,
    )

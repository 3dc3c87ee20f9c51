"""Ragged paged attention for NVIDIA Hopper, in Pallas with the Triton lowering: the engine's default.

This is the kernel as it stood before issue 21 (session 7 froze a copy of it as the baseline to
beat; once it was the default again the copy was deleted), plus float8 pages. GPU run 2 (H200) measured it, with its separate XLA scatter for the K/V write,
17-32% faster than the fused-write variant (``gpu_fused.py``) at B=256 decode, and the fused
kernel was not reliably faster anywhere (B=1 ctx 16k: +14% best-of-sweep in one run, within the
~10% run-to-run spread seen at B=1), so this is the default and the fused kernel is opt-in
(``docs/KERNELS.md``, issue-21 section).

One program serves one work tile (up to ``block_q`` queries of one sequence, all query
heads of one KV head stacked as rows, see ``work_tiles``), for one KV head and one KV
split. It gathers its query rows straight from ``q [T, Hq, D]`` and scatters its output
rows straight into ``out``; tiles never overlap, so no two programs write one row. It
walks the sequence's KV positions ``block_kv`` at a time: the page table gives each
position's physical page, K and V rows are gathered through it (each row is
``head_dim`` contiguous elements, so the gather is coalesced), and an online softmax
accumulates in f32. Causality bounds the walk: a tile never reads past its last query's
position, and a sliding window starts it late. Positions past the sequence are masked
loads, so pages past the end, and the NaN that unused pages may hold, are never read.
The pieces of that walk that the fused-write kernel (``gpu_fused.py``) shares live in
``gpu_tile.py``.

Decode-like batches split each sequence's KV range across ``num_splits`` programs
(flash-decoding) and merge the partial results with their log-sum-exps in one small Pallas
launch (``gpu_merge.py``; ``merge_kernel=False``: XLA ops, as before session 19); prefill-like
batches use large query tiles and no split. Sizes come from ``block_sizes.gpu_block_sizes``.
``prefetch_pages=True`` (an option for sweeps, off by default: measured neutral or slower,
``block_sizes.default_kernel_mechanisms``) loads the next block's page ids a step ahead.

The new tokens' K/V are written first by an XLA scatter into the donated cache (in
place: no cache-sized copy, which the benchmark checks in the compiled program), then
the kernel reads the cache. A float8_e4m3fn cache is loaded as such (half bf16's bytes) and each
K/V tile is widened in registers to ``fp8_tile_dtype``: float16 for bf16/f16 queries (the default,
``fp8_widen_to="float16"``), the query's dtype otherwise. Why float16: on sm_90 Triton widens e4m3
to f16 with one ``cvt.rn.f16x2.e4m3x2`` per two values but to bf16 through f16 and f32, several
conversions per two values, and conversions issue at 16 a clock per SM; that conversion rate,
not HBM, bounded the bf16-widening kernel (measured: fp8 pages took as long as bf16 pages,
about 32 SM clocks per KV token and KV head at B=256 ctx 4k). Every e4m3 value is exact in f16, and so is a
bf16 query within f16's range (it is clipped to +-65504 first); the softmax weights round to
f16 (3 more mantissa bits than bf16). The dispatcher (``jaxinfer.attention``) has already
quantized the new K/V (so the scatter stores fp8) and folds the scales into q and out.

Lowering choice: Pallas-Triton, chosen by measurement against a Mosaic GPU prototype
(``mosaic_gpu_prototype.py``: one warpgroup per sequence x KV head x split, one TMA copy
per page at the coordinate read from the page table, Q K^T and P V as wgmma, pages
pipelined 2/4/8 deep by ``plgpu.emit_pipeline``). ``benchmarks/kernel_lowering_choice.py``
timed both in one run on the H200 (bf16, 32 q / 8 KV heads, d 128, page 32, 32 chained
calls per timed program; ``benchmarks/results/kernel_lowering_choice.md``), best Mosaic
variant vs this kernel at its tuned sizes, two runs:

    shape          Triton TB/s (of 4.53 ceiling)   best Mosaic / Triton time
    B=64 ctx 4k    3.87-3.91 (85-86%)              1.06, 1.07
    B=8  ctx 16k   3.31-3.52 (73-78%)              0.95, 1.04
    B=1  ctx 32k   2.39-2.61 (53-58%)              1.07, 1.03
    B=32 ctx 4k    3.54 (78%)                      1.07 (second run only)

Mosaic GPU can express paged decode (page-table indirection for TMA works: the
coordinate is a scalar loaded from GMEM inside the BlockSpec's ``index_map``), but the
prototype is no faster: 3-8% slower at three of four shapes, and within the 6-9%
run-to-run spread at the fourth. This kernel also already serves prefill, mixed and
chunked batches, sliding windows and soft caps, and never reads unowned cache rows (masked
loads), so it stays. Where Mosaic GPU might still win: prefill (wgmma at M=64 rows of real
queries, not 4 of 64 as in decode) and decode with two warpgroups overlapping softmax and
the next page's matmuls; neither was built.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention import gpu_tile as tile_lib
from pallas_kernels.paged_attention import work_tiles as wt
from pallas_kernels.paged_attention.block_sizes import BlockSizes, default_kernel_mechanisms, gpu_block_sizes
from pallas_kernels.paged_attention.gpu_merge import merge_splits_gpu
from pallas_kernels.paged_attention.gpu_write_kv import write_kv
from pallas_kernels.paged_attention.v_layout import v_pages_shape
from pallas_kernels.paged_attention.validation import check_inputs
# Re-exported: callers and tests know them from here.
from pallas_kernels.paged_attention.gpu_tile import F16_MAX, FP8_WIDEN_CHOICES, fp8_tile_dtype  # noqa: F401
from pallas_kernels.precision import matmul_precision

def _attention_kernel(
    meta_ref,  # [W, NUM_META] int32
    page_tables_ref,  # [S, pages_per_seq] int32
    q_ref,  # [T, Hq, D]
    k_ref,  # [num_pages * page_size, D] (this KV head, pages flattened)
    v_ref,  # [num_pages * page_size, D]
    *out_refs,  # out [T (+ 1), Hq, D], or out [T + 1, Hq, D] f32 and lse [T + 1, Hq] f32 of this split
    sm_scale: float, soft_cap: float | None, sliding_window: int | None,
    page_size: int, block_kv: int, block_q: int, group: int, group_padded: int, num_splits: int, precision,
    tile_dtype, prefetch_pages: bool, v_dim_major: bool,
):
    # Program ids are read here, outside the condition: the interpreter (CPU tests) lowers them only here.
    tile, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tile_q_len = meta_ref[tile, wt.TILE_Q_LEN]

    # An empty tile (past the live ones, or emptied for another kernel) stores nothing: skip the
    # address math of its masked loads and stores too (measured: a step of 4k rows whose tiles were
    # all emptied still took 13 us without this).
    @pl.when(tile_q_len > 0)
    def _():
        _attend_tile(tile, kv_head, split, meta_ref, page_tables_ref, q_ref, k_ref, v_ref, *out_refs,
                     sm_scale=sm_scale, soft_cap=soft_cap,
                     sliding_window=sliding_window, page_size=page_size, block_kv=block_kv, block_q=block_q,
                     group=group, group_padded=group_padded, num_splits=num_splits, precision=precision,
                     tile_dtype=tile_dtype, prefetch_pages=prefetch_pages, v_dim_major=v_dim_major)


def _attend_tile(tile, kv_head, split, meta_ref, page_tables_ref, q_ref, k_ref, v_ref, *out_refs, sm_scale, soft_cap,
                 sliding_window, page_size, block_kv, block_q, group, group_padded, num_splits, precision, tile_dtype,
                 prefetch_pages, v_dim_major):
    """One non-empty work tile of ``_attention_kernel`` (program ids ``tile``, ``kv_head``, ``split``)."""
    seq = meta_ref[tile, wt.SEQ]
    first_pos = meta_ref[tile, wt.FIRST_POS]
    tile_q_len = meta_ref[tile, wt.TILE_Q_LEN]
    kv_end, my_lo, my_hi = tile_lib.split_block_range(
        first_pos, tile_q_len, split, block_kv=block_kv, num_splits=num_splits, sliding_window=sliding_window)
    head_dim = q_ref.shape[-1]
    rows = tile_lib.query_rows(meta_ref[tile, wt.TOKEN_START], first_pos, tile_q_len, kv_head,
                               block_q=block_q, group=group, group_padded=group_padded, head_dim=head_dim,
                               num_tokens=q_ref.shape[0])
    q = tile_lib.load_queries(q_ref, rows, tile_dtype)  # fp8 pages, f16 tiles: clipped once per program
    scale = tile_lib.score_scale(sm_scale, soft_cap)

    def page_ids(i):
        return tile_lib.block_page_ids(page_tables_ref, seq, i, block_kv=block_kv, page_size=page_size)

    def step(i, carry, masked: bool, page=None):
        if v_dim_major:
            return dim_major_step(i, carry, masked)
        kv_pos = i * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # [BK]
        in_seq = kv_pos < kv_end
        if page is None:
            page = plgpu.load(page_tables_ref.at[seq, kv_pos // page_size], mask=in_seq if masked else None,
                              other=0 if masked else None)
        slot = page * page_size + kv_pos % page_size  # [BK] row in the flattened pages
        # Index both axes with arrays (a gather), the form both Triton and the interpreter take.
        slot_2d = jnp.broadcast_to(slot[:, None], (block_kv, head_dim))
        lane_2d = jnp.broadcast_to(jnp.arange(head_dim, dtype=jnp.int32)[None, :], (block_kv, head_dim))
        load_mask = jnp.broadcast_to(in_seq[:, None], (block_kv, head_dim)) if masked else None
        other = 0.0 if masked else None

        def load(ref):  # [BK, D] in the tile dtype
            return plgpu.load(ref.at[slot_2d, lane_2d], mask=load_mask, other=other).astype(tile_dtype)

        return tile_lib.softmax_step(
            q, load(k_ref), lambda: load(v_ref), kv_pos, rows.row_pos, lambda: in_seq, carry, masked=masked,
            scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, precision=precision)

    def dim_major_step(i, carry, masked: bool):
        """``step`` over dim-major V pages (v_layout.py): the block in parts of one page each (or the block,
        when smaller), each part's page id read as a scalar. With the page the same along a V^T row
        [D, part], Triton can prove the row's columns contiguous and vectorise its loads (a per-token page
        vector would hide that; token-major rows are contiguous along D whatever their page)."""
        part = min(block_kv, page_size)
        pages_per_seq = page_tables_ref.shape[1]
        other = 0.0 if masked else None

        def load_v_part(v_rows, v_cols, v_mask, v_keep):  # after the scores, as the token-major step loads V
            v = plgpu.load(v_ref.at[v_rows, v_cols], mask=v_mask, other=other).astype(tile_dtype)
            return v if v_keep is None else jnp.where(v_keep, v, jnp.zeros((), tile_dtype))

        k_lanes = jnp.broadcast_to(jnp.arange(head_dim, dtype=jnp.int32)[None, :], (part, head_dim))
        ks, load_vs, kv_pos_parts, in_seq_parts = [], [], [], []
        for j in range(block_kv // part):
            first = i * block_kv + j * part
            kv_pos = first + jnp.arange(part, dtype=jnp.int32)  # [part]
            in_seq = kv_pos < kv_end
            # Clamped: a part past the sequence's pages (a masked block's tail) is never read.
            page = page_tables_ref[seq, jnp.minimum(first // page_size, pages_per_seq - 1)]
            # The part's slots in its page, built so Triton can prove them contiguous and aligned: a
            # jnp `%` lowers to a select (Python's sign rule) that hides both, and the V^T tile's
            # columns were then loaded one byte at a time, unpipelined (session 26, H100).
            if part == page_size:
                offset = jnp.arange(part, dtype=jnp.int32)
            else:  # part divides the page size, so the part starts at a multiple of it in its page
                offset = pl.multiple_of(lax.rem(first, page_size), part) + jnp.arange(part, dtype=jnp.int32)
            k_rows = jnp.broadcast_to((page * page_size + offset)[:, None], (part, head_dim))
            k_mask = jnp.broadcast_to(in_seq[:, None], (part, head_dim)) if masked else None
            ks.append(plgpu.load(k_ref.at[k_rows, k_lanes], mask=k_mask, other=other).astype(tile_dtype))
            # V^T [D, part]: dim d of token (page, r) is row page * D + d, column r, of the flattened pages.
            v_rows = jnp.broadcast_to(page * head_dim + jnp.arange(head_dim, dtype=jnp.int32)[:, None],
                                      (head_dim, part))
            v_cols = jnp.broadcast_to(offset[None, :], (head_dim, part))
            # The load's mask is one value for the whole V^T tile, so its loads stay vectorised and
            # pipelined (a mask varying along the columns limits Triton to a byte a value): a part
            # past the sequence is not read; a live part's slots past the end are read (in its own
            # page) and zeroed after, since a stale NaN there would survive its weight of 0.
            v_mask = jnp.broadcast_to(first < kv_end, (head_dim, part)) if masked else None
            v_keep = jnp.broadcast_to(in_seq[None, :], (head_dim, part)) if masked else None
            load_vs.append(functools.partial(load_v_part, v_rows, v_cols, v_mask, v_keep))
            kv_pos_parts.append(kv_pos)
            in_seq_parts.append(in_seq)
        return tile_lib.softmax_step_parts(
            q, ks, load_vs, kv_pos_parts, rows.row_pos, in_seq_parts, carry, masked=masked, scale=scale,
            soft_cap=soft_cap, sliding_window=sliding_window, precision=precision, v_transposed=True)

    full_lo, full_hi = tile_lib.unmasked_block_range(my_lo, my_hi, first_pos, kv_end, block_kv=block_kv,
                                                     sliding_window=sliding_window)
    carry = tile_lib.initial_carry(block_q * group_padded, head_dim)
    carry = lax.fori_loop(my_lo, full_lo, functools.partial(step, masked=True), carry)
    if prefetch_pages:
        # The bulk of the walk loads the next block's page ids one step ahead, in the carry: this
        # block's K/V addresses are then known when the step starts, not one global load later.
        def prefetched_step(i, carry_and_pages):
            *state, pages = carry_and_pages
            next_pages = page_ids(i + 1)  # issued before this block's K/V loads
            return (*step(i, tuple(state), masked=False, page=pages), next_pages)

        *carry, _ = lax.fori_loop(full_lo, full_hi, prefetched_step, (*carry, page_ids(full_lo)))
        carry = tuple(carry)
    else:
        carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
    acc, row_max, denom = lax.fori_loop(full_hi, my_hi, functools.partial(step, masked=True), carry)
    tile_lib.store_outputs(out_refs, rows, acc, row_max, denom, num_splits=num_splits)


def attend_gpu(
    q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *, sm_scale, sliding_window=None,
    soft_cap=None, sizes: BlockSizes, interpret: bool = False, fp8_widen_to: str = "float16",
    tiles: wt.WorkTiles | None = None, out_init: jax.Array | None = None, v_layout: str = "token_major",
):
    """Attention of packed queries over their (already written) pages; returns out [T, Hq, D].

    ``fp8_widen_to``: see ``fp8_tile_dtype`` (only float8 pages read it). ``tiles``: the work
    tiles, when the caller planned them itself (``gpu_fresh_prefill`` empties the tiles of the
    sequence another kernel serves); by default planned here with ``sizes.block_q``.
    ``out_init`` [T, Hq, D] in q's dtype (one split only): the output buffer to write the tiles'
    rows into, in place (donate it), instead of zeros; rows of no tile keep its values. So another
    kernel's output for the rows of emptied tiles needs no select and no zero fill.
    ``v_layout``: ``"token_major"`` (the engine's pages) or ``"dim_major"``: ``v_pages`` is
    ``[Hkv, P, D, page_size]`` and the kernel loads V tiles transposed, one page a part of a block
    (``v_layout.py``, a layout under measurement for float8 pages).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    group_padded = wt.next_power_of_2(group)
    block_q, splits = sizes.block_q, sizes.num_splits
    if tiles is None:
        tiles = wt.plan_work_tiles(cu_q_lens, kv_lens, num_tokens, block_q)
    num_tiles = tiles.meta.shape[0]
    # Flattening pages is a bitcast: row page * page_size + r is token r of that page.
    k_flat = k_pages.reshape(num_kv_heads, num_pages * page_size, head_dim)
    v_dim_major = v_layout == "dim_major"
    if v_dim_major and min(sizes.block_kv, page_size) < 16 and not interpret:  # a part: a page at most
        raise ValueError(f"dim-major V pages need parts of >= 16 tokens on a GPU (Triton's dot), so pages and "
                         f"blocks of >= 16 tokens; got block_kv {sizes.block_kv}, page_size {page_size}")
    if v_pages.shape != v_pages_shape(k_pages.shape, v_layout):
        raise ValueError(f"v_pages {v_pages.shape} do not hold k_pages' {k_pages.shape} tokens as {v_layout} pages")
    # Flattened the same way: row page * D + d of dim-major pages holds dim d of that page's tokens.
    v_rows, v_cols = v_pages.shape[1] * v_pages.shape[2], v_pages.shape[3]
    v_flat = v_pages.reshape(num_kv_heads, v_rows, v_cols)
    # HIGHEST makes Triton's dot IEEE float32 for float32 inputs; at the default it rounds them to TF32.
    precision = matmul_precision(q.dtype)
    tile_dtype = fp8_tile_dtype(q.dtype, k_pages.dtype, fp8_widen_to)

    kernel = functools.partial(
        _attention_kernel, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        page_size=page_size, block_kv=sizes.block_kv, block_q=block_q, group=group, group_padded=group_padded,
        num_splits=splits, precision=precision, tile_dtype=tile_dtype, prefetch_pages=sizes.prefetch_pages,
        v_dim_major=v_dim_major,
    )
    whole = lambda shape: pl.BlockSpec(shape, lambda w, h, s: (0,) * len(shape))  # noqa: E731
    cache_spec = pl.BlockSpec((None, num_pages * page_size, head_dim), lambda w, h, s: (h, 0, 0))
    # Outputs have one extra token row that masked rows write to; padding tokens stay 0.
    out_rows = (num_tokens + 1, num_q_heads)
    if out_init is not None:
        if splits != 1 or out_init.shape != q.shape or out_init.dtype != q.dtype:
            raise ValueError(f"out_init must be [T, Hq, D] {q.shape} in q's dtype {q.dtype} with one KV split "
                             f"(got {out_init.shape} {out_init.dtype}, {splits} splits)")
        # No extra row: masked rows index it (token T) but never store (masked stores touch no memory).
        out_init = [out_init]
        out_specs = [whole(q.shape)]
    elif splits == 1:
        out_init = [jnp.zeros((*out_rows, head_dim), q.dtype)]
        out_specs = [whole((*out_rows, head_dim))]
    else:
        out_init = [jnp.zeros((splits, *out_rows, head_dim), jnp.float32),
                    jnp.full((splits, *out_rows), -jnp.inf, jnp.float32)]
        out_specs = [pl.BlockSpec((None, *out_rows, head_dim), lambda w, h, s: (s, 0, 0, 0)),
                     pl.BlockSpec((None, *out_rows), lambda w, h, s: (s, 0, 0))]
    v_spec = pl.BlockSpec((None, v_rows, v_cols), lambda w, h, s: (h, 0, 0))
    in_specs = [whole(tiles.meta.shape), whole(page_tables.shape), whole(q.shape), cache_spec, v_spec]
    in_specs += [whole(x.shape) for x in out_init]
    num_inputs = len(in_specs) - len(out_init)
    results = pl.pallas_call(
        functools.partial(_split_init_refs, kernel, num_init=len(out_init)),
        grid=(num_tiles, num_kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in out_init],
        input_output_aliases={num_inputs + i: i for i in range(len(out_init))},
        compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(tiles.meta, page_tables, q, k_flat, v_flat, *out_init)
    if splits == 1:
        return results[0][:num_tokens]
    if sizes.merge_kernel:  # one launch instead of XLA's reductions and divide
        return merge_splits_gpu(results[0], results[1], cu_q_lens, num_tokens=num_tokens, dtype=q.dtype,
                                interpret=interpret)
    out = wt.combine_splits(results[0][:, :num_tokens], results[1][:, :num_tokens], precision=precision)
    return out.astype(q.dtype)


def _split_init_refs(kernel, *refs, num_init: int):
    """Drop the aliased init inputs (the outputs are the same buffers) before calling the kernel."""
    return kernel(*refs[:5], *refs[5 + num_init:])


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_q", "block_kv", "num_splits",
                     "num_warps", "num_stages", "prefetch_pages", "merge_kernel", "interpret", "fp8_widen_to",
                     "kv_write", "v_layout"),
    donate_argnames=("k_pages", "v_pages"),
)
def ragged_paged_attention_gpu(
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
    merge_kernel: bool | None = None,
    interpret: bool = False,
    fp8_widen_to: str = "float16",
    kv_write: str = "xla",
    v_layout: str = "token_major",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Same contract as ``ragged_paged_attention_reference``; the cache is donated and updated in place.

    Tile sizes default to the tuned table; any of them can be forced for sweeps and tests.
    ``interpret=True`` runs the kernel through Pallas's interpreter (CPU tests). Float8 pages take
    their own measured sizes (``gpu_block_sizes(kv_itemsize=1)``) and widen tiles as
    ``fp8_widen_to`` says (``fp8_tile_dtype``). ``kv_write``: the new K/V's write, XLA's two
    scatters (``"xla"``) or one Pallas launch (``"pallas"``, opt-in): ``gpu_write_kv.write_kv``.
    ``v_layout="dim_major"``: V pages stored ``[Hkv, P, D, page_size]`` (``v_layout.py``, opt-in).
    """
    check_inputs(q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, v_layout)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"the GPU kernel needs a power-of-two head_dim (Triton tiles), got {head_dim}")
    tuned = gpu_block_sizes(
        num_tokens=num_tokens, max_num_seqs=kv_lens.shape[0], max_kv_len=page_tables.shape[1] * page_size,
        num_kv_heads=num_kv_heads, group=num_q_heads // num_kv_heads, head_dim=head_dim,
        page_size=page_size, itemsize=q.dtype.itemsize, kv_itemsize=k_pages.dtype.itemsize,
    )
    sizes = BlockSizes(
        block_q=block_q or tuned.block_q,
        block_kv=block_kv or tuned.block_kv,
        num_splits=num_splits or tuned.num_splits,
        num_warps=num_warps or tuned.num_warps,
        num_stages=num_stages or tuned.num_stages,
    )
    mechanisms = default_kernel_mechanisms(sizes)  # for the split count in force, unless forced
    sizes = dataclasses.replace(
        sizes, prefetch_pages=mechanisms.prefetch_pages if prefetch_pages is None else prefetch_pages,
        merge_kernel=mechanisms.merge_kernel if merge_kernel is None else merge_kernel)
    return attend_and_write_gpu(
        q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, sizes=sizes, interpret=interpret, fp8_widen_to=fp8_widen_to,
        kv_write=kv_write, v_layout=v_layout,
    )


def attend_and_write_gpu(
    q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *, sm_scale, sliding_window=None,
    soft_cap=None, sizes: BlockSizes, interpret: bool = False, fp8_widen_to: str = "float16", kv_write: str = "xla",
    v_layout: str = "token_major",
):
    """This step's K/V written into the cache (``gpu_write_kv.write_kv``: XLA's two scatters, or
    one Pallas launch), then ``attend_gpu``. Returns (out, k_pages, v_pages).

    Same signature as ``gpu_fused.attend_and_write_gpu`` (less ``kv_write``), so benchmarks time
    either at given sizes. The write is in place only when the caller's jit donates the cache.
    """
    k_pages, v_pages = write_kv(k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, kv_write=kv_write,
                                interpret=interpret, v_layout=v_layout)
    out = attend_gpu(
        q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, sizes=sizes, interpret=interpret, fp8_widen_to=fp8_widen_to,
        v_layout=v_layout,
    )
    return out, k_pages, v_pages

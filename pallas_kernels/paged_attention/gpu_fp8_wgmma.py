"""Paged decode attention over fp8 (e4m3) pages with e4m3 ``wgmma`` (Pallas Mosaic GPU, Hopper).

Not used by the engine: issue 18's decode-kernel candidate, measured against the engine's
Pallas-Triton kernel by ``benchmarks/fp8_wgmma_decode.py``. The Triton kernel widens every fp8
tile to f16 before its dots; here both dots multiply e4m3 operands as loaded, so no K or V value
is ever converted (only the query, once per program, and the softmax weights are rounded to e4m3).

Inputs (decode only: one query token per sequence slot)
-------------------------------------------------------
``q [B, Hq, D]`` (f32/bf16/f16): slot ``b``'s query. ``k_pages [Hkv, num_pages, page_size, D]``
e4m3 as in ``reference.py``. ``v_pages_t [Hkv, num_pages, D, page_size]`` e4m3: **V pages stored
transposed** (each page's tokens contiguous for every feature). ``lengths [B]`` int32: tokens of
slot ``b`` in the cache (0: an empty slot, output zero). ``page_tables [B, pages_per_seq]`` int32.
``k_scale``/``v_scale``: the cache's per-layer dequantisation scales (``value = stored * scale``).
Output ``[B, Hq, D]`` in q's dtype.

Why these layouts. On sm_90 an 8-bit ``wgmma`` reads both operands from shared memory *K-major*
(the contracted dimension contiguous); it cannot transpose 8-bit tiles the way it does 16-bit
ones. Scores ``S = Q K^T`` contract over ``D``: K pages as stored are already K-major for the B
operand (rows = tokens, ``D`` contiguous), and so is Q. The output ``O = P V`` contracts over
*tokens*: the B operand must have tokens contiguous, which a ``[page_size, D]`` V page does not;
a ``[D, page_size]`` page does. Hence ``v_pages_t``.

How it maps to Hopper. One program (one warpgroup) serves one sequence, one KV head and one
KV split (flash-decoding). ``plgpu.emit_pipeline`` walks the split ``pages_per_step`` pages a
step (64 tokens at page 16); each page of K and of V is its own TMA copy whose GMEM coordinate
is the physical page read from the page table inside the BlockSpec's ``index_map``. Per step:

- scores: one ``wgmma`` per page, ``[64, D] x [D, page_size]`` into columns of one ``[64, T]``
  accumulator. The A operand is the GQA group's query heads, rounded to e4m3 per head, as rows
  of a 64-row tile (wgmma's M is 64 per warpgroup; see "Orientation" below);
- online softmax in f32 registers (exp2, running max per row; only a sequence's last step masks);
- output: one ``wgmma`` per page, ``[64, W] x [W, D / f]``. The A operand is that page's softmax
  weights, scaled by 448 and rounded to e4m3 (``p_smem``; the GPU interpreter takes wgmma
  operands from shared memory only). With ``row_sums="mma"`` one more ``[64, W] x [W, 8]``
  wgmma a page, against a ones tile, gives the denominators' increments.

Pages of 16 tokens (``f = 2``). An e4m3 ``wgmma`` contracts 32 values per instruction and its
shared-memory rows must be at least 32 bytes (the narrowest swizzle); a transposed page of 16
tokens has rows of 16 bytes, and pages are separate TMA copies, so two pages cannot be laid side
by side in one swizzled row. The page is read instead as ``[D / 2, 32]`` (a free reshape of its
2 KiB): row ``n`` holds features ``2n`` and ``2n + 1``, 16 tokens each. Its A operand is built
to match: the query heads are written twice into the 64-row tile (rows ``g`` and ``G + g``), and
row ``h G + g`` of the page's weights holds head ``g``'s 16 weights in columns ``16 h .. 16 h +
15``, zeros in the other 16. Then accumulator row ``h G + g``, column ``n`` is head ``g``'s output
feature ``2 n + h``; the wrapper interleaves the two halves back. Rows are duplicated, never
permuted, so the running max and its rescaling stay per row. The zeros cost tensor-core work
only (which decode has to spare), not bytes. Pages of 32 tokens or more use ``f = 1``.

Orientation (a deviation from the brief that asked for ``S^T = K Q^T``). With tokens on M and
the query heads on N = 8 the tensor cores would waste nothing, but ``P^T`` would have to be stored
transposed from registers into a K-major e4m3 smem tile. Probed through the sm_90 lowering from
CPU (jax 0.11.2): a transposed store of a WGMMA-layout array lowers for f16 but not for e4m3
("Failed to infer a possible set of layouts"), a load through a transposed smem view fails
verification ("most minor memref dim must have unit stride"), and a detour through a transposed
f16 store, reloaded as ``[8, T]`` and stored as e4m3, fails layout inference too.
Query heads on M (as in ``benchmarks/mosaic_gpu_prototype.py``, which lowers and ran on the H200)
costs 64 / (f G) times the needed MMA work: at GQA 4 and 85% of the H200's read ceiling about a
quarter of its dense e4m3 rate, which the MMA pipe can absorb; the softmax works on ``[64, T]``
registers of which ``f G`` rows matter.

Numerics. ``q`` is rounded to e4m3 per query head with scale ``max|q_h| / 448`` (so its largest
element is 448); that scale, ``k_scale``, ``sm_scale`` and log2(e) make one f32 multiplier per row
applied to the f32 scores. The weights ``p = exp2(s - m) <= 1`` (``m``: running row max) are
stored as ``e4m3(448 p)``: a fixed scale, since after the max subtraction every weight lies in
(0, 1], the largest is exact, and a per-row scale would buy nothing. Relative rounding is 2^-4 at
most for ``448 p >= 2^-6`` (p >= 3.5e-5); smaller weights round with absolute error <= 2^-10 / 448
(subnormals), and below 2^-10 / 448 to zero. The row sums add the *rounded* weights (widened back
to f32), so ``O = sum p~ v / sum p~`` is an exact convex combination of V rows with perturbed
weights, never a biased one; the 448 cancels. ``v_scale`` multiplies the output.

Limits: decode only; no sliding window or soft cap; ``head_dim`` 64 or 128; ``page_size`` 16, 32,
64 or 128; GQA group ``G <= 32`` (``f G <= 64``). Tokens past ``lengths[b]`` in the last page are
masked in the scores, but their V rows still enter ``P V`` with weight 0: they must be finite
(an e4m3fn NaN would poison the row). Written pages are always finite (the K/V write saturates),
and an unwritten row holds whatever finite bytes were there; the Triton kernel masks its loads
instead.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_gpu_names
from pallas_kernels.paged_attention import work_tiles as wt

FP8 = jnp.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
_ROWS = 64  # wgmma M for one warpgroup
_MIN_SWIZZLE_BYTES = 32  # Mosaic GPU's narrowest swizzle: an e4m3 wgmma's K group
_MASK_VALUE = -1e30  # finite: an empty split keeps a finite max and a zero output
_LOG2E = math.log2(math.e)
_ONES_COLUMNS = 8  # wgmma's smallest N: the ones tile of the MMA row sums
ROW_SUMS = ("registers", "mma")
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)


def _fp8_smem_transforms(row_bytes: int) -> tuple:
    """wgmma-ready tiling of an e4m3 tile whose rows are ``row_bytes`` long: swizzled by their width."""
    swizzle = min(128, row_bytes)
    return plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle)


def pack_factor(page_size: int) -> int:
    """How many features share one smem row of a transposed V page (``f`` in the module docstring)."""
    return max(1, _MIN_SWIZZLE_BYTES // page_size)


def quantize_query_rows(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Round each query head to e4m3 with its own scale: (``q8 [..., D]`` e4m3, ``scale [...]`` f32).

    ``q ~= q8 * scale``; the largest magnitude of a row becomes 448 (exact in e4m3). All-zero rows
    get scale 1.
    """
    q32 = q.astype(jnp.float32)
    amax = jnp.max(jnp.abs(q32), axis=-1)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q8 = jnp.clip(q32 / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(FP8)
    return q8, scale


def quantize_weights(p: jax.Array) -> jax.Array:
    """Softmax weights in [0, 1] as the kernel feeds them to the tensor cores: ``e4m3(448 p)``."""
    return (p * E4M3_MAX).astype(FP8)


def transpose_v_pages(v_pages: jax.Array) -> jax.Array:
    """``[Hkv, num_pages, page_size, D]`` -> ``[Hkv, num_pages, D, page_size]``: the layout this kernel reads."""
    return jnp.swapaxes(v_pages, -1, -2)


def _decode_kernel(
    page_tables_ref,  # [B, pages_per_seq] int32 (GMEM)
    lengths_ref,  # [B] int32 (GMEM)
    q_ref,  # [B, Hkv, 64, D] e4m3 (GMEM): rows h*G + g hold query head g, h < f
    row_scale_ref,  # [B, Hkv, 64] f32 (GMEM): score multiplier of each row, log2 units
    k_ref,  # [Hkv, num_pages, page_size, D] e4m3 (GMEM)
    v_ref,  # [Hkv, num_pages, D / f, W] e4m3 (GMEM): transposed pages, f features a row
    ones_ref,  # [8, W] e4m3 (GMEM): all 1, the B operand of the row sums when row_sums == "mma"
    out_ref,  # [splits, B, Hkv, f*G, D / f] f32
    lse_ref,  # [splits, B, Hkv, 64] f32
    q_smem,  # [64, D] e4m3
    scale_smem,  # [64] f32
    p_smem,  # [pages_per_step, 64, W] e4m3: this step's weights, one A operand per page
    ones_smem,  # [8, W] e4m3
    barriers,  # 3: the query tile, its row scales, the ones tile
    *, page_size: int, group: int, pack: int, pages_per_step: int, num_splits: int,
    max_concurrent_steps: int, row_sums: str,
):
    seq, kv_head, split = lax.axis_index("seq"), lax.axis_index("kv_head"), lax.axis_index("split")
    head_dim = q_smem.shape[-1]
    row_width = pack * page_size  # W: tokens x features of one smem row of a V page
    tokens_per_step = pages_per_step * page_size
    length = lengths_ref[seq]
    num_pages = pl.cdiv(length, page_size)
    num_steps = pl.cdiv(num_pages, pages_per_step)
    steps_per_split = pl.cdiv(num_steps, num_splits)
    first_step = jnp.minimum(split * steps_per_split, num_steps)
    my_steps = jnp.minimum(first_step + steps_per_split, num_steps) - first_step

    plgpu.copy_gmem_to_smem(q_ref.at[seq, kv_head], q_smem, barriers.at[0])
    plgpu.copy_gmem_to_smem(row_scale_ref.at[seq, kv_head], scale_smem, barriers.at[1])
    if row_sums == "mma":
        plgpu.copy_gmem_to_smem(ones_ref, ones_smem, barriers.at[2])
        plgpu.barrier_wait(barriers.at[2])
    plgpu.barrier_wait(barriers.at[0])
    plgpu.barrier_wait(barriers.at[1])
    row_scale = plgpu.load(scale_smem, layout=plgpu.Layout.WGMMA.reduce(1))  # [64]

    # Which copy of the query heads a row is (h in the module docstring; f = 2 only); rows past f*G are idle.
    row = plgpu.broadcasted_iota(jnp.int32, (_ROWS, page_size), 0, layout=plgpu.Layout.WGMMA)
    row_copy = [(row >= h * group) & (row < (h + 1) * group) for h in range(pack)] if pack > 1 else []

    def body(indices, *refs_and_carry):
        k_pages = refs_and_carry[:pages_per_step]  # each [page_size, D]
        v_pages = refs_and_carry[pages_per_step:2 * pages_per_step]  # each [D / f, W]
        acc, row_max, denom = refs_and_carry[-1]  # [64, D / f] f32, [64], [64] (row max in log2 units)
        (step,) = indices

        def qk(acc_ref):
            for j, k_smem in enumerate(k_pages):
                plgpu.wgmma(acc_ref.at[:, pl.ds(j * page_size, page_size)], q_smem, k_smem.transpose((1, 0)))
            return acc_ref[...]

        scores = pl.run_scoped(qk, plgpu.ACC((_ROWS, tokens_per_step), jnp.float32))  # [64, T]
        scores = scores * lax.broadcast_in_dim(row_scale, scores.shape, [0])
        visible_tokens = length - (first_step + step) * tokens_per_step

        def mask(scores):
            column = plgpu.broadcasted_iota(jnp.int32, scores.shape, 1, layout=plgpu.Layout.WGMMA)
            return jnp.where(column < visible_tokens, scores, _MASK_VALUE)

        # Only a sequence's last step has tokens to mask: the others skip a compare and a select a score.
        scores = lax.cond(visible_tokens < tokens_per_step, mask, lambda scores: scores, scores)
        new_max = jnp.maximum(row_max, scores.max(axis=1))
        correction = jnp.exp2(row_max - new_max)
        weights = jnp.exp2(scores - lax.broadcast_in_dim(new_max, scores.shape, [0]))  # (0, 1]
        # The row sums add what the tensor cores multiply (the rounded weights), so acc / denom
        # stays a convex combination of V rows; the 448 cancels in that ratio.
        if row_sums == "registers":
            scaled = quantize_weights(weights).astype(jnp.float32)  # exact e4m3 values, summed here
            step_sum = scaled.sum(axis=1)
        else:
            scaled = weights * E4M3_MAX  # rounded by the cast below, summed by a wgmma

        for j in range(pages_per_step):
            page_weights = scaled[:, j * page_size:(j + 1) * page_size]  # [64, page_size]
            if pack == 1:
                operand = page_weights  # rows past G are idle queries; their output is never read
            else:
                operand = jnp.concatenate([jnp.where(row_copy[h], page_weights, 0.0) for h in range(pack)], axis=1)
            p_smem[j] = operand.astype(FP8)  # [64, W]
        plgpu.commit_smem()

        def pv(acc_ref, sum_ref=None):
            for j, v_smem in enumerate(v_pages):
                plgpu.wgmma(acc_ref, p_smem.at[j], v_smem.transpose((1, 0)))
                if sum_ref is not None:
                    # Every column of P_j . ones is P_j's row sum; with f = 2 each copy of a head's
                    # row holds all the page's weights (in its own half), so the sum is the page's.
                    plgpu.wgmma(sum_ref, p_smem.at[j], ones_smem.transpose((1, 0)))
            return acc_ref[...], (None if sum_ref is None else sum_ref[...])

        if row_sums == "registers":
            step_out, _ = pl.run_scoped(pv, plgpu.ACC((_ROWS, head_dim // pack), jnp.float32))
        else:
            step_out, sums = pl.run_scoped(pv, plgpu.ACC((_ROWS, head_dim // pack), jnp.float32),
                                           plgpu.ACC((_ROWS, _ONES_COLUMNS), jnp.float32))
            step_sum = sums.max(axis=1)  # [64, 8] -> [64]: the columns are equal
        denom = denom * correction + step_sum
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + step_out
        return acc, new_max, denom

    init = (
        plgpu.layout_cast(jnp.zeros((_ROWS, head_dim // pack), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((_ROWS,), _MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )

    def page_index(j):
        # Steps cover whole groups of pages; a group's pages past the sequence's last re-read the
        # last page (in the table, and masked out of the scores) instead of reading past the row.
        def index(i):
            page = jnp.minimum((first_step + i) * pages_per_step + j, num_pages - 1)
            return kv_head, page_tables_ref[seq, page], 0, 0
        return index

    k_specs = [plgpu.BlockSpec((None, None, page_size, head_dim), page_index(j),
                               transforms=_fp8_smem_transforms(head_dim)) for j in range(pages_per_step)]
    v_specs = [plgpu.BlockSpec((None, None, head_dim // pack, row_width), page_index(j),
                               transforms=_fp8_smem_transforms(row_width)) for j in range(pages_per_step)]
    acc, row_max, denom = plgpu.emit_pipeline(
        body, grid=(my_steps,), in_specs=k_specs + v_specs,
        max_concurrent_steps=max_concurrent_steps, init_carry=init,
    )(*([k_ref] * pages_per_step), *([v_ref] * pages_per_step))

    is_live = denom > 0
    safe_denom = jnp.where(is_live, denom, 1.0)

    # Allocated after the pipeline has released its page buffers (as in the bf16 prototype).
    def store(o_smem, lse_smem):  # [64, D / f] f32, [64] f32
        o_smem[...] = acc / lax.broadcast_in_dim(safe_denom, acc.shape, [0])
        # Natural-log units, the weights' 448 taken back out; -inf marks an empty split.
        lse_smem[...] = jnp.where(is_live, (row_max + jnp.log2(safe_denom / E4M3_MAX)) / _LOG2E, -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, pack * group)], out_ref.at[split, seq, kv_head])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, seq, kv_head])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((_ROWS, head_dim // pack), jnp.float32), plgpu.SMEM((_ROWS,), jnp.float32))


def _check_inputs(q, k_pages, v_pages_t, lengths, page_tables, pages_per_step, num_splits):
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, num_q_heads, head_dim], got shape {q.shape}")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    batch, num_q_heads, head_dim = q.shape
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    for name, pages in (("k_pages", k_pages), ("v_pages_t", v_pages_t)):
        if pages.dtype != FP8:
            raise ValueError(f"{name} must be float8_e4m3fn, got {pages.dtype}")
        if pages.ndim != 4:
            raise ValueError(f"{name} must be 4-D, got shape {pages.shape}")
    num_kv_heads, num_pages, page_size, k_head_dim = k_pages.shape
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"page_size (k_pages axis 2) must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
    if k_head_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and k_pages ({k_head_dim}) differ")
    expected_v = (num_kv_heads, num_pages, head_dim, page_size)
    if v_pages_t.shape != expected_v:
        raise ValueError(f"v_pages_t must be transposed pages [Hkv, num_pages, head_dim, page_size] = "
                         f"{expected_v}, got {v_pages_t.shape}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    if pack_factor(page_size) * group > _ROWS:
        raise ValueError(f"the GQA group (num_q_heads / num_kv_heads = {group}) must be at most "
                         f"{_ROWS // pack_factor(page_size)} at page_size {page_size}")
    if page_tables.ndim != 2 or page_tables.shape[0] != batch:
        raise ValueError(f"page_tables must be [batch={batch}, pages_per_seq], got {page_tables.shape}")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must be ({batch},), got {lengths.shape}")
    for name, array in (("page_tables", page_tables), ("lengths", lengths)):
        if array.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {array.dtype}")
    tokens_per_step = pages_per_step * page_size
    if pages_per_step < 1 or tokens_per_step > 256 or tokens_per_step % 8:
        raise ValueError(f"pages_per_step x page_size must be a multiple of 8 and at most 256 (wgmma's N), "
                         f"got {pages_per_step} x {page_size}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")


def default_pages_per_step(page_size: int) -> int:
    """64 tokens a pipeline step (at least one page): the softmax's fixed cost over 4 pages of 16."""
    return max(1, 64 // page_size)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "pages_per_step", "num_splits", "max_concurrent_steps", "row_sums", "interpret"),
)
def paged_decode_fp8_wgmma(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, D] e4m3
    v_pages_t: jax.Array,  # [Hkv, num_pages, D, page_size] e4m3 (transposed pages)
    lengths: jax.Array,  # [B] int32
    page_tables: jax.Array,  # [B, pages_per_seq] int32
    *,
    k_scale: jax.Array | float,
    v_scale: jax.Array | float,
    sm_scale: float,
    pages_per_step: int | None = None,
    num_splits: int = 1,
    max_concurrent_steps: int = 2,
    row_sums: str = "registers",
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:
    """Decode attention of ``q[b]`` over slot ``b``'s first ``lengths[b]`` cached tokens; out [B, Hq, D].

    Layouts, numerics and limits are in the module docstring. ``pages_per_step`` pages are one
    pipeline step (default: 64 tokens); ``num_splits`` programs share each sequence (merged by
    their log-sum-exps); ``max_concurrent_steps`` steps of pages are in flight. ``row_sums``: how the
    softmax denominators add the rounded weights, ``"registers"`` (widened back to f32 and summed)
    or ``"mma"`` (one more small wgmma a page, against a ones tile; same values, fewer register
    operations a score: the benchmark times both). ``interpret``
    runs Pallas's Mosaic GPU interpreter (CPU tests): ``True``, or its parameters (e.g. race detection).
    """
    mosaic_gpu_names.install()  # equal kernels, equal hashes: one compile per process (see that module)
    page_size = k_pages.shape[2]
    pages_per_step = pages_per_step or default_pages_per_step(page_size)
    _check_inputs(q, k_pages, v_pages_t, lengths, page_tables, pages_per_step, num_splits)
    if row_sums not in ROW_SUMS:
        raise ValueError(f"row_sums must be one of {ROW_SUMS}, got {row_sums!r}")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages = k_pages.shape[:2]
    group = num_q_heads // num_kv_heads
    pack = pack_factor(page_size)

    q8, q_scale = quantize_query_rows(q.reshape(batch, num_kv_heads, group, head_dim))  # [B, Hkv, G, D], [B, Hkv, G]
    # The query heads of one KV head, f times, as the first f*G rows of a 64-row wgmma tile.
    q_tiles = jnp.pad(jnp.tile(q8, (1, 1, pack, 1)), ((0, 0), (0, 0), (0, _ROWS - pack * group), (0, 0)))
    score_scale = q_scale * (jnp.asarray(k_scale, jnp.float32) * sm_scale * _LOG2E)
    row_scales = jnp.pad(jnp.tile(score_scale, (1, 1, pack)), ((0, 0), (0, 0), (0, _ROWS - pack * group)))
    # Free reshape: a transposed page's [D, page_size] bytes as [D / f, f * page_size].
    v_rows = v_pages_t.reshape(num_kv_heads, num_pages, head_dim // pack, pack * page_size)

    kernel = plgpu.kernel(
        functools.partial(_decode_kernel, page_size=page_size, group=group, pack=pack,
                          pages_per_step=pages_per_step, num_splits=num_splits,
                          max_concurrent_steps=max_concurrent_steps, row_sums=row_sums),
        out_type=(jax.ShapeDtypeStruct((num_splits, batch, num_kv_heads, pack * group, head_dim // pack), jnp.float32),
                  jax.ShapeDtypeStruct((num_splits, batch, num_kv_heads, _ROWS), jnp.float32)),
        scratch_types=(
            plgpu.SMEM((_ROWS, head_dim), FP8, transforms=_fp8_smem_transforms(head_dim)),
            plgpu.SMEM((_ROWS,), jnp.float32),
            plgpu.SMEM((pages_per_step, _ROWS, pack * page_size), FP8,
                       transforms=_fp8_smem_transforms(pack * page_size)),
            plgpu.SMEM((_ONES_COLUMNS, pack * page_size), FP8, transforms=_fp8_smem_transforms(pack * page_size)),
            plgpu.Barrier(num_barriers=3),
        ),
        grid=(batch, num_kv_heads, num_splits),
        grid_names=("seq", "kv_head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                   else plgpu.InterpretGPUParams() if interpret else None),
    )
    ones = jnp.ones((_ONES_COLUMNS, pack * page_size), FP8)
    out, lse = kernel(page_tables, lengths, q_tiles, row_scales, k_pages, v_rows, ones)
    # Row h*G + g, column n of a KV head's block is head g's feature n*f + h.
    out = out.reshape(num_splits, batch, num_kv_heads, pack, group, head_dim // pack)
    out = jnp.moveaxis(out, 3, -1).reshape(num_splits, batch, num_q_heads, head_dim)
    lse = lse[..., :group].reshape(num_splits, batch, num_q_heads)
    out = out[0] if num_splits == 1 else wt.combine_splits(out, lse)
    return (out * jnp.asarray(v_scale, jnp.float32)).astype(q.dtype)

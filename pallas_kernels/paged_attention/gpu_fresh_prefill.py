"""Prefill-heavy GPU steps: fresh prompts through cuDNN's or a Mosaic GPU flash attention, the rest through Triton.

Why: the Pallas-Triton kernel (``gpu.py``) reaches 18-40% of the H200's bf16 matmul rate on
prefill, cuDNN's flash attention 379-578 TFLOP/s (``benchmarks/results/kernel_attention.md``).
jax bundles an FA3-style Mosaic GPU kernel (``jax.experimental.pallas.ops.gpu.attention_mgpu``:
two consumer warpgroups and a TMA producer warpgroup, causal blocks unmasked off the diagonal).
It takes dense ``[batch, L, heads, D]`` inputs, causal from row 0 of both q and K/V, so it
fits exactly one case of the engine's ragged step: a *fresh* prompt (no cached prefix, so
every K/V it reads is in this step's ``k_new``/``v_new``, contiguous in the packed rows).
``benchmarks/prefill_peers.py`` times the path against cuDNN and the bundled kernel alone, and
(``NxL`` shapes) a step of several fresh prompts; ``benchmarks/prefill_engine.py`` times it inside
the engine (compile, TTFT, a prefill-heavy mix). ``"auto"`` on Hopper
(``jaxinfer.attention.HOPPER_AUTO_IMPL``) runs the cuDNN segments variant (below) since session 17;
``impl="pallas_gpu_fresh_prefill"`` runs this path by name.

How one step runs, all on device, shapes static:

1. the new K/V are written into the pages (XLA scatter, as ``gpu.py``);
2. ``fresh_prompts.choose_slots`` picks one of a few static *branches* (a window length from a
   ladder of multiples of 128 growing by sqrt(2), and a number of slots: 1, 2, 4, ... up to how
   many prompts that length can take in the step, capped by ``max_fresh_prompts``) and the
   prompts it takes (``q_len == kv_len >= min_fresh_tokens``, at most ``L`` rows and more than
   ``L / sqrt(max_window_waste)``): the one whose *gain* is largest, the paged kernel's work it
   removes (``sum n^2``) less the windows' (``slots * L^2 / max_window_waste``: an empty slot
   costs a whole window, since the bundled kernel computes every row it is given);
3. the Triton kernel serves everything else: the taken prompts' work tiles are emptied
   (``fresh_prompts.hide_served``), so their rows stay 0 and no program walks their K/V;
4. one ``lax.switch``: branch 0 (nothing taken) keeps the Triton output; branch i gathers
   ``slots x L`` rows (each slot from its prompt's first row) out of q/k_new/v_new, runs the
   bundled kernel once on ``[slots, L, H, D]``, and scatters each prompt's rows into the Triton
   output in place. Rows of a window past its prompt are zeros (later in causal order, they
   never reach the prompt's own rows) and are dropped.

So a step of eight 1000-token prompts (throughput-1k) runs one ``[8, 1024]`` call, a lone 5000-token
prompt a ``[1, 6528]`` one. The branches number at most ``len(lengths) * (log2(max_fresh_prompts) + 2)``
(an 8192-row step: 18, against 7 with ``max_fresh_prompts=1``, the path before session 11), each a
bundled kernel to compile per prefill-heavy program; the windows of a branch hold at most
``sqrt(max_window_waste)`` times the step's rows.

Costs around the kernel, per call (session 8 measured ~200 us of them at 4k tokens beside the
kernel's 301 us, when the path sliced and padded whole arrays and branched twice): a max-abs
reduction over q/k_new/v_new (the float16 check), the Triton launch over emptied tiles with its
zeroed output, the windows' gather-and-convert (q: ``slots x L x Hq x D``; K/V: ``Hkv`` heads) and
their scatter back, the choice (a ``top_k`` over the ``[S]`` lengths, ``[branches, slots]``
arithmetic), and one device conditional. On the GPU a conditional copies its index to the host and
waits (``jaxinfer/runner.py``'s docstring): the dispatch of the rest of the step stalls there, so
the host cannot prepare the next step meanwhile. Two rules keep that off the steps that cannot
gain: a step shorter than ``min_fresh_tokens`` has no branch at all, and neither has a
*decode-like* step (token rows <= sequence slots, as ``gpu_block_sizes`` calls it), so steady
decode never pays it; a prefill-heavy step pays one per layer.

Numerics: the bundled kernel in jax 0.11.2 stages Q/K/V through float16 shared memory whatever
the input dtype (its ``SMEM`` scratch is declared float16, so a bf16 input fails its TMA copy's
dtype check; there is no bf16 variant to call), so the windows are converted to float16 with
``sm_scale`` folded into q (the kernel applies no scale), and the output converted back.
float16 has more mantissa than bf16 but a range of 65504: a step whose q, k or v exceed it
takes the Triton path (checked on device, folded into the branch index).

FP8 pages (e4m3, ``kv_cache_dtype="fp8"``): the dispatcher (``jaxinfer.attention``) has already
quantized ``k_new``/``v_new`` with the layer's ``k_scale``/``v_scale`` exactly as the pages store
them (saturating at 448), folded ``k_scale`` into q and will multiply the output by ``v_scale``.
So the window reads the same e4m3 values the paged kernel would read from the pages, and widens
them, exactly (every e4m3 value is a float16 and a bf16): to float16 for the bundled kernel (which
needs no range check for them), to q's dtype for ours. The numerics are those of the paged kernel
over the pages, which widens its e4m3 tiles to float16 too.

Branchless variant (``branchless=True``, ``impl="pallas_gpu_fresh_prefill_branchless"``,
``attend_with_fresh_window``): our own window kernel (``gpu_fresh_window.py``) takes, per 64-row
query block, where its prompt starts (``first_block``), so the step's fresh prompts (the longest
``max_fresh_prompts``) are packed one after another on 64-row blocks into one static window of
``round_up(T, 64) + 64 * (slots - 1)`` rows, each served whole (Triton keeps none of their rows);
empty room is dead blocks, whose programs exit at once. It runs on every prefill-heavy step and
needs no branch, no window ladder, no float16 copies and no range check; its work follows the
prompts. Its kernel is the one-warpgroup prototype, slower than the bundled one (docs/KERNELS.md).

cuDNN variant (``cudnn=True``, ``impl="pallas_gpu_fresh_prefill_cudnn"``): the same branches and
prompts, each window through cuDNN's flash attention (``causal_attention_cudnn``) in bf16, so no
float16 copies and no range check. Session 16 measured it faster than the bundled kernel where the
window is the prompt (4k: 417 vs 511 us a call) and found cuDNN computing every query row of a
padded window, so it keeps the ladder (docs/KERNELS.md).

cuDNN segments variant (``cudnn_segments=True``, ``impl="pallas_gpu_fresh_prefill_cudnn_segments"``,
``attend_with_fresh_segments``; Hopper's default since session 17): no window at all. cuDNN's packed
(THD) layout takes the step's own q/k_new/v_new as one batch row holding up to ``max_fresh_prompts``
segments (ragged offsets: each prompt's first row and length), each causal within itself, so the
fresh prompts (>= ``SEGMENTS_MIN_FRESH_TOKENS`` rows, the longest first) are attended where they lie:
no gather, no padding, no float16 copies, no device conditional, no kernel of ours to compile, and
cuDNN's tiles follow the prompts' rows. Triton serves everything else (the served prompts' tiles
emptied as above) and, with one KV split, writes its rows into cuDNN's output in place (session 18:
no select reading both outputs, no zero fill; the padding rows, which cuDNN leaves unwritten, are
zeroed by ``gpu_zero_rows``). Measured on the H200 (session 18, full call against cuDNN alone on a
contiguous cache, same run): 4k 319 vs 285 us, 8k 1006 vs 938, 16k 3936 vs 3711, 32k 15036 vs 14521,
a ragged 16k batch 1200 vs 1357, eight 1000-token prompts 307 vs 414; the select join of session 17,
in the same run, 354 / 1116 / 4054 / 15339 / 1431 / 377 (docs/KERNELS.md).

Limits: chunks over a cached prefix stay with Triton; no sliding window or soft cap; bf16/f16
queries over bf16/f16 or e4m3 pages; head_dim a multiple of 64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic_gpu_names
from pallas_kernels.paged_attention import fresh_prompts as fpr
from pallas_kernels.paged_attention import work_tiles as wt
from pallas_kernels.paged_attention.block_sizes import BlockSizes, gpu_block_sizes
from pallas_kernels.paged_attention.fresh_prompts import (  # noqa: F401  re-exported: callers know them here
    MAX_FRESH_PROMPTS, WINDOW_MULTIPLE, fresh_prefill_lengths, window_branches,
)
from pallas_kernels.paged_attention.gpu import attend_gpu
from pallas_kernels.paged_attention.gpu_fresh_window import packed_causal_attention_mosaic_gpu
from pallas_kernels.paged_attention.gpu_zero_rows import zero_rows_from
from pallas_kernels.paged_attention.page_storage import E4M3
from pallas_kernels.paged_attention.gpu_write_kv import write_kv
from pallas_kernels.paged_attention.validation import check_inputs

# Shorter fresh prompts stay with Triton. A guess: measured gains start at 4k (session 8: 1.1x);
# prefill_peers.py's 2k row and its multi-prompt rows (8 x 1000 tokens) are what should move it.
MIN_FRESH_TOKENS = 1024
# The cuDNN segments path has no window to waste, so it takes shorter prompts: on the H200 (session 17,
# prefill_peers) eight 1000-token prompts took 376 us there against Triton's 410 (fp8 pages: 399 vs
# 487), sixteen of 500 tokens 348 against 313, thirty-two of 256 310 against 254.
SEGMENTS_MIN_FRESH_TOKENS = 1000
_FLOAT16_LIMIT = 65504.0
# The fresh kernel's cost follows its window (L^2), Triton's the prompt (n^2). Session 8 measured the
# bundled kernel at 1.85-2.0x Triton's TFLOP/s on 4k-16k chunks; with ~80 us of copies around it at 4k,
# a window of more than ~1.5x the prompt's causal work would be slower than Triton on the prompt.
MAX_WINDOW_WASTE = 1.5


def default_mgpu_config():
    """The bundled kernel's tiles for D=128 (its own benchmark's first choice that fits shared memory)."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    return attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)


def causal_attention_mgpu(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float, config=None) -> jax.Array:
    """Causal attention through jax's bundled Mosaic GPU kernel; q [n, L, Hq, D], k/v [n, L, Hkv, D]; out in q's dtype.

    The kernel applies no softmax scale and reads only float16 (see the module docstring), so
    q is scaled and every input converted here. ``config``: an ``attention_mgpu.TuningConfig``
    with ``causal=True`` (default ``default_mgpu_config()``).
    """
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    mosaic_gpu_names.install()  # equal kernels, equal hashes: one compile per process (see that module)
    config = config or default_mgpu_config()
    if not config.causal:
        raise ValueError("causal_attention_mgpu needs a TuningConfig with causal=True")
    q16 = (q.astype(jnp.float32) * sm_scale).astype(jnp.float16)
    out = attention_mgpu.attention(q16, k.astype(jnp.float16), v.astype(jnp.float16), config)
    return out.astype(q.dtype)


def causal_attention_cudnn(q: jax.Array, k: jax.Array, v: jax.Array, *, sm_scale: float,
                           implementation: str = "cudnn") -> jax.Array:
    """Causal attention through cuDNN's flash attention (``jax.nn.dot_product_attention``); q [n, L, Hq, D],
    k/v [n, L, Hkv, D] (GQA: Hq a multiple of Hkv); out in q's dtype.

    bf16 in directly (no float16 copies, so no range limit); e4m3 K/V (fp8 pages) are widened to
    q's dtype here, exactly. A window's rows past its prompt are zeros, later in causal order, so
    they never reach the prompt's rows. Measured (session 16): cuDNN computes every query row of
    the window, padding masks included, so a window must fit its prompt (the ladder's job).
    ``implementation="xla"``: the same contract on any backend (CPU tests).
    """
    return jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), scale=sm_scale, is_causal=True,
                                        implementation=implementation)


def causal_attention_cudnn_segments(q: jax.Array, k: jax.Array, v: jax.Array, seg_start: jax.Array,
                                    seg_len: jax.Array, *, sm_scale: float, implementation: str = "cudnn") -> jax.Array:
    """Causal attention of a step's fresh prompts where they lie, as segments of its packed rows; q [T, Hq, D],
    k/v [T, Hkv, D] (GQA), ``seg_start``/``seg_len`` [M] each segment's first row and rows (0 rows: none;
    non-empty segments first, disjoint). Out [T, Hq, D] in q's dtype; rows outside every segment are unspecified.

    cuDNN's packed (THD) layout: one batch row of ``T`` tokens holding ``M`` segments (ragged offsets;
    Hopper and later), each attending causally within itself. So no window is gathered, padded or
    scattered back, and cuDNN's tiles follow the segments' rows. jax exposes the packed layout only
    through its private cuDNN wrapper (``jax._src.cudnn.fused_attention_stablehlo``, jax 0.11.2), so
    this is the one place that names it. With ``M = 1`` the wrapper would drop the offsets (it reads
    one segment as "not packed", starting at row 0), so a second, empty segment is added.
    ``implementation="xla"``: the same contract in plain JAX (a segment mask; CPU tests).
    """
    if seg_start.shape[0] == 1:
        seg_start, seg_len = (jnp.concatenate([x, jnp.zeros((1,), x.dtype)]) for x in (seg_start, seg_len))
    k, v = k.astype(q.dtype), v.astype(q.dtype)  # e4m3 K/V (fp8 pages) widen exactly
    if implementation == "xla":
        return _segments_causal_xla(q, k, v, seg_start, seg_len, sm_scale=sm_scale)
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    is_segment = seg_len > 0
    seqlen = jnp.where(is_segment, seg_len, -1).astype(jnp.int32)[None]  # [1, M]: -1 marks no segment
    offsets = jnp.concatenate([jnp.where(is_segment, seg_start, -1), jnp.full((1,), -1, seg_start.dtype)])
    offsets = offsets.astype(jnp.int32)[None]  # [1, M + 1]
    out = cudnn_attention.dot_product_attention(
        q[None], k[None], v[None], q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets,
        scale=sm_scale, mask_type=cudnn_attention.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")
    return out[0]


def _segments_causal_xla(q, k, v, seg_start, seg_len, *, sm_scale):
    """``causal_attention_cudnn_segments``' contract through a dense segment mask ([T, T]: small steps only)."""
    row = jnp.arange(q.shape[0], dtype=jnp.int32)
    segment = _row_segments(row, seg_start, seg_len)  # [T]: -1 outside every segment
    mask = (segment[:, None] == segment[None, :]) & (segment[:, None] >= 0) & (row[:, None] >= row[None, :])
    return jax.nn.dot_product_attention(q[None], k[None], v[None], mask=mask[None, None], scale=sm_scale,
                                        implementation="xla")[0]


def _row_segments(row: jax.Array, seg_start: jax.Array, seg_len: jax.Array) -> jax.Array:
    """The segment each of ``row`` [T] lies in, -1 for none ([T, M] comparisons: M is a few)."""
    inside = (row[:, None] >= seg_start[None, :]) & (row[:, None] < (seg_start + seg_len)[None, :])  # [T, M]
    return jnp.where(jnp.any(inside, axis=1), jnp.argmax(inside, axis=1), -1).astype(jnp.int32)


def step_window_branches(num_tokens: int, num_seqs: int, *, min_fresh_tokens: int = MIN_FRESH_TOKENS,
                         max_fresh_prompts: int = MAX_FRESH_PROMPTS,
                         max_window_waste: float = MAX_WINDOW_WASTE) -> tuple[fpr.WindowBranch, ...]:
    """The window branches a step of ``num_tokens`` rows and ``num_seqs`` sequence slots compiles
    (``attend_with_fresh_prefill``): none for a decode-like step, else ``fresh_prompts.window_branches``."""
    if not _more_rows_than_slots(num_tokens, num_seqs):
        return ()
    return fpr.window_branches(num_tokens, min_fresh_tokens, max_fresh_prompts, max_window_waste)


def lower_window_kernel(branch: fpr.WindowBranch, num_q_heads: int, num_kv_heads: int, head_dim: int,
                        platform: str | None = None) -> jax.stages.Lowered:
    """The bundled kernel of one window branch as a program of its own, lowered for ``platform``
    (default: this backend; tests lower for "cuda" on a CPU).

    Compiled, it leaves the kernel in jaxlib's process-wide Mosaic GPU cache under the same hash as
    the branch inside a step program (``mosaic_gpu_names``), so a step compiled after it finds the
    kernel there instead of compiling it again: the engine's warm-up compiles these early, in
    parallel, rather than each large step program compiling its branches one after another.
    """
    q = jax.ShapeDtypeStruct((branch.num_slots, branch.length, num_q_heads, head_dim), jnp.float16)
    kv = jax.ShapeDtypeStruct((branch.num_slots, branch.length, num_kv_heads, head_dim), jnp.float16)
    traced = jax.jit(functools.partial(causal_attention_mgpu, sm_scale=1.0)).trace(q, kv, kv)
    return traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()


def _fits_float16(*xs: jax.Array) -> jax.Array:
    return functools.reduce(jnp.logical_and, [jnp.max(jnp.abs(x.astype(jnp.float32))) < _FLOAT16_LIMIT for x in xs])


def is_prefill_heavy(num_tokens: int, kv_lens: jax.Array) -> bool:
    """Static: more token rows than sequence slots. A decode-like step (rows <= slots) never
    takes the fresh path, so it compiles with no device conditional (see the module docstring)."""
    return _more_rows_than_slots(num_tokens, kv_lens.shape[0])


def _more_rows_than_slots(num_tokens: int, num_seqs: int) -> bool:
    return num_tokens > num_seqs


def _take_rows(x: jax.Array, source: jax.Array, dtype=None) -> jax.Array:
    """``x[source]`` [*source.shape, ...], 0 where ``source`` is out of range, converted to ``dtype`` on the way.

    Only the window's rows are read: rows past a prompt read 0 (later in causal order than its
    rows, they never reach them; 0, not whatever a padded step holds there, since 0 * NaN would).
    """
    rows = jnp.take(x, source, axis=0, mode="fill", fill_value=0)
    return rows if dtype is None else rows.astype(dtype)


def _merge_rows(rest: jax.Array, window_out: jax.Array, dest: jax.Array) -> jax.Array:
    """``rest`` [T, Hq, D] with rows ``dest`` set from ``window_out`` [*dest.shape, Hq, D]; out-of-range rows dropped.

    A scatter into ``rest`` in place (its buffer is dead after this), converting on the way.
    """
    return rest.at[dest].set(window_out.astype(rest.dtype), mode="drop", unique_indices=True)


def attend_with_fresh_prefill(
    q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *, sm_scale, sizes: BlockSizes,
    min_fresh_tokens: int, fresh_attend=causal_attention_mgpu, interpret: bool = False,
    max_window_waste: float = MAX_WINDOW_WASTE, max_fresh_prompts: int = MAX_FRESH_PROMPTS,
    float16_window: bool = True, v_layout: str = "token_major",
):
    """Attention of a step whose K/V are already in the pages; up to ``max_fresh_prompts`` fresh prompts
    through ``fresh_attend`` in one batched call, everything else through Triton.

    The branch (window length, slots) and its prompts come from ``fresh_prompts.choose_slots``: a
    prompt stays with Triton when its window's causal work exceeds ``max_window_waste`` times its
    own, and a branch with empty slots is taken only if its gain still is not negative.

    ``fresh_attend(q [c, L, Hq, D], k [c, L, Hkv, D], v, *, sm_scale) -> [c, L, Hq, D]``: causal
    attention of ``c`` windows (tests pass a CPU-runnable one). ``interpret`` runs the Triton kernel
    in Pallas's interpreter. ``float16_window``: ``fresh_attend`` computes in float16 (the bundled
    kernel), so a step whose q, k or v exceed its range stays with Triton (checked on device); False
    for a window attention that takes q's dtype (cuDNN). Returns out [T, Hq, D].

    One device-side branch (``lax.switch``: branch 0 keeps the Triton output, branch i runs the
    windows of ``branches[i - 1]``), because on the GPU every conditional copies its index to the
    host and waits for it (``jaxinfer/runner.py``'s docstring): the dispatch of the rest of the
    step stalls there. Around the fresh kernel only the windows' rows are touched: gathered
    (and converted) from q/k_new/v_new, scattered (and converted) into the Triton output in place.
    """
    num_tokens = q.shape[0]
    tiles = wt.plan_work_tiles(cu_q_lens, kv_lens, num_tokens, sizes.block_q)
    branches = step_window_branches(num_tokens, kv_lens.shape[0], min_fresh_tokens=min_fresh_tokens,
                                    max_fresh_prompts=max_fresh_prompts, max_window_waste=max_window_waste)
    attend_rest = functools.partial(attend_gpu, q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens,
                                    sm_scale=sm_scale, sizes=sizes, interpret=interpret, v_layout=v_layout)
    if not branches:
        return attend_rest(tiles=tiles)
    slots = fpr.choose_slots(cu_q_lens, kv_lens, branches, min_fresh_tokens=min_fresh_tokens,
                             max_window_waste=max_window_waste)
    if float16_window:
        # e4m3 K/V (fp8 pages) always fit float16 (|x| <= 448), and widen to it exactly.
        fits = _fits_float16(q.astype(jnp.float32) * sm_scale, *[x for x in (k_new, v_new) if x.dtype != E4M3])
        slots = fpr.FreshSlots(branch=jnp.where(fits, slots.branch, 0), seq=slots.seq, token_start=slots.token_start,
                               num_tokens=slots.num_tokens, served=jnp.where(fits, slots.served, 0))
    rest = attend_rest(tiles=fpr.hide_served(tiles, slots.served))  # [T, Hq, D]; the taken prompts' rows are 0

    def window(branch: fpr.WindowBranch):
        def attend(rest):
            source, dest = fpr.slot_rows(slots, branch.num_slots, branch.length, num_tokens)  # [c, L] each
            out = fresh_attend(_take_rows(q, source), _take_rows(k_new, source), _take_rows(v_new, source),
                               sm_scale=sm_scale)  # [c, L, Hq, D]
            return _merge_rows(rest, out, dest)
        return attend

    return lax.switch(slots.branch, [lambda rest: rest] + [window(b) for b in branches], rest)


def _whole_prompt_slots(num_tokens: int, cu_q_lens, kv_lens, *, min_fresh_tokens: int,
                        max_fresh_prompts: int) -> fpr.FreshSlots | None:
    """The step's longest fresh prompts (up to ``max_fresh_prompts`` of ``>= min_fresh_tokens``) that another
    kernel serves whole (``fresh_prompts.choose_packed``); None where the step can hold none or is decode-like."""
    num_slots = fpr.max_fresh_prompts_in(num_tokens, min_fresh_tokens, max_fresh_prompts)
    if num_slots == 0 or not is_prefill_heavy(num_tokens, kv_lens):
        return None
    return fpr.choose_packed(cu_q_lens, kv_lens, num_slots=num_slots, min_fresh_tokens=min_fresh_tokens)


def _triton_beside_whole_prompts(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *, sm_scale, sizes, interpret,
                                 min_fresh_tokens: int, max_fresh_prompts: int, v_layout: str):
    """``(rest, slots)``: the Triton output of a step whose whole-prompt ``slots`` (``_whole_prompt_slots``)
    another kernel serves, their rows left 0; ``slots`` is None where the step can hold none or is
    decode-like, and ``rest`` is then the whole step's output."""
    tiles = wt.plan_work_tiles(cu_q_lens, kv_lens, q.shape[0], sizes.block_q)
    attend_rest = functools.partial(attend_gpu, q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens,
                                    sm_scale=sm_scale, sizes=sizes, interpret=interpret, v_layout=v_layout)
    slots = _whole_prompt_slots(q.shape[0], cu_q_lens, kv_lens, min_fresh_tokens=min_fresh_tokens,
                                max_fresh_prompts=max_fresh_prompts)
    if slots is None:
        return attend_rest(tiles=tiles), None
    return attend_rest(tiles=fpr.hide_served(tiles, slots.served)), slots  # [T, Hq, D]


def attend_with_fresh_window(
    q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *, sm_scale, sizes: BlockSizes,
    min_fresh_tokens: int, window_attend=packed_causal_attention_mosaic_gpu, interpret: bool = False,
    max_fresh_prompts: int = MAX_FRESH_PROMPTS, v_layout: str = "token_major",
):
    """As ``attend_with_fresh_prefill``, with no device conditional: our window kernel runs on every
    prefill-heavy step over one static window, packed with up to ``max_fresh_prompts`` fresh prompts,
    and does work only for their blocks.

    ``window_attend(q [1, W, Hq, D], k [1, W, Hkv, D], v, first_block [1, W / 64], *, sm_scale)``:
    ``packed_causal_attention_mosaic_gpu``'s contract (rows of dead blocks are not read). The prompts
    (the first fresh ones in batch order) are laid on 64-row blocks one after another
    (``fresh_prompts.pack_prompts``), each served whole, so Triton keeps none of their tiles; with
    nothing taken every block is dead: one launch of programs that exit. Inputs stay in q's dtype
    (e4m3 K/V are widened to it, exactly): no float16 copies, no range check.
    """
    num_tokens = q.shape[0]
    rest, slots = _triton_beside_whole_prompts(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale,
                                               sizes=sizes, interpret=interpret, min_fresh_tokens=min_fresh_tokens,
                                               max_fresh_prompts=max_fresh_prompts, v_layout=v_layout)
    if slots is None:
        return rest
    num_slots = slots.seq.shape[0]
    length = fpr.packed_window_length(num_tokens, num_slots)
    source, dest, first_block = fpr.pack_prompts(slots, length, num_tokens)  # [W], [W], [W / 64]
    take = lambda x: _take_rows(x, source, q.dtype)[None]  # noqa: E731  [1, W, H, D]
    out = window_attend(take(q), take(k_new), take(v_new), first_block[None], sm_scale=sm_scale)[0]
    return _merge_rows(rest, out, dest)


def attend_with_fresh_segments(
    q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *, sm_scale, sizes: BlockSizes,
    min_fresh_tokens: int, segment_attend=causal_attention_cudnn_segments, interpret: bool = False,
    max_fresh_prompts: int = MAX_FRESH_PROMPTS, v_layout: str = "token_major",
):
    """As ``attend_with_fresh_window``, with cuDNN's flash attention over the step's own rows: the fresh
    prompts (the ``max_fresh_prompts`` longest of ``>= min_fresh_tokens``) are segments of the packed
    q/k_new/v_new, served whole, with no window, gather, scatter or device conditional; Triton serves
    the rest.

    With one KV split (prefill-heavy steps) Triton writes its rows into cuDNN's output in place
    (``attend_gpu(out_init=...)``), so the two outputs are never read again to be joined; the rows
    past the step's tokens, which cuDNN leaves unwritten, are zeroed first (``gpu_zero_rows``: a launch
    that writes those rows only), so every row is defined as on the other paths. With more splits a
    select joins them.

    ``segment_attend(q [T, Hq, D], k [T, Hkv, D], v, seg_start [M], seg_len [M], *, sm_scale)``:
    ``causal_attention_cudnn_segments``' contract (tests pass its ``implementation="xla"``).
    """
    num_tokens = q.shape[0]
    if sizes.num_splits != 1:
        rest, slots = _triton_beside_whole_prompts(
            q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale, sizes=sizes, interpret=interpret,
            min_fresh_tokens=min_fresh_tokens, max_fresh_prompts=max_fresh_prompts, v_layout=v_layout)
        if slots is None:
            return rest
        out = segment_attend(q, k_new, v_new, slots.token_start, slots.num_tokens, sm_scale=sm_scale)
        row = jnp.arange(num_tokens, dtype=jnp.int32)
        is_served = _row_segments(row, slots.token_start, slots.num_tokens) >= 0  # [T]
        return jnp.where(is_served[:, None, None], out.astype(rest.dtype), rest)
    tiles = wt.plan_work_tiles(cu_q_lens, kv_lens, num_tokens, sizes.block_q)
    attend = functools.partial(attend_gpu, q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale,
                               sizes=sizes, interpret=interpret, v_layout=v_layout)
    slots = _whole_prompt_slots(num_tokens, cu_q_lens, kv_lens, min_fresh_tokens=min_fresh_tokens,
                                max_fresh_prompts=max_fresh_prompts)
    if slots is None:
        return attend(tiles=tiles)
    out = segment_attend(q, k_new, v_new, slots.token_start, slots.num_tokens, sm_scale=sm_scale).astype(q.dtype)
    out = zero_rows_from(out, cu_q_lens[-1], interpret=interpret)  # the padding rows, which cuDNN leaves unwritten
    return attend(tiles=fpr.hide_served(tiles, slots.served), out_init=out)


def can_take_fresh_prefill(q_dtype, page_dtype, head_dim: int, sliding_window, soft_cap) -> bool:
    """Whether a step of these static properties may use the fresh-prefill kernel at all.

    Pages of bf16/f16, or e4m3 (fp8 pages: the window's K/V are this step's e4m3 ``k_new``/``v_new``,
    as the pages hold them, widened exactly; see the module docstring).
    """
    half = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return (jnp.dtype(q_dtype) in half and jnp.dtype(page_dtype) in (*half, E4M3) and head_dim % 64 == 0
            and sliding_window is None and soft_cap is None)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "min_fresh_tokens", "fresh_attend", "interpret",
                     "max_window_waste", "branchless", "cudnn", "cudnn_segments", "max_fresh_prompts", "kv_write",
                     "v_layout"),
    donate_argnames=("k_pages", "v_pages"),
)
def ragged_paged_attention_gpu_fresh_prefill(
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
    min_fresh_tokens: int = MIN_FRESH_TOKENS,
    fresh_attend=None,
    interpret: bool = False,
    max_window_waste: float = MAX_WINDOW_WASTE,
    branchless: bool = False,
    cudnn: bool = False,
    cudnn_segments: bool = False,
    max_fresh_prompts: int = MAX_FRESH_PROMPTS,
    kv_write: str = "xla",
    v_layout: str = "token_major",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Same contract as ``ragged_paged_attention_reference``; the cache is donated and updated in place.

    ``branchless=False``: the bundled kernel on float16 windows behind one ``lax.switch``
    (``attend_with_fresh_prefill``); ``True``: our window kernel over packed prompts with no
    conditional (``attend_with_fresh_window``); ``cudnn=True``: the bundled path's branches with cuDNN's
    flash attention on bf16 windows (``causal_attention_cudnn``); ``cudnn_segments=True``: cuDNN over the
    fresh prompts where they lie in the step's rows, no windows and no conditional
    (``attend_with_fresh_segments``). ``fresh_attend``: that path's window (or segment) attention
    (default: its own; tests pass CPU-runnable ones). ``max_fresh_prompts``: fresh
    prompts served per step (1: the longest only, as before session 11; the engine passes
    ``fresh_prompts.ENGINE_MAX_FRESH_PROMPTS`` to the window paths, ``MAX_FRESH_PROMPTS`` and
    ``SEGMENTS_MIN_FRESH_TOKENS`` to the segments path). ``min_fresh_tokens``,
    ``max_window_waste`` and ``max_fresh_prompts`` are static, for benchmarks to sweep. Steps the
    fresh kernel cannot serve (see ``can_take_fresh_prefill``) run exactly as
    ``ragged_paged_attention_gpu`` at its tuned sizes (fp8 pages: its fp8 sizes). ``kv_write`` and
    ``v_layout``: as for ``ragged_paged_attention_gpu`` (the fresh prompts' attention reads this
    step's K/V, not the pages, so only the Triton part reads the layout).
    """
    check_inputs(q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, v_layout)
    if branchless + cudnn + cudnn_segments > 1:
        raise ValueError("branchless, cudnn and cudnn_segments name different fresh-prompt paths: pick one")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"the GPU kernel needs a power-of-two head_dim (Triton tiles), got {head_dim}")
    sizes = gpu_block_sizes(
        num_tokens=num_tokens, max_num_seqs=kv_lens.shape[0], max_kv_len=page_tables.shape[1] * page_size,
        num_kv_heads=num_kv_heads, group=num_q_heads // num_kv_heads, head_dim=head_dim,
        page_size=page_size, itemsize=q.dtype.itemsize, kv_itemsize=k_pages.dtype.itemsize,
    )
    k_pages, v_pages = write_kv(k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, kv_write=kv_write,
                                interpret=interpret, v_layout=v_layout)
    if can_take_fresh_prefill(q.dtype, k_pages.dtype, head_dim, sliding_window, soft_cap) and cudnn_segments:
        out = attend_with_fresh_segments(
            q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale, sizes=sizes,
            min_fresh_tokens=min_fresh_tokens, segment_attend=fresh_attend or causal_attention_cudnn_segments,
            interpret=interpret, max_fresh_prompts=max_fresh_prompts, v_layout=v_layout)
    elif can_take_fresh_prefill(q.dtype, k_pages.dtype, head_dim, sliding_window, soft_cap) and branchless:
        out = attend_with_fresh_window(
            q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale, sizes=sizes,
            min_fresh_tokens=min_fresh_tokens, window_attend=fresh_attend or packed_causal_attention_mosaic_gpu,
            interpret=interpret, max_fresh_prompts=max_fresh_prompts, v_layout=v_layout)
    elif can_take_fresh_prefill(q.dtype, k_pages.dtype, head_dim, sliding_window, soft_cap):
        out = attend_with_fresh_prefill(
            q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale, sizes=sizes,
            min_fresh_tokens=min_fresh_tokens,
            fresh_attend=fresh_attend or (causal_attention_cudnn if cudnn else causal_attention_mgpu),
            interpret=interpret, max_window_waste=max_window_waste, max_fresh_prompts=max_fresh_prompts,
            float16_window=not cudnn, v_layout=v_layout)
    else:
        out = attend_gpu(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale,
                         sliding_window=sliding_window, soft_cap=soft_cap, sizes=sizes, interpret=interpret,
                         v_layout=v_layout)
    return out, k_pages, v_pages

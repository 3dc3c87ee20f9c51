"""Opt-in GPU paths: a step's longest fresh prefill through a Mosaic GPU flash attention, the rest through Triton.

Why: the Pallas-Triton kernel (``gpu.py``) reaches 18-40% of the H200's bf16 matmul rate on
prefill, cuDNN's flash attention 379-578 TFLOP/s (``benchmarks/results/kernel_attention.md``).
jax bundles an FA3-style Mosaic GPU kernel (``jax.experimental.pallas.ops.gpu.attention_mgpu``:
two consumer warpgroups and a TMA producer warpgroup, causal blocks unmasked off the diagonal).
It takes dense ``[batch, L, heads, D]`` inputs, causal from row 0 of both q and K/V, so it
fits exactly one case of the engine's ragged step: a *fresh* prefill (no cached prefix, so
every K/V it reads is in this step's ``k_new``/``v_new``, contiguous in the packed rows).
``benchmarks/prefill_peers.py`` times the path against cuDNN and the bundled kernel alone;
``benchmarks/prefill_engine.py`` times it inside the engine (compile, TTFT, a prefill-heavy mix).
Until those decide, it is opt-in (``impl="pallas_gpu_fresh_prefill"``, or
``jaxinfer.attention.HOPPER_AUTO_IMPL`` for ``"auto"``).

How one step runs, all on device, shapes static:

1. the new K/V are written into the pages (XLA scatter, as ``gpu.py``);
2. ``pick_fresh_prefill`` finds the longest sequence with ``q_len == kv_len >= min_fresh_tokens``;
3. the Triton kernel serves every other sequence: the chosen one's work tiles are emptied
   (``hide_sequence``), so its rows stay 0 and no program walks its K/V;
4. one ``lax.switch``: branch 0 (nothing taken) keeps the Triton output; branch i gathers a
   window of ``lengths[i - 1]`` rows from the sequence's first row out of q/k_new/v_new (the
   shortest of a few static lengths that holds it; the kernel's cost is that of the whole
   window), converting them on the way, runs the bundled kernel on it, and scatters its first
   ``q_len`` rows into the Triton output in place. Rows of the window past the sequence are
   zeros (later in causal order, they never reach the sequence's own rows) and are dropped.

Costs around the kernel, per call (session 8 measured ~200 us of them at 4k tokens beside the
kernel's 301 us, when the path sliced and padded whole arrays and branched twice): a max-abs
reduction over q/k_new/v_new (the float16 check), the Triton launch over emptied tiles with its
zeroed output, the window's gather-and-convert (q: ``L x Hq x D``; K/V: ``Hkv`` heads) and its
scatter back, and one device conditional. On the GPU a conditional copies its index to the
host and waits (``jaxinfer/runner.py``'s docstring): the dispatch of the rest of the step
stalls there, so the host cannot prepare the next step meanwhile. Two rules keep that off the
steps that cannot gain: a step shorter than ``min_fresh_tokens`` has no branch at all, and
neither has a *decode-like* step (token rows <= sequence slots, as ``gpu_block_sizes`` calls
it), so steady decode never pays it; a prefill-heavy step pays one per layer.

Numerics: the bundled kernel in jax 0.11.2 stages Q/K/V through float16 shared memory whatever
the input dtype (its ``SMEM`` scratch is declared float16, so a bf16 input fails its TMA copy's
dtype check; there is no bf16 variant to call), so the window is converted to float16 with
``sm_scale`` folded into q (the kernel applies no scale), and the output converted back.
float16 has more mantissa than bf16 but a range of 65504: a step whose q, k or v exceed it
takes the Triton path (checked on device, folded into the branch index).

Branchless variant (``branchless=True``, ``impl="pallas_gpu_fresh_prefill_branchless"``,
``attend_with_fresh_window``): our own window kernel (``gpu_fresh_window.py``) takes the number
of live query blocks as data, so it runs on every prefill-heavy step over one static window of
the whole step and needs no branch, no window ladder, no float16 copies and no range check; it
serves the sequence's rows in whole blocks and leaves the last few to Triton. Its kernel is the
one-warpgroup prototype, slower than the bundled one (docs/KERNELS.md).

Limits: one sequence per step takes the fast path (several fresh prompts in one step: the
longest); no sliding window or soft cap; bf16/f16 pages only; head_dim a multiple of 64.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention import work_tiles as wt
from pallas_kernels.paged_attention.block_sizes import BlockSizes, gpu_block_sizes
from pallas_kernels.paged_attention.gpu import attend_gpu
from pallas_kernels.paged_attention.gpu_fresh_window import causal_window_attention_mosaic_gpu
from pallas_kernels.paged_attention.reference import write_kv_reference
from pallas_kernels.paged_attention.validation import check_inputs

# Shorter fresh prompts stay with Triton. A guess: measured gains start at 4k (session 8: 1.1x);
# prefill_peers.py's 2k row and prefill_engine.py's mix are what should move it.
MIN_FRESH_TOKENS = 1024
WINDOW_MULTIPLE = 128  # the bundled kernel's query tile (two warpgroups of 64 rows) and K/V block
WINDOW_BLOCK = 64  # our window kernel's query and K/V block (gpu_fresh_window.py)
_FLOAT16_LIMIT = 65504.0
_LENGTH_RATIO = math.sqrt(2)  # window lengths grow by this: at most 2x the causal FLOPs, few compiles
# The fresh kernel's cost follows its window (L^2), Triton's the sequence (n^2). Session 8 measured the
# bundled kernel at 1.85-2.0x Triton's TFLOP/s on 4k-16k chunks; with ~80 us of copies around it at 4k,
# a window of more than ~1.5x the sequence's causal work would be slower than Triton on the sequence.
MAX_WINDOW_WASTE = 1.5


def fresh_prefill_lengths(num_tokens: int, min_fresh_tokens: int) -> tuple[int, ...]:
    """Static window lengths compiled for a step of ``num_tokens`` rows, shortest first.

    Each is a multiple of ``WINDOW_MULTIPLE``, about ``sqrt(2)`` times the previous, the last
    covering ``num_tokens``; a sequence of ``n`` tokens runs in the shortest length ``>= n``.
    Empty when the step is shorter than ``min_fresh_tokens`` (no sequence could qualify).
    """
    if min_fresh_tokens < 1:
        raise ValueError(f"min_fresh_tokens must be at least 1, got {min_fresh_tokens}")
    if num_tokens < min_fresh_tokens:
        return ()
    round_up = lambda n: -(-n // WINDOW_MULTIPLE) * WINDOW_MULTIPLE  # noqa: E731
    last = round_up(num_tokens)
    lengths = [min(round_up(min_fresh_tokens), last)]
    while lengths[-1] < last:
        lengths.append(min(round_up(int(lengths[-1] * _LENGTH_RATIO)), last))
    return tuple(lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FreshPrefill:
    """The sequence of a step that the fresh-prefill kernel serves (traced scalars)."""

    is_taken: jax.Array  # [] bool: some sequence qualified
    seq: jax.Array  # [] int32: its slot in the batch
    token_start: jax.Array  # [] int32: its first packed row
    num_tokens: jax.Array  # [] int32: its query rows (0 when none was taken)


def pick_fresh_prefill(cu_q_lens: jax.Array, kv_lens: jax.Array, min_fresh_tokens: int) -> FreshPrefill:
    """The longest sequence whose chunk is its whole context (``q_len == kv_len``), if ``>= min_fresh_tokens``.

    A chunk over a cached prefix (``kv_len > q_len``) reads K/V that are only in the pages, so it
    stays with the paged kernel; padded slots (``q_len == kv_len == 0``) never reach the minimum.
    """
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [S]
    is_fresh = (q_lens == kv_lens) & (q_lens >= min_fresh_tokens)
    seq = jnp.argmax(jnp.where(is_fresh, q_lens, -1)).astype(jnp.int32)
    is_taken = is_fresh[seq]
    return FreshPrefill(is_taken=is_taken, seq=seq, token_start=cu_q_lens[seq],
                        num_tokens=jnp.where(is_taken, q_lens[seq], 0).astype(jnp.int32))


def hide_sequence(tiles: wt.WorkTiles, fresh: FreshPrefill) -> wt.WorkTiles:
    """Empty the taken sequence's work tiles that start below ``fresh.num_tokens`` (all of them unless the
    fresh kernel serves fewer rows): no queries and first position 0, so their programs exit at once.

    A fresh sequence's tile starting at query ``i`` has first position ``i`` (no cached prefix).
    """
    is_hidden = (fresh.is_taken & (tiles.meta[:, wt.SEQ] == fresh.seq)
                 & (tiles.meta[:, wt.FIRST_POS] < fresh.num_tokens))  # [W]
    meta = tiles.meta.at[:, wt.TILE_Q_LEN].set(jnp.where(is_hidden, 0, tiles.meta[:, wt.TILE_Q_LEN]))
    meta = meta.at[:, wt.FIRST_POS].set(jnp.where(is_hidden, 0, meta[:, wt.FIRST_POS]))
    return dataclasses.replace(tiles, meta=meta)


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

    config = config or default_mgpu_config()
    if not config.causal:
        raise ValueError("causal_attention_mgpu needs a TuningConfig with causal=True")
    q16 = (q.astype(jnp.float32) * sm_scale).astype(jnp.float16)
    out = attention_mgpu.attention(q16, k.astype(jnp.float16), v.astype(jnp.float16), config)
    return out.astype(q.dtype)


def _fits_float16(*xs: jax.Array) -> jax.Array:
    return functools.reduce(jnp.logical_and, [jnp.max(jnp.abs(x.astype(jnp.float32))) < _FLOAT16_LIMIT for x in xs])


def is_prefill_heavy(num_tokens: int, kv_lens: jax.Array) -> bool:
    """Static: more token rows than sequence slots. A decode-like step (rows <= slots) never
    takes the fresh path, so it compiles with no device conditional (see the module docstring)."""
    return num_tokens > kv_lens.shape[0]


def window_rows(x: jax.Array, fresh: FreshPrefill, length: int) -> jax.Array:
    """Rows ``token_start .. token_start + length`` of ``x`` [T, ...], zero past the sequence's own rows.

    A gather that reads only the window (rows past the sequence, including past the step's end,
    become 0): the rows of other sequences are later in causal order and never reach the
    sequence's own outputs, but 0 * NaN would, and a padded step may hold anything there.
    """
    offsets = jnp.arange(length, dtype=jnp.int32)
    rows = jnp.where(offsets < fresh.num_tokens, fresh.token_start + offsets, x.shape[0])  # x.shape[0]: filled
    return jnp.take(x, rows, axis=0, mode="fill", fill_value=0)


def merge_window(rest: jax.Array, window_out: jax.Array, fresh: FreshPrefill) -> jax.Array:
    """``rest`` [T, Hq, D] with the sequence's rows replaced by the first ``num_tokens`` rows of ``window_out``.

    A scatter into ``rest`` in place (its buffer is dead after this), converting on the way;
    rows of the window past the sequence go to distinct out-of-range rows and are dropped.
    """
    num_tokens, length = rest.shape[0], window_out.shape[0]
    offsets = jnp.arange(length, dtype=jnp.int32)
    rows = jnp.where(offsets < fresh.num_tokens, fresh.token_start + offsets, num_tokens + offsets)
    return rest.at[rows].set(window_out.astype(rest.dtype), mode="drop", unique_indices=True)


def attend_with_fresh_prefill(
    q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *, sm_scale, sizes: BlockSizes,
    min_fresh_tokens: int, fresh_attend=causal_attention_mgpu, interpret: bool = False,
    max_window_waste: float = MAX_WINDOW_WASTE,
):
    """Attention of a step whose K/V are already in the pages; the longest fresh prefill through ``fresh_attend``.

    The sequence stays with Triton when its window's causal work exceeds ``max_window_waste``
    times its own (``L^2 > max_window_waste * n^2``: a length just past a window length).

    ``fresh_attend(q [1, L, Hq, D], k [1, L, Hkv, D], v, *, sm_scale) -> [1, L, Hq, D]``: causal
    attention of a window (tests pass a CPU-runnable one). ``interpret`` runs the Triton kernel
    in Pallas's interpreter. Returns out [T, Hq, D].

    One device-side branch (``lax.switch``: branch 0 keeps the Triton output, branch i runs the
    window of the i-th length), because on the GPU every conditional copies its index to the
    host and waits for it (``jaxinfer/runner.py``'s docstring): the dispatch of the rest of the
    step stalls there. Around the fresh kernel only the window's rows are touched: gathered
    (and converted) from q/k_new/v_new, scattered (and converted) into the Triton output in place.
    """
    num_tokens = q.shape[0]
    tiles = wt.plan_work_tiles(cu_q_lens, kv_lens, num_tokens, sizes.block_q)
    lengths = fresh_prefill_lengths(num_tokens, min_fresh_tokens) if is_prefill_heavy(num_tokens, kv_lens) else ()
    attend_rest = functools.partial(attend_gpu, q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens,
                                    sm_scale=sm_scale, sizes=sizes, interpret=interpret)
    if not lengths:
        return attend_rest(tiles=tiles)
    fresh = pick_fresh_prefill(cu_q_lens, kv_lens, min_fresh_tokens)
    fits = _fits_float16(q.astype(jnp.float32) * sm_scale, k_new, v_new)
    # Branch i >= 1: the shortest window length that holds the sequence. A comparison, not
    # searchsorted's default loop: a loop on the GPU is a conditional per iteration.
    branch = jnp.minimum(1 + jnp.sum(jnp.asarray(lengths, jnp.int32) < fresh.num_tokens), len(lengths))
    window_len = jnp.asarray(lengths, jnp.float32)[branch - 1]
    is_worth_it = window_len**2 <= max_window_waste * fresh.num_tokens.astype(jnp.float32) ** 2
    fresh = dataclasses.replace(fresh, is_taken=fresh.is_taken & fits & is_worth_it)
    index = jnp.where(fresh.is_taken, branch, 0)  # branch 0: nothing taken, the Triton output as it is
    rest = attend_rest(tiles=hide_sequence(tiles, fresh))  # [T, Hq, D]; the taken sequence's rows are 0

    def window(length: int):
        def attend(rest):
            take = lambda x: window_rows(x, fresh, length)[None]  # noqa: E731  [1, length, H, D]
            out = fresh_attend(take(q), take(k_new), take(v_new), sm_scale=sm_scale)[0]  # [length, Hq, D]
            return merge_window(rest, out, fresh)
        return attend

    return lax.switch(index, [lambda rest: rest] + [window(n) for n in lengths], rest)


def attend_with_fresh_window(
    q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *, sm_scale, sizes: BlockSizes,
    min_fresh_tokens: int, window_attend=causal_window_attention_mosaic_gpu, interpret: bool = False,
):
    """As ``attend_with_fresh_prefill``, with no device conditional: our window kernel runs on every
    prefill-heavy step, over a static window of the step's length, and does work only for live rows.

    ``window_attend(q [1, L, Hq, D], k [1, L, Hkv, D], v, num_blocks [1], *, sm_scale)``: causal
    attention of the first ``64 * num_blocks`` rows of the window (its other rows are not read).
    The kernel serves the sequence's rows in whole blocks (a multiple of 64 and of Triton's
    ``block_q``); the last few rows stay with Triton, whose tiles for them are kept. With nothing
    taken the kernel gets 0 blocks: one launch of programs that exit. Inputs stay bf16 (no
    float16 copies, no range check); the window's K/V past the served rows are zeros.
    """
    num_tokens = q.shape[0]
    tiles = wt.plan_work_tiles(cu_q_lens, kv_lens, num_tokens, sizes.block_q)
    attend_rest = functools.partial(attend_gpu, q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens,
                                    sm_scale=sm_scale, sizes=sizes, interpret=interpret)
    if num_tokens < min_fresh_tokens or not is_prefill_heavy(num_tokens, kv_lens):
        return attend_rest(tiles=tiles)
    fresh = pick_fresh_prefill(cu_q_lens, kv_lens, min_fresh_tokens)
    unit = math.lcm(WINDOW_BLOCK, sizes.block_q)  # Triton's tiles of the sequence end where the kernel's rows do
    served = jnp.where(fresh.is_taken, fresh.num_tokens // unit * unit, 0).astype(jnp.int32)
    fresh = dataclasses.replace(fresh, is_taken=served > 0, num_tokens=served)
    rest = attend_rest(tiles=hide_sequence(tiles, fresh))  # [T, Hq, D]; the served rows are 0
    length = -(-num_tokens // WINDOW_BLOCK) * WINDOW_BLOCK
    take = lambda x: window_rows(x, fresh, length)[None]  # noqa: E731  [1, length, H, D]
    out = window_attend(take(q), take(k_new), take(v_new), (served // WINDOW_BLOCK)[None], sm_scale=sm_scale)[0]
    return merge_window(rest, out, fresh)


def can_take_fresh_prefill(q_dtype, page_dtype, head_dim: int, sliding_window, soft_cap) -> bool:
    """Whether a step of these static properties may use the fresh-prefill kernel at all."""
    half = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return (jnp.dtype(q_dtype) in half and jnp.dtype(page_dtype) in half and head_dim % 64 == 0
            and sliding_window is None and soft_cap is None)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "min_fresh_tokens", "fresh_attend", "interpret",
                     "max_window_waste", "branchless"),
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
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Same contract as ``ragged_paged_attention_reference``; the cache is donated and updated in place.

    ``branchless=False``: the bundled kernel on a float16 window behind one ``lax.switch``
    (``attend_with_fresh_prefill``); ``True``: our bf16 window kernel with no conditional
    (``attend_with_fresh_window``). ``fresh_attend``: that path's window attention (default: its
    Mosaic GPU kernel; tests pass CPU-runnable ones). Steps the fresh kernel cannot serve (see
    ``can_take_fresh_prefill``) run exactly as ``ragged_paged_attention_gpu`` at its tuned sizes.
    """
    check_inputs(q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"the GPU kernel needs a power-of-two head_dim (Triton tiles), got {head_dim}")
    sizes = gpu_block_sizes(
        num_tokens=num_tokens, max_num_seqs=kv_lens.shape[0], max_kv_len=page_tables.shape[1] * page_size,
        num_kv_heads=num_kv_heads, group=num_q_heads // num_kv_heads, head_dim=head_dim,
        page_size=page_size, itemsize=q.dtype.itemsize,
    )
    k_pages, v_pages = write_kv_reference(k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
    if can_take_fresh_prefill(q.dtype, k_pages.dtype, head_dim, sliding_window, soft_cap) and branchless:
        out = attend_with_fresh_window(
            q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale, sizes=sizes,
            min_fresh_tokens=min_fresh_tokens, window_attend=fresh_attend or causal_window_attention_mosaic_gpu,
            interpret=interpret)
    elif can_take_fresh_prefill(q.dtype, k_pages.dtype, head_dim, sliding_window, soft_cap):
        out = attend_with_fresh_prefill(
            q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale, sizes=sizes,
            min_fresh_tokens=min_fresh_tokens, fresh_attend=fresh_attend or causal_attention_mgpu,
            interpret=interpret, max_window_waste=max_window_waste)
    else:
        out = attend_gpu(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=sm_scale,
                         sliding_window=sliding_window, soft_cap=soft_cap, sizes=sizes, interpret=interpret)
    return out, k_pages, v_pages

"""Which fresh prompts of a step the fresh-prefill kernels serve, and where their rows go (``gpu_fresh_prefill.py``).

A *fresh* prompt (``q_len == kv_len``: no cached prefix) has every K/V it reads in this step's
``k_new``/``v_new``, so a dense causal kernel can serve it from a window of its packed rows.
Everything here is static planning (Python ints) or a few small device ops over the step's
``[S]`` sequence lengths: no loop, no conditional.

Two layouts, one per window kernel:

- **Slots** (the bundled kernel, which computes every row it is given): the step runs one of a
  few static *branches* ``(length, num_slots)``; each slot is a window of ``length`` rows from a
  taken prompt's first row. An empty slot costs a full window there, so the branch is chosen by
  its estimated gain (``choose_slots``), and its ``num_slots`` is one of a short ladder.
- **Packed** (our window kernel, which skips dead 64-row blocks): the taken prompts are laid
  one after another in one static window, each starting on a 64-row block, with a per-block
  table of where each prompt's causal range begins (``pack_prompts``). Empty room costs nothing.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention import work_tiles as wt

WINDOW_MULTIPLE = 128  # the bundled kernel's query tile (two warpgroups of 64 rows) and K/V block
PACK_BLOCK = 64  # our window kernel's query and K/V block (gpu_fresh_window.py)
_LENGTH_RATIO = math.sqrt(2)  # window lengths grow by this: at most 2x the causal FLOPs, few compiles
# throughput-1k puts eight ~1000-token prompts in an 8192-token step; more slots than this would
# mostly be empty (and each is a compiled count per window length).
MAX_FRESH_PROMPTS = 8
# What the engine's path serves per step: the longest fresh prompt, as before session 11. On the
# H200 (session 12) 8 prompts of 1000 tokens took 529-577 us through the batched windows against
# the Triton kernel's 407 (bf16 pages; fp8 alike), and each slot count is more bundled kernels to
# compile (+~10 s of cold start at 8192 rows). jaxinfer.attention passes it; the kernel
# functions and `benchmarks/prefill_peers.py` default to MAX_FRESH_PROMPTS.
ENGINE_MAX_FRESH_PROMPTS = 1


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fresh_prefill_lengths(num_tokens: int, min_fresh_tokens: int) -> tuple[int, ...]:
    """Static window lengths compiled for a step of ``num_tokens`` rows, shortest first.

    One ladder for every step: ``128, 256, 384, 640, 1024, 1536, 2176, ...``, each the previous
    times ``sqrt(2)`` rounded up to ``WINDOW_MULTIPLE``; a step compiles its rungs from the first
    that holds ``min_fresh_tokens`` to the first that covers ``num_tokens`` (cut to it). A prompt
    of ``n`` tokens runs in the shortest length ``>= n``. The rungs do not move with
    ``min_fresh_tokens`` (a sweep of it changes which prompts qualify, not their windows: 1000-token
    prompts keep their 1024-row window). Empty when the step is shorter than ``min_fresh_tokens``.
    """
    if min_fresh_tokens < 1:
        raise ValueError(f"min_fresh_tokens must be at least 1, got {min_fresh_tokens}")
    if num_tokens < min_fresh_tokens:
        return ()
    last = _round_up(num_tokens, WINDOW_MULTIPLE)
    rung = WINDOW_MULTIPLE
    while rung < min(min_fresh_tokens, last):
        rung = _round_up(int(rung * _LENGTH_RATIO), WINDOW_MULTIPLE)
    lengths = [min(rung, last)]
    while lengths[-1] < last:
        rung = _round_up(int(rung * _LENGTH_RATIO), WINDOW_MULTIPLE)
        lengths.append(min(rung, last))
    return tuple(lengths)


def max_fresh_prompts_in(num_tokens: int, min_fresh_tokens: int, max_fresh_prompts: int) -> int:
    """How many fresh prompts of ``>= min_fresh_tokens`` a step of ``num_tokens`` rows can hold, capped."""
    if max_fresh_prompts < 1:
        raise ValueError(f"max_fresh_prompts must be at least 1, got {max_fresh_prompts}")
    return max(0, min(max_fresh_prompts, num_tokens // min_fresh_tokens))


@dataclasses.dataclass(frozen=True)
class WindowBranch:
    """One compiled branch of the bundled path: ``num_slots`` windows of ``length`` rows each."""

    length: int
    num_slots: int


def window_branches(num_tokens: int, min_fresh_tokens: int, max_fresh_prompts: int,
                    max_window_waste: float) -> tuple[WindowBranch, ...]:
    """The static branches of a step of ``num_tokens`` rows: every window length, each with a few slot counts.

    A window of length ``L`` takes prompts of ``n <= L`` rows with ``L^2 <= max_window_waste * n^2``
    (at least ``L / sqrt(max_window_waste)`` rows, and ``min_fresh_tokens``), so at most
    ``num_tokens // that`` of them fit in the step (capped by ``max_fresh_prompts``); the slot
    counts are the powers of two below that and that number itself. So the branches number at most
    ``len(lengths) * (log2(max_fresh_prompts) + 2)``, the windows of one branch hold at most
    ``sqrt(max_window_waste) * num_tokens`` rows, and ``max_fresh_prompts=1`` gives one branch per
    length (the single-prompt path).
    """
    if max_window_waste < 1:
        raise ValueError(f"max_window_waste must be at least 1, got {max_window_waste}")
    cap = max_fresh_prompts_in(num_tokens, min_fresh_tokens, max_fresh_prompts)
    branches = []
    for length in fresh_prefill_lengths(num_tokens, min_fresh_tokens):
        shortest = max(min_fresh_tokens, math.ceil(length / math.sqrt(max_window_waste)))
        most = max(1, min(cap, num_tokens // shortest))
        counts = sorted({1 << i for i in range(most.bit_length()) if 1 << i <= most} | {most})
        branches += [WindowBranch(length, count) for count in counts]
    return tuple(branches)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FreshSlots:
    """The fresh prompts a step's window kernel serves (traced), in slots; an empty slot has 0 rows."""

    branch: jax.Array  # [] int32: 0 = nothing taken; i >= 1: branches[i - 1] (slots layout; packed: 1)
    seq: jax.Array  # [C] int32: each slot's sequence (0 in an empty slot)
    token_start: jax.Array  # [C] int32: its first packed row
    num_tokens: jax.Array  # [C] int32: its rows the window kernel serves (0: an empty slot)
    served: jax.Array  # [S] int32: rows of each sequence the window kernel serves (0: none)


def fresh_candidates(cu_q_lens: jax.Array, kv_lens: jax.Array, *, min_fresh_tokens: int, num_candidates: int):
    """The ``num_candidates`` longest fresh prompts, longest first: ``(seq [K], num_tokens [K], q_lens [S])``.

    A prompt qualifies when its chunk is its whole context (``q_len == kv_len``) and has at least
    ``min_fresh_tokens`` rows; a candidate that does not has ``num_tokens`` 0. A chunk over a cached
    prefix (``kv_len > q_len``) reads K/V that are only in the pages, so it stays with the paged
    kernel; padded slots (``q_len == kv_len == 0``) never reach the minimum. ``lax.top_k`` over the
    ``[S]`` lengths (a sort on the GPU, no loop).
    """
    q_lens = (cu_q_lens[1:] - cu_q_lens[:-1]).astype(jnp.int32)  # [S]
    is_fresh = (q_lens == kv_lens) & (q_lens >= min_fresh_tokens)
    longest, seq = lax.top_k(jnp.where(is_fresh, q_lens, -1), min(num_candidates, q_lens.shape[0]))  # [K]
    return seq.astype(jnp.int32), jnp.maximum(longest, 0).astype(jnp.int32), q_lens


def _fill_slots(seq, num_tokens, taken, rank, cu_q_lens, num_seqs: int, num_slots: int, branch) -> FreshSlots:
    """Slot ``j`` holds the taken candidate of rank ``j``; ``served`` spreads their rows over the sequences."""
    slot = jnp.arange(num_slots, dtype=jnp.int32)[:, None]  # [C, 1]
    is_here = taken[None, :] & (rank[None, :] == slot)  # [C, K]: one True per filled slot
    pick = jnp.argmax(is_here, axis=1)
    is_filled = jnp.any(is_here, axis=1)
    slot_seq = jnp.where(is_filled, seq[pick], 0).astype(jnp.int32)
    served = jnp.zeros((num_seqs,), jnp.int32).at[seq].add(jnp.where(taken, num_tokens, 0))  # top_k: distinct seqs
    return FreshSlots(branch=branch.astype(jnp.int32), seq=slot_seq,
                      token_start=jnp.where(is_filled, cu_q_lens[slot_seq], 0).astype(jnp.int32),
                      num_tokens=jnp.where(is_filled, num_tokens[pick], 0).astype(jnp.int32), served=served)


def choose_slots(cu_q_lens: jax.Array, kv_lens: jax.Array, branches: tuple[WindowBranch, ...], *,
                 min_fresh_tokens: int, max_window_waste: float) -> FreshSlots:
    """The branch of ``branches`` worth most, and the prompts it takes (``max(num_slots)`` slots).

    Branch ``(L, c)`` takes the ``c`` longest fresh prompts with ``n <= L`` and ``L^2 <=
    max_window_waste * n^2``. Its gain counts causal work in units of the paged kernel's time:
    what leaves that kernel (``sum n^2``) less what the window kernel spends, every slot a full
    window, ``max_window_waste`` times faster (``c * L^2 / max_window_waste``). The best branch is
    taken if its gain is not negative: for one prompt that is ``L^2 <= max_window_waste * n^2``,
    the single-prompt rule; an empty slot costs its whole window. Evaluated for every branch at
    once (``[B, K]`` arrays over the ``K`` longest fresh prompts).
    """
    num_slots = max(b.num_slots for b in branches)
    seq, num_tokens, q_lens = fresh_candidates(cu_q_lens, kv_lens, min_fresh_tokens=min_fresh_tokens,
                                               num_candidates=num_slots)
    length = jnp.asarray([b.length for b in branches], jnp.float32)[:, None]  # [B, 1]
    count = jnp.asarray([b.num_slots for b in branches], jnp.int32)[:, None]
    n = num_tokens.astype(jnp.float32)[None, :]  # [1, K]
    fits = (n > 0) & (n <= length) & (length**2 <= max_window_waste * n**2)  # [B, K]
    rank = jnp.cumsum(fits, axis=1, dtype=jnp.int32) - 1  # longest first: a branch takes its longest
    taken = fits & (rank < count)
    gain = jnp.sum(jnp.where(taken, n**2, 0.0), axis=1) - count[:, 0] * length[:, 0] ** 2 / max_window_waste  # [B]
    best = jnp.argmax(gain)
    is_any = gain[best] >= 0
    return _fill_slots(seq, num_tokens, taken[best] & is_any, rank[best], cu_q_lens, q_lens.shape[0], num_slots,
                       jnp.where(is_any, best + 1, 0))


def slot_rows(slots: FreshSlots, num_slots: int, length: int, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Row maps of the first ``num_slots`` slots' windows, ``[num_slots, length]`` each.

    ``source``: the packed row each window row reads (``num_tokens``, out of range, past a
    prompt's rows: a gather with ``mode="fill"`` reads 0 there). ``dest``: where each window
    row's output goes; rows past a prompt point at distinct rows past ``num_tokens`` (a
    scatter with ``mode="drop"`` drops them).
    """
    offset = jnp.arange(length, dtype=jnp.int32)[None, :]  # [1, L]
    is_row = offset < slots.num_tokens[:num_slots, None]  # [C, L]
    row = slots.token_start[:num_slots, None] + offset
    spare = num_tokens + jnp.arange(num_slots * length, dtype=jnp.int32).reshape(num_slots, length)
    return jnp.where(is_row, row, num_tokens), jnp.where(is_row, row, spare)


def packed_window_length(num_tokens: int, num_slots: int) -> int:
    """Rows of the packed window: every prompt rounded up to whole blocks fits (``sum n <= num_tokens``)."""
    return _round_up(num_tokens, PACK_BLOCK) + PACK_BLOCK * max(0, num_slots - 1)


def choose_packed(cu_q_lens: jax.Array, kv_lens: jax.Array, *, num_slots: int, min_fresh_tokens: int) -> FreshSlots:
    """The ``num_slots`` longest fresh prompts, all taken (the packed window's work follows them), in
    slots shortest first: the kernel walks the window from its end, so the longest prompt's blocks
    (the most work) start first."""
    seq, num_tokens, q_lens = fresh_candidates(cu_q_lens, kv_lens, min_fresh_tokens=min_fresh_tokens,
                                               num_candidates=num_slots)
    taken = num_tokens > 0
    rank = jnp.sum(taken, dtype=jnp.int32) - jnp.cumsum(taken, dtype=jnp.int32)  # [K]: the shortest taken: slot 0
    return _fill_slots(seq, num_tokens, taken, rank, cu_q_lens, q_lens.shape[0], num_slots, jnp.any(taken))


def pack_prompts(slots: FreshSlots, length: int, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The packed window's maps: ``(source [length], dest [length], first_block [length // 64])``.

    Slot ``j``'s prompt starts at window row ``start_j`` (the blocks of the slots before it) and
    holds ``round_up(n_j, 64)`` rows, its rows past ``n_j`` reading 0 (later in causal order, they
    never reach the prompt's rows). ``first_block[b]``: the first block of the prompt that block
    ``b`` belongs to (its causal range starts there), or -1 for a block no prompt holds.
    ``source``/``dest`` as in ``slot_rows``.
    """
    blocks = -(-slots.num_tokens // PACK_BLOCK)  # [C]
    start_block = jnp.cumsum(blocks) - blocks  # [C]
    block = jnp.arange(length // PACK_BLOCK, dtype=jnp.int32)[:, None]  # [NB, 1]
    in_slot = (block >= start_block[None, :]) & (block < (start_block + blocks)[None, :])  # [NB, C]
    first_block = jnp.max(jnp.where(in_slot, start_block[None, :], -1), axis=1).astype(jnp.int32)  # [NB]
    row = jnp.arange(length, dtype=jnp.int32)[:, None]  # [W, 1]
    offset = row - (start_block * PACK_BLOCK)[None, :]  # [W, C]
    is_row = (offset >= 0) & (offset < slots.num_tokens[None, :])
    source_row = jnp.max(jnp.where(is_row, slots.token_start[None, :] + offset, -1), axis=1)  # [W]
    is_live = source_row >= 0
    source = jnp.where(is_live, source_row, num_tokens).astype(jnp.int32)
    dest = jnp.where(is_live, source_row, num_tokens + row[:, 0]).astype(jnp.int32)
    return source, dest, first_block


def hide_served(tiles: wt.WorkTiles, served: jax.Array) -> wt.WorkTiles:
    """Empty the paged kernel's work tiles of the rows a window kernel serves (``served [S]`` per sequence).

    A fresh prompt's tile starting at query ``i`` has first position ``i`` (no cached prefix), so
    its tiles starting below ``served[seq]`` are emptied: no queries and first position 0, their
    programs exit at once and its output rows stay 0.
    """
    is_hidden = tiles.meta[:, wt.FIRST_POS] < served[tiles.meta[:, wt.SEQ]]  # [W]
    meta = tiles.meta.at[:, wt.TILE_Q_LEN].set(jnp.where(is_hidden, 0, tiles.meta[:, wt.TILE_Q_LEN]))
    meta = meta.at[:, wt.FIRST_POS].set(jnp.where(is_hidden, 0, meta[:, wt.FIRST_POS]))
    return dataclasses.replace(tiles, meta=meta)

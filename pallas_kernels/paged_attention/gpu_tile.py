"""The pieces of one Pallas-Triton work tile, shared by the two GPU kernels (``gpu.py``, ``gpu_fused.py``).

Both kernels serve one work tile (up to ``block_q`` queries of one sequence, all query heads of
one KV head stacked as rows, see ``work_tiles``) per program and walk its KV range in blocks of
``block_kv`` with an online softmax. They differ only in where K/V rows come from (pages
gathered through the page table; the fused kernel also reads this step's rows from
``k_new``/``v_new`` and writes them) and in how a tile finds its scalars. What is the same lives
here, once: the KV range of a tile and split, the query rows and their gather, a block's page ids
(loaded ahead), one softmax step, the range of blocks that need no mask, and the output store.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite, so that max() over a fully masked row stays finite and exp() never sees inf - inf.
MASK_VALUE = -1e30
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
F16_MAX = 65504.0
FP8_WIDEN_CHOICES = ("float16", "query")


def fp8_tile_dtype(q_dtype, kv_dtype, fp8_widen_to: str = "float16"):
    """The dtype K/V tiles are widened to and the dots run in: q's, except fp8 pages with 16-bit queries.

    ``fp8_widen_to="float16"`` (default): e4m3 pages with bf16/f16 queries compute in float16 (one
    conversion instruction per two values on sm_90, see ``gpu.py``'s docstring). ``"query"``: widen
    to q's dtype, the kernel as it was before (kept for the benchmark's same-run comparison).
    """
    if fp8_widen_to not in FP8_WIDEN_CHOICES:
        raise ValueError(f"fp8_widen_to must be one of {FP8_WIDEN_CHOICES}, got {fp8_widen_to!r}")
    q_dtype, kv_dtype = jnp.dtype(q_dtype), jnp.dtype(kv_dtype)
    if kv_dtype.itemsize == 1 and q_dtype.itemsize == 2 and fp8_widen_to == "float16":
        return jnp.dtype(jnp.float16)
    return q_dtype


def split_block_range(first_pos, tile_q_len, split, *, block_kv: int, num_splits: int, sliding_window: int | None):
    """(kv_end, first block, end block) of one split of a tile's KV walk.

    Causal: nothing past the tile's last query is read; a sliding window starts the walk late.
    The walk's blocks are cut into ``num_splits`` equal runs (flash-decoding).
    """
    kv_end = first_pos + tile_q_len
    kv_start = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    step_lo = kv_start // block_kv
    step_hi = pl.cdiv(kv_end, block_kv)
    steps_per_split = pl.cdiv(step_hi - step_lo, num_splits)
    my_lo = step_lo + split * steps_per_split
    my_hi = jnp.minimum(my_lo + steps_per_split, step_hi)
    return kv_end, my_lo, my_hi


def unmasked_block_range(my_lo, my_hi, first_pos, kv_end, *, block_kv: int, sliding_window: int | None):
    """(lo, hi): the blocks of ``[my_lo, my_hi)`` that every row of the tile sees in full.

    Only blocks at the edges need masks: one holding a position past the tile's first query
    (causal, or past the sequence's end), and with a sliding window one starting before the
    last query's window. Every block between skips the bounds masks on its loads and the mask
    arithmetic on its scores, the bulk of a prefill.
    """
    full_lo = my_lo
    if sliding_window is not None:
        full_lo = jnp.maximum(my_lo, pl.cdiv(kv_end - sliding_window, block_kv))
    full_lo = jnp.minimum(full_lo, my_hi)
    full_hi = jnp.clip((first_pos + 1) // block_kv, full_lo, my_hi)
    return full_lo, full_hi


@dataclasses.dataclass(frozen=True)
class QueryRows:
    """A tile's rows: row r is query head ``kv_head * group + r % Gp`` of token ``token_start + r // Gp``."""

    row: jax.Array  # [rows] int32: 0 .. rows - 1
    row_token: jax.Array  # [rows] int32: token offset inside the tile
    row_head: jax.Array  # [rows] int32: query head inside the KV head's group (padded)
    is_row: jax.Array  # [rows] bool: a live query row (not past the tile, not a padding head)
    row_pos: jax.Array  # [rows] int32: the row's position in its sequence
    row_token_index: jax.Array  # [rows] int32: packed token index; masked rows point at out's extra row
    row_head_index: jax.Array  # [rows] int32: query head index
    token_2d: jax.Array  # [rows, D] int32
    head_2d: jax.Array  # [rows, D] int32
    lane_2d: jax.Array  # [rows, D] int32
    row_mask: jax.Array  # [rows, D] bool


def query_rows(token_start, first_pos, tile_q_len, kv_head, *, block_q: int, group: int, group_padded: int,
               head_dim: int, num_tokens: int) -> QueryRows:
    rows = block_q * group_padded
    row = jnp.arange(rows, dtype=jnp.int32)
    row_token, row_head = row // group_padded, row % group_padded
    is_row = (row_token < tile_q_len) & (row_head < group)
    row_pos = first_pos + row_token
    dummy_token = num_tokens  # masked rows point at out's extra row, so no two rows alias
    row_token_index = jnp.where(is_row, token_start + row_token, dummy_token)
    row_head_index = jnp.where(is_row, kv_head * group + row_head, 0)
    return QueryRows(
        row=row, row_token=row_token, row_head=row_head, is_row=is_row, row_pos=row_pos,
        row_token_index=row_token_index, row_head_index=row_head_index,
        token_2d=jnp.broadcast_to(row_token_index[:, None], (rows, head_dim)),
        head_2d=jnp.broadcast_to(row_head_index[:, None], (rows, head_dim)),
        lane_2d=jnp.broadcast_to(jnp.arange(head_dim, dtype=jnp.int32)[None, :], (rows, head_dim)),
        row_mask=jnp.broadcast_to(is_row[:, None], (rows, head_dim)),
    )


def block_page_ids(page_tables_ref, seq, block, *, block_kv: int, page_size: int) -> jax.Array:
    """[block_kv] page ids of KV block ``block`` of sequence ``seq``, for a walk that loads them a block ahead.

    Clamped, not masked: an entry past the table's end is never used (its rows are masked loads or
    past the walk), and an unmasked load has no predicate to compute.
    """
    pages_per_seq = page_tables_ref.shape[1]
    index = jnp.minimum((block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)) // page_size, pages_per_seq - 1)
    return plgpu.load(page_tables_ref.at[seq, index])


def load_queries(q_ref, rows: QueryRows, compute_dtype) -> jax.Array:
    """The tile's query rows [rows, D] in the compute dtype (masked rows 0).

    When the compute dtype is float16 (fp8 pages, 16-bit queries) the rows are clipped to
    float16's range first, so that no row becomes inf; once per program.
    """
    num_tokens = q_ref.shape[0]
    q = plgpu.load(q_ref.at[jnp.minimum(rows.token_2d, num_tokens - 1), rows.head_2d, rows.lane_2d],
                   mask=rows.row_mask, other=0.0)
    if q.dtype != compute_dtype:
        q = jnp.clip(q.astype(jnp.float32), -F16_MAX, F16_MAX).astype(compute_dtype)
    return q


def score_scale(sm_scale: float, soft_cap: float | None) -> float:
    """Scores are kept in log2 units (scaled by log2(e)) so the softmax uses exp2, one
    instruction, instead of exp's extra range reduction; with a soft cap, after the tanh."""
    return sm_scale if soft_cap is not None else sm_scale * LOG2E


def softmax_step(q, k, load_v, kv_pos, row_pos, in_seq, carry, *, masked: bool, scale: float,
                 soft_cap: float | None, sliding_window: int | None, precision):
    """One KV block of the online softmax; returns the new ``(acc [rows, D], row_max [rows], denom [rows])``.

    ``k`` [BK, D] is loaded by the caller; ``load_v()`` loads V [BK, D] after the scores (the
    order both kernels had). ``masked``: apply the causal / sequence-end / window masks;
    ``in_seq()`` [BK] bool says which positions are before the tile's KV end (called only then).
    Dim-major V pages (V^T tiles, ``v_layout.py``) go through ``softmax_step_parts``.
    """
    return softmax_step_parts(q, [k], [load_v], [kv_pos], row_pos, [in_seq() if masked else None], carry,
                              masked=masked, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                              precision=precision)


def softmax_step_parts(q, ks, load_vs, kv_pos_parts, row_pos, in_seq_parts, carry, *, masked: bool, scale: float,
                       soft_cap: float | None, sliding_window: int | None, precision, v_transposed: bool = False):
    """``softmax_step`` over a block given as consecutive parts (lists, one entry a part; ``in_seq_parts``
    holds arrays, read only when ``masked``): one running max, correction and denominator for the
    whole block, a dot per part.

    Over dim-major V pages a part is one page, whose tile is addressed by a scalar page id (gpu.py);
    with one part this is ``softmax_step`` op for op.
    """
    acc, row_max, denom = carry  # max in log2 units
    scores, visible = [], []
    for k, kv_pos, in_seq in zip(ks, kv_pos_parts, in_seq_parts):
        part = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [rows, part]
        if soft_cap is not None:
            part = (soft_cap * LOG2E) * jnp.tanh(part / soft_cap)
        if masked:
            seen = (kv_pos[None, :] <= row_pos[:, None]) & in_seq[None, :]
            if sliding_window is not None:
                seen &= kv_pos[None, :] > row_pos[:, None] - sliding_window
            part = jnp.where(seen, part, MASK_VALUE)
            visible.append(seen)
        scores.append(part)
    block_max = jnp.max(scores[0], axis=1)
    for part in scores[1:]:
        block_max = jnp.maximum(block_max, jnp.max(part, axis=1))
    new_max = jnp.maximum(row_max, block_max)
    correction = jnp.exp2(row_max - new_max)
    weights = [jnp.exp2(part - new_max[:, None]) for part in scores]
    if masked:
        weights = [jnp.where(seen, w, 0.0) for seen, w in zip(visible, weights)]
    # The first part's terms in softmax_step's order (so that one part traces to the same program).
    denom = denom * correction + jnp.sum(weights[0], axis=1)
    for w in weights[1:]:
        denom = denom + jnp.sum(w, axis=1)
    v = load_vs[0]()
    acc = acc * correction[:, None] + plgpu.dot(weights[0].astype(v.dtype), v, trans_b=v_transposed,
                                                precision=precision)
    for w, load_v in zip(weights[1:], load_vs[1:]):
        v = load_v()
        acc = acc + plgpu.dot(w.astype(v.dtype), v, trans_b=v_transposed, precision=precision)
    return acc, new_max, denom


def initial_carry(rows: int, head_dim: int):
    """(acc, row_max, denom) before the first block."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def store_outputs(out_refs, rows: QueryRows, acc, row_max, denom, *, num_splits: int):
    """Normalise and store the tile's rows; with splits also each row's log-sum-exp (natural log)."""
    safe_denom = jnp.where(denom > 0, denom, 1.0)
    out = acc / safe_denom[:, None]
    out_ref = out_refs[0]
    plgpu.store(out_ref.at[rows.token_2d, rows.head_2d, rows.lane_2d], out.astype(out_ref.dtype), mask=rows.row_mask)
    if num_splits > 1:
        lse = jnp.where(denom > 0, (row_max + jnp.log2(safe_denom)) * LN2, -jnp.inf)
        plgpu.store(out_refs[1].at[rows.row_token_index, rows.row_head_index], lse, mask=rows.is_row)

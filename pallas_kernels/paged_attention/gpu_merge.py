"""Merging flash-decoding splits on the GPU: one small Pallas-Triton kernel instead of XLA's reductions.

When the decode kernel splits each sequence's KV walk over ``P`` programs, each writes a
normalised partial output and its log-sum-exp; the merge weighs the partials by
``exp(lse - max lse)``. As XLA ops that is a max-reduction, then a weighted sum and a
select for padding tokens: two or three launches of a few microseconds each, a fixed cost
that decides batch-1 decode (B=1 at 32k context reads its whole cache in ~30 µs). This
kernel does it in one launch: one program per (token, query head) reads its ``P`` partial
rows and writes the final row in the output dtype, zero for padding tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.work_tiles import next_power_of_2


def _merge_kernel(cu_q_lens_ref, out_splits_ref, lse_splits_ref, out_ref, *, num_splits: int):
    token, head = pl.program_id(0), pl.program_id(1)
    head_dim = out_splits_ref.shape[-1]
    split = jnp.arange(next_power_of_2(num_splits), dtype=jnp.int32)
    is_split = split < num_splits
    split = jnp.minimum(split, num_splits - 1)
    lse = plgpu.load(lse_splits_ref.at[split, token, head], mask=is_split, other=-jnp.inf)  # [P]
    lse_max = jnp.max(lse)
    lse_max = jnp.where(lse_max > -jnp.inf, lse_max, 0.0)
    weight = jnp.exp(lse - lse_max)  # empty or padded splits: lse -inf, weight 0
    total = jnp.sum(weight)
    split_2d = jnp.broadcast_to(split[:, None], (split.shape[0], head_dim))
    lane_2d = jnp.broadcast_to(jnp.arange(head_dim, dtype=jnp.int32)[None, :], (split.shape[0], head_dim))
    parts = plgpu.load(out_splits_ref.at[split_2d, token, head, lane_2d],
                       mask=jnp.broadcast_to(is_split[:, None], (split.shape[0], head_dim)), other=0.0)
    merged = jnp.sum(weight[:, None] * parts, axis=0) / jnp.where(total > 0, total, 1.0)  # [D]
    # Padding tokens' partial rows were never written (uninitialised memory): their output is 0.
    is_token = token < cu_q_lens_ref[cu_q_lens_ref.shape[0] - 1]
    merged = jnp.where(is_token, merged, 0.0)
    plgpu.store(out_ref.at[token, head, jnp.arange(head_dim, dtype=jnp.int32)], merged.astype(out_ref.dtype))


def merge_splits_gpu(out_splits: jax.Array, lse_splits: jax.Array, cu_q_lens: jax.Array, *, num_tokens: int,
                     dtype, interpret: bool = False) -> jax.Array:
    """[P, >= T, Hq, D] float32 partials and [P, >= T, Hq] log-sum-exps -> out [T, Hq, D] in ``dtype``."""
    num_splits, _, num_q_heads, head_dim = out_splits.shape
    whole = lambda x: pl.BlockSpec(x.shape, lambda t, h: (0,) * x.ndim)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_merge_kernel, num_splits=num_splits),
        grid=(num_tokens, num_q_heads),
        in_specs=[whole(cu_q_lens), whole(out_splits), whole(lse_splits)],
        out_specs=pl.BlockSpec((num_tokens, num_q_heads, head_dim), lambda t, h: (0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="merge_decode_splits",
    )(cu_q_lens, out_splits, lse_splits)

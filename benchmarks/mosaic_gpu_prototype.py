"""PROTOTYPE, not used by the engine: paged decode attention in Pallas with the Mosaic GPU lowering.

Built only to choose the GPU lowering by measurement (issue 3, deliverable 2): it is
timed against the Pallas-Triton kernel (``pallas_kernels/paged_attention/gpu.py``) by ``kernel_lowering_choice.py``
at three decode shapes. It serves decode batches only (one query per sequence slot:
``q [B, Hq, D]``, sequence ``b``'s query is ``q[b]``), bf16/f16, GQA with ``Hq / Hkv <= 64``,
``head_dim`` a multiple of 64, over the cache layout of ``pallas_kernels/paged_attention/reference.py``.

How it maps to Hopper. One program (one warpgroup, ``plgpu.kernel``) serves one sequence,
one KV head and one KV split (flash-decoding). ``plgpu.emit_pipeline`` walks the split's
pages one page per step: each step's K and V pages are TMA copies whose GMEM coordinate
is the physical page read from the page table (a scalar load inside the BlockSpec's
``index_map``), ``max_concurrent_steps`` pages deep, completing on an mbarrier. The
``G`` query heads of the KV head are rows of a 64-row wgmma tile (wgmma's M is 64 per
warpgroup; rows past ``G`` are zero queries, so a decode step does 64/G times the needed
tensor-core work, still far under the tensor-core rate at 16 KiB of K/V per page):
``S = Q K^T`` and ``O += P V`` are wgmmas from shared memory, softmax in registers.
Partial outputs and log-sum-exps of the splits are merged by ``work_tiles.combine_splits``.

Limits, on purpose for a prototype: positions past ``kv_len`` in the last page are
masked in the scores but their V rows still enter ``P V`` with weight 0, so they must be
finite (the Triton kernel masks the loads and is NaN-safe; its tests fill unused pages
with NaN). No prefill, no sliding window or soft cap, no fused K/V write.

Measured (H200, ``benchmarks/results/kernel_lowering_choice.md``): 0.93-1.05x the Triton
kernel's speed at B=64 ctx 4k, B=8 ctx 16k, B=1 ctx 32k and B=32 ctx 4k; best at 2-4 pages
in flight (8 costs occupancy: 1 program per SM). Not faster, so the engine keeps Triton.
What Mosaic GPU asked for along the way: wgmma's A and B swizzles must match (layout
inference fails with "Failed to infer a possible set of layouts" otherwise: hence V pages
swizzled by P's row width, not Q's), and the GPU interpreter takes wgmma operands from
shared memory only (hence P through ``p_smem``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import work_tiles as wt
from pallas_kernels.paged_attention.gpu_fresh_window import smem_transforms as _smem_transforms

_ROWS = 64  # wgmma M for one warpgroup
_MASK_VALUE = -1e30  # finite: an empty split keeps a finite max and a zero output
_LOG2E = math.log2(math.e)


def _decode_kernel(
    page_tables_ref,  # [B, pages_per_seq] int32 (GMEM)
    kv_lens_ref,  # [B] int32 (GMEM)
    q_ref,  # [B, Hkv, 64, D] (GMEM)
    k_ref,  # [Hkv, num_pages, page_size, D] (GMEM)
    v_ref,
    out_ref,  # [splits, B, Hq, D] f32
    lse_ref,  # [splits, B, Hkv, 64] f32
    q_smem,  # [64, D]
    p_smem,  # [64, page_size]: this step's softmax weights
    q_barrier,
    *, sm_scale: float, page_size: int, group: int, num_splits: int, max_concurrent_steps: int,
):
    seq, kv_head, split = lax.axis_index("seq"), lax.axis_index("kv_head"), lax.axis_index("split")
    head_dim = q_smem.shape[-1]
    kv_len = kv_lens_ref[seq]
    num_pages = pl.cdiv(kv_len, page_size)
    pages_per_split = pl.cdiv(num_pages, num_splits)
    first_page = jnp.minimum(split * pages_per_split, num_pages)
    my_pages = jnp.minimum(first_page + pages_per_split, num_pages) - first_page

    plgpu.copy_gmem_to_smem(q_ref.at[seq, kv_head], q_smem, q_barrier)
    plgpu.barrier_wait(q_barrier)

    def body(indices, k_smem, v_smem, carry):
        acc, row_max, denom = carry  # [64, D] f32, [64], [64] (row max kept in log2 units)
        (step,) = indices

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
            return acc_ref[...]

        scores = pl.run_scoped(qk, plgpu.ACC((_ROWS, page_size), jnp.float32))  # [64, page_size]
        column = plgpu.broadcasted_iota(jnp.int32, (_ROWS, page_size), 1, layout=plgpu.Layout.WGMMA)
        is_visible = (first_page + step) * page_size + column < kv_len
        scores = jnp.where(is_visible, scores * (sm_scale * _LOG2E), _MASK_VALUE)
        new_max = jnp.maximum(row_max, scores.max(axis=1))
        correction = jnp.exp2(row_max - new_max)
        weights = jnp.exp2(scores - lax.broadcast_in_dim(new_max, scores.shape, [0]))
        denom = denom * correction + weights.sum(axis=1)

        # P goes through shared memory and PV into a fresh accumulator plus a register add:
        # Pallas's GPU interpreter (the CPU tests) takes wgmma operands only from shared
        # memory and has no rule for the discharged wgmma of ``run_state(ACC.init(acc))``.
        # 4 KiB per page, next to the 16 KiB of K/V the page brings.
        p_smem[...] = weights.astype(p_smem.dtype)
        plgpu.commit_smem()

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem)
            return acc_ref[...]

        step_out = pl.run_scoped(pv, plgpu.ACC((_ROWS, head_dim), jnp.float32))  # [64, D]
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + step_out
        return acc, new_max, denom

    init = (
        plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((_ROWS,), _MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    page_index = lambda i: (kv_head, page_tables_ref[seq, first_page + i], 0, 0)
    # wgmma wants A and B swizzled alike: K pages match Q's 128-byte rows, V pages match P's
    # rows (page_size elements, 64 bytes at 32 bf16 tokens).
    k_spec = plgpu.BlockSpec((None, None, page_size, head_dim), page_index,
                             transforms=_smem_transforms(head_dim, k_ref.dtype))
    v_spec = plgpu.BlockSpec((None, None, page_size, head_dim), page_index,
                             transforms=_smem_transforms(page_size, v_ref.dtype))
    acc, row_max, denom = plgpu.emit_pipeline(
        body, grid=(my_pages,), in_specs=[k_spec, v_spec],
        max_concurrent_steps=max_concurrent_steps, init_carry=init,
    )(k_ref, v_ref)

    is_live = denom > 0
    safe_denom = jnp.where(is_live, denom, 1.0)

    # Allocated after the pipeline has released its page buffers, so the output staging
    # (32 KiB) does not count against the shared memory that decides programs per SM.
    def store(o_smem, lse_smem):  # [64, D] f32, [64] f32
        o_smem[...] = acc / lax.broadcast_in_dim(safe_denom, acc.shape, [0])
        # log-sum-exp in natural-log units; -inf marks an empty split (weight 0 in the combine).
        lse_smem[...] = jnp.where(is_live, (row_max + jnp.log2(safe_denom)) / _LOG2E, -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)], out_ref.at[split, seq, pl.ds(kv_head * group, group)])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, seq, kv_head])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((_ROWS, head_dim), jnp.float32), plgpu.SMEM((_ROWS,), jnp.float32))


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "num_splits", "max_concurrent_steps", "interpret"),
)
def paged_decode_attention_mosaic_gpu(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, D], already written
    v_pages: jax.Array,
    page_tables: jax.Array,  # [B, pages_per_seq] int32
    kv_lens: jax.Array,  # [B] int32
    *,
    sm_scale: float,
    num_splits: int = 1,
    max_concurrent_steps: int = 4,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention of ``q[b]`` over sequence ``b``'s first ``kv_lens[b]`` cached tokens; out [B, Hq, D]."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pages.dtype != q.dtype:
        raise ValueError(f"the Mosaic GPU prototype needs bf16/f16 q and pages, got {q.dtype}, {k_pages.dtype}")
    if head_dim % 64 or group > _ROWS or num_q_heads % num_kv_heads:
        raise ValueError(f"unsupported heads for the prototype: Hq {num_q_heads}, Hkv {num_kv_heads}, D {head_dim}")
    if page_tables.shape[0] != batch or kv_lens.shape != (batch,):
        raise ValueError(f"page_tables {page_tables.shape} and kv_lens {kv_lens.shape} must have B={batch} rows")
    # Query heads of one KV head as the first G rows of a 64-row wgmma tile (small: B*Hkv*64*D).
    q_tiles = q.reshape(batch, num_kv_heads, group, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, _ROWS - group), (0, 0)))
    kernel = plgpu.kernel(
        functools.partial(_decode_kernel, sm_scale=sm_scale, page_size=page_size, group=group,
                          num_splits=num_splits, max_concurrent_steps=max_concurrent_steps),
        out_type=(jax.ShapeDtypeStruct((num_splits, batch, num_q_heads, head_dim), jnp.float32),
                  jax.ShapeDtypeStruct((num_splits, batch, num_kv_heads, _ROWS), jnp.float32)),
        scratch_types=(
            plgpu.SMEM((_ROWS, head_dim), q.dtype, transforms=_smem_transforms(head_dim, q.dtype)),
            plgpu.SMEM((_ROWS, page_size), q.dtype, transforms=_smem_transforms(page_size, q.dtype)),
            plgpu.Barrier(num_barriers=1),
        ),
        grid=(batch, num_kv_heads, num_splits),
        grid_names=("seq", "kv_head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    out, lse = kernel(page_tables, kv_lens, q_tiles, k_pages, v_pages)
    lse = lse[..., :group].reshape(num_splits, batch, num_q_heads)
    if num_splits == 1:
        return out[0].astype(q.dtype)
    return wt.combine_splits(out, lse).astype(q.dtype)

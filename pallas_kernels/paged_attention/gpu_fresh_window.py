"""Causal attention of fresh prompts in Pallas Mosaic GPU (Hopper), with live query blocks given as data.

The kernel of the ``"pallas_gpu_fresh_prefill_branchless"`` path (``gpu_fresh_prefill.py``) and of
``benchmarks/mosaic_gpu_prefill_prototype.py`` (which measured it against the bundled kernel and
cuDNN, ``prefill_peers.py``'s ``proto_*`` columns). It serves ``n`` chunks of equal static length
``L`` (a multiple of 64), each causal over itself from row 0: ``q [n, L, Hq, D]``, ``k``/``v``
``[n, L, Hkv, D]``, bf16 or f16 (no float16 copies of bf16 data, unlike the bundled kernel).

Which query blocks are live, and where each one's causal range starts, is data (traced), so the
work follows the live rows, not ``L``, and an engine step can run the kernel over one static window
with no device conditional. ``packed_causal_attention_mosaic_gpu`` takes ``first_block [n, L / 64]``:
query block ``b`` attends to K/V blocks ``first_block[b] .. b`` (its prompt's first block up to the
diagonal), or is dead (-1). So several prompts, each starting on a 64-row block, share one chunk:
the branchless path packs a step's fresh prompts that way (``fresh_prompts.pack_prompts``).
``causal_window_attention_mosaic_gpu`` is the one-prompt-per-chunk form: ``num_blocks [n]``
(optional) live blocks from row 0. A program whose block is dead exits at once, without a copy (a
step with nothing to serve pays one launch of empty programs). Output rows of dead blocks are left
unwritten: the caller must not read them.

How it maps to Hopper (measured on the H200 in session 8 as ``proto_2``: 53-63% of the bf16
matmul rate at 4k-16k, against 67-84% for jax's bundled two-warpgroup kernel): one program (one
warpgroup) serves 64 query rows of one query head; Q arrives by one TMA copy;
``plgpu.emit_pipeline`` walks the KV blocks of 64 rows up to the causal diagonal, each K and V
block a TMA copy, ``max_concurrent_steps`` deep; ``S = Q K^T`` and ``O += P V`` are wgmmas from
shared memory, the online softmax in registers (exp2). The wrapper lays Q/K/V out head-major
(``[n, H, L, D]``, one XLA transpose each) so every TMA box is a plain 2-D tile. Programs run
from the window's last block back (a lone prompt's longest walks first; packed prompts'
last blocks come first in each prompt).

Not built (what FA3 and the bundled kernel add): two consumer warpgroups ping-ponging softmax
against the next block's wgmma with a producer warpgroup (``plgpu.emit_pipeline_warp_specialized``),
unmasked off-diagonal blocks (every block is masked here), P from registers (the GPU interpreter
takes wgmma operands from shared memory only), no transposes (TMA boxes over ``[L, H, D]``).
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


def smem_transforms(minor_dim: int, dtype) -> tuple:
    """wgmma-ready shared-memory tiling: rows of up to 128 bytes, swizzled by their width."""
    swizzle = min(128, minor_dim * jnp.dtype(dtype).itemsize)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


_ROWS = 64  # wgmma M for one warpgroup; also the KV block, so the diagonal is one block
_MASK_VALUE = -1e30
_LOG2E = math.log2(math.e)


def _prefill_kernel(first_block_ref, q_ref, k_ref, v_ref, out_ref, q_smem, p_smem, q_barrier, *, sm_scale: float,
                    group: int, max_concurrent_steps: int):
    # first_block_ref [n * L / 64] int32, q_ref [n, Hq, L, D], k_ref/v_ref [n, Hkv, L, D], out_ref [n, Hq, L, D] (GMEM)
    seq, head = lax.axis_index("seq"), lax.axis_index("head")
    num_q_blocks = q_ref.shape[2] // _ROWS
    q_block = num_q_blocks - 1 - lax.axis_index("q_block")  # the window's last blocks (the longest walks) first
    first_block = first_block_ref[seq * num_q_blocks + q_block]  # < 0: a dead block
    pl.when(first_block >= 0)(functools.partial(
        _attend_block, q_ref, k_ref, v_ref, out_ref, q_smem, p_smem, q_barrier, seq=seq, head=head, q_block=q_block,
        first_block=first_block, sm_scale=sm_scale, group=group, max_concurrent_steps=max_concurrent_steps))


def _attend_block(q_ref, k_ref, v_ref, out_ref, q_smem, p_smem, q_barrier, *, seq, head, q_block, first_block,
                  sm_scale: float, group: int, max_concurrent_steps: int):
    """Query block ``q_block`` of chunk ``seq``, head ``head``: causal over the K/V blocks ``first_block..q_block``."""
    kv_head = head // group
    head_dim = q_smem.shape[-1]
    plgpu.copy_gmem_to_smem(q_ref.at[seq, head, pl.ds(q_block * _ROWS, _ROWS)], q_smem, q_barrier)
    plgpu.barrier_wait(q_barrier)

    def body(indices, k_smem, v_smem, carry):
        acc, row_max, denom = carry  # [64, D] f32, [64], [64] (row max in log2 units)
        (step,) = indices

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
            return acc_ref[...]

        scores = pl.run_scoped(qk, plgpu.ACC((_ROWS, _ROWS), jnp.float32))
        row = plgpu.broadcasted_iota(jnp.int32, (_ROWS, _ROWS), 0, layout=plgpu.Layout.WGMMA)
        column = plgpu.broadcasted_iota(jnp.int32, (_ROWS, _ROWS), 1, layout=plgpu.Layout.WGMMA)
        # Causal: only the diagonal block (first_block + step == q_block) hides anything.
        is_visible = (first_block + step) * _ROWS + column <= q_block * _ROWS + row
        scores = jnp.where(is_visible, scores * (sm_scale * _LOG2E), _MASK_VALUE)
        new_max = jnp.maximum(row_max, scores.max(axis=1))
        correction = jnp.exp2(row_max - new_max)
        weights = jnp.exp2(scores - lax.broadcast_in_dim(new_max, scores.shape, [0]))
        denom = denom * correction + weights.sum(axis=1)
        p_smem[...] = weights.astype(p_smem.dtype)
        plgpu.commit_smem()

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem)
            return acc_ref[...]

        step_out = pl.run_scoped(pv, plgpu.ACC((_ROWS, head_dim), jnp.float32))
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + step_out
        return acc, new_max, denom

    init = (
        plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((_ROWS,), _MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    block_index = lambda i: (seq, kv_head, first_block + i, 0)
    # wgmma wants A and B swizzled alike: K blocks match Q's rows (head_dim wide), V blocks P's (64 wide).
    k_spec = plgpu.BlockSpec((None, None, _ROWS, head_dim), block_index,
                             transforms=smem_transforms(head_dim, k_ref.dtype))
    v_spec = plgpu.BlockSpec((None, None, _ROWS, head_dim), block_index,
                             transforms=smem_transforms(_ROWS, v_ref.dtype))
    acc, _, denom = plgpu.emit_pipeline(
        body, grid=(q_block - first_block + 1,), in_specs=[k_spec, v_spec],
        max_concurrent_steps=max_concurrent_steps, init_carry=init,
    )(k_ref, v_ref)

    def store(o_smem):
        o_smem[...] = (acc / lax.broadcast_in_dim(denom, acc.shape, [0])).astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[seq, head, pl.ds(q_block * _ROWS, _ROWS)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((_ROWS, head_dim), out_ref.dtype))


@functools.partial(jax.jit, static_argnames=("sm_scale", "max_concurrent_steps", "interpret"))
def causal_window_attention_mosaic_gpu(
    q: jax.Array,  # [n, L, Hq, D]
    k: jax.Array,  # [n, L, Hkv, D]
    v: jax.Array,
    num_blocks: jax.Array | None = None,  # [n] int32: live 64-row query blocks per chunk (default: all)
    *,
    sm_scale: float,
    max_concurrent_steps: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of each chunk over itself; out [n, L, Hq, D] in q's dtype, rows of dead blocks unwritten."""
    num_seqs, length = q.shape[:2]
    if length % _ROWS:
        raise ValueError(f"unsupported shape: L {length} (multiple of 64)")
    if num_blocks is None:
        num_blocks = jnp.full((num_seqs,), length // _ROWS, jnp.int32)
    block = jnp.arange(length // _ROWS, dtype=jnp.int32)[None, :]
    first_block = jnp.where(block < num_blocks.astype(jnp.int32)[:, None], 0, -1)  # [n, L / 64]
    return packed_causal_attention_mosaic_gpu(q, k, v, first_block, sm_scale=sm_scale,
                                              max_concurrent_steps=max_concurrent_steps, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "max_concurrent_steps", "interpret"))
def packed_causal_attention_mosaic_gpu(
    q: jax.Array,  # [n, L, Hq, D]
    k: jax.Array,  # [n, L, Hkv, D]
    v: jax.Array,
    first_block: jax.Array,  # [n, L / 64] int32: each query block's first K/V block (its prompt's), -1: dead
    *,
    sm_scale: float,
    max_concurrent_steps: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of prompts packed on 64-row blocks: query block ``b`` of chunk ``c`` attends causally
    to the K/V rows from block ``first_block[c, b]`` to its own; out [n, L, Hq, D] in q's dtype, rows of
    dead blocks unwritten. ``first_block`` must hold, for every block of one prompt, that prompt's first
    block (``<= b``); a prompt's rows past its end inside its last block must be finite (they are later in
    causal order than its rows, so they never reach them)."""
    mosaic_gpu_names.install()  # equal kernels, equal hashes: one compile per process (see that module)
    num_seqs, length, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"the Mosaic GPU window kernel needs bf16/f16 q, k, v; got {q.dtype}, {k.dtype}")
    if length % _ROWS or head_dim % 64 or num_q_heads % num_kv_heads:
        raise ValueError(f"unsupported shape: L {length} (multiple of 64), D {head_dim} (multiple of 64), "
                         f"Hq {num_q_heads} / Hkv {num_kv_heads}")
    if first_block.shape != (num_seqs, length // _ROWS):
        raise ValueError(f"first_block must be [n, L / 64] = {(num_seqs, length // _ROWS)}, got {first_block.shape}")
    # Clipped into the block itself: a first block past it would walk nothing, or outside the window.
    block = jnp.arange(length // _ROWS, dtype=jnp.int32)[None, :]
    first_block = jnp.where(first_block < 0, -1, jnp.minimum(first_block.astype(jnp.int32), block)).reshape(-1)
    head_major = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    kernel = plgpu.kernel(
        functools.partial(_prefill_kernel, sm_scale=sm_scale, group=num_q_heads // num_kv_heads,
                          max_concurrent_steps=max_concurrent_steps),
        out_type=jax.ShapeDtypeStruct((num_seqs, num_q_heads, length, head_dim), q.dtype),
        scratch_types=(
            plgpu.SMEM((_ROWS, head_dim), q.dtype, transforms=smem_transforms(head_dim, q.dtype)),
            plgpu.SMEM((_ROWS, _ROWS), q.dtype, transforms=smem_transforms(_ROWS, q.dtype)),
            plgpu.Barrier(num_barriers=1),
        ),
        grid=(num_seqs, num_q_heads, length // _ROWS),
        grid_names=("seq", "head", "q_block"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return head_major(kernel(first_block, head_major(q), head_major(k), head_major(v)))

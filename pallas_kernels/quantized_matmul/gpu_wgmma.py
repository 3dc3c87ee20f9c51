"""Few-token matmul that streams the weight by TMA into ``wgmma`` (Pallas Mosaic GPU, Hopper).

Issue 18/21's decode GEMV without the register detour. The Pallas-Triton kernels of ``gpu.py``
load each weight tile into registers, widen it there (fp8) and multiply on the CUDA cores or
through a converted tensor-core operand; their best fp8 tiles read 50-60% of the H200's read
ceiling at one row, and XLA's W8A16 path about as much (``docs/KERNELS.md``, runs 1-4). Here
the weight never enters registers: TMA copies tiles into shared memory ``max_concurrent_steps``
deep, and ``wgmma`` multiplies them as stored, so the only per-byte work is the copy.

Orientation ("swap AB"). ``y [M, N] = x [M, K] @ W^T`` with M a few tokens and N, K thousands.
wgmma's M is 64 rows a warpgroup and its N can be as small as 8, so the *weight* rows are the
MMA's M (no padding waste: every row is a real output channel) and the tokens its N (padded to
a multiple of 8). The accumulator is ``acc [block_n, Mp] = W_tile [block_n, K] @ x^T [K, Mp]``;
the wrapper transposes the ``[N, Mp]`` result back (an elementwise step XLA fuses into the
consumer).

Weight formats:

- ``float8_e4m3fn`` ``[N, K]`` (``[out, in]``, the quantized weight layer's payload) with a float32
  per-output-channel scale, in one of three modes (``activations``):
  ``"e4m3"``, **W8A8**: an 8-bit wgmma takes both operands e4m3 and K-major, so x is rounded to
  e4m3 per token row (``scale = max|x_row| / 448``, the FP8_DYNAMIC scheme that ``jaxinfer.linear``
  already uses for many tokens), or by a static input scale; nothing is converted.
  ``"e4m3-fused"``, **W8A8 quantized in the kernel**: x arrives bf16 and each step rounds its
  ``[tokens, block_k]`` tile to e4m3 in registers, per token row with that block's own scale;
  each step's product goes to a fresh accumulator, scaled and added to a running sum (no XLA op
  before the kernel, and finer scales than one a row).
  ``"f16"``, **weight-only**: x is scaled per token row into f16 and each e4m3 tile is widened to
  f16 between shared memory and registers, where it is the MMA's A operand (Hopper converts e4m3
  to f16, not to bf16). Both scales multiply the float32 accumulator in the epilogue.
- ``int8`` ``[N, K]`` with its scale: weight-only, as the fp8 ``"f16"`` mode.
- ``bfloat16`` ``[N, K]`` or ``[K, N]`` (the dense model's ``[in, out]``: 16-bit wgmma operands
  may be MN-major, so either layout is read as stored, never transposed in HBM).

Several weights that share an input (q/k/v, gate/up) run in one launch: their row blocks are
laid end to end in the grid and each program branches to its own weight's pipeline.

Parallelism. Grid ``(sum N_i / block_n, k_splits)``: program ``(i, s)`` owns output rows
``i * block_n ..`` and the ``s``-th slice of K. With one split and a 16-bit output the epilogue
(scales, cast, a store through a transposed shared-memory view so the output leaves ``[M, N]``)
is the kernel's own; with ``k_splits > 1`` the float32 partial sums ``[k_splits, N, Mp]`` are
added and scaled by XLA after it. ``max_concurrent_steps`` tiles of ``block_n x block_k`` weights
are in flight a program; a memory-bound kernel needs ~5 MB in flight across the GPU (Little's
law: 4.5 TB/s x ~1 µs), e.g. 100 programs x 6 x 16 KB.

Numerics: products of e4m3, f16 or bf16 values accumulate in float32 on the tensor cores; the
tests' reference is the float32 product of the same rounded operands (W8A8) or of x itself
(weight-only, bf16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_gpu_names

FP8 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
WGMMA_ROWS = 64  # wgmma's M for one warpgroup: block_n is a multiple of it
TOKEN_MULTIPLE = 8  # wgmma's smallest N: the token rows are padded to a multiple of it
MAX_TOKENS = 64
WEIGHT_LAYOUTS = ("nk", "kn")
ACTIVATIONS = ("e4m3", "e4m3-fused", "f16")  # fp8 weights' modes (int8 takes "f16" only)
FUSED_BLOCK_K_MULTIPLE = 256
_SWIZZLE_BYTES = 128
# "e4m3-fused": the e4m3 weight and x tiles at a 64-byte swizzle. An x tile quantized in registers
# (from bf16 16-bit tiles of 64 values) can be stored only in 64-value tiles, and wgmma takes both
# operands at one swizzle.
_FUSED_E4M3_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
_TINY = 1e-30  # an all-zero row's maximum: its values stay 0 and its scale is negligible


def _smem_transforms(minor_elems: int, dtype) -> tuple:
    """wgmma-ready tiling of a tile whose minor dimension holds ``minor_elems`` values."""
    row_bytes = minor_elems * jnp.dtype(dtype).itemsize
    swizzle = min(_SWIZZLE_BYTES, row_bytes)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def padded_tokens(m: int) -> int:
    """Token rows as the kernel multiplies them: ``m`` rounded up to wgmma's N granule (8)."""
    return -(-m // TOKEN_MULTIPLE) * TOKEN_MULTIPLE


def quantize_rows_e4m3(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row of ``x [M, K]`` rounded to e4m3 with its own scale: (``x8`` e4m3, ``scale [M]`` f32).

    ``x ~= x8 * scale[:, None]``; a row's largest magnitude becomes 448 (exact). All-zero rows get
    scale 1.
    """
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    return jnp.clip(x32 / scale[:, None], -E4M3_MAX, E4M3_MAX).astype(FP8), scale


def quantize_blocks_e4m3(x: jax.Array, block_k: int) -> tuple[jax.Array, jax.Array]:
    """``"e4m3-fused"``'s rounding of ``x [M, K]``, as the kernel does it: each row's ``block_k``
    values of each K step to e4m3 with their own scale. (``x8``, ``scale [M, K / block_k]``),
    ``x ~= x8 * repeat(scale, block_k)``."""
    m, k = x.shape
    blocks = x.astype(jnp.bfloat16).astype(jnp.float32).reshape(m, k // block_k, block_k)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), _TINY)
    x8 = (blocks * (E4M3_MAX / amax)[..., None]).astype(FP8).reshape(m, k)
    return x8, amax / E4M3_MAX


F16_ROW_MAX = 256.0  # x's largest magnitude a row in f16: products with e4m3 (<= 448) or int8 stay far from f16's limits


def scale_rows_f16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row of ``x [M, K]`` scaled into f16 (largest magnitude ``F16_ROW_MAX``): (``x16``, ``scale [M]``).

    ``x ~= x16 * scale[:, None]``; f16's 11-bit significand keeps more of a bf16 x than bf16 does,
    and the scale keeps any row in range. All-zero rows get scale 1.
    """
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    scale = jnp.where(amax > 0, amax / F16_ROW_MAX, 1.0)
    return (x32 / scale[:, None]).astype(jnp.float16), scale


def _kernel(*refs, block_starts: tuple[int, ...], block_n: int, block_k: int, steps_per_split: int,
            max_concurrent_steps: int, weight_layout: str, scaled: bool, fused_epilogue: bool, widen: bool,
            quantize_x: bool, stage_in_smem: bool):
    # GMEM refs: the weights (each [N_i, K] or [K, N_i]), x [Mp, K], with ``scaled`` each
    # weight's scale [N_i] and x's [Mp] (f32), then the output: [Mp, sum N_i] in the output dtype
    # (``fused_epilogue``) or [k_splits, sum N_i, Mp] f32 partial sums; last, with ``scaled``
    # and ``fused_epilogue``, two barriers. Program (b, s) owns output rows b * block_n .. of the
    # weights laid end to end (weight i from block block_starts[i]) and K slice s.
    num_weights = len(block_starts) - 1
    w_refs, (x_ref, *rest) = refs[:num_weights], refs[num_weights:]
    if scaled:
        w_scale_refs, (x_scale_ref, out_ref, barriers) = rest[:num_weights], rest[num_weights:]
    else:
        (out_ref,) = rest
    tokens = x_ref.shape[0]
    block, split = lax.axis_index("n"), lax.axis_index("split")
    out_rows = pl.ds(block * block_n, block_n)
    k_slice = pl.ds(split * steps_per_split * block_k, steps_per_split * block_k)
    x_spec = plgpu.BlockSpec((tokens, block_k), lambda k: (0, k), transforms=_smem_transforms(block_k, x_ref.dtype))
    if quantize_x:  # the e4m3 tiles at a 64-byte swizzle: the one an x tile quantized in registers can be stored in
        w_transforms = _FUSED_E4M3_TRANSFORMS
    else:
        w_transforms = _smem_transforms(block_k if weight_layout == "nk" else block_n, w_refs[0].dtype)

    def one_weight(i):
        w_ref = w_refs[i]
        rows = pl.ds((block - block_starts[i]) * block_n, block_n)  # this weight's own rows
        if weight_layout == "nk":
            w_part = w_ref.at[rows, k_slice]
            w_spec = plgpu.BlockSpec((block_n, block_k), lambda k: (0, k), transforms=w_transforms)
        else:
            w_part = w_ref.at[k_slice, rows]
            w_spec = plgpu.BlockSpec((block_k, block_n), lambda k: (k, 0), transforms=w_transforms)

        def accumulate(acc_ref, widened_smem=None):
            def step(_, w_smem, x_smem):
                weights = w_smem if weight_layout == "nk" else w_smem.transpose((1, 0))  # [block_n, block_k]
                if widen:  # weight-only: the 8-bit tile to f16 in registers, the A operand from there
                    weights = weights[...].astype(jnp.float16)
                    if widened_smem is not None:  # the interpreter takes wgmma operands from smem only
                        widened_smem[...] = weights
                        plgpu.commit_smem()
                        weights = widened_smem
                plgpu.wgmma(acc_ref, weights, x_smem.transpose((1, 0)))
                # The tiles' slots are refilled when this step returns: the MMA must have read them.
                plgpu.wgmma_wait(0)

            plgpu.emit_pipeline(step, grid=(steps_per_split,), in_specs=[w_spec, x_spec],
                                max_concurrent_steps=max_concurrent_steps)(w_part, x_ref.at[:, k_slice])
            return acc_ref[...]

        def accumulate_quantizing(x8_smem, scale_smem):
            # Each step's x tile [tokens, block_k] (bf16) is rounded to e4m3 per token row with its
            # own scale, max|x| / 448 over the row's block_k values, and multiplied into a fresh
            # accumulator that is scaled and added to the running sum in registers.
            copy_layout = plgpu.Layout.SMEM_GMEM_COPY((tokens, block_k), jnp.bfloat16, _SWIZZLE_BYTES)

            def step(_, w_smem, x_smem, total):
                x = plgpu.load(x_smem, layout=copy_layout).astype(jnp.float32)  # [tokens, block_k]
                amax = jnp.maximum(jnp.max(jnp.abs(x), axis=1), _TINY)
                x8_smem[...] = (x * lax.broadcast_in_dim(E4M3_MAX / amax, x.shape, [0])).astype(FP8)
                scale_smem[...] = amax * (1 / E4M3_MAX)
                plgpu.commit_smem()
                # The scales again in the accumulator's column layout, through shared memory.
                scale = plgpu.load(scale_smem, layout=plgpu.Layout.WGMMA.reduce(0))  # [tokens]

                def multiply(acc_ref):
                    plgpu.wgmma(acc_ref, w_smem, x8_smem.T)
                    plgpu.wgmma_wait(0)  # the tiles' slots (and x8_smem) are reused after this step
                    return acc_ref[...]

                part = pl.run_scoped(multiply, plgpu.ACC((block_n, tokens), jnp.float32))
                return total + part * lax.broadcast_in_dim(scale, part.shape, [1])

            zeros = plgpu.layout_cast(jnp.zeros((block_n, tokens), jnp.float32), plgpu.Layout.WGMMA)
            return plgpu.emit_pipeline(step, grid=(steps_per_split,), in_specs=[w_spec, x_spec],
                                       max_concurrent_steps=max_concurrent_steps, init_carry=zeros)(
                w_part, x_ref.at[:, k_slice])

        accumulator = plgpu.ACC((block_n, tokens), jnp.float32)
        if quantize_x:
            acc = pl.run_scoped(accumulate_quantizing,
                                plgpu.SMEM((tokens, block_k), FP8, transforms=_FUSED_E4M3_TRANSFORMS),
                                plgpu.SMEM((tokens,), jnp.float32))
        elif widen and stage_in_smem:  # (an accumulator and an smem buffer need separate scopes)
            acc = pl.run_scoped(
                lambda widened_smem: pl.run_scoped(lambda acc_ref: accumulate(acc_ref, widened_smem), accumulator),
                plgpu.SMEM((block_n, block_k), jnp.float16, transforms=_smem_transforms(block_k, jnp.float16)))
        else:
            acc = pl.run_scoped(accumulate, accumulator)  # [block_n, Mp]

        if not fused_epilogue:
            def store_partials(out_smem):
                out_smem[...] = acc
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem, out_ref.at[split, out_rows])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(store_partials, plgpu.SMEM((block_n, tokens), jnp.float32))
            return

        def store(out_smem, *scale_smem):
            result = acc
            if scaled:
                w_scale_smem, x_scale_smem = scale_smem
                plgpu.copy_gmem_to_smem(w_scale_refs[i].at[rows], w_scale_smem, barriers.at[0])
                plgpu.copy_gmem_to_smem(x_scale_ref, x_scale_smem, barriers.at[1])
                plgpu.barrier_wait(barriers.at[0])
                plgpu.barrier_wait(barriers.at[1])
                w_scale = plgpu.load(w_scale_smem, layout=plgpu.Layout.WGMMA.reduce(1))  # [block_n]
                x_scale = plgpu.load(x_scale_smem, layout=plgpu.Layout.WGMMA.reduce(0))  # [Mp]
                result = (result * lax.broadcast_in_dim(w_scale, result.shape, [0])
                          * lax.broadcast_in_dim(x_scale, result.shape, [1]))
            # Stored through a transposed view: the output leaves as [Mp, N], the layout its consumer reads.
            out_smem.transpose((1, 0))[...] = result.astype(out_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_ref.at[:, out_rows])
            plgpu.wait_smem_to_gmem(0)

        scratch = [plgpu.SMEM((tokens, block_n), out_ref.dtype)]
        if scaled:
            scratch += [plgpu.SMEM((block_n,), jnp.float32), plgpu.SMEM((tokens,), jnp.float32)]
        pl.run_scoped(store, *scratch)

    if num_weights == 1:
        one_weight(0)
        return
    for i in range(num_weights):
        pl.when((block >= block_starts[i]) & (block < block_starts[i + 1]))(functools.partial(one_weight, i))


def check_shapes(m: int, n: int, k: int, *, block_n: int, block_k: int, k_splits: int,
                 max_concurrent_steps: int) -> None:
    """Raise ``ValueError`` naming the field and the limit if the kernel cannot take this shape."""
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"x must have 1 to {MAX_TOKENS} rows (tokens), got {m}")
    if block_n % WGMMA_ROWS or block_n <= 0:
        raise ValueError(f"block_n must be a positive multiple of {WGMMA_ROWS} (wgmma's M), got {block_n}")
    if n % block_n:
        raise ValueError(f"N ({n}) must be a multiple of block_n ({block_n})")
    if block_k <= 0 or block_k % 32:
        raise ValueError(f"block_k must be a positive multiple of 32 (an 8-bit wgmma's K), got {block_k}")
    if k_splits < 1 or k % (block_k * k_splits):
        raise ValueError(f"K ({k}) must be a multiple of block_k x k_splits ({block_k} x {k_splits})")
    if max_concurrent_steps < 1:
        raise ValueError(f"max_concurrent_steps must be at least 1, got {max_concurrent_steps}")


def _check_weight(w, w_scale, k: int, weight_layout: str, quantized, index: int) -> int:
    """The weight's N, after checking its rank, dtype (``quantized``: weights[0]'s 8-bit dtype, or
    None for bf16), K and scale."""
    name = f"weights[{index}]"
    if w.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {w.shape}")
    n, wk = w.shape if weight_layout == "nk" else w.shape[::-1]
    if wk != k:
        raise ValueError(f"x's K ({k}) and {name}'s K ({wk}, layout {weight_layout!r}) differ")
    expected = jnp.dtype(quantized or jnp.bfloat16)
    if w.dtype != expected:
        raise ValueError(f"{name} must be {expected.name} like weights[0], got {w.dtype}")
    if quantized and (w_scale is None or w_scale.shape != (n,)):
        raise ValueError(f"w_scales[{index}] must be [{n}] float32 for {expected.name} weights, got "
                         f"{None if w_scale is None else w_scale.shape}")
    return n


@functools.partial(jax.jit, static_argnames=(
    "activations", "weight_layout", "block_n", "block_k", "k_splits", "max_concurrent_steps", "out_dtype",
    "interpret"))
def wgmma_matmul_many(x: jax.Array, weights: tuple, w_scales: tuple | None = None, *,
                      x_scale: jax.Array | None = None, activations: str | None = None,
                      weight_layout: str = "nk", block_n: int = 64,
                      block_k: int = 128, k_splits: int = 1, max_concurrent_steps: int = 4, out_dtype=None,
                      interpret: bool | plgpu.InterpretGPUParams = False) -> list[jax.Array]:
    """``x [M, K]`` times each of ``weights`` (projections sharing an input: q/k/v, gate/up) in
    one launch: a list of ``[M, N_i]`` in ``out_dtype`` (default: float32 for fp8 weights, else
    x's dtype).

    Weights ``float8_e4m3fn [N_i, K]`` with ``w_scales[i] [N_i]`` (float32, per output channel),
    by ``activations``:

    - ``"e4m3"`` (fp8's default): W8A8. x is either bf16/f32, rounded to e4m3 per row here
      (:func:`quantize_rows_e4m3`), or already ``float8_e4m3fn`` with ``x_scale`` (``[M]`` per
      row, or ``[]`` for a static input scale);
    - ``"e4m3-fused"``: W8A8 with the rounding inside the kernel. x (bf16/f32, read as bf16) is
      rounded to e4m3 tile by tile, each token row of each K step with its own scale
      (:func:`quantize_blocks_e4m3` is the reference), so no XLA op quantizes it first; ``block_k``
      a multiple of 256;
    - ``"f16"``: weight-only. x (bf16/f32) is scaled per row into f16 (:func:`scale_rows_f16`:
      f16 keeps more of x than bf16 does), and each 8-bit tile is widened to f16 in registers
      between shared memory and the MMA (its A operand). Also for ``int8`` weights (the only mode
      they take).

    Weights ``bfloat16`` ``[N_i, K]`` (``weight_layout="nk"``) or ``[K, N_i]`` (``"kn"``)
    take no scales. Every ``N_i`` must be a multiple of ``block_n``. ``interpret`` runs Pallas's
    Mosaic GPU interpreter (CPU tests): ``True``, or its parameters (e.g. race detection).
    """
    mosaic_gpu_names.install()
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    weights = tuple(weights)
    if not weights:
        raise ValueError("weights must hold at least one weight")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [tokens, K], got shape {x.shape}")
    m, k = x.shape
    quantized = jnp.dtype(weights[0].dtype) if weights[0].dtype in (FP8, jnp.int8) else None
    if quantized is None and weights[0].dtype != jnp.bfloat16:
        raise ValueError(f"weights must be float8_e4m3fn or int8 (with w_scales) or bfloat16, got {weights[0].dtype}")
    activations = activations or ("e4m3" if quantized == FP8 else "f16" if quantized else None)
    allowed = ACTIVATIONS if quantized == FP8 else ("f16",) if quantized else (None,)
    if activations not in allowed:
        raise ValueError(f"activations must be one of {allowed} for {jnp.dtype(weights[0].dtype).name} weights, "
                         f"got {activations!r}")
    if quantized and weight_layout != "nk":
        raise ValueError("float8_e4m3fn and int8 weights must be [N, K] (weight_layout='nk'): an 8-bit wgmma "
                         "reads its operands K-major, and a widened tile is loaded row by row")
    if quantized and (w_scales is None or len(w_scales) != len(weights)):
        raise ValueError(f"w_scales must hold one [N] float32 scale per {jnp.dtype(quantized).name} weight "
                         f"({len(weights)})")
    if not quantized and w_scales is not None:
        raise ValueError("bfloat16 weights take no w_scales")
    ns = [_check_weight(w, w_scales[i] if quantized else None, k, weight_layout, quantized, i)
          for i, w in enumerate(weights)]
    row_scale = None
    if activations == "e4m3":
        if x.dtype == FP8:
            if x_scale is None or jnp.shape(x_scale) not in ((), (m,)):
                raise ValueError(f"x_scale must be [] or [{m}] float32 for float8_e4m3fn x, got "
                                 f"{None if x_scale is None else jnp.shape(x_scale)}")
            x_in, row_scale = x, jnp.broadcast_to(jnp.asarray(x_scale, jnp.float32), (m,))
        elif x_scale is not None:
            raise ValueError("x_scale goes with float8_e4m3fn x (already quantized); bf16/f32 x is "
                             "quantized per row here")
        else:
            x_in, row_scale = quantize_rows_e4m3(x)
    elif activations == "e4m3-fused":
        if x_scale is not None:
            raise ValueError("x_scale goes with float8_e4m3fn x; activations='e4m3-fused' rounds bf16 x "
                             "in the kernel")
        if x.dtype not in (jnp.bfloat16, jnp.float32):
            raise ValueError(f"x must be bfloat16 or float32 for activations='e4m3-fused', got {x.dtype}")
        if block_k % FUSED_BLOCK_K_MULTIPLE:
            raise ValueError(f"block_k must be a multiple of {FUSED_BLOCK_K_MULTIPLE} for activations='e4m3-fused' "
                             f"(x's bf16 tile is rounded in 64-value tiles spread over the warpgroup's 4 "
                             f"warps), got {block_k}")
        x_in, row_scale = x.astype(jnp.bfloat16), jnp.ones((m,), jnp.float32)  # x's scales apply inside
    else:
        if x_scale is not None:
            raise ValueError(f"x_scale goes with float8_e4m3fn x; activations={activations!r} takes bf16/f32 x")
        if x.dtype not in (jnp.bfloat16, jnp.float32):
            raise ValueError(f"x must be bfloat16 or float32 here, got {x.dtype}")
        if activations == "f16":
            x_in, row_scale = scale_rows_f16(x)
        else:
            x_in = x.astype(jnp.bfloat16)
    out_dtype = out_dtype or (jnp.float32 if quantized else x.dtype)
    for n in ns:
        check_shapes(m, n, k, block_n=block_n, block_k=block_k, k_splits=k_splits,
                     max_concurrent_steps=max_concurrent_steps)
    per_step = stage_bytes(m, block_n, block_k, weights[0].dtype, activations)
    room = PIPELINE_SMEM_BYTES - fixed_smem_bytes(m, block_k, activations)
    if max_concurrent_steps * per_step > room:
        raise ValueError(f"max_concurrent_steps ({max_concurrent_steps}) x {per_step} bytes a step "
                         f"(a {block_n}x{block_k} weight tile and {padded_tokens(m)} tokens of x) exceeds the "
                         f"pipeline's {room} bytes of shared memory")
    n_total = sum(ns)
    block_starts = tuple(int(v) for v in np.cumsum([0] + [n // block_n for n in ns]))
    mp = padded_tokens(m)
    x_in = jnp.pad(x_in, ((0, mp - m), (0, 0)))
    steps_per_split = k // (block_k * k_splits)
    # One split and a 16-bit output: the epilogue (scales, cast, [Mp, N] layout) is in the kernel.
    # Otherwise float32 partials [k_splits, N, Mp], added and scaled by XLA after it.
    fused_epilogue = k_splits == 1 and jnp.dtype(out_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    scaled = quantized is not None and fused_epilogue
    if fused_epilogue:
        out_type = jax.ShapeDtypeStruct((mp, n_total), out_dtype)
    else:
        out_type = jax.ShapeDtypeStruct((k_splits, n_total, mp), jnp.float32)
    body = functools.partial(_kernel, block_starts=block_starts, block_n=block_n, block_k=block_k,
                          steps_per_split=steps_per_split, max_concurrent_steps=max_concurrent_steps,
                          weight_layout=weight_layout, scaled=scaled, fused_epilogue=fused_epilogue,
                          widen=activations == "f16", quantize_x=activations == "e4m3-fused",
                          stage_in_smem=bool(interpret))
    # The kernel's name (Mosaic GPU's is its body's) says what it multiplies, so a profile's
    # kernels read "wgmma_matmul_e4m3_fused_n6144_k4096" rather than "anonymous".
    mode = (activations or "bf16").replace("-", "_")
    body.__name__ = f"wgmma_matmul_{mode}_n{n_total}_k{k}"
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=(plgpu.Barrier(num_barriers=2),) if scaled else (),
        grid=(n_total // block_n, k_splits),
        grid_names=("n", "split"),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                   else plgpu.InterpretGPUParams() if interpret else None),
    )
    if fused_epilogue:
        scales = ((*(s.astype(jnp.float32) for s in w_scales), jnp.pad(row_scale, (0, mp - m), constant_values=1.0))
                  if scaled else ())
        y = kernel(*weights, x_in, *scales)[:m]  # [M, sum N_i]
    else:
        partials = kernel(*weights, x_in)
        acc = partials[0] if k_splits == 1 else partials.sum(axis=0)  # [sum N_i, Mp]
        y = acc[:, :m].T
        if quantized is not None:
            y = y * row_scale[:, None] * jnp.concatenate([s.astype(jnp.float32) for s in w_scales])[None, :]
        y = y.astype(out_dtype)
    bounds = np.cumsum([0] + ns)
    return [y[:, int(lo):int(hi)] for lo, hi in zip(bounds[:-1], bounds[1:])]


def wgmma_matmul(x: jax.Array, w: jax.Array, w_scale: jax.Array | None = None, **options) -> jax.Array:
    """``x [M, K]`` times one weight: :func:`wgmma_matmul_many` with ``weights=(w,)``."""
    return wgmma_matmul_many(x, (w,), None if w_scale is None else (w_scale,), **options)[0]


def split_count(n: int, k: int, block_n: int, block_k: int, *, num_sms: int = 132, min_steps: int = 4) -> int:
    """K splits for about one program per SM: doubled while the grid has fewer than 90% of
    ``num_sms`` programs and each split keeps at least ``min_steps`` steps."""
    k_splits = 1
    while (n // block_n) * k_splits < num_sms * 0.9 and k % (block_k * k_splits * 2) == 0 \
            and k // (block_k * k_splits * 2) >= min_steps:
        k_splits *= 2
    return k_splits


# Programs below which the default sizes split K (and pay an XLA epilogue): with fewer, even deep
# pipelines leave too few bytes in flight across the GPU.
MIN_PROGRAMS_UNSPLIT = 48
# Shared memory the pipeline's stages may take: sm_90's 227 KB a block less room for the
# epilogue's staging tile ([64 tokens, block_n] in 16 bits: 8 KB), its scales and barriers.
PIPELINE_SMEM_BYTES = 208 * 1024


def stage_bytes(m: int, block_n: int, block_k: int, weight_dtype, activations: str | None = None) -> int:
    """Shared memory of one pipeline step: a weight tile and an x tile (tokens padded to 8) in the
    operand dtypes the kernel stages (e4m3 x for W8A8, f16 for the weight-only modes, else bf16;
    ``"e4m3-fused"`` stages bf16 x and rounds it into one e4m3 tile outside the stages:
    :func:`fixed_smem_bytes`)."""
    x_itemsize = 1 if _x_operand_is_e4m3(weight_dtype, activations) else 2
    return block_n * block_k * jnp.dtype(weight_dtype).itemsize + padded_tokens(m) * block_k * x_itemsize


def fixed_smem_bytes(m: int, block_k: int, activations: str | None = None) -> int:
    """Shared memory outside the pipeline's stages that grows with the tiles: ``"e4m3-fused"``'s
    one e4m3 x tile (the epilogue's staging is within ``PIPELINE_SMEM_BYTES``'s margin)."""
    return padded_tokens(m) * block_k if activations == "e4m3-fused" else 0


def _x_operand_is_e4m3(weight_dtype, activations: str | None) -> bool:
    return jnp.dtype(weight_dtype) == jnp.dtype(FP8) and activations in (None, "e4m3")


def default_sizes(m: int, n: int, k: int, weight_dtype, *, activations: str | None = None,
                  num_sms: int = 132) -> dict:
    """Tile sizes for ``wgmma_matmul`` when nothing measured says better: 64 weight rows a program,
    256 bytes of K a step (two 128-byte swizzle rows), up to 6 steps in flight (96 KB of weight a
    program) within ``PIPELINE_SMEM_BYTES`` of stages (x's tile grows with the tokens: 64 tokens
    of f16 x take 32 KB a step), and K unsplit (the epilogue in the kernel) unless N gives fewer
    than ``MIN_PROGRAMS_UNSPLIT`` programs. ``activations`` as for :func:`wgmma_matmul_many`;
    ``"e4m3-fused"`` rounds x every step, which costs more than the step's copy (session 22: 1.2-2.2
    TB/s at 256-byte steps and 64-448 programs), so it takes 512-byte steps (half the steps; up
    to 16 tokens) and splits K to about a program an SM."""
    fused = activations == "e4m3-fused"
    step_bytes = 512 if fused and padded_tokens(m) <= 16 else 256  # (more tokens: bf16 x fills the stages)
    block_n, block_k = 64, step_bytes // jnp.dtype(weight_dtype).itemsize
    if k % block_k:
        block_k //= 2
    if fused:  # each step's rounding of x costs more than its copy at 64 programs: a program an SM
        k_splits = split_count(n, k, block_n, block_k, num_sms=num_sms)
    else:
        k_splits = 1 if n // block_n >= MIN_PROGRAMS_UNSPLIT else split_count(n, k, block_n, block_k, num_sms=num_sms)
    room = PIPELINE_SMEM_BYTES - fixed_smem_bytes(m, block_k, activations)
    steps = min(6, room // stage_bytes(m, block_n, block_k, weight_dtype, activations))
    return dict(block_n=block_n, block_k=block_k, k_splits=k_splits, max_concurrent_steps=steps)

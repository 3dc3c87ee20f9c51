"""Weight-only FP8 / int8 / bf16 matmul for few tokens on NVIDIA Hopper, in Pallas with the Triton lowering.

``out[M, N] = (x[M, K] @ w[N, K]^T) * scale[N]``, with ``w`` in float8_e4m3fn or int8
stored ``[out, in]`` and ``x`` in bfloat16 (or float32); or ``x @ w^T`` with unquantized
bfloat16 ``w`` and no scale (the plain decode GEMV, same kernel). Decode steps multiply a handful
of token rows by every weight of the model, so the step is a read of the weights: the
kernel streams each weight byte from HBM exactly once, converts it to x's dtype in
registers (exact for both formats), accumulates in float32 and applies the per-channel
scale once per output in the epilogue. Reading fp8 instead of bf16 halves the bytes, so
at M <= ~16 it should run close to twice as fast as a bf16 GEMV. XLA's own FP8 paths were
measured at 1.4-2 TB/s there (of 4.5; ``../../shared/BENCHMARKS.md``): cuBLASLt's FP8 GEMM
wants M padded to 16, and convert-then-dot is a GEMM tiling, not a stream.

Grid ``(N / block_n, k_splits)``: program ``(j, s)`` owns output columns
``[j * block_n, (j + 1) * block_n)`` and the ``s``-th slice of K, walking it ``block_k``
at a time in a loop Triton software-pipelines ``num_stages`` deep. When ``N / block_n``
alone leaves SMs idle (``k``/``v`` at N=1024), K is split and the float32 partial sums
(``k_splits * M * N * 4`` bytes, small next to the weights) are added by one fused XLA
step, which also casts to x's dtype. x's rows are padded to the tile with masked loads,
so neither x nor the output is copied to pad M.

Tile sizes and the five multiply forms (tensor-core dot, swapped dot, element-wise FMA
with a tile-sized accumulator, GEMV reducing every step, and that GEMV with f16 products
summed over short spans) are in ``block_sizes``; the measured table that picks among them
per shape is ``tuning_table``. fp8 weights become floats by the hardware's conversion or,
with ``convert="bits"``, by integer ops on their bits (``conversion``: the conversion pipe
is the suspected limit of the fp8 GEMV), the power of two that leaves folded into the
epilogue's scale.

bf16 weights may also come as the model stores them, ``w [K, N]`` (``layout="kn"``): then
``w_ref`` is ``[K / k_splits, block_n]`` and each step's tile is ``block_k`` rows, each
contiguous along N, so a program owning 64-256 output columns reads whole cache lines and
the model needs no transposed copy of its weights.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.precision import matmul_precision
from pallas_kernels.quantized_matmul.block_sizes import (
    GEMV_F16_SPAN,
    GEMV_F16_X_LIMIT,
    GEMV_F16_X_SHIFT,
    MatmulBlockSizes,
    default_block_sizes,
    num_k_splits,
    padded_rows,
)
from pallas_kernels.quantized_matmul.conversion import (
    E4M3_F16_SHIFT, E4M3_F32_SHIFT, e4m3_to_f16_scaled, e4m3_to_f16_scaled_ptx, e4m3_to_f32_scaled,
)
from pallas_kernels.quantized_matmul.validation import (
    check_block_sizes, check_inputs, check_operands, operands_fit,
)


F16_MAX = 65504.0
# The f32 forms with convert="bits" multiply weights w * 2**-120 (e4m3 subnormals as f32
# denormals) by x * 2**F32_BITS_X_SHIFT, so a product is a denormal only when |w x| < 2**-70
# (negligible whether or not the compiler flushes denormals) instead of < 2**-6; x is
# saturated to +-F32_BITS_X_LIMIT first so its scaled copy stays finite.
F32_BITS_X_SHIFT = 64
F32_BITS_X_LIMIT = 2.0 ** 63


def _load_x_tile(x_ref, k0, *, m: int, block_m: int, block_k: int):
    """x's columns ``[k0, k0 + block_k)`` as ``[block_m, block_k]``; rows past ``m`` read as zeros."""
    if block_m == m:
        return x_ref[:, pl.ds(k0, block_k)]
    row = jnp.arange(block_m, dtype=jnp.int32)
    is_row = jnp.broadcast_to((row < m)[:, None], (block_m, block_k))
    # Clamped row indices keep even masked lanes' addresses inside x.
    rows = jnp.broadcast_to(jnp.minimum(row, m - 1)[:, None], (block_m, block_k))
    cols = jnp.broadcast_to((k0 + jnp.arange(block_k, dtype=jnp.int32))[None, :], (block_m, block_k))
    return plgpu.load(x_ref.at[rows, cols], mask=is_row, other=0.0)


def _store_rows(out_ref, values, *, m: int):
    """Store ``values [block_m, block_n]`` into ``out_ref [m, block_n]``, dropping padded rows."""
    block_m, block_n = values.shape
    values = values.astype(out_ref.dtype)
    if block_m == m:
        out_ref[...] = values
        return
    row = jnp.arange(block_m, dtype=jnp.int32)
    is_row = jnp.broadcast_to((row < m)[:, None], (block_m, block_n))
    # Padded rows keep their own (out-of-range, never written) row index: clamping them
    # onto row m - 1 would alias it, and the interpreter's scatter would let them win.
    rows = jnp.broadcast_to(row[:, None], (block_m, block_n))
    cols = jnp.broadcast_to(jnp.arange(block_n, dtype=jnp.int32)[None, :], (block_m, block_n))
    plgpu.store(out_ref.at[rows, cols], values, mask=is_row)


def _convert_weights(w, dtype):
    """fp8 / int8 / bf16 weights to ``dtype`` (bf16 or f32), exactly: every e4m3 and int8 value is a bf16 and an f16.

    To f32 the path is through f16, one ``cvt`` for two fp8 values on sm_89+; fp8 to bf16 is
    Triton's own conversion; int8 goes through f16 either way (a conversion every GPU has).
    bf16 weights (the unquantized GEMV) are used as they are, or widened to f32.
    """
    if jnp.dtype(w.dtype) == jnp.dtype(dtype):
        return w
    if jnp.dtype(w.dtype) == jnp.bfloat16 or (
            jnp.dtype(dtype) == jnp.bfloat16 and jnp.dtype(w.dtype) == jnp.float8_e4m3fn):
        return w.astype(dtype)
    return w.astype(jnp.float16).astype(dtype)


def _matmul_kernel(
    x_ref,  # [M, K / k_splits]: this split's columns of x
    w_ref,  # [block_n, K / k_splits] ("nk") or [K / k_splits, block_n] ("kn"): this program's weights, this split's K
    *refs,  # scale_ref [block_n] float32 (quantized weights only), then out_ref [M, block_n]: the
    # output (k_splits == 1) or this split's float32 partial sums
    m: int, sizes: MatmulBlockSizes, compute_dtype, precision, scaled: bool, layout: str, interpret: bool,
):
    scale_ref, out_ref = refs if scaled else (None, refs[0])
    block_n, block_k = sizes.block_n, sizes.block_k
    # "kn": the dense einsum layout, w [in, out]. A tile is block_k rows each contiguous along N,
    # so a program owning block_n >= 64 outputs still loads whole 128-byte lines.
    k_major = layout == "kn"
    num_steps = w_ref.shape[0 if k_major else 1] // block_k
    depth = int(sizes.prefetch)  # weight tiles loaded ahead of the one being multiplied
    # bf16 weights carry no scale: a multiply by one would be wasted work per output.
    scale = scale_ref[...].astype(jnp.float32) if scaled else None  # [block_n]
    reduce_k = 0 if k_major else 1  # the tile's K axis

    bits = sizes.convert in ("bits", "bits_ptx")
    # The power of two the "bits" conversion (and x's pre-scaling) leaves in the sums, undone in
    # the epilogue, before the per-channel scale (the sums are then the true ones, so no overflow).
    if not bits:
        unscale = None
    elif sizes.algorithm == "gemv_f16":
        unscale = 2.0 ** (E4M3_F16_SHIFT + GEMV_F16_X_SHIFT)
    elif sizes.algorithm in ("gemv", "fma"):
        unscale = 2.0 ** (E4M3_F32_SHIFT - F32_BITS_X_SHIFT)
    else:
        unscale = 2.0 ** E4M3_F16_SHIFT

    def scaled_by_channel(values):  # values [..., block_n] with the per-channel scale applied
        if unscale is not None:
            values = values * unscale
        return values if scale is None else values * scale

    def f16_weights(tile):  # a raw fp8 tile as f16 weights * 2**-8, by "bits" or "bits_ptx"
        if sizes.convert == "bits_ptx":
            return e4m3_to_f16_scaled_ptx(tile, interpret=interpret)
        return e4m3_to_f16_scaled(tile)

    def f32_weights(tile):  # a raw tile as f32: the weights, or (convert="bits") the weights * 2**-120
        return e4m3_to_f32_scaled(tile) if bits else _convert_weights(tile, jnp.float32)

    def load_weights(i):  # the raw weight tile of step i (a traced or a Python int), in its stored orientation
        start = i * block_k if isinstance(i, int) else pl.multiple_of(i * block_k, block_k)
        return w_ref[pl.ds(start, block_k), :] if k_major else w_ref[:, pl.ds(start, block_k)]

    def x_column(r, k0):  # row r of x over this step's K (f32), shaped to broadcast against a weight tile
        x = x_ref[r, pl.ds(k0, block_k)].astype(jnp.float32)
        if bits:  # see F32_BITS_X_SHIFT; a multiply by a power of two is exact
            x = jnp.clip(x, -F32_BITS_X_LIMIT, F32_BITS_X_LIMIT) * (2.0 ** F32_BITS_X_SHIFT)
        return x[:, None] if k_major else x[None, :]

    def k_loop(step, init):
        """``fori_loop`` over K steps of ``step(i, k0, raw_tile, carry)``, the tile loaded here.

        With ``prefetch = d > 0`` the carry also holds the next ``d`` steps' raw tiles, each
        loaded ``d`` steps before its arithmetic: ``d + 1`` tiles in flight per program even
        where Triton does not software-pipeline the loop (it pipelines loads that feed a dot;
        the gemv and fma forms have none).
        """
        def body(i, carry):
            k0 = pl.multiple_of(i * block_k, block_k)
            if not depth:
                return step(i, k0, load_weights(i), carry)
            state, tiles = carry
            ahead = load_weights(jnp.minimum(i + depth, num_steps - 1))
            return step(i, k0, tiles[0], state), tiles[1:] + (ahead,)

        if not depth:
            return lax.fori_loop(0, num_steps, body, init)
        first = tuple(load_weights(min(d, num_steps - 1)) for d in range(depth))
        return lax.fori_loop(0, num_steps, body, (init, first))[0]

    if sizes.algorithm == "fma":
        # One [block_n, block_k] accumulator per row of x: products are added element-wise
        # each step and reduced over K once at the end, so the loop has no cross-lane work.
        def fma_step(i, k0, tile, accs):
            w = f32_weights(tile)
            return tuple(acc + w * x_column(r, k0) for r, acc in enumerate(accs))

        zeros = jnp.zeros((block_k, block_n) if k_major else (block_n, block_k), jnp.float32)
        accs = k_loop(fma_step, (zeros,) * m)
        for r, acc in enumerate(accs):
            out_ref[r, :] = scaled_by_channel(jnp.sum(acc, axis=reduce_k)).astype(out_ref.dtype)
        return

    if sizes.algorithm == "gemv":
        # One [block_n] accumulator per row of x, reduced over the tile's K every step: the
        # registers hold the weight tiles in flight (this step's and, with prefetch, the next
        # one's), not an [block_n, block_k] f32 accumulator per row as "fma" does, so tiles of
        # 16-64 KB fit. Per-step reductions cost a few shuffles per row against a tile of
        # thousands of weights.
        def gemv_step(i, k0, tile, accs):
            w = f32_weights(tile)
            return tuple(acc + jnp.sum(w * x_column(r, k0), axis=reduce_k) for r, acc in enumerate(accs))

        accs = k_loop(gemv_step, (jnp.zeros((block_n,), jnp.float32),) * m)
        for r, acc in enumerate(accs):
            out_ref[r, :] = scaled_by_channel(acc).astype(out_ref.dtype)
        return

    if sizes.algorithm == "gemv_f16":
        # "gemv" in half precision (block_sizes' module doc): products and sums of spans of
        # GEMV_F16_SPAN products in f16, where the GPU packs two per instruction and no weight
        # needs a conversion beyond the bit shifts; each span's sum joins the row's f32
        # accumulator. Weights are w * 2**-8 (<= 1.75), x is x * 2**-4, saturated so a span's
        # sum stays finite; the epilogue multiplies by 2**12. Only fp8 in "nk" gets here.
        # A span takes every other K of 2 * SPAN consecutive ones ([.., SPAN, 2], summed over
        # SPAN): the two spans of each group are independent chains of the same adds on
        # neighbouring halves, which is what a compiler can put in one f16x2 register without
        # reassociating a sum; consecutive K in one span would make each add depend on the last.
        num_groups = block_k // (2 * GEMV_F16_SPAN)

        def x_half(r, k0):  # [1, block_k] f16
            x = x_ref[r, pl.ds(k0, block_k)].astype(jnp.float32)
            x = jnp.clip(x, -GEMV_F16_X_LIMIT, GEMV_F16_X_LIMIT) * (2.0 ** -GEMV_F16_X_SHIFT)
            return x.astype(jnp.float16)[None, :]

        def gemv_f16_step(i, k0, tile, accs):
            w = f16_weights(tile)  # [block_n, block_k] f16
            out = []
            for r, acc in enumerate(accs):
                products = (w * x_half(r, k0)).reshape(block_n, num_groups, GEMV_F16_SPAN, 2)
                # lax.reduce keeps f16 (jnp.sum would sum f16 in f32, a conversion per product); a
                # NumPy zero lets it recognise the sum (reduce_sum, which Pallas-Triton lowers).
                spans = lax.reduce(products, np.float16(0), lax.add, (2,))  # [block_n, num_groups, 2] f16
                # One axis at a time: Pallas-Triton's lowering of a two-axis sum fails under a mesh.
                out.append(acc + jnp.sum(jnp.sum(spans.astype(jnp.float32), axis=2), axis=1))
            return tuple(out)

        accs = k_loop(gemv_f16_step, (jnp.zeros((block_n,), jnp.float32),) * m)
        for r, acc in enumerate(accs):
            out_ref[r, :] = scaled_by_channel(acc).astype(out_ref.dtype)
        return

    block_m = padded_rows(m, sizes.algorithm)
    swapped = sizes.algorithm == "mma_swapped"

    def mma_step(i, k0, tile, acc):
        # convert="bits" (dot_dtype float16 only): f16 weights * 2**-8, undone in the epilogue.
        w = f16_weights(tile) if bits else _convert_weights(tile, compute_dtype)
        x = _load_x_tile(x_ref, k0, m=m, block_m=block_m, block_k=block_k)
        if jnp.dtype(compute_dtype) == jnp.float16:
            # Saturate rather than overflow to inf: f16 tops out at 65504 where bf16 does not.
            x = jnp.clip(x.astype(jnp.float32), -F16_MAX, F16_MAX)
        x = x.astype(compute_dtype)
        if swapped:  # acc [block_n, block_m]
            return acc + plgpu.dot(w, x, trans_a=k_major, trans_b=True, precision=precision)
        return acc + plgpu.dot(x, w, trans_b=not k_major, precision=precision)  # acc [block_m, block_n]

    acc_shape = (block_n, block_m) if swapped else (block_m, block_n)
    acc = k_loop(mma_step, jnp.zeros(acc_shape, jnp.float32))
    if swapped:
        acc = acc.T
    _store_rows(out_ref, scaled_by_channel(acc), m=m)


def weight_only_matmul_gpu(x, w, scale, *, sizes: MatmulBlockSizes, interpret: bool = False,
                           layout: str = "nk") -> jax.Array:
    """``(x @ w^T) * scale`` in ``x.dtype`` through the kernel, at the given (already checked) sizes.

    ``scale`` is None for unquantized (bf16) weights: the kernel then takes no scale input.
    ``layout``: "nk" for ``w [N, K]`` (stored [out, in]), "kn" for ``w [K, N]`` (``x @ w``).
    """
    m, k = x.shape
    n = w.shape[1] if layout == "kn" else w.shape[0]
    splits = sizes.k_splits
    k_per_split = k // splits
    scaled = scale is not None
    # bf16 x: weights convert to bf16 (exact) and the dot runs on bf16 tensor cores with
    # f32 accumulation; f32 x: weights convert to f32 and the dot is IEEE f32 (HIGHEST).
    # dot_dtype "float16" (fp8 / int8 weights, bf16 x): the dot runs in f16 instead (see block_sizes).
    compute_dtype = jnp.float16 if sizes.dot_dtype == "float16" else x.dtype
    kernel = functools.partial(_matmul_kernel, m=m, sizes=sizes, compute_dtype=compute_dtype,
                               precision=matmul_precision(compute_dtype), scaled=scaled, layout=layout,
                               interpret=interpret)
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
        out_spec = pl.BlockSpec((m, sizes.block_n), lambda j, s: (0, j))
    else:
        out_shape = jax.ShapeDtypeStruct((splits, m, n), jnp.float32)
        out_spec = pl.BlockSpec((None, m, sizes.block_n), lambda j, s: (s, 0, j))
    in_specs = [
        pl.BlockSpec((m, k_per_split), lambda j, s: (0, s)),
        pl.BlockSpec((k_per_split, sizes.block_n), lambda j, s: (s, j)) if layout == "kn"
        else pl.BlockSpec((sizes.block_n, k_per_split), lambda j, s: (j, s)),
    ]
    operands = (x, w)
    if scaled:
        in_specs.append(pl.BlockSpec((sizes.block_n,), lambda j, s: (j,)))
        operands += (scale,)
    out = pl.pallas_call(
        kernel,
        grid=(n // sizes.block_n, splits),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages),
        interpret=interpret,
        name=f"weight_only_matmul_{jnp.dtype(w.dtype).name}_{layout}",
    )(*operands)
    if splits == 1:
        return out
    return jnp.sum(out, axis=0).astype(x.dtype)


def resolve_block_sizes(m: int, n: int, k: int, weight_dtype=jnp.float8_e4m3fn, layout: str = "nk",
                        **overrides) -> MatmulBlockSizes:
    """The default sizes for this shape, weight format and layout with any non-None ``overrides`` applied.

    When the tile is overridden but ``k_splits`` is not, the split count is recomputed for
    the new tile; ``k_splits`` given explicitly is kept as is.
    """
    overrides = {name: value for name, value in overrides.items() if value is not None}
    sizes = dataclasses.replace(default_block_sizes(m, n, k, weight_dtype, layout=layout), **overrides)
    if "k_splits" not in overrides and ({"block_n", "block_k"} & overrides.keys()):
        sizes = dataclasses.replace(sizes, k_splits=num_k_splits(n, k, sizes.block_n, sizes.block_k))
    check_block_sizes(sizes, m, n, k)
    return sizes


_STATIC = ("interpret", "algorithm", "block_n", "block_k", "k_splits", "num_warps", "num_stages", "prefetch",
           "dot_dtype", "convert")


def _weight_only_matmul(x, w, scale, weight_dtype, *, interpret, algorithm, block_n, block_k, k_splits,
                        num_warps, num_stages, prefetch, dot_dtype=None, convert=None, layout="nk"):
    check_inputs(x, w, scale, weight_dtype, layout)
    m, k = x.shape
    n = w.shape[1] if layout == "kn" else w.shape[0]
    sizes = resolve_block_sizes(m, n, k, weight_dtype, layout, algorithm=algorithm, block_n=block_n,
                                block_k=block_k, k_splits=k_splits, num_warps=num_warps, num_stages=num_stages,
                                prefetch=prefetch, dot_dtype=dot_dtype, convert=convert)
    if not operands_fit(sizes, x.dtype, weight_dtype):
        # A measured default for bf16 x and fp8 weights does not apply to an f32 caller (it keeps
        # its exact f32 arithmetic) or to other weights: the options the caller did not force
        # fall back to the plain ones, on the same tiles.
        sizes = dataclasses.replace(
            sizes, dot_dtype=sizes.dot_dtype if dot_dtype is not None else None,
            convert=sizes.convert if convert is not None else "cvt",
            algorithm="gemv" if algorithm is None and sizes.algorithm == "gemv_f16" else sizes.algorithm)
    check_operands(sizes, x.dtype, weight_dtype)
    return weight_only_matmul_gpu(x, w, scale, sizes=sizes, interpret=interpret, layout=layout)


@functools.partial(jax.jit, static_argnames=_STATIC)
def fp8_weight_only_matmul(
    x: jax.Array, w: jax.Array, scale: jax.Array, *, interpret: bool = False, algorithm: str | None = None,
    block_n: int | None = None, block_k: int | None = None, k_splits: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, prefetch: int | None = None,
    dot_dtype: str | None = None, convert: str | None = None,
) -> jax.Array:
    """``x @ (w * scale[:, None]).T for few tokens, reading the fp8 weights once: ``[M, N]`` in ``x.dtype``.

    Accepts ``x [M, K]`` bfloat16 or float32 with ``1 <= M <= 64``, ``w [N, K]``
    float8_e4m3fn stored ``[out, in]`` (contracting on its minor dimension), ``scale [N]``
    float32 per output channel. ``N`` must be a multiple of ``block_n`` and ``K`` of
    ``block_k * k_splits`` (the defaults fit any N, K that are multiples of 16); anything
    else raises ``ValueError`` naming the field. Tile sizes default to
    ``block_sizes.default_block_sizes`` (the measured table where it has the shape); each
    can be forced (sweeps, tests); ``prefetch`` is how many weight tiles a program loads
    ahead (0-3; True means 1); ``dot_dtype="float16"`` runs the tensor-core forms in f16
    (bf16 x only, saturated to f16's range); ``convert="bits"`` converts the weights by integer
    ops on their bits instead of the hardware's ``cvt`` (``conversion``; required by
    ``algorithm="gemv_f16"``, the half-precision GEMV for bf16 x), ``convert="bits_ptx"`` by
    the same ops as inline PTX on packed registers (f16 consumers only). ``interpret=True`` runs the kernel in Pallas's interpreter
    (CPU tests). Needs compute capability >= 8.9 on the GPU (Triton's fp8 conversion).
    """
    return _weight_only_matmul(x, w, scale, jnp.float8_e4m3fn, interpret=interpret, algorithm=algorithm,
                               block_n=block_n, block_k=block_k, k_splits=k_splits, num_warps=num_warps,
                               num_stages=num_stages, prefetch=prefetch, dot_dtype=dot_dtype, convert=convert)


@functools.partial(jax.jit, static_argnames=_STATIC)
def int8_weight_only_matmul(
    x: jax.Array, w: jax.Array, scale: jax.Array, *, interpret: bool = False, algorithm: str | None = None,
    block_n: int | None = None, block_k: int | None = None, k_splits: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, prefetch: int | None = None,
    dot_dtype: str | None = None, convert: str | None = None,
) -> jax.Array:
    """``fp8_weight_only_matmul`` for int8 weights ``w [N, K]`` (per-channel ``scale [N]``), same kernel and contract.

    int8 converts to bfloat16 exactly (|w| <= 128), so the arithmetic is the fp8 path's.
    Runs on any GPU Triton supports.
    """
    return _weight_only_matmul(x, w, scale, jnp.int8, interpret=interpret, algorithm=algorithm,
                               block_n=block_n, block_k=block_k, k_splits=k_splits, num_warps=num_warps,
                               num_stages=num_stages, prefetch=prefetch, dot_dtype=dot_dtype, convert=convert)


@functools.partial(jax.jit, static_argnames=_STATIC + ("layout",))
def bf16_weight_only_matmul(
    x: jax.Array, w: jax.Array, *, interpret: bool = False, algorithm: str | None = None,
    block_n: int | None = None, block_k: int | None = None, k_splits: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, prefetch: int | None = None,
    dot_dtype: str | None = None, convert: str | None = None, layout: str = "nk",
) -> jax.Array:
    """``x @ w.T`` for few tokens with unquantized bfloat16 weights ``w [N, K]`` (no scale): the plain decode GEMV.

    Same kernel, contract and tile options as ``fp8_weight_only_matmul``; it exists because
    XLA's bf16 GEMV chain runs at ~65% of the HBM read rate at one row (issue 21), and
    bf16 batch-1 decode is a read of every weight. ``layout="kn"`` takes ``w [K, N]`` and
    returns ``x @ w``: the layout the model's dense weights already have (einsum
    ``"te,ef->tf"``), so the weight layer needs no second copy of them; each program owns
    ``block_n`` output columns and walks K in row tiles that are contiguous along N.
    """
    return _weight_only_matmul(x, w, None, jnp.bfloat16, interpret=interpret, algorithm=algorithm,
                               block_n=block_n, block_k=block_k, k_splits=k_splits, num_warps=num_warps,
                               num_stages=num_stages, prefetch=prefetch, dot_dtype=dot_dtype, convert=convert,
                               layout=layout)

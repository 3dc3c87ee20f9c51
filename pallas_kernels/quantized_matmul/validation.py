"""Checks of the weight-only matmul's inputs and tile sizes, with messages that name the field and the limit."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.quantized_matmul.block_sizes import (
    ALGORITHMS, CONVERSIONS, DOT_DTYPES, GEMV_F16_SPAN, LAYOUTS, MAX_FMA_ROWS, MAX_GEMV_ROWS, MAX_PREFETCH, MAX_ROWS, MatmulBlockSizes,
)

ACTIVATION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def supports_shape(m: int, n: int, k: int) -> bool:
    """Whether the kernels serve ``x [m, k] @ w[n, k]^T`` at their default tiles, without raising.

    For a dispatcher deciding between the kernel and XLA: 1 <= m <= 64 rows, and N, K
    multiples of 16 (the defaults shrink their tiles to divide any such N and K).
    """
    return 1 <= m <= MAX_ROWS and n > 0 and k > 0 and n % 16 == 0 and k % 16 == 0


def check_inputs(x, w, scale, weight_dtype, layout: str = "nk") -> None:
    """``x [M, K]`` bf16/f32 with 1 <= M <= 64, ``w [N, K]`` (layout "nk") or ``[K, N]`` ("kn") of
    ``weight_dtype``, ``scale [N]`` float32.

    ``scale`` is None for bf16 weights (unquantized: nothing to scale) and required otherwise.
    """
    weight_dtype = jnp.dtype(weight_dtype)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x has M={m} rows; this kernel serves 1 <= M <= {MAX_ROWS} (use XLA's matmul above)")
    stored = "[K, N] (stored [in, out], layout 'kn')" if layout == "kn" else "[N, K] (stored [out, in])"
    if w.ndim != 2:
        raise ValueError(f"w must be {stored}, got shape {w.shape}")
    if jnp.dtype(w.dtype) != weight_dtype:
        raise ValueError(f"w must be {weight_dtype}, got {w.dtype}")
    w_k, n = w.shape if layout == "kn" else w.shape[::-1]
    if w_k != k:
        raise ValueError(f"w's K ({w_k}) must equal x's K ({k}); w must be {stored}")
    if weight_dtype == jnp.dtype(jnp.bfloat16):
        if scale is not None:
            raise ValueError("scale must be None for bfloat16 weights (they are not quantized)")
        return
    if scale is None:
        raise ValueError(f"scale is required for {weight_dtype} weights: [N] = ({n},) float32")
    if scale.shape != (n,):
        raise ValueError(f"scale must be [N] = ({n},), one per output channel, got shape {scale.shape}")
    if jnp.dtype(scale.dtype) != jnp.float32:
        raise ValueError(f"scale must be float32, got {scale.dtype}")


def check_block_sizes(sizes: MatmulBlockSizes, m: int, n: int, k: int) -> None:
    """The tiles must divide the matrix exactly: the kernel reads weights without bounds masks."""
    if sizes.algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {sizes.algorithm!r}")
    for name in ("block_n", "block_k", "k_splits", "num_warps"):
        value = getattr(sizes, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 1, got {value}")
    if not 0 <= int(sizes.prefetch) <= MAX_PREFETCH:
        raise ValueError(f"prefetch (weight tiles loaded ahead) must be in [0, {MAX_PREFETCH}], got {sizes.prefetch}")
    if sizes.num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {sizes.num_stages}")
    if sizes.algorithm != "fma" and (sizes.block_n < 16 or sizes.block_k < 16):
        raise ValueError(f"algorithm {sizes.algorithm!r} uses Triton's dot: block_n and block_k must be >= 16, "
                         f"got {sizes.block_n} and {sizes.block_k}")
    if sizes.algorithm in ("gemv", "gemv_f16") and m > MAX_GEMV_ROWS:
        raise ValueError(f"algorithm {sizes.algorithm!r} reduces every row on the CUDA cores: M must be "
                         f"<= {MAX_GEMV_ROWS}, got {m}")
    if sizes.algorithm == "gemv_f16" and sizes.block_k % (2 * GEMV_F16_SPAN):
        raise ValueError(f"algorithm 'gemv_f16' sums pairs of spans of {GEMV_F16_SPAN} K elements: block_k must be "
                         f"a multiple of {2 * GEMV_F16_SPAN}, got {sizes.block_k}")
    if sizes.algorithm == "fma" and m > MAX_FMA_ROWS:
        raise ValueError(f"algorithm 'fma' keeps one accumulator per row: M must be <= {MAX_FMA_ROWS}, got {m}")
    if n % sizes.block_n:
        raise ValueError(f"N={n} must be a multiple of block_n={sizes.block_n}")
    if k % (sizes.block_k * sizes.k_splits):
        raise ValueError(f"K={k} must be a multiple of block_k * k_splits = {sizes.block_k} * {sizes.k_splits}")


def operands_fit(sizes: MatmulBlockSizes, x_dtype, weight_dtype) -> bool:
    """Whether ``sizes``' dot_dtype and convert may serve these operands (``check_operands`` says why not)."""
    try:
        check_operands(sizes, x_dtype, weight_dtype)
    except ValueError:
        return False
    return True


def check_operands(sizes: MatmulBlockSizes, x_dtype, weight_dtype) -> None:
    """The options that depend on the operands' dtypes: ``dot_dtype`` and ``convert``."""
    check_dot_dtype(sizes, x_dtype, weight_dtype)
    check_convert(sizes, x_dtype, weight_dtype)


def check_convert(sizes: MatmulBlockSizes, x_dtype, weight_dtype) -> None:
    """``convert="bits"`` needs fp8 weights and an f32 form or an f16 one; ``gemv_f16`` needs it and bf16 x."""
    if sizes.convert not in CONVERSIONS:
        raise ValueError(f"convert must be one of {CONVERSIONS}, got {sizes.convert!r}")
    if sizes.algorithm == "gemv_f16":
        if sizes.convert not in ("bits", "bits_ptx"):
            raise ValueError(f"algorithm 'gemv_f16' takes its f16 weights from the bits: convert must be 'bits' or "
                             f"'bits_ptx', got {sizes.convert!r}")
        if jnp.dtype(x_dtype) != jnp.bfloat16:
            raise ValueError(f"algorithm 'gemv_f16' needs bfloat16 x (an f32 caller keeps f32 products), "
                             f"got x {jnp.dtype(x_dtype)}")
    if sizes.convert == "cvt":
        return
    if jnp.dtype(weight_dtype) != jnp.float8_e4m3fn:
        raise ValueError(f"convert={sizes.convert!r} reads e4m3 bit fields: weights must be float8_e4m3fn, "
                         f"got {jnp.dtype(weight_dtype)}")
    if sizes.algorithm in ("mma", "mma_swapped") and sizes.dot_dtype != "float16":
        raise ValueError(f"convert={sizes.convert!r} feeds the tensor-core forms f16 operands: dot_dtype must be "
                         f"'float16', got {sizes.dot_dtype!r}")
    if sizes.convert == "bits_ptx" and sizes.algorithm in ("gemv", "fma"):
        raise ValueError(f"convert='bits_ptx' makes f16 weights: it serves gemv_f16 and the f16 tensor-core dot, "
                         f"not algorithm {sizes.algorithm!r} (use convert='bits')")


def check_dot_dtype(sizes: MatmulBlockSizes, x_dtype, weight_dtype) -> None:
    """``dot_dtype="float16"`` needs bf16 x, quantized weights and a tensor-core form."""
    if sizes.dot_dtype not in DOT_DTYPES:
        raise ValueError(f"dot_dtype must be one of {DOT_DTYPES}, got {sizes.dot_dtype!r}")
    if sizes.dot_dtype is None:
        return
    if jnp.dtype(x_dtype) != jnp.bfloat16 or jnp.dtype(weight_dtype) == jnp.bfloat16:
        raise ValueError(f"dot_dtype={sizes.dot_dtype!r} needs bfloat16 x and fp8/int8 weights "
                         f"(f32 x keeps its exact f32 dot; bf16 weights do not fit f16's range), "
                         f"got x {jnp.dtype(x_dtype)}, weights {jnp.dtype(weight_dtype)}")
    if sizes.algorithm not in ("mma", "mma_swapped"):
        raise ValueError(f"dot_dtype={sizes.dot_dtype!r} applies to the tensor-core forms (mma, mma_swapped), "
                         f"got algorithm {sizes.algorithm!r}")

"""Plain-JAX weight-only quantized matmul: the reference the kernels are checked against.

A quantized weight is stored ``[out, in]`` (``[N, K]``, contracting on its minor
dimension, the layout XLA's FP8 GEMM wants too) with one float32 scale per output
channel: the real weight is ``w[n, k] * scale[n]``. ``x`` is ``[M, K]`` activations in
bfloat16 or float32; the result is ``[M, N]`` in ``x.dtype``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Largest finite magnitude of each weight format: a channel's absolute maximum maps to it.
QUANTIZED_MAX = {
    jnp.dtype(jnp.float8_e4m3fn): 448.0,
    jnp.dtype(jnp.int8): 127.0,
}


def weight_only_matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """``x @ (w * scale[:, None]).T`` in float32 at full precision, cast back to ``x.dtype``.

    Dequantizing to float32 is exact for both formats (e4m3 and int8 values are all
    representable), so the only rounding is float32 summation and the final cast.
    """
    dequantized = w.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]  # [N, K]
    out = lax.dot_general(x.astype(jnp.float32), dequantized, (((1,), (1,)), ((), ())),
                          precision=lax.Precision.HIGHEST)  # [M, N]
    return out.astype(x.dtype)


def quantize_per_channel(w: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Quantize ``w [N, K]`` (any float dtype) per output channel: ``(w_q [N, K] dtype, scale [N] f32)``.

    The scale maps each row's absolute maximum to the format's largest value (448 for
    e4m3, 127 for int8); an all-zero row gets scale 1. fp8 rounds to nearest, int8 rounds
    to nearest and clips.
    """
    dtype = jnp.dtype(dtype)
    if dtype not in QUANTIZED_MAX:
        raise ValueError(f"quantize_per_channel: dtype must be one of {sorted(map(str, QUANTIZED_MAX))}, got {dtype}")
    limit = QUANTIZED_MAX[dtype]
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=1)  # [N]
    scale = jnp.where(amax > 0, amax / limit, 1.0).astype(jnp.float32)
    scaled = w32 / scale[:, None]
    if dtype == jnp.int8:
        scaled = jnp.clip(jnp.round(scaled), -limit, limit)
    return scaled.astype(dtype), scale

"""A native weight-only int8 matmul for XLA:CPU (``csrc/int8_matmul_cpu.cc``, built by ``jaxinfer.cpu_native``).

XLA:CPU has no int8 weight-only dot: ``dot(x, w_int8.astype(f32))`` runs as a loop fusion that
writes the whole weight out in float32 and a float32 dot that reads the copy back, so an int8
weight costs more memory traffic than the float32 one it replaces (measured 2-5x slower than
float32 for SmolLM2-135M's projections, ``benchmarks/cpu_int8_matmul.py``); ``int8 x int8``
dots are widened to int32 the same way, and the YNNPACK library fusion (a compiler option) does
not take single-row dots. This kernel widens a group of weight rows in registers (AVX-512 where
the CPU has it), so the weight is read once, as int8, and splits the output rows over XLA's
intra-op thread pool. It is called through the XLA FFI (``jax.ffi.ffi_call``), so it runs inside
the jitted step like any other op; projections of one input (q/k/v, gate/up) go in one call.

:func:`is_available` is False when the native kernels cannot be built here (the reason is in
:func:`unavailable_reason`); callers then keep XLA's path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer import cpu_native
from jaxinfer.cpu_native import is_available, unavailable_reason  # noqa: F401  (this module's API)

TARGET_NAME = "jaxinfer_int8_matmul_cpu"


def int8_matmul_cpu(x: jax.Array, payload: jax.Array, scale: jax.Array, max_threads: int = 64) -> jax.Array:
    """x [M, K] (any float dtype; computed in float32) times the int8 payload [N, K] with scales
    [N] -> [M, N] float32, on at most ``max_threads`` threads of XLA's intra-op pool. Call only
    where :func:`is_available` is True."""
    return int8_matmul_many_cpu(x, [(payload, scale)], max_threads)[0]


def int8_matmul_many_cpu(x: jax.Array, weights, max_threads: int = 64) -> list[jax.Array]:
    """x [M, K] times each ``(payload [N_i, K] int8, scale [N_i])`` of ``weights`` -> a list of
    [M, N_i] float32, in one call: projections of one input (q/k/v, gate/up) share the call's
    overhead and its split over threads."""
    weights = list(weights)
    if not weights or x.ndim != 2:
        raise ValueError(f"int8_matmul_cpu: x [M, K] and at least one weight expected, got x {x.shape}")
    for payload, scale in weights:
        if payload.dtype != jnp.int8 or payload.ndim != 2 or x.shape[1] != payload.shape[1] \
                or tuple(scale.shape) != payload.shape[:1]:
            raise ValueError(f"int8_matmul_cpu: x [M, K] float, payload [N, K] int8 and scale [N] expected, got "
                             f"x {x.shape} {x.dtype}, payload {payload.shape} {payload.dtype}, scale {scale.shape}")
    cpu_native.require()
    outs = [jax.ShapeDtypeStruct((x.shape[0], payload.shape[0]), jnp.float32) for payload, _ in weights]
    operands = [a for payload, scale in weights for a in (payload, scale.astype(jnp.float32))]
    return list(jax.ffi.ffi_call(TARGET_NAME, outs)(x.astype(jnp.float32), *operands, max_threads=max_threads))

"""Plain-JAX residual add + RMSNorm: the contract of the GPU kernel and the model's own form."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back before the weight multiply (as transformers does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def add_rms_norm_reference(x: jax.Array, delta: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """The residual stream after adding ``delta`` [T, E], and its RMSNorm by ``weight`` [E]."""
    total = x + delta
    return total, rms_norm_reference(total, weight, eps)

"""How page arrays hold their K/V: as values, or (FP8 on a CPU) as e4m3 bit patterns in ``uint8``.

Page arrays normally hold K/V values in their own dtype (float32, bfloat16, or
``float8_e4m3fn`` read directly by the GPU and TPU kernels). A ``uint8`` page array holds
``float8_e4m3fn`` values by their bit patterns: it is how a CPU keeps FP8 pages. XLA:CPU has no
float8 scatter or gather; its float normalization runs them in float16 and converts the *whole*
pool there and back around each one (a 134M-element pool: about 0.7 s for one layer's K/V write,
where a bfloat16 pool takes microseconds). A bitcast of the whole pool is no cheaper there: it
is compiled as a copy. So on a CPU the pool itself is ``uint8``; only what a step writes (its
new rows) and what it reads (the gathered pages) are bitcast, and the same bytes are in the
pool as an ``float8_e4m3fn`` pool would hold. No other page dtype is an integer, so the dtype is
the whole of the metadata.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E4M3_BITS = jnp.dtype(jnp.uint8)  # the storage of e4m3 pages on a CPU


def holds_e4m3_bits(pages_dtype) -> bool:
    """Whether pages of this dtype hold ``float8_e4m3fn`` bit patterns rather than values."""
    return jnp.dtype(pages_dtype) == E4M3_BITS


def value_dtype(pages_dtype) -> jnp.dtype:
    """The dtype of the values a page array of ``pages_dtype`` holds."""
    return E4M3 if holds_e4m3_bits(pages_dtype) else jnp.dtype(pages_dtype)


def page_values(pages: jax.Array) -> jax.Array:
    """K/V values of (a gather from) a page array: bitcast to e4m3 where it holds bits.

    Apply it to what was gathered, never to a whole pool on a CPU (that is a copy of the pool).
    """
    if holds_e4m3_bits(pages.dtype):
        return jax.lax.bitcast_convert_type(pages, E4M3)
    return pages


def to_page_storage(values: jax.Array, pages_dtype) -> jax.Array:
    """New K/V ``values`` in the form a page array of ``pages_dtype`` stores them.

    A plain cast to the page dtype (the dispatcher has already quantized FP8 values with their
    scale, saturating); for bit pages the e4m3 values' bit patterns.
    """
    values = values.astype(value_dtype(pages_dtype))
    if holds_e4m3_bits(pages_dtype):
        return jax.lax.bitcast_convert_type(values, E4M3_BITS)
    return values

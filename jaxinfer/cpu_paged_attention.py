"""Ragged paged attention on XLA:CPU as one native call per layer (``csrc/paged_attention_cpu.cc``).

Same arguments and results as ``pallas_kernels.paged_attention.reference.ragged_paged_attention_reference``
(write this step's K/V into the pages, then attend each token over its own sequence's visible
positions). The plain-JAX CPU path (``pallas_kernels/paged_attention/cpu.py``) runs that as a
scatter and two nested loops of small XLA ops per layer, each op dispatched on its own, and
a batch-1 decode computes a block of 8 tokens; here one FFI call writes the token's K/V in place
(the pages are aliased to the call's outputs, so the donated cache is updated without a copy)
and reads exactly the positions the token sees, in float32.

Pages of float32 or bfloat16 only (:func:`supports`); an FP8 cache keeps the plain-JAX path.
``jaxinfer.attention`` picks this path for ``impl="cpu"`` when the native kernels are available.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import cpu_native

TARGET_NAME = "jaxinfer_paged_attention_cpu"
# Threads of XLA's intra-op pool a prefill's attention may split over (a decode step's is
# too small to split: the kernel keeps it on the calling thread).
MAX_THREADS = 2
SUPPORTED_PAGE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def supports(page_dtype) -> bool:
    """Whether pages of ``page_dtype`` can take the native path here."""
    return jnp.dtype(page_dtype) in SUPPORTED_PAGE_DTYPES and cpu_native.is_available()


def ragged_paged_attention_native(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write this step's K/V into the paged cache, then attend. Returns (out, k_pages, v_pages).

    q [T, Hq, D]; k_new, v_new [T, Hkv, D]; pages [Hkv, P, S, D] (float32 or bfloat16);
    page_tables [B, W]; cu_q_lens [B + 1]; kv_lens [B]. Computed in float32; out in q's dtype.
    """
    if jnp.dtype(k_pages.dtype) not in SUPPORTED_PAGE_DTYPES or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"ragged_paged_attention_native: float32 or bfloat16 pages expected, got "
                         f"k_pages {k_pages.dtype}, v_pages {v_pages.dtype}")
    if q.ndim != 3 or k_new.shape != v_new.shape or k_new.shape[0] != q.shape[0] or k_pages.ndim != 4 \
            or k_pages.shape != v_pages.shape or k_new.shape[1:] != (k_pages.shape[0], k_pages.shape[3]) \
            or q.shape[2] != k_pages.shape[3] or q.shape[1] % k_pages.shape[0]:
        raise ValueError(f"ragged_paged_attention_native: q [T, Hq, D], k_new/v_new [T, Hkv, D] and pages "
                         f"[Hkv, P, S, D] expected, got q {q.shape}, k_new {k_new.shape}, v_new {v_new.shape}, "
                         f"k_pages {k_pages.shape}, v_pages {v_pages.shape}")
    cpu_native.require()
    out_types = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                 jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype))
    call = jax.ffi.ffi_call(TARGET_NAME, out_types, input_output_aliases={3: 1, 4: 2})
    out, k_pages, v_pages = call(
        q.astype(jnp.float32), k_new.astype(k_pages.dtype), v_new.astype(v_pages.dtype), k_pages, v_pages,
        page_tables.astype(jnp.int32), cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32),
        sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0), max_threads=np.int64(MAX_THREADS))
    return out.astype(q.dtype), k_pages, v_pages

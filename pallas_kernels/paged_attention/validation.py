"""Shape checks shared by every paged-attention entry point, with messages that name the arrays."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.paged_attention.v_layout import v_pages_shape


def check_inputs(q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens,
                 v_layout: str = "token_major") -> None:
    """Shapes and dtypes of the kernels' arguments; ``v_layout="dim_major"``: ``v_pages`` is
    ``[num_kv_heads, num_pages, head_dim, page_size]`` (``v_layout.py``)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    num_tokens, num_q_heads, head_dim = q.shape
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [num_kv_heads, num_pages, page_size, head_dim], got {k_pages.shape}")
    v_shape = v_pages_shape(k_pages.shape, v_layout)
    if v_pages.shape != v_shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages {v_pages.shape} {v_pages.dtype} must be {v_shape} {k_pages.dtype} "
                         f"(k_pages {k_pages.shape}, V {v_layout.replace('_', '-')})")
    num_kv_heads, _, page_size, cache_head_dim = k_pages.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and k_pages ({cache_head_dim}) differ")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    expected_new = (num_tokens, num_kv_heads, head_dim)
    if k_new.shape != expected_new or v_new.shape != expected_new:
        raise ValueError(f"k_new {k_new.shape} and v_new {v_new.shape} must be {expected_new}")
    if page_tables.ndim != 2:
        raise ValueError(f"page_tables must be [max_num_seqs, pages_per_seq], got {page_tables.shape}")
    max_num_seqs = page_tables.shape[0]
    if kv_lens.shape != (max_num_seqs,):
        raise ValueError(f"kv_lens {kv_lens.shape} must be ({max_num_seqs},) to match page_tables")
    if cu_q_lens.shape != (max_num_seqs + 1,):
        raise ValueError(f"cu_q_lens {cu_q_lens.shape} must be ({max_num_seqs + 1},)")
    for name, array in (("page_tables", page_tables), ("cu_q_lens", cu_q_lens), ("kv_lens", kv_lens)):
        if array.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {array.dtype}")

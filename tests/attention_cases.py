"""Random ragged batches over a paged cache, shared by the kernel tests and the kernel benchmarks.

Every cache row that no sequence owns (free pages, the tail of a last page, the rows
this step writes) is NaN, so any stray read shows up as NaN in the output.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Case:
    q: jnp.ndarray  # [T, Hq, D]
    k_new: jnp.ndarray  # [T, Hkv, D]
    v_new: jnp.ndarray
    k_pages: jnp.ndarray  # [Hkv, num_pages, page_size, D]
    v_pages: jnp.ndarray
    page_tables: jnp.ndarray  # [S, pages_per_seq]
    cu_q_lens: jnp.ndarray  # [S + 1]
    kv_lens: jnp.ndarray  # [S]
    sm_scale: float

    def args(self):
        return (self.q, self.k_new, self.v_new, self.k_pages, self.v_pages,
                self.page_tables, self.cu_q_lens, self.kv_lens)


def make_case(
    seed: int,
    seqs: list[tuple[int, int]],  # (q_len, kv_len) per slot; (0, 0) is an empty slot
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    page_size: int = 16,
    pages_per_seq: int | None = None,
    extra_pages: int = 3,
    pad_tokens: int = 0,
    dtype=jnp.float32,
    nan_fill: bool = True,
) -> Case:
    rng = np.random.default_rng(seed)
    q_lens = np.array([q for q, _ in seqs], np.int32)
    kv_lens = np.array([kv for _, kv in seqs], np.int32)
    assert np.all(q_lens <= kv_lens)
    pages_needed = -(-kv_lens // page_size)
    pages_per_seq = pages_per_seq or max(1, int(pages_needed.max()))
    num_pages = int(pages_needed.sum()) + extra_pages
    physical = rng.permutation(num_pages)
    free = physical[pages_needed.sum():]
    page_tables = np.zeros((len(seqs), pages_per_seq), np.int32)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages = rng.standard_normal(shape, np.float32)
    v_pages = rng.standard_normal(shape, np.float32)
    is_owned = np.zeros((num_pages, page_size), bool)
    used = 0
    for b, (q_len, kv_len) in enumerate(seqs):
        mine = physical[used : used + pages_needed[b]]
        used += pages_needed[b]
        page_tables[b, : len(mine)] = mine
        # Entries past the sequence point at free (NaN) pages, as a stale allocator would leave them.
        if len(free):
            page_tables[b, len(mine):] = rng.choice(free, pages_per_seq - len(mine))
        for position in range(kv_len - q_len):
            is_owned[page_tables[b, position // page_size], position % page_size] = True
    if nan_fill:
        k_pages[:, ~is_owned] = np.nan
        v_pages[:, ~is_owned] = np.nan
    num_tokens = int(q_lens.sum()) + pad_tokens
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim), np.float32)
    k_new = rng.standard_normal((num_tokens, num_kv_heads, head_dim), np.float32)
    v_new = rng.standard_normal((num_tokens, num_kv_heads, head_dim), np.float32)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return Case(
        q=jnp.asarray(q, dtype), k_new=jnp.asarray(k_new, dtype), v_new=jnp.asarray(v_new, dtype),
        k_pages=jnp.asarray(k_pages, dtype), v_pages=jnp.asarray(v_pages, dtype),
        page_tables=jnp.asarray(page_tables), cu_q_lens=jnp.asarray(cu_q_lens),
        kv_lens=jnp.asarray(kv_lens), sm_scale=float(head_dim) ** -0.5,
    )

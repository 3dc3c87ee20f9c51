"""Collective matmul: a row-parallel matmul whose reduce-scatter overlaps its own computation.

The matmul is split into ``tp`` row chunks; each chunk's partial sum travels round a ring
(``ppermute``) while the next chunk is multiplied, leaving the output reduce-scattered; an
all-gather (or the next layer's all-gather matmul) completes it. Measured in isolation on the
MLP's down projection at Llama-3.1-8B shapes by ``benchmarks/tensor_parallel.py``; not yet
wired into the model (see docs/SHARDING.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reduce_scatter_matmul(x: jax.Array, w: jax.Array, axis_name: str) -> jax.Array:
    """Inside ``shard_map``: ``psum_scatter(x @ w)`` over rows, as a ring of ``ppermute`` steps.

    x: [T, K/n] (this shard's columns), w: [K/n, N] (its rows); returns [T/n, N], rows
    ``i*T/n:(i+1)*T/n`` of the full sum on shard ``i``. Step ``s`` multiplies the row chunk whose
    partial sum arrives next while the previous one is in flight, so the transfer of each
    chunk overlaps the matmul of the next.
    """
    n = jax.lax.axis_size(axis_name)
    index = jax.lax.axis_index(axis_name)
    rows = x.shape[0] // n
    ring = [(i, (i + 1) % n) for i in range(n)]

    def partial(chunk):  # [T/n, N]: this shard's contribution to row chunk ``chunk``
        block = jax.lax.dynamic_slice_in_dim(x, chunk * rows, rows, axis=0)
        return jnp.einsum("tk,kn->tn", block, w, preferred_element_type=jnp.float32)

    # The partial sum of chunk c starts on shard c+1, visits every shard, and ends on shard c.
    acc = partial((index - 1) % n)
    for step in range(1, n):
        acc = jax.lax.ppermute(acc, axis_name, ring) + partial((index - 1 - step) % n)
    return acc.astype(x.dtype)

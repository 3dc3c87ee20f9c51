"""KVCache: the preallocated, paged key/value arrays on the device.

Layout (owned by ``pallas_kernels.paged_attention``; see its reference module): per
layer ``[num_kv_heads, num_pages, page_size, head_dim]`` for K and for V. The host-side
page allocator hands out page indices; this module only holds the device arrays. The
cache is donated to every jitted step, which writes the new tokens' K/V in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: list[jax.Array]  # per layer [num_kv_heads, num_pages, page_size, head_dim]
    v: list[jax.Array]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


CACHE_LOGICAL_AXES = ("kv_heads", "pages", "page_rows", "head_dim")


def create_kv_cache(config: ModelConfig, num_pages: int, page_size: int, dtype=jnp.bfloat16, sharding=None) -> KVCache:
    """Allocate a zeroed cache of ``num_pages`` pages per layer, laid out by ``sharding`` if given."""
    shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)

    def make():
        return KVCache(
            k=[jnp.zeros(shape, dtype) for _ in range(config.num_layers)],
            v=[jnp.zeros(shape, dtype) for _ in range(config.num_layers)],
        )

    return jax.jit(make, out_shardings=sharding)()

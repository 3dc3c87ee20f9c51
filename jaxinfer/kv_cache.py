"""KVCache: the preallocated, paged key/value arrays on the device.

Layout (owned by ``pallas_kernels.paged_attention``; see its reference module): per
layer ``[num_kv_heads, num_pages, page_size, head_dim]`` for K and for V. The host-side
page allocator hands out page indices; this module only holds the device arrays. The
cache is donated to every jitted step, which writes the new tokens' K/V in place.

Pages are stored in the serving dtype or, with ``kv_cache_dtype="fp8"``, as ``float8_e4m3fn``
beside one float32 scale per layer for K and one for V (``jaxinfer.kv_cache_dtype``). The
scales ride in the cache pytree, replicated under a mesh, so they travel through every jitted
step with the pages; they are 1.0 and unused for pages that are not FP8. On a CPU the FP8
pages' arrays are ``uint8``, holding the e4m3 bit patterns (``kv_cache_dtype.page_array_dtype``).

``v_layout="dim_major"`` (opt-in, under measurement for fp8 pages on a GPU; see
``pallas_kernels.paged_attention.v_layout``) stores V as ``[num_kv_heads, num_pages, head_dim,
page_size]``; the layout is static pytree metadata, so every step is traced for the cache it gets.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache_dtype import is_fp8, page_array_dtype
from pallas_kernels.paged_attention.v_layout import v_pages_shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: list[jax.Array]  # per layer [num_kv_heads, num_pages, page_size, head_dim]
    v: list[jax.Array]
    # [num_layers] float32: page value x scale = the real K/V (FP8 pages only). None: unscaled.
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    # How V is stored: "token_major" (as K) or "dim_major" ([num_kv_heads, num_pages, head_dim, page_size]).
    v_layout: str = dataclasses.field(default="token_major", metadata=dict(static=True))

    def layer_scales(self, layer: int) -> tuple[jax.Array | None, jax.Array | None]:
        """Layer ``layer``'s (K scale, V scale) as scalars, or ``(None, None)`` for unscaled pages."""
        if self.k_scale is None or not is_fp8(self.k[layer].dtype):
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

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


def create_kv_cache(config: ModelConfig, num_pages: int, page_size: int, dtype=jnp.bfloat16, sharding=None,
                    scales: tuple[np.ndarray, np.ndarray] | None = None, v_layout: str = "token_major") -> KVCache:
    """Allocate a zeroed cache of ``num_pages`` pages per layer, laid out by ``sharding`` if given.

    ``dtype`` is the pages' storage dtype (``jaxinfer.kv_cache_dtype.storage_dtype``); the arrays
    take ``page_array_dtype(dtype)`` (``uint8`` bit patterns for e4m3 pages on a CPU);
    ``scales``: per-layer (K, V) float32 scales of FP8 pages (default 1.0; ignored otherwise);
    ``v_layout``: how V is stored (``KVCache.v_layout``; ``sharding`` must be built for the same).
    """
    shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)
    v_shape = v_pages_shape(shape, v_layout)
    dtype = page_array_dtype(dtype)
    k_scale, v_scale = kv_scale_arrays(config.num_layers, scales if is_fp8(dtype) else None)

    def make():
        return KVCache(
            k=[jnp.zeros(shape, dtype) for _ in range(config.num_layers)],
            v=[jnp.zeros(v_shape, dtype) for _ in range(config.num_layers)],
            k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale), v_layout=v_layout,
        )

    return jax.jit(make, out_shardings=sharding)()


V_LAYOUT_ENV = "JAXINFER_V_LAYOUT"


def engine_v_layout(attention_impl: str, head_dim: int) -> str:
    """The V layout of an engine's cache: ``$JAXINFER_V_LAYOUT`` (``"token_major"``, the default, or
    ``"dim_major"``), read once when the engine is made and kept in the cache's metadata.

    An experiment switch, as ``JAXINFER_DECODE_MATMUL`` is, while GPU runs decide whether dim-major V
    pages pay (``pallas_kernels.paged_attention.v_layout``); refused, naming the variable, where the
    attention implementation cannot read them (``attention.check_v_layout``).
    """
    # Imported here: jaxinfer.attention imports sharding.rules, which imports this module.
    from jaxinfer.attention import check_v_layout, resolve_impl

    v_layout = os.environ.get(V_LAYOUT_ENV, "") or "token_major"
    try:
        check_v_layout(v_layout, resolve_impl(attention_impl, head_dim=head_dim))
    except ValueError as e:
        raise ValueError(f"${V_LAYOUT_ENV}={v_layout!r}: {e}") from None
    return v_layout


def kv_scale_arrays(num_layers: int, scales: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
    """Checked [num_layers] float32 (K, V) scales; ``None``: all 1.0."""
    if scales is None:
        return np.ones(num_layers, np.float32), np.ones(num_layers, np.float32)
    checked = []
    for name, scale in zip(("k_scales", "v_scales"), scales):
        scale = np.asarray(scale, np.float32).reshape(-1)
        if scale.shape != (num_layers,):
            raise ValueError(f"KV cache {name} must hold one scale per layer ({num_layers}), got shape {scale.shape}")
        if not (np.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"KV cache {name} must be finite and positive, got {scale.tolist()}")
        checked.append(scale)
    return checked[0], checked[1]

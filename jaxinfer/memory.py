"""KV-cache memory: the design's formula, and sizing the page pool from free device memory.

Per token the cache holds K and V for every layer and KV head::

    bytes_per_token = 2 * layers * kv_heads * head_dim * bytes_per_element

so ``tokens that fit = free memory / bytes_per_token``, and a request of ``S`` tokens
needs ``ceil(S / page_size)`` pages. ``bytes_per_element`` is the pages' storage dtype's: 1 for
an FP8 cache (``kv_cache_dtype="fp8"``; its per-layer scales are a few bytes in all), so the same
memory holds twice a bf16 cache's tokens.

The weights are counted from their declaration (``jaxinfer.params.param_specs``), so a quantized
model (``config.quantization``) counts its projections' payloads (1 byte an element) and float32
per-channel scales, and its embedding, norms and lm_head in the serving dtype: the bytes the
loaded weights hold on the device, which the engine subtracts before sizing its page pool.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # no device memory to measure on CPU: a modest fixed pool

# FP8 pages past 2**31 elements in one layer's K or V array ([kv_heads, pages, page_size,
# head_dim]) fault in the GPU decode kernel: on the H200, 256 sequences x 16k tokens of FP8
# pages (4.3e9 elements) hit an illegal memory access (benchmarks/results/
# kernel_fp8_pages.session8.md), a 32-bit offset overflowing in the 8-bit load path; bf16 pages
# ran correctly at 8.6e9 (256 x 32k, session 5). An FP8 cache of Llama-3.1-8B on one H200 holds
# 1.9e9, close to the limit, so an FP8 pool is capped below it on GPUs.
GPU_MAX_KV_ARRAY_ELEMENTS = 2**31 - 1


def max_num_pages(config: ModelConfig, page_size: int) -> int:
    """The most pages a GPU KV cache may have: each layer's K (and V) array stays addressable
    with 32-bit offsets (``config`` with the KV heads one device holds)."""
    return GPU_MAX_KV_ARRAY_ELEMENTS // (config.num_kv_heads * page_size * config.head_dim)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    bytes_per_token: int
    weight_bytes: int
    available_bytes: int
    num_tokens: int
    num_requests: int  # requests of ``request_len`` tokens that fit at once
    request_len: int
    quantization: str | None = None  # the weights' projections ("fp8"/"int8"), None when dense

    def __str__(self) -> str:
        gib = 1 << 30
        return (
            f"KV cache: {self.bytes_per_token / 1024:.1f} KiB per token; "
            f"{self.available_bytes / gib:.2f} GiB for the cache holds {self.num_tokens:,} tokens "
            f"= {self.num_requests:,} requests of {self.request_len:,} tokens "
            f"(weights: {self.weight_bytes / gib:.2f} GiB"
            f"{f', {self.quantization} projections' if self.quantization else ''})"
        )


def weight_bytes(config: ModelConfig, bytes_per_element: int) -> int:
    """Bytes of the model's weights: ``bytes_per_element`` (the serving dtype's) for the dense
    weights, the declared dtype's for the rest (quantized payloads and scales, when
    ``config.quantization`` is set)."""
    from jaxinfer.params import is_spec, param_specs

    total = 0
    for spec in jax.tree.leaves(param_specs(config), is_leaf=is_spec):
        itemsize = jnp.dtype(spec.dtype).itemsize if spec.dtype else bytes_per_element
        total += math.prod(spec.shape) * itemsize
    return total


# The share of device memory an engine may use by default (weights + KV cache); the rest holds
# compiled programs and activations. EngineConfig's default for every platform.
DEFAULT_MEMORY_UTILIZATION = 0.9


def estimate(config: ModelConfig, *, bytes_per_element: int, memory_bytes: int, request_len: int,
             memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
             kv_bytes_per_element: int | None = None) -> MemoryEstimate:
    """How many tokens, and requests of ``request_len`` tokens, fit on a device of ``memory_bytes``.

    ``bytes_per_element``: the weights' (the serving dtype's; quantized projections count their
    own bytes, from ``config.quantization``); ``kv_bytes_per_element``: the KV pages' (default:
    the same; 1 for an FP8 cache).
    """
    kv_bytes = bytes_per_element if kv_bytes_per_element is None else kv_bytes_per_element
    per_token = config.kv_bytes_per_token(kv_bytes)
    weights = weight_bytes(config, bytes_per_element)
    available = max(0, int(memory_bytes * memory_utilization) - weights)
    tokens = available // per_token
    return MemoryEstimate(per_token, weights, available, tokens, tokens // max(1, request_len), request_len,
                          config.quantization)


def num_pages_for_device(config: ModelConfig, *, page_size: int, bytes_per_element: int,
                         memory_utilization: float, reserve_bytes: int = 0) -> int:
    """Size the page pool from free device memory after the weights are loaded.

    ``memory_utilization`` is the fraction of the device's memory limit jaxinfer may use in
    all; what JAX has already allocated (the weights) is subtracted, and ``reserve_bytes`` is
    kept back for activations and compiled programs.
    """
    device = jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    page_bytes = config.kv_bytes_per_token(bytes_per_element) * page_size
    if not stats or "bytes_limit" not in stats:
        budget = CPU_KV_CACHE_BYTES
        if device.platform != "cpu":
            # Some allocators report no limit (XLA's VMM allocator, which
            # --xla_gpu_command_buffer_update_mode selects): a 1 GiB pool would quietly
            # starve an accelerator, so say how to size it.
            logger.warning("%s reports no memory limit; the KV cache falls back to %.0f GiB. "
                           "Pass num_pages (LLM(num_pages=...), --num-pages) to size it.",
                           device.device_kind, CPU_KV_CACHE_BYTES / 2**30)
    else:
        budget = int(stats["bytes_limit"] * memory_utilization) - int(stats.get("bytes_in_use", 0)) - reserve_bytes
    num_pages = max(2, budget // page_bytes)
    logger.info("KV cache: %d pages of %d tokens (%.2f GiB)", num_pages, page_size, num_pages * page_bytes / 2**30)
    return int(num_pages)


def pages_for(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)

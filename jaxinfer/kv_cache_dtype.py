"""The KV cache's storage dtype: its names, the devices that can hold it, and the FP8 arithmetic.

``kv_cache_dtype`` takes vLLM's names: ``"auto"`` stores K/V in the model's serving dtype (the
embedding's: bfloat16 or float32); ``"fp8"`` (alias ``"fp8_e4m3"``) stores them as
``float8_e4m3fn`` with one float32 scale per layer for K and one for V, which halves a bf16
cache's bytes, so the same memory holds twice the tokens.

How a scaled FP8 page is used (``jaxinfer.attention`` does it, so the kernels stay simple):

- write: ``k_page = saturate_e4m3(k_new / k_scale)``; values past e4m3's ±448 are clipped to it
  (a plain cast would give NaN, which the format has in place of infinity);
- read: ``scores = (q * k_scale) . k_page`` and ``out = v_scale * softmax(scores) . v_page``,
  since ``q . (k_scale * k_page) = (q * k_scale) . k_page`` and the softmax weights are linear in V.
  Each kernel only converts the FP8 tiles it loads to its compute dtype.

Scales are 1.0 unless the checkpoint carries them (``LoadedModel.kv_cache_scales``) or they are
calibrated (:func:`kv_scales_from_amax`). On a CPU FP8 is emulated by XLA, exact to the format,
and the pool's arrays hold the e4m3 values' bit patterns as ``uint8`` (:func:`page_array_dtype`):
XLA:CPU would otherwise convert the whole pool to float16 and back around every K/V write and
page gather (``pallas_kernels.paged_attention.page_storage`` has the measurements).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention.page_storage import E4M3_BITS, holds_e4m3_bits

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_KV_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_KV_DTYPE).max)  # 448.0

# FP8 tensor cores arrived with Ada (sm_89) and Hopper (sm_90); the TPU with its 7th generation.
MIN_GPU_COMPUTE_CAPABILITY = (8, 9)
MIN_TPU_GENERATION = 7
SUPPORTED_FP8_DEVICES = (f"NVIDIA GPUs of compute capability >= {MIN_GPU_COMPUTE_CAPABILITY[0]}."
                         f"{MIN_GPU_COMPUTE_CAPABILITY[1]} (Ada, Hopper, Blackwell), TPU v{MIN_TPU_GENERATION} "
                         "or later, or CPU (emulated)")


def normalize_kv_cache_dtype(name: str) -> str:
    """``"auto"`` or ``"fp8"``; raises ``ValueError`` naming the accepted values otherwise."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not one of {KV_CACHE_DTYPES}")
    return "fp8" if name.startswith("fp8") else name


def storage_dtype(kv_cache_dtype: str, serving_dtype) -> jnp.dtype:
    """The dtype the pages are stored in: the serving dtype for ``"auto"``, e4m3 for ``"fp8"``."""
    return jnp.dtype(FP8_KV_DTYPE if normalize_kv_cache_dtype(kv_cache_dtype) == "fp8" else serving_dtype)


def page_array_dtype(dtype, platform: str | None = None) -> jnp.dtype:
    """The dtype of the arrays that hold pages of ``dtype`` (a :func:`storage_dtype`) on ``platform``.

    e4m3 pages on a CPU are held as their bit patterns (``uint8``); everything else as itself.
    ``platform`` defaults to JAX's backend, where the engine's arrays live.
    """
    platform = platform or jax.default_backend()
    if jnp.dtype(dtype) == jnp.dtype(FP8_KV_DTYPE) and platform == "cpu":
        return E4M3_BITS
    return jnp.dtype(dtype)


def is_fp8(dtype) -> bool:
    """Whether pages of this array dtype hold e4m3 values (as themselves, or as bits on a CPU)."""
    return jnp.dtype(dtype) == jnp.dtype(FP8_KV_DTYPE) or holds_e4m3_bits(dtype)


def fp8_unsupported_reason(device) -> str | None:
    """Why ``device`` cannot hold an FP8 KV cache, or ``None`` if it can."""
    platform = device.platform
    kind = getattr(device, "device_kind", platform)
    if platform == "cpu":
        return None
    if platform in ("gpu", "cuda"):
        capability = getattr(device, "compute_capability", None)
        if capability is None:
            return f"{kind} reports no compute capability"
        major, minor = (int(part) for part in str(capability).split(".")[:2])
        if (major, minor) >= MIN_GPU_COMPUTE_CAPABILITY:
            return None
        return f"{kind} has compute capability {capability}, without FP8"
    if platform == "tpu":
        match = re.search(r"(?:v|TPU\s*)(\d+)", kind)
        if match and int(match.group(1)) >= MIN_TPU_GENERATION:
            return None
        return f"{kind} has no FP8"
    return f"{kind} ({platform}) has no FP8 path in jaxinfer"


def check_kv_cache_dtype_supported(kv_cache_dtype: str | None, devices=None) -> None:
    """Raise before anything is allocated if ``devices`` (default: JAX's) cannot store this cache.

    The error is an ``EngineConfigError`` on ``kv_cache_dtype`` that names what is supported.
    """
    from jaxinfer.engine_config import EngineConfigError  # engine_config imports this module

    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise EngineConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}",
                                field="kv_cache_dtype")
    if kv_cache_dtype is None or normalize_kv_cache_dtype(kv_cache_dtype) != "fp8":
        return
    for device in devices if devices is not None else jax.devices():
        reason = fp8_unsupported_reason(device)
        if reason is not None:
            raise EngineConfigError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs FP8: {reason}. FP8 KV caches run on "
                f"{SUPPORTED_FP8_DEVICES}; on this device use kv_cache_dtype='auto'", field="kv_cache_dtype",
            )


def quantize_to_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` cast to e4m3, saturating at ±448 (a plain cast past the range gives NaN)."""
    scaled = x.astype(jnp.float32) / scale
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8_KV_DTYPE)


def dequantize_fp8(x: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (x.astype(jnp.float32) * scale).astype(dtype)


def kv_scales_from_amax(k_amax, v_amax, headroom: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer scales that map ``headroom`` times each layer's largest |K| and |V| onto e4m3's 448.

    The headroom keeps a value larger than any the calibration text showed from saturating;
    e4m3 is a float format, so scaling costs no relative precision except in its subnormals.
    """
    def scale(amax):
        return np.maximum(np.asarray(amax, np.float32) * headroom / FP8_MAX, np.float32(1e-6)).astype(np.float32)

    return scale(k_amax), scale(v_amax)

"""Quantized weights: one pytree leaf type that carries a payload and its per-channel scales.

A projection weight is either a plain array (the serving dtype) or a :class:`QuantizedWeight`:

    payload      [out..., in...]  float8_e4m3fn or int8
    scale        [out...]         float32; the weight is ``payload * scale[..., None]``
    input_scale  []               float32, FP8 only, optional: a *static* per-tensor scale of the
                                  activations this weight multiplies (``None``: scaled per token at
                                  run time). ``jaxinfer.activation_scales`` says where it comes from.

The payload is stored *output axes first*, the transpose of the dense declaration
(``jaxinfer.params``: ``q`` is ``[embed, q_heads, head_dim]`` dense, ``[q_heads, head_dim, embed]``
quantized), which is Hugging Face's ``[out_features, in_features]`` order. Both operands of the
matmul then contract on their minor dimension, which is what cuBLASLt's FP8 GEMM wants: with the
weight stored ``[in, out]``, XLA inserts a transpose of it on every call (measured on an H200,
``/work/shared/BENCHMARKS.md``).

Both fields are pytree children and keep the logical axis names of the dense weight
(``q_heads``, ``embed``, ...), so the sharding rules, Orbax and the loaders walk them like any
other leaf (the idea of jax-llm-examples' ``QuantArray``). :mod:`jaxinfer.linear` is the one
place that multiplies by one.

Scales are per output channel (one per row of ``[out, in]``), symmetric. Two ways to choose them
(:data:`SCALE_METHODS`):

- ``"absmax"``: the row's absmax maps to the format's largest value (448 for e4m3, 127 for int8);
- ``"mse"`` (the default for FP8, :data:`DEFAULT_SCALE_METHOD`): a few candidate scales per row,
  ``c * absmax / qmax`` for the ratios of :data:`SEARCH_RATIOS`, and the row keeps the one whose
  dequantized weight has the least squared error (``c = 1``, absmax, is always a candidate, so no
  row gets worse). For e4m3, whose rounding error is relative, the ratios above 1 shift where the
  row's values fall between the format's grid points (one binade in eighths) and cost no range,
  since e4m3 keeps its relative precision down to 2^-6 of the scale. On SmolLM2-135M it cuts the
  e4m3 weights' squared error by ~12%, the mean KL against float32 by 23% and the top-1
  disagreements by 8% (``benchmarks/results/quantization_sensitivity.md``). For int8 the ratios
  below 1 clip a row's few largest weights to round the rest more finely; with 127 steps that
  rarely pays (clipping helps 4-bit formats), and on SmolLM2 it moved neither metric (KL 0.0031
  vs 0.0032, top-1 96.6% vs 96.9%: ten near-tie positions of 3,714), so int8 keeps absmax by
  default.

A pre-quantized checkpoint keeps its own scales.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp

# quantization name -> the payload dtype.
QUANTIZATIONS = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0
# A row of zeros would get scale 0 and divide by it; any positive scale represents it exactly.
_MIN_SCALE = 1e-12

SCALE_METHODS = ("absmax", "mse")
# quantization -> the scale method quantize() uses unless told: the one measured to help (above).
DEFAULT_SCALE_METHOD = {"fp8": "mse", "int8": "absmax"}
# Candidate ratios c of a row's scale c * absmax / qmax, searched by scale_method="mse". e4m3:
# one binade in eighths, plus two that clip slightly; int8: light clipping ratios.
SEARCH_RATIOS = {
    "fp8": tuple(2.0 ** (k / 8) for k in range(-2, 8)),
    "int8": (1.0, 0.98, 0.96, 0.94, 0.92, 0.9),
}


class QuantizationError(ValueError):
    """A quantization that cannot be served: an unknown name, an unsupported checkpoint scheme,
    a scale of the wrong shape, or FP8 on a device without it. The message names what is supported."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedWeight:
    payload: Any  # [out..., in...] float8_e4m3fn or int8 (or a ParamSpec / sharding in a spec tree)
    scale: Any  # [out...] float32
    # [] float32: the static activation scale of W8A8 (x is quantized as clip(x / input_scale)); None:
    # per-token dynamic scales. A pytree child like the others (replicated, saved by Orbax); None is
    # an empty subtree, so the trees of dynamic models are what they were before the field existed.
    input_scale: Any = None

    @property
    def quantization(self) -> str:
        """``"fp8"`` or ``"int8"``, from the payload's dtype."""
        return quantization_of_dtype(self.payload.dtype)

    @property
    def num_out_axes(self) -> int:
        return len(self.scale.shape)


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def check_quantization(quantization: str | None) -> str | None:
    """``quantization`` itself when it is ``None`` or a supported name, else a ``ValueError`` naming them."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise QuantizationError(f"quantization {quantization!r} is not supported; choose one of "
                         f"{sorted(QUANTIZATIONS)} or None")
    return quantization


def quantization_of_dtype(dtype) -> str:
    dtype = jnp.dtype(dtype)
    for name, payload_dtype in QUANTIZATIONS.items():
        if dtype == jnp.dtype(payload_dtype):
            return name
    raise ValueError(f"{dtype} is not a quantized payload dtype ({sorted(QUANTIZATIONS)})")


def quantize(w: jax.Array, quantization: str, num_out_axes: int,
             scale_method: str | None = None) -> QuantizedWeight:
    """Per-output-channel symmetric quantization of ``w`` laid out ``[out..., in...]``.

    ``scale_method``: ``"absmax"`` or ``"mse"`` (the module docstring); ``None``: the
    quantization's :data:`DEFAULT_SCALE_METHOD`. The scale is computed in
    float32 from ``w`` in its own dtype; jit-friendly (the search is a short unrolled loop that
    keeps one candidate's error at a time, so memory stays about twice the weight's).
    """
    check_quantization(quantization)
    scale_method = scale_method or DEFAULT_SCALE_METHOD[quantization]
    if scale_method not in SCALE_METHODS:
        raise QuantizationError(f"scale_method {scale_method!r} is not one of {SCALE_METHODS}")
    in_axes = tuple(range(num_out_axes, w.ndim))
    w32 = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w32), axis=in_axes)  # [out...]
    qmax = FP8_MAX if quantization == "fp8" else INT8_MAX
    absmax_scale = jnp.maximum(absmax / qmax, _MIN_SCALE)
    if scale_method == "absmax":
        return QuantizedWeight(payload=_round(w32, absmax_scale, quantization), scale=absmax_scale)
    best_scale, best_error = absmax_scale, _squared_error(w32, absmax_scale, quantization)
    for ratio in SEARCH_RATIOS[quantization]:
        if ratio == 1.0:
            continue
        scale = absmax_scale * ratio
        error = _squared_error(w32, scale, quantization)  # [out...]
        better = error < best_error
        best_scale, best_error = jnp.where(better, scale, best_scale), jnp.where(better, error, best_error)
    return QuantizedWeight(payload=_round(w32, best_scale, quantization), scale=best_scale)


def _round(w32: jax.Array, scale: jax.Array, quantization: str) -> jax.Array:
    """``w32 / scale`` per row, saturated at the format's largest value and rounded to nearest."""
    qmax = FP8_MAX if quantization == "fp8" else INT8_MAX
    scaled = jnp.clip(w32 / scale.reshape(scale.shape + (1,) * (w32.ndim - scale.ndim)), -qmax, qmax)
    if quantization == "int8":
        return jnp.round(scaled).astype(jnp.int8)
    return scaled.astype(jnp.float8_e4m3fn)


def _squared_error(w32: jax.Array, scale: jax.Array, quantization: str) -> jax.Array:
    """[out...] sum over each row of (dequantized - w)^2 with the row scales ``scale``."""
    in_axes = tuple(range(scale.ndim, w32.ndim))
    rebuilt = _round(w32, scale, quantization).astype(jnp.float32) * scale.reshape(scale.shape + (1,) * len(in_axes))
    return jnp.sum(jnp.square(rebuilt - w32), axis=in_axes)


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The ``[out..., in...]`` weight the quantized one stands for, in ``dtype``."""
    in_ndim = w.payload.ndim - w.num_out_axes
    scale = w.scale.reshape(w.scale.shape + (1,) * in_ndim)
    return (w.payload.astype(jnp.float32) * scale).astype(dtype)


def fp8_support(device: jax.Device | None = None) -> tuple[bool, str]:
    """Whether ``device`` (default: the first) computes FP8 matmuls, and a sentence saying why.

    CPUs run FP8 emulated (XLA upcasts), exact to the format; NVIDIA GPUs need compute
    capability 8.9 (Ada) or later (Hopper is 9.0); TPUs before v7 have no FP8 unit.
    """
    device = device or jax.devices()[0]
    platform = device.platform
    if platform == "cpu":
        return True, "CPU: FP8 runs emulated (upcast to float32), exact to the format but slow"
    if platform in ("gpu", "cuda", "rocm"):
        capability = getattr(device, "compute_capability", None)
        try:
            major, minor = (int(p) for p in str(capability).split(".")[:2])
        except ValueError:
            return False, f"GPU {device.device_kind!r}: compute capability {capability!r} unknown"
        if (major, minor) >= (8, 9):
            return True, f"GPU {device.device_kind!r} (sm_{major}{minor}) has FP8 tensor cores"
        return False, f"GPU {device.device_kind!r} (sm_{major}{minor}) has no FP8 tensor cores (need sm_89 or later)"
    if platform == "tpu":
        match = re.search(r"v?(\d+)", device.device_kind.replace("TPU", ""))
        generation = int(match.group(1)) if match else 0
        if generation >= 7:
            return True, f"TPU {device.device_kind!r} has FP8"
        return False, f"TPU {device.device_kind!r} has no FP8 (TPU v7 and later do)"
    return False, f"platform {platform!r} is not known to compute FP8"


def check_platform_supports(quantization: str | None, device: jax.Device | None = None) -> None:
    """Refuse ``quantization="fp8"`` where the device has no FP8, naming what is supported."""
    if check_quantization(quantization) != "fp8":
        return
    ok, why = fp8_support(device)
    if not ok:
        raise QuantizationError(f"quantization='fp8' is not supported here: {why}. Use quantization='int8' "
                         f"(weight-only, every platform) or None")

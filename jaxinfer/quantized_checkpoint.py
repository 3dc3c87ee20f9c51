"""Pre-quantized checkpoints: reading a ``quantization_config`` and the scale tensors beside each weight.

Two FP8 formats of Hugging Face checkpoints are read, both with e4m3 weights ``[out, in]`` (the
``F8_E4M3`` safetensors dtype) and a float32 ``weight_scale`` per tensor or per output channel:

- **compressed-tensors** (llm-compressor, RedHatAI's models), ``"quant_method": "compressed-tensors"``,
  ``"format": "float-quantized"``: its presets ``FP8`` (per-tensor weight scale, a static
  per-tensor ``input_scale``) and ``FP8_DYNAMIC`` (per-channel weight scale, per-token dynamic
  activations), ``ignore`` (typically ``["lm_head"]``), and ``kv_cache_scheme`` with per-layer
  ``k_scale`` / ``v_scale`` tensors.
- **fbgemm-fp8** (``"quant_method": "fbgemm_fp8"``): per-channel weight scales, dynamic activations.

The ``compressed-tensors`` package needs torch, so the config JSON is parsed here. Both formats
load into the same :class:`~jaxinfer.quantization.QuantizedWeight` (a per-tensor scale is
broadcast over the output channels, which is exact). A compressed-tensors ``FP8`` checkpoint's
static per-tensor ``input_scale`` becomes the weight's ``input_scale`` and the model serves W8A8
with it (``ModelConfig.activation_scales == "static"``, as vLLM does): quantizing an activation
is then one elementwise pass fused into its producer instead of a row-max plus a pass
(``jaxinfer.activation_scales``). q/k/v and gate/up, which share one input, share the largest of
their scales. ``FP8_DYNAMIC`` and fbgemm-fp8 scale activations per token at run time.

Anything else (FP8_BLOCK, group scales, int4/int8 compressed-tensors, AWQ, GPTQ, ...) is refused
with a :class:`~jaxinfer.quantization.QuantizationError` that names what is supported, before any
weight is read. jaxinfer's own Orbax checkpoints write ``{"quant_method": "jaxinfer", "weights":
"fp8" | "int8"}``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from jaxinfer.quantization import QUANTIZATIONS, QuantizationError

# How W8A8 scales activations: per token at run time, or by a fixed per-tensor scale per projection.
ACTIVATION_SCALES = ("dynamic", "static")
SUPPORTED = ("compressed-tensors FP8 and FP8_DYNAMIC (8-bit float weights with per-tensor or per-channel "
             "scales; tensor-wise FP8 KV scales), fbgemm_fp8, or quantize at load with quantization='fp8' "
             "or 'int8' from a bf16/f32 checkpoint")


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's ``quantization_config`` says about its weights."""

    method: str  # "compressed-tensors", "fbgemm_fp8" or "jaxinfer"
    quantization: str  # "fp8" or "int8": the payload of every projection
    scheme: str  # "FP8", "FP8_DYNAMIC", "FP8_WEIGHT_ONLY", "fbgemm_fp8" or "jaxinfer"
    has_kv_scales: bool = False  # k_scale / v_scale tensors per layer (compressed-tensors kv_cache_scheme)
    stores_quantized: bool = True  # the safetensors hold payload + weight_scale (not jaxinfer's own)
    activation_scales: str = "dynamic"  # "static": one input_scale per projection (jaxinfer.activation_scales)


def parse_quantization_config(config: dict[str, Any] | None) -> CheckpointQuantization | None:
    """The checkpoint's quantization, ``None`` for a dense checkpoint; unsupported schemes raise."""
    if not config:
        return None
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "fbgemm_fp8":
        return CheckpointQuantization("fbgemm_fp8", "fp8", "fbgemm_fp8")
    if method == "jaxinfer":
        weights = config.get("weights")
        if weights not in QUANTIZATIONS:
            raise QuantizationError(f"quantization_config.weights {weights!r}: expected one of {sorted(QUANTIZATIONS)}")
        activation_scales = config.get("activation_scales", "dynamic")
        if activation_scales not in ACTIVATION_SCALES or (activation_scales == "static" and weights != "fp8"):
            raise QuantizationError(f"quantization_config.activation_scales {activation_scales!r} with "
                                    f"{weights} weights: expected 'dynamic', or 'static' with fp8 weights")
        return CheckpointQuantization("jaxinfer", weights, "jaxinfer", stores_quantized=False,
                                      activation_scales=activation_scales)
    raise QuantizationError(f"quantization_config.quant_method {method!r} is not supported; supported: {SUPPORTED}")


def checkpoint_activation_scales(config: dict[str, Any] | None) -> str:
    """``"static"`` when a checkpoint's ``quantization_config`` gives each projection a static
    activation scale (compressed-tensors ``FP8``; jaxinfer's own, when saved with them), else ``"dynamic"``."""
    parsed = parse_quantization_config(config)
    return "dynamic" if parsed is None else parsed.activation_scales


def weight_quantization(config: dict[str, Any] | None) -> str | None:
    """``"fp8"``/``"int8"`` for a quantized checkpoint's ``quantization_config``, ``None`` for none."""
    parsed = parse_quantization_config(config)
    return None if parsed is None else parsed.quantization


def _compressed_tensors(config: dict[str, Any]) -> CheckpointQuantization:
    fmt = config.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise QuantizationError(f"compressed-tensors format {fmt!r} is not supported (float-quantized is); "
                                f"supported: {SUPPORTED}")
    groups = config.get("config_groups") or {}
    if not groups:
        raise QuantizationError("compressed-tensors quantization_config has no config_groups")
    schemes = {_group_scheme(name, group) for name, group in groups.items()}
    if len(schemes) != 1:
        raise QuantizationError(f"compressed-tensors config_groups mix schemes {sorted(schemes)}; one scheme "
                                f"for every Linear is supported")
    kv = config.get("kv_cache_scheme")
    if kv is not None:
        if not (kv.get("num_bits") == 8 and kv.get("type") == "float" and kv.get("strategy", "tensor") == "tensor"
                and not kv.get("dynamic", False)):
            raise QuantizationError(f"compressed-tensors kv_cache_scheme {kv} is not supported; supported: "
                                    f"static 8-bit float with tensor strategy (one k_scale and v_scale per layer)")
    scheme = schemes.pop()
    return CheckpointQuantization("compressed-tensors", "fp8", scheme, has_kv_scales=kv is not None,
                                  activation_scales="static" if scheme == "FP8" else "dynamic")


def _group_scheme(name: str, group: dict[str, Any]) -> str:
    weights = group.get("weights") or {}
    where = f"compressed-tensors config_groups.{name}"
    targets = group.get("targets") or ["Linear"]
    if targets != ["Linear"]:
        raise QuantizationError(f"{where}.targets {targets}: only ['Linear'] is supported")
    strategy = weights.get("strategy")
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise QuantizationError(f"{where}.weights is {weights.get('num_bits')}-bit {weights.get('type')} "
                                f"(e.g. int4/int8 W4A16/W8A8); supported: {SUPPORTED}")
    if strategy not in ("tensor", "channel") or weights.get("block_structure") or weights.get("group_size"):
        named = "FP8_BLOCK" if strategy == "block" else f"strategy {strategy!r}"
        raise QuantizationError(f"{where}.weights uses {named}; supported: {SUPPORTED}")
    if weights.get("dynamic", False):
        raise QuantizationError(f"{where}.weights.dynamic is true; supported: static weight scales")
    acts = group.get("input_activations")
    if acts is None:
        return "FP8_WEIGHT_ONLY"
    if acts.get("num_bits") != 8 or acts.get("type") != "float":
        raise QuantizationError(f"{where}.input_activations is {acts.get('num_bits')}-bit {acts.get('type')}; "
                                f"supported: 8-bit float")
    if acts.get("dynamic"):
        if acts.get("strategy") not in ("token", "tensor"):
            raise QuantizationError(f"{where}.input_activations strategy {acts.get('strategy')!r}; supported: token")
        return "FP8_DYNAMIC"
    if acts.get("strategy", "tensor") != "tensor":
        raise QuantizationError(f"{where}.input_activations: static {acts.get('strategy')!r} scales; supported: tensor")
    return "FP8"


def read_weight_scale(get: Callable[[str], np.ndarray], weight_name: str, num_out: int) -> np.ndarray:
    """The ``[out]`` float32 scale of the e4m3 weight ``weight_name`` (``...q_proj.weight``).

    A per-tensor scale (shape ``()``, ``[1]`` or ``[1, 1]``) is broadcast over the channels; a
    per-channel one is ``[out]`` or ``[out, 1]``; any other shape is refused.
    """
    name = weight_name + "_scale"
    scale = np.asarray(get(name), np.float32)
    if scale.size == 1:
        return np.full((num_out,), scale.reshape(()), np.float32)
    if scale.shape in ((num_out,), (num_out, 1)):
        return scale.reshape(num_out)
    raise QuantizationError(f"{name} has shape {list(scale.shape)}; supported: per-tensor [1] or per-channel "
                            f"[{num_out}] / [{num_out}, 1] (block or group scales are not)")


def read_input_scale(get: Callable[[str], np.ndarray], weight_name: str) -> np.ndarray:
    """The static ``input_scale`` of the module of ``weight_name``: one positive float32 number, as a
    ``[]`` array (``QuantizedWeight.input_scale``); any other shape or value is refused."""
    name = weight_name.removesuffix(".weight") + ".input_scale"
    scale = np.asarray(get(name), np.float32)
    if scale.size != 1 or not np.isfinite(scale).all() or scale.reshape(()) <= 0:
        raise QuantizationError(f"{name} has shape {list(scale.shape)} and values {scale.ravel()[:4]}; "
                                f"supported: one positive per-tensor scale")
    return scale.reshape(())


def kv_scale_names(layer: int) -> dict[str, tuple[str, ...]]:
    """Where compressed-tensors keeps layer ``layer``'s K and V scales (newer name first)."""
    prefix = f"model.layers.{layer}.self_attn"
    return {"k": (f"{prefix}.k_scale", f"{prefix}.k_proj.output_scale"),
            "v": (f"{prefix}.v_scale", f"{prefix}.v_proj.output_scale")}


def read_kv_cache_scales(has: Callable[[str], bool], get: Callable[[str], np.ndarray],
                         num_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """(k_scales [L], v_scales [L]) float32 of a checkpoint with a ``kv_cache_scheme``."""
    scales = {"k": [], "v": []}
    for layer in range(num_layers):
        for which, names in kv_scale_names(layer).items():
            found = [n for n in names if has(n)]
            if not found:
                raise QuantizationError(f"the checkpoint has a kv_cache_scheme but no {' or '.join(names)}")
            value = np.asarray(get(found[0]), np.float32)
            if value.size != 1:
                raise QuantizationError(f"{found[0]} has shape {list(value.shape)}; supported: one per-tensor scale")
            scales[which].append(float(value.reshape(())))
    return np.asarray(scales["k"], np.float32), np.asarray(scales["v"], np.float32)

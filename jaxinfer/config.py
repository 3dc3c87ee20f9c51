"""ModelConfig: the architecture of a Llama-family model, read from a Hugging Face config.

One forward serves every supported architecture; they differ only by the flags here
(qkv bias, q/k RMSNorm, tied embeddings, rope scaling, sliding window), never by
copies of the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxinfer.quantized_checkpoint import checkpoint_activation_scales, weight_quantization

# model_type in config.json -> the flags that distinguish it from plain Llama.
SUPPORTED_MODEL_TYPES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one this engine implements."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1-style frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable (usable as a static jit argument) description of the architecture."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # "fp8" / "int8": the projections are QuantizedWeights (jaxinfer.quantization); None: dense.
    # Set from a checkpoint's quantization_config, or by quantize-at-load (jaxinfer.checkpoint).
    quantization: str | None = None
    # "static": every FP8 projection carries a per-tensor input_scale (QuantizedWeight.input_scale,
    # jaxinfer.activation_scales) and W8A8 quantizes activations with it; "dynamic": per token.
    activation_scales: str = "dynamic"

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """The design's memory formula: 2 (K and V) * layers * kv_heads * head_dim * bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (LlamaConfig, MistralConfig, Qwen2/3Config)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            architectures = hf.get("architectures") or []
            raise UnsupportedModelError(
                f"unsupported architecture model_type={model_type!r} (architectures={architectures}); "
                f"supported model types: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        flags = SUPPORTED_MODEL_TYPES[model_type]
        num_q_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_q_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding_window = hf.get("sliding_window")
        # Qwen2 configs carry a sliding_window value but switch it off with use_sliding_window.
        if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
            sliding_window = None
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_q_heads=num_q_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_q_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", flags.get("attention_bias", False))),
            qk_norm=flags.get("qk_norm", False),
            sliding_window=sliding_window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quantization=weight_quantization(hf.get("quantization_config")),
            activation_scales=checkpoint_activation_scales(hf.get("quantization_config")),
        )


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes "rope_parameters"; older configs use rope_theta + rope_scaling.
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _rope_theta(hf: dict[str, Any]) -> float:
    return float(hf.get("rope_theta") or _rope_parameters(hf).get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict[str, Any]) -> RopeScaling | None:
    params = _rope_parameters(hf)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"unsupported rope scaling type {rope_type!r}; supported: default, llama3")
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )

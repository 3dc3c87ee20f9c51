"""The tensor names of each architecture, in Hugging Face checkpoints and in GGUF files.

Each weight the model declares (``jaxinfer.params.param_specs``: a field of ``Weights`` or of
``LayerWeights``) has one name in a Hugging Face safetensors checkpoint and one in a GGUF file;
this module is the only place that spells them. The loaders look names up here
(``jaxinfer.checkpoint`` for safetensors, ``jaxinfer.gguf_loader`` for GGUF); a weight's layout
(transpose, reshape into heads) follows from its declaration, not from its family. Adding a
family is an ``Architecture`` entry here plus its flags in ``jaxinfer.config``.

Llama, Mistral, Qwen2 and Qwen3 (and SmolLM2, a Llama) use the same names; they differ in
which weights exist (Qwen2's q/k/v biases, Qwen3's q/k norms: config flags) and in whether
llama.cpp's converter interleaved the rotary halves of the Q/K rows (Llama's GGUFs only).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from jaxinfer.config import ModelConfig
from jaxinfer.params import LayerWeights, Weights, param_specs


@dataclasses.dataclass(frozen=True)
class TensorName:
    """One weight's name in each format; ``{layer}`` stands for the layer index."""

    hf: str
    gguf: str


@dataclasses.dataclass(frozen=True)
class Architecture:
    model_type: str  # config.json's model_type
    hf_class: str  # config.json's architectures[0]
    gguf_architecture: str | None  # a GGUF file's general.architecture; None: no GGUF files
    # llama.cpp's converter reorders each head's Q/K rows (rotary halves -> interleaved pairs).
    gguf_qk_rows_interleaved: bool
    model_tensors: Mapping[str, TensorName]  # Weights field -> names
    layer_tensors: Mapping[str, TensorName]  # LayerWeights field -> names


LLAMA_MODEL_TENSORS = {
    "embed": TensorName("model.embed_tokens.weight", "token_embd.weight"),
    "final_norm": TensorName("model.norm.weight", "output_norm.weight"),
    "lm_head": TensorName("lm_head.weight", "output.weight"),
}

LLAMA_LAYER_TENSORS = {
    "attn_norm": TensorName("model.layers.{layer}.input_layernorm.weight", "blk.{layer}.attn_norm.weight"),
    "q": TensorName("model.layers.{layer}.self_attn.q_proj.weight", "blk.{layer}.attn_q.weight"),
    "k": TensorName("model.layers.{layer}.self_attn.k_proj.weight", "blk.{layer}.attn_k.weight"),
    "v": TensorName("model.layers.{layer}.self_attn.v_proj.weight", "blk.{layer}.attn_v.weight"),
    "o": TensorName("model.layers.{layer}.self_attn.o_proj.weight", "blk.{layer}.attn_output.weight"),
    "mlp_norm": TensorName("model.layers.{layer}.post_attention_layernorm.weight", "blk.{layer}.ffn_norm.weight"),
    "gate": TensorName("model.layers.{layer}.mlp.gate_proj.weight", "blk.{layer}.ffn_gate.weight"),
    "up": TensorName("model.layers.{layer}.mlp.up_proj.weight", "blk.{layer}.ffn_up.weight"),
    "down": TensorName("model.layers.{layer}.mlp.down_proj.weight", "blk.{layer}.ffn_down.weight"),
    "q_bias": TensorName("model.layers.{layer}.self_attn.q_proj.bias", "blk.{layer}.attn_q.bias"),
    "k_bias": TensorName("model.layers.{layer}.self_attn.k_proj.bias", "blk.{layer}.attn_k.bias"),
    "v_bias": TensorName("model.layers.{layer}.self_attn.v_proj.bias", "blk.{layer}.attn_v.bias"),
    "q_norm": TensorName("model.layers.{layer}.self_attn.q_norm.weight", "blk.{layer}.attn_q_norm.weight"),
    "k_norm": TensorName("model.layers.{layer}.self_attn.k_norm.weight", "blk.{layer}.attn_k_norm.weight"),
}

ARCHITECTURES = {
    arch.model_type: arch
    for arch in (
        Architecture("llama", "LlamaForCausalLM", "llama", True, LLAMA_MODEL_TENSORS, LLAMA_LAYER_TENSORS),
        # Mistral GGUFs say general.architecture "llama" and load as Llama.
        Architecture("mistral", "MistralForCausalLM", None, False, LLAMA_MODEL_TENSORS, LLAMA_LAYER_TENSORS),
        Architecture("qwen2", "Qwen2ForCausalLM", "qwen2", False, LLAMA_MODEL_TENSORS, LLAMA_LAYER_TENSORS),
        Architecture("qwen3", "Qwen3ForCausalLM", "qwen3", False, LLAMA_MODEL_TENSORS, LLAMA_LAYER_TENSORS),
    )
}

GGUF_ARCHITECTURES = {arch.gguf_architecture: arch for arch in ARCHITECTURES.values() if arch.gguf_architecture}

# Which weights are Hugging Face [out_features, in_features] matrices; the model stores them
# input axis first (``jaxinfer.params``), so their loaders transpose. The embedding is a lookup
# table, [vocab, embed] in both.
HF_OUT_IN_MATRICES = frozenset({"q", "k", "v", "o", "gate", "up", "down", "lm_head"})


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """Where one declared weight comes from in a Hugging Face checkpoint."""

    name: str
    is_out_in: bool  # stored [out_features, in_features]: transposed on loading


def hf_tensors(config: ModelConfig) -> Weights:
    """A ``Weights`` pytree of ``HFTensor``s matching ``param_specs(config)`` leaf for leaf
    (``None`` where the model has no such weight; one ``HFTensor`` for a whole ``QuantizedWeight``)."""
    arch = ARCHITECTURES[config.model_type]
    specs = param_specs(config)

    def tensor(table: Mapping[str, TensorName], field: str, layer: int | None = None) -> HFTensor:
        return HFTensor(table[field].hf.format(layer=layer), field in HF_OUT_IN_MATRICES)

    layers = [
        LayerWeights(**{
            field.name: tensor(arch.layer_tensors, field.name, i) if getattr(spec, field.name) is not None else None
            for field in dataclasses.fields(LayerWeights)
        })
        for i, spec in enumerate(specs.layers)
    ]
    return Weights(
        embed=tensor(arch.model_tensors, "embed"),
        layers=layers,
        final_norm=tensor(arch.model_tensors, "final_norm"),
        lm_head=tensor(arch.model_tensors, "lm_head") if specs.lm_head is not None else None,
    )


def gguf_to_hf_name(arch: Architecture, gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor of ``arch``, or ``None`` for a name it does not use."""
    for tensor in arch.model_tensors.values():
        if tensor.gguf == gguf_name:
            return tensor.hf
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if match:
        for tensor in arch.layer_tensors.values():
            if tensor.gguf == "blk.{layer}." + match[2]:
                return tensor.hf.format(layer=int(match[1]))
    return None


def known_gguf_names(arch: Architecture) -> list[str]:
    """The GGUF names ``arch`` uses, for error messages."""
    return [t.gguf for t in arch.model_tensors.values()] + [t.gguf for t in arch.layer_tensors.values()]

"""Loading checkpoints: Hugging Face directories (safetensors), GGUF files and Orbax checkpoints.

Both formats end as Hugging Face-named tensors (``model.layers.0.self_attn.q_proj.weight``,
``[out, in]`` shapes), which :func:`weights_from_hf` lays out as the model's ``Weights``.
GGUF files are read and dequantized by ``jaxinfer.gguf_loader``; Orbax checkpoints (converted
once from either) are written and restored, shard by shard, by ``jaxinfer.orbax_checkpoint``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.params import LayerWeights, Weights
from jaxinfer.tokenizer import Tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype: str | None) -> jnp.dtype:
    """``None``/``"auto"`` -> bfloat16 on an accelerator, float32 on CPU."""
    if dtype in (None, "auto"):
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)} or 'auto'")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def weights_from_hf(config: ModelConfig, get: Callable[[str], np.ndarray], dtype) -> Weights:
    """Lay out Hugging Face tensors (fetched one at a time by ``get``) as ``Weights`` on the device."""
    e, d = config.hidden_size, config.head_dim
    hq, hkv = config.num_q_heads, config.num_kv_heads

    def put(x: np.ndarray) -> jax.Array:
        return jnp.asarray(np.asarray(x, dtype=np.float32)).astype(dtype)

    def proj_in(name: str, heads: int) -> jax.Array:  # [heads*D, E] -> [E, heads, D]
        return put(np.asarray(get(name)).T.reshape(e, heads, d))

    def layer(i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        bias = config.attention_bias
        return LayerWeights(
            attn_norm=put(get(p + "input_layernorm.weight")),
            q=proj_in(p + "self_attn.q_proj.weight", hq),
            k=proj_in(p + "self_attn.k_proj.weight", hkv),
            v=proj_in(p + "self_attn.v_proj.weight", hkv),
            o=put(np.asarray(get(p + "self_attn.o_proj.weight")).T.reshape(hq, d, e)),
            mlp_norm=put(get(p + "post_attention_layernorm.weight")),
            gate=put(np.asarray(get(p + "mlp.gate_proj.weight")).T),
            up=put(np.asarray(get(p + "mlp.up_proj.weight")).T),
            down=put(np.asarray(get(p + "mlp.down_proj.weight")).T),
            q_bias=put(np.asarray(get(p + "self_attn.q_proj.bias")).reshape(hq, d)) if bias else None,
            k_bias=put(np.asarray(get(p + "self_attn.k_proj.bias")).reshape(hkv, d)) if bias else None,
            v_bias=put(np.asarray(get(p + "self_attn.v_proj.bias")).reshape(hkv, d)) if bias else None,
            q_norm=put(get(p + "self_attn.q_norm.weight")) if config.qk_norm else None,
            k_norm=put(get(p + "self_attn.k_norm.weight")) if config.qk_norm else None,
        )

    return Weights(
        embed=put(get("model.embed_tokens.weight")),
        layers=[layer(i) for i in range(config.num_layers)],
        final_norm=put(get("model.norm.weight")),
        lm_head=None if config.tie_word_embeddings else put(np.asarray(get("lm_head.weight")).T),
    )


def _safetensors_getter(path: Path) -> Callable[[str], np.ndarray]:
    from safetensors import safe_open

    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        weight_map = None
    handles = {f: safe_open(str(path / f), framework="flax") for f in files}
    if weight_map is None:
        weight_map = {name: f for f, h in handles.items() for name in h.keys()}

    def get(name: str) -> np.ndarray:
        if name not in weight_map:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {path}")
        # framework="flax" reads bfloat16 too; float32 on the host keeps the layout code simple.
        return np.asarray(handles[weight_map[name]].get_tensor(name).astype(jnp.float32))

    return get


def load_hf_dir(path: Path, dtype) -> LoadedModel:
    hf_config = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf(hf_config)
    weights = weights_from_hf(config, _safetensors_getter(path), dtype)
    tokenizer = Tokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
    return LoadedModel(config, weights, tokenizer, path)


def load_gguf(path: Path, dtype) -> LoadedModel:
    from jaxinfer.gguf_loader import read_gguf
    from jaxinfer.gguf_tokenizer import tokenizer_from_gguf

    checkpoint = read_gguf(path)
    config = ModelConfig.from_hf(checkpoint.config)
    weights = weights_from_hf(config, lambda name: checkpoint.tensors[name], dtype)
    tok, info = tokenizer_from_gguf(checkpoint.metadata)
    special = {
        k: info[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if info.get(k) is not None
    }
    eos_ids = list(config.eos_token_ids)
    if info.get("eos_token_id") is not None:
        eos_ids.append(info["eos_token_id"])
    tokenizer = Tokenizer(
        tokenizer=tok,
        chat_template=info.get("chat_template"),
        bos_token=special.get("bos_token"),
        eos_token=special.get("eos_token"),
        special_tokens=special,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
    )
    return LoadedModel(config, weights, tokenizer, path)


def load_model(model: str | Path, dtype: str | None = None, shardings=None) -> LoadedModel:
    """Load a built-in model name, a Hugging Face directory, a GGUF file, or an Orbax checkpoint.

    ``shardings``: a ``Weights`` pytree of ``NamedSharding``s, or a function of the ``ModelConfig``
    that returns one (``lambda c: weight_shardings(c, mesh)``). An Orbax checkpoint (written by
    ``jaxinfer convert``) restores each shard straight onto its devices; the other formats load
    onto the default device and are then laid out with ``jax.device_put``.
    """
    from jaxinfer.model_registry import resolve_model
    from jaxinfer.orbax_checkpoint import is_orbax_checkpoint, restore

    path = resolve_model(model)
    jdtype = resolve_dtype(dtype)
    if is_orbax_checkpoint(path):
        return restore(path, shardings=shardings, dtype=jdtype)
    if path.is_file() and path.suffix == ".gguf":
        loaded = load_gguf(path, jdtype)
    else:
        loaded = load_hf_dir(path, jdtype)
    if callable(shardings):
        shardings = shardings(loaded.config)
    if shardings is not None:
        loaded.weights = jax.device_put(loaded.weights, shardings)
    return loaded

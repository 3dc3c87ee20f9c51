"""Loading an EAGLE-3 head from a local directory (``config.json`` + ``*.safetensors``).

Two layouts of the same tensors are read (both are what vLLM loads):

- **EAGLE** (SafeAILab's ``EAGLE3-*`` checkpoints, e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``):
  a flat ``LlamaConfig`` (``vocab_size`` the target's, ``draft_vocab_size`` the head's,
  ``num_hidden_layers: 1``), the layer's tensors under ``midlayer.``;
- **speculators** (``speculators_model_type: "eagle3"``, e.g.
  ``RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3``): the layer's config nested in
  ``transformer_layer_config``, ``draft_vocab_size``, ``norm_before_residual``,
  ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``; tensors under ``layers.0.``.

Tensors (``{L}`` the layer prefix; ``[out, in]`` as in PyTorch): ``fc.weight [E, 3 * E_target]``
(``fc.bias`` optional), ``{L}hidden_norm.weight``, ``{L}input_layernorm.weight`` (the
embedding half), ``{L}post_attention_layernorm.weight``, ``{L}self_attn.{q,k,v}_proj.weight
[heads * D, 2E]``, ``{L}self_attn.o_proj.weight``, ``{L}mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight [Vd, E]``, ``d2t [Vd]`` (int64: target id = draft id +
``d2t``; absent when the draft vocabulary is the target's), ``t2d [V]`` (bool, unused here:
the reverse map is only needed to train), ``embed_tokens.weight [V, E]`` optional (the target's
embedding otherwise).

The auxiliary layers default to vLLM's ``(2, L // 2, L - 3)`` for an ``L``-layer target; id
``i`` is the residual stream *entering* layer ``i`` (Hugging Face's ``hidden_states[i]``).
Everything that must agree with the target is checked here, and a mismatch raises a
``SpeculativeConfigError`` whose ``field`` names the head's config key (or tensor) at fault.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.checkpoint import _safetensors_getter
from jaxinfer.config import ModelConfig, UnsupportedModelError
from jaxinfer.params import LayerWeights
from jaxinfer.spec_decode.config import SpeculativeConfigError
from jaxinfer.spec_decode.eagle3 import Eagle3Config, Eagle3Weights

FIELD = "speculative_config.model"


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default: a low, a middle and a high layer of the target."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def read_eagle3_config(path: Path, target: ModelConfig) -> Eagle3Config:
    """The head's :class:`Eagle3Config` from ``path/config.json``, checked against the ``target``."""
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        raise SpeculativeConfigError(f"{FIELD}: no EAGLE-3 head at {path} (a directory with config.json and "
                                     f"*.safetensors)", field=FIELD)
    hf = json.loads(config_file.read_text())
    is_speculators = "transformer_layer_config" in hf
    layer_hf = dict(hf["transformer_layer_config"]) if is_speculators else dict(hf)
    layer_hf.setdefault("model_type", "llama")
    target_vocab = layer_hf.get("vocab_size", target.vocab_size)
    draft_vocab = hf.get("draft_vocab_size") or target_vocab
    if target_vocab != target.vocab_size:
        raise SpeculativeConfigError(
            f"{FIELD}.vocab_size: the head was trained for a {target_vocab}-token vocabulary, the target has "
            f"{target.vocab_size}", field=f"{FIELD}.vocab_size", limit=target.vocab_size)
    if not 1 <= draft_vocab <= target.vocab_size:
        raise SpeculativeConfigError(f"{FIELD}.draft_vocab_size must be in [1, {target.vocab_size}], got {draft_vocab}",
                                     field=f"{FIELD}.draft_vocab_size", limit=target.vocab_size)
    if layer_hf.get("num_hidden_layers", 1) != 1:
        raise SpeculativeConfigError(f"{FIELD}.num_hidden_layers: an EAGLE-3 head has one decoder layer, got "
                                     f"{layer_hf['num_hidden_layers']}", field=f"{FIELD}.num_hidden_layers", limit=1)
    try:
        layer = ModelConfig.from_hf({**layer_hf, "vocab_size": draft_vocab, "num_hidden_layers": 1})
    except (UnsupportedModelError, KeyError) as error:
        raise SpeculativeConfigError(f"{FIELD}: the head's layer config cannot be read: {error}", field=FIELD) from None
    target_hidden = hf.get("target_hidden_size") or layer.hidden_size
    if target_hidden != target.hidden_size:
        raise SpeculativeConfigError(
            f"{FIELD}.target_hidden_size: the head reads {target_hidden}-wide features, the target's are "
            f"{target.hidden_size}", field=f"{FIELD}.target_hidden_size", limit=target.hidden_size)
    ids = (hf.get("eagle_aux_hidden_state_layer_ids") or (hf.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or default_aux_layer_ids(target.num_layers))
    ids = tuple(int(i) for i in ids)
    # Three in every published head; fc's width (checked with the tensors) follows their number.
    if not ids or not all(0 <= i < target.num_layers for i in ids):
        raise SpeculativeConfigError(
            f"{FIELD}.eagle_aux_hidden_state_layer_ids must be layers of the target, in [0, {target.num_layers - 1}], "
            f"got {list(ids)}", field=f"{FIELD}.eagle_aux_hidden_state_layer_ids", limit=target.num_layers - 1)
    return Eagle3Config(layer=layer, target_hidden_size=target_hidden, target_vocab_size=target.vocab_size,
                        aux_layer_ids=ids, norm_before_residual=bool(hf.get("norm_before_residual", False)))


def _layer_prefix(names) -> str:
    for prefix in ("midlayer.", "layers.0.", "model.midlayer.", "model.layers.0."):
        if f"{prefix}hidden_norm.weight" in names:
            return prefix
    raise SpeculativeConfigError(f"{FIELD}: no EAGLE-3 decoder layer in the checkpoint (looked for "
                                 f"midlayer.hidden_norm.weight and layers.0.hidden_norm.weight)", field=FIELD)


def load_eagle3_head(path: str | Path, target: ModelConfig, dtype) -> tuple[Eagle3Config, Eagle3Weights]:
    """The head in ``path`` in ``dtype`` on the device, checked against the ``target``'s config."""
    path = Path(path)
    config = read_eagle3_config(path, target)
    try:
        get = _safetensors_getter(path)
    except FileNotFoundError as error:
        # Some EAGLE-3 heads are published as pytorch_model.bin: convert them to safetensors first.
        raise SpeculativeConfigError(f"{FIELD}: {error} (only safetensors heads are read)", field=FIELD) from None
    names = get.names
    top = "model." if "model.fc.weight" in names else ""
    prefix = _layer_prefix(names)
    c = config.layer
    e, f, d, hq, hkv = c.hidden_size, c.intermediate_size, c.head_dim, c.num_q_heads, c.num_kv_heads

    def tensor(name: str, stored_shape: tuple[int, ...], layout: tuple[int, ...] | None = None) -> jax.Array:
        """``name`` as stored (PyTorch's ``[out, in]``), transposed and reshaped to ``layout`` if given."""
        if name not in names:
            raise SpeculativeConfigError(f"{FIELD}: tensor {name!r} is missing from the head in {path}",
                                         field=f"{FIELD}.{name}")
        host = get(name)
        if tuple(host.shape) != stored_shape:
            raise SpeculativeConfigError(f"{FIELD}: tensor {name!r} has shape {list(host.shape)}, the head's config "
                                         f"implies {list(stored_shape)}", field=f"{FIELD}.{name}")
        array = jax.device_put(host)
        return (array if layout is None else array.T.reshape(layout)).astype(dtype)

    def optional(name: str, stored_shape: tuple[int, ...]):
        return tensor(name, stored_shape) if name in names else None

    attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
    bias = c.attention_bias
    layer = LayerWeights(
        attn_norm=tensor(f"{prefix}input_layernorm.weight", (e,)),
        q=tensor(f"{attn}q_proj.weight", (hq * d, 2 * e), (2 * e, hq, d)),
        k=tensor(f"{attn}k_proj.weight", (hkv * d, 2 * e), (2 * e, hkv, d)),
        v=tensor(f"{attn}v_proj.weight", (hkv * d, 2 * e), (2 * e, hkv, d)),
        o=tensor(f"{attn}o_proj.weight", (e, hq * d), (hq, d, e)),
        mlp_norm=tensor(f"{prefix}post_attention_layernorm.weight", (e,)),
        gate=tensor(f"{mlp}gate_proj.weight", (f, e), (e, f)),
        up=tensor(f"{mlp}up_proj.weight", (f, e), (e, f)),
        down=tensor(f"{mlp}down_proj.weight", (e, f), (f, e)),
        q_bias=tensor(f"{attn}q_proj.bias", (hq * d,)).reshape(hq, d) if bias else None,
        k_bias=tensor(f"{attn}k_proj.bias", (hkv * d,)).reshape(hkv, d) if bias else None,
        v_bias=tensor(f"{attn}v_proj.bias", (hkv * d,)).reshape(hkv, d) if bias else None,
    )
    embed = optional(f"{top}embed_tokens.weight", (target.vocab_size, e))
    if embed is None and e != target.hidden_size:
        raise SpeculativeConfigError(f"{FIELD}: the head's hidden size {e} differs from the target's "
                                     f"{target.hidden_size}, so it needs its own embed_tokens.weight",
                                     field=f"{FIELD}.embed_tokens.weight")
    weights = Eagle3Weights(
        fc=tensor(f"{top}fc.weight", (e, config.aux_width), (config.aux_width, e)),
        fc_bias=optional(f"{top}fc.bias", (e,)),
        hidden_norm=tensor(f"{prefix}hidden_norm.weight", (e,)),
        layer=layer,
        final_norm=tensor(f"{top}norm.weight", (e,)),
        lm_head=tensor("lm_head.weight", (config.draft_vocab_size, e), (e, config.draft_vocab_size)),
        draft_to_target=jnp.asarray(_draft_to_target(get, names, config)),
        embed=embed,
    )
    return config, weights


def _draft_to_target(get, names, config: Eagle3Config) -> np.ndarray:
    """[Vd] int32 target ids of the draft vocabulary, from the ``d2t`` offsets (identity without them)."""
    base = np.arange(config.draft_vocab_size, dtype=np.int64)
    name = next((n for n in ("d2t", "model.d2t") if n in names), None)
    if name is None:
        if config.draft_vocab_size != config.target_vocab_size:
            raise SpeculativeConfigError(f"{FIELD}: a {config.draft_vocab_size}-token draft vocabulary needs the d2t "
                                         "map to the target's", field=f"{FIELD}.d2t")
        return base.astype(np.int32)
    offsets = np.asarray(get(name)).astype(np.int64).reshape(-1)
    if offsets.shape != base.shape:
        raise SpeculativeConfigError(f"{FIELD}: d2t has {offsets.size} entries for a {base.size}-token draft "
                                     "vocabulary", field=f"{FIELD}.d2t", limit=base.size)
    targets = base + offsets
    if targets.min() < 0 or targets.max() >= config.target_vocab_size:
        raise SpeculativeConfigError(f"{FIELD}: d2t maps draft ids to target ids outside [0, "
                                     f"{config.target_vocab_size - 1}]", field=f"{FIELD}.d2t",
                                     limit=config.target_vocab_size - 1)
    return targets.astype(np.int32)

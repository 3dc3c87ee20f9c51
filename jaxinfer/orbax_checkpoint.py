"""Orbax checkpoints: convert a model once, then restore each shard straight onto its devices.

``jaxinfer convert`` loads a Hugging Face directory or a GGUF file (dequantizing, transposing
and permuting as ``jaxinfer.checkpoint`` does) and writes the result as a directory::

    config.json            Hugging Face-style config; ModelConfig.from_hf reads it back
    tokenizer.json         the fast tokenizer (rebuilt from GGUF metadata for a GGUF source)
    tokenizer_config.json  special tokens and the chat template
    generation_config.json the end-of-sequence ids
    weights/               Orbax (StandardCheckpointer, OCDBT + tensorstore) checkpoint of ``Weights``
    jaxinfer_orbax.json    the marker, written last: the format version, the stored dtype (of the
                           dense weights), the quantization and any FP8 KV-cache scales

Apart from ``weights/`` the directory reads like a Hugging Face checkpoint, so the tokenizer code
and ``jaxinfer estimate`` need nothing new. :func:`restore` builds an abstract ``Weights`` target
(``jax.ShapeDtypeStruct`` leaves carrying the wanted shardings) from the weight declarations in
``jaxinfer.params``; Orbax then reads only the slice of each tensor that each device holds and
casts it on the way, so a model sharded 8 ways never exists whole on the host, let alone once per device.

A quantized model (``config.quantization``) saves its ``QuantizedWeight`` leaves (payload and
scale) like any other, and ``config.json`` says ``"quantization_config": {"quant_method":
"jaxinfer", "weights": "fp8"}`` (with ``"activation_scales": "static"`` when the FP8 weights carry
static input scales), so its declaration, and hence the restore target, is quantized too.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.loaded_model import LoadedModel
from jaxinfer.config import ModelConfig
from jaxinfer.params import Weights, is_spec, param_specs, spec_dtype
from jaxinfer.quantization import QuantizationError, check_quantization
from jaxinfer.tokenizer import Tokenizer

MARKER = "jaxinfer_orbax.json"
FORMAT_VERSION = 1
WEIGHTS_DIR = "weights"
# Orbax would store each weight as one chunk, the unit it reads and decompresses: each of 8
# devices would then decompress the whole tensor to take its 1/8, and Orbax's in-flight byte
# limit (which counts the chunks a read touches) would count whole tensors. With small chunks
# each device reads about its own slices (restoring the 368 MiB test model 8 ways: 1.1-1.4 s
# instead of 2-6 s on 2 cores).
CHUNK_BYTES = 8 << 20
MAX_INFLIGHT_BYTES = 1 << 30

# A Weights pytree of shardings, or a function of the config that makes one (the caller of
# load_model does not know the config before the checkpoint is opened).
Shardings = Weights | Callable[[ModelConfig], Weights]


class OutputExistsError(ValueError):
    """The output directory of a conversion exists and is not empty."""


def is_orbax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def check_output_dir(out_dir: str | Path) -> None:
    """Refuse to write over anything: a conversion is checked before the (slow) load."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OutputExistsError(f"{out} already exists and is not an empty directory; choose another --output")


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face-style config that ``ModelConfig.from_hf`` turns back into ``config``."""
    rope = config.rope_scaling
    return {
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_q_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if rope is None else {
            "rope_type": "llama3",
            "factor": rope.factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        },
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "sliding_window": config.sliding_window,
        "use_sliding_window": config.sliding_window is not None,  # read by Qwen2/3 configs only
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
        **({"quantization_config": _quantization_config(config)} if config.quantization else {}),
    }


def _quantization_config(config: ModelConfig) -> dict[str, Any]:
    # "activation_scales" only when static, so that dynamic checkpoints are written as before.
    static = {"activation_scales": "static"} if config.activation_scales == "static" else {}
    return {"quant_method": "jaxinfer", "weights": config.quantization, **static}


def save(model: LoadedModel, out_dir: str | Path, chunk_bytes: int = CHUNK_BYTES) -> Path:
    """Write ``model`` (weights in their current dtype, config, tokenizer) as an Orbax checkpoint directory.

    Each weight is stored in chunks of at most ``chunk_bytes``, the unit Orbax reads and decompresses.
    """
    import orbax.checkpoint as ocp

    out = Path(out_dir).absolute()  # Orbax wants absolute paths
    check_output_dir(out)
    hf = hf_config(model.config)
    if ModelConfig.from_hf(hf) != model.config:  # a new ModelConfig field that hf_config does not write yet
        raise ValueError(f"the config does not survive the round trip through config.json: {model.config}")
    # The dense weights share the serving dtype; quantized payloads and scales have their own.
    specs = jax.tree.leaves(param_specs(model.config), is_leaf=is_spec)
    dtypes = {str(x.dtype) for x, spec in zip(jax.tree.leaves(model.weights), specs) if spec.dtype is None}
    if len(dtypes) != 1:
        raise ValueError(f"the weights mix dtypes {sorted(dtypes)}; convert loads them in one dtype")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", hf)
    _save_tokenizer(model.tokenizer, out)
    with ocp.StandardCheckpointer() as checkpointer:
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk_bytes), model.weights)
        checkpointer.save(out / WEIGHTS_DIR, model.weights, save_args=save_args)
        checkpointer.wait_until_finished()
    # Last, so that an interrupted conversion is not mistaken for a checkpoint.
    marker = {"format_version": FORMAT_VERSION, "dtype": dtypes.pop(), "source": str(Path(model.source).absolute()),
              "quantization": model.config.quantization}
    if model.kv_cache_scales is not None:
        marker["kv_cache_scales"] = {"k": [float(x) for x in model.kv_cache_scales[0]],
                                     "v": [float(x) for x in model.kv_cache_scales[1]]}
    _write_json(out / MARKER, marker)
    return out


def restore(
    path: str | Path, shardings: Shardings | None = None, dtype=None, max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
    quantization: str | None = None,
) -> LoadedModel:
    """Load a converted checkpoint, each weight restored straight onto its devices.

    Args:
        path: a directory written by :func:`save` (``jaxinfer convert``).
        shardings: a ``Weights`` pytree of ``jax.sharding.Sharding`` (``NamedSharding`` on a mesh),
            or a function from the ``ModelConfig`` to one; default: everything on the first device.
        dtype: the dtype of the restored weights (cast while reading); default: the stored one.
        max_inflight_bytes: host memory for shards read but not yet placed on their devices.
        quantization: ``"fp8"``/``"int8"`` to quantize a dense checkpoint's projections after
            restoring them (one at a time); ``None``: as stored. A quantized checkpoint serves
            in its own quantization.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    marker = json.loads((path / MARKER).read_text())
    if marker.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} is a jaxinfer Orbax checkpoint of format {marker.get('format_version')}; "
            f"this jaxinfer reads format {FORMAT_VERSION}: convert the model again"
        )
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    check_quantization(quantization)
    if config.quantization and quantization not in (None, config.quantization):
        raise QuantizationError(f"{path} holds {config.quantization} weights; restore it with "
                                f"quantization={config.quantization!r} or None")
    if quantization and not config.quantization:
        from jaxinfer.checkpoint import quantize_weights
        from jaxinfer.quantization import check_platform_supports

        check_platform_supports(quantization)
        dense = restore(path, dtype=dtype, max_inflight_bytes=max_inflight_bytes)
        config = dataclasses.replace(config, quantization=quantization)
        weights = quantize_weights(dense.weights, quantization)
        del dense
        if callable(shardings):
            shardings = shardings(config)
        if shardings is not None:
            weights = jax.device_put(weights, shardings)
        return LoadedModel(config, weights, Tokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids), path,
                           kv_cache_scales=_kv_cache_scales(marker))
    specs = param_specs(config)
    if callable(shardings):
        shardings = shardings(config)
    if shardings is None:
        first = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: first, specs, is_leaf=is_spec)
    dtype = jnp.dtype(dtype or marker["dtype"])
    target = jax.tree.map(
        lambda spec, sharding: jax.ShapeDtypeStruct(spec.shape, spec_dtype(spec, dtype), sharding=sharding),
        specs, shardings, is_leaf=is_spec,
    )
    # Orbax reads each shard into a host buffer, then copies it to its device(s); the limit
    # bounds those buffers. Orbax refuses a single read larger than the limit, and estimates a
    # read by the chunks it touches, so the limit leaves room for the largest tensor, twice.
    largest = max(math.prod(spec.shape) for spec in jax.tree.leaves(specs, is_leaf=is_spec))
    stored = jnp.dtype(marker["dtype"]).itemsize
    limit = max_inflight_bytes + 2 * largest * max(stored, dtype.itemsize)
    handler = ocp.StandardCheckpointHandler(restore_concurrent_gb=limit / 1e9)
    with ocp.Checkpointer(handler) as checkpointer:
        weights = checkpointer.restore(path / WEIGHTS_DIR, args=ocp.args.StandardRestore(target))
    tokenizer = Tokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
    return LoadedModel(config, weights, tokenizer, path, kv_cache_scales=_kv_cache_scales(marker))


def _kv_cache_scales(marker: dict[str, Any]):
    import numpy as np

    scales = marker.get("kv_cache_scales")
    if scales is None:
        return None
    return np.asarray(scales["k"], np.float32), np.asarray(scales["v"], np.float32)


def _save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    # The files Tokenizer.from_hf_dir reads, holding what the Tokenizer was built with; the
    # eos ids are saved in order, so that from_hf_dir rebuilds the same tuple.
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = dict(tokenizer.special_tokens)
    if tokenizer.chat_template is not None:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "generation_config.json", {"eos_token_id": list(tokenizer.eos_token_ids)})


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")

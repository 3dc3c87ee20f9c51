"""Loading checkpoints: Hugging Face directories (safetensors), GGUF files and Orbax checkpoints.

Both formats end as Hugging Face-named tensors (``model.layers.0.self_attn.q_proj.weight``,
``[out, in]`` shapes; the names of each family are in ``jaxinfer.architectures``), which
:func:`weights_from_hf` streams, one tensor at a time in the checkpoint's own dtype, into the
model's ``Weights`` on the device.
GGUF files are read and dequantized by ``jaxinfer.gguf_loader``; Orbax checkpoints (converted
once from either) are written and restored, shard by shard, by ``jaxinfer.orbax_checkpoint``.

Quantized weights (``docs/QUANTIZATION.md``): ``quantization="fp8"``/``"int8"`` quantizes each
projection on the device as it is loaded (one tensor at a time, so the model never exists twice);
a pre-quantized FP8 checkpoint (``jaxinfer.quantized_checkpoint``) loads its e4m3 payloads and
scales as they are. Whether the platform can run the quantization is checked before any weight
is read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.activation_scales import share_input_scales
from jaxinfer.architectures import hf_tensors
from jaxinfer.config import ModelConfig
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.params import Weights, is_declared_weight, param_specs
from jaxinfer.quantization import (QuantizationError, QuantizedWeight, check_platform_supports, check_quantization,
                                   quantize)
from jaxinfer.quantized_checkpoint import (CheckpointQuantization, parse_quantization_config, read_input_scale,
                                           read_kv_cache_scales, read_weight_scale)
from jaxinfer.safetensors_reader import SafetensorsFile
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


def weights_from_hf(config: ModelConfig, get: Callable[[str], np.ndarray], dtype,
                    shardings: Weights | None = None, stored: CheckpointQuantization | None = None) -> Weights:
    """Lay out Hugging Face tensors, fetched one at a time by ``get``, as ``Weights`` on the device.

    ``get(name)`` returns a host array in any dtype (the checkpoint's own: bf16 stays bf16). It is
    copied to the device as it is and dropped before the next tensor is read, then transposed,
    reshaped and cast to ``dtype`` on the device, so the host holds one tensor at a time and
    never a float32 copy of the model. With ``shardings`` (a ``Weights`` pytree of shardings)
    each weight moves to its place as soon as it is made.

    With ``config.quantization`` set, each projection becomes a ``QuantizedWeight``: read as
    stored when ``stored`` (the checkpoint's quantization) says the checkpoint holds e4m3
    payloads with ``weight_scale`` tensors, else quantized on the device from the dense tensor.
    """
    specs, treedef = jax.tree.flatten(param_specs(config), is_leaf=is_declared_weight)
    sources = treedef.flatten_up_to(hf_tensors(config))
    places = [None] * len(specs) if shardings is None else treedef.flatten_up_to(shardings)
    dtype = jnp.dtype(dtype)
    arrays = []
    for spec, source, place in zip(specs, sources, places):
        if isinstance(spec, QuantizedWeight):
            array = _load_quantized(get, source.name, spec, config.quantization, stored)
        else:
            host = get(source.name)
            if host.dtype == jnp.float8_e4m3fn:
                # An FP8 checkpoint that quantized a weight kept dense here (an lm_head left out of
                # its `ignore`): dequantized with its per-row scale into the serving dtype.
                scale = read_weight_scale(get, source.name, host.shape[0])
                array = _dequantize_to_model_layout(jax.device_put(host), jax.device_put(scale), source.is_out_in,
                                                    spec.shape, dtype)
            else:
                array = _to_model_layout(jax.device_put(host), source.is_out_in, spec.shape, dtype)
        # Once the copy has landed the host array is gone: transfers cannot queue up host memory.
        jax.block_until_ready(array)
        arrays.append(array if place is None else jax.device_put(array, place))
    # q/k/v (and gate/up) are quantized together, with the largest of their static input scales.
    return share_input_scales(jax.tree.unflatten(treedef, arrays))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _dequantize_to_model_layout(x: jax.Array, scale: jax.Array, is_out_in: bool, shape: tuple[int, ...],
                                dtype) -> jax.Array:
    return _to_model_layout(x.astype(jnp.float32) * scale[:, None], is_out_in, shape, dtype)


def _load_quantized(get, name: str, spec: QuantizedWeight, quantization: str,
                    stored: CheckpointQuantization | None) -> QuantizedWeight:
    num_out = len(spec.scale.shape)
    if stored is not None and stored.stores_quantized:
        try:
            scale = read_weight_scale(get, name, int(np.prod(spec.scale.shape)))
        except KeyError:
            scale = None  # a module the checkpoint's `ignore` kept dense: quantized here like the rest
        if scale is not None:
            payload = get(name)
            if payload.dtype != jnp.float8_e4m3fn or payload.size != np.prod(spec.payload.shape):
                raise QuantizationError(f"{name} is {payload.dtype} {list(payload.shape)}; a {stored.scheme} "
                                        f"checkpoint stores it as float8_e4m3fn {list(spec.payload.shape)}")
            input_scale = None
            if stored.scheme == "FP8":
                input_scale = read_input_scale(get, name)
                input_scale = jax.device_put(input_scale) if spec.input_scale is not None else None
            return QuantizedWeight(payload=jax.device_put(payload.reshape(spec.payload.shape)),
                                   scale=jax.device_put(scale.reshape(spec.scale.shape)), input_scale=input_scale)
    if spec.input_scale is not None:
        raise QuantizationError(f"{name} is stored dense in a checkpoint with static activation scales: it has no "
                                f"input_scale to serve W8A8 with; supported: every Linear quantized, or FP8_DYNAMIC")
    return _quantize_in_layout(jax.device_put(get(name)), tuple(spec.payload.shape), quantization, num_out)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_in_layout(x: jax.Array, shape: tuple[int, ...], quantization: str, num_out: int) -> QuantizedWeight:
    # Hugging Face's [out, in] is the payload's order: only a reshape into heads, no transpose.
    return quantize(x.reshape(shape), quantization, num_out)


def quantize_weights(weights: Weights, quantization: str) -> Weights:
    """Dense ``Weights`` (as the model lays them out) with every projection quantized, one at a time."""
    from jaxinfer.params import QUANTIZED_PROJECTIONS

    def one(layer):
        updates = {}
        for name, num_in in QUANTIZED_PROJECTIONS.items():
            w = getattr(layer, name)
            updates[name] = _quantize_dense(w, quantization, num_in)
        return dataclasses.replace(layer, **updates)

    return dataclasses.replace(weights, layers=[one(layer) for layer in weights.layers])


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_dense(w: jax.Array, quantization: str, num_in: int) -> QuantizedWeight:
    # [in..., out...] -> [out..., in...], then quantized per output channel.
    order = tuple(range(num_in, w.ndim)) + tuple(range(num_in))
    return quantize(jnp.transpose(w, order), quantization, w.ndim - num_in)


def resolve_quantization(requested: str | None, stored: CheckpointQuantization | None, source) -> str | None:
    """The quantization to serve ``source`` in: what was asked for, or what the checkpoint holds.

    A checkpoint stored quantized serves in its own quantization (asking for another is an
    error, since requantizing FP8 to int8 would compound two roundings); a dense one is
    quantized at load when asked.
    """
    check_quantization(requested)
    if stored is None:
        return requested
    if requested not in (None, stored.quantization):
        raise QuantizationError(f"{source} holds {stored.quantization} weights ({stored.method} {stored.scheme}); "
                                f"load it with quantization={stored.quantization!r} or None")
    return stored.quantization


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _to_model_layout(x: jax.Array, is_out_in: bool, shape: tuple[int, ...], dtype) -> jax.Array:
    # [out, in] -> the declared [in, ...out] (e.g. [hq*D, E] -> [E, hq, D]); a bias [hq*D] -> [hq, D].
    return (x.T if is_out_in else x).reshape(shape).astype(dtype)


def _safetensors_getter(path: Path) -> Callable[[str], np.ndarray]:
    """``get(name)``: one tensor of the checkpoint in ``path``, read from disk in its stored dtype;
    ``get.names``: every tensor name (for optional tensors such as KV scales)."""
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        weight_map = None
    readers = {f: SafetensorsFile(path / f) for f in files}
    if weight_map is None:
        weight_map = {name: f for f, reader in readers.items() for name in reader.names()}

    def get(name: str) -> np.ndarray:
        if name not in weight_map:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {path}")
        return readers[weight_map[name]].read(name)

    get.names = frozenset(weight_map)
    return get


def load_hf_dir(path: Path, dtype, shardings=None, quantization: str | None = None) -> LoadedModel:
    hf_config = json.loads((path / "config.json").read_text())
    stored = parse_quantization_config(hf_config.get("quantization_config"))
    quantization = resolve_quantization(quantization, stored, path)
    check_platform_supports(quantization)  # before any weight is read
    config = dataclasses.replace(ModelConfig.from_hf(hf_config), quantization=quantization)
    get = _safetensors_getter(path)
    weights = weights_from_hf(config, get, dtype, _shardings_for(shardings, config), stored)
    kv_cache_scales = None
    if stored is not None and stored.has_kv_scales:
        kv_cache_scales = read_kv_cache_scales(lambda name: name in get.names, get, config.num_layers)
    tokenizer = Tokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
    return LoadedModel(config, weights, tokenizer, path, kv_cache_scales=kv_cache_scales)


def load_gguf(path: Path, dtype, shardings=None, quantization: str | None = None) -> LoadedModel:
    from jaxinfer.gguf_loader import read_gguf
    from jaxinfer.gguf_tokenizer import tokenizer_from_gguf

    check_platform_supports(check_quantization(quantization))  # before any weight is read
    # Each tensor is dequantized and cast to ``dtype`` on the host, one at a time (then, with
    # ``quantization``, quantized on the device).
    checkpoint = read_gguf(path, dtype=dtype)
    config = dataclasses.replace(ModelConfig.from_hf(checkpoint.config), quantization=quantization)
    weights = weights_from_hf(config, lambda name: checkpoint.tensors[name], dtype, _shardings_for(shardings, config))
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


def load_model(model: str | Path, dtype: str | None = None, shardings=None,
               quantization: str | None = None) -> LoadedModel:
    """Load a built-in model name, a Hugging Face directory, a GGUF file, or an Orbax checkpoint.

    ``quantization``: ``"fp8"`` or ``"int8"`` quantizes the projections at load (per output
    channel); ``None`` keeps the checkpoint's own (dense, or a pre-quantized FP8 checkpoint's).

    ``shardings``: a ``Weights`` pytree of ``NamedSharding``s, or a function of the ``ModelConfig``
    that returns one (``lambda c: weight_shardings(c, mesh)``). An Orbax checkpoint (written by
    ``jaxinfer convert``) restores each shard straight onto its devices; the other formats load
    each weight onto the default device and move it to its sharding before the next one.
    """
    from jaxinfer.model_registry import resolve_model
    from jaxinfer.orbax_checkpoint import is_orbax_checkpoint, restore

    path = resolve_model(model)
    jdtype = resolve_dtype(dtype)
    if is_orbax_checkpoint(path):
        return restore(path, shardings=shardings, dtype=jdtype, quantization=quantization)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, jdtype, shardings, quantization)
    return load_hf_dir(path, jdtype, shardings, quantization)


def _shardings_for(shardings, config: ModelConfig) -> Weights | None:
    return shardings(config) if callable(shardings) else shardings

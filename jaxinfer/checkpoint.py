"""Loading checkpoints: Hugging Face directories (safetensors), GGUF files and Orbax checkpoints.

Both formats end as Hugging Face-named tensors (``model.layers.0.self_attn.q_proj.weight``,
``[out, in]`` shapes; the names of each family are in ``jaxinfer.architectures``), which
:func:`weights_from_hf` streams, one tensor at a time in the checkpoint's own dtype, into the
model's ``Weights`` on the device.
GGUF files are read and dequantized by ``jaxinfer.gguf_loader``; Orbax checkpoints (converted
once from either) are written and restored, shard by shard, by ``jaxinfer.orbax_checkpoint``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.architectures import hf_tensors
from jaxinfer.config import ModelConfig
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.params import Weights, is_spec, param_specs
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
                    shardings: Weights | None = None) -> Weights:
    """Lay out Hugging Face tensors, fetched one at a time by ``get``, as ``Weights`` on the device.

    ``get(name)`` returns a host array in any dtype (the checkpoint's own: bf16 stays bf16). It is
    copied to the device as it is and dropped before the next tensor is read, then transposed,
    reshaped and cast to ``dtype`` on the device, so the host holds one tensor at a time and
    never a float32 copy of the model. With ``shardings`` (a ``Weights`` pytree of shardings)
    each weight moves to its place as soon as it is made.
    """
    specs, treedef = jax.tree.flatten(param_specs(config), is_leaf=is_spec)
    sources = treedef.flatten_up_to(hf_tensors(config))
    places = [None] * len(specs) if shardings is None else treedef.flatten_up_to(shardings)
    dtype = jnp.dtype(dtype)
    arrays = []
    for spec, source, place in zip(specs, sources, places):
        array = _to_model_layout(jax.device_put(get(source.name)), source.is_out_in, spec.shape, dtype)
        # Once the copy has landed the host array is gone: transfers cannot queue up host memory.
        array.block_until_ready()
        arrays.append(array if place is None else jax.device_put(array, place))
    return jax.tree.unflatten(treedef, arrays)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _to_model_layout(x: jax.Array, is_out_in: bool, shape: tuple[int, ...], dtype) -> jax.Array:
    # [out, in] -> the declared [in, ...out] (e.g. [hq*D, E] -> [E, hq, D]); a bias [hq*D] -> [hq, D].
    return (x.T if is_out_in else x).reshape(shape).astype(dtype)


def _safetensors_getter(path: Path) -> Callable[[str], np.ndarray]:
    """``get(name)``: one tensor of the checkpoint in ``path``, read from disk in its stored dtype."""
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

    return get


def load_hf_dir(path: Path, dtype, shardings=None) -> LoadedModel:
    hf_config = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf(hf_config)
    weights = weights_from_hf(config, _safetensors_getter(path), dtype, _shardings_for(shardings, config))
    tokenizer = Tokenizer.from_hf_dir(path, extra_eos_ids=config.eos_token_ids)
    return LoadedModel(config, weights, tokenizer, path)


def load_gguf(path: Path, dtype, shardings=None) -> LoadedModel:
    from jaxinfer.gguf_loader import read_gguf
    from jaxinfer.gguf_tokenizer import tokenizer_from_gguf

    # Each tensor is dequantized and cast to ``dtype`` on the host, one at a time.
    checkpoint = read_gguf(path, dtype=dtype)
    config = ModelConfig.from_hf(checkpoint.config)
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


def load_model(model: str | Path, dtype: str | None = None, shardings=None) -> LoadedModel:
    """Load a built-in model name, a Hugging Face directory, a GGUF file, or an Orbax checkpoint.

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
        return restore(path, shardings=shardings, dtype=jdtype)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, jdtype, shardings)
    return load_hf_dir(path, jdtype, shardings)


def _shardings_for(shardings, config: ModelConfig) -> Weights | None:
    return shardings(config) if callable(shardings) else shardings

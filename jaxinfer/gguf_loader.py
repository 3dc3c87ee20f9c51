"""Reading a GGUF checkpoint as Hugging Face-named tensors and an HF-style config.

The model code knows one naming and layout: Hugging Face's (`model.layers.N.self_attn.q_proj.weight`,
[out_features, in_features]) and LlamaConfig's config keys. A GGUF file differs in three ways, each
undone here:

1. Names: llama.cpp's (`blk.N.attn_q.weight`), mapped by the architecture's table in
   `jaxinfer.architectures`.
2. Storage: quantized blocks, dequantized with the `gguf` package one tensor at a time, when the
   tensor is asked for, a slice of rows at a time straight into the requested dtype, so the host
   holds one tensor in that dtype (plus one slice in float32), never the model.
3. Q/K rows: for the `llama` architecture llama.cpp's converter permutes the rows of attn_q/attn_k
   so each head's rotary pairs are interleaved (GPT-J style) instead of split in halves (NeoX style,
   which HF uses); `_unpermute_rows` puts them back. Qwen2/Qwen3 are converted without it.

Shapes: ggml lists dimensions innermost first (`ne0` = in_features), and `GGUFReader` exposes the
data already in numpy (row-major, outermost first) order: for a [out, in] weight `tensor.shape` is
[in, out] while the dequantized rows come out as [out, in], which is HF's layout, so no transpose.
"""

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, quants

from jaxinfer.architectures import GGUF_ARCHITECTURES, Architecture, gguf_to_hf_name, known_gguf_names

# llama.cpp stores Llama 3.1-style rope scaling as per-frequency factors, not as config keys.
_ROPE_FREQS = "rope_freqs.weight"

# float32 bytes dequantized at once, per slice of a tensor's rows.
_DEQUANTIZE_SLICE_BYTES = 64 << 20


def supported_tensor_types() -> list[str]:
    """Names of the ggml tensor types the installed `gguf` package can dequantize."""
    # `_type_traits` is the package's own registry of dequantizers; F32/F16 are handled inline.
    traits = getattr(quants, "_type_traits", {})
    return ["F32", "F16", "F64"] + sorted(t.name for t in traits)


@dataclasses.dataclass
class GGUFCheckpoint:
    config: dict[str, Any]
    tensors: "GGUFTensors"
    metadata: dict[str, Any]
    architecture: str


class GGUFTensors(Mapping):
    """HF name -> numpy array, dequantized (and Q/K rows restored) on each access."""

    def __init__(self, reader: GGUFReader, arch: Architecture, config: dict, dtype):
        self._dtype = np.dtype(dtype)
        self._by_hf_name = {}
        for tensor in reader.tensors:
            if tensor.name == _ROPE_FREQS:
                continue
            self._by_hf_name[_hf_name(arch, tensor.name)] = tensor
        # HF name -> head count, for the Q/K tensors whose rows llama.cpp's converter interleaved.
        self._interleaved_heads = {}
        if arch.gguf_qk_rows_interleaved:
            for layer in range(config["num_hidden_layers"]):
                for field, heads in (("q", "num_attention_heads"), ("q_bias", "num_attention_heads"),
                                     ("k", "num_key_value_heads"), ("k_bias", "num_key_value_heads")):
                    name = arch.layer_tensors[field].hf.format(layer=layer)
                    self._interleaved_heads[name] = config[heads]

    def __getitem__(self, name: str) -> np.ndarray:
        array = dequantize(self._by_hf_name[name], self._dtype)
        if name in self._interleaved_heads:
            array = _unpermute_rows(array, self._interleaved_heads[name])
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_hf_name)

    def __len__(self) -> int:
        return len(self._by_hf_name)

    def shape(self, name: str) -> tuple[int, ...]:
        """HF shape of a tensor without dequantizing it."""
        return tuple(int(d) for d in reversed(self._by_hf_name[name].shape.tolist()))

    def ggml_type(self, name: str) -> str:
        return self._by_hf_name[name].tensor_type.name


def read_metadata(path) -> dict[str, Any]:
    """A GGUF file's metadata (key -> plain Python value), without touching its tensors."""
    return _metadata(GGUFReader(str(path)))


def read_gguf(path, dtype=np.float32) -> GGUFCheckpoint:
    """Opens a GGUF file (memory-mapped) and describes it in Hugging Face terms."""
    reader = GGUFReader(str(path))
    metadata = _metadata(reader)
    architecture = metadata.get("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported; "
            f"supported architectures: {', '.join(sorted(GGUF_ARCHITECTURES))}."
        )
    arch = GGUF_ARCHITECTURES[architecture]
    by_name = {t.name: t for t in reader.tensors}
    for tensor in reader.tensors:
        if tensor.name != _ROPE_FREQS:
            _hf_name(arch, tensor.name)  # fail on the first unknown tensor, before any is used
    config = _hf_config(metadata, arch, by_name)
    return GGUFCheckpoint(
        config=config,
        tensors=GGUFTensors(reader, arch, config, dtype),
        metadata=metadata,
        architecture=architecture,
    )


def dequantize(tensor, dtype=np.float32) -> np.ndarray:
    """Array of ``dtype`` in numpy (HF) order from a `GGUFReader` tensor of any supported type.

    Quantized blocks are dequantized to float32 a slice of rows at a time (rows are quantized
    independently) and each slice is cast into the result at once, so a bf16 load of a large
    embedding never holds it whole in float32.
    """
    qtype = tensor.tensor_type
    data = tensor.data
    if qtype in (GGMLQuantizationType.F64, GGMLQuantizationType.F32):
        # Through float32 as the quantized types are; a copy, not a view into the mapped file.
        return np.asarray(data, dtype=np.float32).astype(dtype)
    try:
        if data.ndim < 2:
            return quants.dequantize(data, qtype).astype(dtype)
        first = quants.dequantize(data[:1], qtype)
    except NotImplementedError:
        raise NotImplementedError(
            f"tensor {tensor.name!r} has ggml type {qtype.name}, which the installed gguf package "
            f"cannot dequantize; supported types: {', '.join(supported_tensor_types())}."
        ) from None
    out = np.empty((data.shape[0], *first.shape[1:]), dtype)
    rows = max(1, _DEQUANTIZE_SLICE_BYTES // max(1, first.nbytes))
    for start in range(0, data.shape[0], rows):
        out[start:start + rows] = quants.dequantize(data[start:start + rows], qtype)
    return out


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation.

    Per head, llama.cpp reorders rows [first half | second half] into interleaved pairs
    (reshape to [heads, 2, half, ...] then swap axes 1 and 2); reading the stored rows as
    [heads, half, 2, ...] and swapping back restores the halves.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(arch: Architecture, gguf_name: str) -> str:
    hf_name = gguf_to_hf_name(arch, gguf_name)
    if hf_name is None:
        raise ValueError(
            f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart known to jaxinfer "
            f"(known for {arch.gguf_architecture}: {', '.join(known_gguf_names(arch))})."
        )
    return hf_name


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    # "GGUF.*" fields are the reader's view of the file header, not metadata.
    return {name: _field_value(field) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def _field_value(field) -> Any:
    value = field.contents()
    # float32 metadata (eps, rope theta) read back as e.g. 9.999999747e-06; HF configs say 1e-05.
    if field.types == [GGUFValueType.FLOAT32]:
        value = float(str(np.float32(value)))
    return value


def _hf_config(metadata: dict, arch: Architecture, tensors: dict) -> dict:
    architecture = arch.gguf_architecture

    def key(name, default=None):
        return metadata.get(f"{architecture}.{name}", default)

    hidden_size = key("embedding_length")
    num_heads = key("attention.head_count")
    num_kv_heads = key("attention.head_count_kv", num_heads)
    embedding = tensors["token_embd.weight"]
    # The embedding's row count is authoritative; the token list may be padded or shorter.
    vocab_size = int(embedding.shape[1])
    head_dim = key("attention.key_length", hidden_size // num_heads)
    rope_theta = key("rope.freq_base", 10000.0)
    config = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(metadata, architecture, tensors, head_dim, rope_theta),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(metadata),
        "sliding_window": None,
    }
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if config[k] is None]
    if missing:
        raise ValueError(f"GGUF metadata lacks {architecture}.* keys for: {', '.join(missing)}")
    return config


def _eos_token_ids(metadata: dict) -> int | list[int] | None:
    # Chat models end a turn with eot (Llama 3's <|eot_id|>) or eom; HF lists them all as eos.
    ids = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = metadata.get(f"tokenizer.ggml.{name}")
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return ids[0] if len(ids) == 1 else (ids or None)


def _rope_scaling(metadata, architecture, tensors, head_dim, rope_theta) -> dict | None:
    kind = metadata.get(f"{architecture}.rope.scaling.type")
    factor = metadata.get(f"{architecture}.rope.scaling.factor")
    original = metadata.get(f"{architecture}.rope.scaling.original_context_length")
    if _ROPE_FREQS in tensors:
        rope_dim = metadata.get(f"{architecture}.rope.dimension_count", head_dim)
        return _llama3_rope_scaling(dequantize(tensors[_ROPE_FREQS]), rope_dim, rope_theta)
    if kind in (None, "none") or factor is None:
        return None
    scaling = {"rope_type": kind, "factor": factor}
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _llama3_rope_scaling(freq_factors: np.ndarray, rope_dim: int, theta: float) -> dict:
    """HF's `llama3` rope_scaling recovered from llama.cpp's per-frequency divisors.

    Each divisor is 1 (short wavelengths), `factor` (long ones) or, between the two, a smooth mix
    whose weight s obeys  original_ctx / wavelength = low + s * (high - low).  Only the ratios of
    original_ctx, low and high matter, so low is fixed at 1 and the other two solved by least squares.
    """
    wavelength = 2 * math.pi * theta ** (np.arange(0, rope_dim, 2) / rope_dim)
    factor = float(freq_factors.max())
    middle = (freq_factors > 1 + 1e-6) & (freq_factors < factor - 1e-6)
    if factor <= 1 or middle.sum() < 2:
        raise ValueError("GGUF rope_freqs tensor does not match Llama 3 rope scaling; "
                         "this checkpoint's rope scaling is not supported.")
    smooth = (1 / freq_factors[middle] - 1 / factor) / (1 - 1 / factor)
    # original_ctx * (1 / wavelength) - (high - 1) * s = 1
    a = np.stack([1 / wavelength[middle], -smooth], axis=1)
    (original_ctx, high_minus_low), *_ = np.linalg.lstsq(a, np.ones_like(smooth), rcond=None)
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": round(float(1 + high_minus_low), 4),
        "original_max_position_embeddings": int(round(original_ctx)),
    }
    rebuilt = _llama3_freq_factors(scaling, wavelength)
    if not np.allclose(rebuilt, freq_factors, rtol=1e-3):
        raise ValueError("GGUF rope_freqs tensor could not be expressed as Llama 3 rope scaling.")
    return scaling


def _llama3_freq_factors(scaling: dict, wavelength: np.ndarray) -> np.ndarray:
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - smooth) / factor + smooth)

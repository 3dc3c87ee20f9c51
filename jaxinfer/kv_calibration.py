"""Calibrated FP8 KV-cache scales: one forward over sample text, each layer's largest |K| and |V|.

vLLM's ``--calculate-kv-scales`` takes them from the first batch it serves; here it is an
explicit, offline step, so that the scales are fixed before the engine compiles and every
request is served with the same ones::

    scales = calibrate_kv_scales(model, [tokenizer.encode(text) for text in samples])
    llm = LLM(loaded=dataclasses.replace(model, kv_cache_scales=scales), kv_cache_dtype="fp8")

The forward runs over a cache in the serving dtype (nothing quantized yet), made and dropped
inside the program, as the prompt scorer's; its cost is one prefill of each sample.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache_dtype import kv_scales_from_amax
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.model import hidden_states
from jaxinfer.one_sequence_step import one_sequence_step
from jaxinfer.params import Weights
from jaxinfer.prompt_logprobs import bucket_for


@functools.partial(jax.jit, static_argnames=("config", "page_size", "attention_impl"))
def kv_amax(weights: Weights, token_ids: jax.Array, length: jax.Array, *, config: ModelConfig, page_size: int,
            attention_impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Per-layer largest |K| and |V| (after RoPE and any k-norm, as the cache stores them) of one
    sequence, the first ``length`` of ``token_ids`` [T], from position 0: two [num_layers] float32
    arrays. Tokens past ``length`` are padding (not written), so one program serves every length
    up to T."""
    batch, cache = one_sequence_step(token_ids, length, config, page_size, weights.embed.dtype)
    _, cache = hidden_states(weights, cache, batch, config, attention_impl)
    # Unwritten rows are zero, so the page-wide max is the tokens' max.
    k = jnp.stack([jnp.max(jnp.abs(pages.astype(jnp.float32))) for pages in cache.k])
    v = jnp.stack([jnp.max(jnp.abs(pages.astype(jnp.float32))) for pages in cache.v])
    return k, v


def calibrate_kv_scales(model: LoadedModel, samples: list[list[int]], *, page_size: int = 16,
                        headroom: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer (K, V) scales for ``LoadedModel.kv_cache_scales`` from token-id ``samples``."""
    if not samples or not all(samples):
        raise ValueError("calibrate_kv_scales needs at least one non-empty sample of token ids")
    k_amax = np.zeros(model.config.num_layers, np.float32)
    v_amax = np.zeros(model.config.num_layers, np.float32)
    for ids in samples:
        padded = np.zeros(bucket_for(len(ids)), np.int32)  # one program per power-of-two length
        padded[:len(ids)] = ids
        k, v = jax.device_get(kv_amax(model.weights, padded, np.int32(len(ids)), config=model.config,
                                      page_size=page_size))
        k_amax, v_amax = np.maximum(k_amax, k), np.maximum(v_amax, v)
    return kv_scales_from_amax(k_amax, v_amax, headroom=headroom)

"""Calibrated static FP8 activation scales: the model's own forward over sample text, each
projection input's largest |x|.

A model quantized at load (``quantization="fp8"`` from bf16/f32 weights) has no activation scales
of its own. This runs a few samples teacher-forced through :func:`jaxinfer.model.hidden_states`
with an :class:`~jaxinfer.activation_scales.ActivationObserver` in each FP8 weight's
``input_scale``: :func:`jaxinfer.linear.linear` shows it each projection input and runs the
dynamic path, so the forward is exactly the serving one. Each observer keeps every token's
absmax; a group's scale (q/k/v, o, gate/up, down per layer) is ``margin * percentile / 448`` over
the samples' tokens (``percentile=100``: the largest)::

    scales = calibrate_activation_scales(model, [tokenizer.encode(text) for text in samples])
    llm = LLM(loaded=with_static_input_scales(model, scales))

or ``LLM(model, quantization="fp8", activation_scales="static", calibration_prompts=[...])``.
As with the KV scales (``jaxinfer.kv_calibration``), it is an explicit step before the engine
compiles, so every request is served with the same scales. Inputs past the calibrated range
saturate at +-448 * scale (``jaxinfer.linear.quantize_activations_fp8``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.activation_scales import (INPUT_GROUPS, ActivationObserver, check_activation_scales,
                                        with_static_input_scales, without_static_input_scales)
from jaxinfer.config import ModelConfig
from jaxinfer.errors import RequestError
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.model import hidden_states
from jaxinfer.one_sequence_step import one_sequence_step
from jaxinfer.params import Weights
from jaxinfer.prompt_logprobs import bucket_for
from jaxinfer.quantization import FP8_MAX

# The statistic of the tokens' absmax that becomes the scale, and a factor on it. Measured on
# SmolLM2-135M-Instruct (benchmarks/results/static_activation_scales.md): the largest absmax, as is.
DEFAULT_PERCENTILE = 100.0
DEFAULT_MARGIN = 1.0


@functools.partial(jax.jit, static_argnames=("config", "page_size", "attention_impl"))
def projection_input_absmax(weights: Weights, token_ids: jax.Array, length: jax.Array, *, config: ModelConfig,
                            page_size: int, attention_impl: str = "auto") -> dict[str, jax.Array]:
    """Every token's largest |x| at the input of each projection group (:data:`INPUT_GROUPS`) of
    each layer, for one sequence, the first ``length`` of ``token_ids`` [T], from position 0:
    ``{group: [num_layers, T] float32}``, zero past ``length`` (padding, so one program serves
    every length up to T)."""
    num_tokens = token_ids.shape[0]
    is_token = jnp.arange(num_tokens) < length  # [T]
    seen = {group: [[] for _ in weights.layers] for group in INPUT_GROUPS}

    def observer(group: str, layer: int) -> ActivationObserver:
        def observe(x2):  # [T, K]: traced in this program, kept for it to return
            seen[group][layer].append(jnp.where(is_token, jnp.max(jnp.abs(x2.astype(jnp.float32)), axis=-1), 0.0))
        return ActivationObserver(observe)

    observed = dataclasses.replace(weights, layers=[
        dataclasses.replace(layer, **{name: dataclasses.replace(getattr(layer, name), input_scale=observer(group, i))
                                      for group, names in INPUT_GROUPS.items() for name in names})
        for i, layer in enumerate(weights.layers)])
    batch, cache = one_sequence_step(token_ids, length, config, page_size, weights.embed.dtype)
    hidden_states(observed, cache, batch, config, attention_impl)
    # q, k and v each saw the same input (as gate and up): one row per layer.
    return {group: jnp.stack([functools.reduce(jnp.maximum, per_layer) for per_layer in seen[group]])
            for group in INPUT_GROUPS}


def calibrate_activation_scales(model: LoadedModel, samples: Sequence[Sequence[int]], *,
                                percentile: float = DEFAULT_PERCENTILE, margin: float = DEFAULT_MARGIN,
                                page_size: int = 16) -> dict[str, np.ndarray]:
    """Static activation scales of an FP8 ``model`` from token-id ``samples``: ``{group:
    [num_layers] float32}`` for :func:`~jaxinfer.activation_scales.with_static_input_scales`.

    ``percentile`` of the tokens' absmax (100: the largest seen) times ``margin``, over 448.
    """
    return scales_from_token_absmax(token_absmax(model, samples, page_size=page_size), percentile=percentile,
                                    margin=margin)


def token_absmax(model: LoadedModel, samples: Sequence[Sequence[int]], *,
                 page_size: int = 16) -> dict[str, np.ndarray]:
    """Every sample token's largest |x| at each projection group's input: ``{group: [num_layers,
    total tokens] float32}`` (:func:`projection_input_absmax` over the samples, padding dropped)."""
    if model.config.quantization != "fp8":
        raise RequestError(f"calibrating activation scales needs FP8 weights; the model's are "
                           f"{model.config.quantization or 'not quantized'}", field="quantization")
    if not samples or not all(len(ids) for ids in samples):
        raise RequestError("calibrating activation scales needs at least one non-empty sample of token ids",
                           field="calibration_prompts")
    longest = model.config.max_position_embeddings
    per_token = {group: [] for group in INPUT_GROUPS}  # [num_layers, tokens] arrays per sample
    for ids in samples:
        if len(ids) > longest:
            raise RequestError(f"a calibration sample has {len(ids)} tokens, more than the model's "
                               f"{longest} positions", field="calibration_prompts", limit=longest)
        padded = np.zeros(bucket_for(len(ids)), np.int32)  # one program per power-of-two length
        padded[:len(ids)] = ids
        amax = jax.device_get(projection_input_absmax(model.weights, padded, np.int32(len(ids)),
                                                      config=model.config, page_size=page_size))
        for group in INPUT_GROUPS:
            per_token[group].append(amax[group][:, :len(ids)])
    return {group: np.concatenate(arrays, axis=1) for group, arrays in per_token.items()}


def scales_from_token_absmax(per_token: dict[str, np.ndarray], *, percentile: float = DEFAULT_PERCENTILE,
                             margin: float = DEFAULT_MARGIN) -> dict[str, np.ndarray]:
    """``{group: [num_layers]}`` scales: ``margin`` times the ``percentile`` of each layer's token
    absmax (:func:`token_absmax`), over 448."""
    if not 0 < percentile <= 100 or not margin > 0:
        raise ValueError(f"percentile {percentile} must be in (0, 100] and margin {margin} positive")
    scales = {}
    for group, tokens in per_token.items():
        statistic = np.percentile(tokens, percentile, axis=1) if percentile < 100 else tokens.max(axis=1)
        scales[group] = np.maximum(margin * statistic / FP8_MAX, 1e-12).astype(np.float32)
    return scales


def apply_activation_scales(model: LoadedModel, activation_scales: str | None,
                            calibration_samples: Sequence[Sequence[int]] | None = None) -> LoadedModel:
    """``model`` with the activation scales asked for (``LLM(activation_scales=...)``).

    ``None``: as loaded (a compressed-tensors ``FP8`` checkpoint's static scales, else dynamic);
    ``"dynamic"``: per token, any static scales dropped; ``"static"``: calibrated on
    ``calibration_samples`` when given, else the checkpoint's own, else a ``RequestError``.
    """
    check_activation_scales(activation_scales)
    if activation_scales is None and calibration_samples:
        activation_scales = "static"
    if activation_scales is None:
        return model
    if activation_scales == "dynamic":
        if calibration_samples:
            raise RequestError("calibration_prompts calibrate static activation scales; activation_scales is "
                               "'dynamic'", field="calibration_prompts")
        return without_static_input_scales(model)
    if model.config.quantization != "fp8":
        raise RequestError(f"activation_scales='static' needs FP8 weights (quantization='fp8'); the model's are "
                           f"{model.config.quantization or 'not quantized'}", field="activation_scales")
    if calibration_samples:
        return with_static_input_scales(model, calibrate_activation_scales(model, calibration_samples))
    if model.config.activation_scales == "static":
        return model
    raise RequestError("activation_scales='static' needs scales: load a checkpoint that has them (compressed-tensors "
                       "FP8, input_scale per Linear) or pass calibration_prompts to calibrate them",
                       field="activation_scales")

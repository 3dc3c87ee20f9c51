"""The Llama-family transformer as pure functions over pytrees.

One forward serves prefill and decode alike: it takes a ragged batch of new tokens
(:class:`~jaxinfer.batch.StepBatch`), writes their K/V into the paged cache through the
attention dispatcher, and returns logits at each sequence's last new token. Llama 2/3,
SmolLM2, Mistral and Qwen2/3 differ only by ``ModelConfig`` flags.

Every matmul goes through :func:`~jaxinfer.linear.linear`, which runs float32 weights at full
float32 precision on every platform (``pallas_kernels.precision``), bfloat16 at JAX's default,
and quantized weights (FP8, int8: ``jaxinfer.quantization``) through their own paths.

Shapes: T tokens in the step, B sequence slots, E hidden size, Hq/Hkv query/KV heads,
D head dim, F ffn size, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.attention import paged_attention
from jaxinfer.batch import StepBatch
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import KVCache
from jaxinfer.linear import linear, linear_many
from jaxinfer.params import LayerWeights, Weights
from jaxinfer.quantization import QuantizedWeight
from pallas_kernels.precision import matmul_precision


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back before the weight multiply (as transformers does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


@functools.cache
def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """[D/2] float32 inverse frequencies, with Llama-3.1 scaling when the config asks for it."""
    d = config.head_dim
    inv_freq = (1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))).astype(
        np.float32
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """The step's RoPE factors, made once and shared by every layer: (cos [T, 1, 1, D/2],
    signed sin [T, 1, 2, D/2]) in float32, for :func:`apply_rope`. positions: [T].

    The sin is stored as (-sin, +sin) for the two halves of the head, so that the rotation is a
    multiply-add over x and its halves swapped, with no split or concatenate per layer.
    """
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    cos = jnp.cos(angles)[:, None, None, :]
    sin = jnp.sin(angles)[:, None, None, :]
    return cos, jnp.concatenate([-sin, sin], axis=2)


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face convention) with :func:`rope_tables`' factors. x: [T, H, D].

    With x = (x1, x2) by halves of D: (x1 cos - x2 sin, x2 cos + x1 sin). Written as
    x * cos + swap_halves(x) * (-sin, sin): the same products and sums (x2 * -sin is -(x2 sin)
    exactly, so the result is bit for bit the split form's), but one elementwise expression with
    no slice or concatenate, which XLA fuses like any other (the split form showed up in the
    H200 batch-1 traces as its own ``input_concatenate_fusion`` kernel per layer).
    """
    cos, signed_sin = rope
    t, h, d = x.shape
    halves = x.astype(jnp.float32).reshape(t, h, 2, d // 2)  # [T, H, 2, D/2]
    rotated = halves * cos + jnp.flip(halves, axis=2) * signed_sin
    return rotated.reshape(t, h, d).astype(x.dtype)


def attention_block(
    layer: LayerWeights,
    x: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    batch: StepBatch,
    config: ModelConfig,
    attention_impl: str,
    kv_scales: tuple[jax.Array | None, jax.Array | None] = (None, None),
    rope: tuple[jax.Array, jax.Array] | None = None,
    v_layout: str = "token_major",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's attention: norm, q/k/v, RoPE, paged attention (writing this step's K/V), o.

    ``rope``: :func:`rope_tables` of the step's positions, made once for all layers (None: made here).
    ``v_layout``: how ``v_pages`` is stored (``KVCache.v_layout``).
    """
    h = rms_norm(x, layer.attn_norm, config.rms_norm_eps)  # [T, E]
    # q [T, Hq, D], k and v [T, Hkv, D]; one input, quantized once when it runs FP8 W8A8
    q, k, v = linear_many("te,ehd->thd", h, (layer.q, layer.k, layer.v))
    if config.attention_bias:
        q, k, v = q + layer.q_bias, k + layer.k_bias, v + layer.v_bias
    if config.qk_norm:
        q = rms_norm(q, layer.q_norm, config.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, config.rms_norm_eps)
    rope = rope if rope is not None else rope_tables(batch.positions, rope_inverse_frequencies(config))
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    out, k_pages, v_pages = paged_attention(
        q, k, v, k_pages, v_pages, batch,
        sm_scale=config.head_dim**-0.5, sliding_window=config.sliding_window, impl=attention_impl,
        k_scale=kv_scales[0], v_scale=kv_scales[1], v_layout=v_layout,
    )  # out: [T, Hq, D]
    return output_projection(out, layer.o), k_pages, v_pages


def output_projection(out: jax.Array, o) -> jax.Array:
    """Attention output [T, Hq, D] through the o weight [Hq, D, E] (or quantized [E, Hq, D]) -> [T, E]."""
    if jax.default_backend() == "cpu" and not isinstance(o, QuantizedWeight):
        # jnp.einsum contracts (d, h) in that order, and XLA:CPU transposed the o weight to match
        # on every step: a quarter of a batch-1 decode step of SmolLM2-135M on 2 cores. In the
        # weight's own (h, d) order the dot reads it in place. Other backends keep their program.
        precision = matmul_precision(jnp.result_type(out, o))
        return jax.lax.dot_general(out, o, (((1, 2), (0, 1)), ((), ())), precision=precision)
    return linear("thd,hde->te", out, o)


def mlp_block(layer: LayerWeights, x: jax.Array, config: ModelConfig) -> jax.Array:
    h = rms_norm(x, layer.mlp_norm, config.rms_norm_eps)  # [T, E]
    gate, up = linear_many("te,ef->tf", h, (layer.gate, layer.up))  # [T, F] each
    return linear("tf,fe->te", jax.nn.silu(gate) * up, layer.down)


def hidden_states(
    weights: Weights, cache: KVCache, batch: StepBatch, config: ModelConfig, attention_impl: str = "auto"
) -> tuple[jax.Array, KVCache]:
    """Run every layer over the step's tokens; returns the final-normed hidden states [T, E]."""
    x, _, cache = hidden_states_and_aux(weights, cache, batch, config, attention_impl, ())
    return x, cache


def hidden_states_and_aux(
    weights: Weights, cache: KVCache, batch: StepBatch, config: ModelConfig, attention_impl: str,
    aux_layers: tuple[int, ...],
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """:func:`hidden_states`, and the residual stream entering each layer of ``aux_layers`` (an
    EAGLE-3 head's input, ``jaxinfer.spec_decode.eagle3``), concatenated in that order: [T, len * E];
    None when ``aux_layers`` is empty, whose program is exactly :func:`hidden_states`'s."""
    x = weights.embed[batch.token_ids]  # [T, E]
    aux = {}
    new_k, new_v = [], []
    rope = rope_tables(batch.positions, rope_inverse_frequencies(config))  # once per step, not per layer
    for i, layer in enumerate(weights.layers):
        if i in aux_layers:
            aux[i] = x  # HF's hidden_states[i], vLLM's aux hidden state of layer i
        with jax.named_scope(f"layer_{i}"):
            with jax.named_scope("attention"):
                attn, k_pages, v_pages = attention_block(
                    layer, x, cache.k[i], cache.v[i], batch, config, attention_impl, cache.layer_scales(i), rope,
                    cache.v_layout,
                )
            x = x + attn
            with jax.named_scope("mlp"):
                x = x + mlp_block(layer, x, config)
        new_k.append(k_pages)
        new_v.append(v_pages)
    aux_states = jnp.concatenate([aux[i] for i in aux_layers], axis=-1) if aux_layers else None
    cache = dataclasses.replace(cache, k=new_k, v=new_v)
    return rms_norm(x, weights.final_norm, config.rms_norm_eps), aux_states, cache


def compute_logits(weights: Weights, x: jax.Array) -> jax.Array:
    """float32 logits [N, V] of hidden states x [N, E]; the lm_head is the embedding when tied."""
    if weights.lm_head is None:
        return linear("ne,ve->nv", x, weights.embed, preferred_element_type=jnp.float32)
    return linear("ne,ev->nv", x, weights.lm_head, preferred_element_type=jnp.float32)


def forward(
    weights: Weights, cache: KVCache, batch: StepBatch, config: ModelConfig, attention_impl: str = "auto"
) -> tuple[jax.Array, KVCache]:
    """One step: logits [B, V] (float32) at each sequence's last new token, and the updated cache.

    Jit it with ``config`` and ``attention_impl`` static and the cache donated::

        step = jax.jit(forward, static_argnums=(3, 4), donate_argnums=(1,))
    """
    x, cache = hidden_states(weights, cache, batch, config, attention_impl)
    return compute_logits(weights, x[batch.logits_indices]), cache


def forward_with_aux(
    weights: Weights, cache: KVCache, batch: StepBatch, config: ModelConfig, attention_impl: str,
    aux_layers: tuple[int, ...],
) -> tuple[jax.Array, jax.Array, KVCache]:
    """:func:`forward` that also returns every token's auxiliary hidden states [T, len(aux_layers) * E]
    (:func:`hidden_states_and_aux`): only the programs of an engine with an EAGLE-3 head call it."""
    x, aux, cache = hidden_states_and_aux(weights, cache, batch, config, attention_impl, aux_layers)
    return compute_logits(weights, x[batch.logits_indices]), aux, cache

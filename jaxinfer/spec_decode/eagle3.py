"""The EAGLE-3 draft head as pure functions over a params pytree.

An EAGLE-3 head (Li et al., 2025) drafts from the target's own features. For the token at
position ``i`` the target exposes its residual stream entering three of its layers (low, middle,
high: ``aux_layer_ids``), concatenated ``[3 * E_target]``; the head

1. projects them with ``fc`` to its hidden size ``E``;
2. runs **one** decoder layer whose attention input is ``[norm(embed(token i+1)), norm(hidden)]``
   (``2E`` wide q/k/v projections), at position ``i``, with its own K/V (one layer);
3. normalises and scores a reduced *draft vocabulary* (``lm_head [E, Vd]``); draft id ``j`` is
   target id ``draft_to_target[j]`` (the checkpoints' ``d2t`` offsets added to ``j``).

After the catch-up (every position whose target features are known), each further draft feeds
the head's own pre-norm output back in place of the projected features, with the draft just
made as the next token. So ``k`` drafts cost one catch-up and ``k - 1`` one-row steps of one
layer, all in one jitted program (:func:`draft_round`). Drafts are the argmax: a point mass
``q``, which ``jaxinfer.spec_decode.rejection.verify`` handles exactly for greedy and random
targets alike.

The residual/normalisation order follows vLLM's ``llama_eagle3.py`` and the ``speculators``
library: the layer's residual is the (projected) hidden input, normalised first when
``norm_before_residual``. Loading from a checkpoint: ``jaxinfer.spec_decode.eagle3_checkpoint``.

Shapes: T head positions in the step, B sequence slots, E head hidden size, W = 3 * target hidden
size, Hq/Hkv/D heads and head dim, Vd draft vocabulary, V target vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.attention import paged_attention
from jaxinfer.batch import StepBatch
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import KVCache
from jaxinfer.linear import linear, linear_many
from jaxinfer.model import apply_rope, mlp_block, output_projection, rms_norm, rope_inverse_frequencies, rope_tables
from jaxinfer.params import LayerWeights
from jaxinfer.spec_decode.aux_hidden import gather_aux_hidden
from jaxinfer.spec_decode.draft_model import draft_decode_batch


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """What the head's programs need to know (static under ``jit``).

    ``layer``: the head's decoder layer as a one-layer ``ModelConfig`` (hidden size, heads, RoPE,
    ``vocab_size`` = the draft vocabulary); its q/k/v take ``2 * layer.hidden_size`` inputs.
    """

    layer: ModelConfig
    target_hidden_size: int
    target_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # the target layers whose input features the head reads
    norm_before_residual: bool = False

    @property
    def draft_vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def aux_width(self) -> int:
        return len(self.aux_layer_ids) * self.target_hidden_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3Weights:
    fc: Any  # [W, E]
    hidden_norm: Any  # [E]: normalises the hidden half of the attention input
    layer: LayerWeights  # attn_norm normalises the embedding half; q/k/v are [2E, heads, D]
    final_norm: Any  # [E]
    lm_head: Any  # [E, Vd]
    draft_to_target: Any  # [Vd] int32: the target id of each draft id
    fc_bias: Any = None  # [E] (older speculators checkpoints)
    embed: Any = None  # [V, E]; None: the target's embedding (most checkpoints share it)


def init_random_head(config: Eagle3Config, key: jax.Array, dtype=jnp.bfloat16,
                     with_embed: bool = False) -> Eagle3Weights:
    """Random weights of the head's shapes (fan-in scaled normals, unit norms) and a random draft
    vocabulary: for benchmarks and tests, where only the cost or the plumbing matters."""
    c = config.layer
    e, f, d, hq, hkv = c.hidden_size, c.intermediate_size, c.head_dim, c.num_q_heads, c.num_kv_heads
    keys = iter(jax.random.split(key, 10))

    def normal(*shape, fan_in):
        return (jax.random.normal(next(keys), shape, jnp.float32) / fan_in**0.5).astype(dtype)

    layer = LayerWeights(
        attn_norm=jnp.ones((e,), dtype), q=normal(2 * e, hq, d, fan_in=2 * e), k=normal(2 * e, hkv, d, fan_in=2 * e),
        v=normal(2 * e, hkv, d, fan_in=2 * e), o=normal(hq, d, e, fan_in=hq * d), mlp_norm=jnp.ones((e,), dtype),
        gate=normal(e, f, fan_in=e), up=normal(e, f, fan_in=e), down=normal(f, e, fan_in=f),
    )
    draft_to_target = jnp.sort(jax.random.permutation(next(keys), config.target_vocab_size)[: config.draft_vocab_size])
    return Eagle3Weights(
        fc=normal(config.aux_width, e, fan_in=config.aux_width), hidden_norm=jnp.ones((e,), dtype), layer=layer,
        final_norm=jnp.ones((e,), dtype), lm_head=normal(e, config.draft_vocab_size, fan_in=e),
        draft_to_target=draft_to_target.astype(jnp.int32),
        embed=normal(config.target_vocab_size, e, fan_in=1) if with_embed else None,
    )


def project_features(head: Eagle3Weights, aux: jax.Array) -> jax.Array:
    """The target's concatenated features [T, W] -> the head's hidden input [T, E] (``fc``)."""
    hidden = linear("tw,we->te", aux, head.fc)
    return hidden if head.fc_bias is None else hidden + head.fc_bias


def head_layer(head: Eagle3Weights, cache: KVCache, embeds: jax.Array, hidden: jax.Array, batch: StepBatch,
               config: Eagle3Config, attention_impl: str) -> tuple[jax.Array, jax.Array, KVCache]:
    """The head's decoder layer over ``batch``'s positions: embeds [T, E] of the next tokens, hidden
    [T, E] (projected target features or the head's own output); returns the normed hidden
    states [T, E] (for the lm_head), the pre-norm ones [T, E] (fed back) and the cache."""
    c, layer = config.layer, head.layer
    normed_hidden = rms_norm(hidden, head.hidden_norm, c.rms_norm_eps)
    residual = normed_hidden if config.norm_before_residual else hidden
    x = jnp.concatenate([rms_norm(embeds, layer.attn_norm, c.rms_norm_eps), normed_hidden], axis=-1)  # [T, 2E]
    with jax.named_scope("eagle3_attention"):
        q, k, v = linear_many("te,ehd->thd", x, (layer.q, layer.k, layer.v))  # [T, Hq|Hkv, D]
        if c.attention_bias:
            q, k, v = q + layer.q_bias, k + layer.k_bias, v + layer.v_bias
        rope = rope_tables(batch.positions, rope_inverse_frequencies(c))
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out, k_pages, v_pages = paged_attention(q, k, v, cache.k[0], cache.v[0], batch, sm_scale=c.head_dim**-0.5,
                                                impl=attention_impl)
    residual = residual + output_projection(out, layer.o)
    with jax.named_scope("eagle3_mlp"):
        prenorm = residual + mlp_block(layer, residual, c)
    cache = dataclasses.replace(cache, k=[k_pages], v=[v_pages])
    return rms_norm(prenorm, head.final_norm, c.rms_norm_eps), prenorm, cache


def draft_logits(head: Eagle3Weights, normed: jax.Array) -> jax.Array:
    """float32 logits [N, Vd] over the draft vocabulary."""
    return linear("ne,ev->nv", normed, head.lm_head, preferred_element_type=jnp.float32)


def draft_round(head: Eagle3Weights, cache: KVCache, target_embed: jax.Array, aux_pages: jax.Array, batch: StepBatch,
                *, config: Eagle3Config, attention_impl: str, num_drafts: int) -> tuple[jax.Array, KVCache]:
    """Catch up on ``batch`` then ``num_drafts - 1`` decode steps: target-id drafts [B, num_drafts] and the cache.

    ``batch`` lists head positions: row ``i`` of a sequence is position ``i`` with ``token_ids`` its
    *next* token (``i + 1``), whose target features ``aux_pages`` holds at slot ``i``; each
    sequence's ``logits_indices`` row is its last known position, which drafts the first token.
    """
    embed = target_embed if head.embed is None else head.embed
    hidden = project_features(head, gather_aux_hidden(aux_pages, batch))  # [T, E]
    normed, prenorm, cache = head_layer(head, cache, embed[batch.token_ids], hidden, batch, config, attention_impl)
    token = head.draft_to_target[jnp.argmax(draft_logits(head, normed[batch.logits_indices]), axis=1)]  # [B]
    hidden = prenorm[batch.logits_indices]  # [B, E]
    drafts = [token]
    for i in range(1, num_drafts):
        step = draft_decode_batch(batch, token, i)
        normed, hidden, cache = head_layer(head, cache, embed[token], hidden, step, config, attention_impl)
        token = head.draft_to_target[jnp.argmax(draft_logits(head, normed), axis=1)]
        drafts.append(token)
    return jnp.stack(drafts, axis=1).astype(jnp.int32), cache

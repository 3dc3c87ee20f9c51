"""Prompt logprobs: how likely the model finds each prompt token, given the tokens before it.

This is what scorers (lm-evaluation-harness's loglikelihood, perplexity) need, and vLLM's
``SamplingParams.prompt_logprobs``. The engine's step programs return logits only at each
sequence's last token, and they are compiled once per bucket with a promise of no compilation
after warm-up; widening them to every prompt row would cost every request. So scoring is a
separate, opt-in program: :class:`PromptScorer` runs one causal forward over the whole prompt
(the model's own :func:`~jaxinfer.model.hidden_states`, over a throwaway KV cache made inside
the program, so the engine's cache and pages are never touched), then the lm_head,
``log_softmax`` and top-k in chunks of token rows, so a long prompt never holds
``[T, vocab]`` float32 logits at once.

Cost: one prefill of the prompt (padded to a power-of-two bucket) on the caller's thread,
plus a temporary KV cache of the bucket's length, stored as the engine's is (``kv_cache_dtype``
and its scales), so the logprobs are those of the model the engine serves. Each new bucket compiles once (the first
prompt of that length class waits for it); these programs are not step programs and are not
counted in ``num_compilations_after_warmup``.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.errors import RequestError
from jaxinfer.kv_cache import kv_scale_arrays
from jaxinfer.kv_cache_dtype import page_array_dtype, storage_dtype
from jaxinfer.model import compute_logits, hidden_states
from jaxinfer.one_sequence_step import one_sequence_step
from jaxinfer.params import Weights
from jaxinfer.sampling_params import MAX_TOP_LOGPROBS

DEFAULT_CHUNK_ROWS = 256  # token rows per lm_head + log_softmax chunk: [256, vocab] f32 at a time
MIN_BUCKET = 16

PromptLogprobs = list[dict[int, float] | None]


def bucket_for(num_tokens: int) -> int:
    """The padded length a prompt of ``num_tokens`` is scored at: a power of two >= MIN_BUCKET.

    The chunk size is a power of two too, so a bucket past it is a multiple of it and the rows
    split into whole chunks.
    """
    return max(MIN_BUCKET, 1 << max(0, num_tokens - 1).bit_length())


def score_tokens(
    weights: Weights,
    token_ids: jax.Array,
    kv_scales: tuple[jax.Array, jax.Array] | None = None,
    *,
    config: ModelConfig,
    page_size: int,
    chunk_rows: int,
    num_top: int,
    attention_impl: str,
    kv_dtype=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row i of the padded prompt ``token_ids`` [T]: the logprob of token i+1 after tokens 0..i.

    Returns ``(target_logprobs [T], top_ids [T, num_top], top_logprobs [T, num_top])`` of the raw
    distribution (log_softmax of the float32 logits). The last row's target is padding; so are
    rows past the real prompt (causal attention: padding after the prompt never changes it).
    ``kv_dtype``: the temporary cache's storage dtype (default: the embedding's);
    ``kv_scales``: its per-layer [num_layers] (K, V) scales when that is FP8.
    Pure; jit it with everything but ``weights``, ``token_ids`` and ``kv_scales`` static.
    """
    num_tokens = token_ids.shape[0]
    # As the engine's cache holds it: e4m3 pages on a CPU are uint8 bit patterns (kv_cache_dtype).
    dtype = page_array_dtype(weights.embed.dtype if kv_dtype is None else kv_dtype)
    k_scale, v_scale = (None, None) if kv_scales is None else kv_scales
    batch, cache = one_sequence_step(token_ids, num_tokens, config, page_size, dtype, k_scale, v_scale)
    x, _ = hidden_states(weights, cache, batch, config, attention_impl)  # [T, E]
    targets = jnp.concatenate([token_ids[1:], jnp.zeros((1,), token_ids.dtype)])  # row i predicts token i+1

    rows = min(chunk_rows, num_tokens)
    num_chunks = num_tokens // rows

    def score_chunk(chunk):
        x_chunk, target_chunk = chunk
        logprobs = jax.nn.log_softmax(compute_logits(weights, x_chunk), axis=-1)  # [rows, V] f32, this chunk only
        target = jnp.take_along_axis(logprobs, target_chunk[:, None], axis=-1)[:, 0]
        top_values, top_ids = jax.lax.top_k(logprobs, num_top)
        return target, top_ids.astype(jnp.int32), top_values

    # lax.map runs the chunks one after another (a loop in the program), so only one chunk's
    # [rows, V] logits is live at a time, whatever the prompt's length.
    target, top_ids, top_values = jax.lax.map(
        score_chunk, (x.reshape(num_chunks, rows, -1), targets.reshape(num_chunks, rows))
    )
    return target.reshape(num_tokens), top_ids.reshape(num_tokens, num_top), top_values.reshape(num_tokens, num_top)


class PromptScorer:
    """Scores prompts with a model's weights as they are (on one device or sharded over a mesh).

    ``placement`` is the engine's ``sharding.placement.StepPlacement``: under a tensor-parallel
    mesh the program runs inside its mesh context, so the attention runs per shard of heads
    exactly as in the step programs, and XLA partitions the rest from the weights' shardings.
    """

    def __init__(self, weights: Weights, config: ModelConfig, *, page_size: int, attention_impl: str = "auto",
                 placement=None, chunk_rows: int = DEFAULT_CHUNK_ROWS, kv_cache_dtype: str = "auto",
                 kv_cache_scales: tuple[np.ndarray, np.ndarray] | None = None):
        """``kv_cache_dtype``/``kv_cache_scales``: the engine's (``EngineConfig.kv_cache_dtype``,
        ``LoadedModel.kv_cache_scales``), so scoring reads K/V stored as the engine stores them."""
        if chunk_rows < 1 or chunk_rows & (chunk_rows - 1):
            raise ValueError(f"chunk_rows must be a power of two, got {chunk_rows}")
        self.weights = weights
        self.config = config
        self.chunk_rows = chunk_rows
        self.placement = placement
        kv_dtype = storage_dtype(kv_cache_dtype, weights.embed.dtype)
        self.kv_scales = kv_scale_arrays(config.num_layers, kv_cache_scales)  # host numpy, sent with each call
        # Always the top MAX_TOP_LOGPROBS (sliced on the host): one program per length bucket, not per k.
        # Outputs replicated under a mesh (as the step's sampler outputs), so every process can read them.
        self._score = jax.jit(functools.partial(
            score_tokens, config=config, page_size=page_size, chunk_rows=chunk_rows, num_top=MAX_TOP_LOGPROBS,
            attention_impl=attention_impl, kv_dtype=kv_dtype,
        ), **(placement.jit_kwargs() if placement is not None else {}))
        self.buckets_compiled: set[int] = set()

    def score(self, prompt_token_ids: list[int], num_top: int) -> PromptLogprobs:
        """vLLM's prompt_logprobs: ``None`` for the first token, then ``{token: logprob, **top num_top}``.

        The prompt token comes first in each dict; the top ``num_top`` follow (one may be the
        prompt token itself, then the dict holds ``num_top`` entries, else ``num_top + 1``).
        """
        if not 0 <= num_top <= MAX_TOP_LOGPROBS:
            raise RequestError(f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {num_top}",
                               field="prompt_logprobs", limit=(0, MAX_TOP_LOGPROBS))
        num_tokens = len(prompt_token_ids)
        bucket = bucket_for(num_tokens)
        padded = np.zeros(bucket, np.int32)
        padded[:num_tokens] = prompt_token_ids
        placement = self.placement
        with placement.context() if placement is not None else contextlib.nullcontext():
            tokens = jax.device_put(padded, placement.replicated if placement is not None else None)
            outputs = self._score(self.weights, tokens, self.kv_scales)
        self.buckets_compiled.add(bucket)
        # The whole bucket comes back (T floats + 2 x [T, 20]: small) and is sliced here: slicing
        # on the device would compile a small program per prompt length.
        target, top_ids, top_values = jax.device_get(outputs)
        top_ids, top_values = top_ids[:, :num_top], top_values[:, :num_top]
        target, top_ids, top_values = target.tolist(), top_ids.tolist(), top_values.tolist()
        result: PromptLogprobs = [None]
        for row in range(num_tokens - 1):  # row i scores prompt token i + 1
            entry = {int(prompt_token_ids[row + 1]): target[row]}
            for tid, value in zip(top_ids[row], top_values[row]):
                entry.setdefault(tid, value)
            result.append(entry)
        return result


def prompt_logprob_sum(prompt_logprobs: PromptLogprobs, prompt_token_ids: list[int]) -> float:
    """log P(prompt[1:] | prompt[0]): the sum of each prompt token's logprob (for scorers and tests)."""
    return math.fsum(entry[token] for entry, token in zip(prompt_logprobs[1:], prompt_token_ids[1:]))

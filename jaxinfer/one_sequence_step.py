"""One sequence's step from position 0 over a fresh cache: what prompt scoring and calibration run.

Prompt scoring (``jaxinfer.prompt_logprobs``) and the KV and activation calibrations
(``jaxinfer.kv_calibration``, ``jaxinfer.activation_calibration``) run a whole sequence through the
model outside the engine's paged pool. Each builds the cache inside its own program (XLA frees it
when the program returns), over pages ``1..num_pages`` (page 0 is the kernels' scratch page).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.batch import StepBatch
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import KVCache


def one_sequence_step(token_ids: jax.Array, length: jax.Array | int, config: ModelConfig, page_size: int, dtype,
                      k_scale=None, v_scale=None) -> tuple[StepBatch, KVCache]:
    """The step of the first ``length`` of ``token_ids`` [T] from position 0 (rows past it are
    padding, never written), and a zeroed cache of ``dtype`` pages to run it over.

    ``dtype``: the pages' array dtype (``kv_cache_dtype.page_array_dtype``: e4m3 pages on a CPU are
    uint8); ``k_scale``/``v_scale``: their per-layer scales when FP8. Logits are for the last row.
    """
    num_tokens = token_ids.shape[0]
    num_pages = -(-num_tokens // page_size)
    length = jnp.asarray(length, jnp.int32)
    batch = StepBatch(
        token_ids=token_ids,
        positions=jnp.arange(num_tokens, dtype=jnp.int32),
        cu_q_lens=jnp.stack([jnp.int32(0), length]),
        kv_lens=length[None],
        page_tables=jnp.arange(1, num_pages + 1, dtype=jnp.int32)[None, :],
        logits_indices=jnp.asarray([num_tokens - 1], jnp.int32),
    )
    shape = (config.num_kv_heads, num_pages + 1, page_size, config.head_dim)
    cache = KVCache(k=[jnp.zeros(shape, dtype) for _ in range(config.num_layers)],
                    v=[jnp.zeros(shape, dtype) for _ in range(config.num_layers)], k_scale=k_scale, v_scale=v_scale)
    return batch, cache

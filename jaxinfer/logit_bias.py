"""``logit_bias`` (OpenAI's): a bias in [-100, 100] added to chosen token ids' logits, per request.

On the device each row carries a fixed-width list of (id, bias) pairs, padded with id -1, like
the min_tokens bans (``SamplingTensors.banned_ids``): ``MAX_LOGIT_BIAS_IDS`` pairs per row, so
the "full" sampler program's shapes never change; the engine refuses a request with more. Only
the "full" sampler path reads them (a step whose rows have no bias runs "basic", which carries
zero-width lists). The bias is added to the logits after the penalties, before the bans and
the temperature (vLLM's order), and never to the logprobs, which come from the raw logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import RequestError

# Pairs per row. OpenAI accepts up to 300 entries; 64 keeps the full path's per-step inputs
# small (512 bytes a row) and covers the usual uses (forcing or forbidding a few tokens).
MAX_LOGIT_BIAS_IDS = 64


def check_logit_bias(logit_bias: dict[int, float], vocab_size: int) -> None:
    """A ``RequestError`` unless ``logit_bias`` fits a row and names ids in the vocabulary."""
    if len(logit_bias) > MAX_LOGIT_BIAS_IDS:
        raise RequestError(f"logit_bias has {len(logit_bias)} entries, more than the {MAX_LOGIT_BIAS_IDS} supported",
                           field="logit_bias", limit=MAX_LOGIT_BIAS_IDS)
    if any(t >= vocab_size for t in logit_bias):
        raise RequestError(f"logit_bias token ids must be in [0, {vocab_size})", field="logit_bias", limit=vocab_size)


def fill_logit_bias_row(ids: np.ndarray, values: np.ndarray, row: int, logit_bias: dict[int, float]) -> None:
    """Write ``logit_bias`` into ``row`` of ``ids`` [B, N] / ``values`` [B, N] (the engine checked it fits)."""
    count = len(logit_bias)
    ids[row, :count] = list(logit_bias.keys())
    values[row, :count] = list(logit_bias.values())


def apply_logit_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """``logits`` [B, V] plus ``values`` [B, N] at ``ids`` [B, N]; padding ids (-1) change nothing."""
    num_rows, vocab_size = logits.shape
    safe = jnp.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)  # out of range: dropped
    rows = jnp.arange(num_rows)[:, None]
    return logits.at[rows, safe].add(values.astype(logits.dtype), mode="drop")

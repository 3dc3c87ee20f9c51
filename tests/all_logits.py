"""Logits at every token row of a step, for the tests that compare whole prompts.

The engine needs logits only at each sequence's last new token, so the model has one
``forward`` that computes those (``batch.logits_indices``); the tests pick every row instead.
"""

import dataclasses

import jax.numpy as jnp

from jaxinfer.model import forward


def forward_all_logits(weights, cache, batch, config, attention_impl="auto"):
    """Like :func:`jaxinfer.model.forward`, but float32 logits [T, V] at every token row of ``batch``."""
    every_row = jnp.arange(batch.token_ids.shape[0], dtype=jnp.int32)
    return forward(weights, cache, dataclasses.replace(batch, logits_indices=every_row), config, attention_impl)

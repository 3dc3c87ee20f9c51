"""The packed token bitmask: one bit per vocabulary id, 32 ids per int32 word.

Row ``r`` allows token ``i`` when bit ``i % 32`` of word ``i // 32`` is set (llguidance's
layout, so it fills rows in place). A step's mask is ``[B, ceil(V / 32)]`` int32 for the
sampler's ``B`` rows: ~6 KB a row at V = 49k, 16 KB at 128k, against 4 bytes a token for a
boolean mask. Rows of unconstrained sequences are all ones (-1), which the device turns into
"every id allowed", so they sample exactly as without a mask.

On the device :func:`apply_token_bitmask` unpacks with shifts (no gather, no lookup table)
and sets disallowed logits to -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BITS_PER_WORD = 32
ALL_ALLOWED = -1  # an int32 word with every bit set


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """[num_rows, ceil(V / 32)] int32, every id allowed: unconstrained rows stay like that."""
    return np.full((num_rows, bitmask_width(vocab_size)), ALL_ALLOWED, np.int32)


def ids_below(limit: int, vocab_size: int) -> np.ndarray:
    """[ceil(V / 32)] int32 with the bits of ids < ``limit`` set: ANDed into a constrained row,
    it disallows the padded-vocabulary ids (the model's rows past the tokenizer's)."""
    bits = np.zeros(bitmask_width(vocab_size) * BITS_PER_WORD, np.uint8)
    bits[:limit] = 1
    return np.packbits(bits.reshape(-1, BITS_PER_WORD), axis=1, bitorder="little").view(np.uint32).view(np.int32)[:, 0]


def set_only(bitmask: np.ndarray, row: int, token_ids) -> None:
    """Allow exactly ``token_ids`` in ``row``."""
    bitmask[row] = 0
    for token in token_ids:
        word, bit = divmod(int(token), BITS_PER_WORD)
        bitmask[row, word] |= np.int32(np.uint32(1 << bit).view(np.int32))


def allowed_tokens(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """[B, W] int32 -> [B, V] bool: id ``i`` of row ``b`` is allowed when its bit is set."""
    shifts = jnp.arange(BITS_PER_WORD, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts[None, None, :]) & 1  # [B, W, 32]; arithmetic shift, masked
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] != 0


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """``logits`` [B, V] with every id the mask [B, ceil(V/32)] disallows at -inf."""
    return jnp.where(allowed_tokens(bitmask, logits.shape[1]), logits, -jnp.inf)

"""Prompt lookup on the device: the n-gram proposer of ``ngram.py``, over token histories already there.

A speculating step can only be dispatched before the previous one is read back if its drafts
are made where that step's tokens are: on the device. The runner keeps every sequence's
tokens in ``token_pages`` (``jaxinfer.token_history``), so a jitted program can gather each
slot's history ``[B, L]`` and look its tail up there, with static shapes and no host trip.

The result equals :func:`jaxinfer.spec_decode.ngram.propose_ngram` row by row (a property test
holds them together): for ``n`` from ``max_n`` down to ``min_n`` (and at most ``length - 1``),
the latest earlier occurrence of the last ``n`` tokens, and up to ``room`` tokens that followed
it, never past the history's end.

How the match is found without a loop over positions: write ``t`` for the position where a
window ends. The window ending at ``t`` equals the suffix of length ``n`` when
``history[t - j] == history[length - 1 - j]`` for every ``j < n``. One shifted comparison per
``j`` (``max_n`` of them, each ``[B, L]``) gives every ``n`` at once as a running AND, so the
cost is ``O(max_n * B * L)`` element compares: microseconds beside a decode step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.token_history import gather_history


def propose_ngram_on_device(history: jax.Array, lengths: jax.Array, rooms: jax.Array, *, num_speculative_tokens: int,
                            min_n: int, max_n: int) -> tuple[jax.Array, jax.Array]:
    """Drafts for each row of ``history`` [B, L] (its first ``lengths`` [B] tokens real), at most
    ``rooms`` [B] of them (and ``num_speculative_tokens`` = k).

    Returns ``draft_ids`` [B, k] int32 (0 past each row's count) and ``num_drafts`` [B] int32, as
    ``jaxinfer.spec_decode.layout.expand_to_rows`` lays drafts out for the verifier.
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n ({min_n}) <= max_n ({max_n})")
    num_rows, width = history.shape
    k = num_speculative_tokens
    history = history.astype(jnp.int32)
    lengths = lengths.astype(jnp.int32)
    rows = jnp.arange(num_rows)
    t = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, L]: where a window ends
    # A window must end before the last token (it is an *earlier* occurrence of the suffix).
    ends_before_last = t <= (lengths - 2)[:, None]  # [B, L]

    window_matches = jnp.ones((num_rows, width), bool)  # running AND over j < n
    best_end = jnp.full((num_rows,), -1, jnp.int32)  # window end of the longest n that matched
    for n in range(1, max_n + 1):
        j = n - 1
        suffix_token = history[rows, jnp.maximum(lengths - 1 - j, 0)]  # [B]
        shifted = jnp.pad(history, ((0, 0), (j, 0)), constant_values=-1)[:, :width]  # shifted[b, t] = history[b, t - j]
        window_matches &= shifted == suffix_token[:, None]
        if n < min_n:
            continue
        # n <= length - 1 as the host proposer requires; t >= j keeps the window inside the history.
        valid = window_matches & ends_before_last & (t >= j) & (n <= lengths - 1)[:, None]
        latest = jnp.max(jnp.where(valid, t, -1), axis=1)  # [B]
        best_end = jnp.where(latest >= 0, latest, best_end)  # a longer n, found later in the loop, wins

    start = best_end + 1  # [B]: the first token after the matched window
    available = jnp.where(best_end >= 0, lengths - start, 0)
    num_drafts = jnp.clip(jnp.minimum(available, jnp.minimum(rooms.astype(jnp.int32), k)), 0, k)
    position = jnp.arange(k, dtype=jnp.int32)[None, :]
    index = jnp.clip(start[:, None] + position, 0, width - 1)
    draft_ids = jnp.where(position < num_drafts[:, None], jnp.take_along_axis(history, index, axis=1), 0)
    return draft_ids.astype(jnp.int32), num_drafts.astype(jnp.int32)


def propose_after_verify(token_pages: jax.Array, page_tables: jax.Array, kv_lens: jax.Array, num_drafts: jax.Array,
                         num_accepted: jax.Array, next_token: jax.Array, rooms: jax.Array, *, num_speculative_tokens: int,
                         min_n: int, max_n: int) -> tuple[jax.Array, jax.Array]:
    """The next step's drafts of each slot of a verify step, from what that step left on the device.

    The verify step wrote its inputs ``[last, d_1..d_n]`` (``n`` = ``num_drafts`` [B]) to
    ``token_pages`` through ``page_tables`` [B, P], ``kv_lens`` [B] counting all of them. A slot
    that accepted ``a`` (``num_accepted`` [B]) drafts keeps its first ``kv_lens - n + a`` tokens
    there; ``next_token`` [B] (the token after the run, not yet written: it is the next step's
    input) ends its history. ``rooms`` [B]: drafts each slot may take (max_tokens and
    max_model_len, as ``Speculator.propose`` limits them).

    Returns ``draft_ids`` [B, k] and ``num_drafts`` [B]: what the host proposer would draft for
    the same tokens, without the host ever reading them.
    """
    num_kept = kv_lens - num_drafts + num_accepted  # [B]: tokens in the cache the slot keeps
    history, _ = gather_history(token_pages, page_tables, num_kept, jnp.zeros_like(num_kept))
    history = jnp.concatenate([history, jnp.full((history.shape[0], 1), -1, history.dtype)], axis=1)  # room for next_token
    rows = jnp.arange(history.shape[0])
    lengths = jnp.where(kv_lens > 0, num_kept + 1, 0)  # an empty slot proposes nothing
    history = history.at[rows, jnp.maximum(lengths - 1, 0)].set(jnp.where(kv_lens > 0, next_token, -1))
    return propose_ngram_on_device(history, lengths, rooms, num_speculative_tokens=num_speculative_tokens,
                                   min_n=min_n, max_n=max_n)

"""``bad_words`` (vLLM's): words the output may never contain, banned token sequence by token sequence.

Each word becomes the token ids of the word and of the word after a space (how it reads
mid-text); a sequence ``w[0..n-1]`` is enforced by banning ``w[n-1]`` at every step whose last
``n-1`` generated tokens are ``w[0..n-2]`` (a one-token word is banned always). With async
scheduling the host does not know the last tokens yet (they are still on the device), so the
comparison runs on the device, against the tail of the sequence read from the token pages
(``jaxinfer.token_history``), inside the "full" sampler program.

Layout: ``[B, MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS]`` int32 per step, each sequence
right-aligned (its last token in the last column) and padded with -1 on the left; the engine
refuses a request whose words need more sequences or longer ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import RequestError
from jaxinfer.tokenizer import Tokenizer

MAX_BAD_WORD_SEQUENCES = 16  # per request: two per word (with and without a leading space)
MAX_BAD_WORD_TOKENS = 8  # tokens per banned sequence
NOT_OUTPUT = -2  # a tail slot before the output starts: matches no token id


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """The token sequences to ban for ``words``: each word alone and after a space, deduplicated.

    The spaced form is kept only when it tokenizes to a different first token and as many
    tokens as the bare form (vLLM's rule: otherwise the space became its own token and the
    bare form already covers the word).
    """
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        variants = [bare]
        if bare and spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            variants.append(spaced)
        for ids in variants:
            if ids and ids not in sequences:
                sequences.append(ids)
    return tuple(sequences)


def check_bad_words(sequences: tuple[tuple[int, ...], ...]) -> None:
    """A ``RequestError`` unless the token sequences of a request's bad words fit a row."""
    if len(sequences) > MAX_BAD_WORD_SEQUENCES:
        raise RequestError(f"bad_words needs {len(sequences)} token sequences (each word alone and after a space), "
                           f"more than the {MAX_BAD_WORD_SEQUENCES} supported", field="bad_words",
                           limit=MAX_BAD_WORD_SEQUENCES)
    longest = max((len(ids) for ids in sequences), default=0)
    if longest > MAX_BAD_WORD_TOKENS:
        raise RequestError(f"a bad word is {longest} tokens long, more than the {MAX_BAD_WORD_TOKENS} supported",
                           field="bad_words", limit=MAX_BAD_WORD_TOKENS)


def fill_bad_words_row(array: np.ndarray, row: int, sequences: tuple[tuple[int, ...], ...]) -> None:
    """Write ``sequences`` right-aligned into ``array[row]`` [S, L] (the engine checked they fit)."""
    for i, ids in enumerate(sequences):
        array[row, i, array.shape[2] - len(ids):] = ids


def gather_output_tail(token_pages: jax.Array, page_tables: jax.Array, kv_lens: jax.Array,
                       num_prompt_tokens: jax.Array, length: int) -> jax.Array:
    """[B, length] ids of each row's last ``length`` tokens (this step's input last); ``NOT_OUTPUT``
    where a slot is before the row's first generated token."""
    page_size = token_pages.shape[1]
    offsets = jnp.arange(length, dtype=jnp.int32)[None, :] - length  # [1, length]: -length .. -1
    positions = kv_lens[:, None] + offsets  # [B, length]
    safe = jnp.maximum(positions, 0)
    pages = jnp.take_along_axis(page_tables, safe // page_size, axis=1)
    tail = token_pages[pages, safe % page_size]
    return jnp.where(positions >= num_prompt_tokens[:, None], tail, NOT_OUTPUT)


def bad_word_bans(sequences: jax.Array, tail: jax.Array, vocab_size: int) -> jax.Array:
    """[B, V] bool: the last token of every ``sequences`` [B, S, L] entry whose prefix ends the
    row's ``tail`` [B, L-1]."""
    prefix, last = sequences[:, :, :-1], sequences[:, :, -1]  # [B, S, L-1], [B, S]
    matches = jnp.all((prefix < 0) | (prefix == tail[:, None, :]), axis=2) & (last >= 0)  # [B, S]
    banned_ids = jnp.where(matches, last, vocab_size)  # not matching: dropped
    rows = jnp.arange(sequences.shape[0])[:, None]
    return jnp.zeros((sequences.shape[0], vocab_size), bool).at[rows, banned_ids].set(True, mode="drop")

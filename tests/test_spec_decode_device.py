"""The device n-gram proposer (``jaxinfer.spec_decode.device_ngram``) against the host's, on random histories.

Small vocabularies make repeats (and so matches of every length) common; random lengths and
rooms cover empty and one-token histories, rooms of zero, and matches whose continuation runs
into the history's end. Each case is one jitted call over many rows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.spec_decode.device_ngram import propose_ngram_on_device
from jaxinfer.spec_decode.ngram import propose_ngram
from jaxinfer.token_history import gather_history


def host_drafts(history, lengths, rooms, min_n, max_n):
    return [propose_ngram(np.asarray(row[:length], np.int32), int(room), min_n, max_n)
            for row, length, room in zip(history, lengths, rooms)]


def device_drafts(history, lengths, rooms, k, min_n, max_n):
    propose = jax.jit(functools.partial(propose_ngram_on_device, num_speculative_tokens=k, min_n=min_n, max_n=max_n))
    draft_ids, num_drafts = propose(jnp.asarray(history), jnp.asarray(lengths), jnp.asarray(rooms))
    draft_ids, num_drafts = np.asarray(draft_ids), np.asarray(num_drafts)
    assert np.all(draft_ids[np.arange(k)[None, :] >= num_drafts[:, None]] == 0)  # padding is zero
    return [draft_ids[b, : num_drafts[b]].tolist() for b in range(len(num_drafts))]


@pytest.mark.parametrize("k, min_n, max_n, vocab", [(3, 1, 3, 3), (5, 2, 4, 4), (4, 1, 1, 6), (8, 3, 5, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_device_ngram_equals_host_proposer_on_random_histories(k, min_n, max_n, vocab, seed):
    rng = np.random.default_rng(seed)
    num_rows, width = 512, 40
    history = rng.integers(0, vocab, size=(num_rows, width)).astype(np.int32)
    lengths = rng.integers(0, width + 1, size=num_rows).astype(np.int32)
    # Past a row's length the history holds garbage, as token pages do past a sequence's tokens.
    history[np.arange(width)[None, :] >= lengths[:, None]] = rng.integers(0, vocab)
    rooms = rng.integers(0, k + 1, size=num_rows).astype(np.int32)
    expected = host_drafts(history, lengths, rooms, min_n, max_n)
    assert sum(map(bool, expected)) > num_rows // 4  # the case exercises matches, not only misses
    assert device_drafts(history, lengths, rooms, k, min_n, max_n) == expected


def test_device_ngram_hand_checked_cases():
    k = 4
    rows = [([1, 2, 3, 4, 5, 1, 2, 3], 4),  # the latest "1 2 3" -> 4 5 1 2
            ([1, 2, 3, 4, 5, 1, 2, 3], 9),  # room past k: k tokens
            ([4, 8, 4], 2),  # only "4" repeats: 8 4 (never past the end)
            ([7, 7, 7, 7], 4),  # the latest earlier "7 7 7" ends one before the last: one token follows
            ([1, 2, 3], 4),  # nothing repeats
            ([5], 4), ([], 4)]
    width = 10
    history = np.full((len(rows), width), -1, np.int32)
    for b, (tokens, _) in enumerate(rows):
        history[b, : len(tokens)] = tokens
    lengths = np.array([len(tokens) for tokens, _ in rows], np.int32)
    rooms = np.array([room for _, room in rows], np.int32)
    got = device_drafts(history, lengths, rooms, k, 1, 3)
    assert got == [[4, 5, 1, 2], [4, 5, 1, 2], [8, 4], [7], [], [], []]
    assert got == host_drafts(history, lengths, np.minimum(rooms, k), 1, 3)


def test_device_ngram_reads_histories_from_token_pages():
    """Through ``gather_history``, as a runner program would: pages shared and out of order."""
    page_size, k = 4, 3
    tokens = [[9, 1, 2, 3, 9, 1, 2], [5, 6, 5, 6, 5]]
    page_tables = np.array([[3, 0], [1, 2]], np.int32)
    token_pages = np.full((4, page_size), -1, np.int32)
    for b, seq in enumerate(tokens):
        for position, token in enumerate(seq):
            token_pages[page_tables[b, position // page_size], position % page_size] = token
    lengths = np.array([len(seq) for seq in tokens], np.int32)
    history, _ = gather_history(jnp.asarray(token_pages), jnp.asarray(page_tables), jnp.asarray(lengths),
                                jnp.zeros(2, jnp.int32))
    draft_ids, num_drafts = propose_ngram_on_device(history, jnp.asarray(lengths), jnp.full(2, k), num_speculative_tokens=k,
                                                    min_n=1, max_n=4)
    got = [np.asarray(draft_ids)[b, : int(num_drafts[b])].tolist() for b in range(2)]
    assert got == [[3, 9, 1], [6, 5]] == host_drafts([np.array(seq) for seq in tokens], lengths, [k, k], 1, 4)


def test_device_ngram_rejects_bad_lookup_range():
    with pytest.raises(ValueError, match="min_n"):
        propose_ngram_on_device(jnp.zeros((1, 4), jnp.int32), jnp.ones(1, jnp.int32), jnp.ones(1, jnp.int32),
                                num_speculative_tokens=2, min_n=3, max_n=2)


def test_proposals_after_a_verify_step_continue_the_kept_tokens():
    """A verify step's inputs written to token pages as the runner writes them; each slot keeps its
    accepted drafts and the token after them, and the device drafts from exactly those tokens."""
    from jaxinfer.batch import build_step_batch
    from jaxinfer.sampling import SamplingTensors
    from jaxinfer.spec_decode.device_ngram import propose_after_verify
    from jaxinfer.spec_decode.layout import expand_to_rows
    from jaxinfer.token_history import write_tokens

    page_size, k, num_pages = 4, 3, 16
    rng = np.random.default_rng(3)
    contexts = [rng.integers(0, 3, size=n).tolist() for n in (9, 14, 5)]  # tokens before this step, last = input
    drafts = [(1, 2, 0), (2,), ()]
    page_tables = [[3, 7, 1, 12], [0, 5, 9, 2, 14], [11, 6, 8]]
    token_pages = np.full((num_pages, page_size), -1, np.int32)
    for context, table in zip(contexts, page_tables):
        for position, token in enumerate(context[:-1]):  # computed by earlier steps
            token_pages[table[position // page_size], position % page_size] = token
    chunks = [([context[-1], *d], len(context) - 1, table) for context, d, table in zip(contexts, drafts, page_tables)]
    batch = build_step_batch(chunks, num_tokens=16, num_seqs=4, pages_per_seq=5)
    batch, _, _, num_drafts = expand_to_rows(batch, SamplingTensors.neutral(4, 0, 16), list(drafts), k)
    token_pages = write_tokens(jnp.asarray(token_pages), jnp.asarray(batch.token_ids), batch)

    num_accepted = np.array([2, 0, 0, 0], np.int32)  # slot 0 keeps d_1 d_2, slot 1 rejects its draft
    next_token = np.array([1, 0, 2, 0], np.int32)
    rooms = np.array([3, 2, 3, 3], np.int32)
    draft_ids, counts = propose_after_verify(
        token_pages, jnp.asarray(batch.page_tables), jnp.asarray(batch.kv_lens), jnp.asarray(num_drafts),
        jnp.asarray(num_accepted), jnp.asarray(next_token), jnp.asarray(rooms), num_speculative_tokens=k, min_n=1,
        max_n=3)
    draft_ids, counts = np.asarray(draft_ids), np.asarray(counts)
    for slot, (context, d) in enumerate(zip(contexts, drafts)):
        kept = [*context, *d[: num_accepted[slot]], int(next_token[slot])]
        assert draft_ids[slot, : counts[slot]].tolist() == propose_ngram(np.array(kept), int(rooms[slot]), 1, 3)
    assert counts[3] == 0  # the empty slot
    assert counts[:3].sum() > 0

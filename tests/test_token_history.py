"""Token pages: the device-side history the penalties read equals the host's token lists."""

import jax.numpy as jnp
import numpy as np

from jaxinfer.batch import build_step_batch
from jaxinfer.token_history import gather_history, write_tokens

PAGE_SIZE = 4


def test_histories_follow_page_tables_across_chunked_steps():
    rng = np.random.default_rng(0)
    token_pages = jnp.full((16, PAGE_SIZE), -1, jnp.int32)
    # Two sequences on scattered pages; sequence 1 shares sequence 0's first (full) page.
    tables = [[3, 7, 1], [3, 9, 12]]
    prompts = [rng.integers(0, 100, 9).tolist(), None]
    prompts[1] = prompts[0][:4] + rng.integers(0, 100, 3).tolist()
    history = [[], prompts[1][:4]]  # sequence 1's first page is cached: computed by sequence 0
    steps = [
        [(prompts[0][:6], 0, tables[0])],  # a prefill chunk
        [(prompts[0][6:], 6, tables[0]), (prompts[1][4:], 4, tables[1])],  # the rest, and a cache hit
        [([42], 9, tables[0]), ([17], 7, tables[1])],  # decodes
        [([5], 10, tables[0]), ([8], 8, tables[1])],
    ]
    for chunks in steps:
        batch = build_step_batch(chunks, num_tokens=16, num_seqs=4, pages_per_seq=3)
        batch = type(batch)(*(jnp.asarray(x) for x in (batch.token_ids, batch.positions, batch.cu_q_lens,
                                                        batch.kv_lens, batch.page_tables, batch.logits_indices)))
        token_pages = write_tokens(token_pages, batch.token_ids, batch)
        for b, (tokens, _, _) in enumerate(chunks):
            seq = 0 if chunks[b][2] is tables[0] else 1
            history[seq] = history[seq] + list(tokens)
        num_prompt = jnp.asarray([9, 7, 0, 0], jnp.int32)
        ids, is_output = gather_history(token_pages, batch.page_tables, batch.kv_lens, num_prompt)
        for b, (_, _, table) in enumerate(chunks):
            seq = 0 if table is tables[0] else 1
            expected = history[seq]
            row = np.asarray(ids[b])
            assert row[: len(expected)].tolist() == expected
            assert (row[len(expected):] == -1).all()
            outputs = np.asarray(is_output[b])
            assert outputs.tolist() == [num_prompt[b] <= i < len(expected) for i in range(row.size)]
        assert (np.asarray(ids[len(chunks):]) == -1).all()  # padded slots: no history

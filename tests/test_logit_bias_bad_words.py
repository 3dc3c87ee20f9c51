"""logit_bias and bad_words (jaxinfer.logit_bias, jaxinfer.bad_words): the device functions on
hand-made arrays, then through the engine on the tiny fixture."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.bad_words import (
    MAX_BAD_WORD_TOKENS, NOT_OUTPUT, bad_word_bans, bad_words_token_ids, fill_bad_words_row, gather_output_tail,
)
from jaxinfer.checkpoint import load_model
from jaxinfer.errors import RequestError
from jaxinfer.logit_bias import MAX_LOGIT_BIAS_IDS, apply_logit_bias

from .conftest import FIXTURES


@pytest.fixture(scope="module")
def tiny():
    return load_model(FIXTURES / "tiny-llama3", dtype="float32")


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(loaded=tiny, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_pages=96,
             page_size=16, use_tqdm=False, max_wait_s=0.0) as llm:
        yield llm


def contains(tokens, sub):
    return any(tuple(tokens[i:i + len(sub)]) == tuple(sub) for i in range(len(tokens) - len(sub) + 1))


def test_apply_logit_bias_adds_at_listed_ids_only():
    logits = jnp.zeros((2, 10))
    ids = jnp.array([[3, 7, -1], [-1, -1, -1]], jnp.int32)
    values = jnp.array([[5.0, -2.5, 9.0], [1.0, 1.0, 1.0]])
    out = np.asarray(apply_logit_bias(logits, ids, values))
    expected = np.zeros((2, 10), np.float32)
    expected[0, 3], expected[0, 7] = 5.0, -2.5
    np.testing.assert_array_equal(out, expected)


def test_bad_word_bans_follow_the_generated_tail():
    sequences = np.full((2, 3, 4), -1, np.int32)
    fill_bad_words_row(sequences, 0, ((9,), (4, 5), (1, 2, 3)))
    fill_bad_words_row(sequences, 1, ((4, 5),))
    tail = np.array([[7, 1, 2], [NOT_OUTPUT, NOT_OUTPUT, 4]], np.int32)  # row 0 ends in 1 2; row 1 in 4
    bans = np.asarray(bad_word_bans(jnp.asarray(sequences), jnp.asarray(tail), 12))
    assert np.flatnonzero(bans[0]).tolist() == [3, 9]  # (1, 2, 3) completes, 9 always; (4, 5) does not
    assert np.flatnonzero(bans[1]).tolist() == [5]


def test_output_tail_reads_the_token_pages_through_the_page_table():
    token_pages = jnp.arange(40, dtype=jnp.int32).reshape(10, 4)  # page p slot s holds 4p + s
    page_tables = jnp.array([[2, 5, 7], [1, 0, 0]], jnp.int32)
    kv_lens = jnp.array([6, 2], jnp.int32)  # row 0: positions 0..5 -> pages 2, 5; row 1: page 1
    num_prompt = jnp.array([3, 1], jnp.int32)
    tail = np.asarray(gather_output_tail(token_pages, page_tables, kv_lens, num_prompt, 4))
    assert tail[0].tolist() == [NOT_OUTPUT, 11, 20, 21]  # positions 2 (prompt), 3, 4, 5
    assert tail[1].tolist() == [NOT_OUTPUT, NOT_OUTPUT, NOT_OUTPUT, 5]


def test_logit_bias_plus_100_forces_and_minus_100_forbids(llm):
    prompts = [[5, 6, 7], [100, 200, 300, 400]]
    base = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    forced = llm.generate(prompts, SamplingParams(**{**base.__dict__, "logit_bias": {"77": 100}}), use_tqdm=False)
    assert all(o.outputs[0].token_ids == [77] * 12 for o in forced)
    free = llm.generate(prompts, base, use_tqdm=False)
    seen = sorted({t for o in free for t in o.outputs[0].token_ids})[:MAX_LOGIT_BIAS_IDS]
    banned = llm.generate(prompts, SamplingParams(**{**base.__dict__, "logit_bias": {t: -100 for t in seen}}),
                          use_tqdm=False)
    assert not set(seen) & {t for o in banned for t in o.outputs[0].token_ids}
    assert llm.engine.stats()["num_compilations_after_warmup"] == 0


def test_bad_words_never_appear(llm, tiny):
    prompts = [[i, 2 * i + 1, 3] for i in range(1, 7)]
    base = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, base, use_tqdm=False)]
    # Words the free run produces: the text of some of its two- and one-token spans.
    words = sorted({tiny.tokenizer.decode(ids[2:4]).strip() for ids in free} - {""})[:4]
    sequences = bad_words_token_ids(words, tiny.tokenizer)
    assert sequences and any(contains(ids, s) for ids in free for s in sequences)
    params = SamplingParams(**{**base.__dict__, "bad_words": words})
    for temperature in (0.0, 1.0):
        outputs = llm.generate(prompts, SamplingParams(**{**params.__dict__, "temperature": temperature}),
                               use_tqdm=False)
        for output in outputs:
            assert not any(contains(output.outputs[0].token_ids, s) for s in sequences), output.outputs[0].token_ids


def test_widths_are_checked_at_the_edge(llm):
    with pytest.raises(RequestError) as error:
        llm.engine.validate([1, 2], SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_IDS + 1)}))
    assert (error.value.field, error.value.limit) == ("logit_bias", MAX_LOGIT_BIAS_IDS)
    with pytest.raises(RequestError, match=r"in \[0, 512\)"):
        llm.engine.validate([1, 2], SamplingParams(logit_bias={512: 1.0}))
    with pytest.raises(RequestError) as error:
        llm.engine.validate([1, 2], SamplingParams(bad_words=["x" * 40 + "q z j"]))
    assert (error.value.field, error.value.limit) == ("bad_words", MAX_BAD_WORD_TOKENS)

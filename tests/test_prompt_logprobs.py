"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``, OpenAI's legacy echo + logprobs).

The scorer is checked against ``log_softmax`` of the model's logits at every row of the whole
prompt (``tests/all_logits.py``); the engine, ``LLM`` and the server (through the official ``openai`` client)
are checked to return what the scorer computes, in their formats, without changing generation.
All on the tiny Llama-3 fixture in float32, on CPU.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import requests

from jaxinfer import LLM, SamplingParams
from jaxinfer.batch import build_step_batch
from jaxinfer.checkpoint import load_model
from jaxinfer.kv_cache import create_kv_cache
from jaxinfer.prompt_logprobs import PromptScorer, bucket_for, prompt_logprob_sum

from .all_logits import forward_all_logits
from .conftest import FIXTURES
from .fake_engine import FakeEngine, RunningServer
from .subprocess_report import read_report, report_line

VOCAB = 512
PAGE_SIZE = 16
PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def tiny():
    return load_model(FIXTURES / "tiny-llama3", dtype="float32")


@pytest.fixture(scope="module")
def scorer(tiny):
    # 16-row chunks, so short prompts already cross chunk boundaries (the engine's default is 256).
    # The engine's attention ("auto"), so that its prompt logprobs can be compared exactly.
    return PromptScorer(tiny.weights, tiny.config, page_size=PAGE_SIZE, attention_impl="auto", chunk_rows=16)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(loaded=tiny, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, num_pages=96,
               page_size=PAGE_SIZE, use_tqdm=False, max_wait_s=0.0)


def oracle_logprobs(tiny, ids: list[int]) -> np.ndarray:
    """[len(ids), V] log_softmax of the logits at every row: one plain forward over the prompt."""
    # Padded to the scorer's bucket so that XLA's matmuls see the same shapes (float32 sums in
    # another order differ by ~1e-5); the padding rows come after the prompt and never reach it.
    # The scorer's attention ("auto") for the same reason.
    num_tokens = bucket_for(len(ids))
    num_pages = num_tokens // PAGE_SIZE
    cache = create_kv_cache(tiny.config, num_pages + 1, PAGE_SIZE, jnp.float32)
    batch = build_step_batch([(ids, 0, list(range(1, num_pages + 1)))], num_tokens=num_tokens,
                             num_seqs=1, pages_per_seq=num_pages)
    logits, _ = jax.jit(forward_all_logits, static_argnums=(3, 4))(
        tiny.weights, cache, jax.tree.map(jnp.asarray, batch), tiny.config, "auto")
    return np.asarray(jax.nn.log_softmax(np.asarray(logits)[: len(ids)], axis=-1))


def assert_matches_oracle(result, ids, oracle, k):
    assert len(result) == len(ids) and result[0] is None
    for j in range(1, len(ids)):
        entry, row = result[j], oracle[j - 1]  # row j-1 predicts token j
        assert next(iter(entry)) == ids[j]  # the prompt token first, as vLLM
        top = np.argsort(-row, kind="stable")[:k].tolist()
        assert set(entry) == set(top) | {ids[j]}
        for token, value in entry.items():
            assert value == pytest.approx(float(row[token]), abs=1e-5)


# 1 (nothing to score), 15/16/17 and 32/33 (bucket edges, and 16-row chunk edges), 100 (8 chunks).
@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 32, 33, 100])
def test_scorer_equals_log_softmax_of_a_full_forward(tiny, scorer, length):
    ids = np.random.default_rng(length).integers(0, VOCAB, size=length).tolist()
    result = scorer.score(ids, 4)
    assert_matches_oracle(result, ids, oracle_logprobs(tiny, ids), 4)
    assert bucket_for(length) in scorer.buckets_compiled


def test_default_chunk_size_across_a_chunk_boundary(tiny, llm):
    # 300 tokens: bucket 512, two chunks of the engine's default 256 rows.
    ids = np.random.default_rng(300).integers(0, VOCAB, size=300).tolist()
    result = llm.engine.score_prompt(ids, 2)
    assert_matches_oracle(result, ids, oracle_logprobs(tiny, ids), 2)
    assert result[1:] == llm.engine.prompt_scorer.score(ids, 2)[1:]
    with pytest.raises(ValueError, match="prompt_logprobs must be between"):
        llm.engine.score_prompt(ids, 21)


def test_sampling_params_validate_prompt_logprobs():
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="^prompt_logprobs must be between 0 and 20"):
            SamplingParams(prompt_logprobs=bad)


def test_generation_is_unchanged_and_prompt_logprobs_are_attached(tiny, llm, scorer):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 40, 70)]
    base = dict(max_tokens=6, logprobs=3, ignore_eos=True, seed=5)
    for temperature in (0.0, 0.8):
        plain = llm.generate(prompts, SamplingParams(temperature=temperature, **base), use_tqdm=False)
        scored = llm.generate(prompts, SamplingParams(temperature=temperature, prompt_logprobs=2, **base),
                              use_tqdm=False)
        for prompt, a, b in zip(prompts, plain, scored):
            assert a.prompt_logprobs is None
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
            # Not bit-equal: the second run finds the prompts' pages in the prefix cache, so its
            # prefill is computed in other chunks (float32 sums in another order, ~1e-6).
            for entry_a, entry_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
                assert list(entry_b) == list(entry_a)
                assert list(entry_b.values()) == pytest.approx(list(entry_a.values()), abs=1e-5)
            assert b.prompt_logprobs == scorer.score(prompt, 2)
    stats = llm.engine.stats()
    assert stats["num_compilations_after_warmup"] == 0  # the scorer is its own program...
    # ...compiled once per prompt-length bucket used (5 -> 16, 40 -> 64, 70 -> 128), and counted.
    assert stats["num_prompt_scoring_programs"] == len(llm.engine.prompt_scorer.buckets_compiled) >= 3


def test_llm_generate_returns_prompt_logprobs_in_vllm_format(tiny, llm):
    out = llm.generate(PROMPT, SamplingParams(prompt_logprobs=2, max_tokens=3), use_tqdm=False)[0]
    ids = llm.tokenizer.encode(PROMPT)
    assert out.prompt_token_ids == ids and len(out.outputs[0].token_ids) == 3
    assert_matches_oracle(out.prompt_logprobs, ids, oracle_logprobs(tiny, ids), 2)
    streamed = list(llm.stream(ids, SamplingParams(prompt_logprobs=0, max_tokens=2)))
    assert all(o.prompt_logprobs == [None] + [{t: e[t]} for t, e in zip(ids[1:], out.prompt_logprobs[1:])]
               for o in streamed)


# ---------------------------------------------------------------- the server, real tiny model


@pytest.fixture(scope="module")
def server(llm):
    with RunningServer(llm.engine) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def check_echo_logprobs(tokenizer, text: str, lp, prompt_ids: list[int], num_generated: int, k: int):
    """OpenAI's legacy format with echo: prompt tokens then generated ones, the first entry null."""
    n = len(prompt_ids) + num_generated
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert lp.tokens[: len(prompt_ids)] == [tokenizer.decode([t], skip_special_tokens=False) for t in prompt_ids]
    assert all(k <= len(top) <= k + 1 for top in lp.top_logprobs[1:])
    # text_offset counts from the start of the echoed text; BOS, which the echo leaves out, takes no width.
    for offset, token_id in zip(lp.text_offset, prompt_ids):
        piece = tokenizer.decode([token_id])
        assert text[offset: offset + len(piece)] == piece
    if num_generated:
        assert lp.text_offset[len(prompt_ids)] == len(PROMPT)  # generated text follows the prompt's


def test_server_echo_with_logprobs(client, server, scorer):
    tok = server.engine.tokenizer
    ids = tok.encode(PROMPT)
    r = client.completions.create(model=server.model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                  temperature=0)
    choice = r.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    check_echo_logprobs(tok, choice.text, choice.logprobs, ids, 3, 2)
    expected = scorer.score(ids, 2)
    assert sum(choice.logprobs.token_logprobs[1: len(ids)]) == pytest.approx(prompt_logprob_sum(expected, ids),
                                                                            abs=1e-4)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3
    # The stream carries the same logprobs, the prompt's in its first chunk.
    tokens, token_logprobs, offsets, text = [], [], [], ""
    for chunk in client.completions.create(model=server.model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                token_logprobs += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert (text, tokens) == (choice.text, choice.logprobs.tokens)
    # The prompt's offsets agree; a stream's later offsets count the text sent so far, which holds
    # back a character split over tokens (its pieces decode to U+FFFD alone), so they may not.
    assert offsets[: len(ids) + 1] == choice.logprobs.text_offset[: len(ids) + 1]
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-6)


def test_server_scores_a_prompt_with_max_tokens_zero(client, server, scorer):
    tok = server.engine.tokenizer
    ids = tok.encode(PROMPT)
    r = client.completions.create(model=server.model, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 0, len(ids))
    check_echo_logprobs(tok, choice.text, choice.logprobs, ids, 0, 1)
    expected = scorer.score(ids, 1)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([e[t] for e, t in zip(expected[1:], ids[1:])], abs=1e-5)
    # lm-eval's loglikelihood request: token ids, several prompts, greedy check on top_logprobs.
    prompts = [ids[1:], ids[2:5]]
    r = client.completions.create(model=server.model, prompt=prompts, echo=True, max_tokens=0, logprobs=1)
    for choice, prompt in zip(r.choices, prompts):
        assert len(choice.logprobs.token_logprobs) == len(prompt)
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            [e[t] for e, t in zip(scorer.score(prompt, 1)[1:], prompt[1:])], abs=1e-5)
    # vLLM's prompt_logprobs field, whole and streamed; max_tokens 0 needs echo.
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2,
                                  extra_body={"prompt_logprobs": 1})
    vllm = r.choices[0].model_extra["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    assert vllm[1][str(ids[1])]["logprob"] == pytest.approx(expected[1][ids[1]], abs=1e-5)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=0, logprobs=1)
    assert e.value.body["param"] == "max_tokens"
    assert server.engine.stats()["num_compilations_after_warmup"] == 0


def test_fake_engine_serves_echo_logprobs():
    with RunningServer(FakeEngine(max_model_len=64)) as s:
        url = s.base_url + "/v1/completions"
        body = {"model": s.model, "prompt": "the cat sat", "echo": True, "logprobs": 1}
        r = requests.post(url, json={**body, "max_tokens": 2}, timeout=30).json()["choices"][0]["logprobs"]
        num_prompt = len(s.engine.tokenizer.encode("the cat sat"))
        assert r["token_logprobs"][0] is None
        assert r["token_logprobs"][1:] == pytest.approx([-0.05 * j for j in range(1, num_prompt)] + [-0.1, -0.2])
        r = requests.post(url, json={**body, "max_tokens": 0, "stream": True}, timeout=30)
        assert r.status_code == 200 and '"finish_reason": "length"' in r.text and "[DONE]" in r.text


# ---------------------------------------------------------------- sharded weights


def test_tensor_parallel_scores_match_one_device():
    # 8 host devices need a fresh process (XLA reads the flag at start-up), as tests/test_sharding.py.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    result = subprocess.run([sys.executable, "-m", "tests.test_prompt_logprobs"], env=env, check=False,
                            capture_output=True, text=True, timeout=300, cwd=FIXTURES.parent.parent)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    report = read_report(result.stdout)
    for tp in ("2", "4"):  # tp=4 pads tiny_9_3's 9 query / 3 KV heads
        assert report[tp]["max_abs_diff"] <= 1e-4 and report[tp]["same_keys"] and report[tp]["same_tokens"]


def _tensor_parallel_report() -> dict:
    """Runs in the 8-device subprocess: prompt logprobs with weights split over tp devices."""
    from tests.test_sharding import LLM_OPTIONS, tiny_9_3_model

    model = tiny_9_3_model()
    prompt = list(range(200, 240))
    params = SamplingParams(prompt_logprobs=3, max_tokens=2, temperature=0)
    reference = LLM(loaded=model, **LLM_OPTIONS).generate([prompt], params, use_tqdm=False)[0]
    report = {}
    for tp in (2, 4):
        out = LLM(loaded=model, tensor_parallel_size=tp, **LLM_OPTIONS).generate([prompt], params, use_tqdm=False)[0]
        pairs = list(zip(out.prompt_logprobs[1:], reference.prompt_logprobs[1:], strict=True))
        report[str(tp)] = dict(
            max_abs_diff=max(abs(a[t] - b[t]) for a, b in pairs for t in b if t in a),
            same_keys=all(set(a) == set(b) for a, b in pairs),
            same_tokens=out.outputs[0].token_ids == reference.outputs[0].token_ids,
        )
    return report


if __name__ == "__main__":
    print(report_line(_tensor_parallel_report()))

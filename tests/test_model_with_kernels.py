"""The model with the Pallas kernels in place of the reference attention (interpret mode, CPU).

The golden comparison of ``test_model_golden.py`` (tiny random Llama-3, Qwen2, Qwen3,
Mistral against Hugging Face transformers, float32, same tolerances) with
``attention_impl`` forced to ``"pallas_gpu_interpret"`` and ``"pallas_tpu_interpret"``
through the model's dispatcher argument:
- a prefill: logits at every position of one prompt;
- a mixed step over a cached prefix: one sequence's chunked prefill continuing its
  cached first 40 tokens (ending mid-page), another's decode token right after a page
  boundary, an empty sequence slot and padding tokens; chunk logits against golden,
  the decode token against golden greedy output and the reference implementation;
- the engine (scheduler, chunked prefill, mixed prefill + decode steps) generating
  greedy tokens identical to transformers'.
Interpret mode is slow, so prompts are short and the engine run is one fixture.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.batch import build_step_batch
from jaxinfer.kv_cache import create_kv_cache

from .all_logits import forward_all_logits
from .test_model_golden import ATOL, PAGE_SIZE, RTOL, TINY, _golden, _model

KERNELS = ["pallas_gpu_interpret", "pallas_tpu_interpret"]
_all_logits_fn = jax.jit(forward_all_logits, static_argnums=(3, 4))


def _run(model, cache, chunks, *, num_tokens, num_seqs, pages_per_seq, impl):
    batch = build_step_batch(chunks, num_tokens=num_tokens, num_seqs=num_seqs, pages_per_seq=pages_per_seq)
    logits, cache = _all_logits_fn(model.weights, cache, jax.tree.map(jnp.asarray, batch), model.config, impl)
    return np.asarray(logits), cache


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("name", TINY)
def test_prefill_logits_match_transformers_with_kernel(name, impl):
    golden, arrays = _golden(name)
    model = _model(name)
    ids = golden["prompts"][golden["all_positions_prompt_index"]]["ids"]
    num_pages = -(-len(ids) // PAGE_SIZE)
    cache = create_kv_cache(model.config, 1 + num_pages, PAGE_SIZE, jnp.float32)
    logits, _ = _run(model, cache, [(ids, 0, list(range(1, 1 + num_pages)))],
                     num_tokens=128, num_seqs=1, pages_per_seq=num_pages, impl=impl)
    np.testing.assert_allclose(logits[: len(ids)], arrays["all_pos_logits"], atol=ATOL, rtol=RTOL)


def _mixed_steps(name, impl):
    """Two steps over one cache; returns the logits to check and the golden data they match."""
    golden, arrays = _golden(name)
    model = _model(name)
    long_ids = golden["prompts"][golden["all_positions_prompt_index"]]["ids"]  # 56-70 tokens
    # The prompt nearest one page (16 tokens in Llama-3's fixture: its decode token opens a new page).
    short = min(range(len(golden["prompts"])), key=lambda i: abs(len(golden["prompts"][i]["ids"]) - PAGE_SIZE))
    short_ids = golden["prompts"][short]["ids"]
    pages_a, pages_b = [3, 1, 6, 4, 7], [2, 5]  # scattered physical pages; page 0 stays unused
    cache = create_kv_cache(model.config, 8, PAGE_SIZE, jnp.float32)
    sizes = dict(num_tokens=64, num_seqs=3, pages_per_seq=len(pages_a), impl=impl)
    # Step 1: two prefills; a's first 40 tokens end mid-page.
    logits1, cache = _run(model, cache, [(long_ids[:40], 0, pages_a), (short_ids, 0, pages_b)], **sizes)
    # Step 2: a's remaining tokens over its cached prefix, b's first decode token, an empty
    # third slot, and padding tokens past the live ones.
    next_b = golden["prompts"][short]["greedy_ids"][0]
    rest = len(long_ids) - 40
    logits2, cache = _run(model, cache, [(long_ids[40:], 40, pages_a), ([next_b], len(short_ids), pages_b)], **sizes)
    return dict(
        prefix=logits1[:40], b_last=logits1[40 + len(short_ids) - 1], chunk=logits2[:rest], decode=logits2[rest],
        all_pos=arrays["all_pos_logits"], b_golden_last=arrays["last_logits"][short],
        b_second_token=golden["prompts"][short]["greedy_ids"][1],
    )


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen3"])
def test_mixed_chunked_step_matches_transformers_with_kernel(name, impl):
    got = _mixed_steps(name, impl)
    np.testing.assert_allclose(got["prefix"], got["all_pos"][:40], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(got["chunk"], got["all_pos"][40:], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(got["b_last"], got["b_golden_last"], atol=ATOL, rtol=RTOL)
    assert int(np.argmax(got["decode"])) == got["b_second_token"]
    # transformers' golden data has no logits for decode steps: the reference implementation,
    # itself checked against them in test_model_golden, stands in.
    want = _mixed_steps(name, "reference")["decode"]
    np.testing.assert_allclose(got["decode"], want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("impl", KERNELS)
def test_engine_greedy_matches_transformers_with_kernel(impl):
    name = "tiny-llama3"
    golden, _ = _golden(name)
    # A 32-token step budget splits the 63- and 99-token prompts into chunks, and the later
    # steps mix their chunks with the decode tokens of the prompts already done.
    llm = LLM(loaded=_model(name), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              page_size=PAGE_SIZE, num_pages=40, attention_impl=impl, warm_up=False, use_tqdm=False)
    prompts = [p for p in golden["prompts"] if len(p["ids"]) < 100][:4]
    max_tokens = 6
    outputs = llm.generate([p["ids"] for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                       ignore_eos=True), use_tqdm=False)
    for out, prompt in zip(outputs, prompts):
        assert out.outputs[0].token_ids == prompt["greedy_ids"][:max_tokens], prompt["text"]

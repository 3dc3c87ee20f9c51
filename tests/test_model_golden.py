"""The model against Hugging Face transformers (golden data made by tests/golden/make_golden.py).

For every fixture (tiny random Llama-3, Qwen2, Qwen3, Mistral) and the default model
(SmolLM2-135M-Instruct, Q4_1 GGUF), in float32:
- prompt token ids and chat-template text/ids are identical to transformers';
- last-position logits (and every position of one prompt) match within ATOL/RTOL;
- greedy 32-token continuations, run through the engine, are identical.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.batch import build_step_batch
from jaxinfer.checkpoint import load_model
from jaxinfer.kv_cache import create_kv_cache

from .all_logits import forward_all_logits
from .conftest import FIXTURES, GOLDEN

# float32 on both sides; the difference is summation order (XLA vs torch) over ~1e2-1e3 terms.
ATOL = 1e-4
RTOL = 1e-4
TINY = ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
DEFAULT = "smollm2-135m-instruct"
PAGE_SIZE = 16


def _golden(name):
    path = GOLDEN / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path} not generated")
    return json.loads(path.read_text()), np.load(GOLDEN / f"{name}.npz")


_MODELS = {}


def _model(name):
    if name not in _MODELS:
        _MODELS[name] = load_model(FIXTURES / name if name in TINY else name, dtype="float32")
    return _MODELS[name]


def _all_logits(model, ids):
    """Logits at every position of one prompt, computed as one prefill over the paged cache."""
    num_pages = -(-len(ids) // PAGE_SIZE)
    pages_per_seq = 1 << (num_pages - 1).bit_length()
    cache = create_kv_cache(model.config, 1 + pages_per_seq, PAGE_SIZE, jnp.float32)
    num_tokens = 1 << (len(ids) - 1).bit_length()
    batch = build_step_batch([(ids, 0, list(range(1, 1 + num_pages)))], num_tokens=num_tokens, num_seqs=1, pages_per_seq=pages_per_seq)
    logits, _ = jax.jit(forward_all_logits, static_argnums=(3, 4))(
        model.weights, cache, jax.tree.map(jnp.asarray, batch), model.config, "reference"
    )
    return np.asarray(logits)[: len(ids)]


def _params(name):
    return [pytest.param(n, marks=pytest.mark.slow) if n == DEFAULT else n for n in name]


@pytest.mark.parametrize("name", _params(TINY + [DEFAULT]))
def test_prompt_token_ids_match_transformers(name):
    golden, _ = _golden(name)
    tokenizer = _model(name).tokenizer
    for prompt in golden["prompts"]:
        assert tokenizer.encode(prompt["text"]) == prompt["ids"], prompt["text"]


@pytest.mark.parametrize("name", _params(TINY + [DEFAULT]))
def test_chat_template_matches_transformers(name):
    golden, _ = _golden(name)
    tokenizer = _model(name).tokenizer
    for chat in golden["chats"]:
        text = tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True)
        assert text == chat["text"]
        assert tokenizer.encode(text, add_special_tokens=False) == chat["ids"]


@pytest.mark.parametrize("name", _params(TINY + [DEFAULT]))
def test_last_position_logits_match_transformers(name):
    golden, arrays = _golden(name)
    model = _model(name)
    for i, prompt in enumerate(golden["prompts"]):
        logits = _all_logits(model, prompt["ids"])[-1]
        np.testing.assert_allclose(logits, arrays["last_logits"][i], atol=ATOL, rtol=RTOL, err_msg=prompt["text"])


@pytest.mark.parametrize("name", _params(TINY + [DEFAULT]))
def test_logits_at_every_position_match_transformers(name):
    golden, arrays = _golden(name)
    prompt = golden["prompts"][golden["all_positions_prompt_index"]]
    logits = _all_logits(_model(name), prompt["ids"])
    if "all_pos_logits" in arrays:
        np.testing.assert_allclose(logits, arrays["all_pos_logits"], atol=ATOL, rtol=RTOL)
        return
    # The default model's golden file keeps the top 64 logits per position and the logsumexp
    # of each row (its full logits would be 10 MB): compare those.
    ours_at_ids = np.take_along_axis(logits, arrays["all_pos_topk_ids"].astype(np.int64), axis=1)
    np.testing.assert_allclose(ours_at_ids, arrays["all_pos_topk_logits"], atol=ATOL, rtol=RTOL)
    logsumexp = np.log(np.sum(np.exp(logits - logits.max(1, keepdims=True)), axis=1)) + logits.max(1)
    np.testing.assert_allclose(logsumexp, arrays["all_pos_logsumexp"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", _params(TINY + [DEFAULT]))
def test_greedy_continuations_match_transformers(name):
    golden, _ = _golden(name)
    llm = LLM(loaded=_model(name), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128, num_pages=160, use_tqdm=False)
    # transformers ran with EOS disabled: an EOS picked by argmax is kept like any token.
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [p["ids"] for p in golden["prompts"]] + [c["ids"] for c in golden["chats"]]
    expected = [p["greedy_ids"] for p in golden["prompts"]] + [c["greedy_ids"] for c in golden["chats"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out, want in zip(outputs, expected):
        assert out.outputs[0].token_ids == want
    assert llm.engine.stats()["num_compilations_after_warmup"] == 0

"""Adversarial engine tests: the promised properties on workloads built to break them.

Every test compares the engine with itself run another way (one request at a time on a roomy
pool without prefix caching, or a plain no-cache forward over the whole sequence), so a
scheduling, paging, prefix-cache or sampling bug that changes one token shows up as a mismatch.
Small shapes (context 48, pages of 4 tokens, a budget of 16 tokens) make preemption, chunked
prefill and page boundaries happen all the time with the tiny Llama-3 fixture.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.batch import build_step_batch
from jaxinfer.checkpoint import load_model
from jaxinfer.detokenizer import Detokenizer
from jaxinfer.errors import PromptTooLongError, RequestError, RequestIdInUseError
from jaxinfer.kv_cache import create_kv_cache
from jaxinfer.input_batch import MAX_BANNED
from jaxinfer.runner import default_buckets
from jaxinfer.sequence import SequenceStatus

from .all_logits import forward_all_logits
from .conftest import FIXTURES

MAX_MODEL_LEN = 48
PAGE_SIZE = 4
BUDGET = 16  # max_num_batched_tokens: a prompt of more than 16 tokens is prefilled in chunks
PAGES_PER_SEQ = MAX_MODEL_LEN // PAGE_SIZE
VOCAB = 500  # prompt ids are drawn below this (the fixture's vocabulary is 512)


@pytest.fixture(scope="module")
def tiny():
    return load_model(FIXTURES / "tiny-llama3", dtype="float32")


def make_llm(tiny, **overrides):
    options = dict(
        max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=BUDGET, num_pages=64,
        page_size=PAGE_SIZE, use_tqdm=False, max_wait_s=0.0,
    )
    options.update(overrides)
    return LLM(loaded=tiny, **options)


@pytest.fixture(scope="module")
def reference(tiny):
    """One request at a time on a roomy pool, no prefix cache: the outputs every other run must give."""
    return make_llm(tiny, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def shared(tiny):
    """A roomy pool with prefix caching: no preemption, lots of sharing."""
    return make_llm(tiny)


@pytest.fixture(scope="module")
def tight(tiny):
    """Room for one full-length sequence and two pages more: preemption in most steps (greedy
    admission: the default holds pages back for the growth and would preempt far less)."""
    return make_llm(tiny, num_pages=PAGES_PER_SEQ + 3, scheduling_admission="greedy")


def alone(llm, prompts, params):
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]


def summary(output):
    """Everything a sample's result promises, except logprobs (compared with a tolerance)."""
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in output.outputs]


def assert_same_outputs(got, expected):
    for g, e in zip(got, expected, strict=True):
        assert summary(g) == summary(e)
        for cg, ce in zip(g.outputs, e.outputs):
            assert (cg.logprobs is None) == (ce.logprobs is None)
            for entry_g, entry_e in zip(cg.logprobs or [], ce.logprobs or []):
                assert entry_g.keys() == entry_e.keys()
                assert np.allclose(list(entry_g.values()), list(entry_e.values()), atol=1e-4)


def drain(engine):
    """Step until idle; the finished outputs by request id."""
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def random_params(rng, max_tokens_high=40):
    """A request drawn from every sampling feature, always seeded."""
    common = dict(max_tokens=int(rng.integers(1, max_tokens_high)), seed=int(rng.integers(0, 2**40)),
                  ignore_eos=bool(rng.integers(0, 2)))
    kind = int(rng.integers(0, 7))
    if kind == 0:
        extra = dict(temperature=0)
    elif kind == 1:
        extra = dict(temperature=float(rng.uniform(0.3, 1.5)))
    elif kind == 2:
        extra = dict(temperature=1.0, top_k=int(rng.integers(1, 50)), top_p=float(rng.uniform(0.3, 1.0)),
                     min_p=float(rng.uniform(0.0, 0.2)))
    elif kind == 3:
        extra = dict(temperature=float(rng.choice([0.0, 0.8])), repetition_penalty=float(rng.uniform(0.5, 2.0)),
                     presence_penalty=float(rng.uniform(-1, 1)), frequency_penalty=float(rng.uniform(-1, 1)),
                     n=int(rng.integers(1, 3)))
    elif kind == 4:
        extra = dict(temperature=0.9, logprobs=int(rng.integers(0, 6)), min_tokens=int(rng.integers(0, 5)))
    elif kind == 5:
        extra = dict(temperature=0.7, n=int(rng.integers(2, 5)))
    else:
        extra = dict(temperature=0, stop=[chr(c) for c in rng.integers(97, 123, size=3)],
                     min_tokens=int(rng.integers(0, 3)))
    extra["min_tokens"] = min(extra.get("min_tokens", 0), common["max_tokens"])
    return SamplingParams(**common, **extra)


def random_workload(seed, count=12):
    """Prompts of 1 token to max_model_len - 1, on and off page boundaries, longer than the
    budget, sharing a prefix, one a prefix of another, and the same prompt twice."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, VOCAB, size=30).tolist()
    lengths = [1, 3, 4, 5, 8, 16, 17, 24, MAX_MODEL_LEN - 2, MAX_MODEL_LEN - 1]
    prompts = []
    for _ in range(count):
        length = int(rng.choice(lengths + [int(rng.integers(1, MAX_MODEL_LEN))]))
        if rng.integers(0, 2):
            prompts.append((prefix + rng.integers(0, VOCAB, size=length).tolist())[:length])
        else:
            prompts.append(rng.integers(0, VOCAB, size=length).tolist())
    prompts += [list(prompts[3]), list(prompts[3]), prefix[:12], prefix[:21]]
    return prompts, [random_params(rng) for _ in prompts]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_under_preemption_matches_one_at_a_time(reference, tight, seed):
    prompts, params = random_workload(seed)
    expected = alone(reference, prompts, params)
    preemptions_before = tight.engine.stats()["num_preemptions"]
    got = tight.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(got, expected)
    stats = tight.engine.stats()
    assert stats["num_preemptions"] > preemptions_before
    assert stats["num_pages_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_random_workload_with_prefix_sharing_matches_one_at_a_time(reference, shared):
    prompts, params = random_workload(3)
    expected = alone(reference, prompts, params)
    hits_before = shared.engine.stats()["prefix_cache_hits"]
    assert_same_outputs(shared.generate(prompts, params, use_tqdm=False), expected)
    assert shared.engine.stats()["prefix_cache_hits"] > hits_before
    assert shared.engine.stats()["num_pages_used"] == 0


def test_greedy_mixed_batch_equals_one_at_a_time(reference, tight):
    rng = np.random.default_rng(10)
    prompts = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in rng.integers(1, MAX_MODEL_LEN, size=10)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    batched = tight.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(batched, alone(reference, prompts, params))
    for prompt, out in zip(prompts, batched):
        assert len(out.outputs[0].token_ids) == min(20, MAX_MODEL_LEN - len(prompt))


def oracle_logprobs(tiny, tokens):
    """log_softmax of the raw logits after ``tokens``: one forward over the whole sequence, no paging."""
    padded = list(tokens) + [0] * (MAX_MODEL_LEN - len(tokens))  # causal: the padding is never seen
    pages = list(range(1, PAGES_PER_SEQ + 1))
    batch = jax.tree.map(jnp.asarray, build_step_batch([(padded, 0, pages)], num_tokens=MAX_MODEL_LEN, num_seqs=1,
                                                       pages_per_seq=PAGES_PER_SEQ))
    cache = create_kv_cache(tiny.config, PAGES_PER_SEQ + 1, PAGE_SIZE, jnp.float32)
    logits, _ = _oracle_step(tiny.weights, cache, batch, tiny.config, "reference")
    return np.asarray(jax.nn.log_softmax(logits[len(tokens) - 1]))


_oracle_step = jax.jit(forward_all_logits, static_argnums=(3, 4))


def test_chunked_and_paged_greedy_matches_a_plain_forward(tiny, tight):
    """Long prompts (chunked prefill, page boundaries, preemption) against a no-cache forward."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (40, 32, 17, MAX_MODEL_LEN - 1)]
    outputs = tight.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        tokens = list(prompt)
        for _ in range(min(8, MAX_MODEL_LEN - len(prompt))):
            tokens.append(int(np.argmax(oracle_logprobs(tiny, tokens))))
        assert out.outputs[0].token_ids == tokens[len(prompt):]


def test_logprobs_are_of_the_raw_distribution_whatever_the_processing(tiny, tight):
    rng = np.random.default_rng(12)
    prompt = rng.integers(0, VOCAB, size=21).tolist()
    params = SamplingParams(temperature=0.6, top_k=5, top_p=0.9, repetition_penalty=1.7, frequency_penalty=0.5,
                            presence_penalty=-0.3, min_tokens=3, max_tokens=8, logprobs=5, seed=9, ignore_eos=True)
    others = [rng.integers(0, VOCAB, size=30).tolist() for _ in range(3)]
    out = tight.generate([prompt] + others, [params] + [SamplingParams(temperature=0, max_tokens=12)] * 3,
                         use_tqdm=False)[0].outputs[0]
    tokens = list(prompt)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        raw = oracle_logprobs(tiny, tokens)
        top = np.argsort(-raw, kind="stable")[:5].tolist()
        assert next(iter(entry)) == token  # the sampled token first
        assert set(entry) == set(top) | {token}
        for tid, value in entry.items():
            assert value == pytest.approx(float(raw[tid]), abs=1e-4)
        tokens.append(token)
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))


SEEDED = [
    SamplingParams(temperature=1.3, seed=1, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=7, seed=2, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.6, seed=3, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=0.1, seed=4, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.4, seed=5,
                   max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, n=3, seed=6, max_tokens=12, ignore_eos=True),
]


@pytest.mark.parametrize("params", SEEDED, ids=["temperature", "top_k", "top_p", "min_p", "penalties", "n3"])
def test_seed_reproduces_the_text_whatever_else_is_in_the_batch(reference, tight, params):
    rng = np.random.default_rng(13)
    prompt = rng.integers(0, VOCAB, size=19).tolist()
    expected = alone(reference, [prompt], params)[0]
    others = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in rng.integers(5, 40, size=5)]
    other_params = [SamplingParams(temperature=0.7, top_k=3, seed=i, max_tokens=20, repetition_penalty=1.2)
                    for i in range(3)] + [SamplingParams(temperature=0, max_tokens=25, logprobs=2)] * 2
    mixed = tight.generate(others[:2] + [prompt] + others[2:], other_params[:2] + [params] + other_params[2:],
                           use_tqdm=False)
    assert summary(mixed[2]) == summary(expected)
    if params.n > 1:  # each sample draws from its own seed, derived from the request's
        assert len({tuple(c.token_ids) for c in expected.outputs}) > 1


def test_n_samples_share_the_prompt_pages(shared):
    engine = shared.engine
    rng = np.random.default_rng(14)
    for length in (13, 16, 40):  # mid-page, exactly on a page boundary, longer than the budget
        prompt = rng.integers(0, VOCAB, size=length).tolist()
        request_id = f"n-share-{length}"
        engine.add_request(request_id, prompt, SamplingParams(n=3, temperature=1.0, seed=8, max_tokens=3, ignore_eos=True))
        before = engine.stats()["num_tokens_computed"]
        tables = None
        while engine.has_unfinished_requests():
            engine.step()
            request = engine._requests.get(request_id)
            if tables is None and request is not None and all(s.page_table for s in request.seqs):
                tables = [list(s.page_table) for s in request.seqs]
        shareable = (length - 1) // PAGE_SIZE  # full pages before the last prompt token
        assert tables is not None
        assert all(t[:shareable] == tables[0][:shareable] for t in tables)
        # The prompt is computed once, plus at most one page per extra sample, plus the decodes.
        assert engine.stats()["num_tokens_computed"] - before <= length + 2 * PAGE_SIZE + 3 * 4


def test_prefix_sharing_computes_fewer_tokens_with_identical_outputs(tiny, reference):
    rng = np.random.default_rng(15)
    system = rng.integers(0, VOCAB, size=24).tolist()  # six full pages
    prompts = [system + rng.integers(0, VOCAB, size=int(n)).tolist() for n in (1, 3, 4, 9)]
    prompts += [system[:8], system[:9], list(prompts[1])]  # prefixes of a cached prompt, a repeat
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.8,
                             frequency_penalty=0.6, presence_penalty=0.4)] * 3
    params.append(params[1])
    expected = alone(reference, prompts, params)
    cached = make_llm(tiny)
    cached.generate([system + [1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # cache it
    before = cached.engine.stats()["num_tokens_computed"]
    assert_same_outputs(cached.generate(prompts, params, use_tqdm=False), expected)
    computed = cached.engine.stats()["num_tokens_computed"] - before
    uncached = make_llm(tiny, enable_prefix_caching=False)
    assert_same_outputs(uncached.generate(prompts, params, use_tqdm=False), expected)
    assert computed <= uncached.engine.stats()["num_tokens_computed"] - 4 * 24


def test_identical_prompts_in_one_step_race_for_the_prefix_cache(reference, shared):
    rng = np.random.default_rng(16)
    prompt = rng.integers(0, VOCAB, size=20).tolist()  # ends exactly on a page boundary
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=2.0),
              SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=3),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    expected = alone(reference, [prompt] * 4, params)
    for _ in range(2):  # the second round hits the pages the first registered
        assert_same_outputs(shared.generate([prompt] * 4, params, use_tqdm=False), expected)


def text_lengths(tokenizer, token_ids):
    """Length of the output text after each token, as the engine's incremental detokenizer sees it
    (a token ending inside a UTF-8 character adds its text only with the next one)."""
    detokenizer, lengths = Detokenizer(tokenizer), []
    for token in token_ids:
        detokenizer.add_token(token)
        lengths.append(len(detokenizer.text))
    return lengths


def stop_string_cases(text, pieces):
    """Stop strings of 1 to 5 characters that start inside one token and end inside a later one."""
    cases = []
    for end in pieces[:-1]:
        for before, after in ((1, 1), (2, 3), (3, 2)):
            if before <= end and end + after <= len(text):
                cases.append(text[end - before : end + after])
    return cases[:8]


def test_stop_strings_across_token_boundaries_are_excluded(reference, tight):
    rng = np.random.default_rng(17)
    prompt = rng.integers(0, VOCAB, size=9).tolist()
    free = alone(reference, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    pieces = text_lengths(reference.tokenizer, free.token_ids)
    stops = [s for s in stop_string_cases(free.text, pieces) if s.strip()]
    assert stops
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[s]) for s in stops]
    params += [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[s], include_stop_str_in_output=True)
               for s in stops]
    outputs = tight.generate([prompt] * len(params), params, use_tqdm=False)
    for sp, out in zip(params, outputs):
        (stop,) = sp.stop
        got = out.outputs[0]
        cut = free.text.index(stop)
        assert got.finish_reason == "stop" and got.stop_reason == stop
        assert got.text == free.text[: cut + (len(stop) if sp.include_stop_str_in_output else 0)]
        # Generation ends on the token that completed the stop string.
        assert got.token_ids == free.token_ids[: next(i for i, n in enumerate(pieces) if n >= cut + len(stop)) + 1]


def test_streamed_text_only_grows_when_a_stop_string_spans_tokens(reference, shared):
    rng = np.random.default_rng(17)
    prompt = rng.integers(0, VOCAB, size=9).tolist()
    free = alone(reference, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    pieces = text_lengths(reference.tokenizer, free.token_ids)
    for stop in [s for s in stop_string_cases(free.text, pieces) if s.strip()][:4]:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop, "\x00never"])
        texts = [out.outputs[0].text for out in shared.stream(prompt, params)]
        assert texts[-1] == free.text[: free.text.index(stop)]
        assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:])), (stop, texts)


def test_min_tokens_holds_back_stop_strings_stop_ids_and_eos(reference):
    rng = np.random.default_rng(18)
    prompt = rng.integers(0, VOCAB, size=9).tolist()
    free = alone(reference, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    tokenizer = reference.tokenizer
    first_text = tokenizer.decode(free.token_ids[:1])
    assert first_text
    stop = first_text[-1]  # completed by the very first token
    out = alone(reference, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert out.outputs[0].token_ids == free.token_ids[:1] and out.outputs[0].stop_reason == stop
    held = alone(reference, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                     min_tokens=6))[0].outputs[0]
    assert len(held.token_ids) >= 6  # a stop string inside the first min_tokens tokens does not stop
    assert held.token_ids[:6] == free.token_ids[:6]
    # The same with a stop token: banned on the device until min_tokens, then it stops.
    stop_id = free.token_ids[0]
    banned = alone(reference, [prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id],
                                                       min_tokens=4))[0].outputs[0]
    eos_ids = reference.engine.eos_ids
    assert len(banned.token_ids) >= 4 and not set(banned.token_ids[:4]) & ({stop_id} | eos_ids)
    assert banned.finish_reason == "length" or banned.token_ids[-1] in {stop_id} | eos_ids


def find_eos_prompt(llm, eos_ids, rng):
    """A prompt whose greedy continuation emits EOS within its first 20 tokens (the tiny model is random)."""
    prompts = [rng.integers(0, VOCAB, size=int(rng.integers(3, 20))).tolist() for _ in range(64)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ids = out.outputs[0].token_ids
        positions = [i for i, t in enumerate(ids) if t in eos_ids]
        if positions and positions[0] >= 1:
            return prompt, ids, positions[0]
    # Seeded and deterministic: a failure here means the model or the engine's greedy path changed,
    # which a skip would hide.
    raise AssertionError("none of the 64 seeded prompts makes the tiny model emit EOS within 20 tokens")


def test_eos_ignore_eos_min_tokens_and_max_tokens(reference, tight):
    eos_ids = reference.engine.eos_ids
    prompt, free, at = find_eos_prompt(reference, eos_ids, np.random.default_rng(19))
    stopped = tight.generate([prompt], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == free[: at + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = tight.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == free and ignored.finish_reason == "length"
    held = tight.generate([prompt], SamplingParams(temperature=0, max_tokens=20, min_tokens=at + 2),
                          use_tqdm=False)[0].outputs[0]
    assert held.token_ids[:at] == free[:at]
    assert not set(held.token_ids[: at + 2]) & set(eos_ids)  # banned, not only ignored


def test_too_many_ids_to_ban_for_min_tokens_is_refused(reference):
    engine = reference.engine
    many = list(range(MAX_BANNED + 1))
    with pytest.raises(RequestError, match="min_tokens") as refused:
        engine.validate([1, 2, 3], SamplingParams(stop_token_ids=many, min_tokens=2))
    assert (refused.value.field, refused.value.limit) == ("min_tokens", MAX_BANNED)
    engine.validate([1, 2, 3], SamplingParams(stop_token_ids=many))  # without min_tokens nothing is banned
    engine.validate([1, 2, 3], SamplingParams(stop_token_ids=[1, 1, 2], min_tokens=2))


def test_context_edges(reference, tight):
    rng = np.random.default_rng(20)
    longest = rng.integers(0, VOCAB, size=MAX_MODEL_LEN - 1).tolist()
    boundary = rng.integers(0, VOCAB, size=4 * PAGE_SIZE).tolist()
    short = rng.integers(0, VOCAB, size=10).tolist()
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True),  # passes max_model_len
              SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, repetition_penalty=1.3)]
    prompts = [longest, short, boundary]
    expected = alone(reference, prompts, params)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(got, expected)
    for prompt, out in zip(prompts, got):
        assert len(prompt) + len(out.outputs[0].token_ids) <= MAX_MODEL_LEN
        assert out.outputs[0].finish_reason == "length"
    assert len(got[0].outputs[0].token_ids) == 1
    assert len(got[1].outputs[0].token_ids) == MAX_MODEL_LEN - len(short)
    too_long = tight.generate([longest + [1]], params[0], use_tqdm=False)[0]
    assert too_long.error and "max_model_len" in too_long.error


def test_abort_mid_prefill_frees_pages_at_once_and_poisons_nothing(reference, tight):
    engine = tight.engine
    rng = np.random.default_rng(21)
    prompt = rng.integers(0, VOCAB, size=40).tolist()  # three chunks of the budget
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("mid-prefill", prompt, params)
    engine.step()
    (seq,) = engine._requests["mid-prefill"].seqs
    assert 0 < seq.num_computed_tokens < len(prompt) and engine.stats()["num_pages_used"] > 0
    assert engine.abort("mid-prefill")
    assert engine.stats()["num_pages_used"] == 0 and seq.page_table == []
    finished = drain(engine)
    assert finished["mid-prefill"].outputs[0].finish_reason == "abort"
    assert finished["mid-prefill"].outputs[0].token_ids == []
    # The aborted prefill registered the pages it computed; a new request that hits them is unharmed.
    again = tight.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert summary(again) == summary(alone(reference, [prompt], params)[0])


def test_abort_of_a_preempted_request_and_of_a_waiting_one(reference, tight):
    engine = tight.engine
    rng = np.random.default_rng(22)
    prompts = [rng.integers(0, VOCAB, size=24).tolist() for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"pre-{i}", prompt, params)
    victim = None
    for _ in range(200):
        engine.step()
        preempted = [s for s in engine.scheduler.waiting if s.num_preemptions > 0]
        if preempted:
            victim = preempted[0]
            break
    assert victim is not None
    never_run = next(s for s in engine.scheduler.waiting if s is not victim and s.num_preemptions == 0
                     and s.num_computed_tokens == 0)
    used = engine.stats()["num_pages_used"]
    assert engine.abort(victim.request_id) and engine.abort(never_run.request_id)
    assert victim.status is SequenceStatus.FINISHED and never_run.status is SequenceStatus.FINISHED
    assert engine.stats()["num_pages_used"] <= used and engine.stats()["num_waiting"] == len(engine.scheduler.waiting)
    assert victim not in engine.scheduler.waiting and never_run not in engine.scheduler.waiting
    finished = drain(engine)
    for i, prompt in enumerate(prompts):
        out = finished[f"pre-{i}"]
        if out.request_id in (victim.request_id, never_run.request_id):
            assert out.outputs[0].finish_reason == "abort"
        else:
            assert summary(out) == summary(alone(reference, [prompt], params)[0])
    assert engine.stats()["num_pages_used"] == 0


def test_abort_of_a_request_with_n_samples_some_finished(tight):
    engine = tight.engine
    rng = np.random.default_rng(23)
    prompt = rng.integers(0, VOCAB, size=14).tolist()
    probe = tight.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=20, ignore_eos=True),
                           use_tqdm=False)[0]
    # Stop sample 0 early on a token only it produces at that point, so the others keep running.
    first_tokens = [c.token_ids[1] for c in probe.outputs]
    stop_id = first_tokens[0]
    # Seeded and deterministic: assert (not skip) that the probe still gives a token only sample 0 has.
    assert stop_id not in probe.outputs[1].token_ids[:8] + probe.outputs[2].token_ids[:8], "samples share the stop token"
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id])
    engine.add_request("n-abort", prompt, params)
    request = engine._requests["n-abort"]
    for _ in range(100):
        engine.step()
        if request.seqs[0].is_finished:
            break
    assert request.seqs[0].finish_reason == "stop"
    assert not request.seqs[1].is_finished and not request.seqs[2].is_finished
    assert engine.abort("n-abort")
    assert engine.stats()["num_pages_used"] == 0
    out = drain(engine)["n-abort"]
    assert [c.finish_reason for c in out.outputs] == ["stop", "abort", "abort"]
    assert out.outputs[0].token_ids == probe.outputs[0].token_ids[:2]


def test_abort_in_flight_then_reuse_of_its_pages(reference, tight):
    """Abort requests whose step is still on the device; the next requests get their pages."""
    engine = tight.engine
    rng = np.random.default_rng(24)
    prompts = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in (30, 11, 7)]
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, repetition_penalty=1.4)
    for step in range(1, 6):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"flight-{step}-{i}", prompt, params)
        for _ in range(step):
            engine.step()
        for i in range(len(prompts)):
            engine.abort(f"flight-{step}-{i}")
        assert engine.stats()["num_pages_used"] == 0
        assert_same_outputs(tight.generate(prompts, params, use_tqdm=False), alone(reference, prompts, params))
        drain(engine)


def test_n_samples_with_preemption_match_one_at_a_time(reference, tight):
    rng = np.random.default_rng(25)
    prompts = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in (22, 9, 30)]
    params = [SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=18, ignore_eos=True),
              SamplingParams(n=2, temperature=0, max_tokens=25, ignore_eos=True, presence_penalty=0.8),
              SamplingParams(n=4, temperature=1.1, top_p=0.8, seed=12, max_tokens=15, ignore_eos=True, logprobs=2)]
    before = tight.engine.stats()["num_preemptions"]
    assert_same_outputs(tight.generate(prompts, params, use_tqdm=False), alone(reference, prompts, params))
    assert tight.engine.stats()["num_preemptions"] > before


def test_more_sequences_than_tokens_per_step_is_refused_up_front(tiny):
    # The CPU bucket set stays valid for such shapes (it once held nothing to compile) ...
    buckets = default_buckets(16, 8, PAGES_PER_SEQ, "cpu")
    assert buckets.all() and all(b <= t for t, b, _ in buckets.all())
    # ... but an engine refuses them, naming both limits, as vLLM does: a step could not give
    # every running sequence its token, so the first ones would starve the rest.
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        make_llm(tiny, max_num_seqs=8, max_num_batched_tokens=4)


def test_zero_compilations_after_warmup_across_the_workload(reference, shared, tight):
    # Runs last: every test above drove these engines through varied shapes and sampler paths.
    for llm in (reference, shared, tight):
        assert llm.engine.runner.warmup_done
        assert llm.engine.stats()["num_compilations_after_warmup"] == 0


def test_out_of_range_sampling_values_are_refused_or_harmless(reference, shared):
    # float32 on the device: a temperature or penalty past its range would arrive as inf.
    for field in ("temperature", "repetition_penalty"):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: 1e300})
    # A top_k past the vocabulary (even past int32) keeps every token: top-k off, same samples.
    prompts = [[5, 6, 7, 8, 9]]
    off = shared.generate(prompts, SamplingParams(temperature=1.0, top_k=0, seed=3, max_tokens=8), use_tqdm=False)
    huge = shared.generate(prompts, SamplingParams(temperature=1.0, top_k=2**40, seed=3, max_tokens=8), use_tqdm=False)
    assert summary(huge[0]) == summary(off[0])


def test_final_text_is_the_decoded_output_even_when_it_ends_inside_a_character(tiny, shared):
    # The tiny model's random outputs are full of characters split over several tokens, so many
    # samples end inside one: their text must still be what decoding all their tokens gives.
    rng = np.random.default_rng(23)
    prompts = [rng.integers(0, VOCAB, size=int(rng.integers(2, 9))).tolist() for _ in range(24)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=int(rng.integers(1, 12)), ignore_eos=True)
              for i in range(len(prompts))]
    decoder = shared.tokenizer.tokenizer
    ended_inside = 0
    for out in shared.generate(prompts, params, use_tqdm=False):
        sample = out.outputs[0]
        decoded = decoder.decode(sample.token_ids, skip_special_tokens=True)
        assert sample.text == decoded, (sample.token_ids, sample.text, decoded)
        ended_inside += decoded.endswith("\ufffd")
    assert ended_inside > 0  # the case this test is about happened



def test_a_stop_string_completed_by_the_lossy_tail_still_stops_and_is_cut(tiny, shared):
    # A sample that ends inside a character gets its last bytes as U+FFFD only when it finishes;
    # a stop string that this tail completes (a character, then U+FFFD) must be cut like any other.
    rng = np.random.default_rng(23)
    decoder = shared.tokenizer.tokenizer
    for seed in range(200):
        prompt = rng.integers(0, VOCAB, size=int(rng.integers(2, 9))).tolist()
        free = shared.generate([prompt], SamplingParams(temperature=1.0, seed=seed, max_tokens=10, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
        # The stop string must first appear in that tail, not earlier in the text.
        if len(free.text) >= 2 and free.text.endswith("\ufffd") and free.text.find(free.text[-2:]) == len(free.text) - 2:
            break
    else:
        pytest.fail("no sample ended inside a character")
    assert decoder.decode(free.token_ids, skip_special_tokens=True) == free.text
    stop = free.text[-2:]
    out = shared.generate([prompt], SamplingParams(temperature=1.0, seed=seed, max_tokens=10, ignore_eos=True,
                                                   stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids  # the same sample, which ended on its length
    assert out.text == free.text[:-2] and stop not in out.text
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)

def test_streamed_outputs_are_snapshots(shared):
    outputs = list(shared.stream([5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                           logprobs=1)))
    lengths = [len(out.outputs[0].token_ids) for out in outputs]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1] == 6  # each kept as it was when yielded
    assert all(len(out.outputs[0].logprobs) == n for out, n in zip(outputs, lengths))


def test_refusals_are_typed_and_name_the_field_and_the_limit(reference):
    engine = reference.engine
    vocab = engine.model_config.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=2)
    refusals = [
        (lambda: engine.add_request("empty", [], greedy), RequestError, "prompt", 1),
        (lambda: engine.add_request("oov", [1, vocab], greedy), RequestError, "prompt", vocab),
        (lambda: engine.add_request("long", [1] * MAX_MODEL_LEN, greedy), PromptTooLongError, "prompt",
         MAX_MODEL_LEN - 1),
        (lambda: engine.add_request("stop-oov", [1], SamplingParams(stop_token_ids=[vocab])), RequestError,
         "stop_token_ids", vocab),
        (lambda: engine.score_prompt([1] * (MAX_MODEL_LEN + 1), 1), PromptTooLongError, "prompt", MAX_MODEL_LEN),
        (lambda: engine.score_prompt([1, 2, 3], 21), RequestError, "prompt_logprobs", (0, 20)),
    ]
    for refuse, error_type, field, limit in refusals:
        with pytest.raises(error_type) as refused:
            refuse()
        assert (refused.value.field, refused.value.limit) == (field, limit), refused.value
        assert isinstance(refused.value, ValueError)  # callers that caught ValueError still do
    assert not engine.has_unfinished_requests()  # nothing refused was queued

    engine.add_request("twice", [1, 2, 3], greedy)
    with pytest.raises(RequestIdInUseError) as refused:
        engine.add_request("twice", [4, 5], greedy)
    assert refused.value.field == "request_id" and refused.value.code == "duplicate_request_id"
    assert drain(engine)["twice"].outputs[0].finish_reason == "length"

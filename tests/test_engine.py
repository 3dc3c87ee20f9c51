"""The continuous-batching engine on CPU in float32, with a tiny Llama-3 fixture.

Each property compares the engine against itself run another way (one at a time, with a
roomy page pool, without prefix caching), so any scheduling, paging or sampling bug that
changes a token shows up as a mismatch.
"""

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.checkpoint import load_model

from .conftest import FIXTURES

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def tiny():
    return load_model(FIXTURES / "tiny-llama3", dtype="float32")


def make_llm(tiny, **overrides):
    options = dict(
        max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=64, num_pages=96, page_size=16,
        use_tqdm=False, max_wait_s=0.0,
    )
    options.update(overrides)
    return LLM(loaded=tiny, **options)


@pytest.fixture(scope="module")
def llm(tiny):
    return make_llm(tiny)


def random_prompts(count, seed=0, low=1, high=60, vocab=500):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(low, high))).tolist() for _ in range(count)]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_mixed_batch_equals_one_at_a_time(llm):
    prompts = random_prompts(32)
    batched = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    alone = [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert batched == alone
    assert all(len(t) == 12 for t in batched)
    assert llm.engine.stats()["num_compilations_after_warmup"] == 0


def test_preemption_gives_identical_outputs(tiny, llm):
    prompts = random_prompts(12, seed=1, low=30, high=60)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = token_ids(llm.generate(prompts, params, use_tqdm=False))
    # 12 pages of 16 tokens: two sequences of ~90 tokens already need all of them. Greedy
    # admission (by the prompt alone) preempts; the default reserves pages for the growth and
    # preempts less; both give the roomy pool's tokens.
    preemptions = {}
    for admission in ("greedy", "reserve"):
        tight = make_llm(tiny, num_pages=MAX_MODEL_LEN // 16 + 4, scheduling_admission=admission)
        squeezed = token_ids(tight.generate(prompts, params, use_tqdm=False))
        assert squeezed == roomy, admission
        assert tight.engine.stats()["num_pages_used"] == 0
        preemptions[admission] = tight.engine.stats()["num_preemptions"]
    assert preemptions["greedy"] > 0
    assert preemptions["reserve"] < preemptions["greedy"] / 2, preemptions


def test_seeded_sampling_is_reproducible_across_batches(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    prompt = random_prompts(1, seed=2)[0]
    alone = token_ids(llm.generate([prompt], params, use_tqdm=False))[0]
    others = random_prompts(7, seed=3)
    mixed = llm.generate(others[:3] + [prompt] + others[3:], [SamplingParams(temperature=0.7, seed=i) for i in range(3)] + [params] + [SamplingParams(temperature=0.7, seed=i) for i in range(4)], use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=4321, ignore_eos=True)
    assert token_ids(llm.generate([prompt], different_seed, use_tqdm=False))[0] != alone


def test_prefix_sharing_computes_fewer_tokens_with_same_outputs(tiny, llm):
    system = random_prompts(1, seed=4, low=64, high=65)[0]  # four full pages shared by all
    prompts = [system + tail for tail in random_prompts(6, seed=5, low=3, high=10)]
    shared = make_llm(tiny)
    before = shared.engine.stats()["num_tokens_computed"]
    with_cache = token_ids(shared.generate(prompts, GREEDY, use_tqdm=False))
    computed_with_cache = shared.engine.stats()["num_tokens_computed"] - before
    plain = make_llm(tiny, enable_prefix_caching=False)
    without_cache = token_ids(plain.generate(prompts, GREEDY, use_tqdm=False))
    computed_without = plain.engine.stats()["num_tokens_computed"]
    assert with_cache == without_cache
    assert shared.engine.stats()["prefix_cache_hits"] > 0
    assert computed_with_cache <= computed_without - 4 * 64


def test_n_samples_share_the_prompt(llm):
    prompt = random_prompts(1, seed=6, low=40, high=41)[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # each sample has its own seed


def test_stop_string_across_token_boundaries(llm):
    prompt = random_prompts(1, seed=8)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    text = free.text
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [llm.tokenizer.decode(free.token_ids[: i + 1]) for i in range(len(free.token_ids))]
    boundary = next(len(p) for p in pieces if len(p) >= 6)
    stop = text[boundary - 3 : boundary + 3]
    assert len(stop) == 6
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[stop], include_stop_str_in_output=True, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_abort_frees_pages_at_once(llm):
    engine = llm.engine
    engine.add_request("a", random_prompts(1, seed=9, low=50, high=51)[0], SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("b", random_prompts(1, seed=10)[0], SamplingParams(temperature=0, max_tokens=5))
    engine.step()
    engine.step()
    assert engine.stats()["num_pages_used"] > 0
    assert engine.abort("a") and engine.abort("b")
    assert engine.stats()["num_pages_used"] == 0
    assert not engine.abort("a") and not engine.abort("never-added")  # nothing left to abort
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id: o.outputs[0].finish_reason for o in outputs} == {"a": "abort", "b": "abort"}


def test_stop_tokens_max_tokens_and_min_tokens(llm):
    prompt = random_prompts(1, seed=11)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id and out.token_ids == free.token_ids[: first + 1]
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id], min_tokens=first + 2), use_tqdm=False)[0].outputs[0]
    assert stop_id not in banned.token_ids[: first + 2]
    assert free.finish_reason == "length" and len(free.token_ids) == 10


def test_logprobs_are_of_the_raw_distribution(llm):
    prompt = random_prompts(1, seed=12)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) >= 3
        assert max(entry.values()) == pytest.approx(entry[token])  # greedy picks the most likely
        assert all(v <= 0 for v in entry.values())


def test_bad_prompt_fails_alone(llm):
    outputs = llm.generate([[1, 2, 3], list(range(MAX_MODEL_LEN + 5)), []], GREEDY, use_tqdm=False)
    assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) == 12
    assert "max_model_len" in outputs[1].error and outputs[1].outputs[0].finish_reason == "error"
    assert "empty" in outputs[2].error


def test_penalties_run_exactly_and_change_the_output(llm):
    prompt = random_prompts(1, seed=13)[0]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    penalized = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=5.0), use_tqdm=False)[0].outputs[0]
    # With a strong repetition penalty, greedy decoding repeats no token of its own output as often.
    assert len(set(penalized.token_ids)) >= len(set(plain.token_ids))
    batched = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=5.0)] * 2, use_tqdm=False)
    assert token_ids(batched) == [penalized.token_ids] * 2


def test_penalties_match_a_plain_loop_over_the_whole_sequence(tiny, llm):
    """Penalties read the history from the device's token pages; check them against the definition.

    The reference recomputes every position from scratch each step (no cache, no pages) and
    applies vLLM's penalties in numpy to the last position's logits.
    """
    import jax
    import jax.numpy as jnp

    from jaxinfer.batch import build_step_batch
    from jaxinfer.kv_cache import create_kv_cache

    from .all_logits import forward_all_logits

    prompt = random_prompts(1, seed=21, low=20, high=21)[0]
    rep, presence, frequency = 1.8, 0.7, 0.4
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=rep,
                            presence_penalty=presence, frequency_penalty=frequency)
    # Prefix caching would reuse the prompt's pages from earlier tests: that is part of what is tested.
    got = token_ids(llm.generate([prompt, random_prompts(1, seed=5)[0]], [params, GREEDY], use_tqdm=False))[0]

    step = jax.jit(forward_all_logits, static_argnums=(3, 4))
    tokens = list(prompt)
    for _ in range(10):
        pages = list(range(1, -(-len(tokens) // 16) + 1))
        batch = jax.tree.map(jnp.asarray, build_step_batch([(tokens, 0, pages)], num_tokens=len(tokens), num_seqs=1,
                                                           pages_per_seq=len(pages)))
        logits, _ = step(tiny.weights, create_kv_cache(tiny.config, len(pages) + 1, 16, jnp.float32), batch,
                         tiny.config, "reference")
        row = np.asarray(logits[-1], np.float64)
        seen = set(tokens)
        counts = np.bincount(tokens[len(prompt):], minlength=row.size)
        for t in seen:
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
        row -= frequency * counts + presence * (counts > 0)
        tokens.append(int(np.argmax(row)))
    assert got == tokens[len(prompt):]


def test_zero_compilations_after_warmup_across_the_workload(llm):
    # Runs last in this module: every test above used the same engine with varied shapes,
    # sampling features (penalties, logprobs, top-p, min_tokens bans) and batch compositions.
    assert llm.engine.runner.warmup_done
    assert llm.engine.stats()["num_compilations_after_warmup"] == 0


def test_no_step_program_branches_on_a_device_value(llm):
    # On the GPU a conditional copies its predicate to the host and waits for it, so a
    # lax.cond anywhere in a step made every dispatch block until the device got there (the
    # H200 idled half of each decode step). Every program a step runs must be branch-free.
    from jaxinfer.runner import SAMPLER_PATHS

    runner = llm.engine.runner
    for num_tokens, num_seqs, pages in runner.buckets.all():
        fn, args, kwargs = runner._step_call(runner.empty_inputs(num_tokens, num_seqs, pages))
        with runner.placement.context():
            assert "stablehlo.case" not in fn.lower(*args, **kwargs).as_text()
        for path in SAMPLER_PATHS:
            args, kwargs = runner._sampler_call(runner.empty_inputs(num_tokens, num_seqs, pages, path))
            # XLA:CPU only: the random stage sits under one cond that all-greedy steps skip
            # (jaxinfer.sampling._sample_random_rows); a CPU conditional reads its predicate in
            # place. Other backends' samplers have none (tests/test_sampling.py checks that).
            allowed = int(jax.default_backend() == "cpu" and SAMPLER_PATHS[path].any_random)
            assert runner._sampler.lower(*args, **kwargs).as_text().count("stablehlo.case") <= allowed, path


def test_llm_close_frees_weights_and_cache_and_refuses_to_generate():
    from jaxinfer.llm import LLM

    with LLM(str(FIXTURES / "tiny-llama3"), max_model_len=64, max_num_seqs=2, num_pages=16, use_tqdm=False) as llm:
        engine = llm.engine
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    assert engine.runner.cache.k[0].is_deleted() and engine.model.weights.embed.is_deleted()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()  # twice is fine


def test_llm_close_leaves_a_lent_model_to_its_owner():
    # A notebook loads once and builds several LLMs over the same model: closing one (a `with`
    # block) must not free the weights under the next (it did, until session 16).
    from jaxinfer.checkpoint import load_model

    model = load_model(FIXTURES / "tiny-llama3", dtype="float32")
    options = dict(max_model_len=64, max_num_seqs=2, num_pages=16, use_tqdm=False, warm_up=False)
    outputs = []
    for _ in range(2):
        with LLM(loaded=model, **options) as llm:
            engine = llm.engine
            output = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
            outputs.append(output.outputs[0].token_ids)
        assert engine.runner.cache.k[0].is_deleted()  # what the LLM made is freed
        assert not any(a.is_deleted() for a in jax.tree.leaves(model.weights))  # what it was lent is not
    assert outputs[0] == outputs[1] and outputs[0]


def test_clearing_jax_caches_recompiles_without_counting_new_programs(tiny):
    """``jax.clear_caches()`` (a notebook, tests/map_budget.py) makes warmed programs compile
    again: that is no new program, and the count never goes negative."""
    llm = make_llm(tiny, num_pages=64)
    prompts = random_prompts(4, seed=9)
    before = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    jax.clear_caches()
    assert llm.engine.stats()["num_compilations_after_warmup"] == 0
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == before
    assert llm.engine.stats()["num_compilations_after_warmup"] == 0

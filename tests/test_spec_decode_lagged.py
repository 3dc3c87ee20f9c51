"""Asynchronous verify steps (``speculative_config.async_verify``, ``jaxinfer.spec_decode.lagged``) on CPU, f32.

The device drafts step N+1 from step N's output and the host learns step N's accepted count a
step late, so these tests check what that could break: positions shifted by the accepted
count, the token history, rollback with a step in flight, preemption and prefix caching,
stops and ``max_tokens`` inside a run, logprobs, seeds. Random fixture weights rarely repeat
themselves, so the device lookup is replaced by an *oracle* (a host callback from the
jitted verifier, installed before the engine compiles): the plain run's own continuation,
corrupted at fixed positions, as ``test_spec_decode``'s oracle drafts on the host. The
history it is given is the one the device gathered, so a wrong shift or rollback shows as
an unknown context (no drafts) or a changed token. The real device lookup runs on the
default model (slow) and in ``test_spec_decode_device``.
"""

import itertools

import numpy as np
import pytest

import jax

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine import Engine
from jaxinfer.spec_decode import device_ngram as device_ngram_module
from jaxinfer.spec_decode import speculator as speculator_module

from .test_page_allocator import check_allocator_invariants
from .test_spec_decode import (GREEDY, K, OPTIONS, SPEC, _greedy_reference, check_logprobs_match_plain, prompts_of,
                               run_to_completion, token_ids)
from .test_spec_decode import plain, tiny  # noqa: F401 (fixtures)

LAGGED = {**SPEC, "async_verify": True}
# The real proposers: the module-scoped ``lagged`` fixture patches them until the module ends, so a
# test that needs the real lookup while that fixture lives puts these back.
REAL_DEVICE_LOOKUP = device_ngram_module.propose_ngram_on_device
REAL_HOST_LOOKUP = speculator_module.propose_ngram
_KNOWN: list[tuple[list[int], list[int]]] = []  # (prompt, continuation) pairs the oracle drafts from


_MISREAD: list[list[int]] = []  # contexts whose prompt is known but whose generated tokens are not the run's


def _oracle_drafts(context: list[int], num_drafts: int) -> list[int]:
    misread = False
    for prompt, continuation in _KNOWN:
        if context[: len(prompt)] == prompt:
            done = len(context) - len(prompt)
            generated = context[len(prompt):]
            # (A step dispatched before its sequence finished may look one token past the run.)
            if generated[: len(continuation)] != continuation[:done]:
                # The device's token history lost a token (an accepted draft stored as what the host
                # scheduled, say): a real lookup would miss there, though the output stays right.
                misread = True
                continue
            drafts = continuation[done : done + num_drafts]
            # About a third of the positions corrupted (a hash of the context length and the
            # position), so runs are rejected at changing places.
            return [(t + 1) % 500 if (len(context) * 2654435761 + i * 40503) >> 7 & 3 == 0 else t
                    for i, t in enumerate(drafts)]
    if misread:
        _MISREAD.append(context)
    return []


def _device_oracle(history, lengths, rooms, *, num_speculative_tokens, min_n, max_n):
    k = num_speculative_tokens

    def lookup(history, lengths, rooms):
        draft_ids = np.zeros((history.shape[0], k), np.int32)
        num_drafts = np.zeros(history.shape[0], np.int32)
        for b, (row, length, room) in enumerate(zip(history, lengths, rooms)):
            drafts = _oracle_drafts(row[:length].tolist(), min(int(room), k)) if length > 0 else []
            draft_ids[b, : len(drafts)] = drafts
            num_drafts[b] = len(drafts)
        return draft_ids, num_drafts

    shapes = (jax.ShapeDtypeStruct((history.shape[0], k), np.int32), jax.ShapeDtypeStruct((history.shape[0],), np.int32))
    return jax.pure_callback(lookup, shapes, history, lengths, rooms)


@pytest.fixture(scope="module")
def lagged(tiny):
    with pytest.MonkeyPatch.context() as patch:
        # Installed before the engine compiles its verifiers, which trace the lookup.
        patch.setattr(device_ngram_module, "propose_ngram_on_device", _device_oracle)
        patch.setattr(speculator_module, "propose_ngram",
                      lambda context, num_drafts, min_n, max_n: _oracle_drafts(context.tolist(), num_drafts))
        # Greedy admission: the preemption test below squeezes this engine's pool and wants it to preempt.
        yield LLM(loaded=tiny, speculative_config=LAGGED, **{**OPTIONS, "scheduling_admission": "greedy"})
        _KNOWN.clear()


def know(prompts, continuations):
    _KNOWN[:] = [(list(p), list(c)) for p, c in zip(prompts, continuations)]


@pytest.fixture
def host_reads(monkeypatch):
    """Records, for each verify step the engine reads, whether a later step was already dispatched."""
    reads = []
    process = Engine._process_verified

    def recording(self, launched, changed):
        reads.append(self._launched is not None)
        return process(self, launched, changed)

    monkeypatch.setattr(Engine, "_process_verified", recording)
    return reads


def test_greedy_identical_and_the_host_reads_each_verify_step_a_step_late(plain, lagged, host_reads):
    prompts = prompts_of(6, seed=1)
    reference = _greedy_reference(plain, prompts, GREEDY)
    know(prompts, reference)
    before = lagged.engine.stats()
    assert token_ids(lagged.generate(prompts, GREEDY, use_tqdm=False)) == reference
    after = lagged.engine.stats()
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    assert accepted > 20 and drafted > 1.2 * accepted  # long runs, and rejections among them
    assert not _MISREAD  # the device drafted from each sequence's true tokens, accepted drafts included
    # The verify steps were read with the next one already dispatched; only the last (nothing left
    # to dispatch) and those ending speculation for good are read alone.
    assert len(host_reads) > 10 and sum(host_reads) >= len(host_reads) - 2
    assert [token_ids(lagged.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts[:2]] == reference[:2]
    stats = lagged.engine.stats()
    assert stats["num_compilations_after_warmup"] == 0
    assert stats["num_pages_used"] == 0


def test_greedy_identical_under_preemption_and_prefix_caching_without_page_leaks(tiny, plain, lagged):
    shared = prompts_of(1, seed=2, low=40, high=41)[0]
    prompts = [shared + p for p in prompts_of(8, seed=3, low=2, high=20)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reference = _greedy_reference(plain, prompts, params)
    know(prompts, reference)
    engine = lagged.engine
    engine.allocator.reset_prefix_cache()
    # Leave the batch fewer pages than it needs, as test_spec_decode's tight engine has, so the
    # scheduler preempts: held out of the pool here rather than compiling another engine.
    hoarder = engine.allocator._free_pages
    held = [hoarder.pop() for _ in range(engine.allocator.num_free_pages - (128 // 16 + 4))]

    def check_pages():
        for seq in engine.scheduler.running:  # never more than its tokens and two steps of drafts
            assert len(seq.page_table) <= engine.allocator.num_pages_for(seq.num_tokens + 2 * K)

    try:
        outputs = run_to_completion(engine, prompts, params, after_step=check_pages)
    finally:
        hoarder.extend(held)
    check_allocator_invariants(engine.allocator, [])
    assert outputs == reference
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["num_pages_used"] == 0


def test_stops_and_max_tokens_inside_an_accepted_run(plain, lagged):
    prompt = prompts_of(1, seed=4)[0]
    free = _greedy_reference(plain, [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    know([prompt], [free])
    for max_tokens in range(1, 10):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        out = lagged.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free[:max_tokens] and out.finish_reason == "length"
    for stop_at in range(2, 10):
        params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[free[stop_at]], ignore_eos=True)
        expected = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        out = lagged.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (
            expected.token_ids, expected.finish_reason, expected.stop_reason)
    assert lagged.engine.stats()["num_pages_used"] == 0


def test_logprobs_and_seeds_with_lagged_steps(plain, lagged):
    check_logprobs_match_plain(plain, lagged, know)

    prompts = prompts_of(3, seed=6)
    params = SamplingParams(temperature=0.9, top_k=50, max_tokens=16, seed=123, ignore_eos=True)
    first = token_ids(lagged.generate(prompts, params, use_tqdm=False))
    know(prompts, first)  # drafts that match: accepted often, each with probability p(d)
    again = token_ids(lagged.generate(prompts, params, use_tqdm=False))
    assert again == token_ids(lagged.generate(prompts, params, use_tqdm=False))
    assert token_ids(lagged.generate(prompts[1:2], params, use_tqdm=False))[0] == again[1]


def test_sequences_that_do_not_speculate_share_lagged_steps_exactly(plain, lagged):
    """Penalties, min_tokens and top-k sampling beside a speculating sequence: their rows are
    sampled as in a plain step, at their true step, though the host counts lag behind."""
    prompts = prompts_of(4, seed=10)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, presence_penalty=1.5, repetition_penalty=1.2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, min_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=5, max_tokens=16, seed=7, ignore_eos=True)]
    reference = [token_ids(plain.generate([p], q, use_tqdm=False))[0] for p, q in zip(prompts, params)]
    know(prompts[:1], reference[:1])
    before = lagged.engine.stats()["spec_decode_num_accepted_tokens"]
    got = token_ids(lagged.generate(prompts, params, use_tqdm=False))
    assert lagged.engine.stats()["spec_decode_num_accepted_tokens"] > before
    assert got == reference


def test_a_constrained_request_arriving_mid_run_ends_lagged_steps_exactly(plain, lagged, host_reads):
    """A grammar needs a plain (masked) step: the engine reads the verify step in flight, steps
    plainly while the constrained request runs, then speculates again; every output unchanged."""
    from jaxinfer.sampling_params import StructuredOutputsParams

    prompts = prompts_of(2, seed=12)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    reference = _greedy_reference(plain, prompts, params)
    expected = plain.generate([prompts[1]], constrained, use_tqdm=False)[0].outputs[0]
    know(prompts[:1], reference[:1])
    engine = lagged.engine
    engine.add_request("free", prompts[0], params)
    outputs = {}
    for step in itertools.count():
        if step == 8:
            engine.add_request("constrained", prompts[1], constrained)
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0]
        if not engine.has_unfinished_requests():
            break
    assert outputs["free"].token_ids == reference[0]
    assert (outputs["constrained"].token_ids, outputs["constrained"].text) == (expected.token_ids, expected.text)
    assert not all(host_reads) and sum(host_reads) > 3  # read alone to stop, a step late otherwise
    stats = engine.stats()
    assert stats["num_compilations_after_warmup"] == 0 and stats["num_pages_used"] == 0


def test_random_arrivals_of_free_and_constrained_requests_keep_outputs_and_pages(plain, lagged, monkeypatch):
    """Randomized rounds (seeded): 1-4 requests arriving at random steps, about a third constrained
    by a grammar whose compilation is held back a random number of steps, ``max_tokens`` 1-40.
    Each output is the plain engine's for that request alone, the allocator's invariants hold
    after every step, and no page is left at the end. (Found nothing when written, over 2,350
    rounds of another seed; outputs differed once, at a 1e-6 near-tie of the random weights.)"""
    import random

    from jaxinfer.sampling_params import StructuredOutputsParams
    from jaxinfer.structured_output.matchers import GrammarMatchers

    rng = random.Random(20261202)
    take_ready = GrammarMatchers.take_ready

    def held_back_take_ready(self):
        if self.num_waiting and rng.random() < 0.6:
            return []  # as if the grammar were still compiling
        for _, template in list(self._waiting.values()):
            template.result()  # deterministic: compiled once no longer held back
        return take_ready(self)

    monkeypatch.setattr(GrammarMatchers, "take_ready", held_back_take_ready)
    engine = lagged.engine
    for round_index in range(40):
        requests = []
        for i, prompt in enumerate(prompts_of(rng.randint(1, 4), seed=rng.randint(0, 10**6))):
            if rng.random() < 0.35:
                regex = rng.choice(["[a-z]+", "[0-9]+", "(yes|no)"])
                params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 8),
                                        structured_outputs=StructuredOutputsParams(regex=regex))
            else:
                params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True)
            requests.append((f"{round_index}-{i}", prompt, params, rng.randint(0, 14)))
        expected = {request_id: plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
                    for request_id, prompt, params, _ in requests}
        free = [(prompt, expected[request_id]) for request_id, prompt, params, _ in requests
                if params.structured_outputs is None]
        know([prompt for prompt, _ in free], [tokens for _, tokens in free])
        outputs = {}
        for step in itertools.count():
            for request_id, prompt, params, arrival in requests:
                if arrival == step:
                    engine.add_request(request_id, prompt, params)
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output.outputs[0].token_ids
            check_allocator_invariants(engine.allocator, engine.scheduler.running)
            if step > 14 and not engine.has_unfinished_requests():
                break
        assert outputs == expected, f"round {round_index}"
    stats = engine.stats()
    assert stats["num_pages_used"] == 0 and stats["num_compilations_after_warmup"] == 0


def test_async_verify_needs_the_ngram_method():
    from jaxinfer.errors import RequestError
    from jaxinfer.spec_decode.config import SpeculativeConfig

    with pytest.raises(RequestError) as error:
        SpeculativeConfig.from_value({"model": "some-draft", "async_verify": True})
    assert error.value.field == "speculative_config.async_verify"


@pytest.mark.slow
def test_default_model_lagged_ngram_greedy_identical_and_accepting(default_model, monkeypatch):
    """SmolLM2-135M, real weights, the device's own prompt lookup: a copy prompt is mostly accepted."""
    # After the fixture-model tests of this module the oracle is still installed (module scope).
    monkeypatch.setattr(device_ngram_module, "propose_ngram_on_device", REAL_DEVICE_LOOKUP)
    monkeypatch.setattr(speculator_module, "propose_ngram", REAL_HOST_LOOKUP)
    passage = ("The committee met on Tuesday to review the budget. It approved the new library roof, "
               "postponed the bridge repairs until spring, and asked the treasurer for a report on parking fees.")
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{passage}"}]
    params = SamplingParams(temperature=0, max_tokens=48)
    options = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128, use_tqdm=False, max_wait_s=0.0)
    expected = LLM(loaded=default_model, **options).chat(messages, params, use_tqdm=False)[0].outputs[0]
    spec = LLM(loaded=default_model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                         "async_verify": True}, **options)
    got = spec.chat([messages, messages], params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [expected.token_ids] * 2
    stats = spec.engine.stats()
    assert stats["spec_decode_mean_acceptance_length"] > 2
    assert stats["num_compilations_after_warmup"] == 0 and stats["num_pages_used"] == 0

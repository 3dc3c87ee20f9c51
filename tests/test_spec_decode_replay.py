"""The replay (``jaxinfer.spec_decode.replay``) counts what the engine counts, run for run.

The acceptance benchmark measures proposers by replaying them over recorded greedy outputs;
that is only honest if a replay gives the engine's own numbers. Here the engine speculates on
the tiny fixture (greedy, one request at a time) and the replay, given the plain run's output
and the same proposer, must give the same drafts, draft tokens and accepted tokens.
"""

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.checkpoint import load_model
from jaxinfer.spec_decode import speculator as speculator_module
from jaxinfer.spec_decode.config import SpeculativeConfig
from jaxinfer.spec_decode.ngram import propose_ngram
from jaxinfer.spec_decode.replay import ReplayCounts, replay_greedy

from .conftest import FIXTURES, REPO

OPTIONS = dict(max_model_len=96, max_num_seqs=1, max_num_batched_tokens=64, num_pages=32, page_size=16,
               use_tqdm=False, max_wait_s=0.0)
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def tiny():
    return load_model(FIXTURES / "tiny-llama3", dtype="float32")


def noisy_oracle(prompt, continuation):
    """Drafts the plain run's continuation with a third of the positions wrong (a hash of the
    context length and the position), so runs are accepted, cut short and rejected."""

    def propose(context, num_drafts, min_n=1, max_n=1):
        done = len(context) - len(prompt)
        drafts = continuation[done: done + num_drafts]
        return [(t + 1) % 500 if (len(context) * 2654435761 + i * 40503) >> 7 & 3 == 0 else t
                for i, t in enumerate(drafts)]

    return propose


@pytest.mark.parametrize("judge", [dict(), dict(judge_after_steps=3, min_accepted_per_step=3.0)])
def test_replay_counts_equal_the_engines(tiny, monkeypatch, judge):
    # The replay follows the synchronous schedule (host drafts), which the oracle below drafts for.
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, async_verify=False, **judge)
    plain = LLM(loaded=tiny, **OPTIONS)
    spec = LLM(loaded=tiny, speculative_config=config, **OPTIONS)
    rng = np.random.default_rng(3)
    total = ReplayCounts()
    for length in (9, 21):
        prompt = rng.integers(1, 500, size=length).tolist()
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        output = plain.generate([prompt], params)[0].outputs[0].token_ids
        propose = noisy_oracle(prompt, output)
        monkeypatch.setattr(speculator_module, "propose_ngram", propose)
        before = spec.engine.stats()
        assert spec.generate([prompt], params)[0].outputs[0].token_ids == output
        after = spec.engine.stats()
        counts = replay_greedy(prompt, output, lambda context, room: propose(context, room), config,
                               max_tokens=MAX_TOKENS, max_model_len=OPTIONS["max_model_len"])
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert getattr(counts, name) == after[f"spec_decode_{name}"] - before[f"spec_decode_{name}"], name
        total += counts
    assert total.num_accepted_tokens > 0 and total.num_accepted_tokens < total.num_draft_tokens
    if judge:  # k = 3 cannot gain 3.0 a step: judged low once it has drafted in 3 steps
        assert total.num_drafts <= 2 * 3
    else:
        assert total.num_drafts > 2 * 3


def test_replay_of_a_copy_counts_steps_by_hand():
    """An output that copies its prompt: 6 tokens in 3 target steps, counted by hand."""
    config = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1)
    prompt, output = [1, 2, 3, 4, 5, 6, 0], [1, 2, 3, 4, 5, 6]

    def lookup(context, room):
        return propose_ngram(context, room, config.prompt_lookup_min, config.prompt_lookup_max)

    counts = replay_greedy(prompt, output, lookup, config, max_tokens=64, max_model_len=64)
    # prefill -> "1"; step: context ends "0 1", drafts "2 3" accepted + "4"; step: drafts "5 6"
    # accepted and the output ends there (the run is not recorded: the sequence finished).
    assert (counts.num_steps, counts.num_drafts, counts.num_accepted_tokens) == (3, 1, 2)
    assert counts.tokens_per_step == 2.0
    capped = replay_greedy(prompt, output, lookup, config, max_tokens=6, max_model_len=64)
    assert capped.num_steps == 3  # room for the last run: 6 - 4 - 1 = 1 draft, + the token after it


def test_lookup_variants_of_the_benchmark_pick_the_match_they_name():
    """benchmarks/spec_decode.py's variants, on a context where they disagree (by hand)."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from spec_decode import lookup_variant

    context = np.array([5, 1, 2, 1, 2, 9, 1, 2], np.int32)  # a 5-token prompt, then 9 1 2
    assert lookup_variant("latest", 1, 3, 5)(context, 6) == [9, 1, 2]  # the latest "1 2", then the end
    assert lookup_variant("earliest", 1, 3, 5)(context, 6) == [1, 2, 9, 1, 2]
    assert lookup_variant("overlap", 1, 3, 5)(context, 6) == [9, 1, 2, 9, 1, 2]  # copies through its own drafts
    assert lookup_variant("prompt-only", 1, 3, 4)(context, 6) == [1, 2, 9, 1, 2]  # the only "1 2" in the first 4 tokens
    assert lookup_variant("latest", 1, 3, 5)(context, 6) == propose_ngram(context, 6, 1, 3)

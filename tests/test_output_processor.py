"""The output processor on hand-made sampler outputs: placeholders filled, stops, logprobs, outputs."""

import numpy as np
import pytest

from jaxinfer.output_processor import FetchedSamples, OutputProcessor, RequestState
from jaxinfer.sampling import SamplerOutput
from jaxinfer.sampling_params import SamplingParams, SequenceSampling
from jaxinfer.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from jaxinfer.tokenizer import Tokenizer

from .conftest import FIXTURES

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_hf_dir(FIXTURES / "tiny-llama3")


def make_request(tokenizer, request_id, params, first_seq_id, n=1, final_only=False):
    seqs = [Sequence(first_seq_id + i, request_id, [5, 6, 7], sampling=SequenceSampling(params, 0, params.max_tokens, i))
            for i in range(n)]
    return RequestState(request_id, None, [5, 6, 7], params, seqs, tokenizer, 0.0, final_only)


def fetched(token_ids, logprobs=None):
    if logprobs is None:
        return FetchedSamples(token_ids, None)
    num_rows = len(token_ids)
    top_ids = np.tile(np.arange(10, 13), (num_rows, 1))
    top_values = np.tile(np.array([-0.1, -0.2, -0.3], np.float32), (num_rows, 1))
    return FetchedSamples(token_ids, SamplerOutput(np.asarray(token_ids), np.asarray(logprobs, np.float32),
                                                   top_ids, top_values))


def launch(seqs):
    """What the engine does at launch: a placeholder for each token being sampled."""
    for seq in seqs:
        seq.append_token(PLACEHOLDER_TOKEN)


def test_tokens_fill_the_earliest_placeholder_and_stop_by_each_rule(tokenizer):
    processor = OutputProcessor(frozenset({EOS}))
    length = make_request(tokenizer, "length", SamplingParams(max_tokens=2, ignore_eos=True), 0)
    stop_id = make_request(tokenizer, "stop-id", SamplingParams(max_tokens=9, stop_token_ids=[40], min_tokens=2), 1)
    eos = make_request(tokenizer, "eos", SamplingParams(max_tokens=9), 2)
    seqs = [r.seqs[0] for r in (length, stop_id, eos)]
    by_seq = {0: length, 1: stop_id, 2: eos}
    sampled = [(seq, row) for row, seq in enumerate(seqs)]

    launch(seqs)  # step 1 launched
    launch(seqs)  # step 2 launched before step 1's tokens are read (async scheduling)
    changed = {}
    stops = processor.process(sampled, fetched([EOS, 40, 31]), by_seq, changed)
    assert [seq.token_ids[3:] for seq in seqs] == [[EOS, PLACEHOLDER_TOKEN], [40, PLACEHOLDER_TOKEN],
                                                    [31, PLACEHOLDER_TOKEN]]
    assert stops == []  # EOS ignored; the stop id is the first of min_tokens 2; 31 stops nothing
    assert list(changed) == ["length", "stop-id", "eos"]

    stops = processor.process(sampled, fetched([EOS, 40, EOS]), by_seq, {})
    assert [(seq.request_id, reason) for seq, reason in stops] == [("length", "length"), ("stop-id", "stop"),
                                                                    ("eos", "stop")]
    assert stop_id.stop_reasons == [40] and eos.stop_reasons == [None]
    assert processor.num_generation_tokens == 6
    assert length.output_token_ids == [[EOS, EOS]]


def test_logprobs_entries_and_final_only_outputs(tokenizer):
    processor = OutputProcessor(frozenset({EOS}))
    streamed = make_request(tokenizer, "streamed", SamplingParams(max_tokens=5, logprobs=2, ignore_eos=True), 0)
    final = make_request(tokenizer, "final", SamplingParams(max_tokens=5), 1, n=2, final_only=True)
    seqs = streamed.seqs + final.seqs
    by_seq = {0: streamed, 1: final, 2: final}
    launch(seqs)
    changed = {}
    processor.process([(seq, row) for row, seq in enumerate(seqs)], fetched([11, 30, 31], [-0.2, -1, -2]),
                      by_seq, changed)
    # The sampled token's logprob first, then the top 2 (11 is among them: no second entry).
    assert streamed.logprobs == [[{11: pytest.approx(-0.2), 10: pytest.approx(-0.1)}]]
    assert streamed.cumulative_logprob == [pytest.approx(-0.2)]
    outputs = OutputProcessor.collect(changed)
    assert [o.request_id for o in outputs] == ["streamed"]  # "final" waits until it finishes
    assert outputs[0].outputs[0].token_ids == [11] and outputs[0].outputs[0].logprobs is not None
    assert final.output(is_finished=False).outputs[1].logprobs is None  # not asked for


def test_plain_final_only_requests_stop_by_the_same_rules_and_decode_the_same_text(tokenizer):
    """Final-only requests without logprobs or stop strings skip the per-token work: they stop
    exactly where a streamed twin does, enter ``changed`` only when a sample stops, and their
    text is the decode of their tokens."""
    processor = OutputProcessor(frozenset({EOS}))
    cases = [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=9, stop_token_ids=[40], min_tokens=2),
             SamplingParams(max_tokens=9), SamplingParams(max_tokens=9, min_tokens=3)]
    plain = [make_request(tokenizer, f"plain{i}", params, i, final_only=True) for i, params in enumerate(cases)]
    streamed = [make_request(tokenizer, f"streamed{i}", params, 10 + i) for i, params in enumerate(cases)]
    assert all(r.is_plain for r in plain) and not any(r.is_plain for r in streamed)
    requests = plain + streamed
    by_seq = {r.seqs[0].seq_id: r for r in requests}
    seqs = [r.seqs[0] for r in requests]
    sampled = [(seq, row) for row, seq in enumerate(seqs)]
    stopped_at = {}
    for step, tokens in enumerate([[EOS, 40, 300, EOS], [400, 40, 301, 302], [EOS, 41, EOS, EOS], [5, 6, 7, EOS]]):
        launch([seq for seq in seqs if not seq.is_finished])
        live_streamed = {r.request_id for r in streamed if not r.seqs[0].is_finished}
        changed = {}
        stops = processor.process(sampled, fetched(tokens * 2), by_seq, changed)
        for seq, reason in stops:
            stopped_at[seq.request_id] = (step, reason)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
            seq.drop_placeholders()
        assert set(changed) == {seq.request_id for seq, _ in stops} | live_streamed
    assert stopped_at == {"plain0": (2, "length"), "plain1": (1, "stop"), "plain2": (2, "stop"), "plain3": (2, "stop"),
                          "streamed0": (2, "length"), "streamed1": (1, "stop"), "streamed2": (2, "stop"),
                          "streamed3": (2, "stop")}
    for p, s in zip(plain, streamed):
        assert p.output_token_ids == s.output_token_ids
        assert p.output(True).outputs[0].text == s.output(True).outputs[0].text == tokenizer.decode(p.output_token_ids[0])
    assert plain[1].stop_reasons == [40]


def test_fill_next_token_fills_the_earliest_placeholder_or_appends():
    seq = Sequence(0, "r", [1, 2])
    seq.append_token(PLACEHOLDER_TOKEN)
    seq.append_token(PLACEHOLDER_TOKEN)
    seq.fill_next_token(7)
    assert seq.token_ids == [1, 2, 7, PLACEHOLDER_TOKEN] and seq.num_placeholders == 1
    seq.fill_next_token(8)
    seq.fill_next_token(9)  # none left: a later token of an accepted run
    assert seq.token_ids == [1, 2, 7, 8, 9] and not seq.has_placeholder
    with pytest.raises(ValueError, match="sampled token ids are >= 0"):
        seq.fill_next_token(PLACEHOLDER_TOKEN)

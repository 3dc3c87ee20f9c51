"""Packing a Schedule into step inputs, checked by hand on small schedules (no model, no device)."""

import numpy as np
import pytest

from jaxinfer.input_batch import MAX_BANNED, PackedStep, pack_step
from jaxinfer.page_table_rows import PageTableRows
from jaxinfer.runner import Buckets
from jaxinfer.sampling_params import SamplingParams, SequenceSampling
from jaxinfer.scheduler import Schedule, ScheduledSeq
from jaxinfer.sequence import PLACEHOLDER_TOKEN, Sequence

BUCKETS = Buckets(num_tokens=(8, 16), num_seqs=(4,), pages_per_seq=(2, 4))
VOCAB = 100


def make_seq(seq_id, prompt, generated=(), params=None, seed=0, banned=()):
    sampling = SequenceSampling(params or SamplingParams(temperature=0), seed, max_tokens=50,
                                banned_before_min_tokens=banned)
    seq = Sequence(seq_id, f"r{seq_id}", prompt, sampling=sampling)
    for token in generated:
        seq.append_token(token)
    seq.page_table = [10 + seq_id, 20 + seq_id][: -(-seq.num_tokens // 16)]
    return seq


def decode(seq):
    return ScheduledSeq(seq, 1, seq.num_tokens - 1, samples_token=True)


def chunk(seq, start, num_new):
    return ScheduledSeq(seq, num_new, start, samples_token=start + num_new == seq.num_tokens)


def schedule_of(*items):
    return Schedule(tuple(items), (), sum(item.num_new_tokens for item in items))


def test_a_decode_reads_its_placeholder_from_the_previous_steps_row():
    a = make_seq(0, [5, 6, 7], generated=[8, PLACEHOLDER_TOKEN], params=SamplingParams(temperature=0.5), seed=11)
    b = make_seq(1, [1, 2, 3, 4, 5, 6])
    previous = PackedStep(inputs=None, sampled=[(b, 0), (a, 3)])  # a sampled at row 3 last step
    packed = pack_step(schedule_of(decode(a), chunk(b, 0, 4)), BUCKETS, previous, VOCAB)
    inputs = packed.inputs
    assert inputs.batch.num_tokens == 8 and inputs.batch.num_seqs == 4
    assert inputs.batch.token_ids.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]  # the placeholder is sent as 0
    assert inputs.prev_rows.tolist() == [3, -1, -1, -1, -1, -1, -1, -1]  # ... and read from row 3
    assert inputs.batch.positions[:5].tolist() == [4, 0, 1, 2, 3]
    assert inputs.batch.page_tables[:2, :1].tolist() == [[10], [11]]
    # Only a's chunk reaches its end: one sampled row, at a's slot; b's prefill samples nothing.
    assert [(seq.seq_id, row) for seq, row in packed.sampled] == [(0, 0)]
    assert inputs.sampler_path == "basic" and not packed.wants_logprobs
    assert inputs.sampling.temperature.tolist() == [0.5, 0, 0, 0]
    assert inputs.sampling.seed.tolist() == [11, 0, 0, 0]
    assert inputs.sampling.step.tolist() == [2, 0, 0, 0]  # tokens generated before this one


def test_a_recomputed_prefill_reads_every_placeholder_it_holds():
    # Preempted with a sample in flight: the recompute chunk ends in a placeholder.
    seq = make_seq(0, [1, 2, 3], generated=[4, PLACEHOLDER_TOKEN])
    previous = PackedStep(inputs=None, sampled=[(seq, 2)])
    packed = pack_step(schedule_of(chunk(seq, 0, 5)), BUCKETS, previous, VOCAB)
    assert packed.inputs.batch.token_ids[:5].tolist() == [1, 2, 3, 4, 0]
    assert packed.inputs.prev_rows[:5].tolist() == [-1, -1, -1, -1, 2]
    assert packed.last_row_of_each_seq() == {0: 0}


def test_one_row_needing_the_full_sampler_takes_the_step_there():
    plain = make_seq(0, [1, 2])
    top_k = make_seq(1, [3], params=SamplingParams(temperature=1.0, top_k=VOCAB + 5, top_p=0.9, logprobs=2))
    held = make_seq(2, [4], params=SamplingParams(temperature=0, min_tokens=2), banned=(2, 7))
    done_holding = make_seq(3, [5], generated=[9, 9], params=SamplingParams(temperature=0, min_tokens=2), banned=(2,))
    items = [chunk(plain, 0, 2), chunk(top_k, 0, 1), chunk(held, 0, 1), chunk(done_holding, 0, 3)]
    packed = pack_step(schedule_of(*items), BUCKETS, None, VOCAB)
    sampling = packed.inputs.sampling
    assert packed.inputs.sampler_path == "full" and packed.wants_logprobs
    assert sampling.top_k.tolist() == [0, 0, 0, 0]  # past the vocabulary: off
    assert sampling.top_p.tolist() == [1.0, np.float32(0.9), 1.0, 1.0]
    assert sampling.banned_ids.shape == (4, MAX_BANNED)
    assert sampling.banned_ids[2, :3].tolist() == [2, 7, -1]  # before min_tokens: banned
    assert (sampling.banned_ids[[0, 1, 3]] == -1).all()  # min_tokens reached: nothing banned
    assert sampling.num_prompt_tokens.tolist() == [2, 1, 1, 1]


def test_buckets_grow_with_the_step():
    seqs = [make_seq(i, list(range(1, 31))) for i in range(3)]
    packed = pack_step(schedule_of(*(chunk(s, 0, 5) for s in seqs)), BUCKETS, None, VOCAB)
    assert (packed.inputs.batch.num_tokens, packed.inputs.batch.page_tables.shape) == (16, (4, 2))
    assert packed.inputs.batch.cu_q_lens.tolist() == [0, 5, 10, 15, 15]
    assert packed.sampled == []


def test_a_full_decode_step_has_a_gpu_bucket_of_its_own():
    from jaxinfer.runner import default_buckets

    buckets = default_buckets(384, 8192, 64, "gpu")
    assert buckets.num_tokens == (8, 16, 32, 64, 128, 256, 384, 512, 1024, 2048, 4096, 8192)
    assert buckets.pick(384, 384, 64) == (384, 384, 64)  # not 512 rows for 384 tokens
    assert buckets.pick(330, 330, 64) == (384, 384, 64)
    assert buckets.pick(385, 200, 64) == (512, 384, 64)
    # Fewer sequences than the smallest bucket: nothing to add.
    assert default_buckets(5, 8192, 64, "gpu").num_tokens[0] == 8


def test_decode_steps_above_256_rows_pad_by_less_than_half():
    from jaxinfer.runner import default_buckets

    buckets = default_buckets(1024, 8192, 64, "gpu")
    assert buckets.num_tokens == (8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 2048, 4096, 8192)
    assert buckets.num_seqs == (8, 16, 32, 64, 128, 256, 384, 512, 768, 1024)
    assert buckets.pick(561, 561, 64) == (768, 768, 64)  # was (1024, 1024): 83% padded rows
    assert buckets.pick(257, 257, 64) == (384, 384, 64)
    assert buckets.pick(1500, 700, 64) == (2048, 1024, 64)  # prefill-sized steps: powers of two as before
    for n in range(257, 1025):
        assert buckets.pick(n, n, 64)[0] < 1.5 * n, n  # was up to 2n
    assert 1536 in default_buckets(2048, 8192, 64, "gpu").num_seqs
    # At most 256 sequences, and on CPU, nothing changes.
    assert default_buckets(256, 8192, 64, "gpu").num_tokens == (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert 384 not in default_buckets(1024, 8192, 64, "cpu").num_tokens


def test_decode_steps_keep_page_table_rows_in_step_with_the_allocator(monkeypatch):
    """The one-token-per-item path keeps the page-table rows between steps: pages appended in
    place, a table replaced (preemption, admission) and one cut by a rollback and regrown to
    the same length must all show in the next step's array, as the general path packs them."""
    from jaxinfer import input_batch
    from jaxinfer.page_allocator import PageAllocator

    monkeypatch.setattr(input_batch, "MIN_ITEMS_FOR_WHOLE_LIST_PACKING", 2)  # these two decodes take that path

    allocator = PageAllocator(num_pages=40, page_size=4, model_identity="test", enable_prefix_caching=False)
    a = make_seq(0, [1, 2, 3])
    b = make_seq(1, [4, 5, 6, 7, 8])
    for seq in (a, b):
        seq.page_table = []
        assert allocator.allocate_prompt(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1

    rows = PageTableRows()  # kept between steps, as the runner keeps it

    def pack_decodes():
        packed = pack_step(schedule_of(decode(a), decode(b)), BUCKETS, None, VOCAB, page_table_rows=rows)
        expected = pack_step(schedule_of(decode(a), chunk(b, b.num_tokens - 2, 2)), BUCKETS, None, VOCAB)
        assert packed.inputs.batch.page_tables[:2].tolist() == expected.inputs.batch.page_tables[:2].tolist()
        return packed.inputs.batch.page_tables[:2].tolist()

    first = pack_decodes()
    assert first[0][:1] == a.page_table and first[1][:2] == b.page_table
    # Grown in place: the new page shows.
    b.append_token(9)
    b.num_computed_tokens = b.num_tokens - 1
    for _ in range(4):
        b.append_token(9)
    assert allocator.allocate_slots(b, b.num_tokens - b.num_computed_tokens)
    assert pack_decodes()[1][:3] == b.page_table and len(b.page_table) == 3
    # Cut by a rollback, then regrown to the same length with a different page (free pages are
    # taken oldest first, so the one just freed is not the one taken).
    cut_page = b.page_table[-1]
    for _ in range(4):
        b.token_ids.pop()
    allocator.free_tail(b)
    for _ in range(4):
        b.append_token(9)
    assert allocator.allocate_slots(b, b.num_tokens - b.num_computed_tokens)
    assert b.page_table[-1] != cut_page and pack_decodes()[1][:3] == b.page_table
    # Replaced (freed and admitted again).
    allocator.free(a)
    assert allocator.allocate_prompt(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens - 1
    assert pack_decodes()[0][:1] == a.page_table


def test_page_table_rows_follow_sequences_that_leave_join_and_move():
    """Rows move with their sequences when the batch's order changes, a new sequence gets its
    own row, a wider table starts afresh, and each result equals the tables padded by hand."""
    seqs = [make_seq(i, [1, 2, 3]) for i in range(4)]
    for i, seq in enumerate(seqs):
        seq.page_table = [100 + i, 200 + i][: 1 + i % 2]
    rows = PageTableRows()

    def expected(order, width):
        return [seq.page_table + [0] * (width - len(seq.page_table)) for seq in order]

    for order, width in [(seqs, 8), (seqs, 8), (seqs[1:], 8), ([seqs[3], seqs[0], seqs[1]], 8),
                         ([seqs[2], seqs[3]], 8), ([seqs[2], seqs[3]], 16)]:
        seqs[3].page_table.append(300 + width)  # grown in place between steps
        seqs[0].page_table = seqs[0].page_table + [400]  # replaced by a longer list
        if len(seqs[0].page_table) > 3:
            seqs[0].page_table = [7]  # replaced by a shorter one
        assert rows.rows(list(order), width).tolist() == expected(order, width)
    with pytest.raises(ValueError, match="sequence 2 needs 17 pages; the page table holds 16"):
        seqs[2].page_table.extend(range(500, 516))
        rows.rows([seqs[3], seqs[2]], 16)


def test_steady_decode_reads_placeholders_from_the_same_rows_or_looks_them_up(monkeypatch):
    """A decode step of the same sequences as the step in flight reads each placeholder from the
    sequence's own row; after one left, the rest are looked up where that step sampled them."""
    from jaxinfer import input_batch

    monkeypatch.setattr(input_batch, "MIN_ITEMS_FOR_WHOLE_LIST_PACKING", 2)
    seqs = [make_seq(i, [1, 2, 3], generated=[4, PLACEHOLDER_TOKEN], params=SamplingParams(temperature=0.7),
                     seed=30 + i) for i in range(3)]
    rows = PageTableRows()
    first = pack_step(schedule_of(*map(decode, seqs)), BUCKETS,
                      PackedStep(None, [(s, b) for b, s in enumerate(seqs)]), VOCAB, page_table_rows=rows)
    assert first.sampled_in_order == seqs and first.inputs.prev_rows[:4].tolist() == [0, 1, 2, -1]
    for seq in seqs:
        seq.set_token(seq.first_placeholder_index, 5)
        seq.append_token(PLACEHOLDER_TOKEN)
    second = pack_step(schedule_of(*map(decode, seqs)), BUCKETS, first, VOCAB, page_table_rows=rows)
    assert second.inputs.prev_rows[:4].tolist() == [0, 1, 2, -1]
    assert second.inputs.batch.positions[:4].tolist() == [5, 5, 5, 0]
    assert second.inputs.batch.kv_lens.tolist() == [6, 6, 6, 0]
    assert second.inputs.batch.cu_q_lens.tolist() == [0, 1, 2, 3, 3]
    assert second.inputs.batch.logits_indices.tolist() == [0, 1, 2, 0]
    assert second.inputs.sampling.step.tolist() == [3, 3, 3, 0]
    assert second.inputs.sampling.seed.tolist() == [30, 31, 32, 0]
    assert second.inputs.sampling.temperature.tolist() == [np.float32(0.7)] * 3 + [0]
    for seq in seqs:
        seq.set_token(seq.first_placeholder_index, 6)
        seq.append_token(PLACEHOLDER_TOKEN)
    third = pack_step(schedule_of(decode(seqs[0]), decode(seqs[2])), BUCKETS, second, VOCAB, page_table_rows=rows)
    assert third.inputs.prev_rows[:3].tolist() == [0, 2, -1]
    assert third.inputs.batch.page_tables[:2, 0].tolist() == [10, 12]


def test_sampled_in_order_reads_as_the_list_of_pairs():
    from jaxinfer.input_batch import SampledInOrder

    seqs = [make_seq(i, [1, 2]) for i in range(3)]
    sampled = SampledInOrder(seqs)
    pairs = [(seq, b) for b, seq in enumerate(seqs)]
    assert list(sampled) == pairs and sampled == pairs and len(sampled) == 3
    assert sampled[1] == pairs[1] and sampled[-1] == pairs[-1] and sampled[1:] == pairs[1:]
    assert sampled != pairs[:2] and PackedStep(None, sampled).sampled_in_order is seqs
    assert PackedStep(None, pairs).sampled_in_order is None
    assert PackedStep(None, sampled).last_row_of_each_seq() == {0: 0, 1: 1, 2: 2}

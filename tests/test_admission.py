"""Admission (jaxinfer.admission): reserving pages for the running sequences' growth, the adaptive
ratio, FCFS without starvation, config errors; driven by test_scheduler's hand-checkable fake device."""

import pytest
from prometheus_client import generate_latest

from jaxinfer.admission import Admission, AdmissionConfig, AdmissionConfigError, RunningTotals
from jaxinfer.engine_config import EngineConfig, EngineConfigError
from jaxinfer.page_allocator import PageAllocator
from jaxinfer.scheduler import Scheduler, SchedulerConfig
from jaxinfer.sequence import Sequence, SequenceStatus
from jaxinfer.server.metrics import ServerMetrics
from tests.test_page_allocator import check_allocator_invariants
from tests.test_scheduler import PAGE_SIZE, FakeEngine, make_seq, reference_run


def make_scheduler(admission: AdmissionConfig, num_pages=25, max_num_seqs=8, max_num_batched_tokens=32,
                   max_model_len=40):
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, PAGE_SIZE, 0.0, admission)
    return Scheduler(config, PageAllocator(num_pages, PAGE_SIZE, "fake"))


def run_counting(engine, max_steps=10_000):
    """Run to the end; the most sequences that ran at once and the ratio after each step."""
    most_running, ratios = 0, []
    for _ in range(max_steps):
        if not (engine.has_work() or engine.in_flight):
            return most_running, ratios
        engine.step()
        check_allocator_invariants(engine.scheduler.allocator, engine.scheduler.running)
        most_running = max(most_running, engine.scheduler.num_running)
        ratios.append(engine.scheduler.admission.ratio)
    raise AssertionError("did not finish")


@pytest.mark.parametrize("is_async", [False, True])
def test_reserve_preempts_far_less_than_greedy_with_the_same_tokens(is_async):
    # 24 usable pages; 12 sequences of 6-13 prompt tokens and up to 40 tokens in all: by their
    # prompts (2-4 pages) most fit at once, by their full length (10 pages) two do.
    prompts = [[seq_id + 1] * 6 + list(range(seq_id % 8)) for seq_id in range(12)]
    preemptions = {}
    for policy in ("greedy", "reserve"):
        engine = FakeEngine(make_scheduler(AdmissionConfig(policy=policy)), is_async)
        for seq_id, prompt in enumerate(prompts):
            engine.add(make_seq(seq_id, prompt), 40 - len(prompt))
        run_counting(engine)
        for seq, prompt in zip(engine.seqs, prompts):
            assert seq.finish_reason == "length"
            assert seq.token_ids == reference_run(prompt, 40 - len(prompt))
        assert engine.scheduler.allocator.num_used_pages == 0
        assert engine.scheduler.admission.sum_max_num_tokens == 0  # every start matched by a stop
        preemptions[policy] = engine.scheduler.num_preemptions
    assert preemptions["greedy"] >= 10
    assert preemptions["reserve"] <= preemptions["greedy"] / 4, preemptions


def test_the_ratio_decays_without_preemptions_and_jumps_back_after_one():
    config = AdmissionConfig(initial_ratio=0.9, min_ratio=0.5, decay_steps=4)
    # A roomy pool: one sequence decodes for 10 steps and nothing is preempted.
    engine = FakeEngine(make_scheduler(config, num_pages=40))
    engine.add(make_seq(0, [1, 2, 3]), 10)
    _, ratios = run_counting(engine)
    assert ratios[:5] == pytest.approx([0.8, 0.7, 0.6, 0.5, 0.5])
    assert ratios[-1] == 0.5
    # A floor of 0 reserves nothing once decayed: sequences growing to 40 tokens in a pool of
    # 24 usable pages preempt, and each step that does puts the ratio back to its start.
    config = AdmissionConfig(initial_ratio=0.3, min_ratio=0.0, decay_steps=1)
    engine = FakeEngine(make_scheduler(config))
    for seq_id in range(8):
        engine.add(make_seq(seq_id, [seq_id + 1] * 8), 32)
    num_preempting_steps = 0
    while engine.has_work() or engine.in_flight:
        schedule = engine.step()
        if schedule.preempted:
            num_preempting_steps += 1
            assert engine.scheduler.admission.ratio == 0.3
        elif not schedule.is_empty:
            assert engine.scheduler.admission.ratio == 0.0
    assert num_preempting_steps > 0


def test_requests_that_stop_early_let_more_in_over_time():
    # Each declares max_tokens 28 (36 tokens, 9 pages) but stops after 6. With the ratio held
    # at 1 the 24 usable pages fit two at a time; a decaying ratio sees no preemption, expects
    # less and less of the declared outputs, and runs more at once.
    most_running = {}
    for name, config in {"held": AdmissionConfig(initial_ratio=1.0, min_ratio=1.0),
                         "decaying": AdmissionConfig(initial_ratio=1.0, min_ratio=0.1, decay_steps=10)}.items():
        engine = FakeEngine(make_scheduler(config))
        for seq_id in range(16):
            seq = make_seq(seq_id, [seq_id + 1] * 8)
            engine.add(seq, 6)
            seq.max_tokens = 28  # what the request declared; the fake engine stops it at 6 (an EOS)
        most_running[name], _ = run_counting(engine)
        assert engine.scheduler.num_preemptions == 0
        assert all(seq.token_ids == reference_run(seq.token_ids[:8], 6) for seq in engine.seqs)
    assert most_running["held"] == 2
    assert most_running["decaying"] >= 4, most_running


def test_the_first_request_is_never_held_back_and_later_ones_keep_their_order():
    # 10 usable pages; a request of 8 prompt tokens and max_tokens 32 needs all 10 with its
    # expected output at ratio 1. (Alone it always fits: the scheduler refuses a pool smaller
    # than one max_model_len sequence, and admission never holds back the first one either.)
    engine = FakeEngine(make_scheduler(AdmissionConfig(initial_ratio=1.0, min_ratio=1.0), num_pages=11))
    first, second, small = make_seq(0, [1] * 8), make_seq(1, [2] * 8), make_seq(2, [3])
    engine.add(first, 32)
    engine.add(second, 32)
    engine.add(small, 1)
    engine.step()
    assert first.status is SequenceStatus.RUNNING
    # The second does not fit beside the first's growth, and the small one does not overtake it.
    assert [seq.seq_id for seq in engine.scheduler.waiting] == [1, 2]
    assert engine.scheduler.admission.num_reserved_pages > 0
    run_counting(engine)
    assert engine.scheduler.num_preemptions == 0
    assert [seq.finish_reason for seq in engine.seqs] == ["length"] * 3


def test_the_reservation_is_counted_in_pages_and_prefix_hits_cost_nothing():
    allocator = PageAllocator(40, PAGE_SIZE, "fake")
    admission = Admission(AdmissionConfig(initial_ratio=0.5), PAGE_SIZE, max_model_len=64)
    # Running: 2 sequences with 30 tokens in all, 50 more they may generate, 3 prompt tokens
    # not yet in a page: 0.5 * 50 + 3 = 28 tokens, 7 pages.
    for seq_id, (prompt, max_tokens) in enumerate([(10, 20), (20, 30)]):
        admission.on_start(Sequence(seq_id, f"r{seq_id}", [1] * prompt, max_tokens=max_tokens))
    assert admission.reserved_pages(RunningTotals(num_seqs=2, num_tokens=30, num_pending_tokens=3)) == 7
    # A cap on what one sequence's output is expected to be: at most 4 tokens each here.
    capped = Admission(AdmissionConfig(initial_ratio=1.0, max_reserved_tokens=4), PAGE_SIZE, max_model_len=64)
    capped.sum_max_num_tokens = 80
    assert capped.reserved_pages(RunningTotals(num_seqs=2, num_tokens=30, num_pending_tokens=0)) == 2
    # A candidate of 9 tokens (max_tokens 6: 3 expected) needs 3 pages; sharing its first two
    # full pages with a running sequence, only 1.
    holder = Sequence(10, "holder", list(range(1, 10)))
    candidate = Sequence(11, "candidate", list(range(1, 10)), max_tokens=6)
    assert admission.candidate_tokens(candidate) == 12
    assert allocator.num_pages_to_admit(candidate, 12) == 3
    assert allocator.allocate_prompt(holder, 9)
    holder.num_computed_tokens = 9
    allocator.register_computed(holder)
    assert allocator.num_pages_to_admit(candidate, 12) == 1
    # Once the holder is gone its cached pages are free: reviving them costs them again.
    allocator.free(holder)
    assert allocator.num_pages_to_admit(candidate, 12) == 3


def test_greedy_reserves_nothing_and_keeps_its_ratio_at_zero():
    admission = Admission(AdmissionConfig(policy="greedy"), PAGE_SIZE, max_model_len=64)
    admission.on_start(Sequence(0, "r0", [1] * 10, max_tokens=50))
    assert admission.reserved_pages(RunningTotals(1, 10, 0)) == 0
    admission.end_step(preempted=True)
    assert admission.ratio == 0.0


@pytest.mark.parametrize("options, field", [
    (dict(policy="optimistic"), "policy"),
    (dict(initial_ratio=0.0), "initial_ratio"),
    (dict(initial_ratio=1.5), "initial_ratio"),
    (dict(min_ratio=-0.1), "min_ratio"),
    (dict(initial_ratio=0.5, min_ratio=0.6), "min_ratio"),
    (dict(decay_steps=0), "decay_steps"),
    (dict(decay_steps=2.5), "decay_steps"),
    (dict(max_reserved_tokens=0), "max_reserved_tokens"),
])
def test_bad_admission_settings_name_the_field(options, field):
    with pytest.raises(AdmissionConfigError, match=field) as error:
        AdmissionConfig(**options)
    assert error.value.field == field
    with pytest.raises(EngineConfigError) as error:
        EngineConfig(scheduling_admission="optimistic")
    assert error.value.field == "scheduling_admission"


def test_the_ratio_and_reserved_pages_reach_the_metrics():
    metrics = ServerMetrics("m", 64)
    metrics.update_engine_stats({"admission_new_token_ratio": 0.35, "admission_reserved_pages": 17}, stepped=True)
    text = generate_latest(metrics.registry).decode()
    assert 'jaxinfer:scheduler_admission_new_token_ratio{model_name="m"} 0.35' in text
    assert 'jaxinfer:scheduler_admission_reserved_pages{model_name="m"} 17.0' in text


def test_a_sequences_limit_is_its_prompt_and_max_tokens_within_max_model_len():
    from jaxinfer.admission import max_num_tokens

    assert max_num_tokens(Sequence(0, "r", [1] * 10, max_tokens=5), max_model_len=64) == 15
    assert max_num_tokens(Sequence(1, "r", [1] * 10, max_tokens=500), max_model_len=64) == 64
    assert max_num_tokens(Sequence(2, "r", [1] * 10), max_model_len=64) == 64  # no max_tokens: the context
    with pytest.raises(ValueError, match="max_tokens"):
        Sequence(3, "r", [1], max_tokens=-1)

"""Admission (jaxinfer.admission): reserving pages for the running sequences' growth, the adaptive
ratio, FCFS without starvation, config errors; driven by test_scheduler's hand-checkable fake device."""

import pytest
from prometheus_client import generate_latest

import numpy as np

from jaxinfer.admission import Admission, AdmissionConfig, AdmissionConfigError, Projection, RunningTotals
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
        assert not engine.scheduler.admission.limits  # every start matched by a stop
        preemptions[policy] = engine.scheduler.num_preemptions
    assert preemptions["greedy"] >= 10
    assert preemptions["reserve"] <= preemptions["greedy"] / 4, preemptions


def test_the_ratio_decays_without_preemptions_and_jumps_back_after_one():
    # SGLang's schedule (nothing learned): the ratio falls every step, whatever has finished.
    config = AdmissionConfig(initial_ratio=0.9, min_ratio=0.5, decay_steps=4, learn_from_finished=False)
    # A roomy pool: one sequence decodes for 10 steps and nothing is preempted.
    engine = FakeEngine(make_scheduler(config, num_pages=40))
    engine.add(make_seq(0, [1, 2, 3]), 10)
    _, ratios = run_counting(engine)
    assert ratios[:5] == pytest.approx([0.8, 0.7, 0.6, 0.5, 0.5])
    assert ratios[-1] == 0.5
    # A floor of 0 reserves nothing once decayed: sequences growing to 40 tokens in a pool of
    # 24 usable pages preempt, and each step that does puts the ratio back to its start.
    config = AdmissionConfig(initial_ratio=0.3, min_ratio=0.0, decay_steps=1, learn_from_finished=False)
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


def test_the_ratio_holds_until_sequences_finish_then_falls_to_what_they_used():
    # Each of 16 declares max_tokens 28 but stops after 7 (a quarter of it). Nothing decays while
    # nothing has finished; after 8 finishes the ratio falls (one decay step a step) to 0.25.
    config = AdmissionConfig(initial_ratio=1.0, min_ratio=0.1, decay_steps=3)
    engine = FakeEngine(make_scheduler(config, num_pages=40))
    for seq_id in range(16):
        seq = make_seq(seq_id, [seq_id + 1] * 8)
        engine.add(seq, 7)
        seq.max_tokens = 28
    admission = engine.scheduler.admission
    ratios, learned = [], []
    while engine.has_work() or engine.in_flight:
        engine.step()
        ratios.append(admission.ratio)
        learned.append(admission.learned_ratio)
    first_learned = next(i for i, value in enumerate(learned) if value is not None)
    assert set(ratios[:first_learned]) == {1.0}
    assert learned[-1] == pytest.approx(0.25)
    assert ratios[-1] == pytest.approx(0.25)
    assert min(ratios) == pytest.approx(0.25)  # never below what the finished ones used
    assert engine.scheduler.num_preemptions == 0


def test_requests_that_run_to_max_tokens_are_not_preempted_by_their_own_growth():
    # 12 sequences of 6-13 prompt tokens running to 40 tokens in a pool of 24 pages (two fit at
    # full length): SGLang's schedule decays while they grow and preempts; the learned ratio stays 1.
    prompts = [[seq_id + 1] * 6 + list(range(seq_id % 8)) for seq_id in range(12)]
    preemptions = {}
    for learn in (False, True):
        engine = FakeEngine(make_scheduler(AdmissionConfig(initial_ratio=1.0, decay_steps=10,
                                                           learn_from_finished=learn)))
        for seq_id, prompt in enumerate(prompts):
            engine.add(make_seq(seq_id, prompt), 40 - len(prompt))
        _, ratios = run_counting(engine)
        assert [seq.token_ids for seq in engine.seqs] == [reference_run(p, 40 - len(p)) for p in prompts]
        preemptions[learn] = engine.scheduler.num_preemptions
        if learn:
            assert set(ratios) == {1.0}
    assert preemptions[False] > 0 and preemptions[True] == 0, preemptions


def test_the_learned_ratio_is_the_mean_use_of_a_window_of_finished_sequences():
    config = AdmissionConfig(min_finished=2, finished_window=3)
    admission = Admission(config, PAGE_SIZE, max_model_len=64)

    def finished(seq_id, num_prompt, max_tokens, num_generated):
        seq = Sequence(seq_id, f"r{seq_id}", [1] * num_prompt, max_tokens=max_tokens)
        for _ in range(num_generated):
            seq.append_token(2)
        return seq

    admission.on_finish(finished(0, 4, 10, 5))
    assert admission.learned_ratio is None  # one is not enough
    admission.on_finish(finished(1, 4, 10, 10))
    assert admission.learned_ratio == pytest.approx(0.75)
    # No max_tokens: the budget is the context left (60), capped by max_reserved_tokens (4096).
    admission.on_finish(finished(2, 4, None, 15))
    assert admission.learned_ratio == pytest.approx((0.5 + 1.0 + 0.25) / 3)
    admission.on_finish(finished(3, 4, 10, 0))  # the window drops the oldest (0.5)
    assert admission.learned_ratio == pytest.approx((1.0 + 0.25 + 0.0) / 3)
    admission.on_finish(finished(4, 64, 10, 0))  # no room to generate: teaches nothing
    assert admission.learned_ratio == pytest.approx((1.0 + 0.25 + 0.0) / 3)


def test_aborted_sequences_teach_the_ratio_nothing():
    scheduler = make_scheduler(AdmissionConfig(min_finished=1))
    seq = make_seq(0, [1] * 8)
    seq.max_tokens = 20
    scheduler.add(seq)
    scheduler.postprocess(scheduler.schedule(1e9))
    scheduler.finish(seq, "abort")
    assert scheduler.admission.learned_ratio is None
    other = make_seq(1, [2] * 8)
    other.max_tokens = 20
    scheduler.add(other)
    scheduler.postprocess(scheduler.schedule(1e9))
    other.append_token(3)
    scheduler.finish(other, "stop")
    assert scheduler.admission.learned_ratio == pytest.approx(1 / 20)


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


@pytest.mark.parametrize("is_async", [False, True])
def test_the_last_requests_of_a_burst_start_at_once_instead_of_running_alone_afterwards(is_async):
    # 20 requests of 4 + 28 tokens (8 pages each at full length) over 155 usable pages: all 20
    # at full length need 160, 19 fit. Held to the projection, the 20th would wait until the
    # first are about to finish and then run most of its 28 steps alone. It is one request behind 19 running (within
    # tail_fraction 0.1): admitted against a projected overflow in its last half, it starts
    # at once and at worst is preempted late and finishes a few steps after the others.
    steps = {}
    for name, config in {"tail": AdmissionConfig(), "no tail": AdmissionConfig(tail_fraction=0.0)}.items():
        engine = FakeEngine(make_scheduler(config, num_pages=156, max_num_seqs=32, max_num_batched_tokens=32,
                                           max_model_len=32), is_async)
        prompts = [[seq_id + 1] * 4 for seq_id in range(20)]
        for seq_id, prompt in enumerate(prompts):
            engine.add(make_seq(seq_id, prompt), 28)
        _, ratios = run_counting(engine)
        assert [seq.token_ids for seq in engine.seqs] == [reference_run(p, 28) for p in prompts]
        steps[name] = len(ratios)
        assert engine.scheduler.num_preemptions <= 1
    # 28 decode steps + the prompts' steps + a few: against the 20th's 28 steps alone after the peak.
    assert steps["tail"] <= 36 and steps["no tail"] >= steps["tail"] + 8, steps


def running_seq(seq_id, num_prompt, max_tokens, num_generated=0):
    seq = Sequence(seq_id, f"r{seq_id}", [seq_id + 1] * num_prompt, max_tokens=max_tokens)
    seq.token_ids += [7] * num_generated
    return seq


def test_the_projection_peaks_just_before_a_sequence_ends():
    # Two running: one expected to run 3 more steps, then free its 10 tokens; one 8 more steps,
    # freeing 20. After step t (0 = the next) the pool holds (t+1) more per running sequence,
    # less what ended.
    projection = Projection.of(np.array([8, 3]), np.array([20, 10]))
    assert projection.growth(np.arange(10)).tolist() == [2, 4, 6, -6, -5, -4, -3, -2, -30, -30]
    assert projection.peak_growth(10, with_candidate=False) == 6
    # With a candidate beside them for 5 steps: +t+1 each step, the peak is step 2's 6 + 3.
    assert projection.peak_growth(5, with_candidate=True) == 9
    assert projection.peak_growth(0, with_candidate=True) == 0
    # A third sequence joins (admitted this step): ending after 3 steps, freeing 5.
    grown = projection.with_sequence(3, 5)
    assert grown.ends.tolist() == [3, 3, 8]
    assert grown.growth(np.arange(5)).tolist() == [3, 6, 9, -11, -10]


@pytest.mark.parametrize("num_free, admitted", [(6, True), (5, False)])
def test_the_check_counts_pages_pending_prompt_tokens_and_the_projected_peak(num_free, admitted):
    allocator = PageAllocator(40, PAGE_SIZE, "fake")  # 39 usable pages of 4 tokens
    admission = Admission(AdmissionConfig(initial_ratio=0.5), PAGE_SIZE, max_model_len=64)
    # Running: 10 + 20 tokens (3 + 5 pages), max_tokens 20 and 30: at ratio 0.5 expected to run
    # 10 and 15 more steps. 3 of their prompt tokens have no page yet.
    running = [running_seq(0, 10, 20), running_seq(1, 20, 30)]
    for seq in running:
        assert allocator.allocate_prompt(seq, seq.num_tokens)
        admission.on_start(seq)
    blocker = Sequence(9, "blocker", [5] * (4 * (31 - num_free)))  # holds pages, leaves num_free
    assert allocator.allocate_prompt(blocker, blocker.num_tokens)
    assert allocator.num_free_pages == num_free
    # The candidate: 9 tokens (3 pages), max_tokens 6: expected to run 3 steps. Over them the
    # pool grows 3 tokens a step (two running, the candidate): 9 by the third, + 3 pending = 12
    # tokens, 3 pages; 6 pages in all. (Summing every remaining output instead, as if all peaked
    # together: 10 + 15 + 3 + 3 + 9 tokens = 10 pages.)
    candidate = Sequence(11, "candidate", list(range(1, 10)), max_tokens=6)
    totals = RunningTotals(num_seqs=2, num_pending_tokens=3)
    assert admission.can_admit(candidate, running, totals, allocator) is admitted
    # The running set's own peak: 2 tokens a step for 10 steps + 3 pending = 23 tokens, 6 pages.
    assert admission.num_reserved_pages == 6


def test_a_prefix_another_sequence_holds_costs_the_candidate_nothing():
    allocator = PageAllocator(12, PAGE_SIZE, "fake")  # 11 usable pages
    admission = Admission(AdmissionConfig(), PAGE_SIZE, max_model_len=64)
    holder = running_seq(0, 9, 1)  # 9 tokens, 3 pages; expected to run 1 step
    assert allocator.allocate_prompt(holder, 9)
    holder.num_computed_tokens = 9
    allocator.register_computed(holder)
    admission.on_start(holder)
    blocker = Sequence(9, "blocker", [5] * 28)  # 7 pages: 1 of the 11 left
    assert allocator.allocate_prompt(blocker, 28)
    # 11 tokens sharing the holder's 2 full pages: 1 page of its own. Over its 1 expected step
    # the pool grows 2 tokens (1 page): 2 pages needed, 1 free.
    candidate = Sequence(1, "candidate", [1] * 8 + [4, 2, 3], max_tokens=1)
    totals = RunningTotals(num_seqs=1, num_pending_tokens=0)
    assert allocator.num_pages_to_admit(candidate, candidate.num_tokens) == 1
    assert not admission.can_admit(candidate, [holder], totals, allocator)
    allocator.free(blocker)
    assert admission.can_admit(candidate, [holder], totals, allocator)


def test_greedy_never_checks_and_keeps_its_ratio_at_zero():
    allocator = PageAllocator(3, PAGE_SIZE, "fake")
    admission = Admission(AdmissionConfig(policy="greedy"), PAGE_SIZE, max_model_len=64)
    running = [running_seq(0, 4, 50)]
    admission.on_start(running[0])
    # Even a candidate that cannot fit passes: the allocator alone decides under "greedy".
    assert admission.can_admit(running_seq(1, 40, 50), running, RunningTotals(1, 0), allocator)
    admission.end_step(preempted=True)
    assert admission.ratio == 0.0


@pytest.mark.parametrize("options, field", [
    (dict(policy="optimistic"), "policy"),
    (dict(initial_ratio=0.0), "initial_ratio"),
    (dict(initial_ratio=1.5), "initial_ratio"),
    (dict(horizon=0.0), "horizon"),
    (dict(horizon=0.5, tail_horizon=0.6), "tail_horizon"),
    (dict(tail_fraction=-0.1), "tail_fraction"),
    (dict(min_ratio=-0.1), "min_ratio"),
    (dict(initial_ratio=0.5, min_ratio=0.6), "min_ratio"),
    (dict(decay_steps=0), "decay_steps"),
    (dict(decay_steps=2.5), "decay_steps"),
    (dict(max_reserved_tokens=0), "max_reserved_tokens"),
    (dict(finished_window=0), "finished_window"),
    (dict(min_finished=0), "min_finished"),
    (dict(min_finished=300, finished_window=256), "min_finished"),
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


def test_the_cpu_benchmarks_host_cost_cases_refuse_as_they_say():
    # benchmarks/admission_cpu.py's host-cost harness asserts that nothing is admitted while it
    # times; the "projected" case must be refused by the projection, not by the prompt's pages.
    import benchmarks.admission_cpu as admission_cpu

    for policy, waiting in [("greedy", "too-big"), ("reserve", "too-big"), ("reserve", "projected"),
                            ("reserve", "empty")]:
        assert admission_cpu.host_cost_round(policy, num_running=64, waiting=waiting, num_steps=4) > 0

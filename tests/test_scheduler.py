"""Scheduler: token budget, decode-first order, chunked prefill, preemption by recompute, abort,
max wait, n > 1 sibling sharing; driven by a fake device whose outputs can be computed by hand."""

import random

import pytest

from jaxinfer.admission import AdmissionConfig
from jaxinfer.page_allocator import SCRATCH_PAGE, PageAllocator
from jaxinfer.scheduler import Scheduler, SchedulerConfig
from jaxinfer.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from tests.test_page_allocator import check_allocator_invariants

PAGE_SIZE = 4


def next_token(tokens):
    """The fake model: a deterministic function of the whole context."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 7 + len(tokens)) % 997 + 1


def reference_run(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens


class FakeDevice:
    """Writes each scheduled token into its page slot and samples from what it reads back.

    Reading the context through the page table (not from ``seq.token_ids``) is what checks the
    allocator: a shared, stale or overwritten page changes the output.
    """

    def __init__(self, allocator):
        self.allocator = allocator
        self.pages = {}  # page -> {slot: (position, token)}
        self.last_sample = {}  # seq_id -> the token the device sampled last (for placeholders)
        self.num_computed_tokens = 0

    def execute(self, schedule):
        samples = {}
        for item in schedule.items:
            seq = item.seq
            for position in range(item.start_position, item.start_position + item.num_new_tokens):
                token = seq.token_ids[position]
                if token == PLACEHOLDER_TOKEN:
                    # The protocol the runner relies on: a placeholder only ever is the one
                    # input token of a decode, the sample this sequence's previous step made.
                    assert item.num_new_tokens == 1 and position == seq.num_tokens - 1
                    token = self.last_sample[seq.seq_id]
                page = seq.page_table[position // PAGE_SIZE]
                assert page != SCRATCH_PAGE
                assert page not in self.allocator._page_hash, "wrote into a registered (shared) page"
                self.pages.setdefault(page, {})[position % PAGE_SIZE] = (position, token)
            self.num_computed_tokens += item.num_new_tokens
            if item.samples_token:
                context = []
                for position in range(item.start_position + item.num_new_tokens):
                    page = seq.page_table[position // PAGE_SIZE]
                    stored_position, token = self.pages[page][position % PAGE_SIZE]
                    assert stored_position == position
                    context.append(token)
                samples[seq.seq_id] = self.last_sample[seq.seq_id] = next_token(context)
        return samples


class FakeEngine:
    """The engine loop of scheduler.py's docstring; ``is_async`` appends placeholders, filled a step late."""

    def __init__(self, scheduler, is_async=False):
        self.scheduler = scheduler
        self.device = FakeDevice(scheduler.allocator)
        self.is_async = is_async
        self.max_tokens = {}
        self.in_flight = []  # (seq, index, token) of the previous step
        self.seqs = []

    def add(self, seq, max_tokens):
        self.max_tokens[seq.seq_id] = max_tokens
        seq.max_tokens = max_tokens  # as the engine's Sequence(max_tokens=...): admission reads it
        self.seqs.append(seq)
        self.scheduler.add(seq)

    def step(self, now=1e9):
        schedule = self.scheduler.schedule(now)
        samples = self.device.execute(schedule)
        self.scheduler.postprocess(schedule)
        outputs = []
        for item in schedule.items:
            if item.samples_token and not item.seq.is_finished:
                if self.is_async:
                    item.seq.append_token(PLACEHOLDER_TOKEN)
                    outputs.append((item.seq, item.seq.num_tokens - 1, samples[item.seq.seq_id]))
                else:
                    outputs.append((item.seq, None, samples[item.seq.seq_id]))
        if self.is_async:
            outputs, self.in_flight = self.in_flight, outputs
        for seq, index, token in outputs:
            if seq.is_finished:
                continue  # finished a step late: drop its in-flight sample
            if index is None:
                seq.append_token(token)
                index = seq.num_tokens - 1
            else:
                seq.set_token(index, token)
            if index + 1 - seq.num_prompt_tokens >= self.max_tokens[seq.seq_id]:
                self.scheduler.finish(seq, "length")
        return schedule

    def has_work(self):
        return bool(self.scheduler.num_waiting or self.scheduler.num_running)

    def abort(self, request_id):
        """The engine's abort: finish every sample of the request, whatever its state."""
        seqs = [seq for seq in self.seqs if seq.request_id == request_id and not seq.is_finished]
        for seq in seqs:
            self.scheduler.finish(seq, "abort")
        return seqs

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if not (self.has_work() or self.in_flight):
                return
            self.step()
        raise AssertionError("did not finish")


def make_scheduler(num_pages=64, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, **kwargs):
    caching = kwargs.pop("enable_prefix_caching", True)
    if isinstance(kwargs.get("admission"), str):
        kwargs["admission"] = AdmissionConfig(policy=kwargs["admission"])
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, PAGE_SIZE, **kwargs)
    return Scheduler(config, PageAllocator(num_pages, PAGE_SIZE, "fake", caching))


def make_seq(seq_id, prompt, request_id=None, arrival_time=0.0):
    return Sequence(seq_id, request_id or f"r{seq_id}", list(prompt), arrival_time=arrival_time)


def test_budget_is_respected_and_decodes_come_first():
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=8))
    engine.add(make_seq(0, [1, 2, 3]), 10)
    engine.add(make_seq(1, [4, 5]), 10)
    engine.step()
    engine.add(make_seq(2, range(10, 30)), 5)
    schedule = engine.step()
    assert [(i.seq.seq_id, i.num_new_tokens) for i in schedule.items] == [(0, 1), (1, 1), (2, 6)]
    assert schedule.num_batched_tokens == 8
    assert [i.samples_token for i in schedule.items] == [True, True, False]
    while engine.has_work():
        assert engine.step().num_batched_tokens <= 8


def test_chunked_prefill_splits_a_long_prompt():
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=8))
    engine.add(make_seq(0, range(1, 21)), 2)
    chunks = [engine.step().items[0] for _ in range(3)]
    assert [(c.start_position, c.num_new_tokens, c.samples_token) for c in chunks] == [
        (0, 8, False), (8, 8, False), (16, 4, True)
    ]
    engine.run()
    assert engine.seqs[0].token_ids == reference_run(range(1, 21), 2)


def test_max_num_seqs_caps_the_batch():
    engine = FakeEngine(make_scheduler(max_num_seqs=2, max_num_batched_tokens=64))
    for seq_id in range(5):
        engine.add(make_seq(seq_id, [seq_id + 1] * 3), 4)
    assert engine.step().num_seqs == 2
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 3
    engine.run()
    assert all(seq.token_ids == reference_run(seq.token_ids[:3], 4) for seq in engine.seqs)


@pytest.mark.parametrize("is_async", [False, True])
def test_preempted_sequences_resume_and_yield_the_same_tokens(is_async):
    # 12 usable pages; 4 sequences of up to 24 tokens need 24 pages: preemption is certain when
    # admission does not hold pages back for the growth.
    engine = FakeEngine(make_scheduler(num_pages=13, max_num_seqs=4, max_num_batched_tokens=16, admission="greedy"),
                        is_async)
    prompts = [[seq_id + 1] * 5 + list(range(seq_id * 3)) for seq_id in range(4)]
    for seq_id, prompt in enumerate(prompts):
        engine.add(make_seq(seq_id, prompt), 24 - len(prompt))
    engine.run()
    assert engine.scheduler.num_preemptions > 0
    assert sum(seq.num_preemptions for seq in engine.seqs) == engine.scheduler.num_preemptions
    for seq, prompt in zip(engine.seqs, prompts):
        assert seq.finish_reason == "length"
        assert seq.token_ids == reference_run(prompt, 24 - len(prompt))
    assert engine.scheduler.allocator.num_used_pages == 0


def test_preemption_takes_the_most_recently_admitted():
    scheduler = make_scheduler(num_pages=7, max_num_seqs=3, max_num_batched_tokens=32, max_model_len=24,
                               admission="greedy")
    engine = FakeEngine(scheduler)
    for seq_id in range(3):
        engine.add(make_seq(seq_id, [seq_id + 1] * 8), 10)  # 2 full pages each, 6 usable
    engine.step()
    schedule = engine.step()  # each decode needs a third page
    assert [seq.seq_id for seq in schedule.preempted] == [2]
    assert [item.seq.seq_id for item in schedule.items] == [0, 1]
    assert list(engine.scheduler.waiting)[0].seq_id == 2
    assert engine.seqs[2].status is SequenceStatus.WAITING and engine.seqs[2].num_computed_tokens == 0


def test_abort_frees_pages_at_once():
    engine = FakeEngine(make_scheduler())
    engine.add(make_seq(0, range(1, 10), request_id="a"), 10)
    engine.add(make_seq(1, range(1, 10), request_id="a"), 10)
    engine.add(make_seq(2, range(5, 9), request_id="b"), 10)
    engine.step()
    engine.step()
    allocator = engine.scheduler.allocator
    assert allocator.num_used_pages > 0
    schedule = engine.scheduler.schedule(1e9)
    aborted = engine.abort("a") + engine.abort("b")
    engine.scheduler.postprocess(schedule)  # the step in flight still completes
    assert sorted(seq.seq_id for seq in aborted) == [0, 1, 2]
    assert all(seq.finish_reason == "abort" and seq.page_table == [] for seq in aborted)
    assert allocator.num_used_pages == 0 and allocator.usage == 0.0
    assert not engine.has_work()
    check_allocator_invariants(allocator, [])


def test_finish_is_safe_on_a_sequence_in_the_executing_step():
    engine = FakeEngine(make_scheduler(), is_async=True)
    engine.add(make_seq(0, [1, 2, 3]), 100)
    engine.step()
    engine.step()
    seq = engine.seqs[0]
    assert seq.token_ids[-1] == PLACEHOLDER_TOKEN
    engine.scheduler.finish(seq, "stop")
    engine.scheduler.finish(seq, "stop")  # idempotent
    assert PLACEHOLDER_TOKEN not in seq.token_ids and seq.is_finished
    engine.in_flight = []
    assert engine.scheduler.schedule(1e9).is_empty


def test_schedule_requires_the_previous_postprocess():
    scheduler = make_scheduler()
    scheduler.add(make_seq(0, [1, 2, 3]))
    scheduler.schedule(1e9)
    with pytest.raises(RuntimeError):
        scheduler.schedule(1e9)


def test_max_wait_gathers_arrivals_but_never_idles_a_busy_device():
    engine = FakeEngine(make_scheduler(max_wait_s=0.01, max_num_batched_tokens=64))
    scheduler = engine.scheduler
    engine.add(make_seq(0, [1, 2, 3], arrival_time=100.0), 3)
    first = scheduler.schedule(now=100.002)
    assert first.is_empty and first.wait_until == pytest.approx(100.01)
    engine.add(make_seq(1, [4, 5, 6], arrival_time=100.005), 3)
    assert scheduler.schedule(now=100.009).is_empty  # the oldest arrival decides
    assert engine.step(now=100.01).num_seqs == 2
    engine.add(make_seq(2, [7, 8], arrival_time=100.011), 3)
    assert engine.step(now=100.011).num_seqs == 3  # something is running: never wait
    no_wait = FakeEngine(make_scheduler(max_wait_s=0.0))
    no_wait.add(make_seq(0, [1, 2, 3], arrival_time=100.0), 3)
    assert no_wait.step(now=100.0).num_seqs == 1
    full = FakeEngine(make_scheduler(max_wait_s=0.01, max_num_seqs=2))
    full.add(make_seq(0, [1, 2, 3], arrival_time=100.0), 3)
    full.add(make_seq(1, [1, 2, 3], arrival_time=100.0), 3)
    assert full.step(now=100.0).num_seqs == 2  # a full batch is waiting: go


@pytest.mark.parametrize("max_num_batched_tokens", [64, 8])
def test_siblings_wait_for_the_shared_prompt_instead_of_recomputing_it(max_num_batched_tokens):
    prompt = list(range(1, 18))  # 17 tokens: 16 shareable in 4 full pages
    totals = {}
    for caching in (True, False):
        engine = FakeEngine(
            make_scheduler(max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=caching)
        )
        for seq_id in range(3):
            engine.add(make_seq(seq_id, prompt, request_id="req"), 3)
        first = engine.step()
        if caching:
            assert [item.seq.seq_id for item in first.items] == [0]
        engine.run()
        totals[caching] = engine.device.num_computed_tokens
        if caching:
            assert [seq.num_cached_tokens for seq in engine.seqs] == [0, 16, 16]
        assert all(seq.token_ids == reference_run(prompt, 3) for seq in engine.seqs)
    assert totals[True] == totals[False] - 2 * 16


def test_config_rejects_impossible_shapes():
    with pytest.raises(ValueError):
        make_scheduler(num_pages=5, max_model_len=32)  # 8 pages per sequence, 4 usable
    with pytest.raises(ValueError):
        make_scheduler().add(make_seq(0, range(40)))


@pytest.mark.parametrize(
    "seed, is_async, caching, admission",
    [(0, False, True, "greedy"), (1, True, True, "greedy"), (2, True, False, "reserve"), (3, False, True, "reserve"),
     (4, True, True, "reserve")],
)
def test_random_workload_keeps_invariants_and_outputs(seed, is_async, caching, admission):
    rng = random.Random(seed)
    engine = FakeEngine(
        make_scheduler(
            num_pages=17, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=40,
            enable_prefix_caching=caching, admission=admission,
        ),
        is_async,
    )
    scheduler = engine.scheduler
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(0, 13))] for _ in range(3)]
    expected = {}
    num_seqs = 0
    for op in range(400):
        choice = rng.random()
        if choice < 0.25:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))]
            max_tokens = rng.randrange(1, 40 - len(prompt) + 1)
            for _ in range(rng.choice([1, 1, 1, 2, 3])):  # n samples of one request
                engine.add(make_seq(num_seqs, prompt, request_id=f"req{op}"), max_tokens)
                expected[num_seqs] = reference_run(prompt, max_tokens)
                num_seqs += 1
        elif choice < 0.3 and engine.seqs:
            for seq in engine.abort(rng.choice(engine.seqs).request_id):
                expected.pop(seq.seq_id)
        else:
            schedule = engine.step()
            assert schedule.num_batched_tokens <= scheduler.config.max_num_batched_tokens
            assert schedule.num_seqs <= scheduler.config.max_num_seqs
        check_allocator_invariants(scheduler.allocator, scheduler.running)
        assert all(not seq.page_table for seq in scheduler.waiting)
    engine.run()
    check_allocator_invariants(scheduler.allocator, [])
    assert scheduler.allocator.num_used_pages == 0
    for seq in engine.seqs:
        assert seq.is_finished
        if seq.seq_id in expected:
            assert seq.token_ids == expected[seq.seq_id], seq


@pytest.mark.parametrize("num_pages", [6, 7, 16])
def test_decodes_scheduled_in_bulk_match_the_one_by_one_loop(num_pages):
    """Plain decodes are scheduled by whole-list passes when the free pages cover them; the
    items, page tables, preemptions and free pages must be those of the one-by-one loop, also
    when the pool is one page short (the loop preempts) or a prefill runs beside them."""

    def build():
        # Greedy admission: the case with 16 pages admits a prefill beside the decodes.
        scheduler = make_scheduler(num_pages=num_pages, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16,
                                   admission="greedy")
        engine = FakeEngine(scheduler)
        for i, prompt_len in enumerate((4, 8, 3)):
            engine.add(make_seq(i, range(1, prompt_len + 1)), max_tokens=20)
        engine.step()  # prefills; the first two sample a token whose decode needs a new page
        engine.add(make_seq(3, range(1, 13)), max_tokens=20)
        return scheduler

    bulk, reference = build(), build()
    decodes = [seq for seq in reference.running if seq.num_tokens - seq.num_computed_tokens == 1]
    assert len(decodes) == 3
    schedule = bulk.schedule(1e9)
    items, preempted = [], []
    budget = reference._schedule_one_by_one(decodes, items, preempted, 16)
    admitted, _ = reference._schedule_waiting(budget) if not preempted else ([], budget)
    items += admitted

    def view(scheduler, items, preempted):
        return ([(i.seq.seq_id, i.num_new_tokens, i.start_position, i.samples_token) for i in items],
                [s.seq_id for s in preempted], {s.seq_id: s.page_table for s in scheduler.running},
                scheduler.allocator.num_free_pages)

    assert view(bulk, schedule.items, schedule.preempted) == view(reference, items, preempted)
    # The prompts hold 4 pages and the decodes need 2 more: with 6 pages (5 usable) one is
    # missing and the loop preempts; with 7 they fit and no prefill does; with 16 one does.
    assert bool(schedule.preempted) == (num_pages == 6)
    assert any(item.seq.seq_id == 3 for item in schedule.items) == (num_pages == 16)

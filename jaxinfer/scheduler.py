"""Scheduler: which tokens of which sequences the next step computes, under one token budget.

Each ``schedule()`` spends one ``max_num_batched_tokens`` budget over, in order:

1. running sequences that decode (one uncomputed token: the last sampled one), 1 token each,
   plus the drafts the speculator gave them (``seq.draft_token_ids``) to verify;
2. running sequences part-way through a chunked prefill, as much of the rest as fits;
3. waiting sequences, first come first served, starting after their cached prefix, while the
   admission policy (``jaxinfer.admission``, ``SchedulerConfig.admission``) finds room for them
   beside the expected growth of the running ones; the head of the queue that does not fit
   blocks the rest, and with nothing running it is always admitted.

A chunk may be cut to fit the budget (chunked prefill), so prefill and decode share every step.
Admission estimates; it does not promise. When a running sequence needs a page and none is
free, the scheduler preempts by recompute: the most recently admitted running sequence not yet
scheduled this step (possibly the one asking) loses its pages, goes back to the front of the
queue, and later recomputes its prompt and generated tokens as a prefill. No new sequence is
admitted in a step that preempted, and the admission's ratio returns to its start
(``Admission.end_step``).

The engine's step, with async scheduling (step n+1 prepared while the device runs step n):

    schedule = scheduler.schedule(now)      # a plain value; empty + wait_until: sleep, retry
    packed = runner.prepare(schedule, ...)  # item.seq.token_ids[start:start + n] are the inputs
    runner.execute(packed.inputs)           # dispatched; the device runs it while the host goes on
    scheduler.postprocess(schedule)         # advance num_computed_tokens, register full pages
    for item in schedule.items:             # only these sample a token this step
        if item.samples_token: item.seq.append_token(PLACEHOLDER_TOKEN)
    ...fill step n-1's placeholders with set_token, detokenize, scheduler.finish(seq, reason)

``postprocess`` may run before the device has finished the step: pages registered there are
only read by later steps, which the device runs after this one.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
import operator
import typing

import numpy as np

from jaxinfer.admission import Admission, AdmissionConfig, RunningTotals
from jaxinfer.page_allocator import PageAllocator
from jaxinfer.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus


_token_ids_of = operator.attrgetter("token_ids")
_num_computed_tokens_of = operator.attrgetter("num_computed_tokens")
_page_table_of = operator.attrgetter("page_table")
_draft_token_ids_of = operator.attrgetter("draft_token_ids")
_num_lookahead_slots_of = operator.attrgetter("num_lookahead_slots")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int
    # Nothing running: wait up to this long after the oldest waiting arrival to batch more
    # arrivals into the first step. 0 disables.
    max_wait_s: float = 0.002
    # Whether a waiting sequence also needs room for the running sequences' growth (and its
    # own) to be admitted: jaxinfer.admission, where the default is argued.
    admission: AdmissionConfig = AdmissionConfig()

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence needs a token of each step's budget: with fewer, the first
            # decodes would take every step while the rest (and every waiting request) starved.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): each running sequence decodes one token per step"
            )


class ScheduledSeq(typing.NamedTuple):
    """One sequence's share of a step. A named tuple, not a frozen dataclass: one is made per
    running sequence per step, and a frozen dataclass's ``__init__`` cost 1.4 µs to this 0.5."""

    seq: Sequence
    num_new_tokens: int  # tokens whose K/V this step computes
    start_position: int  # position of the first of them (== seq.num_computed_tokens before the step)
    # The chunk reaches the end of the sequence's known tokens, so the step samples its next
    # token from the last row's logits. False for all but the last chunk of a prefill.
    samples_token: bool
    # Drafts to verify after the decode's input token (jaxinfer.spec_decode): they are the last
    # len(draft_token_ids) of the num_new_tokens inputs, and the step keeps those it accepts;
    # placeholders when the device drafts them (asynchronous verify steps).
    draft_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Schedule:
    items: tuple[ScheduledSeq, ...] = ()  # decodes first, then prefill chunks
    preempted: tuple[Sequence, ...] = ()
    num_batched_tokens: int = 0
    # Set on an empty schedule that holds back to gather arrivals: call again at this time
    # (or sooner, when a request arrives).
    wait_until: float | None = None

    @property
    def is_empty(self) -> bool:
        return not self.items

    @property
    def num_seqs(self) -> int:
        return len(self.items)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator):
        if allocator.page_size != config.page_size:
            raise ValueError(f"allocator page_size {allocator.page_size} != config page_size {config.page_size}")
        if allocator.num_pages_for(config.max_model_len) > allocator.num_usable_pages:
            # Otherwise a long sequence alone could preempt itself forever.
            raise ValueError(
                f"max_model_len {config.max_model_len} needs {allocator.num_pages_for(config.max_model_len)} "
                f"pages, more than the {allocator.num_usable_pages} usable pages"
            )
        self.config = config
        self.allocator = allocator
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        self.admission = Admission(config.admission, config.page_size, config.max_model_len)
        self._is_postprocess_due = False

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.WAITING or seq.page_table:
            raise ValueError(f"only a new waiting sequence can be added, got {seq}")
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens > max_model_len {self.config.max_model_len}"
            )
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Free ``seq``'s pages and drop it, waiting or running; a no-op on a finished sequence.

        Safe on a sequence in the schedule now executing (the engine learns of a stop a step
        late): ``postprocess`` skips it and the engine drops its in-flight sample. Fill in the
        final token before calling: trailing placeholders are removed here.
        """
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.admission.on_stop(seq)
            if reason != "abort":
                self.admission.on_finish(seq)
        else:
            self.waiting.remove(seq)
        self.allocator.free(seq)
        seq.drop_placeholders()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def schedule(self, now: float | None = None) -> Schedule:
        if self._is_postprocess_due:
            raise RuntimeError("postprocess() the previous schedule before scheduling the next step")
        now = time.monotonic() if now is None else now
        wait_until = self._wait_until(now)
        if wait_until is not None:
            return Schedule(wait_until=wait_until)
        budget = self.config.max_num_batched_tokens
        items, preempted, budget, num_uncomputed = self._schedule_running(budget)
        if not preempted:
            # The chunks scheduled above have their page slots; the rest of their prompts do not
            # (draft tokens spent budget too, which only makes this smaller by as many).
            num_pending = max(num_uncomputed - (self.config.max_num_batched_tokens - budget), 0)
            totals = RunningTotals(len(self.running), num_pending)
            admitted, budget = self._schedule_waiting(budget, totals)
            items += admitted
        if items or preempted:
            self.admission.end_step(bool(preempted))
        self._is_postprocess_due = bool(items)
        return Schedule(tuple(items), tuple(preempted), self.config.max_num_batched_tokens - budget)

    def postprocess(self, schedule: Schedule) -> None:
        """Account for a launched step: its tokens' K/V are (or will be, in order) in the cache."""
        running = SequenceStatus.RUNNING
        register_computed = self.allocator.register_computed
        page_size = self.config.page_size
        for item in schedule.items:
            seq = item.seq
            if seq.status is not running:
                continue  # finished or aborted since it was scheduled
            if seq.num_computed_tokens != item.start_position:
                raise RuntimeError(f"schedule postprocessed twice or out of order for {seq}")
            # Drafts count as not kept until the engine learns how many were accepted (after the
            # step, or a step later with asynchronous verify steps) and rolls the sequence forward.
            seq.num_computed_tokens += item.num_new_tokens - len(item.draft_token_ids)
            # Only a step that fills a page (or follows one skipped for a placeholder) has pages to
            # register: the others skip the call. So does a page whose last token is still on the
            # device (async scheduling: the decode that fills a page): the next step registers it.
            next_page_end = (seq.num_registered_pages + 1) * page_size
            if seq.num_computed_tokens >= next_page_end and seq.token_ids[next_page_end - 1] != PLACEHOLDER_TOKEN:
                register_computed(seq)
        self._is_postprocess_due = False

    def _wait_until(self, now: float) -> float | None:
        """When to schedule instead of now: only with nothing running and a step that is not yet full."""
        if self.running or not self.waiting or self.config.max_wait_s <= 0:
            return None
        if len(self.waiting) >= self.config.max_num_seqs:
            return None
        if sum(seq.num_tokens for seq in self.waiting) >= self.config.max_num_batched_tokens:
            return None
        deadline = min(seq.arrival_time for seq in self.waiting) + self.config.max_wait_s
        return deadline if now < deadline else None

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledSeq], list[Sequence], int, int]:
        """The running sequences' items, the preempted, the budget left, and (for admission) the
        running sequences' uncomputed token count before this step."""
        running = self.running
        n = len(running)
        if not n:
            return [], [], budget, 0
        # Runs over every running sequence each step (1000 at a time): counts are read by
        # whole-list passes, and the plain decodes (most of every step) are scheduled in bulk.
        num_tokens = np.fromiter(map(len, map(_token_ids_of, running)), np.int64, n)
        num_computed = np.fromiter(map(_num_computed_tokens_of, running), np.int64, n)
        num_uncomputed_total = int(num_tokens.sum()) - int(num_computed.sum())
        is_decode = num_tokens - num_computed == 1
        decodes = self._bulk_decodes(is_decode, num_tokens, num_computed, budget)
        if decodes is not None:
            items = decodes
            budget -= len(decodes)
            rest = [running[b] for b in np.flatnonzero(~is_decode).tolist()]  # prefill chunks
        else:
            items = []
            is_decode = is_decode.tolist()
            rest = [seq for seq, decode in zip(running, is_decode) if decode]
            rest += [seq for seq, decode in zip(running, is_decode) if not decode]
        preempted: list[Sequence] = []
        budget = self._schedule_one_by_one(rest, items, preempted, budget)
        return items, preempted, budget, num_uncomputed_total

    def _bulk_decodes(self, is_decode: np.ndarray, num_tokens: np.ndarray, num_computed: np.ndarray,
                      budget: int) -> list[ScheduledSeq] | None:
        """The running decodes' items, in order, when each is a plain decode (no drafts, no
        lookahead slots) that the budget and the free pages cover without a preemption: the
        one-by-one loop's result, without its Python per sequence. None when some may not."""
        running = self.running
        decode_rows = np.flatnonzero(is_decode)
        num_decodes = len(decode_rows)
        if num_decodes > budget or (num_tokens > self.config.max_model_len).any():
            return None
        seqs = running if num_decodes == len(running) else [running[b] for b in decode_rows.tolist()]
        if any(map(_draft_token_ids_of, seqs)) or any(map(_num_lookahead_slots_of, seqs)):
            return None
        page_size = self.config.page_size
        num_pages = np.fromiter(map(len, map(_page_table_of, seqs)), np.int64, num_decodes)
        starts = num_computed[decode_rows]
        num_missing = np.maximum(-(-(starts + 1) // page_size) - num_pages, 0)
        if int(num_missing.sum()) > self.allocator.num_free_pages:
            return None  # someone may be preempted: the loop decides who
        allocate_slots = self.allocator.allocate_slots
        for b in np.flatnonzero(num_missing).tolist():
            if not allocate_slots(seqs[b], 1):
                raise AssertionError(f"the free pages were counted, yet {seqs[b]} got none")
        starts = starts.tolist()
        return list(map(ScheduledSeq, seqs, itertools.repeat(1, num_decodes), starts,
                        itertools.repeat(True, num_decodes)))

    def _schedule_one_by_one(self, seqs: list[Sequence], items: list[ScheduledSeq], preempted: list[Sequence],
                             budget: int) -> int:
        """Schedule ``seqs`` in order after ``items`` (appended to it), preempting when pages run
        out; returns the budget left."""
        max_model_len = self.config.max_model_len
        allocate_slots = self.allocator.allocate_slots
        running = SequenceStatus.RUNNING
        for seq in seqs:
            if budget == 0:
                break
            if seq.status is not running:
                continue  # preempted for an earlier sequence of this loop
            num_tokens = len(seq.token_ids)
            if num_tokens > max_model_len:
                raise RuntimeError(f"the engine must finish sequences at max_model_len: {seq}")
            num_computed = seq.num_computed_tokens
            num_uncomputed = num_tokens - num_computed
            drafts = seq.draft_token_ids
            num_new = min(num_uncomputed + len(drafts), budget)
            # After an asynchronous verify step the device may place these tokens up to
            # num_lookahead_slots later than the host counts (never past max_model_len).
            num_slots = min(num_new + seq.num_lookahead_slots, max_model_len - num_computed)
            while not allocate_slots(seq, num_slots):
                # The victim: the most recently admitted sequence not scheduled this step (or seq).
                scheduled_ids = {item.seq.seq_id for item in items}
                victim = next(s for s in reversed(self.running) if s is seq or s.seq_id not in scheduled_ids)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled_drafts = tuple(drafts[: num_new - num_uncomputed]) if drafts else ()
                items.append(ScheduledSeq(seq, num_new, num_computed,
                                          num_computed + num_new - len(scheduled_drafts) == num_tokens,
                                          scheduled_drafts))
                budget -= num_new
        return budget

    def _schedule_waiting(self, budget: int, totals: RunningTotals | None = None) -> tuple[list[ScheduledSeq], int]:
        """Admit waiting sequences in order while the budget, ``max_num_seqs``, the pages and the
        admission policy allow. ``totals``: the running sequences' (``schedule`` has them from its
        pass over them; None: counted here)."""
        items: list[ScheduledSeq] = []
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return items, budget  # nothing to admit: skip the pass over the running sequences below
        if totals is None:
            totals = RunningTotals(len(self.running), sum(seq.num_tokens - seq.num_computed_tokens
                                                          for seq in self.running))
        deferred: list[Sequence] = []
        # Fewest computed tokens among each request's running samples: a sibling whose prompt
        # pages are still being computed will register them for the others to share.
        min_computed_by_request: dict[str, int] = {}
        for seq in self.running:
            previous = min_computed_by_request.get(seq.request_id, seq.num_computed_tokens)
            min_computed_by_request[seq.request_id] = min(previous, seq.num_computed_tokens)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # A placeholder here is a sample of a just-preempted sequence still in flight; the
            # prefill needs its value on the host, which the next step has.
            if seq.has_placeholder or self._is_sibling_pending(seq, min_computed_by_request):
                deferred.append(self.waiting.popleft())
                continue
            num_cached = self.allocator.num_cached_prefix_tokens(seq)
            num_remaining = seq.num_tokens - num_cached
            num_new = min(num_remaining, budget)
            # Out of pages, now or for what runs already: later arrivals do not overtake (FCFS).
            if not self.admission.can_admit(seq, self.running, totals, self.allocator, len(self.waiting)):
                break
            if not self.allocator.allocate_prompt(seq, num_new):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.admission.on_start(seq)
            totals = RunningTotals(totals.num_seqs + 1,
                                   totals.num_pending_tokens + seq.num_tokens - seq.num_computed_tokens - num_new)
            items.append(self._item(seq, num_new))
            budget -= num_new
            previous = min_computed_by_request.get(seq.request_id, seq.num_computed_tokens)
            min_computed_by_request[seq.request_id] = min(previous, seq.num_computed_tokens)
        self.waiting.extendleft(reversed(deferred))
        return items, budget

    def _is_sibling_pending(self, seq: Sequence, min_computed_by_request: dict[str, int]) -> bool:
        """Whether a running sample of the same request will soon register prompt pages ``seq`` could share.

        Siblings (same ``request_id``) share the prompt by the engine's contract. Waiting for
        them costs ``seq`` a few steps and saves recomputing the shared prompt pages.
        """
        if not self.allocator.enable_prefix_caching or seq.request_id not in min_computed_by_request:
            return False
        page_size = self.config.page_size
        num_shareable = min(seq.num_prompt_tokens, seq.num_tokens - 1) // page_size * page_size
        if min_computed_by_request[seq.request_id] >= num_shareable:
            return False  # the siblings have registered all they will
        return self.allocator.num_cached_prefix_tokens(seq) < num_shareable

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.admission.on_stop(seq)
        self.allocator.free(seq)  # also resets num_computed_tokens: recompute from scratch
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    @staticmethod
    def _item(seq: Sequence, num_new: int, drafts: tuple[int, ...] = ()) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(seq, num_new, start, samples_token=start + num_new - len(drafts) == seq.num_tokens,
                            draft_token_ids=drafts)

"""Admission: whether the scheduler may start one more sequence without over-committing the KV pool.

A sequence admitted today grows by one token per step until it stops; if the pool cannot hold
that growth, decode runs out of pages later and the scheduler preempts by recompute: the victim
loses its pages and recomputes prompt and output as a prefill. Admitting by the prompt alone
("greedy") over-commits whenever the outputs are long: on one H200 (Llama-3.1-8B in bf16, a
pool of 878k tokens) 1000 requests of 1000 + 1000 tokens preempted 380 times and made 8,746
output tok/s; "reserve" (in its session-11 form, below) preempted none and made 9,565
(session 12, one device call).

**The projection.** Under "reserve" each running sequence is expected to run ``ratio`` times
the output it may still generate (``max_tokens`` minus what it generated, within
``max_model_len`` and ``max_reserved_tokens``: a request that sets no ``max_tokens`` is not a
promise of 100k tokens), one token a step, and then to free its pages. The pool's growth after
``t`` more steps is then one token per sequence still running, less what the ended ones freed.
A candidate is admitted if its own pages now, plus the peak of that growth with the candidate
running beside, fit in the free pages:

    pages(candidate now) + pages(pending prompt tokens + max over t < horizon x candidate's run of
                                 growth(t) + t + 1)  <=  free pages

Growth rises between ends and drops at each, so the peak is read at the steps just before an
end: sorting the running set's ends once a step makes a check a few vectorised operations
(``Projection``). A sum of every remaining output (SGLang's reservation, and this module's until
session 12) assumes all of them peak together; the projection lets a sequence that will end
before the candidate peaks lend it the pages it will free.

**The tail of a burst.** Held to the projection, the last requests of a burst wait until the
first ones are about to finish and then run a whole output alone, at a small batch: fp8
throughput-1k (1000 requests, a pool of 1.86M tokens that holds 924 of them at full length) ran
881 steps at ~76 sequences, 11 ms each, after the others ended: 12,445 tok/s against greedy's
14,034. So when the waiting queue is short against the running set (at most ``tail_fraction``
of it), a candidate needs the pool to hold it for only ``tail_horizon`` of its expected run: it
starts now, and if the projection was right it is preempted late, recomputes its tokens as one
prefill and finishes a few steps after the others. With it fp8 throughput-1k made 14,095 tok/s
(48 late preemptions, 1233 steps: greedy's schedule). A long queue still waits for its pages:
the bf16 pool holds ~440 of the 1000, and the scheduler alone with the calibrated step-time
model gives 9,602 tok/s and 1 preemption there (the sum of session 11: 9,631 and none; measured
9,565), and on the H200 it made 9,550 with 2 preemptions (session 13).

**The ratio** is the fraction of the remaining outputs expected to be generated, learned from the
sequences that finish:

- It starts at ``initial_ratio`` (1.0: every running sequence's whole remaining budget is
  expected, as TensorRT-LLM's default ``GUARANTEED_NO_EVICT`` scheduler does) and stays there
  until ``min_finished`` sequences have finished, since until then nothing says that outputs stop
  early.
- Then it falls, by ``(initial_ratio - min_ratio) / decay_steps`` a step, to its floor: the mean
  fraction of their output budget that the last ``finished_window`` finished sequences used
  (``learned_ratio``; aborted ones teach nothing), or ``min_ratio`` if that is more. Requests
  that stop early (EOS, stop strings) thus let more in; a workload whose requests run to
  ``max_tokens`` keeps 1.0 and is not preempted by its own growth.
- A step that preempts puts it back to ``initial_ratio``.

(SGLang's scheduler has the decaying ratio, as ``new_token_ratio``, but decays it every step
toward a fixed floor; ``learn_from_finished=False`` gives that behaviour.) Why learn it: with
SGLang's schedule (0.7 decaying to 0.1 over 600 steps), bf16 throughput-1k was admitted by a ratio
that fell while nothing had finished and preempted 120 times at 1024 sequences (9,159 tok/s,
session 10). ``benchmarks/admission_cpu.py`` runs the scheduler alone on these shapes with a
step-time model calibrated on the H200 runs (``benchmarks/results/admission_cpu.md``).

Pages, not tokens, run out: the candidate is counted as the allocator will take it
(``PageAllocator.num_pages_to_admit``: cached prefix pages another sequence holds cost
nothing), and a sequence is expected to free, when it ends, all it holds less the prefix it
found cached. Growth is summed in tokens before rounding to pages, which counts each sequence's
last partial page at its expected value (half a page) rather than at its worst.

The estimate is not a promise: decode can still outgrow it, and preemption stays the backstop.
Nothing ever waits for nothing: with no sequence running, the first waiting one is admitted
whenever its prompt fits.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import operator
import typing

import numpy as np

from jaxinfer.page_allocator import PageAllocator
from jaxinfer.sequence import Sequence

ADMISSION_POLICIES = ("reserve", "greedy")


class AdmissionConfigError(ValueError):
    """An admission setting that cannot work; ``field`` names it, ``limit`` the bound it broke."""

    def __init__(self, message: str, *, field: str, limit: object = None):
        super().__init__(message)
        self.field = field
        self.limit = limit


@dataclasses.dataclass(frozen=True)
class AdmissionConfig:
    """How the scheduler admits waiting sequences (module docstring).

    ``policy="reserve"`` is the default because a user at high concurrency should get few
    preemptions without sizing ``max_num_seqs`` to the pool, and the decaying ratio keeps the
    throughput of workloads whose requests stop early. ``"greedy"`` admits whenever the prompt
    fits (the scheduler before this policy): the most concurrency now, preemptions later.

    The projection's defaults: the pool must hold a candidate for its whole expected run, or
    for half of it when the waiting queue is at most a tenth of the running set (the tail of a
    burst, which would otherwise run alone after everyone else).

    The ratio defaults: 1.0 at the start and after a preemption (until requests finish, nothing
    says they stop before ``max_tokens``; a preemption says the estimate was short), 0.1 as the
    absolute floor (a tenth of the remaining output is always held for), 600 steps of decay
    from 1.0 to the learned floor (a few seconds of decode), learned from the last 256 finished
    sequences once 8 have finished. ``max_reserved_tokens`` 4096: a longer output is held for as
    if it were 4096 tokens, so requests without ``max_tokens`` do not lock the pool.
    ``learn_from_finished=False``: SGLang's schedule (decay to ``min_ratio`` whatever finished).
    """

    policy: str = "reserve"
    initial_ratio: float = 1.0
    min_ratio: float = 0.1
    decay_steps: int = 600
    max_reserved_tokens: int = 4096
    # The part of a candidate's expected run over which the pool must be projected to hold it;
    # ``tail_horizon`` instead when the waiting queue is at most ``tail_fraction`` of the running
    # set (the tail of a burst: the module docstring).
    horizon: float = 1.0
    tail_fraction: float = 0.1
    tail_horizon: float = 0.5
    # The learned floor: the mean budget use of the last ``finished_window`` finished sequences,
    # trusted once ``min_finished`` have finished (fewer say little about a workload).
    learn_from_finished: bool = True
    min_finished: int = 8
    finished_window: int = 256

    def __post_init__(self):
        if self.policy not in ADMISSION_POLICIES:
            raise AdmissionConfigError(f"admission policy {self.policy!r} is not one of {ADMISSION_POLICIES}",
                                       field="policy", limit=ADMISSION_POLICIES)
        if not 0 < self.initial_ratio <= 1:
            raise AdmissionConfigError(f"initial_ratio must be in (0, 1], got {self.initial_ratio}",
                                       field="initial_ratio", limit=(0, 1))
        if not 0 <= self.min_ratio <= self.initial_ratio:
            raise AdmissionConfigError(
                f"min_ratio must be in [0, initial_ratio={self.initial_ratio}], got {self.min_ratio}",
                field="min_ratio", limit=(0, self.initial_ratio))
        if not isinstance(self.decay_steps, int) or self.decay_steps < 1:
            raise AdmissionConfigError(f"decay_steps must be a positive integer, got {self.decay_steps!r}",
                                       field="decay_steps", limit=1)
        if not isinstance(self.max_reserved_tokens, int) or self.max_reserved_tokens < 1:
            raise AdmissionConfigError(
                f"max_reserved_tokens must be a positive integer, got {self.max_reserved_tokens!r}",
                field="max_reserved_tokens", limit=1)
        if not 0 < self.horizon <= 1:
            raise AdmissionConfigError(f"horizon must be in (0, 1], got {self.horizon}", field="horizon",
                                       limit=(0, 1))
        if not 0 < self.tail_horizon <= self.horizon:
            raise AdmissionConfigError(f"tail_horizon must be in (0, horizon={self.horizon}], got {self.tail_horizon}",
                                       field="tail_horizon", limit=(0, self.horizon))
        if not 0 <= self.tail_fraction <= 1:
            raise AdmissionConfigError(f"tail_fraction must be in [0, 1], got {self.tail_fraction}",
                                       field="tail_fraction", limit=(0, 1))
        if not isinstance(self.finished_window, int) or self.finished_window < 1:
            raise AdmissionConfigError(f"finished_window must be a positive integer, got {self.finished_window!r}",
                                       field="finished_window", limit=1)
        if not isinstance(self.min_finished, int) or not 1 <= self.min_finished <= self.finished_window:
            raise AdmissionConfigError(
                f"min_finished must be an integer in [1, finished_window={self.finished_window}], "
                f"got {self.min_finished!r}", field="min_finished", limit=(1, self.finished_window))


class RunningTotals(typing.NamedTuple):
    """Sums over the running sequences, as the admission check needs them."""

    num_seqs: int
    # Known tokens with no page slot yet: the rest of prompts part-way through a chunked prefill.
    num_pending_tokens: int


def max_num_tokens(seq: Sequence, max_model_len: int) -> int:
    """The most tokens ``seq`` can reach: its prompt plus ``max_tokens``, within ``max_model_len``."""
    if seq.max_tokens is None:
        return max_model_len
    return min(seq.num_prompt_tokens + seq.max_tokens, max_model_len)


class Projection(typing.NamedTuple):
    """The running set's expected pool use, step by step from now (the module docstring).

    Sequence ``i`` is expected to run ``ends[i]`` more steps, one token a step, then to free
    what it holds. Sorted by end, so that the tokens freed by the first ``k`` enders are
    ``cum_freed[k]``.
    """

    ends: np.ndarray  # int64, ascending
    cum_freed: np.ndarray  # int64, len(ends) + 1, cum_freed[0] == 0

    @classmethod
    def of(cls, ends: np.ndarray, freed: np.ndarray) -> "Projection":
        order = np.argsort(ends, kind="stable")
        return cls(ends[order], np.concatenate([[0], np.cumsum(freed[order])]))

    def with_sequence(self, end: int, freed: int) -> "Projection":
        """This projection with one more sequence (one just admitted)."""
        k = int(np.searchsorted(self.ends, end, side="right"))
        ends = np.insert(self.ends, k, end)
        cum_freed = np.concatenate([self.cum_freed[: k + 1], self.cum_freed[k:] + freed])
        return Projection(ends, cum_freed)

    def growth(self, steps: np.ndarray) -> np.ndarray:
        """Tokens the pool holds more than now after each of ``steps`` (0: the next step): one
        more per sequence still running, less what the sequences that ended freed."""
        num_ended = np.searchsorted(self.ends, steps, side="right")
        return (steps + 1) * (len(self.ends) - num_ended) - self.cum_freed[num_ended]

    def peak_growth(self, horizon: int, with_candidate: bool) -> int:
        """The most the pool is expected to grow over the next ``horizon`` steps (at least 0),
        with a candidate that runs all of them beside the running set if ``with_candidate``.

        Growth rises between ends and drops at each, so its peaks are the steps just before an
        end, and the horizon's last step.
        """
        if horizon < 1:
            return 0
        ends = self.ends[: np.searchsorted(self.ends, horizon, side="right")]
        steps = np.append(np.maximum(ends - 1, 0), horizon - 1)
        growth = self.growth(steps)
        if with_candidate:
            growth = growth + steps + 1
        return max(int(growth.max()), 0)


class Admission:
    """The state of one scheduler's admission: the ratio, the running sequences' limits and the
    projection of their growth (rebuilt once a step, when a candidate is first checked).

    The scheduler calls ``on_start`` / ``on_stop`` as sequences enter and leave its running
    list, ``on_finish`` when one ends (not when it is aborted), ``end_step`` once per step, and
    ``can_admit`` per waiting candidate.
    """

    def __init__(self, config: AdmissionConfig, page_size: int, max_model_len: int):
        self.config = config
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.is_reserving = config.policy == "reserve"
        self.ratio = config.initial_ratio if self.is_reserving else 0.0
        self._ratio_decay = (config.initial_ratio - config.min_ratio) / config.decay_steps
        self.limits: dict[int, int] = {}  # max_num_tokens of each running sequence, by seq_id
        self.num_reserved_pages = 0  # at the latest check: pages held back for the running set's growth
        self._projection: Projection | None = None  # None: stale, rebuilt at the next check
        # Fractions of their output budget that the latest finished sequences used, and their sum.
        self._used_fractions: collections.deque[float] = collections.deque(maxlen=config.finished_window)
        self._sum_used_fractions = 0.0
        self._num_finished = 0

    def on_start(self, seq: Sequence) -> None:
        """``seq`` joined the running list (admitted: its prompt's pages are allocated)."""
        limit = self.limits[seq.seq_id] = max_num_tokens(seq, self.max_model_len)
        if self._projection is not None:
            end = int(self.expected_steps(seq.num_tokens, limit))
            self._projection = self._projection.with_sequence(end, self._freed_at_end(seq.num_tokens, end,
                                                                                      seq.num_cached_tokens))

    def on_stop(self, seq: Sequence) -> None:
        del self.limits[seq.seq_id]
        self._projection = None

    def on_finish(self, seq: Sequence) -> None:
        """``seq`` ended by itself (EOS, a stop, ``max_tokens``): learn how much of its budget it used."""
        if not (self.is_reserving and self.config.learn_from_finished):
            return
        budget = min(max_num_tokens(seq, self.max_model_len) - seq.num_prompt_tokens, self.config.max_reserved_tokens)
        if budget < 1:
            return
        fraction = min(seq.num_generated_tokens / budget, 1.0)
        window = self._used_fractions
        if len(window) == window.maxlen:
            self._sum_used_fractions -= window[0]
        window.append(fraction)
        self._sum_used_fractions += fraction
        self._num_finished += 1
        if self._num_finished % window.maxlen == 0:
            self._sum_used_fractions = math.fsum(window)  # once a window: a running float sum drifts

    @property
    def learned_ratio(self) -> float | None:
        """The mean budget use of the latest finished sequences; None until ``min_finished`` have finished."""
        if len(self._used_fractions) < self.config.min_finished:
            return None
        return min(self._sum_used_fractions / len(self._used_fractions), 1.0)

    def end_step(self, preempted: bool) -> None:
        """A step was scheduled: back to the initial ratio if it preempted, else one decay step
        toward the floor: ``min_ratio``, or with ``learn_from_finished`` the initial ratio until
        ``min_finished`` sequences finished and then what they used (``learned_ratio``), if more."""
        self._projection = None  # the running set grew a step
        if not self.is_reserving:
            return
        learned = self.learned_ratio
        if not self.config.learn_from_finished:
            floor = self.config.min_ratio
        elif learned is None:
            floor = self.config.initial_ratio  # nothing finished yet: no evidence that outputs stop early
        else:
            floor = max(self.config.min_ratio, learned)
        if preempted:
            self.ratio = max(self.config.initial_ratio, floor)
        else:
            self.ratio = max(self.ratio - self._ratio_decay, floor)

    def expected_steps(self, num_tokens: np.ndarray | int, limits: np.ndarray | int) -> np.ndarray | int:
        """Steps a sequence of ``num_tokens`` is expected to run on: ``ratio`` times what its
        limit leaves (within ``max_reserved_tokens``), rounded up."""
        remaining = np.clip(np.asarray(limits) - num_tokens, 0, self.config.max_reserved_tokens)
        return np.ceil(self.ratio * remaining).astype(np.int64)

    def projection(self, running: typing.Sequence[Sequence]) -> Projection:
        """The running set's projection (built at most once a step; kept up to date as candidates start)."""
        if self._projection is None:
            n = len(running)
            num_tokens = np.fromiter(map(len, map(_token_ids_of, running)), np.int64, n)
            limits = np.fromiter(map(self.limits.__getitem__, map(_seq_id_of, running)), np.int64, n)
            num_shared = np.fromiter(map(_num_cached_tokens_of, running), np.int64, n)
            ends = self.expected_steps(num_tokens, limits)
            self._projection = Projection.of(ends, self._freed_at_end(num_tokens, ends, num_shared))
        return self._projection

    @staticmethod
    def _freed_at_end(num_tokens, num_steps, num_shared):
        """Tokens a sequence frees when it ends: all it holds then, less the prefix it found
        cached at admission (held by others too). A prefix others found cached in its pages is
        counted as freed: an over-estimate once per shared prefix, which preemption backs up."""
        return np.maximum(num_tokens + num_steps - num_shared, 0)

    def can_admit(self, seq: Sequence, running: typing.Sequence[Sequence], totals: RunningTotals,
                  allocator: PageAllocator, num_waiting: int = 1) -> bool:
        """Whether ``seq`` may start beside ``running`` (the scheduler's running list, in
        admission order; ``totals`` its sums) with ``num_waiting`` sequences waiting, ``seq``
        included: its pages now plus the projected peak of the pool's growth over its expected
        run (half of it for the tail of a burst) must fit in the free pages.

        Always true under "greedy" and with nothing running: the allocator alone then decides
        (by whether the first chunk fits).
        """
        if not self.is_reserving or totals.num_seqs == 0:
            return True
        num_free = allocator.num_free_pages
        num_now = allocator.num_pages_to_admit(seq, seq.num_tokens)
        if num_now > num_free:
            return False
        if self._projection is None:
            projection = self.projection(running)
            # For the metrics: the running set's own peak, over all of its expected run.
            whole_run = int(projection.ends[-1]) + 1 if len(projection.ends) else 0
            self.num_reserved_pages = self._pages(totals.num_pending_tokens
                                                  + projection.peak_growth(whole_run, with_candidate=False))
        end = int(self.expected_steps(seq.num_tokens, max_num_tokens(seq, self.max_model_len)))
        horizon = self.config.horizon
        if num_waiting <= self.config.tail_fraction * totals.num_seqs:
            horizon = self.config.tail_horizon
        peak = self._projection.peak_growth(math.ceil(horizon * end), with_candidate=True)
        return num_now + self._pages(totals.num_pending_tokens + peak) <= num_free

    def _pages(self, num_tokens: int) -> int:
        # Tokens summed over sequences before rounding: each one's last partial page is counted
        # at its expected value (half a page in, half a page out) rather than at its worst.
        return -(-num_tokens // self.page_size)


_token_ids_of = operator.attrgetter("token_ids")
_seq_id_of = operator.attrgetter("seq_id")
_num_cached_tokens_of = operator.attrgetter("num_cached_tokens")

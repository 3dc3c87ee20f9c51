"""Admission: whether the scheduler may start one more sequence without over-committing the KV pool.

A sequence admitted today grows by one token per step until it stops; if the pool cannot hold
that growth, decode runs out of pages later and the scheduler preempts by recompute: the victim
loses its pages and recomputes prompt and output as a prefill, and the decode steps it took
before are wasted. Admitting by the prompt alone ("greedy") over-commits whenever the outputs
are long: on one H200 (Llama-3.1-8B, a pool of 878k tokens) 1000 requests of 1000 + 1000 tokens
preempted 380 times; under "reserve", 120 times, and its output rate rose from 8,873 to 9,159
tok/s (session 10, two device calls).

The "reserve" policy admits a candidate only if the free pages cover, besides the candidate's
own prompt and expected output, the expected growth of every running sequence:

    pages(candidate prompt + ratio x remaining output of the candidate)
      + pages(ratio x remaining outputs of the running + their prompt tokens not yet in a page)
      <= free pages

where a sequence's remaining output is ``max_tokens`` minus what it generated, capped by
``max_model_len`` and by ``max_reserved_tokens`` (a request that sets no ``max_tokens`` is
not a promise of 100k tokens). ``ratio`` is the fraction of the remaining outputs expected to
be generated, learned from the sequences that finish:

- It starts at ``initial_ratio`` (1.0: every running sequence's whole remaining budget is held,
  as TensorRT-LLM's default ``GUARANTEED_NO_EVICT`` scheduler does) and stays there until
  ``min_finished`` sequences have finished, since until then nothing says that outputs stop early.
- Then it falls, by ``(initial_ratio - min_ratio) / decay_steps`` a step, to its floor: the mean
  fraction of their output budget that the last ``finished_window`` finished sequences used
  (``learned_ratio``; aborted ones teach nothing), or ``min_ratio`` if that is more. Requests
  that stop early (EOS, stop strings) thus let more in; a workload whose requests run to
  ``max_tokens`` keeps 1.0 and is never preempted by its own growth.
- A step that preempts puts it back to ``initial_ratio``.

(SGLang's scheduler has the decaying ratio, as ``new_token_ratio``, but decays it every step
toward a fixed floor; ``learn_from_finished=False`` gives that behaviour.) Why learn it: with
SGLang's schedule (0.7 decaying to 0.1 over 600 steps), a workload whose requests all run to
``max_tokens`` (``ignore_eos``: ``throughput-1k``) was admitted by a ratio that fell while
nothing had finished, preempted 120 times at 1024 sequences on the H200 and made 9,159 tok/s,
where ``max_num_seqs`` 384 (no preemption) made 9,799. ``benchmarks/admission_cpu.py``'s
step-time model, calibrated on those H200 runs (it gives 9,316 / 9,670 and greedy's 8,707
against 8,873 measured), puts the learned ratio at 9,631 tok/s and 0 preemptions at 1024, and
within 0.6% of the fixed schedule where half or nine in ten requests stop early
(``benchmarks/results/admission_cpu.md``). The GPU run is the measurement.

Pages, not tokens, run out: the candidate is counted as the allocator will take it
(``PageAllocator.num_pages_to_admit``: cached prefix pages another sequence holds cost
nothing), and the running set's growth in whole pages. The running set's part is computed from
totals, not per sequence: the sum of the running sequences' ``max_num_tokens`` is kept here as
sequences start and stop, and the sum of their token counts comes from the pass the scheduler
makes over them each step anyway, so a check costs O(1) per candidate. Summing the tokens
before rounding to pages counts each sequence's last-page rounding at its expected value (half
a page in, half a page out) rather than at its worst.

The estimate is not a promise: decode can still outgrow it, and preemption stays the backstop.
Nothing ever waits for nothing: with no sequence running, the first waiting one is admitted
whenever its prompt fits.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import typing

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
    num_tokens: int  # prompt + generated tokens
    # Known tokens with no page slot yet: the rest of prompts part-way through a chunked prefill.
    num_pending_tokens: int


def max_num_tokens(seq: Sequence, max_model_len: int) -> int:
    """The most tokens ``seq`` can reach: its prompt plus ``max_tokens``, within ``max_model_len``."""
    if seq.max_tokens is None:
        return max_model_len
    return min(seq.num_prompt_tokens + seq.max_tokens, max_model_len)


class Admission:
    """The state of one scheduler's admission: the ratio and the running sequences' summed limits.

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
        self.sum_max_num_tokens = 0  # of the running sequences
        self.num_reserved_pages = 0  # at the latest check: pages held back for the running set's growth
        # Fractions of their output budget that the latest finished sequences used, and their sum.
        self._used_fractions: collections.deque[float] = collections.deque(maxlen=config.finished_window)
        self._sum_used_fractions = 0.0
        self._num_finished = 0

    def on_start(self, seq: Sequence) -> None:
        self.sum_max_num_tokens += max_num_tokens(seq, self.max_model_len)

    def on_stop(self, seq: Sequence) -> None:
        self.sum_max_num_tokens -= max_num_tokens(seq, self.max_model_len)

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

    def reserved_pages(self, totals: RunningTotals) -> int:
        """Pages the running sequences are expected to take as they go on (0 under "greedy")."""
        if not self.is_reserving:
            return 0
        num_remaining = max(self.sum_max_num_tokens - totals.num_tokens, 0)
        num_remaining = min(num_remaining, totals.num_seqs * self.config.max_reserved_tokens)
        expected_tokens = self.ratio * num_remaining + totals.num_pending_tokens
        return math.ceil(expected_tokens / self.page_size)

    def candidate_tokens(self, seq: Sequence) -> int:
        """Tokens to hold room for if ``seq`` is admitted: all it has and its expected output."""
        num_remaining = max(max_num_tokens(seq, self.max_model_len) - seq.num_tokens, 0)
        num_remaining = min(num_remaining, self.config.max_reserved_tokens)
        return seq.num_tokens + math.ceil(self.ratio * num_remaining)

    def can_admit(self, seq: Sequence, totals: RunningTotals, allocator: PageAllocator) -> bool:
        """Whether ``seq`` may start beside the running sequences ``totals`` sums up.

        Always true under "greedy" and with nothing running: the allocator alone then decides
        (by whether the first chunk fits).
        """
        if not self.is_reserving or totals.num_seqs == 0:
            return True
        self.num_reserved_pages = self.reserved_pages(totals)
        num_needed = self.num_reserved_pages + allocator.num_pages_to_admit(seq, self.candidate_tokens(seq))
        return num_needed <= allocator.num_free_pages

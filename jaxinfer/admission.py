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
be generated: it starts at ``initial_ratio``, drops by ``(initial_ratio - min_ratio) /
decay_steps`` each step without a preemption, down to ``min_ratio``, and goes back to
``initial_ratio`` at each step that preempted. Requests that stop early (EOS, stop strings)
thus let more in over time, while a workload whose requests do run to ``max_tokens`` meets a
preemption and turns conservative again. (SGLang's scheduler works this way, under the name
``new_token_ratio``.)

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

    The ratio defaults: 0.7 at the start and after a preemption (most requests that set
    ``max_tokens`` use most of it, and the running set has some slack from the ones that do
    not), 0.1 as the floor (a tenth of the remaining output is always held for), and 600 steps
    of decay between them (a few seconds of decode: long enough for a preemption to show that
    the workload does use its budgets). ``max_reserved_tokens`` 4096: a longer output is held
    for as if it were 4096 tokens, so requests without ``max_tokens`` do not lock the pool.
    """

    policy: str = "reserve"
    initial_ratio: float = 0.7
    min_ratio: float = 0.1
    decay_steps: int = 600
    max_reserved_tokens: int = 4096

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
    list, ``end_step`` once per step, and ``can_admit`` per waiting candidate.
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

    def on_start(self, seq: Sequence) -> None:
        self.sum_max_num_tokens += max_num_tokens(seq, self.max_model_len)

    def on_stop(self, seq: Sequence) -> None:
        self.sum_max_num_tokens -= max_num_tokens(seq, self.max_model_len)

    def end_step(self, preempted: bool) -> None:
        """A step was scheduled: back to the initial ratio if it preempted, else one decay step."""
        if not self.is_reserving:
            return
        if preempted:
            self.ratio = self.config.initial_ratio
        else:
            self.ratio = max(self.ratio - self._ratio_decay, self.config.min_ratio)

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

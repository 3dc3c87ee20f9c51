"""The speculation policy, drafting, and the rollback after a verify step.

Before each schedule the engine asks :meth:`Speculator.propose` for every running sequence's
drafts (``seq.draft_token_ids``): the scheduler gives each decode ``1 + len(drafts)`` tokens
of the step, the runner verifies them (``jaxinfer.spec_decode.rejection``), and once the step's
accepted counts reach the host the engine applies the kept tokens and calls :func:`roll_back`.

Who speculates (a sequence gets no drafts otherwise):

- only with a ``speculative_config``; then every platform (CPU included), in steps of at most
  ``disable_by_batch_size`` running sequences: a large batch makes a step compute-bound, where
  verify rows cost real work. Its default, ``"auto"``, limits the verify rows on an accelerator
  and sets no limit on the CPU (``SpeculativeConfig.batch_size_limit``);
- a step with a sequence whose sampling the verifier does not reproduce row by row
  (structured outputs, logit_bias, bad_words: applied outside ``sampling.sample``) carries no drafts;
- a sequence with repetition/presence/frequency penalties (its later rows would need the
  drafts in their history), or still short of ``min_tokens``, gets none;
- a sequence whose accepted/drafted ratio is below ``min_acceptance_rate`` once it has drafted
  ``judge_after_drafts`` tokens, or which gained fewer than ``min_accepted_per_step`` accepted
  tokens per step it could draft in (a proposer finding nothing counts) once it has had
  ``judge_after_steps`` of them, gets none for the rest of its life;
- drafts never run past ``max_tokens`` or ``max_model_len``: the accepted run plus its bonus
  token fit.

Host drafts need the sequence's last token on the host: while speculation may happen, the engine
reads each step's tokens before it prepares the next, unless verify steps are asynchronous
(``async_verify``): then the device drafts for the sequences of the verify step in flight and
the host only sizes their drafts (see docs/SPECULATIVE.md).
"""

from __future__ import annotations

import itertools

import jax
import numpy as np

from jaxinfer.page_allocator import PageAllocator
from jaxinfer.sequence import PLACEHOLDER_TOKEN, Sequence
from jaxinfer.spec_decode.config import SpeculativeConfig
from jaxinfer.spec_decode.ngram import propose_ngram

# SamplingParams fields the verifier does not apply to a step's rows: a step with any of them runs plain.
_STEP_BLOCKERS = ("structured_outputs", "logit_bias", "bad_words")


class NgramProposer:
    """Prompt lookup (``jaxinfer.spec_decode.ngram``) for each sequence on its own."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.num_compilations_after_warmup = 0

    def warm_up(self) -> None:
        pass  # nothing to compile

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        return [propose_ngram(np.asarray(seq.token_ids, np.int32), room, self.min_n, self.max_n)
                for seq, room in zip(seqs, rooms)]

    def accept(self, seq: Sequence, num_accepted: int, num_drafted: int) -> None:
        pass  # stateless

    def forget(self, seq: Sequence) -> None:
        pass


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer=None, platform: str | None = None):
        """``proposer``: an object with ``propose(seqs, rooms)``, ``accept``, ``forget``, ``warm_up``
        (``NgramProposer`` or ``draft_model.DraftModelProposer``); default: n-gram. ``platform``:
        where the steps run (``jax.default_backend()`` if None), for ``disable_by_batch_size="auto"``."""
        self.config = config
        self.batch_size_limit = config.batch_size_limit(platform or jax.default_backend())
        self.proposer = proposer or NgramProposer(config)
        self.max_model_len = max_model_len
        self._drafted: dict[int, int] = {}  # seq_id -> draft tokens verified so far
        self._accepted: dict[int, int] = {}  # seq_id -> of those, accepted
        self._steps: dict[int, int] = {}  # seq_id -> steps in which it could draft
        self._judged_low: set[int] = set()
        self.num_drafts = 0  # verify proposals: (sequence, step) pairs with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def may_speculate(self, running: list[Sequence], waiting=()) -> bool:
        """Whether the next step could carry drafts: then its tokens must be known on the host first.
        ``waiting``: sequences the step may admit, whose sampling may rule drafts out for the step."""
        return self._step_allows(running, waiting) and any(self._seq_allows(seq) for seq in running)

    def propose(self, running: list[Sequence], continuing: frozenset[int] = frozenset(), waiting=()) -> None:
        """Set every running sequence's ``draft_token_ids`` for the next schedule (empty: none).
        ``waiting``: sequences the step may admit (a constrained one rules drafts out for the step).

        ``continuing``: ids of the sequences of an asynchronous verify step still in flight; the
        device drafts theirs (``PLACEHOLDER_TOKEN`` drafts here, as many as the host schedules),
        assuming the step in flight accepted as many as it could (``num_lookahead_slots``).
        """
        step_allows = self._step_allows(running, waiting)
        k = self.config.num_speculative_tokens
        drafting, rooms = [], []
        for seq in running:
            seq.draft_token_ids = []
            is_continuing = seq.seq_id in continuing
            if (not step_allows or (seq.has_placeholder and not is_continuing) or seq.num_uncomputed_tokens != 1
                    or not self._seq_allows(seq)):
                continue
            # The accepted run and the token after it must fit max_tokens and max_model_len,
            # whatever the step in flight accepts.
            lookahead = seq.num_lookahead_slots if is_continuing else 0
            room = min(k, seq.sampling.max_tokens - seq.num_generated_tokens - 1 - lookahead,
                       self.max_model_len - seq.num_tokens - 1 - lookahead)
            if room > 0 and not self._judge_gain(seq):
                if is_continuing:
                    seq.draft_token_ids = [PLACEHOLDER_TOKEN] * room
                    continue
                drafting.append(seq)
                rooms.append(room)
        if drafting:
            for seq, drafts in zip(drafting, self.proposer.propose(drafting, rooms)):
                seq.draft_token_ids = list(drafts)

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Count a verify step's outcome for ``seq`` (``num_drafted`` > 0) and judge its acceptance."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1
        self.proposer.accept(seq, num_accepted, num_drafted)
        drafted = self._drafted[seq.seq_id] = self._drafted.get(seq.seq_id, 0) + num_drafted
        accepted = self._accepted[seq.seq_id] = self._accepted.get(seq.seq_id, 0) + num_accepted
        if drafted >= self.config.judge_after_drafts and accepted < self.config.min_acceptance_rate * drafted:
            self._judged_low.add(seq.seq_id)

    def forget(self, seq: Sequence) -> None:
        """Drop a finished sequence's counters."""
        self._drafted.pop(seq.seq_id, None)
        self._accepted.pop(seq.seq_id, None)
        self._steps.pop(seq.seq_id, None)
        self._judged_low.discard(seq.seq_id)
        self.proposer.forget(seq)

    def stats(self) -> dict:
        """Running totals, vLLM's names; the mean acceptance length counts the token after each run."""
        return dict(
            spec_decode_num_drafts=self.num_drafts,
            spec_decode_num_draft_tokens=self.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.num_accepted_tokens,
            spec_decode_mean_acceptance_length=mean_acceptance_length(self.num_accepted_tokens, self.num_drafts),
        )

    def _judge_gain(self, seq: Sequence) -> bool:
        """Count a step ``seq`` could draft in; True (and judged low from now on) if its gain stays low."""
        steps = self._steps[seq.seq_id] = self._steps.get(seq.seq_id, 0) + 1
        if steps > self.config.judge_after_steps and (
                self._accepted.get(seq.seq_id, 0) < self.config.min_accepted_per_step * (steps - 1)):
            self._judged_low.add(seq.seq_id)
            return True
        return False

    def _step_allows(self, running: list[Sequence], waiting=()) -> bool:
        limit = self.batch_size_limit
        if limit is not None and len(running) > limit:
            return False
        # A waiting sequence the step admits counts too: drafts would make its step a verify step,
        # which applies no grammar mask, logit bias or bad words.
        return not any(getattr(seq.sampling.params, field, None)
                       for seq in itertools.chain(running, waiting) for field in _STEP_BLOCKERS)

    def _seq_allows(self, seq: Sequence) -> bool:
        params = seq.sampling.params
        if params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            return False
        return seq.num_generated_tokens >= params.min_tokens and seq.seq_id not in self._judged_low


def mean_acceptance_length(num_accepted_tokens: int, num_drafts: int) -> float:
    """Tokens a verify step gives a speculating sequence, on average: its accepted drafts and the one after."""
    return 1 + num_accepted_tokens / max(1, num_drafts)


def roll_back(seq: Sequence, allocator: PageAllocator, num_lookahead_slots: int = 0) -> None:
    """After a verify step's kept tokens are appended: forget the K/V of the rejected drafts.

    Their slots stay in the cache but lie past the sequence's length, so no step reads them
    (attention and the penalties' history stop at ``kv_lens``) and the next step overwrites
    them; pages wholly past the tokens go back to the pool; newly full pages of known tokens
    are offered to the prefix cache only now, since their tokens were drafts until accepted.
    ``num_lookahead_slots``: slots past the tokens that a verify step in flight may still write.
    """
    seq.num_computed_tokens = seq.num_tokens - 1  # the last token (after the run) is the next input
    allocator.free_tail(seq, num_lookahead_slots)
    allocator.register_computed(seq)

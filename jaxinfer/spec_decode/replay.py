"""What a proposer would gain on a known greedy output, computed without running the model.

With greedy sampling a verify step accepts the longest prefix of the drafts equal to the
target's own next tokens, and the output is token-identical to speculation off. So the
output of a plain greedy run fixes, for any proposer, every step of a speculating run: which
drafts it makes, how many are accepted, and how many target steps the output takes. Replaying a
proposer over a recorded output measures its tokens per step exactly, for as many settings as
wanted, from one (slow, on a CPU) run of the real model. ``tests/test_spec_decode_replay.py``
holds the replay to the engine's own counts.

The replay follows :class:`jaxinfer.spec_decode.speculator.Speculator` at batch 1: drafts never
run past ``max_tokens`` or ``max_model_len`` (the run and the token after it fit), and a
sequence judged low (``min_acceptance_rate``, ``min_accepted_per_step``) stops drafting. It is
the synchronous (host-drafting) engine's schedule; asynchronous verify steps draft the same
tokens (the device proposer equals the host one) but size drafts for the worst case near
``max_tokens``, so they can draft a little less in the last ``k`` tokens of a capped output.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxinfer.spec_decode.config import SpeculativeConfig

# (context [L] int32, room) -> up to ``room`` drafts
Proposer = Callable[[np.ndarray, int], list[int]]


@dataclasses.dataclass
class ReplayCounts:
    """A speculating run's counts, with the engine's names (``Speculator.stats``)."""

    num_output_tokens: int = 0
    num_steps: int = 0  # target steps, the prefill's (which gives the first token) included
    num_drafts: int = 0  # verify steps with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __add__(self, other: ReplayCounts) -> ReplayCounts:
        return ReplayCounts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    @property
    def tokens_per_step(self) -> float:
        return self.num_output_tokens / max(1, self.num_steps)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a step with drafts gives: its accepted drafts and the one after."""
        return 1 + self.num_accepted_tokens / max(1, self.num_drafts)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)

    @property
    def share_of_steps_with_drafts(self) -> float:
        return self.num_drafts / max(1, self.num_steps)


def replay_greedy(prompt_ids, output_ids, propose: Proposer, config: SpeculativeConfig, *, max_tokens: int,
                  max_model_len: int, judge: bool = True) -> ReplayCounts:
    """The counts of a greedy run of one request that speculated with ``propose``.

    ``output_ids``: the plain greedy output (its stop token included, as the engine returns it);
    ``max_tokens``, ``max_model_len``: the limits it ran under. ``judge``: stop drafting as the
    speculator's low-acceptance and low-gain switches would (``config``'s thresholds).
    """
    output = np.asarray(output_ids, np.int32)
    context = np.concatenate([np.asarray(prompt_ids, np.int32), output])
    num_prompt, num_output = len(prompt_ids), len(output)
    k = config.num_speculative_tokens
    counts = ReplayCounts(num_output_tokens=num_output, num_steps=min(1, num_output))
    generated = min(1, num_output)  # the prefill step samples the first token
    drafted = accepted = steps_could_draft = 0
    judged_low = False
    while generated < num_output:
        counts.num_steps += 1
        room = min(k, max_tokens - generated - 1, max_model_len - (num_prompt + generated) - 1)
        drafts: list[int] = []
        if room > 0 and not judged_low:
            steps_could_draft += 1
            if judge and steps_could_draft > config.judge_after_steps and (
                    accepted < config.min_accepted_per_step * (steps_could_draft - 1)):
                judged_low = True
            else:
                drafts = list(propose(context[: num_prompt + generated], room))[:room]
        expected = output[generated: generated + len(drafts)]
        matches = np.asarray(drafts[: len(expected)], np.int32) == expected
        num_accepted = int(np.argmin(matches)) if not matches.all() else len(expected)
        gained = min(num_accepted + 1, num_output - generated)
        if drafts and generated + gained < num_output:  # the engine records a run its sequence outlives
            counts.num_drafts += 1
            counts.num_draft_tokens += len(drafts)
            counts.num_accepted_tokens += num_accepted
            drafted += len(drafts)
            accepted += num_accepted
            if judge and drafted >= config.judge_after_drafts and accepted < config.min_acceptance_rate * drafted:
                judged_low = True
        generated += gained
    return counts

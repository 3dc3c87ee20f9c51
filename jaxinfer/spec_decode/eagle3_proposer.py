"""EAGLE-3 proposer: the head of ``jaxinfer.spec_decode.eagle3`` drafting for the engine's sequences.

Like the draft model (``draft_model.py``) the head keeps its own paged K/V (one layer) indexed
by the *target's* page tables, so it needs no allocator: the proposer takes the target pages
the drafts need before the schedule, and the rollback frees them. Unlike a draft model it reads
the target's features, which the runner stores per KV slot in ``aux_pages``
(``jaxinfer.spec_decode.aux_hidden``), written by every target step of an engine with a head.

Per drafting round, one jitted program per bucket (:func:`~jaxinfer.spec_decode.eagle3.draft_round`):
the head catches up on every position whose target features it has not read yet (the prompt on
first use, then the positions the last verify step kept, *recomputed* with the target's
features although the head ran some of them on its own output while drafting: that is what it
was trained on), then drafts ``k`` tokens on the device with no host trip.

Position ``i`` of the head pairs the target's features of token ``i`` with token ``i + 1``, so a
sequence of ``n`` known tokens, whose last token the target has not computed yet, catches up
to position ``n - 2`` and drafts token ``n`` from there.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.batch import build_step_batch
from jaxinfer.kv_cache import create_kv_cache
from jaxinfer.page_allocator import SCRATCH_PAGE, PageAllocator
from jaxinfer.sequence import Sequence
from jaxinfer.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from jaxinfer.spec_decode.draft_model import catch_up_in_rounds
from jaxinfer.spec_decode.eagle3 import Eagle3Config, Eagle3Weights, draft_round
from jaxinfer.spec_decode.eagle3_checkpoint import load_eagle3_head


def load_head_for(speculative: SpeculativeConfig, target, mesh) -> tuple[Eagle3Config, Eagle3Weights]:
    """The head named by ``speculative.model`` for the ``target`` ``LoadedModel``, in its dtype."""
    if mesh is not None:
        raise SpeculativeConfigError("an EAGLE-3 head runs on one device: use the n-gram proposer with tensor or "
                                     "data parallelism", field="speculative_config.method")
    return load_eagle3_head(speculative.model, target.config, target.weights.embed.dtype)


class Eagle3Proposer:
    """Drafts for a batch of sequences with an EAGLE-3 head; see the module docstring.

    ``target_embed`` and ``aux_pages`` are called at each round: the runner replaces its arrays
    every step (``aux_pages`` is donated to the next one).
    """

    def __init__(self, config: Eagle3Config, weights: Eagle3Weights, *, target_embed: Callable[[], jax.Array],
                 aux_pages: Callable[[], jax.Array], num_pages: int, page_size: int, buckets,
                 num_speculative_tokens: int, allocator: PageAllocator, attention_impl: str = "auto"):
        self.config = config
        self.weights = weights
        self.target_embed = target_embed
        self.aux_pages = aux_pages
        self.buckets = buckets
        self.k = num_speculative_tokens
        self.allocator = allocator
        dtype = weights.final_norm.dtype
        self.cache = create_kv_cache(config.layer, num_pages, page_size, dtype)
        self._round = jax.jit(
            functools.partial(draft_round, config=config, attention_impl=attention_impl,
                              num_drafts=num_speculative_tokens),
            donate_argnames=("cache",),
        )
        # seq_id -> (num_preemptions, head positions computed from the target's features): a
        # preemption frees the pages, so the head starts over with the sequence.
        self._computed: dict[int, tuple[int, int]] = {}
        self._num_compiled_after_warmup = None

    def warm_up(self) -> None:
        """Compile the round of every bucket now, each run once on empty inputs."""
        for t, b, p in self.buckets.all():
            batch = build_step_batch([], num_tokens=t, num_seqs=b, pages_per_seq=p, padding_page=SCRATCH_PAGE)
            _, self.cache = self._call(batch)
        jax.block_until_ready(self.cache)
        self._num_compiled_after_warmup = self._round._cache_size()

    @property
    def num_compilations_after_warmup(self) -> int:
        if self._num_compiled_after_warmup is None:
            return 0
        return self._round._cache_size() - self._num_compiled_after_warmup

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """Up to ``rooms[i]`` drafts for each of ``seqs`` (running decodes with every token known and
        all but the last computed by the target).

        Takes the pages the drafts need now (the verify step needs the same ones); a sequence
        that cannot get them gets no drafts.
        """
        chosen = [(seq, room) for seq, room in zip(seqs, rooms)
                  if room > 0 and seq.num_tokens >= 2 and self.allocator.allocate_slots(seq, 1 + self.k)]
        if not chosen:
            return [[] for _ in seqs]
        drafts_of: dict[int, list[int]] = {}
        pending = [(seq, room, self._start(seq)) for seq, room in chosen]
        # The head's positions [start, n - 1).
        for seq, room, row in catch_up_in_rounds(pending, self.buckets, end_of=lambda seq: seq.num_tokens - 1,
                                                 run=self._run):
            drafts_of[seq.seq_id] = row[:room].tolist()
            # Positions past n - 2 ran on the head's own output: recomputed after the verify step.
            self._computed[seq.seq_id] = (seq.num_preemptions, seq.num_tokens - 1)
        return [drafts_of.get(seq.seq_id, []) for seq in seqs]

    def accept(self, seq: Sequence, num_accepted: int, num_drafted: int) -> None:
        pass  # the next round recomputes the kept positions from the target's features

    def forget(self, seq: Sequence) -> None:
        self._computed.pop(seq.seq_id, None)

    def _start(self, seq: Sequence) -> int:
        preemptions, computed = self._computed.get(seq.seq_id, (seq.num_preemptions, 0))
        if preemptions != seq.num_preemptions:
            computed = 0
        return min(computed, seq.num_tokens - 2)  # at least the last known position, for its logits

    def _run(self, chunks) -> np.ndarray:
        # Head position i reads token i + 1: the chunk of positions [start, end) takes tokens [start + 1, end + 1).
        inputs = [(seq.token_ids[start + 1:end + 1], start, seq.page_table) for seq, _, start, end in chunks]
        num_tokens = sum(end - start for _, _, start, end in chunks)
        t, b, p = self.buckets.pick(num_tokens, len(chunks), max(len(seq.page_table) for seq, *_ in chunks))
        batch = build_step_batch(inputs, num_tokens=t, num_seqs=b, pages_per_seq=p, padding_page=SCRATCH_PAGE)
        drafts, self.cache = self._call(batch)
        return np.asarray(drafts)[: len(chunks)]

    def _call(self, batch):
        return self._round(self.weights, self.cache, self.target_embed(), self.aux_pages(),
                           jax.tree.map(jnp.asarray, batch))

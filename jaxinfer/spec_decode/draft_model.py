"""Draft-model proposer: a small model sharing the target's tokenizer drafts ``k`` tokens greedily.

The draft model has its own paged KV cache (its own layers and heads) indexed by the *target's*
page tables: a draft position lives in the same page id and slot as the target's, so it needs
no allocator of its own, and the target's pages (allocated here for the drafts before the
schedule, freed by the rollback) cover both. Per drafting round, one jitted program per bucket:

1. catch-up: the draft computes the tokens it has not seen yet (the prompt on first use, then
   the accepted tokens of the last verify step), as a ragged batch like the target's prefill;
   its logits at each sequence's last token give the first draft;
2. ``k - 1`` decode steps on the device, each feeding the previous draft back (no host trip).

Drafts are the draft model's argmax: a point mass ``q``, which the verifier's rejection
sampling handles exactly for greedy and random targets alike, and which needs no draft
distribution kept per token. A sequence whose prompt pages came from the prefix cache still
runs its whole prompt through the draft once: the draft's K/V of a shared page is only there
if some earlier sequence drafted over it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.batch import StepBatch, build_step_batch
from jaxinfer.compile_counter import CompilationCounter
from jaxinfer.kv_cache import create_kv_cache
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.model import forward
from jaxinfer.page_allocator import SCRATCH_PAGE, PageAllocator
from jaxinfer.sequence import Sequence
from sharding.placement import commit_beside


def draft_decode_batch(batch: StepBatch, token: jax.Array, i: int) -> StepBatch:
    """The decode batch of draft ``i`` after a catch-up ``batch``: one row per slot, token [B] at position kv_len + i - 1.

    Empty slots (kv_len 0) stay empty; shared by every proposer that drafts on the device
    (the draft model, EAGLE-3's head).
    """
    is_real = batch.kv_lens > 0
    return StepBatch(
        token_ids=token,
        positions=batch.kv_lens + i - 1,
        cu_q_lens=jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(is_real, dtype=jnp.int32)]),
        kv_lens=jnp.where(is_real, batch.kv_lens + i, 0),
        page_tables=batch.page_tables,
        logits_indices=jnp.arange(batch.kv_lens.shape[0], dtype=jnp.int32),
    )


def catch_up_in_rounds(pending, buckets, *, end_of, run):
    """Each pending ``(seq, room, start)``'s catch-up over positions ``[start, end_of(seq))``, in rounds.

    A round packs as many sequences' chunks as the largest step bucket holds and calls
    ``run(chunks)`` (``chunks``: ``(seq, room, start, end)``; it returns one row of drafts per
    chunk); a sequence whose chunk stops short of ``end_of(seq)`` goes round again from there.
    Yields ``(seq, room, drafts)`` for each sequence once its catch-up is complete.
    """
    max_tokens, max_seqs = buckets.num_tokens[-1], buckets.num_seqs[-1]
    while pending:
        chunks, budget, rest = [], max_tokens, []
        for seq, room, start in pending:
            if len(chunks) == max_seqs or budget == 0:
                rest.append((seq, room, start))
                continue
            end = min(end_of(seq), start + budget)
            chunks.append((seq, room, start, end))
            budget -= end - start
        for (seq, room, _, end), row in zip(chunks, run(chunks)):
            if end < end_of(seq):
                rest.append((seq, room, end))
            else:
                yield seq, room, row
        pending = rest


def _draft_round(weights, cache, batch: StepBatch, *, config, attention_impl, num_drafts):
    """Catch-up over ``batch`` then ``num_drafts - 1`` greedy decode steps: drafts [B, num_drafts] and the cache."""
    logits, cache = forward(weights, cache, batch, config, attention_impl)
    token = jnp.argmax(logits, axis=1).astype(jnp.int32)  # [B]
    drafts = [token]
    for i in range(1, num_drafts):
        logits, cache = forward(weights, cache, draft_decode_batch(batch, token, i), config, attention_impl)
        token = jnp.argmax(logits, axis=1).astype(jnp.int32)
        drafts.append(token)
    return jnp.stack(drafts, axis=1), cache


class PagedDraftProposer:
    """What every proposer that drafts on the device shares (the draft model, EAGLE-3's head).

    Its own paged K/V indexed by the target's page tables, a jitted round per bucket (catch-up
    then drafts, donating the cache), and per sequence how far its K/V is computed. A subclass
    says how a round is called (:meth:`_call`) and how its positions line up with the tokens:
    position ``i`` reads token ``i + TOKEN_OFFSET``, so a sequence of ``n`` known tokens catches
    up to position ``n - TOKEN_OFFSET`` (exclusive).
    """

    TOKEN_OFFSET = 0

    def __init__(self, round_fn, cache, *, buckets, num_speculative_tokens: int, allocator: PageAllocator):
        self.buckets = buckets
        self.k = num_speculative_tokens
        self.allocator = allocator
        self.cache = cache
        self._round = jax.jit(round_fn, donate_argnames=("cache",))
        # seq_id -> (num_preemptions, positions whose K/V is in the cache): a preemption frees
        # the pages, so drafting starts over with the sequence.
        self._computed: dict[int, tuple[int, int]] = {}
        self.compilations = CompilationCounter(self._round._cache_size)

    def _call(self, batch: StepBatch):
        """One round over the host ``batch``: (drafts [B, k], the new cache)."""
        raise NotImplementedError

    def _run_round(self, batch: StepBatch):
        """:meth:`_call`, keeping the cache it returns and counting a compilation; returns the drafts."""
        size_before = self.compilations.before()
        drafts, self.cache = self._call(batch)
        self.compilations.after((batch.num_tokens, batch.num_seqs, batch.page_tables.shape[1]), size_before)
        return drafts

    def warm_up(self) -> None:
        """Compile the round of every bucket now, each run once on empty inputs."""
        for t, b, p in self.buckets.all():
            batch = build_step_batch([], num_tokens=t, num_seqs=b, pages_per_seq=p, padding_page=SCRATCH_PAGE)
            self._run_round(batch)
        jax.block_until_ready(self.cache)
        self.compilations.end_warm_up()

    @property
    def num_compilations_after_warmup(self) -> int:
        return self.compilations.num_after_warmup

    def _end(self, seq: Sequence) -> int:
        return seq.num_tokens - self.TOKEN_OFFSET

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """Up to ``rooms[i]`` drafts for each of ``seqs`` (running decodes with every token known).

        Takes the pages the drafts need now (the verify step needs the same ones); a sequence
        that cannot get them gets no drafts.
        """
        chosen = [(seq, room) for seq, room in zip(seqs, rooms)
                  if room > 0 and self._end(seq) >= 1 and self.allocator.allocate_slots(seq, 1 + self.k)]
        if not chosen:
            return [[] for _ in seqs]
        drafts_of: dict[int, list[int]] = {}
        pending = [(seq, room, self._start(seq)) for seq, room in chosen]
        for seq, room, row in catch_up_in_rounds(pending, self.buckets, end_of=self._end, run=self._run):
            drafts_of[seq.seq_id] = row[:room].tolist()
            self._computed[seq.seq_id] = (seq.num_preemptions, self._end(seq))
        return [drafts_of.get(seq.seq_id, []) for seq in seqs]

    def accept(self, seq: Sequence, num_accepted: int, num_drafted: int) -> None:
        """After a verify step (nothing to keep by default: the next round recomputes)."""

    def forget(self, seq: Sequence) -> None:
        self._computed.pop(seq.seq_id, None)

    def _start(self, seq: Sequence) -> int:
        preemptions, computed = self._computed.get(seq.seq_id, (seq.num_preemptions, 0))
        if preemptions != seq.num_preemptions:
            computed = 0
        return min(computed, self._end(seq) - 1)  # at least the last position, for its logits

    def _run(self, chunks) -> np.ndarray:
        o = self.TOKEN_OFFSET
        inputs = [(seq.token_ids[start + o:end + o], start, seq.page_table) for seq, _, start, end in chunks]
        num_tokens = sum(end - start for _, _, start, end in chunks)
        t, b, p = self.buckets.pick(num_tokens, len(chunks), max(len(seq.page_table) for seq, *_ in chunks))
        batch = build_step_batch(inputs, num_tokens=t, num_seqs=b, pages_per_seq=p, padding_page=SCRATCH_PAGE)
        drafts = self._run_round(batch)
        return np.asarray(drafts)[: len(chunks)]


class DraftModelProposer(PagedDraftProposer):
    """Drafts for a batch of sequences with ``model``; see the module docstring."""

    def __init__(self, model: LoadedModel, *, target_vocab_size: int, num_pages: int, page_size: int,
                 buckets, num_speculative_tokens: int, allocator: PageAllocator, attention_impl: str = "auto"):
        if model.config.vocab_size > target_vocab_size:
            raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size}) is larger than the target's "
                             f"({target_vocab_size}): they must share the tokenizer")
        self.model = model
        super().__init__(
            functools.partial(_draft_round, config=model.config, attention_impl=attention_impl,
                              num_drafts=num_speculative_tokens),
            commit_beside(create_kv_cache(model.config, num_pages, page_size, model.weights.embed.dtype), model.weights),
            buckets=buckets, num_speculative_tokens=num_speculative_tokens, allocator=allocator)

    def accept(self, seq: Sequence, num_accepted: int, num_drafted: int) -> None:
        """After a verify step: the draft K/V of the accepted drafts it fed back is valid too."""
        preemptions, computed = self._computed.get(seq.seq_id, (seq.num_preemptions, 0))
        # Drafts 1..k-1 were fed back (the last one never was); the accepted ones are now tokens.
        self._computed[seq.seq_id] = (preemptions, computed + min(num_accepted, num_drafted, self.k - 1))

    def _call(self, batch: StepBatch):
        return self._round(self.model.weights, self.cache, jax.tree.map(jnp.asarray, batch))

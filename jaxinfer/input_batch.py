"""Step inputs: how the scheduler's ``Schedule`` becomes the host arrays of one device step.

The engine decides *what* runs (a ``Schedule``: which tokens of which sequences); this module
packs *how* they run: the padded bucket, the ragged token batch (``StepBatch``), one row of
sampling parameters per sampled token (``SamplingTensors``), and for async scheduling where
an input token is still on the device (``prev_rows``). ``ModelRunner.prepare`` calls
:func:`pack_step` with the runner's buckets.

A step scores rows, not sequences. The sampler's output has one row per token it samples,
and :class:`PackedStep` names the sequence that owns each row (``sampled``); whoever reads
the output (the engine's output processor, the next step's placeholders) goes through that
list and never assumes one row per sequence. Today a sequence whose chunk reaches its end
samples exactly one token, at its own sequence slot; a sequence that puts several rows into
a step (draft tokens to verify) scores ``k + 1`` rows per slot (``jaxinfer.spec_decode.layout``);
its ``sampled`` entry names the slot, and the rows it keeps are known once the device has
decided how many drafts it accepted (``PackedStep.verify``).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import itertools
import operator

import numpy as np

from jaxinfer.bad_words import MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS, fill_bad_words_row
from jaxinfer.batch import StepBatch, build_step_batch
from jaxinfer.logit_bias import MAX_LOGIT_BIAS_IDS, fill_logit_bias_row
from jaxinfer.page_allocator import SCRATCH_PAGE
from jaxinfer.page_table_rows import PageTableRows
from jaxinfer.sampling import SamplingTensors
from jaxinfer.scheduler import Schedule
from jaxinfer.sequence import PLACEHOLDER_TOKEN, Sequence
from jaxinfer.spec_decode.layout import VerifyRows, expand_to_rows

# Fewest items of a one-token-each step (steady decode) packed by whole-list passes with cached
# page-table rows: their fixed numpy costs outweigh the per-item loop below this (at batch 1 the
# loop packed in 48 µs, the whole-list passes in 56).
MIN_ITEMS_FOR_WHOLE_LIST_PACKING = 8

# Width of a row's banned-id list (the ids banned before min_tokens); the engine refuses a
# request that needs more.
MAX_BANNED = 16


@dataclasses.dataclass
class StepInputs:
    """Host-side arrays of one step, sent to the device together."""

    batch: StepBatch
    sampling: SamplingTensors
    prev_rows: np.ndarray  # [T] int32: row of the previous step's sampled tokens to use, or -1
    # "basic" or "full", "_masked" when it takes a structured-output token bitmask: which
    # sampler program runs (runner.SAMPLER_PATHS)
    sampler_path: str
    # A verify step (some sequence carries drafts): [B, k] draft ids and [B] how many are real;
    # ``sampling`` and ``batch.logits_indices`` then have k + 1 rows per slot. None: a plain step.
    draft_ids: np.ndarray | None = None
    num_drafts: np.ndarray | None = None
    # Asynchronous verify steps (jaxinfer.spec_decode.lagged), on every step of such a runner:
    # [B] each slot's slot in the previous step if that was a verify step (else -1), and [T] which
    # of that step's device drafts an input token is (prev_slot * k + j, else -1).
    prev_slots: np.ndarray | None = None
    draft_rows: np.ndarray | None = None

    @property
    def is_verify(self) -> bool:
        return self.draft_ids is not None


@dataclasses.dataclass(frozen=True)
class PackedStep:
    """A step's inputs and which sequence owns each row of its sampled tokens."""

    inputs: StepInputs
    # (sequence, row of the sampler output) per token the step samples, in row order; in a
    # verify step, (sequence, slot): its rows are ``verify.rows_of(slot, num_accepted)``. A list,
    # or a ``SampledInOrder`` (steady decode).
    sampled: collections.abc.Sequence[tuple[Sequence, int]]
    verify: VerifyRows | None = None

    @property
    def sampled_in_order(self) -> list[Sequence] | None:
        """When every entry of ``sampled`` is ``(sampled_in_order[b], b)``: those sequences, so that
        the next step finds each one's row without a lookup (None: look it up in ``sampled``)."""
        return self.sampled.seqs if isinstance(self.sampled, SampledInOrder) else None

    @property
    def wants_logprobs(self) -> bool:
        """Whether a sampled row asked for logprobs (only the "full" path computes them)."""
        return is_full_path(self.inputs.sampler_path) and any(
            seq.sampling.params.logprobs is not None for seq, _ in self.sampled
        )

    def last_row_of_each_seq(self) -> dict[int, int]:
        """``seq_id -> row`` of each sequence's last sampled token: what its next placeholder reads."""
        return {seq.seq_id: row for seq, row in self.sampled}


class SampledInOrder(collections.abc.Sequence):
    """``sampled`` of a step where sequence ``b`` samples row ``b``: the pairs ``(seqs[b], b)``,
    made as they are read. A steady decode step's ~1000 pairs, kept as tuples until the next
    step reads them, would outlive collections of the youngest generation and be promoted, to
    be found dead only by a full collection (~0.1 s over the engine's objects)."""

    def __init__(self, seqs: list[Sequence]):
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self)[index]
        return self.seqs[index], range(len(self.seqs))[index]

    def __iter__(self):
        return zip(self.seqs, itertools.count())

    def __eq__(self, other) -> bool:
        return isinstance(other, collections.abc.Sequence) and list(self) == list(other)


def pack_step(schedule: Schedule, buckets, previous: PackedStep | None, vocab_size: int,
              num_speculative_tokens: int = 0, lagged: bool = False,
              page_table_rows: PageTableRows | None = None) -> PackedStep:
    """The inputs of ``schedule``'s step, padded to the smallest of ``buckets`` (a ``runner.Buckets``)
    that fits; ``previous`` is the step still on the device, whose samples fill placeholders.
    A schedule whose items carry drafts becomes a verify step of ``num_speculative_tokens + 1``
    rows per slot. ``lagged``: the runner runs asynchronous verify steps (``spec_decode.lagged``):
    placeholder drafts are read from the previous verify step's device drafts, and a step that
    continues a verify step is a verify step too (its slots shift by what that step accepted).
    ``page_table_rows``: the runner's page-table rows kept between decode steps (a fresh one if
    None)."""
    items = schedule.items
    num_items = len(items)
    # Whole-list passes through C-level getters: this runs for every running sequence every step.
    seqs = list(map(_seq_of, items))
    samplings = list(map(_sampling_of, seqs))
    num_tokens = sum(map(_num_new_tokens_of, items))
    max_pages = max(map(len, map(_page_table_of, seqs)))
    t_bucket, b_bucket, p_bucket = buckets.pick(num_tokens, num_items, max_pages)
    is_full = any(map(_needs_full_sampler, samplings))
    # A constrained row needs the grammar's bitmask, which only the "_masked" paths take.
    is_masked = list(map(_structured_outputs_of, samplings)).count(None) != num_items
    sampler_path = ("full" if is_full else "basic") + ("_masked" if is_masked else "")
    sampling = neutral_sampling(b_bucket, sampler_path)
    # A placeholder input is read on the device from the previous step's sample (prev_rows).
    prev_rows = np.full(t_bucket, -1, np.int32)
    prev_slots = np.full(b_bucket, -1, np.int32)
    draft_rows = np.full(t_bucket, -1, np.int32)
    follows_verify = lagged and previous is not None and previous.verify is not None
    drafts = list(map(_drafts_of, items))
    if num_tokens == num_items >= MIN_ITEMS_FOR_WHOLE_LIST_PACKING:
        # One token each (every steady decode step): whole-list passes instead of the loop below.
        batch, sampled = _pack_one_token_each(
            items, seqs, previous, prev_rows, prev_slots if follows_verify else None, sampling,
            page_table_rows if page_table_rows is not None else PageTableRows(), (t_bucket, b_bucket, p_bucket))
        if is_full:
            for seq, b in sampled:
                _fill_full_sampling_row(sampling, b, seq, vocab_size)
    else:
        previous_rows = previous.last_row_of_each_seq() if previous is not None else {}
        chunks, sampled, token_row = [], [], 0
        sample_rows, temperatures, seeds, steps = [], [], [], []
        # Rows of prev_rows to set and their values, written at once after the loop: the loop runs
        # for every item of every step (1000 at a time), where a numpy element write costs more
        # than a list append.
        prev_indices, prev_values = [], []
        for b, item in enumerate(items):
            seq, start, n = item.seq, item.start_position, item.num_new_tokens
            drafts = item.draft_token_ids
            if n == 1 + len(drafts):  # a decode: its input is usually the placeholder of the step in flight
                token = seq.token_ids[start]
                if token == PLACEHOLDER_TOKEN:
                    previous_row = previous_rows[seq.seq_id]
                    prev_indices.append(token_row)
                    prev_values.append(previous_row)
                    token = 0
                    if follows_verify:
                        prev_slots[b] = previous_row  # a verify step's sampled entry names the slot
                if not drafts:
                    tokens = (token,)
                elif drafts[0] == PLACEHOLDER_TOKEN:  # the device drafted them
                    if prev_slots[b] < 0:
                        raise ValueError(f"sequence {seq.seq_id} has device drafts but did not run in a verify step before")
                    j = np.arange(len(drafts), dtype=np.int32)
                    draft_rows[token_row + 1 + j] = prev_slots[b] * num_speculative_tokens + j
                    tokens = (token, *[0] * len(drafts))
                else:
                    tokens = (token, *drafts)
            else:
                tokens = seq.token_ids[start : start + n]
                if seq.has_placeholder:
                    for j, token in enumerate(tokens):
                        if token == PLACEHOLDER_TOKEN:
                            prev_indices.append(token_row + j)
                            prev_values.append(previous_rows[seq.seq_id])
                    tokens = [max(t, 0) for t in tokens]
            chunks.append((tokens, start, seq.page_table))
            token_row += n
            if item.samples_token:  # one token, from the logits of this sequence's slot b
                sampled.append((seq, b))
                sample_rows.append(b)
                settings = seq.sampling
                temperatures.append(settings.params.temperature)
                seeds.append(settings.seed)
                steps.append(len(seq.token_ids) - seq.num_prompt_tokens)
                if is_full:
                    _fill_full_sampling_row(sampling, b, seq, vocab_size)
        if prev_indices:
            prev_rows[prev_indices] = prev_values
        sampling.temperature[sample_rows] = temperatures
        sampling.seed[sample_rows] = seeds
        sampling.step[sample_rows] = steps
        batch = build_step_batch(
            chunks, num_tokens=t_bucket, num_seqs=b_bucket, pages_per_seq=p_bucket, padding_page=SCRATCH_PAGE
        )
        drafts = [item.draft_token_ids for item in items]
    lagged_inputs = dict(prev_slots=prev_slots, draft_rows=draft_rows) if lagged else {}
    if not any(drafts) and not (follows_verify and (prev_slots >= 0).any()):
        return PackedStep(StepInputs(batch, sampling, prev_rows, sampler_path, **lagged_inputs), sampled)
    # The speculator drafts for no step with a constrained row (and the engine reads a verify step
    # in flight before such a step), so a verify step is never masked.
    batch, sampling, draft_ids, num_drafts = expand_to_rows(batch, sampling, drafts, num_speculative_tokens)
    verify = VerifyRows(num_speculative_tokens, tuple(len(d) for d in drafts))
    return PackedStep(StepInputs(batch, sampling, prev_rows, sampler_path, draft_ids, num_drafts, **lagged_inputs),
                      sampled, verify)


_seq_of = operator.itemgetter(0)  # of a ScheduledSeq (a NamedTuple)
_num_new_tokens_of = operator.itemgetter(1)
_start_of = operator.itemgetter(2)
_samples_token = operator.itemgetter(3)
_drafts_of = operator.itemgetter(4)
_sampling_of = operator.attrgetter("sampling")
_page_table_of = operator.attrgetter("page_table")
_token_ids_of = operator.attrgetter("token_ids")
_num_prompt_tokens_of = operator.attrgetter("num_prompt_tokens")
_needs_full_sampler = operator.attrgetter("needs_full_sampler")
_structured_outputs_of = operator.attrgetter("params.structured_outputs")
_temperature_of = operator.attrgetter("params.temperature")
_seed_of = operator.attrgetter("seed")


def _pack_one_token_each(items, seqs: list[Sequence], previous: PackedStep | None, prev_rows: np.ndarray,
                         prev_slots: np.ndarray | None, sampling: SamplingTensors, page_table_rows: PageTableRows,
                         bucket: tuple[int, int, int]):
    """``pack_step`` for a step whose items compute one token each (so none carries drafts, and
    item ``b`` is token row ``b`` and slot ``b``), by whole-array operations: the batch and the
    sampled (sequence, row) pairs (a ``SampledInOrder`` when every item samples). Fills ``prev_rows`` (and ``prev_slots`` after a verify step) where the input is a
    placeholder, and the basic sampling rows."""
    num_tokens, num_seqs, width = bucket
    n = len(items)
    starts = list(map(_start_of, items))
    token_lists = list(map(_token_ids_of, seqs))
    tokens = np.fromiter(map(operator.getitem, token_lists, starts), np.int32, n)
    placeholder_rows = np.flatnonzero(tokens == PLACEHOLDER_TOKEN)
    if placeholder_rows.size:
        rows = _rows_in_previous_step(previous, seqs, placeholder_rows)
        prev_rows[placeholder_rows] = rows
        if prev_slots is not None:
            prev_slots[placeholder_rows] = rows  # a verify step's sampled entry names the slot
        tokens[placeholder_rows] = 0
    positions = np.asarray(starts, np.int32)
    batch = StepBatch(
        token_ids=_padded(tokens, num_tokens, 0),
        positions=_padded(positions, num_tokens, 0),
        cu_q_lens=np.concatenate([np.arange(n + 1, dtype=np.int32), np.full(num_seqs - n, n, np.int32)]),
        kv_lens=_padded(positions + 1, num_seqs, 0),
        page_tables=np.full((num_seqs, width), SCRATCH_PAGE, np.int32),
        logits_indices=_padded(np.arange(n, dtype=np.int32), num_seqs, 0),
    )
    batch.page_tables[:n] = page_table_rows.rows(seqs, width)
    samples = list(map(_samples_token, items))
    if samples.count(True) == n:
        sampled_seqs, rows = seqs, slice(0, n)
        sampled = SampledInOrder(seqs)
    else:  # a prompt of one token whose chunk ends before its last: rare
        rows = [b for b, samples_token in enumerate(samples) if samples_token]
        sampled_seqs = [seqs[b] for b in rows]
        token_lists = [token_lists[b] for b in rows]
        sampled = list(zip(sampled_seqs, rows))
    num_sampled = len(sampled_seqs)
    sampled_settings = list(map(_sampling_of, sampled_seqs))
    sampling.temperature[rows] = np.fromiter(map(_temperature_of, sampled_settings), np.float32, num_sampled)
    sampling.seed[rows] = np.fromiter(map(_seed_of, sampled_settings), np.uint32, num_sampled)
    # Tokens generated before this one.
    sampling.step[rows] = (np.fromiter(map(len, token_lists), np.int32, num_sampled)
                           - np.fromiter(map(_num_prompt_tokens_of, sampled_seqs), np.int32, num_sampled))
    return batch, sampled


def _padded(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    out = np.full(size, fill, np.int32)
    out[: values.shape[0]] = values
    return out


def _rows_in_previous_step(previous: PackedStep | None, seqs: list[Sequence], indices: np.ndarray):
    """Row (or a verify step's slot) of ``previous``'s sample of each ``seqs[b]``, ``b`` in ``indices``."""
    if previous is None:
        raise ValueError(f"sequence {seqs[int(indices[0])].seq_id} waits for a sample, but no step is in flight")
    if previous.sampled_in_order is not None and previous.sampled_in_order == seqs:
        return indices  # the same sequences in the same rows: the steady decode step
    rows = previous.last_row_of_each_seq()
    return [rows[seqs[b].seq_id] for b in indices.tolist()]


def empty_step_inputs(num_tokens: int, num_seqs: int, pages_per_seq: int, sampler_path: str = "basic") -> StepInputs:
    """Inputs of a step of the given bucket that computes nothing: for warm-up and as a template."""
    batch = StepBatch(
        token_ids=np.zeros(num_tokens, np.int32),
        positions=np.zeros(num_tokens, np.int32),
        cu_q_lens=np.zeros(num_seqs + 1, np.int32),
        kv_lens=np.zeros(num_seqs, np.int32),
        page_tables=np.full((num_seqs, pages_per_seq), SCRATCH_PAGE, np.int32),
        logits_indices=np.zeros(num_seqs, np.int32),
    )
    sampling = neutral_sampling(num_seqs, sampler_path)
    return StepInputs(batch, sampling, np.full(num_tokens, -1, np.int32), sampler_path)


def is_full_path(sampler_path: str) -> bool:
    """Whether ``sampler_path`` is "full" or its masked twin."""
    return sampler_path.startswith("full")


def neutral_sampling(num_seqs: int, sampler_path: str) -> SamplingTensors:
    """The neutral sampling rows of a step on ``sampler_path``: logit bias and bad-word lists have
    their fixed widths on the full paths and none on the basic ones, whose programs never read
    them. No history: the device gathers it (jaxinfer.token_history)."""
    if not is_full_path(sampler_path):
        return SamplingTensors.neutral(num_seqs, 0, MAX_BANNED)
    return SamplingTensors.neutral(num_seqs, 0, MAX_BANNED, MAX_LOGIT_BIAS_IDS,
                                   (MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS))


def _fill_full_sampling_row(sampling: SamplingTensors, row: int, seq: Sequence, vocab_size: int) -> None:
    """``row``'s fields of the "full" sampler (the basic ones are filled for all rows at once)."""
    settings = seq.sampling
    params = settings.params
    # top_k at or past the vocabulary keeps every token, as off (0) does; it is also how a
    # huge top_k (>= 2**31) never reaches the int32 array.
    sampling.top_k[row] = params.top_k if 0 < params.top_k < vocab_size else 0
    sampling.top_p[row] = params.top_p
    sampling.min_p[row] = params.min_p
    sampling.repetition_penalty[row] = params.repetition_penalty
    sampling.presence_penalty[row] = params.presence_penalty
    sampling.frequency_penalty[row] = params.frequency_penalty
    sampling.num_prompt_tokens[row] = seq.num_prompt_tokens
    if seq.num_generated_tokens < params.min_tokens:
        banned = settings.banned_before_min_tokens  # the engine checked it fits MAX_BANNED
        sampling.banned_ids[row, : len(banned)] = banned
    if params.logit_bias:
        fill_logit_bias_row(sampling.logit_bias_ids, sampling.logit_bias_values, row, params.logit_bias)
    if settings.bad_words_token_ids:
        fill_bad_words_row(sampling.bad_word_ids, row, settings.bad_words_token_ids)

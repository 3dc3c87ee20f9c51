"""Asynchronous verify steps: the device's half of speculating without the host on the critical path.

A synchronous verify step makes the host wait for the accepted counts before it drafts and
schedules the next step. Here the host dispatches step N+1 while step N runs, and learns
step N's accepted count ``a`` one step late, as plain async decode learns sampled tokens:

- step N's verifier also drafts for step N+1, on the device (``device_ngram.propose_after_verify``
  over the tokens it kept), and leaves :class:`DeviceDrafts` behind: per slot, ``a`` and the drafts;
- the host schedules each speculating sequence for its worst case (``1 + k`` tokens, pages for
  ``a`` more positions: ``Sequence.num_lookahead_slots``) at the positions it would have if
  ``a`` were 0, and names, per slot, the slot the sequence had in step N (``prev_slots``) and,
  per input token, which device draft it is (``draft_rows``);
- step N+1's forward and verifier shift each slot by its ``a`` (:func:`continue_batch`,
  :func:`continue_verify_inputs`) and read the drafts there, so positions, K/V slots, the token
  history and the random rows' ``step`` are those of the sequence's true length.

Every slot of a step that follows a verify step must be shifted, so while sequences speculate
every step is a verify step (slots without drafts use one row). Drafts past a slot's count are
computed but never accepted: their K/V lie past the sequence's length, as rejected drafts'.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.batch import StepBatch
from jaxinfer.sampling import SamplingTensors
from jaxinfer.sequence import PLACEHOLDER_TOKEN
from jaxinfer.spec_decode.device_ngram import propose_after_verify


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceDrafts:
    """What a verify step leaves for the next one, per slot (padded to the largest sequence bucket)."""

    num_accepted: jax.Array  # [M] i32: the slot's accepted drafts: the next step's positions shift by it
    draft_ids: jax.Array  # [M, k] i32: drafts for the slot's next step
    num_drafts: jax.Array  # [M] i32: how many of them are real

    @classmethod
    def empty(cls, num_slots: int, num_speculative_tokens: int) -> DeviceDrafts:
        return cls(jnp.zeros((num_slots,), jnp.int32), jnp.zeros((num_slots, num_speculative_tokens), jnp.int32),
                   jnp.zeros((num_slots,), jnp.int32))


def slot_offsets(prev_slots: jax.Array, carry: DeviceDrafts) -> jax.Array:
    """[B] positions each slot lies past the host's count: its accepted drafts of the step before (0: none)."""
    return jnp.where(prev_slots >= 0, carry.num_accepted[jnp.maximum(prev_slots, 0)], 0)


def continue_batch(batch: StepBatch, prev_slots: jax.Array, draft_rows: jax.Array, carry: DeviceDrafts) -> StepBatch:
    """``batch`` at the sequences' true lengths, with the device's drafts as their inputs.

    ``prev_slots`` [B]: each slot's slot in the previous step if that was a verify step, else -1;
    ``draft_rows`` [T]: for a device draft input, ``prev_slot * k + j`` (its draft ``j``), else -1.
    """
    offsets = slot_offsets(prev_slots, carry)  # [B]
    num_tokens = batch.token_ids.shape[0]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    slot_of_row = jnp.searchsorted(batch.cu_q_lens[1:], rows, side="right")
    slot_of_row = jnp.minimum(slot_of_row, offsets.shape[0] - 1)
    row_offsets = jnp.where(rows < batch.cu_q_lens[-1], offsets[slot_of_row], 0)
    drafts = carry.draft_ids.reshape(-1)
    token_ids = jnp.where(draft_rows >= 0, drafts[jnp.maximum(draft_rows, 0)], batch.token_ids)
    return dataclasses.replace(batch, token_ids=token_ids, positions=batch.positions + row_offsets,
                               kv_lens=jnp.where(batch.kv_lens > 0, batch.kv_lens + offsets, 0))


def continue_verify_inputs(sampling: SamplingTensors, kv_lens: jax.Array, draft_ids: jax.Array, num_drafts: jax.Array,
                           prev_slots: jax.Array, carry: DeviceDrafts):
    """The verifier's inputs at the sequences' true lengths: ``kv_lens`` [B] and each row's ``step``
    shifted, and a device-drafting slot's drafts (host ``draft_ids`` of ``PLACEHOLDER_TOKEN``) read
    from ``carry``, as many as both the device found and the host scheduled (``num_drafts`` [B])."""
    num_slots, k = draft_ids.shape
    offsets = slot_offsets(prev_slots, carry)
    source = jnp.maximum(prev_slots, 0)
    is_device = (draft_ids[:, 0] == PLACEHOLDER_TOKEN) & (num_drafts > 0) & (prev_slots >= 0)
    draft_ids = jnp.where(is_device[:, None], carry.draft_ids[source], draft_ids)
    num_drafts = jnp.where(is_device, jnp.minimum(carry.num_drafts[source], num_drafts), num_drafts)
    sampling = dataclasses.replace(sampling, step=sampling.step + jnp.repeat(offsets, k + 1))
    kv_lens = jnp.where(kv_lens > 0, kv_lens + offsets, 0)
    return sampling, kv_lens, draft_ids, num_drafts


def drafts_for_next_step(token_pages: jax.Array, page_tables: jax.Array, kv_lens: jax.Array, num_drafts: jax.Array,
                         num_accepted: jax.Array, next_token: jax.Array, *, num_padded: int, num_speculative_tokens: int,
                         min_n: int, max_n: int) -> DeviceDrafts:
    """After a verify step (``kv_lens`` shifted as the forward saw them): the carry for the next step."""
    k = num_speculative_tokens
    draft_ids, counts = propose_after_verify(
        token_pages, page_tables, kv_lens, num_drafts, num_accepted, next_token, jnp.full_like(num_accepted, k),
        num_speculative_tokens=k, min_n=min_n, max_n=max_n)
    num_slots = num_accepted.shape[0]

    def pad(x):
        return jnp.zeros((num_padded, *x.shape[1:]), jnp.int32).at[:num_slots].set(x)

    return DeviceDrafts(pad(num_accepted), pad(draft_ids), pad(counts))

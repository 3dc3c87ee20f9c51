"""The rows of a verify step: ``k + 1`` logits rows per sequence slot, whatever its number of drafts.

A step where some sequence carries drafts scores ``B * (k + 1)`` rows instead of ``B``
(``k`` = ``num_speculative_tokens``, ``B`` the sequence bucket): slot ``b`` owns rows
``b * (k + 1) .. b * (k + 1) + k``. With ``n_b`` drafts its inputs are ``[last, d_1..d_n]``
and row ``j <= n_b`` reads the logits of input ``j``; rows past ``n_b`` (and every row of a
slot without drafts, but the first) repeat its last input's logits and are never read. The
fixed width keeps one program per bucket: the verify programs are compiled at start-up.

The plain step's per-slot arrays (one sampling row per slot) become per-row arrays by
repeating each slot ``k + 1`` times; row ``j`` samples output number ``step + j``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer.batch import StepBatch
from jaxinfer.sampling import SamplingTensors


@dataclasses.dataclass(frozen=True)
class VerifyRows:
    """Which slots of a verify step carry how many drafts (the host's view of its rows)."""

    num_speculative_tokens: int  # k: each slot has k + 1 rows
    num_drafts: tuple[int, ...]  # per used slot, in slot order

    def rows_of(self, slot: int, num_accepted: int) -> range:
        """The rows whose tokens slot ``slot`` keeps: its accepted drafts and the token after them."""
        first = slot * (self.num_speculative_tokens + 1)
        return range(first, first + num_accepted + 1)


def expand_to_rows(batch: StepBatch, sampling: SamplingTensors, drafts: list[tuple[int, ...]],
                   num_speculative_tokens: int) -> tuple[StepBatch, SamplingTensors, np.ndarray, np.ndarray]:
    """A plain step's batch and sampling rows (one per slot) as a verify step's: ``k + 1`` rows per
    slot. ``drafts``: each used slot's draft tokens, in slot order. Returns the batch (with
    ``logits_indices`` [B * (k + 1)]), the row sampling tensors, ``draft_ids`` [B, k] and ``num_drafts`` [B]."""
    k = num_speculative_tokens
    num_slots = batch.num_seqs
    num_drafts = np.zeros(num_slots, np.int32)
    draft_ids = np.zeros((num_slots, k), np.int32)
    for slot, slot_drafts in enumerate(drafts):
        if len(slot_drafts) > k:
            raise ValueError(f"slot {slot} has {len(slot_drafts)} drafts; num_speculative_tokens is {k}")
        num_drafts[slot] = len(slot_drafts)
        draft_ids[slot, : len(slot_drafts)] = slot_drafts
    j = np.arange(k + 1, dtype=np.int32)[None, :]
    # The plain step's logits index is the slot's last input: its last draft, or its only token.
    first_row = batch.logits_indices - num_drafts
    logits_indices = (first_row[:, None] + np.minimum(j, num_drafts[:, None])).reshape(-1).astype(np.int32)
    rows = {field.name: np.repeat(np.asarray(getattr(sampling, field.name)), k + 1, axis=0)
            for field in dataclasses.fields(sampling)}
    rows["step"] = rows["step"] + np.tile(j[0], num_slots)
    return (dataclasses.replace(batch, logits_indices=logits_indices), SamplingTensors(**rows), draft_ids, num_drafts)

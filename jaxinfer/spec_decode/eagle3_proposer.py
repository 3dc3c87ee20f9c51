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

from jaxinfer.kv_cache import create_kv_cache
from jaxinfer.page_allocator import PageAllocator
from jaxinfer.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from jaxinfer.spec_decode.draft_model import PagedDraftProposer
from jaxinfer.spec_decode.eagle3 import Eagle3Config, Eagle3Weights, draft_round
from jaxinfer.spec_decode.eagle3_checkpoint import load_eagle3_head
from sharding.placement import commit_beside


def load_head_for(speculative: SpeculativeConfig, target, mesh) -> tuple[Eagle3Config, Eagle3Weights]:
    """The head named by ``speculative.model`` for the ``target`` ``LoadedModel``, in its dtype."""
    if mesh is not None:
        raise SpeculativeConfigError("an EAGLE-3 head runs on one device: use the n-gram proposer with tensor or "
                                     "data parallelism", field="speculative_config.method")
    return load_eagle3_head(speculative.model, target.config, target.weights.embed.dtype)


class Eagle3Proposer(PagedDraftProposer):
    """Drafts for a batch of sequences with an EAGLE-3 head; see the module docstring.

    ``target_embed`` and ``aux_pages`` are called at each round: the runner replaces its arrays
    every step (``aux_pages`` is donated to the next one).
    """

    # Head position i pairs the target's features of token i with token i + 1.
    TOKEN_OFFSET = 1

    def __init__(self, config: Eagle3Config, weights: Eagle3Weights, *, target_embed: Callable[[], jax.Array],
                 aux_pages: Callable[[], jax.Array], num_pages: int, page_size: int, buckets,
                 num_speculative_tokens: int, allocator: PageAllocator, attention_impl: str = "auto"):
        self.config = config
        self.weights = weights
        self.target_embed = target_embed
        self.aux_pages = aux_pages
        # Positions past n - 2 run on the head's own output while drafting: the next round
        # recomputes them from the target's features (accept keeps nothing).
        super().__init__(
            functools.partial(draft_round, config=config, attention_impl=attention_impl,
                              num_drafts=num_speculative_tokens),
            commit_beside(create_kv_cache(config.layer, num_pages, page_size, weights.final_norm.dtype),
                          weights, target_embed()),
            buckets=buckets, num_speculative_tokens=num_speculative_tokens, allocator=allocator)

    def _call(self, batch):
        return self._round(self.weights, self.cache, self.target_embed(), self.aux_pages(),
                           jax.tree.map(jnp.asarray, batch))

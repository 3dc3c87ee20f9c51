"""Exact verification of drafted tokens on the device: greedy prefix match and rejection sampling.

A sequence with ``n`` drafts ``d_1..d_n`` puts ``n + 1`` rows into a verify step: row ``j``
holds the target's logits after ``d_1..d_j`` (row 0: after its last accepted token). Row ``j``
is sampled as the non-speculative sampler would sample the sequence's output number
``step + j`` (same parameters, same seed and step, so the same Gumbel noise), then:

- greedy rows accept ``d_{j+1}`` when it equals the row's argmax;
- random rows accept ``d_{j+1}`` with probability ``min(1, p(d)/q(d))``, where ``p`` is the
  row's target distribution (after penalties, bans, temperature, top-k/top-p/min-p, as in
  ``jaxinfer.sampling``) and ``q`` the proposer's; the n-gram proposer's ``q`` is a point
  mass, so the test is ``u < p(d)``.

The accepted run is the longest prefix of accepted drafts (``a`` tokens); one more token
follows it: at a rejection, a sample of the normalised residual ``max(0, p - q)`` (for a
point mass: ``p`` without ``d``), else the bonus row's own sample. The output therefore has
the target's distribution token by token (Leviathan et al. 2023, Chen et al. 2023), and with
greedy rows it is exactly the target's argmax chain. ``a`` is decided here, on the device.

Randomness: the acceptance draw of row ``j`` is a uniform keyed by ``(seed, step + j)`` and
a tag that sets it apart from the sampler's Gumbel noise, so a seeded request reproduces its
tokens with speculation on, whatever the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.sampling import (GREEDY_TEMPERATURE, SamplerOutput, SamplingFlags, SamplingTensors, _gumbel_noise,
                               _token_mask, _top_k_top_p_mask, apply_penalties, sample)

# Folded into a row's (seed, step) key for its acceptance draw; the Gumbel noise uses the key unfolded.
_ACCEPT_TAG = 0x5EC


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    """What a verify step leaves on the device; the host reads it a step later."""

    sampler: SamplerOutput  # one entry per row [B * (K + 1)]: the output token of each row (-1 past the run)
    num_accepted: jax.Array  # [B] i32: accepted drafts a; the sequence gains a + 1 tokens
    last_token: jax.Array  # [B] i32: row a's token, the sequence's next input
    num_drafts: jax.Array  # [B] i32: drafts verified (an asynchronous step's drafts are made on the device)


def target_log_probs(logits: jax.Array, tensors: SamplingTensors, flags: SamplingFlags) -> jax.Array:
    """[R, V] log p of each row's target distribution, the one ``sampling.sample`` draws random rows from.

    The same stages in the same order as ``sample`` (penalties, bans, temperature, top-k/top-p,
    min-p); greedy rows get temperature 1 here and are never read as distributions.
    """
    processed = logits.astype(jnp.float32)
    vocab_size = processed.shape[1]
    if flags.any_penalties:
        processed = apply_penalties(processed, tensors)
    if flags.any_banned:
        processed = jnp.where(_token_mask(tensors.banned_ids, vocab_size), -jnp.inf, processed)
    is_random = tensors.temperature >= GREEDY_TEMPERATURE
    scaled = processed / jnp.where(is_random, tensors.temperature, 1.0)[:, None]
    if flags.any_truncation:
        keep = _top_k_top_p_mask(scaled, tensors.top_k, tensors.top_p)
        log_min_p = jnp.where(tensors.min_p > 0, jnp.log(jnp.maximum(tensors.min_p, 1e-30)), -jnp.inf)
        keep &= scaled >= (jnp.max(scaled, axis=1) + log_min_p)[:, None]
        scaled = jnp.where(keep, scaled, -jnp.inf)
    return jax.nn.log_softmax(scaled, axis=1)


def _acceptance_uniforms(seed: jax.Array, step: jax.Array) -> jax.Array:
    """[R] uniforms in [0, 1); row r's depends only on (seed[r], step[r])."""

    def row(seed, step):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), _ACCEPT_TAG)
        return jax.random.uniform(key, (), jnp.float32)

    return jax.vmap(row)(seed, step)


def verify(logits: jax.Array, tensors: SamplingTensors, flags: SamplingFlags, draft_ids: jax.Array,
           num_drafts: jax.Array, draft_probs: jax.Array | None = None) -> VerifyOutput:
    """Verify drafts ``draft_ids`` [B, K] (the first ``num_drafts`` [B] of each row real) against the
    target's ``logits`` [B * (K + 1), V], whose rows and ``tensors`` follow ``jaxinfer.spec_decode.layout``.

    ``draft_probs`` [B, K, V]: the proposer's distribution at each draft (a draft model's);
    ``None``: each draft is a point mass (n-gram).
    """
    num_seqs, k = draft_ids.shape
    num_rows, vocab_size = logits.shape
    plain = sample(logits, tensors, flags)  # each row as the non-speculative sampler samples it
    plain_tokens = plain.token_ids.reshape(num_seqs, k + 1)
    is_random = (tensors.temperature >= GREEDY_TEMPERATURE).reshape(num_seqs, k + 1)
    is_real = jnp.arange(k)[None, :] < num_drafts[:, None]  # [B, K]
    safe_drafts = jnp.where(is_real, draft_ids, 0)

    if flags.any_random:
        log_p = target_log_probs(logits, tensors, flags).reshape(num_seqs, k + 1, vocab_size)
        p_draft = jnp.exp(jnp.take_along_axis(log_p[:, :k], safe_drafts[..., None], axis=2)[..., 0])  # [B, K]
        if draft_probs is None:
            q_draft = jnp.ones_like(p_draft)
        else:
            q_draft = jnp.take_along_axis(draft_probs, safe_drafts[..., None], axis=2)[..., 0]
        u = _acceptance_uniforms(tensors.seed, tensors.step).reshape(num_seqs, k + 1)[:, :k]
        random_accept = u * q_draft < p_draft  # u < min(1, p/q), without dividing by a zero q
    else:
        random_accept = jnp.zeros((num_seqs, k), bool)
    greedy_accept = plain_tokens[:, :k] == draft_ids
    accept = jnp.where(is_random[:, :k], random_accept, greedy_accept) & is_real
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [B]

    # The token after the accepted run: a residual sample at a rejection, else the row's own.
    next_token = jnp.take_along_axis(plain_tokens, num_accepted[:, None], axis=1)[:, 0]  # [B]
    if flags.any_random:
        rows = jnp.arange(num_seqs)
        stop_row = jnp.minimum(num_accepted, k - 1)  # the rejected draft's row (clamped when none was)
        rejected_draft = safe_drafts[rows, stop_row]
        p_row = jnp.exp(log_p[rows, num_accepted])  # [B, V]
        if draft_probs is None:
            residual = p_row.at[rows, rejected_draft].set(0.0)
        else:
            residual = jnp.maximum(p_row - draft_probs[rows, stop_row], 0.0)
        seeds = tensors.seed.reshape(num_seqs, k + 1)[rows, num_accepted]
        steps = tensors.step.reshape(num_seqs, k + 1)[rows, num_accepted]
        perturbed = jnp.log(residual) + _gumbel_noise(seeds, steps, vocab_size)
        residual_token = jnp.argmax(perturbed, axis=1).astype(jnp.int32)
        was_rejected = num_accepted < num_drafts
        # A residual with no mass left (p == q on every token) cannot happen after a
        # rejection in exact arithmetic; fall back to the row's sample then.
        has_mass = jnp.sum(residual, axis=1) > 0
        use_residual = was_rejected & is_random[rows, num_accepted] & has_mass
        next_token = jnp.where(use_residual, residual_token, next_token)

    position = jnp.arange(k + 1)[None, :]
    drafts_then_pad = jnp.concatenate([draft_ids, jnp.zeros((num_seqs, 1), jnp.int32)], axis=1)
    tokens = jnp.where(position < num_accepted[:, None], drafts_then_pad,
                       jnp.where(position == num_accepted[:, None], next_token[:, None], -1))  # [B, K+1]
    flat_tokens = tokens.reshape(num_rows)
    # Logprobs of each row's output token, from the raw logits (as the plain sampler reports them).
    raw = logits.astype(jnp.float32)
    log_normalizer = jax.nn.logsumexp(raw, axis=1)
    chosen = jnp.take_along_axis(raw, jnp.maximum(flat_tokens, 0)[:, None], axis=1)[:, 0]
    sampler = dataclasses.replace(plain, token_ids=flat_tokens, logprobs=chosen - log_normalizer)
    return VerifyOutput(sampler, num_accepted.astype(jnp.int32), next_token, num_drafts.astype(jnp.int32))

"""On-device sampling: one token per row of a batch of logits, each row with its own parameters.

The runner calls ``sample(logits, tensors, flags)`` in its jitted sampler program, which runs
on the forward's logits each step (one program per sequence bucket and flag set). ``SamplingTensors``
holds one row per sequence (arrays built as numpy on the host and sent with the step's other
inputs); ``SamplingFlags`` is static (part of the compiled program) and only switches whole
stages off when no row of the step needs them.

Order of operations (vLLM's)::

    raw logits --(logprobs / top logprobs are read here, from log_softmax of the raw logits)
      -> repetition penalty (tokens seen in prompt or output)
      -> frequency and presence penalties (output tokens only)
      -> logit_bias (``jaxinfer.logit_bias``)
      -> bans (``banned_ids`` set to -inf; the host uses them for min_tokens), bad words
         (``jaxinfer.bad_words``), and the grammar's token bitmask (``jaxinfer.structured_output``)
      -> greedy rows (temperature < 1e-5): argmax here
      -> temperature -> top-k -> top-p (on the top-k renormalized distribution) -> min-p
      -> sample: Gumbel-max over the kept tokens

Reproducibility: a row's noise is ``gumbel(fold_in(key(seed), step), [V])``, indexed by token
id, so its token depends only on its own seed, step, parameters and logits: never on the
batch size, its row index, the other rows, or which ``SamplingFlags`` the step compiled
with (the flags only skip stages that are the identity for every row). A request resumed
after preemption regenerates the same tokens because ``step`` counts its own outputs.

Top-k and top-p share one stable sort per row (descending value, ascending token id on
ties): the kept set is a prefix of that order, so it has exactly ``k`` tokens for top-k and
is the smallest prefix whose mass reaches ``top_p``; ties at the cut keep the lower ids.
Min-p needs no sort: ``p_i >= min_p * p_max`` is ``logit_i >= max_logit + log(min_p)``,
unchanged by the renormalization after top-k/top-p.

Host helper: ``SamplingTensors.neutral(num_seqs, history_len, num_banned)`` gives numpy
arrays with every feature off (padding rows stay like that) to fill per row.

Which sampling type is which (``jaxinfer.sampling_params`` has the host-side two):
``SamplingParams`` is what a client asks for, per request; ``SequenceSampling`` one sample's
share of it (seed, token budget, banned ids); ``SamplingTensors`` (here) those settings as
arrays, one row per token a step samples; ``SamplingFlags`` (here) the static stages a sampler
program compiles (the runner's "basic" and "full" sampler paths); ``SamplerOutput`` (here)
the sampled ids and their logprobs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bad_words import NOT_OUTPUT, bad_word_bans
from jaxinfer.logit_bias import apply_logit_bias
from jaxinfer.structured_output.bitmask import apply_token_bitmask

GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: below it a row is greedy


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters; every array has leading axis B (the step's sequences)."""

    temperature: jax.Array  # [B] f32; < 1e-5 means greedy
    top_k: jax.Array  # [B] i32; <= 0 or >= V means off
    top_p: jax.Array  # [B] f32; >= 1.0 means off
    min_p: jax.Array  # [B] f32; <= 0.0 means off
    repetition_penalty: jax.Array  # [B] f32; 1.0 means off
    presence_penalty: jax.Array  # [B] f32; 0.0 means off
    frequency_penalty: jax.Array  # [B] f32; 0.0 means off
    seed: jax.Array  # [B] u32
    step: jax.Array  # [B] i32, tokens this sample generated before this one
    history_ids: jax.Array  # [B, L] i32, prompt + output ids, padded with -1
    history_is_output: jax.Array  # [B, L] bool, True where history_ids is an output token
    banned_ids: jax.Array  # [B, M] i32, ids forbidden this step (e.g. EOS before min_tokens), padded with -1
    # [B] i32: the engine's runner builds history_ids/history_is_output on the device from its
    # token pages (jaxinfer.token_history) and needs where each row's output starts.
    num_prompt_tokens: jax.Array = None
    logit_bias_ids: jax.Array = None  # [B, N] i32, padded with -1 (jaxinfer.logit_bias)
    logit_bias_values: jax.Array = None  # [B, N] f32
    bad_word_ids: jax.Array = None  # [B, S, L] i32, right-aligned, padded with -1 (jaxinfer.bad_words)
    bad_word_tail: jax.Array = None  # [B, L-1] i32: each row's last tokens, gathered on the device

    @classmethod
    def neutral(cls, num_seqs: int, history_len: int = 0, num_banned: int = 0, num_logit_bias: int = 0,
                bad_words_shape: tuple[int, int] = (0, 0)) -> SamplingTensors:
        """Numpy arrays for ``num_seqs`` greedy rows with every feature off, to fill on the host."""
        num_sequences, sequence_len = bad_words_shape
        return cls(
            temperature=np.zeros(num_seqs, np.float32),
            top_k=np.zeros(num_seqs, np.int32),
            top_p=np.ones(num_seqs, np.float32),
            min_p=np.zeros(num_seqs, np.float32),
            repetition_penalty=np.ones(num_seqs, np.float32),
            presence_penalty=np.zeros(num_seqs, np.float32),
            frequency_penalty=np.zeros(num_seqs, np.float32),
            seed=np.zeros(num_seqs, np.uint32),
            step=np.zeros(num_seqs, np.int32),
            history_ids=np.full((num_seqs, history_len), -1, np.int32),
            history_is_output=np.zeros((num_seqs, history_len), bool),
            banned_ids=np.full((num_seqs, num_banned), -1, np.int32),
            num_prompt_tokens=np.zeros(num_seqs, np.int32),
            logit_bias_ids=np.full((num_seqs, num_logit_bias), -1, np.int32),
            logit_bias_values=np.zeros((num_seqs, num_logit_bias), np.float32),
            bad_word_ids=np.full((num_seqs, num_sequences, sequence_len), -1, np.int32),
            bad_word_tail=np.full((num_seqs, max(sequence_len - 1, 0)), NOT_OUTPUT, np.int32),
        )


@dataclasses.dataclass(frozen=True)
class SamplingFlags:
    """Static switches (one compilation each); a False flag skips a stage no row needs."""

    any_penalties: bool = False  # some row has a repetition, presence or frequency penalty
    any_banned: bool = False  # some row has banned_ids
    any_random: bool = False  # some row has temperature >= 1e-5; if False every row is greedy
    any_truncation: bool = False  # some random row uses top-k, top-p or min-p
    num_top_logprobs: int = 0  # K in 0..20; the runner always compiles 20 and slices on the host
    any_logit_bias: bool = False  # some row has logit_bias
    any_bad_words: bool = False  # some row has bad words (bad_word_tail filled on the device)
    # Some row may report its token's logprob. False: ``SamplerOutput.logprobs`` is NaN and the
    # log-softmax normaliser is not computed: ~50 us of a 384-sequence decode step of an 8B model
    # on an H200 (session 23's traces).
    any_logprobs: bool = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32, log_softmax(raw logits)[token]
    top_logprob_ids: jax.Array  # [B, K] i32, K = flags.num_top_logprobs, best first
    top_logprob_values: jax.Array  # [B, K] f32, raw log_softmax values, descending


def _token_mask(ids: jax.Array, vocab_size: int) -> jax.Array:
    """[B, N] ids (-1 = padding) -> [B, V] bool, True at every listed id."""
    safe = jnp.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)  # out of range: dropped
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], vocab_size), bool).at[rows, safe].set(True, mode="drop")


def apply_penalties(logits: jax.Array, tensors: SamplingTensors) -> jax.Array:
    """Repetition (HF/vLLM: prompt or output), then frequency and presence (OpenAI: output only)."""
    num_seqs, vocab_size = logits.shape
    ids = tensors.history_ids  # [B, L]
    valid = (ids >= 0) & (ids < vocab_size)
    safe = jnp.where(valid, ids, vocab_size)
    rows = jnp.arange(num_seqs)[:, None]
    zeros = jnp.zeros((num_seqs, vocab_size), jnp.int32)
    seen = zeros.at[rows, safe].add(1, mode="drop") > 0  # [B, V]
    output_counts = zeros.at[rows, safe].add((valid & tensors.history_is_output).astype(jnp.int32), mode="drop")

    rep = tensors.repetition_penalty[:, None]
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalized, logits)
    counts = output_counts.astype(logits.dtype)
    logits = logits - tensors.frequency_penalty[:, None] * counts
    return logits - tensors.presence_penalty[:, None] * (output_counts > 0).astype(logits.dtype)


def _top_k_top_p_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B, V] bool: the tokens top-k then top-p keep, from one stable descending sort per row."""
    vocab_size = scaled.shape[1]
    token_ids = jnp.broadcast_to(jnp.arange(vocab_size, dtype=jnp.int32), scaled.shape)
    # Ascending sort of -scaled, stable: descending values, lower ids first among ties.
    neg_sorted, sorted_ids = jax.lax.sort((-scaled, token_ids), dimension=1, is_stable=True, num_keys=1)
    sorted_values = -neg_sorted  # [B, V]

    k = jnp.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)  # [B]
    # Top-p on the top-k renormalized distribution: the smallest prefix n with mass >= p * mass(top k).
    probs = jax.nn.softmax(sorted_values, axis=1)
    cumulative = jnp.cumsum(probs, axis=1)  # [B, V]
    mass_k = jnp.take_along_axis(cumulative, (k - 1)[:, None], axis=1)  # [B, 1]
    position = jnp.arange(vocab_size)[None, :]
    short = (cumulative < top_p[:, None] * mass_k) & (position < k[:, None])
    n_top_p = jnp.minimum(jnp.sum(short, axis=1, dtype=jnp.int32) + 1, k)
    num_kept = jnp.where(top_p >= 1.0, k, n_top_p)  # [B], >= 1

    # The kept prefix, in vocab order: ahead of the last kept token in (value desc, id asc) order.
    last = (num_kept - 1)[:, None]
    last_value = jnp.take_along_axis(sorted_values, last, axis=1)  # [B, 1]
    last_id = jnp.take_along_axis(sorted_ids, last, axis=1)  # [B, 1]
    return (scaled > last_value) | ((scaled == last_value) & (token_ids <= last_id))


def _gumbel_noise(seed: jax.Array, step: jax.Array, vocab_size: int) -> jax.Array:
    """[B, V] noise; row b depends only on (seed[b], step[b]), never on B or b."""

    def row(seed, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)

    return jax.vmap(row)(seed, step)


def _top_k_in_pieces(x: jax.Array, k: int, piece: int = 16) -> tuple[jax.Array, jax.Array]:
    """Exact ``lax.top_k(x, k)`` (ties: lower id first) as top-k's of at most ``piece`` each.

    XLA's GPU top-k has a fast kernel only up to k = 16 and sorts the whole row above it
    (H200, [256, 128256] f32: 0.85 ms for k = 16, 2.5 ms for k = 20), so k = 20 runs as
    16 + 4, each later piece after the earlier winners are masked to -inf.
    """
    num_rows = x.shape[0]
    values, ids = [jnp.zeros((num_rows, 0), x.dtype)], [jnp.zeros((num_rows, 0), jnp.int32)]
    rows = jnp.arange(num_rows)[:, None]
    for start in range(0, k, piece):
        piece_values, piece_ids = jax.lax.top_k(x, min(piece, k - start))
        values.append(piece_values)
        ids.append(piece_ids.astype(jnp.int32))
        if start + piece < k:
            x = x.at[rows, piece_ids].set(-jnp.inf)
    return jnp.concatenate(values, axis=1), jnp.concatenate(ids, axis=1)


def argmax_rows(x: jax.Array) -> jax.Array:
    """[B] int32 ``jnp.argmax(x, axis=1)`` of x [B, V]: the first index of each row's maximum
    (of its first NaN when it has one).

    On XLA:CPU as two plain reductions (the max, then the least index holding it): XLA:CPU
    runs argmax as one variadic (value, index) reduce that it does not vectorise (0.16 ms
    against 0.07 over a 49k vocabulary row on the 2-core machine). Other backends keep
    ``jnp.argmax``.
    """
    if jax.default_backend() != "cpu":
        return jnp.argmax(x, axis=1).astype(jnp.int32)
    vocab_size = x.shape[1]
    is_nan = jnp.isnan(x)
    best = jnp.max(jnp.where(is_nan, jnp.inf, x), axis=1, keepdims=True)  # [B, 1]; inf: a NaN wins
    hit = jnp.where(jnp.any(is_nan, axis=1, keepdims=True), is_nan, x == best)
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.min(jnp.where(hit, ids, vocab_size), axis=1).astype(jnp.int32)


def sample(logits: jax.Array, tensors: SamplingTensors, flags: SamplingFlags,
           token_bitmask: jax.Array | None = None) -> SamplerOutput:
    """Sample one token per row of ``logits`` [B, V]; see the module docstring for the order.

    ``token_bitmask``: [B, ceil(V/32)] int32, the ids each row may sample (structured output;
    all ones for an unconstrained row), or None.
    """
    raw = logits.astype(jnp.float32)  # [B, V]
    vocab_size = raw.shape[1]

    with jax.named_scope("logits_processing"):
        processed = raw
        if flags.any_penalties:
            processed = apply_penalties(processed, tensors)
        if flags.any_logit_bias:
            processed = apply_logit_bias(processed, tensors.logit_bias_ids, tensors.logit_bias_values)
        if flags.any_banned:
            processed = jnp.where(_token_mask(tensors.banned_ids, vocab_size), -jnp.inf, processed)
        if flags.any_bad_words:
            processed = jnp.where(bad_word_bans(tensors.bad_word_ids, tensors.bad_word_tail, vocab_size),
                                  -jnp.inf, processed)
        if token_bitmask is not None:
            processed = apply_token_bitmask(processed, token_bitmask)

    token_ids = argmax_rows(processed)  # greedy rows keep this
    if flags.any_random:
        token_ids = _sample_random_rows(processed, tensors, flags, token_ids)

    top_values, top_ids = _top_k_in_pieces(raw, flags.num_top_logprobs)
    if flags.any_logprobs or flags.num_top_logprobs:
        log_normalizer = jax.nn.logsumexp(raw, axis=1)  # [B]
        logprobs = jnp.take_along_axis(raw, token_ids[:, None], axis=1)[:, 0] - log_normalizer
        top_values = top_values - log_normalizer[:, None]
    else:
        logprobs = jnp.full(token_ids.shape, jnp.nan, jnp.float32)  # not computed: no row reports it
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=logprobs,
        top_logprob_ids=top_ids.astype(jnp.int32),
        top_logprob_values=top_values,
    )


def _sample_random_rows(processed: jax.Array, tensors: SamplingTensors, flags: SamplingFlags,
                        token_ids: jax.Array) -> jax.Array:
    """``token_ids`` [B] with every random row (temperature >= 1e-5) replaced by its draw.

    On XLA:CPU the stage runs under a ``lax.cond`` on whether any row is random: an all-greedy
    step (the "basic" sampler path serves greedy and temperature rows alike) then skips the
    Gumbel noise over the whole vocabulary, a few milliseconds of a batch-1 step on 2 cores. A
    conditional on a CPU reads its predicate in place; on a GPU it would copy it to the host and
    wait (docs/ARCHITECTURE.md, sampling), so other backends always run the stage.
    """

    def draw(token_ids):
        with jax.named_scope("random_sampling"):
            is_random = tensors.temperature >= GREEDY_TEMPERATURE  # [B]
            temperature = jnp.where(is_random, tensors.temperature, 1.0)
            scaled = processed / temperature[:, None]  # [B, V]
            if flags.any_truncation:
                keep = _top_k_top_p_mask(scaled, tensors.top_k, tensors.top_p)
                # p_i >= min_p * p_max, in logits; min_p <= 0 gives -inf and keeps every token.
                log_min_p = jnp.where(tensors.min_p > 0, jnp.log(jnp.maximum(tensors.min_p, 1e-30)), -jnp.inf)
                keep &= scaled >= (jnp.max(scaled, axis=1) + log_min_p)[:, None]
                scaled = jnp.where(keep, scaled, -jnp.inf)
            perturbed = scaled + _gumbel_noise(tensors.seed, tensors.step, processed.shape[1])
            sampled = argmax_rows(perturbed)
            return jnp.where(is_random, sampled, token_ids)

    if jax.default_backend() == "cpu":
        return jax.lax.cond(jnp.any(tensors.temperature >= GREEDY_TEMPERATURE), draw, lambda ids: ids, token_ids)
    return draw(token_ids)

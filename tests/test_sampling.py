"""On-device sampler: each stage against numpy, distributions against softmax, seeds against batching."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.sampling import (
    SamplingFlags,
    SamplingTensors,
    _top_k_in_pieces,
    _top_k_top_p_mask,
    apply_penalties,
    sample,
)

ALL_ON = SamplingFlags(any_penalties=True, any_banned=True, any_random=True, any_truncation=True)


@functools.partial(jax.jit, static_argnames="flags")
def _sample(logits, tensors, flags):
    return sample(logits, tensors, flags)


def _tensors(num_seqs, history_len=0, num_banned=0, **rows):
    """Neutral numpy tensors with the given fields overridden (scalars broadcast to every row)."""
    t = SamplingTensors.neutral(num_seqs, history_len, num_banned)
    fields = {}
    for name, value in rows.items():
        old = getattr(t, name)
        fields[name] = np.broadcast_to(np.asarray(value, old.dtype), old.shape).copy()
    return dataclasses.replace(t, **fields)


def _fewest_flags(t, num_top_logprobs=0):
    """The fewest stages that sample the rows of ``t`` exactly: each flag off skips a stage that is
    the identity for every row, so the tokens must equal those of every stage on."""
    is_random = t.temperature >= 1e-5
    truncates = (t.top_k > 0) | (t.top_p < 1.0) | (t.min_p > 0.0)
    penalizes = (t.repetition_penalty != 1.0) | (t.presence_penalty != 0.0) | (t.frequency_penalty != 0.0)
    return SamplingFlags(
        any_penalties=bool(penalizes.any()), any_banned=bool((t.banned_ids >= 0).any()),
        any_random=bool(is_random.any()), any_truncation=bool((is_random & truncates).any()),
        num_top_logprobs=num_top_logprobs,
    )


def _frequencies(logits_row, num_samples, **params):
    """Sample one row ``num_samples`` times with seeds 0.. and count each token."""
    logits = np.tile(np.asarray(logits_row, np.float32), (num_samples, 1))
    t = _tensors(num_samples, seed=np.arange(num_samples), **params)
    out = _sample(logits, t, _fewest_flags(t))
    return np.bincount(np.asarray(out.token_ids), minlength=logits.shape[1])


def _chi_square(counts, probs):
    expected = probs * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    return float(np.sum((counts[support] - expected[support]) ** 2 / expected[support]))


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_greedy_is_argmax_even_beside_random_rows():
    logits = np.random.default_rng(0).normal(size=(8, 50)).astype(np.float32)
    out = _sample(logits, _tensors(8), SamplingFlags())
    np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=1))

    mixed = _tensors(8, temperature=[0, 1.5] * 4, top_k=[0, 5] * 4, top_p=[1.0, 0.5] * 4, seed=np.arange(8))
    out = _sample(logits, mixed, ALL_ON)
    np.testing.assert_array_equal(np.asarray(out.token_ids)[::2], logits[::2].argmax(axis=1))


def test_temperature_sampling_matches_softmax():
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.0], np.float32)
    counts = _frequencies(logits, 6000, temperature=0.7)
    # Chi-square with 5 degrees of freedom: 20.5 is the 0.1% critical value.
    assert _chi_square(counts, _softmax(logits / 0.7)) < 20.5


def test_top_k_keeps_k_tokens_with_renormalized_probabilities():
    logits = np.array([0.5, 2.0, -1.0, 1.5, 1.0, 0.0, -0.5, 0.8], np.float32)
    counts = _frequencies(logits, 6000, temperature=1.0, top_k=3)
    expected = np.where(np.isin(np.arange(8), [1, 3, 4]), _softmax(logits), 0)
    assert _chi_square(counts, expected / expected.sum()) < 13.8  # 2 degrees of freedom, 0.1%


def test_top_p_keeps_smallest_prefix_reaching_p_after_top_k():
    probs = np.array([0.1, 0.4, 0.2, 0.3], np.float32)
    logits = np.log(probs)
    # Top-p alone: 0.4 + 0.3 = 0.7 < 0.75, so a third token is needed.
    counts = _frequencies(logits, 3000, temperature=1.0, top_p=0.75)
    assert set(np.flatnonzero(counts)) == {1, 3, 2}
    expected = np.array([0, 0.4, 0.2, 0.3]) / 0.9
    assert _chi_square(counts, expected) < 13.8
    # After top-3 the mass renormalizes to 0.9: (0.4 + 0.3) / 0.9 = 0.78 >= 0.75, two tokens suffice.
    counts = _frequencies(logits, 3000, temperature=1.0, top_k=3, top_p=0.75)
    assert set(np.flatnonzero(counts)) == {1, 3}


def _reference_top_k_top_p(scaled, k, p):
    """Numpy: keep the first n of the order (value desc, id asc), n from top-k then top-p."""
    vocab = scaled.shape[0]
    order = np.lexsort((np.arange(vocab), -scaled))
    k = vocab if k <= 0 or k > vocab else k
    n = k
    if p < 1.0:
        probs = _softmax(scaled[order][:k].astype(np.float64))
        n = int(np.searchsorted(np.cumsum(probs), p - 1e-12)) + 1
    keep = np.zeros(vocab, bool)
    keep[order[: min(n, k)]] = True
    return keep


def test_top_k_top_p_mask_breaks_ties_by_lower_id():
    rng = np.random.default_rng(1)
    scaled = rng.integers(-3, 3, size=(64, 12)).astype(np.float32)  # many ties
    top_k = rng.integers(-1, 14, size=64).astype(np.int32)
    top_p = rng.choice([0.1, 0.33, 0.6, 0.9, 1.0], size=64).astype(np.float32)
    keep = np.asarray(jax.jit(_top_k_top_p_mask)(scaled, top_k, top_p))
    for b in range(64):
        want = _reference_top_k_top_p(scaled[b], top_k[b], top_p[b])
        np.testing.assert_array_equal(keep[b], want, err_msg=f"row {b}")
    exact = (top_k > 0) & (top_p >= 1.0)
    np.testing.assert_array_equal(keep[exact].sum(axis=1), np.minimum(top_k[exact], 12))


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = np.array([0.5, 0.2, 0.14, 0.1, 0.06], np.float32)
    counts = _frequencies(np.log(probs), 3000, temperature=1.0, min_p=0.25)
    assert set(np.flatnonzero(counts)) == {0, 1, 2}  # 0.1 < 0.25 * 0.5 <= 0.14


def _reference_penalties(logits, history, is_output, rep, presence, frequency):
    out = logits.astype(np.float64).copy()
    for b in range(logits.shape[0]):
        ids = history[b][history[b] >= 0]
        for token in set(ids.tolist()):
            out[b, token] = out[b, token] / rep[b] if out[b, token] > 0 else out[b, token] * rep[b]
        output_ids = history[b][(history[b] >= 0) & is_output[b]]
        for token, count in zip(*np.unique(output_ids, return_counts=True)):
            out[b, token] -= frequency[b] * count + presence[b]
    return out


def test_penalties_match_numpy():
    rng = np.random.default_rng(2)
    num_seqs, vocab, length = 6, 20, 15
    logits = rng.normal(size=(num_seqs, vocab)).astype(np.float32) * 3
    history = rng.integers(0, vocab, size=(num_seqs, length)).astype(np.int32)
    history[:, 11:] = -1  # padding
    history[0, :] = -1
    is_output = np.zeros((num_seqs, length), bool)
    is_output[:, 6:11] = True  # ids 0..5 are the prompt, 6..10 the output
    rep = np.array([1.0, 1.3, 0.8, 2.0, 1.0, 1.5], np.float32)
    presence = np.array([0.0, 0.5, 0.0, -0.4, 1.0, 0.3], np.float32)
    frequency = np.array([0.0, 0.2, 0.7, 0.0, 0.0, -0.1], np.float32)
    t = _tensors(
        num_seqs, length, history_ids=history, history_is_output=is_output,
        repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency,
    )
    got = np.asarray(jax.jit(apply_penalties)(logits, t))
    want = _reference_penalties(logits, history, is_output, rep, presence, frequency)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[0], logits[0])

    # Through the sampler: greedy picks the argmax of the penalized logits.
    out = _sample(logits, t, SamplingFlags(any_penalties=True))
    np.testing.assert_array_equal(out.token_ids, want.argmax(axis=1))


def test_banned_ids_are_never_chosen():
    logits = np.tile(np.array([5.0, 4.0, 3.0, 0.0, -1.0], np.float32), (200, 1))
    banned = np.array([0, 2, -1], np.int32)
    t = _tensors(200, num_banned=3, banned_ids=banned, temperature=[0.0] + [2.0] * 199, seed=np.arange(200))
    tokens = np.asarray(_sample(logits, t, _fewest_flags(t)).token_ids)
    assert tokens[0] == 1  # greedy falls back to the best allowed token
    assert not np.isin(tokens, [0, 2]).any()
    assert set(tokens[1:]) == {1, 3, 4}


def _sequence(row, position, batch_size, flags, num_steps=25, vocab=300):
    """Tokens of sampling ``row`` (field -> scalar) at ``position`` among random other rows."""
    rng = np.random.default_rng(3)
    others = np.random.default_rng(100 + batch_size + position)
    tokens = []
    for step in range(num_steps):
        logits = others.normal(size=(batch_size, vocab)).astype(np.float32) * 2
        logits[position] = rng.normal(size=vocab).astype(np.float32) * 2
        t = _tensors(
            batch_size, history_len=8, num_banned=2,
            temperature=others.uniform(0, 1.5, batch_size), top_k=others.integers(0, 50, batch_size),
            top_p=others.uniform(0.5, 1.0, batch_size), seed=others.integers(0, 2**32, batch_size),
            step=others.integers(0, 100, batch_size), repetition_penalty=others.uniform(1.0, 1.5, batch_size),
        )
        for name, value in row.items():
            getattr(t, name)[position] = value
        t.step[position] = step
        t.history_ids[position] = -1
        t.history_ids[position, : min(step, 8)] = tokens[-8:]
        t.history_is_output[position, : min(step, 8)] = True
        tokens.append(int(np.asarray(_sample(logits, t, flags or _fewest_flags(t)).token_ids)[position]))
    return tokens


def test_seed_reproducible_whatever_the_batch():
    row = dict(temperature=0.9, top_k=40, top_p=0.9, seed=3_000_000_000, repetition_penalty=1.2, presence_penalty=0.3)
    alone = _sequence(row, position=0, batch_size=1, flags=None)
    assert _sequence(row, position=3, batch_size=5, flags=ALL_ON) == alone
    assert _sequence(row, position=6, batch_size=8, flags=None) == alone
    assert len(set(alone)) > 5  # actually random
    assert _sequence(dict(row, seed=7), position=0, batch_size=1, flags=None) != alone


def test_flags_only_skip_stages_no_row_needs():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(16, 40)).astype(np.float32) * 2
    t = _tensors(16, temperature=np.r_[np.zeros(8), rng.uniform(0.5, 2, 8)], seed=np.arange(16))
    minimal = _sample(logits, t, SamplingFlags(any_random=True))
    basic = _sample(logits, t, SamplingFlags(any_random=True, any_logprobs=False))  # the runner's "basic" path
    full = _sample(logits, t, dataclasses.replace(ALL_ON, num_top_logprobs=3))
    np.testing.assert_array_equal(minimal.token_ids, full.token_ids)
    np.testing.assert_array_equal(minimal.logprobs, full.logprobs)
    np.testing.assert_array_equal(basic.token_ids, full.token_ids)
    assert np.isnan(np.asarray(basic.logprobs)).all()  # not computed, and visibly so


def test_a_sampler_without_logprobs_never_normalises_the_logits():
    # The "basic" path's program has no exp over the logits: logsumexp is its only use there.
    logits = jnp.zeros((4, 32), jnp.float32)
    flags = SamplingFlags(any_random=False, any_logprobs=False)

    def primitives(flags):
        jaxpr = jax.make_jaxpr(lambda x, t: sample(x, t, flags))(logits, _tensors(4))
        return {e.primitive.name for e in jaxpr.eqns}

    assert "exp" not in primitives(flags)
    assert "exp" in primitives(dataclasses.replace(flags, any_logprobs=True))


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(10, 64)).astype(np.float32) * 3
    t = _tensors(10, history_len=4, temperature=0.8, top_k=10, repetition_penalty=1.5, seed=np.arange(10))
    t.history_ids[:] = logits.argsort(axis=1)[:, -4:]
    out = _sample(logits, t, _fewest_flags(t, num_top_logprobs=5))
    raw = _log_softmax(logits)
    tokens = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.logprobs, raw[np.arange(10), tokens], rtol=1e-5, atol=1e-5)
    want_ids = np.argsort(-raw, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(out.top_logprob_ids, want_ids)
    np.testing.assert_allclose(out.top_logprob_values, np.take_along_axis(raw, want_ids, axis=1), rtol=1e-5, atol=1e-5)
    assert np.all(np.diff(np.asarray(out.top_logprob_values), axis=1) <= 0)
    assert out.top_logprob_ids.dtype == jnp.int32


@pytest.mark.parametrize("k", [1, 3, 7, 20])
def test_top_k_in_pieces_equals_stable_top_k(k):
    x = np.random.default_rng(7).integers(-4, 4, size=(5, 40)).astype(np.float32)  # many ties
    values, ids = _top_k_in_pieces(jnp.asarray(x), k, piece=3)
    want_ids = np.argsort(-x, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(values, np.take_along_axis(x, want_ids, axis=1))


def test_compiles_once_per_flags():
    num_traces = []

    @functools.partial(jax.jit, static_argnames="flags")
    def traced(logits, tensors, flags):
        num_traces.append(flags)
        return sample(logits, tensors, flags)

    rng = np.random.default_rng(6)
    for flags in (SamplingFlags(), ALL_ON):
        for i in range(3):
            t = _tensors(4, history_len=3, num_banned=1, temperature=rng.uniform(0, 1, 4), top_k=i, seed=i, step=i)
            traced(rng.normal(size=(4, 16)).astype(np.float32), t, flags)
    assert num_traces == [SamplingFlags(), ALL_ON]


@pytest.mark.parametrize("num_top", [0, 20])
def test_output_shapes(num_top):
    out = _sample(np.zeros((3, 32), np.float32), _tensors(3), SamplingFlags(num_top_logprobs=num_top))
    assert out.token_ids.shape == (3,) and out.logprobs.shape == (3,)
    assert out.top_logprob_ids.shape == (3, num_top) and out.top_logprob_values.shape == (3, num_top)


def test_argmax_rows_is_jnp_argmax_with_ties_infinities_and_nans():
    from jaxinfer.sampling import argmax_rows

    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (6, 97)).astype(np.float32)  # many ties: the first index must win
    x[1, :] = -np.inf
    x[2, 40] = np.inf
    x[3, 7], x[3, 60] = np.nan, np.nan  # the first NaN wins, as in numpy and jnp.argmax
    x[4, 90:] = np.inf
    got = np.asarray(jax.jit(argmax_rows)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=1))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=1)))


def test_all_greedy_steps_skip_the_random_stage_on_cpu():
    # The "basic" path compiles the random stage (any_random); on a CPU it sits under a cond, so
    # an all-greedy step takes the argmax alone, and a step with a random row still samples it.
    flags = SamplingFlags(any_random=True)
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32))
    tensors = SamplingTensors.neutral(2)
    jaxpr = str(jax.make_jaxpr(lambda l, t: sample(l, t, flags))(logits, tensors))
    assert "cond" in jaxpr
    greedy = sample(logits, tensors, flags)
    np.testing.assert_array_equal(np.asarray(greedy.token_ids), np.argmax(np.asarray(logits), axis=1))
    mixed = dataclasses.replace(tensors, temperature=np.array([0.0, 1.0], np.float32))
    always = np.asarray(sample(logits, mixed, flags).token_ids)
    assert always[0] == np.argmax(np.asarray(logits[0]))
    draws = {int(sample(logits, dataclasses.replace(mixed, seed=np.array([0, s], np.uint32)), flags).token_ids[1])
             for s in range(8)}
    assert len(draws) > 1  # the random row was sampled, not argmaxed


def test_the_sampler_has_no_conditional_off_cpu(monkeypatch):
    # On a GPU a conditional copies its predicate to the host and waits: the CPU-only skip of the
    # random stage must not reach other backends' programs.
    flags = SamplingFlags(any_random=True, any_truncation=True)
    logits = jnp.zeros((2, 64), jnp.float32)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    jaxpr = str(jax.make_jaxpr(lambda l, t: sample(l, t, flags))(logits, SamplingTensors.neutral(2)))
    assert "cond" not in jaxpr and "argmax" in jaxpr

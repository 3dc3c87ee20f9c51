"""RoPE: the step-wide tables and the concatenate-free rotation equal the split-halves form.

Equal up to the last bit of float32: the two forms compute the same products and sums, but XLA:CPU
contracts a multiply and an add into one FMA wherever it fuses them, and where that happens depends
on the program (the split form alone, run eagerly and jitted, differs in a quarter of its elements).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.model import apply_rope, rope_inverse_frequencies, rope_tables


def rope_split_halves(x, positions, inv_freq):
    """The textbook rotate-half form (Hugging Face's ``rotate_half``), in float32 as the model computes it."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scaled", [False, True])
def test_rope_equals_split_halves_form(dtype, scaled):
    config = ModelConfig(
        model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_q_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192) if scaled else None,
    )
    inv_freq = rope_inverse_frequencies(config)
    # Positions from 0 to past the original context, where the scaled frequencies differ.
    positions = jnp.array([0, 1, 7, 383, 8191, 8192, 40000, 131071], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (8, 4, 16), jnp.float32).astype(dtype) * 3
    tables = jax.jit(rope_tables)(positions, inv_freq)
    got = jax.jit(apply_rope)(x, tables)
    want = jax.jit(rope_split_halves)(x, positions, inv_freq)
    assert got.dtype == x.dtype and got.shape == x.shape
    got32, want32 = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    # An FMA keeps the product unrounded: a difference of an ulp of the products (|x| <= max|x|,
    # the result may be smaller by cancellation). In bfloat16 the float32 results are rounded to 8
    # bits, so such a difference may carry over as one bfloat16 ulp of the result.
    bound = 2.0**-22 * float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    if dtype == jnp.bfloat16:
        bound = bound + 2.0**-7 * np.abs(want32)
    assert np.all(np.abs(got32 - want32) <= bound), np.max(np.abs(got32 - want32) - bound)
    assert np.mean(got32 == want32) > 0.5  # most elements are bit-identical
    # The rotation does something: position 0 is the identity, the others are not.
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(x[0]))
    assert not np.array_equal(np.asarray(got[1:]), np.asarray(x[1:]))

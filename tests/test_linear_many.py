"""linear_many: projections that share one input quantize it once for FP8 W8A8, and compute what
one linear per weight computes."""

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.linear import FP8_W8A8_MIN_TOKENS, linear, linear_many
from jaxinfer.model import mlp_block, rms_norm
from jaxinfer.params import init_random

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                     num_q_heads=4, num_kv_heads=2, head_dim=8)


@functools.cache
def layer_weights(quantization):
    config = ModelConfig(**{**CONFIG.__dict__, "quantization": quantization})
    return config, init_random(config, jax.random.key(0), jnp.float32).layers[0]


def num_activation_quantizations(fn, *args) -> int:
    """Per-token absmax reductions in the traced program: one per activation quantization."""
    return sum(e.primitive.name == "reduce_max" for e in jax.make_jaxpr(fn)(*args).eqns)


def qkv_separately(layer, h):
    return [linear("te,ehd->thd", h, w) for w in (layer.q, layer.k, layer.v)]


def qkv_together(layer, h):
    return linear_many("te,ehd->thd", h, (layer.q, layer.k, layer.v))


@pytest.mark.parametrize("tokens", [FP8_W8A8_MIN_TOKENS, 2 * FP8_W8A8_MIN_TOKENS])
def test_a_w8a8_layer_quantizes_each_shared_input_once_with_unchanged_outputs(tokens):
    config, layer = layer_weights("fp8")
    h = jax.random.normal(jax.random.key(1), (tokens, config.hidden_size), jnp.float32)
    assert num_activation_quantizations(qkv_separately, layer, h) == 3
    assert num_activation_quantizations(qkv_together, layer, h) == 1
    for separate, together in zip(qkv_separately(layer, h), qkv_together(layer, h)):
        assert jnp.array_equal(separate, together)
    # The MLP: gate and up share one quantized input, down quantizes its own.
    assert num_activation_quantizations(lambda layer, x: mlp_block(layer, x, config), layer, h) == 2


def test_the_mlp_block_computes_what_one_linear_per_weight_does():
    config, layer = layer_weights("fp8")
    x = jax.random.normal(jax.random.key(2), (FP8_W8A8_MIN_TOKENS, config.hidden_size), jnp.float32)
    h = rms_norm(x, layer.mlp_norm, config.rms_norm_eps)
    gate, up = (linear("te,ef->tf", h, w) for w in (layer.gate, layer.up))
    expected = linear("tf,fe->te", jax.nn.silu(gate) * up, layer.down)
    assert jnp.array_equal(mlp_block(layer, x, config), expected)


@pytest.mark.parametrize("quantization,tokens", [("fp8", FP8_W8A8_MIN_TOKENS - 1), ("int8", 256), (None, 256)])
def test_no_quantization_of_activations_off_the_w8a8_path(quantization, tokens):
    config, layer = layer_weights(quantization)
    h = jax.random.normal(jax.random.key(3), (tokens, config.hidden_size), jnp.float32)
    assert num_activation_quantizations(qkv_together, layer, h) == 0
    for separate, together in zip(qkv_separately(layer, h), qkv_together(layer, h)):
        assert jnp.array_equal(separate, together)


def test_dense_and_fp8_weights_mix():
    _, dense = layer_weights(None)
    _, fp8 = layer_weights("fp8")
    h = jax.random.normal(jax.random.key(4), (FP8_W8A8_MIN_TOKENS, CONFIG.hidden_size), jnp.float32)
    weights = (dense.q, fp8.k, fp8.v)
    together = linear_many("te,ehd->thd", h, weights)
    for w, got in zip(weights, together):
        assert jnp.array_equal(linear("te,ehd->thd", h, w), got)

"""Static per-tensor FP8 activation scales: the W8A8 path with a weight's input_scale (no row-max,
e4m3 operands, one output multiply by s * w_scale), sharing among projections of one input, and
the declaration of the leaf."""

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.activation_scales import INPUT_GROUPS, share_input_scales
from jaxinfer.config import ModelConfig
from jaxinfer.linear import FP8_W8A8_MIN_TOKENS, linear, linear_many
from jaxinfer.model import mlp_block
from jaxinfer.params import init_random, param_specs
from jaxinfer.quantization import QuantizedWeight

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_q_heads=4, num_kv_heads=2, head_dim=8, quantization="fp8")


@functools.cache
def layer(activation_scales="dynamic", index=0):
    config = dataclasses.replace(CONFIG, activation_scales=activation_scales)
    return init_random(config, jax.random.key(0), jnp.float32).layers[index]


def with_scale(w, s):
    return dataclasses.replace(w, input_scale=jnp.float32(s))


def equations(jaxpr):
    """Every equation of ``jaxpr``, those of nested jaxprs (``jnp.clip`` is a ``jit``) included."""
    for e in jaxpr.eqns:
        yield e
        for param in e.params.values():
            inner = getattr(param, "jaxpr", param)
            if isinstance(inner, jax.extend.core.Jaxpr):
                yield from equations(inner)


def primitives(fn, *args):
    return [e.primitive.name for e in equations(jax.make_jaxpr(fn)(*args).jaxpr)]


def dot_operand_dtypes(fn, *args):
    return [tuple(str(v.aval.dtype) for v in e.invars) for e in equations(jax.make_jaxpr(fn)(*args).jaxpr)
            if e.primitive.name == "dot_general"]


def emulate_static_w8a8(x, w: QuantizedWeight):
    """numpy: x [M, E] times the gate-like payload [F, E] with a static input scale."""
    s = np.float32(w.input_scale)
    xq = np.clip(np.asarray(x, np.float32) / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    payload = np.asarray(w.payload).astype(np.float32)
    return (xq @ payload.T) * (s * np.asarray(w.scale))[None, :]


def test_the_static_path_quantizes_without_a_row_max_and_feeds_e4m3_to_the_dot():
    w = with_scale(layer().gate, 0.01)
    x = jax.random.normal(jax.random.key(1), (FP8_W8A8_MIN_TOKENS, CONFIG.hidden_size), jnp.float32)
    static = primitives(lambda x, w: linear("te,ef->tf", x, w), x, w)
    dynamic = primitives(lambda x, w: linear("te,ef->tf", x, w), x, layer().gate)
    assert "reduce_max" not in static and "reduce_max" in dynamic
    assert "clamp" in static or {"max", "min"} <= set(static)  # saturated, not overflowed to NaN
    assert dot_operand_dtypes(lambda x, w: linear("te,ef->tf", x, w), x, w) == [("float8_e4m3fn",) * 2]


@pytest.mark.parametrize("s", [0.004, 0.02])  # 0.004 saturates the largest inputs (|x| > 1.8), 0.02 none
def test_the_static_path_matches_a_numpy_emulation(s):
    w = with_scale(layer().gate, s)
    x = 2 * jax.random.normal(jax.random.key(2), (FP8_W8A8_MIN_TOKENS + 3, CONFIG.hidden_size), jnp.float32)
    got = np.asarray(linear("te,ef->tf", x, w))
    np.testing.assert_allclose(got, emulate_static_w8a8(x, w), rtol=1e-5, atol=1e-6)


def test_few_tokens_run_weight_only_and_ignore_the_static_scale():
    x = jax.random.normal(jax.random.key(3), (FP8_W8A8_MIN_TOKENS - 1, CONFIG.hidden_size), jnp.float32)
    dynamic = layer().gate
    static = with_scale(dynamic, 1e-4)  # a scale that would clip nearly everything on the W8A8 path
    assert dot_operand_dtypes(lambda x, w: linear("te,ef->tf", x, w), x, static) == [("float32",) * 2]
    assert jnp.array_equal(linear("te,ef->tf", x, static), linear("te,ef->tf", x, dynamic))


def test_projections_of_one_input_are_quantized_once_with_the_largest_scale():
    base = layer()
    q, k, v = with_scale(base.q, 0.01), with_scale(base.k, 0.03), with_scale(base.v, 0.02)
    h = jax.random.normal(jax.random.key(4), (FP8_W8A8_MIN_TOKENS, CONFIG.hidden_size), jnp.float32)
    together = linear_many("te,ehd->thd", h, (q, k, v))
    for w, got in zip((q, k, v), together):
        assert jnp.array_equal(got, linear("te,ehd->thd", h, with_scale(w, 0.03)))
    ops = primitives(lambda h, ws: linear_many("te,ehd->thd", h, ws), h, (q, k, v))
    assert ops.count("div") == 1 and "reduce_max" not in ops  # x / s once for the three, no row-max
    assert primitives(lambda h, ws: [linear("te,ehd->thd", h, w) for w in ws], h, (q, k, v)).count("div") == 3


def test_static_and_dynamic_weights_of_one_input_do_not_mix():
    base = layer()
    h = jnp.ones((FP8_W8A8_MIN_TOKENS, CONFIG.hidden_size), jnp.float32)
    with pytest.raises(ValueError, match="mix static and dynamic"):
        linear_many("te,ef->tf", h, (with_scale(base.gate, 0.01), base.up))


def test_the_mlp_block_with_static_scales_has_no_row_max():
    base = layer()
    static = dataclasses.replace(base, gate=with_scale(base.gate, 0.05), up=with_scale(base.up, 0.05),
                                 down=with_scale(base.down, 0.02))
    x = jax.random.normal(jax.random.key(5), (FP8_W8A8_MIN_TOKENS, CONFIG.hidden_size), jnp.float32)
    assert "reduce_max" not in primitives(lambda layer, x: mlp_block(layer, x, CONFIG), static, x)
    dense = np.asarray(mlp_block(base, x, CONFIG))
    got = np.asarray(mlp_block(static, x, CONFIG))
    assert np.abs(got - dense).max() < 0.1 * np.abs(dense).max()


def test_a_static_model_declares_a_replicated_scalar_input_scale_per_projection():
    specs = param_specs(dataclasses.replace(CONFIG, activation_scales="static")).layers[0]
    for names in INPUT_GROUPS.values():
        for name in names:
            spec = getattr(specs, name).input_scale
            assert (spec.shape, spec.logical_axes, spec.dtype) == ((), (), "float32")
    assert param_specs(CONFIG).layers[0].q.input_scale is None
    weights = layer("static")
    assert float(weights.q.input_scale) == 1.0  # a placeholder until calibrated
    # A dynamic model's pytree is what it was before the field existed: two leaves per projection.
    assert len(jax.tree.leaves(layer().q)) == 2 and len(jax.tree.leaves(weights.q)) == 3


def test_share_input_scales_gives_each_group_its_largest():
    weights = init_random(dataclasses.replace(CONFIG, activation_scales="static"), jax.random.key(0), jnp.float32)
    first = weights.layers[0]
    first = dataclasses.replace(first, q=with_scale(first.q, 0.5), k=with_scale(first.k, 2.0),
                                up=with_scale(first.up, 3.0))
    shared = share_input_scales(dataclasses.replace(weights, layers=[first] + weights.layers[1:]))
    got = {name: float(getattr(shared.layers[0], name).input_scale) for names in INPUT_GROUPS.values()
           for name in names}
    assert got == {"q": 2.0, "k": 2.0, "v": 2.0, "o": 1.0, "gate": 3.0, "up": 3.0, "down": 1.0}

"""The weight layer: quantize/dequantize error bounds, every ``linear`` path against a dequantized
reference, the dtypes each token bucket puts into its dot, the declarations, and the errors.

The end-to-end checks (loading, checkpoints, generation, Orbax) are in ``test_quantized_checkpoint.py``.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import linear as linear_module
from jaxinfer.config import ModelConfig
from jaxinfer.engine_config import EngineConfig, EngineConfigError
from jaxinfer.linear import FP8_W8A8_MIN_TOKENS, linear, quantize_activations_fp8, split_subscripts
from jaxinfer.params import QUANTIZED_PROJECTIONS, init_random, is_spec, logical_axes, param_specs
from jaxinfer.quantization import (SEARCH_RATIOS, QuantizationError, QuantizedWeight, check_platform_supports, check_quantization,
                                   dequantize, fp8_support, quantize)

RNG = np.random.default_rng(0)
CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                     num_q_heads=4, num_kv_heads=2, head_dim=8)


def weights(shape, scale_rows=True):
    w = RNG.standard_normal(shape).astype(np.float32)
    if scale_rows:  # rows of very different magnitudes: a per-channel scale must follow each
        w *= np.logspace(-3, 1, shape[0], dtype=np.float32).reshape((-1,) + (1,) * (len(shape) - 1))
    return jnp.asarray(w)


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_round_trip_error_is_bounded_per_channel(quantization):
    w = weights((24, 3, 40))  # [out, in...]: the first axis is the channel
    q = quantize(w, quantization, num_out_axes=1, scale_method="absmax")
    assert q.payload.dtype == (jnp.float8_e4m3fn if quantization == "fp8" else jnp.int8)
    assert q.scale.shape == (24,) and q.scale.dtype == jnp.float32
    error = np.abs(np.asarray(dequantize(q)) - np.asarray(w))
    scale = np.asarray(q.scale)[:, None, None]
    if quantization == "int8":
        bound = scale / 2 * (1 + 1e-5)  # round to the nearest step of the row's scale
    else:
        # e4m3: 3 mantissa bits, relative error 2^-4 for normals; subnormals step by 2^-9 * scale.
        bound = np.maximum(np.abs(np.asarray(w)) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5)
    assert (error <= bound).all(), float((error / bound).max())
    # Each row's largest entry maps to the format's largest value, so no row wastes range.
    top = np.abs(np.asarray(q.payload.astype(jnp.float32))).reshape(24, -1).max(axis=1)
    assert np.allclose(top, 448.0 if quantization == "fp8" else 127.0)


def row_squared_error(q, w):
    return ((np.asarray(dequantize(q)) - np.asarray(w)) ** 2).reshape(w.shape[0], -1).sum(axis=1)


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_searched_scales_never_lose_to_absmax_and_win_in_total(quantization):
    w = weights((64, 96), scale_rows=False)
    absmax = quantize(w, quantization, 1, scale_method="absmax")
    searched = quantize(w, quantization, 1, scale_method="mse")
    e_absmax, e_searched = row_squared_error(absmax, w), row_squared_error(searched, w)
    assert (e_searched <= e_absmax * (1 + 1e-6)).all()
    if quantization == "fp8":
        # e4m3's error is relative: shifting a row's values between grid points pays (~12% on
        # SmolLM2's weights); int8's 127 steps leave clipping little to win on Gaussian rows.
        assert e_searched.sum() < 0.95 * e_absmax.sum(), (e_searched.sum(), e_absmax.sum())
    # Every chosen scale is one of the candidates: absmax's times a searched ratio.
    ratios = np.asarray(searched.scale) / np.asarray(absmax.scale)
    assert np.isclose(ratios[:, None], np.asarray(SEARCH_RATIOS[quantization])[None], rtol=1e-5).any(axis=1).all()


def test_an_unknown_scale_method_is_refused_by_name():
    with pytest.raises(QuantizationError, match="scale_method 'minmax'"):
        quantize(jnp.ones((2, 3)), "int8", 1, scale_method="minmax")


@pytest.mark.parametrize("scale_method", ["absmax", "mse"])
def test_a_zero_row_quantizes_to_zeros(scale_method):
    w = jnp.zeros((3, 5)).at[1].set(1.0)
    q = quantize(w, "int8", 1, scale_method=scale_method)
    assert np.isfinite(np.asarray(q.scale)).all()
    np.testing.assert_array_equal(np.asarray(dequantize(q)), np.asarray(w))


# The projections of the model, in the dense layout their einsums are written for.
PROJECTIONS = {
    "te,ehd->thd": ((32, 4, 8), 1),  # q/k/v: x [T, E]
    "thd,hde->te": ((4, 8, 32), 2),  # o: x [T, Hq, D]
    "te,ef->tf": ((32, 48), 1),  # gate/up
    "tf,fe->te": ((48, 32), 1),  # down
}


def quantized_from_dense(dense, num_in, quantization):
    order = tuple(range(num_in, dense.ndim)) + tuple(range(num_in))
    return quantize(jnp.transpose(dense, order), quantization, dense.ndim - num_in)


def dense_from_quantized(q, num_in):
    deq = dequantize(q)  # [out..., in...]
    n_out = q.num_out_axes
    return jnp.transpose(deq, tuple(range(n_out, deq.ndim)) + tuple(range(n_out)))


def x_for(subscripts, tokens):
    lhs = subscripts.split(",")[0]
    shape = {"t": tokens, "e": 32, "h": 4, "d": 8, "f": 48}
    return jnp.asarray(RNG.standard_normal([shape[c] for c in lhs]).astype(np.float32))


@pytest.mark.parametrize("subscripts", list(PROJECTIONS))
@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_weight_only_path_equals_the_dequantized_einsum(subscripts, quantization):
    shape, num_in = PROJECTIONS[subscripts]
    q = quantized_from_dense(weights(shape, scale_rows=False), num_in, quantization)
    x = x_for(subscripts, 5)
    got = linear(subscripts, x, q)
    want = jnp.einsum(subscripts, x, dense_from_quantized(q, num_in), precision="highest")
    assert got.shape == want.shape and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("subscripts", list(PROJECTIONS))
def test_w8a8_path_equals_the_einsum_of_both_dequantized_operands(subscripts):
    shape, num_in = PROJECTIONS[subscripts]
    dense = weights(shape, scale_rows=False)
    q = quantized_from_dense(dense, num_in, "fp8")
    tokens = FP8_W8A8_MIN_TOKENS + 3  # not a multiple of 16: the padded rows must not leak
    x = x_for(subscripts, tokens)
    got = linear(subscripts, x, q)
    n_in = split_subscripts(subscripts)[0]
    x2 = x.reshape(tokens, -1)
    xq, x_scale = quantize_activations_fp8(x2)
    x_deq = (xq.astype(jnp.float32) * x_scale[:, None]).reshape(x.shape)
    want = jnp.einsum(subscripts, x_deq, dense_from_quantized(q, num_in), precision="highest")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    # And near the unquantized product: two e4m3 roundings, 2^-4 relative each at worst.
    exact = jnp.einsum(subscripts, x, dense, precision="highest")
    rel = np.linalg.norm(np.asarray(got - exact)) / np.linalg.norm(np.asarray(exact))
    assert rel < 0.06 and n_in == num_in


def the_dot(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1
    return dots[0]


def dot_operand_dtypes(fn, *args):
    dot = the_dot(fn, *args)
    return [str(v.aval.dtype) for v in dot.invars], dot.params["dimension_numbers"]


@pytest.mark.parametrize("tokens,quantization,want", [
    (1, "fp8", ["bfloat16", "bfloat16"]),  # decode: weight-only, the payload converted to bf16
    (FP8_W8A8_MIN_TOKENS - 1, "fp8", ["bfloat16", "bfloat16"]),
    (FP8_W8A8_MIN_TOKENS, "fp8", ["float8_e4m3fn", "float8_e4m3fn"]),  # prefill: W8A8
    (512, "fp8", ["float8_e4m3fn", "float8_e4m3fn"]),
    (512, "int8", ["bfloat16", "bfloat16"]),  # int8 is weight-only at every size
])
def test_each_token_bucket_puts_its_dtypes_into_the_dot(tokens, quantization, want, monkeypatch):
    # The accelerators' program: on CPU int8 goes through a native kernel (test_cpu_int8_matmul).
    monkeypatch.setattr(linear_module, "_use_cpu_int8_kernel", lambda num_tokens: False)
    q = quantized_from_dense(weights((32, 48), scale_rows=False), 1, quantization)
    x = jnp.ones((tokens, 32), jnp.bfloat16)
    dtypes, dims = dot_operand_dtypes(lambda x, q: linear("te,ef->tf", x, q), x, q)
    assert dtypes == want
    # Both operands contract on their minor dimension: [M, K] x [N, K], no transpose of the weight.
    assert dims == (((1,), (1,)), ((), ()))


@pytest.mark.parametrize("dtype,want", [(jnp.bfloat16, "bfloat16"), (jnp.float32, "float32")])
def test_the_w8a8_dot_writes_a_bf16_models_output_in_bf16(dtype, want):
    # Half the bytes for the GEMM's output and for every fusion reading it (scales, SiLU, the
    # next quantization); an f32 model keeps f32 (and float16 would overflow: see fp8_w8a8_matmul).
    q = quantized_from_dense(weights((32, 48), scale_rows=False), 1, "fp8")
    x = jnp.asarray(RNG.standard_normal((FP8_W8A8_MIN_TOKENS, 32)), dtype)
    dot = the_dot(lambda x, q: linear("te,ef->tf", x, q), x, q)
    assert [str(v.aval.dtype) for v in dot.invars] == ["float8_e4m3fn", "float8_e4m3fn"]
    assert str(dot.outvars[0].aval.dtype) == want
    got = linear("te,ef->tf", x, q)
    assert got.dtype == dtype
    # bf16: the accumulator rounded once more before the scales; within bf16's own output rounding.
    want_f32 = linear("te,ef->tf", x.astype(jnp.float32), q)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want_f32), rtol=2e-2, atol=2e-2)


def test_the_pallas_gemv_is_gpu_only():
    # The committed table prefers the fp8 kernel for 14336 x 4096 at M=1, but only on a GPU.
    assert not linear_module.use_pallas_gemv(1, 14336, 4096, jnp.float8_e4m3fn, "nk")  # the tests run on CPU


def test_subscripts_that_do_not_fit_the_payload_layout_are_refused():
    assert split_subscripts("thd,hde->te") == (2, 1)
    q = quantized_from_dense(weights((32, 48)), 1, "int8")
    with pytest.raises(ValueError, match="trailing axes"):
        linear("et,ef->tf", jnp.ones((32, 3)), q)


def test_declarations_of_a_quantized_model():
    config = ModelConfig(**{**CONFIG.__dict__, "quantization": "fp8"})
    layer = param_specs(config).layers[0]
    assert set(QUANTIZED_PROJECTIONS) == {n for n in vars(layer) if isinstance(getattr(layer, n), QuantizedWeight)}
    assert layer.q.payload.shape == (4, 8, 32) and layer.q.payload.dtype == "float8_e4m3fn"
    assert layer.q.scale.shape == (4, 8) and layer.q.scale.dtype == "float32"
    assert layer.o.payload.shape == (32, 4, 8) and layer.o.scale.shape == (32,)
    assert layer.down.payload.logical_axes == ("embed", "ffn")
    axes = logical_axes(config).layers[0]
    assert axes.q.payload == ("q_heads", "head_dim", "embed") and axes.q.scale == ("q_heads", "head_dim")
    assert param_specs(config).embed.dtype is None  # the serving dtype
    random = init_random(config, jax.random.key(0), jnp.bfloat16)
    leaves = jax.tree.leaves(random)
    specs = jax.tree.leaves(param_specs(config), is_leaf=is_spec)
    assert [(x.shape, str(x.dtype)) for x in leaves] == [(s.shape, s.dtype or "bfloat16") for s in specs]
    assert np.abs(np.asarray(random.layers[0].gate.payload.astype(jnp.float32))).max() == 448.0


def device(platform, kind, capability=None):
    return types.SimpleNamespace(platform=platform, device_kind=kind, compute_capability=capability)


@pytest.mark.parametrize("dev,ok", [
    (device("cpu", "cpu"), True),
    (device("gpu", "NVIDIA H200", "9.0"), True),
    (device("gpu", "NVIDIA L4", "8.9"), True),
    (device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), False),
    (device("tpu", "TPU v5 lite"), False),
    (device("tpu", "TPU v6 lite"), False),
    (device("tpu", "TPU7x"), True),
])
def test_fp8_needs_a_device_with_fp8(dev, ok):
    assert fp8_support(dev)[0] is ok
    if ok:
        check_platform_supports("fp8", dev)
    else:
        with pytest.raises(QuantizationError, match="quantization='int8'"):
            check_platform_supports("fp8", dev)
    check_platform_supports("int8", dev)  # int8 runs everywhere


def test_unknown_quantization_names_the_supported_ones():
    with pytest.raises(QuantizationError, match=r"\['fp8', 'int8'\]"):
        check_quantization("int4")
    with pytest.raises(EngineConfigError, match="quantization") as error:
        EngineConfig(quantization="nf4")
    assert error.value.field == "quantization"


def test_the_default_scale_method_is_the_one_measured_to_help_each_format():
    w = weights((16, 64), scale_rows=False)
    for quantization, method in (("fp8", "mse"), ("int8", "absmax")):
        default, chosen = quantize(w, quantization, 1), quantize(w, quantization, 1, scale_method=method)
        np.testing.assert_array_equal(np.asarray(default.scale), np.asarray(chosen.scale))
    # fp8's default is the search: some row of a Gaussian matrix takes a ratio other than 1.
    absmax = quantize(w, "fp8", 1, scale_method="absmax")
    assert not np.allclose(np.asarray(quantize(w, "fp8", 1).scale), np.asarray(absmax.scale))

"""The native int8 weight-only matmul for XLA:CPU against a float64 product, and its use by ``linear``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer.linear as linear_module
from jaxinfer import cpu_int8_matmul
from jaxinfer.linear import linear, linear_many
from tests.test_quantization import dense_from_quantized, quantized_from_dense

pytestmark = pytest.mark.skipif(not cpu_int8_matmul.is_available(),
                                reason=f"native int8 CPU matmul: {cpu_int8_matmul.unavailable_reason()}")


@pytest.mark.parametrize("m,n,k,max_threads", [
    (1, 1536, 576, 64),  # a decode step's MLP up projection
    (3, 37, 19, 64),  # n not a multiple of the 4- or 8-row groups, k not of the 16 lanes
    (8, 576, 1536, 1),  # two full 4-row tiles of x
    (9, 13, 33, 1),  # tiles of 4, 4 and 1 rows; a 1-row weight group; a 1-element K tail
    (1, 11, 7, 1),  # K shorter than one vector: only the masked tail
    (2, 4099, 64, 2),  # enough weight to split over threads, odd row count per share
])
def test_matches_a_float64_product(m, n, k, max_threads):
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scale = rng.uniform(0.5, 2.0, n).astype(np.float32)
    got = jax.jit(lambda x, w, s: cpu_int8_matmul.int8_matmul_cpu(x, w, s, max_threads=max_threads))(x, w, scale)
    want = (x.astype(np.float64) @ w.T.astype(np.float64)) * scale
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("m,max_threads", [(1, 1), (5, 2)])
def test_several_projections_in_one_call_match_each_alone(m, max_threads):
    # q/k/v of different widths laid end to end: the thread split crosses projection boundaries.
    rng = np.random.default_rng(m)
    k = 200
    x = rng.standard_normal((m, k)).astype(np.float32)
    weights = [(rng.integers(-127, 128, (n, k)).astype(np.int8), rng.uniform(0.5, 2.0, n).astype(np.float32))
               for n in (300, 100, 157)]
    got = jax.jit(lambda x, w: cpu_int8_matmul.int8_matmul_many_cpu(x, w, max_threads=max_threads))(x, weights)
    for y, (w, scale) in zip(got, weights):
        want = (x.astype(np.float64) @ w.T.astype(np.float64)) * scale
        assert y.shape == (m, w.shape[0])
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_linear_many_makes_one_call_for_int8_weights():
    rng = np.random.default_rng(3)
    weights = [quantized_from_dense(jnp.asarray(rng.standard_normal((32, 3, 8)).astype(np.float32)), 1, "int8")
               for _ in range(3)]
    x = jnp.asarray(rng.standard_normal((2, 32)).astype(np.float32))
    jaxpr = str(jax.make_jaxpr(lambda x, w: linear_many("te,ehd->thd", x, w))(x, weights))
    assert jaxpr.count("ffi_call") == 1
    together = linear_many("te,ehd->thd", x, weights)
    for y, w in zip(together, weights):
        np.testing.assert_allclose(np.asarray(y), np.asarray(linear("te,ehd->thd", x, w)), rtol=1e-6, atol=1e-6)


def test_refuses_a_payload_that_is_not_int8_or_a_scale_that_does_not_fit():
    with pytest.raises(ValueError, match="payload"):
        cpu_int8_matmul.int8_matmul_cpu(jnp.ones((1, 4)), jnp.ones((3, 4)), jnp.ones(3))
    with pytest.raises(ValueError, match="scale"):
        cpu_int8_matmul.int8_matmul_cpu(jnp.ones((1, 4)), jnp.ones((3, 4), jnp.int8), jnp.ones(4))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_runs_int8_weights_through_the_kernel_on_cpu(dtype):
    rng = np.random.default_rng(7)
    dense = jnp.asarray(rng.standard_normal((32, 3, 16)).astype(np.float32))  # q: [E, Hq, D]
    q = quantized_from_dense(dense, 1, "int8")
    x = jnp.asarray(rng.standard_normal((5, 32)).astype(np.float32)).astype(dtype)
    jaxpr = str(jax.make_jaxpr(lambda x, q: linear("te,ehd->thd", x, q))(x, q))
    assert "ffi_call" in jaxpr and "dot_general" not in jaxpr
    got = linear("te,ehd->thd", x, q)
    want = jnp.einsum("te,ehd->thd", x.astype(jnp.float32), dense_from_quantized(q, 1), precision="highest")
    assert got.dtype == dtype and got.shape == (5, 3, 16)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)


def test_linear_keeps_xla_weight_only_path_when_the_kernel_is_off(monkeypatch):
    monkeypatch.setattr(linear_module, "_use_cpu_int8_kernel", lambda num_tokens: False)
    q = quantized_from_dense(jnp.ones((32, 48)), 1, "int8")
    jaxpr = str(jax.make_jaxpr(lambda x, q: linear("te,ef->tf", x, q))(jnp.ones((2, 32)), q))
    assert "dot_general" in jaxpr and "ffi_call" not in jaxpr


def test_loading_the_kernel_leaves_the_process_floating_point_state_alone():
    # Built with -ffast-math, the library set flush-to-zero / denormals-are-zero for the whole
    # process when it loaded (GCC's crtfastmath.o): subnormals then read as zero everywhere.
    x = jnp.ones((1, 64), jnp.float32)
    payload, scale = jnp.ones((8, 64), jnp.int8), jnp.ones((8,), jnp.float32)
    jax.block_until_ready(cpu_int8_matmul.int8_matmul_cpu(x, payload, scale))
    smallest = np.float64(5e-324)  # the smallest subnormal double
    assert smallest * 1.0 > 0 and np.nextafter(np.float32(0), np.float32(1)) * np.float32(1) > 0


def test_large_steps_take_xla_convert_and_dot():
    q = quantized_from_dense(jnp.ones((32, 48)), 1, "int8")
    rows = linear_module.CPU_INT8_KERNEL_MAX_TOKENS
    for m, kernel in ((rows - 1, True), (rows, False)):
        jaxpr = str(jax.make_jaxpr(lambda x, q: linear_many("te,ef->tf", x, (q, q)))(jnp.ones((m, 32)), q))
        assert ("ffi_call" in jaxpr) == kernel and ("dot_general" in jaxpr) == (not kernel)

"""The native int8 weight-only matmul for XLA:CPU against a float64 product, and its use by ``linear``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer.linear as linear_module
from jaxinfer import cpu_int8_matmul
from jaxinfer.linear import linear
from tests.test_quantization import dense_from_quantized, quantized_from_dense

pytestmark = pytest.mark.skipif(not cpu_int8_matmul.is_available(),
                                reason=f"native int8 CPU matmul: {cpu_int8_matmul.unavailable_reason()}")


@pytest.mark.parametrize("m,n,k,max_threads", [
    (1, 1536, 576, 64),  # a decode step's MLP up projection
    (3, 37, 19, 64),  # n not a multiple of the 4-row groups, k not of the 16 lanes
    (8, 576, 1536, 1),
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


def test_refuses_a_payload_that_is_not_int8():
    with pytest.raises(ValueError, match="payload"):
        cpu_int8_matmul.int8_matmul_cpu(jnp.ones((1, 4)), jnp.ones((3, 4)), jnp.ones(3))


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
    monkeypatch.setattr(linear_module, "_use_cpu_int8_kernel", lambda: False)
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

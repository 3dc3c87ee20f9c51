"""The weight layer's choice between the Pallas GEMV kernels and XLA, and the dense-layout path it takes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.decode_gemv import (
    PALLAS_GEMV_MAX_TOKENS,
    dense_contraction,
    dense_gemv_shape,
    dense_pallas_matmul,
    use_pallas_gemv,
)

SIZES = dict(algorithm="gemv", block_n=128, block_k=64, k_splits=4, num_warps=4, num_stages=1, prefetch=1)


def entry(m, n, k, weights, layout, ours_us, xla_us):
    return {"m": m, "n": n, "k": k, "weights": weights, "layout": layout, "sizes": SIZES, "ours_us": ours_us,
            "xla_method": "xla_bf16", "xla_us": xla_us}


TABLE = [entry(1, 4096, 4096, "bfloat16", "kn", 8.0, 10.0), entry(8, 4096, 4096, "bfloat16", "kn", 8.5, 10.0),
         entry(1, 4096, 4096, "bfloat16", "nk", 20.0, 10.0)]


def test_ours_only_on_one_gpu_where_the_table_says_it_wins():
    gpu = dict(platform="gpu", num_devices=1, table=TABLE)
    assert use_pallas_gemv(1, 4096, 4096, jnp.bfloat16, "kn", **gpu)
    assert use_pallas_gemv(4, 4096, 4096, jnp.bfloat16, "kn", **gpu)  # between two measured wins
    assert not use_pallas_gemv(1, 4096, 4096, jnp.bfloat16, "nk", **gpu)  # that layout lost
    assert not use_pallas_gemv(16, 4096, 4096, jnp.bfloat16, "kn", **gpu)  # above the measured Ms
    assert not use_pallas_gemv(1, 4096, 1024, jnp.bfloat16, "kn", **gpu)  # shape not measured
    assert not use_pallas_gemv(1, 4096, 4096, jnp.bfloat16, "kn", platform="cpu", num_devices=1, table=TABLE)
    # Sharded over several devices a pallas_call would not partition itself: XLA keeps the dot.
    assert not use_pallas_gemv(1, 4096, 4096, jnp.bfloat16, "kn", platform="gpu", num_devices=2, table=TABLE)
    many = [entry(m, 4096, 4096, "bfloat16", "kn", 8.0, 10.0) for m in (1, 64)]
    assert not use_pallas_gemv(32, 4096, 4096, jnp.bfloat16, "kn", platform="gpu", num_devices=1, table=many)
    assert 32 > PALLAS_GEMV_MAX_TOKENS


@pytest.mark.parametrize("subscripts,n_in", [("te,ef->tf", 1), ("te,ehd->thd", 1), ("thd,hde->te", 2),
                                             ("et,ef->tf", None), ("thd,dhe->te", None), ("te,fe->tf", None)])
def test_only_einsums_that_reshape_to_x_times_w_are_taken(subscripts, n_in):
    assert dense_contraction(subscripts) == n_in


def test_only_bf16_operands_are_taken():
    x, w = jnp.ones((2, 32), jnp.float32), jnp.ones((32, 48), jnp.float32)
    assert dense_gemv_shape("te,ef->tf", x, w) is None
    assert dense_gemv_shape("te,ef->tf", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)) == (2, 48, 32)


@pytest.mark.parametrize("subscripts,x_shape,w_shape", [("te,ehd->thd", (3, 64), (64, 4, 32)),
                                                        ("thd,hde->te", (3, 4, 16), (4, 16, 128))])
def test_dense_path_matches_the_einsum(subscripts, x_shape, w_shape):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, x_shape, jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, w_shape, jnp.float32) / 8).astype(jnp.bfloat16)
    out = dense_pallas_matmul(subscripts, x, w, interpret=True)
    ref = jnp.einsum(subscripts, x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    assert out.shape == ref.shape and out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=2**-7,
                               atol=2**-7 * float(jnp.abs(ref).max()))


def test_the_weight_layer_routes_dense_bf16_projections_only_where_told(monkeypatch):
    # On a GPU with a table that prefers ours, linear() takes the kernel for a bf16 projection
    # and keeps XLA's dot for the lm_head's f32 logits (the kernel returns x's dtype).
    from jaxinfer import linear as linear_module

    asked = []
    monkeypatch.setattr(linear_module, "use_pallas_gemv", lambda *args: asked.append(args) or True)
    monkeypatch.setattr(linear_module, "dense_pallas_matmul",
                        lambda s, x, w: dense_pallas_matmul(s, x, w, interpret=True))
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (2, 64), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (64, 128), jnp.float32) / 8).astype(jnp.bfloat16)
    out = linear_module.linear("te,ef->tf", x, w)
    assert asked == [(2, 128, 64, jnp.bfloat16, "kn")]
    ref = jnp.einsum("te,ef->tf", x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=2**-7,
                               atol=2**-7 * float(jnp.abs(ref).max()))
    logits = linear_module.linear("ne,ev->nv", x, w, preferred_element_type=jnp.float32)
    assert logits.dtype == jnp.float32 and len(asked) == 1  # not asked: XLA's dot
    linear_module.linear("te,ef->tf", x.astype(jnp.float32), w.astype(jnp.float32))
    assert len(asked) == 1  # f32 operands: XLA's dot

"""The Mosaic GPU causal-prefill prototype (benchmarks/, not the engine) vs dense causal attention, on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.mosaic_gpu_prefill_prototype import causal_prefill_attention_mosaic_gpu


def test_mosaic_gpu_prefill_prototype_matches_dense_causal_attention():
    # Two chunks of 128 tokens (two query blocks: the diagonal block and one below it), GQA 2.
    rng = np.random.default_rng(0)
    n, length, hq, hkv, d = 2, 128, 4, 2, 64
    q, k, v = (jnp.asarray(rng.standard_normal((n, length, h, d)), jnp.bfloat16) for h in (hq, hkv, hkv))
    got = causal_prefill_attention_mosaic_gpu(q, k, v, sm_scale=d**-0.5, interpret=True)
    up = lambda x: jnp.repeat(x, hq // hkv, axis=2).astype(jnp.float32)  # noqa: E731
    want = jax.nn.dot_product_attention(q.astype(jnp.float32), up(k), up(v), scale=d**-0.5, is_causal=True)
    assert got.shape == q.shape and not jnp.isnan(got).any()
    err = jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want)
    assert err < 1e-2  # bf16 operands, P rounded to bf16


def test_mosaic_gpu_prefill_prototype_lowers_for_hopper_from_cpu():
    spec = jax.ShapeDtypeStruct
    q, kv = spec((1, 1024, 32, 128), jnp.bfloat16), spec((1, 1024, 8, 128), jnp.bfloat16)
    lowered = causal_prefill_attention_mosaic_gpu.trace(q, kv, kv, sm_scale=0.1).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_mosaic_gpu_prefill_prototype_refuses_unsupported_shapes():
    q = jnp.zeros((1, 100, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64"):
        causal_prefill_attention_mosaic_gpu(q, q[:, :, :2], q[:, :, :2], sm_scale=0.1, interpret=True)

"""The one-launch residual add + RMSNorm (pallas_kernels.residual_norm) against its plain-JAX contract.

The kernel runs in Pallas interpret mode here, lowers through Triton for an H200 from the CPU, and
serves the model: ``jaxinfer.model.add_rms_norm`` picks it for GPU steps of few tokens only, and a
model running it (interpret mode) gives the logits of the model without it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer.model as model_lib
from jaxinfer.batch import build_step_batch
from jaxinfer.kv_cache import create_kv_cache
from pallas_kernels.residual_norm import MAX_GPU_ROWS, add_rms_norm_gpu, add_rms_norm_reference

from .all_logits import forward_all_logits
from .test_model_golden import ATOL, PAGE_SIZE, RTOL, TINY, _golden, _model


def _inputs(rows, hidden, x_dtype, weight_dtype=None, seed=0):
    kx, kd, kw = jax.random.split(jax.random.key(seed), 3)
    # Residual streams grow through a model: rows of very different scales, one of zeros.
    scale = 10.0 ** jnp.linspace(-2, 3, rows)[:, None]
    x = (jax.random.normal(kx, (rows, hidden)) * scale).astype(x_dtype)
    delta = (jax.random.normal(kd, (rows, hidden)) * scale).astype(x_dtype)
    if rows > 1:
        x, delta = x.at[1].set(0), delta.at[1].set(0)
    weight = (1 + 0.2 * jax.random.normal(kw, (hidden,))).astype(weight_dtype or x_dtype)
    return x, delta, weight


@pytest.mark.parametrize("rows, hidden", [(1, 4096), (8, 576), (8, 960), (3, 64), (32, 2048), (MAX_GPU_ROWS, 896)])
@pytest.mark.parametrize("x_dtype, weight_dtype", [(jnp.bfloat16, None), (jnp.float32, None),
                                                    (jnp.bfloat16, jnp.float32)])
def test_kernel_equals_reference(rows, hidden, x_dtype, weight_dtype):
    x, delta, weight = _inputs(rows, hidden, x_dtype, weight_dtype)
    total, normed = add_rms_norm_gpu(x, delta, weight, eps=1e-5, interpret=True)
    want_total, want_normed = add_rms_norm_reference(x, delta, weight, 1e-5)
    assert (total.dtype, normed.dtype) == (want_total.dtype, want_normed.dtype)
    np.testing.assert_array_equal(np.asarray(total), np.asarray(want_total))  # one rounded add: exact
    # The mean square's additions run in another order than XLA's; the float32 mean differs in its
    # last bits at most. In bfloat16 that may flip the rounding of the normed row (one ulp), which
    # the weight multiply's own rounding can carry to two.
    got32, want32 = (np.asarray(a.astype(jnp.float32)) for a in (normed, want_normed))
    bound = 2 * 2.0**-7 if x_dtype == jnp.bfloat16 else 2.0**-20
    np.testing.assert_array_less(np.abs(got32 - want32), bound * np.abs(want32) + 1e-30)
    if x_dtype == jnp.bfloat16:
        assert np.mean(got32 == want32) > 0.99  # the rounding hides the mean's last bits almost everywhere
    assert np.all(got32[1] == 0) if rows > 1 else True  # a zero row normalises to zero, not NaN


def test_kernel_rejects_mismatched_shapes():
    x, delta, weight = _inputs(4, 64, jnp.float32)
    with pytest.raises(ValueError, match=r"weight \[E\]"):
        add_rms_norm_gpu(x, delta, weight[:32], eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match=r"x and delta \[T, E\]"):
        add_rms_norm_gpu(x, delta[:2], weight, eps=1e-5, interpret=True)


def test_kernel_lowers_through_triton_from_cpu():
    from jax._src.mesh import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    for hidden in (4096, 576):
        x, delta, weight = _inputs(8, hidden, jnp.bfloat16)
        with jax.sharding.use_abstract_mesh(mesh):
            lowered = add_rms_norm_gpu.trace(x, delta, weight, eps=1e-5).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()


def test_model_takes_the_kernel_for_few_tokens_on_one_gpu(monkeypatch):
    assert model_lib.add_rms_norm_kernel(8) is None  # CPU: XLA's fusions
    monkeypatch.setattr(model_lib.jax, "default_backend", lambda: "gpu")
    assert model_lib.add_rms_norm_kernel(1) is add_rms_norm_gpu
    assert model_lib.add_rms_norm_kernel(MAX_GPU_ROWS) is add_rms_norm_gpu
    assert model_lib.add_rms_norm_kernel(MAX_GPU_ROWS + 1) is None  # prefill: bytes, not launches
    from jax._src.mesh import AbstractMesh

    with jax.sharding.use_abstract_mesh(AbstractMesh((2,), ("tp",))):
        assert model_lib.add_rms_norm_kernel(8) is None  # a Pallas call cannot be partitioned


def _last_logits(model, ids, num_tokens):
    num_pages = -(-len(ids) // PAGE_SIZE)
    cache = create_kv_cache(model.config, 1 + num_pages, PAGE_SIZE, jnp.float32)
    batch = build_step_batch([(ids, 0, list(range(1, 1 + num_pages)))], num_tokens=num_tokens, num_seqs=1,
                             pages_per_seq=num_pages)
    # A fresh function each call: jit must trace again, under whichever add_rms_norm_kernel is in force.
    step = jax.jit(lambda w, c, b: forward_all_logits(w, c, b, model.config, "reference"))
    logits, _ = step(model.weights, cache, jax.tree.map(jnp.asarray, batch))
    return np.asarray(logits)[len(ids) - 1]


@pytest.mark.parametrize("name", TINY)
def test_model_with_the_kernel_matches_transformers(name, monkeypatch):
    golden, arrays = _golden(name)
    model = _model(name)
    # Prompts that fit one step of MAX_GPU_ROWS tokens, so every add + norm of the step is the kernel's.
    short = [(i, p["ids"]) for i, p in enumerate(golden["prompts"]) if len(p["ids"]) <= MAX_GPU_ROWS]
    assert short, "no golden prompt fits a step the kernel serves"
    without = [_last_logits(model, ids, MAX_GPU_ROWS) for _, ids in short]
    calls = []

    def interpreted(num_tokens):
        calls.append(num_tokens)
        return functools.partial(add_rms_norm_gpu, interpret=True) if num_tokens <= MAX_GPU_ROWS else None

    monkeypatch.setattr(model_lib, "add_rms_norm_kernel", interpreted)
    for (i, ids), logits_without in zip(short, without):
        logits = _last_logits(model, ids, MAX_GPU_ROWS)
        np.testing.assert_allclose(logits, arrays["last_logits"][i], atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(logits, logits_without, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2 * model.config.num_layers * len(short)  # two a layer: after attention, after the MLP

"""Mosaic GPU kernels hash by content (pallas_kernels.mosaic_gpu_names), so warm-up's shared kernels
are the ones the step programs need (jaxinfer.attention.shared_kernel_programs).

jaxlib keeps compiled Mosaic GPU kernels in a process-wide cache keyed by the kernel's hash. In jax
0.11.2 every lowering stamps a counter into the kernel (``mosaic_gpu.dump_basename``), so equal
kernels hashed differently and the H200's large step programs each compiled the same fresh-prefill
windows again. These lower for CUDA from the CPU (no GPU: nothing is compiled) and compare hashes.
"""

import re
import types

import jax
import jax.numpy as jnp
import pytest

from benchmarks.model_shapes import SHAPES
from benchmarks.step_ops import StepShape, lower_step

_KERNEL_HASH = re.compile(r'kernel_hash = "([^"]*)"')


@pytest.fixture
def hopper(monkeypatch):
    """Lowering as for an H200: the fresh-prefill path resolves, and the bundled kernel's CUDA
    version check (it asks the CUDA runtime, absent here) passes."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    import jaxinfer.attention

    monkeypatch.setattr(jaxinfer.attention, "_is_hopper_gpu", lambda: True)
    monkeypatch.setattr(attention_mgpu, "cuda_versions", types.SimpleNamespace(cuda_runtime_get_version=lambda: 13000))


def kernel_hashes(lowered) -> list[str]:
    return _KERNEL_HASH.findall(lowered.as_text())


def test_one_kernel_lowered_in_two_programs_hashes_the_same(hopper):
    from pallas_kernels.paged_attention.gpu_fresh_prefill import causal_attention_mgpu

    q = jax.ShapeDtypeStruct((1, 1024, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)

    def alone(q, k, v):
        return causal_attention_mgpu(q, k, v, sm_scale=0.125)

    def twice(q, k, v):  # a different program around the same kernel
        with jax.named_scope("layer_7"):
            out = causal_attention_mgpu(q, k, v, sm_scale=0.125)
        return causal_attention_mgpu(out, k, v, sm_scale=0.125) * 2

    first = kernel_hashes(jax.jit(alone).trace(q, kv, kv).lower(lowering_platforms=("cuda",)))
    second = kernel_hashes(jax.jit(twice).trace(q, kv, kv).lower(lowering_platforms=("cuda",)))
    assert len(first) == 1 and set(second) == set(first)


def test_warm_up_kernels_are_the_step_programs_window_kernels(hopper):
    from jaxinfer.attention import shared_kernel_programs

    shape = StepShape(SHAPES["llama-3.1-8b"], num_tokens=2048, num_seqs=8, impl="pallas_gpu_fresh_prefill")
    step = set(kernel_hashes(lower_step(shape, 1, "cuda")))
    config = shape.config(1)
    kernels = shared_kernel_programs("pallas_gpu_fresh_prefill", config, [(2048, 8), (8, 8)])  # decode-like: none
    assert [name for name, _ in kernels] == [f"kernel fresh-prefill window 1x{n}" for n in (2048, 1536, 1024)]
    warm = {h for _, lower in kernels for h in kernel_hashes(lower(platform="cuda"))}
    assert len(step) == 3 and warm == step
    # Hopper's default since session 17 (cuDNN over segments) has no Mosaic GPU window to compile early.
    assert shared_kernel_programs("auto", config, [(2048, 8)]) == []


def test_no_shared_kernels_off_the_fresh_prefill_path():
    from jaxinfer.attention import shared_kernel_programs

    config = StepShape(SHAPES["llama-3.1-8b"]).config(1)
    assert shared_kernel_programs("pallas_gpu", config, [(2048, 8)]) == []
    assert shared_kernel_programs("auto", config, [(2048, 8)]) == []  # this CPU is no Hopper GPU

"""Compiler options per step program (jaxinfer.compile_options): which bucket gets which options.

The GPU choices are checked on CPU through ``platform="gpu"``: only the options are computed,
nothing is compiled for a GPU.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.compile_options import (DENSE_UNMERGED_BELOW_TOKENS, DENSE_UNMERGED_MIN_TOKENS, DENSE_UNMERGED_OPTIONS,
                                      FP8_UNMERGED_BELOW_TOKENS, FP8_UNMERGED_OPTIONS, FP8_W8A8_GEMM_OPTIONS,
                                      MERGED_DOTS_MAX_TOKENS, MERGED_DOTS_OPTIONS, XLA_OVERLAP_OPTIONS, OverlapConfig,
                                      PhasedJit, merged_dots_options, quantized_gemm_options)
from jaxinfer.linear import FP8_W8A8_MIN_TOKENS, uses_fp8_w8a8
from jaxinfer.runner import default_buckets


def step(x):
    return x @ x


def gpu_token_buckets(max_num_seqs=384):
    return default_buckets(max_num_seqs, 8192, 64, "gpu").num_tokens


def fp8_gpu_options(tokens):
    """What an FP8 step of ``tokens`` rows should compile with on a GPU (compile_options.py)."""
    if not uses_fp8_w8a8(tokens):
        return {}
    if tokens < FP8_UNMERGED_BELOW_TOKENS:
        return {**FP8_W8A8_GEMM_OPTIONS, **FP8_UNMERGED_OPTIONS}
    return FP8_W8A8_GEMM_OPTIONS


def test_fp8_w8a8_buckets_compile_without_triton_gemms_and_weight_only_ones_keep_it():
    buckets = gpu_token_buckets()
    jitted = PhasedJit(step, None, 384, quantization="fp8", platform="gpu")
    for tokens in buckets:
        options = jitted.compiler_options(tokens)
        if tokens >= FP8_W8A8_MIN_TOKENS:
            assert options == fp8_gpu_options(tokens), tokens
            assert options["xla_gpu_enable_triton_gemm"] is False
        else:
            assert options is None, tokens  # weight-only: the dequant fuses into a Triton GEMM
    # All three kinds occur among the default buckets, each family one jit object.
    assert min(buckets) < FP8_W8A8_MIN_TOKENS < FP8_UNMERGED_BELOW_TOKENS <= max(buckets)
    families = {id(jitted.for_tokens(t)) for t in buckets}
    assert len(families) == 3
    assert jitted.for_tokens(FP8_W8A8_MIN_TOKENS) is jitted.for_tokens(FP8_UNMERGED_BELOW_TOKENS - 1)
    assert jitted.for_tokens(FP8_UNMERGED_BELOW_TOKENS) is jitted.for_tokens(max(buckets))


def test_moderate_fp8_w8a8_steps_merge_no_dots_and_large_ones_keep_xlas_default():
    # A merged pair of FP8 dots costs a copy of their concatenated weights every step: 3 ms of a
    # 15 ms step at 128 rows on an H200; from ~1000 rows the merged q/k/v GEMM paid for it.
    assert FP8_UNMERGED_OPTIONS == {"xla_gpu_dot_merger_threshold_mb": 0}
    assert quantized_gemm_options("fp8", FP8_W8A8_MIN_TOKENS, "gpu")["xla_gpu_dot_merger_threshold_mb"] == 0
    assert quantized_gemm_options("fp8", FP8_UNMERGED_BELOW_TOKENS - 1, "gpu")["xla_gpu_dot_merger_threshold_mb"] == 0
    assert "xla_gpu_dot_merger_threshold_mb" not in quantized_gemm_options("fp8", FP8_UNMERGED_BELOW_TOKENS, "gpu")
    assert quantized_gemm_options("fp8", FP8_W8A8_MIN_TOKENS - 1, "gpu") == {}  # weight-only: Triton fuses it


def test_the_options_follow_the_path_linear_takes():
    for tokens in (1, FP8_W8A8_MIN_TOKENS - 1, FP8_W8A8_MIN_TOKENS, 4 * FP8_W8A8_MIN_TOKENS, 8192):
        assert quantized_gemm_options("fp8", tokens, "gpu") == fp8_gpu_options(tokens)


@pytest.mark.parametrize("quantization,platform", [("int8", "gpu"), ("fp8", "cpu"), ("fp8", "tpu"), (None, "cpu")])
def test_other_models_and_platforms_get_no_gemm_options(quantization, platform):
    jitted = PhasedJit(step, None, 384, quantization=quantization, platform=platform)
    assert all(jitted.compiler_options(t) is None for t in gpu_token_buckets())


def test_small_dense_gpu_steps_merge_gate_and_up_and_larger_ones_merge_nothing(monkeypatch):
    # One Triton GEMV over gate and up (fused concatenation) reads them faster than two; a cuBLAS
    # GEMM of a large decode step would read a copy of the concatenation written every step, so
    # those merge nothing; the sizes between and the prefill sizes keep XLA's default.
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    buckets = gpu_token_buckets()
    jitted = PhasedJit(step, None, 384, platform="gpu")
    for tokens in buckets:
        expected = (MERGED_DOTS_OPTIONS if tokens <= MERGED_DOTS_MAX_TOKENS
                    else DENSE_UNMERGED_OPTIONS if DENSE_UNMERGED_MIN_TOKENS <= tokens < DENSE_UNMERGED_BELOW_TOKENS
                    else None)
        assert jitted.compiler_options(tokens) == expected, tokens
    assert min(buckets) <= MERGED_DOTS_MAX_TOKENS < 128 < DENSE_UNMERGED_MIN_TOKENS <= 384 < DENSE_UNMERGED_BELOW_TOKENS
    assert DENSE_UNMERGED_BELOW_TOKENS <= max(buckets)
    assert jitted.compiler_options(128) is None and jitted.compiler_options(384) == DENSE_UNMERGED_OPTIONS
    assert MERGED_DOTS_OPTIONS["xla_gpu_dot_merger_threshold_mb"] > 117  # gate/up of an 8B model, bf16
    assert DENSE_UNMERGED_OPTIONS["xla_gpu_dot_merger_threshold_mb"] == 0
    assert merged_dots_options("fp8", 8, "gpu") == {}  # no gain measured in the engine
    assert merged_dots_options("int8", 8, "gpu") == {}  # not measured on a GPU
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_dot_merger_threshold_mb=0")
    assert merged_dots_options(None, 8, "gpu") == {}  # the user's choice stays theirs
    assert merged_dots_options(None, 384, "gpu") == {}
    assert len({id(jitted.for_tokens(t)) for t in gpu_token_buckets()}) == 1  # one program family


def test_a_choice_in_xla_flags_stays_the_users(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert quantized_gemm_options("fp8", 4096, "gpu") == {}
    assert quantized_gemm_options("fp8", 256, "gpu") == FP8_UNMERGED_OPTIONS
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true --xla_gpu_dot_merger_threshold_mb=32")
    assert quantized_gemm_options("fp8", 256, "gpu") == {}


def test_overlap_and_base_options_merge_with_the_gemm_options():
    jitted = PhasedJit(step, OverlapConfig(prefill=True), decode_max_tokens=256,
                       base_compiler_options={"xla_gpu_enable_command_buffer": ""}, quantization="fp8",
                       platform="gpu")
    assert jitted.compiler_options(8) == {"xla_gpu_enable_command_buffer": ""}
    assert jitted.compiler_options(256) == {"xla_gpu_enable_command_buffer": "", **fp8_gpu_options(256)}
    assert jitted.compiler_options(2048) == {"xla_gpu_enable_command_buffer": "", **XLA_OVERLAP_OPTIONS,
                                             **FP8_W8A8_GEMM_OPTIONS}


def test_xla_accepts_the_gemm_options():
    # XLA refuses an option name it does not know ("No such compile option"), on any backend.
    jitted = jax.jit(step, compiler_options={**FP8_W8A8_GEMM_OPTIONS, **FP8_UNMERGED_OPTIONS})
    x = jnp.eye(4)
    assert jnp.array_equal(jitted(x), x)

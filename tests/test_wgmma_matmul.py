"""The TMA + wgmma decode matmul (``gpu_wgmma.py``) in Pallas's Mosaic GPU interpreter, its sm_90
lowering, its refusals, and the weight layer's opt-in path to it (``JAXINFER_DECODE_MATMUL=wgmma``).

The interpreter multiplies the operands as stored (e4m3 or bf16) in float32, so these check the
kernel's indexing (row blocks of several weights laid end to end, K slices, the pipeline's steps),
the in-kernel epilogue (both scales, the cast, the transposed store) and the split-K path's XLA
epilogue against a float32 reference of the same rounded operands; speed is the GPU benchmark's
(``benchmarks/wgmma_gemv.py``) and the engine's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized_matmul import gpu_wgmma
from pallas_kernels.quantized_matmul.gpu_wgmma import (FP8, default_sizes, quantize_blocks_e4m3, quantize_rows_e4m3,
                                                       scale_rows_f16, wgmma_matmul, wgmma_matmul_many)


def _fp8_weight(rng, n, k):
    w = rng.standard_normal((n, k)).astype(np.float32) * np.exp(rng.standard_normal((n, 1)))
    scale = np.abs(w).max(axis=1) / 448.0
    return jnp.asarray(w / scale[:, None]).astype(FP8), jnp.asarray(scale, jnp.float32)


def _w8a8_reference(x8, x_scale, w8, w_scale):
    x = x8.astype(jnp.float32) * jnp.asarray(x_scale, jnp.float32).reshape(-1, 1)
    return jnp.dot(x, (w8.astype(jnp.float32) * w_scale[:, None]).T, precision="highest")


def _rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(out - ref)) / np.max(np.abs(ref))


BF16_ROUNDING = 2.0 ** -8  # the output's cast: half an ulp of bf16 at the largest value, and margin


@pytest.mark.parametrize("m", [1, 3, 9])
def test_fp8_weights_with_the_epilogue_in_the_kernel(m):
    """bf16 x rounded to e4m3 per row, two row blocks, bf16 output: scales, cast and [M, N] store in the kernel."""
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 256)) * 3, jnp.bfloat16)
    w8, w_scale = _fp8_weight(rng, 128, 256)
    out = wgmma_matmul(x, w8, w_scale, out_dtype=jnp.bfloat16, block_k=128, interpret=True)
    assert out.shape == (m, 128) and out.dtype == jnp.bfloat16
    x8, x_scale = quantize_rows_e4m3(x)
    assert _rel(out, _w8a8_reference(x8, x_scale, w8, w_scale)) < BF16_ROUNDING


def test_fp8_split_k_partials_in_float32_and_a_static_input_scale():
    """K in 2 slices: float32 partial sums added by XLA (the float32 output keeps them exact to
    f32 rounding); x already e4m3 with one static scale."""
    rng = np.random.default_rng(0)
    w8, w_scale = _fp8_weight(rng, 64, 512)
    x8 = jnp.asarray(rng.standard_normal((5, 512)) * 40, jnp.float32).astype(FP8)
    out = wgmma_matmul(x8, w8, w_scale, x_scale=jnp.float32(0.25), k_splits=2, block_k=128, interpret=True)
    assert out.dtype == jnp.float32
    assert _rel(out, _w8a8_reference(x8, jnp.full((5,), 0.25), w8, w_scale)) < 1e-5


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_bf16_weights_in_either_layout(layout):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 128) if layout == "kn" else (128, 256)), jnp.bfloat16)
    out = wgmma_matmul(x, w, weight_layout=layout, block_k=64, interpret=True)
    w32 = w.astype(jnp.float32)
    ref = jnp.dot(x.astype(jnp.float32), w32 if layout == "kn" else w32.T, precision="highest")
    assert out.dtype == jnp.bfloat16 and _rel(out, ref) < BF16_ROUNDING


@pytest.mark.parametrize("k_splits", [1, 2])
def test_several_weights_in_one_launch(k_splits):
    """q/k/v-like weights of 128, 64 and 64 rows: each output is its own weight's, in both epilogues."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    weights = [_fp8_weight(rng, n, 256) for n in (128, 64, 64)]
    outs = wgmma_matmul_many(x, tuple(w for w, _ in weights), tuple(s for _, s in weights),
                             out_dtype=jnp.bfloat16, block_k=64, k_splits=k_splits, interpret=True)
    x8, x_scale = quantize_rows_e4m3(x)
    for out, (w8, w_scale) in zip(outs, weights, strict=True):
        assert out.shape == (3, w8.shape[0])
        assert _rel(out, _w8a8_reference(x8, x_scale, w8, w_scale)) < BF16_ROUNDING


@pytest.mark.parametrize("activations, k_splits", [("e4m3", 1), ("e4m3", 2), ("e4m3-fused", 1)])
def test_no_data_races_in_the_interpreter(activations, k_splits):
    """The interpreter's happens-before race detector over the pipeline's TMA copies, the scales'
    copies and barriers, the epilogue's smem stores and the wgmma reads, two weights a launch.
    (Its wgmma is synchronous, so a missing wait on an asynchronous one would not show here.)"""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
    weights = [_fp8_weight(rng, 64, 512) for _ in range(2)]
    outs = wgmma_matmul_many(x, tuple(w for w, _ in weights), tuple(s for _, s in weights), out_dtype=jnp.bfloat16,
                             block_k=256 if activations == "e4m3-fused" else 128, k_splits=k_splits,
                             max_concurrent_steps=2, activations=activations,
                             interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(outs)
    assert not interpret_pallas_call.get_races().races_found


@pytest.mark.parametrize("m, k_splits", [(1, 1), (9, 1), (20, 2)])
def test_fused_mode_rounds_each_k_step_of_x_in_the_kernel(m, k_splits):
    """activations="e4m3-fused": bf16 x (columns from 0.01 to 30 in size, one all-zero row) rounded
    to e4m3 inside the kernel, per token row and 256-value K step with that block's own scale;
    one token (the batch-1 bucket, 7 padding rows), 9, and 20 with K split in two;
    against the float32 product of quantize_blocks_e4m3's operands, two weights a launch, both epilogues."""
    rng = np.random.default_rng(7 + m)
    x = jnp.asarray(rng.standard_normal((m, 1024)) * np.linspace(0.01, 30, 1024), jnp.bfloat16)
    x = x.at[0].set(0) if m > 1 else x
    weights = [_fp8_weight(rng, n, 1024) for n in (128, 64)]
    out_dtype = jnp.bfloat16 if k_splits == 1 else jnp.float32
    outs = wgmma_matmul_many(x, tuple(w for w, _ in weights), tuple(s for _, s in weights), activations="e4m3-fused",
                             out_dtype=out_dtype, block_k=256, k_splits=k_splits, max_concurrent_steps=2,
                             interpret=True)
    x8, block_scale = quantize_blocks_e4m3(x, 256)
    x_rounded = (x8.astype(jnp.float32).reshape(m, 4, 256) * block_scale[..., None]).reshape(m, 1024)
    for out, (w8, w_scale) in zip(outs, weights, strict=True):
        ref = _w8a8_reference(x_rounded, jnp.ones((m,)), w8, w_scale)
        assert out.dtype == out_dtype and _rel(out, ref) < (BF16_ROUNDING if k_splits == 1 else 1e-5)
        assert m == 1 or not np.asarray(out[0]).any()  # the zero row: 0, not NaN


def test_fused_rounding_is_finer_than_one_scale_a_row():
    """Per-block scales follow x's size along K: where a row's small values sit under one scale set
    by its largest (e4m3's subnormals, or 0), a block's own scale keeps them to e4m3's precision."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((4, 1024)) * np.geomspace(1e-4, 1e2, 1024), jnp.float32)
    x8, block_scale = quantize_blocks_e4m3(x, 256)
    blocks = (x8.astype(jnp.float32).reshape(4, 4, 256) * block_scale[..., None]).reshape(4, 1024)
    row8, row_scale = quantize_rows_e4m3(x)
    rows = row8.astype(jnp.float32) * row_scale[:, None]
    small = x.astype(jnp.bfloat16).astype(jnp.float32)[:, :256]  # the first K step: 1e-4 to 3e-3

    def rel(y):
        return float(jnp.linalg.norm(y[:, :256] - small) / jnp.linalg.norm(small))

    assert rel(blocks) < 0.05 and rel(rows) > 5 * rel(blocks)  # measured: 0.023 and 0.17


def _int8_weight(rng, n, k):
    w = rng.standard_normal((n, k)).astype(np.float32)
    scale = np.abs(w).max(axis=1) / 127.0
    return jnp.asarray(np.round(w / scale[:, None]), jnp.int8), jnp.asarray(scale, jnp.float32)


@pytest.mark.parametrize("weight_format", ["fp8", "int8"])
@pytest.mark.parametrize("k_splits", [1, 2])
def test_weight_only_widens_the_tiles_and_keeps_x_in_f16(weight_format, k_splits):
    """activations="f16": x scaled per row into f16, e4m3 (or int8) tiles widened to f16 for the MMA;
    against the weight-only product of the unrounded bf16 x (f16 keeps 3 more bits of x than bf16)."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((3, 512)) * 50, jnp.bfloat16)
    make = _fp8_weight if weight_format == "fp8" else _int8_weight
    weights = [make(rng, n, 512) for n in (128, 64)]
    outs = wgmma_matmul_many(x, tuple(w for w, _ in weights), tuple(s for _, s in weights), activations="f16",
                             out_dtype=jnp.bfloat16, block_k=128, k_splits=k_splits, interpret=True)
    for out, (w, scale) in zip(outs, weights, strict=True):
        ref = jnp.dot(x.astype(jnp.float32), (w.astype(jnp.float32) * scale[:, None]).T, precision="highest")
        assert out.dtype == jnp.bfloat16 and _rel(out, ref) < BF16_ROUNDING


def test_f16_rows_keep_their_largest_value_at_256_and_zero_rows_at_scale_one():
    x = jnp.asarray([[0.0, 0.0], [1e5, -3.0], [-2e-3, 1e-3]], jnp.float32)
    x16, scale = scale_rows_f16(x)
    assert x16.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(scale), [1.0, 1e5 / 256, 2e-3 / 256], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(x16, np.float32) * np.asarray(scale)[:, None], np.asarray(x), rtol=1e-3)


def test_several_bf16_weights_in_the_model_layout():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.bfloat16)
    weights = tuple(jnp.asarray(rng.standard_normal((128, n)), jnp.bfloat16) for n in (64, 192))
    outs = wgmma_matmul_many(x, weights, weight_layout="kn", block_k=64, interpret=True)
    for out, w in zip(outs, weights, strict=True):
        ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")
        assert _rel(out, ref) < BF16_ROUNDING


@pytest.mark.parametrize("m", [8, 64])
@pytest.mark.parametrize("fmt", ["fp8", "fp8-fused", "fp8-weight-only", "bf16"])
def test_lowers_for_hopper_at_the_llama_shapes_from_cpu(fmt, m):
    """Mosaic GPU's lowering (layout inference, wgmma operand and swizzle checks, and the shared
    memory against sm_90's 227 KB) of the engine's merged q/k/v and the down projection at the
    default sizes, at 8 tokens (the batch-1 bucket) and 64 (the most the engine sends: 64 tokens
    of f16 x take 32 KB a step, which six steps overflowed on the H200)."""
    spec = jax.ShapeDtypeStruct
    for ns, k in (((4096, 1024, 1024), 4096), ((4096,), 14336)):
        activations = None
        if fmt == "fp8":
            args = (spec((m, k), FP8), tuple(spec((n, k), FP8) for n in ns), tuple(spec((n,), jnp.float32) for n in ns))
            options = dict(x_scale=spec((m,), jnp.float32), out_dtype=jnp.bfloat16)
            dtype = FP8
        elif fmt == "fp8-fused":  # x rounded to e4m3 in registers, stored for the MMA at a 64-byte swizzle
            args = (spec((m, k), jnp.bfloat16), tuple(spec((n, k), FP8) for n in ns),
                    tuple(spec((n,), jnp.float32) for n in ns))
            activations = "e4m3-fused"
            options = dict(activations=activations, out_dtype=jnp.bfloat16)
            dtype = FP8
        elif fmt == "fp8-weight-only":  # the widened tile is the MMA's A operand in registers (not staged)
            args = (spec((m, k), jnp.bfloat16), tuple(spec((n, k), FP8) for n in ns),
                    tuple(spec((n,), jnp.float32) for n in ns))
            activations = "f16"
            options = dict(activations=activations, out_dtype=jnp.bfloat16)
            dtype = FP8
        else:
            args = (spec((m, k), jnp.bfloat16), tuple(spec((k, n), jnp.bfloat16) for n in ns))
            options, dtype = dict(weight_layout="kn"), jnp.bfloat16
        sizes = default_sizes(m, sum(ns), k, dtype, activations=activations)
        lowered = wgmma_matmul_many.trace(*args, **options, **sizes).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


def test_default_sizes_keep_k_whole_where_n_fills_the_gpu():
    assert default_sizes(8, 6144, 4096, FP8) == dict(block_n=64, block_k=256, k_splits=1, max_concurrent_steps=6)
    assert default_sizes(8, 4096, 14336, jnp.bfloat16)["block_k"] == 128
    small = default_sizes(8, 1024, 4096, FP8)  # k or v alone: 16 row blocks, K split
    assert small["k_splits"] > 1 and (1024 // 64) * small["k_splits"] <= 132


def test_default_sizes_fit_the_pipeline_in_shared_memory():
    assert default_sizes(64, 4096, 4096, FP8)["max_concurrent_steps"] == 6  # e4m3 x: 16 + 16 KB a step
    wide = default_sizes(64, 4096, 4096, FP8, activations="f16")  # f16 x: 16 + 32 KB a step
    assert wide["max_concurrent_steps"] == 4
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        wgmma_matmul(jnp.zeros((64, 256), jnp.bfloat16), jnp.zeros((64, 256), FP8), jnp.ones((64,)),
                     activations="f16", block_k=256, max_concurrent_steps=6, interpret=True)


@pytest.mark.parametrize("change, message", [
    (dict(x=jnp.zeros((65, 128), jnp.bfloat16)), "1 to 64 rows"),
    (dict(w=jnp.zeros((96, 128), FP8), w_scale=jnp.ones((96,))), r"N \(96\) must be a multiple of block_n"),
    (dict(w=jnp.zeros((64, 96), FP8)), "K"),
    (dict(w_scale=jnp.ones((32,))), r"w_scales\[0\] must be \[64\]"),
    (dict(w=jnp.zeros((64, 128), jnp.float16)), "float8_e4m3fn or int8"),
    (dict(x=jnp.zeros((2, 128), FP8)), "x_scale must be"),
    (dict(x_scale=jnp.float32(1.0)), "x_scale goes with float8_e4m3fn x"),
    (dict(activations="bf16"), "activations must be one of"),
    (dict(activations="e4m3-fused", block_k=128), "multiple of 256"),
    (dict(activations="e4m3-fused", x=jnp.zeros((2, 128), FP8), x_scale=jnp.float32(1.0)), "x_scale goes with"),
    (dict(w=jnp.zeros((64, 128), jnp.int8), activations="e4m3"), r"activations must be one of \('f16',\)"),
])
def test_bad_inputs_raise_naming_the_field(change, message):
    args = dict(x=jnp.zeros((2, 128), jnp.bfloat16), w=jnp.zeros((64, 128), FP8), w_scale=jnp.ones((64,)))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        wgmma_matmul(args.pop("x"), args.pop("w"), args.pop("w_scale"), interpret=True, **args)


def test_fp8_weights_refuse_the_transposed_layout():
    with pytest.raises(ValueError, match="K-major"):
        wgmma_matmul(jnp.zeros((2, 128), jnp.bfloat16), jnp.zeros((128, 64), FP8), jnp.ones((64,)),
                     weight_layout="kn", interpret=True)


def test_the_weight_layer_runs_it_only_when_chosen_on_one_gpu(monkeypatch):
    from jaxinfer.decode_gemv import DECODE_MATMUL_ENV, use_wgmma_matmul

    monkeypatch.delenv(DECODE_MATMUL_ENV, raising=False)
    assert not use_wgmma_matmul(8, 4096, 4096, FP8, platform="gpu", num_devices=1)
    assert use_wgmma_matmul(8, 4096, 4096, FP8, platform="gpu", num_devices=1, choice="wgmma")
    assert not use_wgmma_matmul(8, 4096, 4096, FP8, platform="cpu", num_devices=1, choice="wgmma")
    assert not use_wgmma_matmul(8, 4096, 4096, FP8, platform="gpu", num_devices=2, choice="wgmma")
    assert not use_wgmma_matmul(128, 4096, 4096, FP8, platform="gpu", num_devices=1, choice="wgmma")
    assert not use_wgmma_matmul(8, 4096, 4096, jnp.int8, platform="gpu", num_devices=1, choice="wgmma")
    assert use_wgmma_matmul(8, 4096, 4096, FP8, platform="gpu", num_devices=1, choice="wgmma-fused")
    # 32 tokens and K = 4224: 128-value steps, short of the fused rounding's 256: XLA's path, not an error
    assert use_wgmma_matmul(32, 4096, 4224, FP8, platform="gpu", num_devices=1, choice="wgmma")
    assert not use_wgmma_matmul(32, 4096, 4224, FP8, platform="gpu", num_devices=1, choice="wgmma-fused")
    monkeypatch.setenv(DECODE_MATMUL_ENV, "wgmma")
    assert not use_wgmma_matmul(8, 4096, 4096, FP8)  # this process's backend is the CPU
    monkeypatch.setenv(DECODE_MATMUL_ENV, "wgmma-fp16")
    with pytest.raises(ValueError, match="JAXINFER_DECODE_MATMUL='wgmma-fp16': expected one of"):
        use_wgmma_matmul(8, 4096, 4096, FP8, platform="gpu", num_devices=1)


@pytest.mark.parametrize("choice", ["wgmma", "wgmma-fused", "wgmma-f16"])
def test_linear_many_sends_fp8_and_bf16_projections_of_one_input_through_one_launch(monkeypatch, choice):
    """What the engine's step runs with the kernel chosen: q/k/v of a tiny layer, fp8 (the one
    launch; W8A8 or weight-only) against XLA's weight-only path, and dense bf16 against XLA's
    einsum (equal)."""
    import jaxinfer.decode_gemv as decode_gemv
    import jaxinfer.linear as linear
    from jaxinfer.quantization import quantize

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((1, 3, 256)), jnp.bfloat16)
    dense = [jnp.asarray(rng.standard_normal((256, h, 64)) / 16, jnp.bfloat16) for h in (2, 1, 1)]
    fp8 = [quantize(jnp.moveaxis(w, 0, -1), "fp8", num_out_axes=2) for w in dense]
    before_fp8 = linear.linear_many("ste,ehd->sthd", x, fp8)
    before_dense = linear.linear_many("ste,ehd->sthd", x, dense)

    launches = []
    original = gpu_wgmma.wgmma_matmul_many

    def interpreted(*args, **options):
        launches.append(len(args[1]))
        return original(*args, **{**options, "interpret": True})

    monkeypatch.setattr(gpu_wgmma, "wgmma_matmul_many", interpreted)
    monkeypatch.setenv(decode_gemv.DECODE_MATMUL_ENV, choice)
    monkeypatch.setattr(linear, "use_wgmma_matmul", lambda m, n, k, dtype: decode_gemv.use_wgmma_matmul(
        m, n, k, dtype, platform="gpu", num_devices=1))
    after_fp8 = linear.linear_many("ste,ehd->sthd", x, fp8)
    after_dense = linear.linear_many("ste,ehd->sthd", x, dense)
    one_fp8 = linear.linear("ste,ehd->sthd", x, fp8[0])  # one weight: linear's own paths
    one_dense = linear.linear("ste,ehd->sthd", x, dense[0])
    assert launches == [3, 3, 1, 1]
    assert _rel(one_fp8, after_fp8[0]) < BF16_ROUNDING
    np.testing.assert_array_equal(np.asarray(one_dense, np.float32), np.asarray(before_dense[0], np.float32))
    for before, after in zip(before_fp8, after_fp8, strict=True):
        assert after.shape == before.shape and after.dtype == before.dtype
        # W8A8 rounds x to e4m3 (~2^-4 relative); weight-only differs by output rounding.
        assert _rel(after, before) < (BF16_ROUNDING if choice == "wgmma-f16" else 0.1)
    for before, after in zip(before_dense, after_dense, strict=True):
        np.testing.assert_array_equal(np.asarray(after, np.float32), np.asarray(before, np.float32))


@pytest.mark.slow
def test_gpu_benchmark_runs_on_cpu(tmp_path):
    import json

    from tests.test_benchmarks_smoke import run_script

    run_script(["benchmarks/wgmma_gemv.py", "--out", tmp_path, "--smoke", "--ms", "3", "--formats", "fp8"], tmp_path)
    results = json.loads((tmp_path / "wgmma_gemv.json").read_text())
    ours = [row for row in results["rows"] if row["method"].startswith("ours")]
    assert ours and all(row["ok"] for row in ours)
    # The fused mode at its default sizes: 256-value steps for q (K = 256), 512 for down (K = 512),
    # each checked against x rounded by its own step.
    fused = {row["projection"]: row for row in results["rows"] if row["method"].startswith("wgmma-fused")}
    assert set(fused) == {"q", "down"} and all(row["ok"] for row in fused.values())
    assert "x256" in fused["q"]["method"] and "x512" in fused["down"]["method"]
    # The device-time pass ran; a CPU's trace has no GPU kernels, so the tables fall back to host time.
    assert results["device_time_errors"] == ["no GPU kernel events in the trace"]
    assert "µs on the device" not in (tmp_path / "wgmma_gemv.log").read_text()


def test_the_device_timed_sweep_splits_its_trace_at_idle_gaps():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from wgmma_gemv import split_at_gaps

    kernels = [{"ts": 0, "dur": 10}, {"ts": 12, "dur": 5}, {"ts": 30_000, "dur": 8}, {"ts": 30_010, "dur": 1},
               {"ts": 90_000, "dur": 3}]
    assert [[k["ts"] for k in group] for group in split_at_gaps(kernels, 25_000)] == [[0, 12], [30_000, 30_010],
                                                                                       [90_000]]

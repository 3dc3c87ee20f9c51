"""Weight-only fp8 / int8 / bf16 matmul kernel vs the plain-JAX reference, in Pallas interpret mode on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized_matmul import (
    bf16_weight_only_matmul,
    default_block_sizes,
    fp8_weight_only_matmul,
    int8_weight_only_matmul,
    prefer_pallas,
    quantize_per_channel,
    supports_shape,
    weight_only_matmul_reference,
)
from pallas_kernels.quantized_matmul.block_sizes import MatmulBlockSizes, padded_rows

FP8 = jnp.float8_e4m3fn
# N = 3 tiles of 16, K = 3 steps of 32 in each of 2 splits: odd counts of tiles everywhere.
N, K = 48, 192
TILES = dict(block_n=16, block_k=32)


def make_case(m, n=N, k=K, *, dtype=jnp.bfloat16, weight_dtype=FP8, seed=0):
    kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    # Rows of very different magnitude, so a scale applied to the wrong axis (or not at all) shows.
    w_real = jax.random.normal(kw, (n, k)) * jnp.exp(jax.random.normal(ks, (n, 1)))
    w, scale = quantize_per_channel(w_real, weight_dtype)
    return x, w, scale


def assert_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out32))
    # f32: only summation order differs. bf16: one rounding of the output (2^-8 relative) at most.
    rtol = 1e-5 if dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(out32, ref32, rtol=rtol, atol=rtol * np.abs(ref32).max())


# fma serves M <= 8, gemv M <= 16 (test_row_limited_forms_refuse_many_rows checks the refusals).
@pytest.mark.parametrize("m,algorithm", [(1, "fma"), (3, "fma"), (1, "mma"), (3, "mma"), (16, "mma"),
                                         (1, "mma_swapped"), (3, "mma_swapped"), (16, "mma_swapped"),
                                         (1, "gemv"), (3, "gemv"), (16, "gemv")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fp8_kernel_matches_reference(m, algorithm, dtype):
    x, w, scale = make_case(m, dtype=dtype, seed=m)
    out = fp8_weight_only_matmul(x, w, scale, interpret=True, algorithm=algorithm, k_splits=2, **TILES)
    assert_close(out, weight_only_matmul_reference(x, w, scale), dtype)


@pytest.mark.parametrize("algorithm,m", [("fma", 3), ("mma", 3), ("mma_swapped", 16), ("gemv", 1), ("gemv", 5)])
def test_prefetched_tiles_give_the_same_result(algorithm, m):
    x, w, scale = make_case(m, seed=30 + m)
    out = fp8_weight_only_matmul(x, w, scale, interpret=True, algorithm=algorithm, k_splits=2, prefetch=True,
                                 **TILES)
    assert_close(out, weight_only_matmul_reference(x, w, scale), jnp.bfloat16)


@pytest.mark.parametrize("k_splits", [1, 2])
def test_padded_rows_are_neither_read_nor_written(k_splits):
    # M=5 pads to 16 rows in the dot; the outputs are exactly M rows, equal to the reference.
    x, w, scale = make_case(5, seed=7)
    assert padded_rows(5, "mma") == 16
    out = fp8_weight_only_matmul(x, w, scale, interpret=True, algorithm="mma", k_splits=k_splits, **TILES)
    assert out.shape == (5, N)
    assert_close(out, weight_only_matmul_reference(x, w, scale), jnp.bfloat16)


@pytest.mark.parametrize("m,algorithm", [(1, "fma"), (3, "mma"), (16, "mma_swapped"), (2, "gemv")])
def test_int8_kernel_matches_reference(m, algorithm):
    x, w, scale = make_case(m, weight_dtype=jnp.int8, seed=10 + m)
    assert w.dtype == jnp.int8
    out = int8_weight_only_matmul(x, w, scale, interpret=True, algorithm=algorithm, k_splits=2, **TILES)
    assert_close(out, weight_only_matmul_reference(x, w, scale), jnp.bfloat16)


def bf16_case(m, n=N, k=K, *, dtype=jnp.bfloat16, seed=0):
    kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (n, k)) * jnp.exp(jax.random.normal(ks, (n, 1)))).astype(jnp.bfloat16)
    return x, w


@pytest.mark.parametrize("m,algorithm", [(1, "gemv"), (5, "gemv"), (16, "gemv"), (1, "fma"), (3, "mma"),
                                         (16, "mma_swapped")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_bf16_weights_match_reference(m, algorithm, dtype):
    # Unquantized bf16 weights: the same kernel with no scale input; the reference with scale 1.
    x, w = bf16_case(m, dtype=dtype, seed=40 + m)
    out = bf16_weight_only_matmul(x, w, interpret=True, algorithm=algorithm, k_splits=2, prefetch=m == 5, **TILES)
    assert_close(out, weight_only_matmul_reference(x, w, jnp.ones((N,), jnp.float32)), dtype)


@pytest.mark.parametrize("m,algorithm", [(1, "gemv"), (5, "gemv"), (1, "fma"), (3, "mma"), (16, "mma_swapped")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_bf16_weights_in_the_dense_layout_match_reference(m, algorithm, dtype):
    # layout="kn": w [K, N] as the model's einsum weights are stored, the result x @ w.
    x, w = bf16_case(m, dtype=dtype, seed=60 + m)  # w [N, K]; its transpose is the dense weight
    w_kn = jnp.asarray(np.asarray(w, np.float32).T, jnp.bfloat16)  # [K, N], a real copy, contiguous along N
    out = bf16_weight_only_matmul(x, w_kn, interpret=True, layout="kn", algorithm=algorithm, k_splits=2,
                                  prefetch=2 if m == 5 else 0, **TILES)
    assert_close(out, weight_only_matmul_reference(x, w, jnp.ones((N,), jnp.float32)), dtype)


@pytest.mark.parametrize("m", [1, 8])
def test_dense_layout_default_sizes_run_and_match(m):
    xb, wb = bf16_case(m, n=256, k=512, seed=70 + m)
    w_kn = jnp.asarray(np.asarray(wb, np.float32).T, jnp.bfloat16)
    sizes = default_block_sizes(m, 256, 512, jnp.bfloat16, table=(), layout="kn")
    assert sizes.block_n >= 64  # whole 128-byte lines per tile row
    out = bf16_weight_only_matmul(xb, w_kn, interpret=True, layout="kn")
    assert_close(out, weight_only_matmul_reference(xb, wb, jnp.ones((256,), jnp.float32)), jnp.bfloat16)


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("algorithm,m", [("gemv", 3), ("mma_swapped", 8)])
def test_deeper_prefetch_gives_the_same_result(depth, algorithm, m):
    # depth tiles loaded ahead: K has 3 steps per split, so depth 3 also clamps its look-ahead.
    x, w, scale = make_case(m, seed=80 + m)
    out = fp8_weight_only_matmul(x, w, scale, interpret=True, algorithm=algorithm, k_splits=2, prefetch=depth,
                                 **TILES)
    assert_close(out, weight_only_matmul_reference(x, w, scale), jnp.bfloat16)


@pytest.mark.parametrize("algorithm,m", [("mma", 3), ("mma_swapped", 16)])
@pytest.mark.parametrize("weight_dtype", [FP8, jnp.int8], ids=["fp8", "int8"])
def test_f16_dot_matches_reference(algorithm, m, weight_dtype):
    # fp8 and int8 are exact in f16; bf16 x is too (f16 has more mantissa bits, and these
    # values are far inside its range), so only the f32 accumulation order differs.
    x, w, scale = make_case(m, seed=90 + m, weight_dtype=weight_dtype)
    fn = fp8_weight_only_matmul if weight_dtype == FP8 else int8_weight_only_matmul
    out = fn(x, w, scale, interpret=True, algorithm=algorithm, k_splits=2, dot_dtype="float16", **TILES)
    assert_close(out, weight_only_matmul_reference(x, w, scale), jnp.bfloat16)


def test_f16_dot_saturates_instead_of_overflowing():
    x, w, scale = make_case(2, seed=7)
    x = x.at[0, 0].set(1e6)  # past f16's 65504
    out = fp8_weight_only_matmul(x, w, scale, interpret=True, algorithm="mma", dot_dtype="float16", **TILES)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


def test_f16_dot_refuses_what_it_cannot_serve_and_measured_defaults_step_aside(monkeypatch):
    x, w, scale = make_case(2, dtype=jnp.float32)
    with pytest.raises(ValueError, match="needs bfloat16 x"):
        fp8_weight_only_matmul(x, w, scale, interpret=True, algorithm="mma", dot_dtype="float16", **TILES)
    with pytest.raises(ValueError, match="tensor-core forms"):
        fp8_weight_only_matmul(x.astype(jnp.bfloat16), w, scale, interpret=True, algorithm="gemv",
                               dot_dtype="float16", **TILES)
    # A table entry measured with bf16 x and dot_dtype f16, used by an f32 caller: the f32 dot.
    from pallas_kernels.quantized_matmul import gpu

    f16_sizes = MatmulBlockSizes("mma", 16, 32, 2, 4, 4, 0, "float16")
    monkeypatch.setattr(gpu, "default_block_sizes", lambda *args, **kwargs: f16_sizes)
    out = gpu._weight_only_matmul(x, w, scale, FP8, interpret=True, algorithm=None, block_n=None, block_k=None,
                                  k_splits=None, num_warps=None, num_stages=None, prefetch=None)
    assert_close(out, weight_only_matmul_reference(x, w, scale), jnp.float32)


def test_dense_layout_bad_input_names_the_field():
    xb, wb = bf16_case(2)  # wb [N=48, K=192]: the wrong orientation for layout "kn"
    with pytest.raises(ValueError, match="w's K \\(48\\) must equal x's K \\(192\\)"):
        bf16_weight_only_matmul(xb, wb, interpret=True, layout="kn")
    with pytest.raises(ValueError, match="layout must be one of"):
        bf16_weight_only_matmul(xb, wb, interpret=True, layout="nkk")
    with pytest.raises(ValueError, match="prefetch .* must be in \\[0, 3\\]"):
        bf16_weight_only_matmul(xb, wb, interpret=True, prefetch=4)


@pytest.mark.parametrize("m", [1, 2, 3, 16, 64])
def test_default_sizes_run_and_match(m):
    x, w, scale = make_case(m, n=64, k=512, seed=20 + m)
    out = fp8_weight_only_matmul(x, w, scale, interpret=True)
    assert_close(out, weight_only_matmul_reference(x, w, scale), jnp.bfloat16)
    xb, wb = bf16_case(m, n=64, k=512, seed=50 + m)
    out = bf16_weight_only_matmul(xb, wb, interpret=True)
    assert_close(out, weight_only_matmul_reference(xb, wb, jnp.ones((64,), jnp.float32)), jnp.bfloat16)


def test_reference_dequantizes_per_output_channel():
    w = jnp.array([[1.0, 2.0], [3.0, -4.0]], FP8)
    scale = jnp.array([0.5, 2.0], jnp.float32)
    x = jnp.array([[1.0, 1.0]], jnp.float32)
    # row n of the output is x . (w[n] * scale[n])
    np.testing.assert_array_equal(np.asarray(weight_only_matmul_reference(x, w, scale)), [[1.5, -2.0]])


def test_quantize_per_channel_round_trips():
    w = jax.random.normal(jax.random.key(3), (8, 64)).at[2].set(0.0)
    for dtype, max_rel in ((FP8, 2**-4), (jnp.int8, 1 / 127)):
        q, scale = quantize_per_channel(w, dtype)
        assert q.dtype == dtype and scale.shape == (8,) and scale.dtype == jnp.float32
        back = q.astype(jnp.float32) * scale[:, None]
        row_max = jnp.max(jnp.abs(w), axis=1, keepdims=True)
        # error per element within half a step of the format at the row's max
        assert float(jnp.max(jnp.abs(back - w) / jnp.maximum(row_max, 1e-30))) <= max_rel
        assert float(scale[2]) == 1.0 and not np.any(np.asarray(q[2], np.float32))


@pytest.mark.parametrize("weight_dtype", [FP8, jnp.bfloat16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("m", [1, 4, 16, 64])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (28672, 4096)])
def test_default_sizes_fill_the_gpu_on_llama_shapes(m, n, k, weight_dtype):
    sizes = default_block_sizes(m, n, k, weight_dtype, table=())  # the heuristics, whatever table is installed
    assert n % sizes.block_n == 0 and k % (sizes.block_k * sizes.k_splits) == 0
    programs = n // sizes.block_n * sizes.k_splits
    steps = k // sizes.k_splits // sizes.block_k
    # A program per SM of an H200 (132), or as many splits as still leave >= 4 K steps each; no
    # split where the output tiles alone cover the SMs (each split costs an XLA step).
    assert programs >= 132 or steps < 8
    assert sizes.k_splits == 1 or n // sizes.block_n < 132
    assert steps >= 4


@pytest.mark.parametrize("bad,message", [
    (dict(x=jnp.zeros((65, 64), jnp.bfloat16)), "1 <= M <= 64"),
    (dict(x=jnp.zeros((2, 64), jnp.float16)), "bfloat16 or float32"),
    (dict(x=jnp.zeros((64,), jnp.bfloat16)), r"x must be \[M, K\]"),
    (dict(w=jnp.zeros((32, 64), jnp.int8)), "w must be float8_e4m3fn"),
    (dict(w=jnp.zeros((64, 32), FP8)), "must equal x's K"),
    (dict(scale=jnp.ones((32, 1), jnp.float32)), r"scale must be \[N\]"),
    (dict(scale=jnp.ones((32,), jnp.bfloat16)), "scale must be float32"),
    (dict(options=dict(block_n=64)), "N=32 must be a multiple of block_n=64"),
    (dict(options=dict(block_k=32, k_splits=4)), "K=64 must be a multiple of block_k \\* k_splits"),
    (dict(options=dict(block_n=24)), "block_n must be a power of two"),
    (dict(options=dict(num_stages=0)), "num_stages must be >= 1"),
    (dict(options=dict(algorithm="mma", block_k=8)), "block_n and block_k must be >= 16"),
    (dict(options=dict(algorithm="wgmma")), "algorithm must be one of"),
])
def test_bad_input_names_the_field(bad, message):
    args = dict(x=jnp.zeros((2, 64), jnp.bfloat16), w=jnp.zeros((32, 64), FP8), scale=jnp.ones((32,), jnp.float32))
    options = bad.pop("options", {})
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        fp8_weight_only_matmul(args["x"], args["w"], args["scale"], interpret=True, **options)


@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (7, 48, 80), (64, 14336, 4096), (3, 1024, 4096)])
def test_supported_shapes_get_working_default_sizes(m, n, k):
    from pallas_kernels.quantized_matmul.validation import check_block_sizes

    assert supports_shape(m, n, k)
    check_block_sizes(default_block_sizes(m, n, k), m, n, k)  # raises if the defaults do not tile the shape


@pytest.mark.parametrize("m,n,k", [(0, 16, 16), (65, 16, 16), (1, 24, 16), (1, 16, 40)])
def test_unsupported_shapes_are_reported_without_raising(m, n, k):
    assert not supports_shape(m, n, k)


@pytest.mark.parametrize("algorithm,m,limit", [("fma", 9, 8), ("gemv", 17, 16)])
def test_row_limited_forms_refuse_many_rows(algorithm, m, limit):
    x, w, scale = make_case(m)
    with pytest.raises(ValueError, match=f"M must be <= {limit}"):
        fp8_weight_only_matmul(x, w, scale, interpret=True, algorithm=algorithm, **TILES)


def test_scale_is_required_for_quantized_weights_only():
    x, w, _ = make_case(2)
    with pytest.raises(ValueError, match="scale is required for float8_e4m3fn"):
        fp8_weight_only_matmul(x, w, None, interpret=True)
    xb, wb = bf16_case(2)
    with pytest.raises(ValueError, match="w must be bfloat16"):
        bf16_weight_only_matmul(xb, w, interpret=True)


def table_entry(m, n, k, weights, ours_us, xla_us, sizes):
    return {"m": m, "n": n, "k": k, "weights": weights, "sizes": sizes, "ours_us": ours_us,
            "xla_method": "xla_w8a16", "xla_us": xla_us}


GEMV_SIZES = dict(algorithm="gemv", block_n=16, block_k=1024, k_splits=1, num_warps=8, num_stages=1, prefetch=True)
MMA_SIZES = dict(algorithm="mma_swapped", block_n=128, block_k=128, k_splits=2, num_warps=8, num_stages=3,
                 prefetch=False)
TABLE = [table_entry(1, 4096, 14336, "float8_e4m3fn", 15.0, 30.0, GEMV_SIZES),
         table_entry(8, 4096, 14336, "float8_e4m3fn", 20.0, 25.0, MMA_SIZES),
         table_entry(16, 4096, 14336, "float8_e4m3fn", 30.0, 25.0, MMA_SIZES)]


def test_measured_table_decides_the_default_sizes():
    # The smallest measured M >= m of the same (N, K, format); elsewhere the heuristics.
    assert default_block_sizes(1, 4096, 14336, FP8, table=TABLE) == MatmulBlockSizes(**GEMV_SIZES)
    assert default_block_sizes(4, 4096, 14336, FP8, table=TABLE) == MatmulBlockSizes(**MMA_SIZES)
    heuristic = default_block_sizes(4, 4096, 14336, FP8, table=())
    assert heuristic != MatmulBlockSizes(**MMA_SIZES)
    assert default_block_sizes(32, 4096, 14336, FP8, table=TABLE) == default_block_sizes(32, 4096, 14336, FP8,
                                                                                          table=())
    assert default_block_sizes(1, 4096, 14336, jnp.bfloat16, table=TABLE) == default_block_sizes(
        1, 4096, 14336, jnp.bfloat16, table=())
    assert default_block_sizes(1, 14336, 4096, FP8, table=TABLE) == default_block_sizes(1, 14336, 4096, FP8,
                                                                                         table=())


def test_prefer_pallas_only_where_measured_faster_on_both_sides():
    assert prefer_pallas(1, 4096, 14336, FP8, table=TABLE)  # 15 vs 30 µs
    assert prefer_pallas(4, 4096, 14336, "float8_e4m3fn", table=TABLE)  # bracketed by M=1 and M=8, both faster
    assert prefer_pallas(8, 4096, 14336, FP8, table=TABLE)
    assert not prefer_pallas(12, 4096, 14336, FP8, table=TABLE)  # M=16 lost (30 vs 25 µs)
    assert not prefer_pallas(16, 4096, 14336, FP8, table=TABLE)
    assert not prefer_pallas(32, 4096, 14336, FP8, table=TABLE)  # above the measured range
    assert not prefer_pallas(1, 4096, 14336, jnp.bfloat16, table=TABLE)  # format not measured
    assert not prefer_pallas(1, 4096, 4096, FP8, table=TABLE)  # shape not measured
    assert not prefer_pallas(1, 4096, 14336, FP8, table=())  # no table: XLA everywhere
    # A tie within the margin is not a win.
    assert not prefer_pallas(1, 4096, 14336, FP8, table=[table_entry(1, 4096, 14336, "float8_e4m3fn", 29.5, 30.0,
                                                                     GEMV_SIZES)])


def test_int8_entry_point_refuses_fp8_weights():
    x, w, scale = make_case(2)
    with pytest.raises(ValueError, match="w must be int8"):
        int8_weight_only_matmul(x, w, scale, interpret=True)


@pytest.mark.parametrize("options", [
    dict(algorithm="fma", block_n=16, block_k=512, k_splits=2),
    dict(algorithm="fma", block_n=16, block_k=512, prefetch=True),
    dict(algorithm="mma", block_n=32, block_k=256),
    dict(algorithm="mma", block_n=32, block_k=256, prefetch=True),
    dict(algorithm="mma_swapped", block_n=64, block_k=128, k_splits=4),
    dict(algorithm="gemv", block_n=32, block_k=1024, num_warps=8, num_stages=1, prefetch=True),
    dict(algorithm="gemv", block_n=16, block_k=512, k_splits=2),
    dict(algorithm="gemv", block_n=16, block_k=1024, num_warps=8, num_stages=1, prefetch=2),
    dict(algorithm="gemv", block_n=128, block_k=64, k_splits=4, num_stages=1, prefetch=1, layout="kn"),
    dict(algorithm="mma", block_n=128, block_k=64, k_splits=4, layout="kn"),
    dict(algorithm="mma_swapped", block_n=64, block_k=128, layout="kn"),
    dict(algorithm="mma", block_n=32, block_k=256, dot_dtype="float16"),
    dict(algorithm="mma_swapped", block_n=64, block_k=256, k_splits=2, dot_dtype="float16"),
])
def test_kernel_lowers_through_triton_from_cpu(options):
    # Lowers Pallas -> Triton IR for an abstract H200: catches primitives the Triton
    # lowering lacks (interpret mode does not), e.g. fp8 casts or the transposed store.
    from jax._src.mesh import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    max_rows = {"fma": 8, "gemv": 16}.get(options["algorithm"], 64)
    formats = ((fp8_weight_only_matmul, FP8), (int8_weight_only_matmul, jnp.int8),
               (bf16_weight_only_matmul, jnp.bfloat16))
    if options.get("layout") == "kn":  # the dense layout is the bf16 weights' only
        formats = formats[2:]
    if options.get("dot_dtype"):  # an f16 dot is for quantized weights only
        formats = formats[:2]
    cases = [(fn, weight_dtype, m) for fn, weight_dtype in formats for m in (1, 3, 8, 16, 64) if m <= max_rows]
    for fn, weight_dtype, m in cases:
        x = jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((4096, 1024) if options.get("layout") == "kn" else (1024, 4096), weight_dtype)
        scale = () if weight_dtype == jnp.bfloat16 else (jax.ShapeDtypeStruct((1024,), jnp.float32),)
        with jax.sharding.use_abstract_mesh(mesh):
            lowered = fn.trace(x, w, *scale, **options).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()


@pytest.mark.slow
def test_benchmark_runs_on_cpu_with_tiny_shapes(tmp_path):
    # benchmarks/fp8_matmul.py end to end in interpret mode (~1-2 min on 2 busy cores): every
    # stage runs and writes its results; the numbers mean nothing.
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import BENCHMARK_CACHE_ENV, REPO

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), **BENCHMARK_CACHE_ENV}
    done = subprocess.run([sys.executable, "benchmarks/fp8_matmul.py", "--out", str(tmp_path), "--shape", "tiny",
                           "--layers", "1", "--ms", "1,3", "--budget-s", "120", "--repeats", "1",
                           "--max-candidates", "3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "fp8_matmul.json").read_text())
    checks = results["correctness"]
    assert checks and all(r.get("rel_error", 1) < 1e-2 for r in checks if r["impl"] == "ours")
    timed = [r for r in results["sweep"] if "us" in r]
    assert {r["method"] for r in timed} >= {"xla_bf16", "xla_w8a16", "xla_w8a8"}
    assert all(r["rel_error_vs_fp8_reference"] < 2e-2 for r in timed if r["method"].startswith("ours"))
    chains = {(r["m"], r["method"]) for r in results["chains"] if "ms" in r}
    assert {(1, "ours best"), (1, "ours int8 best"), (3, "ours best fused"), (3, "xla_w8a8")} <= chains
    assert "| 1 |" in (tmp_path / "fp8_matmul.md").read_text()


@pytest.mark.slow
def test_gemv_benchmark_runs_on_cpu_with_tiny_shapes(tmp_path):
    # benchmarks/gemv_decode.py end to end in interpret mode (~1 min on 2 busy cores): the sweep,
    # the table in tuning_table's format, and the chains; the numbers mean nothing.
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import BENCHMARK_CACHE_ENV, REPO

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), **BENCHMARK_CACHE_ENV}
    done = subprocess.run([sys.executable, "benchmarks/gemv_decode.py", "--out", str(tmp_path), "--shape", "tiny",
                           "--layers", "1", "--ms", "1,8", "--budget-s", "400", "--compile-threads", "2",
                           "--repeats", "1", "--max-candidates", "4"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gemv_decode.json").read_text())
    timed = [r for r in results["sweep"] if "us" in r]
    assert {r["method"] for r in timed} >= {"xla_bf16", "xla_w8a16", "xla_bf16_kn"}
    assert all(r["rel_error"] < 2e-2 for r in timed)
    formats = ("fp8", "bf16", "bf16kn")  # bf16kn: bf16 weights in the dense [K, N] layout
    assert {(r["weights"], r["m"]) for r in timed if "sizes" in r} == {(f, m) for f in formats for m in (1, 8)}
    table = json.loads((tmp_path / "gpu_gemv_table.json").read_text())["entries"]
    assert len(table) == 24  # 4 shapes (gate/up, down, q/o, k/v) x 2 Ms x 3 formats
    assert sorted(e["layout"] for e in table).count("kn") == 8
    # Every fp8 form was probed on every e4m3 code; XLA:CPU flushes f32 denormals, so the f32
    # "bits" forms miss the subnormals here and stay out of the table.
    exactness = results["exactness"]
    assert exactness["gemv_f16 bits"]["inexact_codes"] == [] and exactness["gemv cvt"]["inexact_codes"] == []
    assert exactness["gemv bits"]["inexact_codes"]
    assert not any(e["sizes"]["algorithm"] in ("gemv", "fma") and e["sizes"].get("convert") == "bits" for e in table)
    for entry in table:  # every entry is usable as the kernel's table
        default_block_sizes(entry["m"], entry["n"], entry["k"], entry["weights"], table=table, layout=entry["layout"])
        prefer_pallas(entry["m"], entry["n"], entry["k"], entry["weights"], table=table, layout=entry["layout"])
    chains = {(r["m"], r["method"]) for r in results["chains"] if "ms" in r}
    assert {(1, "ours fp8"), (1, "ours bf16"), (1, "ours bf16kn"), (8, "dispatch fp8"), (8, "dispatch bf16kn"),
            (8, "xla_w8a16"), (8, "xla_bf16_kn")} <= chains

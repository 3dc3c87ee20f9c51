"""fp8 -> float by integer ops (``convert="bits"``) and the half-precision GEMV, in Pallas interpret mode on CPU."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.quantized_matmul import fp8_weight_only_matmul, int8_weight_only_matmul, quantize_per_channel
from pallas_kernels.quantized_matmul import weight_only_matmul_reference
from pallas_kernels.quantized_matmul.block_sizes import GEMV_F16_SPAN, GEMV_F16_X_LIMIT
from pallas_kernels.quantized_matmul.conversion import (
    E4M3_F16_SHIFT, E4M3_F32_SHIFT, e4m3_to_f16_scaled, e4m3_to_f32_scaled,
)
from pallas_kernels.quantized_matmul.exactness import (
    NAN_CODES, every_code_case, inexact_codes, is_subnormal_code,
)

FP8 = jnp.float8_e4m3fn
# N = 5 tiles of 16, K = 2 splits of 3 steps of 16: odd counts of tiles and steps.
N, K = 80, 96
TILES = dict(block_n=16, block_k=16, k_splits=2)
# The new forms (fma keeps one accumulator per row: M <= 8).
NEW_FORMS = {
    "gemv_bits": dict(algorithm="gemv", convert="bits"),
    "fma_bits": dict(algorithm="fma", convert="bits"),
    "gemv_f16": dict(algorithm="gemv_f16", convert="bits"),
    "mma_bits_f16": dict(algorithm="mma", convert="bits", dot_dtype="float16"),
    "mma_swapped_bits_f16": dict(algorithm="mma_swapped", convert="bits", dot_dtype="float16"),
    # Interpret mode runs "bits" for "bits_ptx" (no PTX on a CPU): these check the plumbing; the
    # PTX itself is checked by its lowering below and by the GPU sweep's exactness probe.
    "gemv_f16_ptx": dict(algorithm="gemv_f16", convert="bits_ptx"),
    "mma_swapped_ptx_f16": dict(algorithm="mma_swapped", convert="bits_ptx", dot_dtype="float16"),
}
ALL_CODES = np.arange(256, dtype=np.uint8)
NOT_NAN = np.array([code not in NAN_CODES for code in range(256)])


def convert_in_kernel(convert, codes):
    """``convert`` applied to a [16, 16] tile of e4m3 codes inside a ``pallas_call`` (interpret mode)."""
    w = jnp.asarray(codes.reshape(16, 16).view(ml_dtypes.float8_e4m3fn))
    out_dtype = jax.eval_shape(convert, w).dtype

    def kernel(w_ref, o_ref):
        o_ref[...] = convert(w_ref[...])

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), out_dtype), interpret=True)(w)
    return np.asarray(out).reshape(-1)


@pytest.mark.parametrize("convert,dtype,shift,bits_dtype", [
    (e4m3_to_f16_scaled, np.float16, E4M3_F16_SHIFT, np.uint16),
    (e4m3_to_f32_scaled, np.float32, E4M3_F32_SHIFT, np.uint32),
], ids=["f16", "f32"])
def test_bit_conversion_is_exact_on_every_code(convert, dtype, shift, bits_dtype):
    # ml_dtypes' value of each code times 2**-shift, rounded to the target (exact: every scaled
    # e4m3 value, subnormals included, is an f16 / f32), compared bit for bit (signed zeros too).
    values = ALL_CODES.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** -shift
    expected = values.astype(dtype).view(bits_dtype)
    got = convert_in_kernel(convert, ALL_CODES).view(bits_dtype)
    assert got.dtype == expected.dtype
    mismatched = [hex(c) for c in ALL_CODES[NOT_NAN & (got != expected)]]
    assert not mismatched, f"codes converted wrongly: {mismatched}"


@pytest.mark.parametrize("form", ["gemv_f16", "mma_bits_f16", "mma_swapped_bits_f16", "cvt_gemv", "cvt_mma_f16"])
def test_f16_forms_reproduce_every_code_exactly(form):
    # f16 subnormals (where the e4m3 ones land) survive XLA:CPU's arithmetic and the tensor cores'.
    options = NEW_FORMS.get(form) or {"cvt_gemv": dict(algorithm="gemv"),
                                      "cvt_mma_f16": dict(algorithm="mma", dot_dtype="float16")}[form]
    x, w, scale, expected = every_code_case()
    out = fp8_weight_only_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(scale), interpret=True,
                                 block_n=16, block_k=32, k_splits=2, **options)
    assert inexact_codes(out, expected) == []


@pytest.mark.parametrize("form", ["gemv_bits", "fma_bits"])
def test_f32_bit_forms_lose_only_subnormals_where_denormals_are_flushed(form):
    # e4m3 subnormals become f32 denormals; XLA:CPU flushes those in arithmetic, so in interpret
    # mode they read as zero (on the GPU, benchmarks/gemv_decode.py probes the compiled kernel).
    x, w, scale, expected = every_code_case()
    out = fp8_weight_only_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(scale), interpret=True,
                                 block_n=16, block_k=32, k_splits=2, **NEW_FORMS[form])
    bad = inexact_codes(out, expected)
    assert all(is_subnormal_code(code) for code in bad), f"normal codes wrong: {[hex(c) for c in bad]}"
    got = np.asarray(out, np.float64).reshape(-1)
    assert all(got[code] == 0.0 for code in bad)


def make_case(m, seed, n=N, k=K):
    kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    # Rows of very different magnitude, so a scale (or a power of two) on the wrong axis shows.
    w_real = jax.random.normal(kw, (n, k)) * jnp.exp(jax.random.normal(ks, (n, 1)))
    w, scale = quantize_per_channel(w_real, FP8)
    return x, w, scale


def gemv_f16_tolerance(x, w, scale, ref):
    """The bound ``block_sizes`` documents for gemv_f16, plus the bf16 rounding of the output.

    Per output: scale * ((SPAN + 2) * 2**-11 * sum|w x| + 2**-21 * sum|w| + K * 2**-12), from f16
    rounding of x * 2**-4 (2**-11 relative, 2**-25 absolute below f16's normal range), of each
    product and of each of the span's additions (2**-11 relative each, 2**-25 absolute), and f32
    accumulation (negligible beside them); then 2**-8 of |ref| for the bf16 output.
    """
    x32 = np.abs(np.asarray(x, np.float64))
    w32 = np.abs(np.asarray(w.astype(jnp.float32), np.float64))
    s = np.asarray(scale, np.float64)[None, :]
    k = x32.shape[1]
    bound = s * ((GEMV_F16_SPAN + 2) * 2.0**-11 * (x32 @ w32.T) + 2.0**-21 * w32.sum(1)[None, :] + k * 2.0**-12)
    return bound + 2.0**-8 * np.abs(np.asarray(ref, np.float64))


def assert_matches(out, x, w, scale, form):
    ref = weight_only_matmul_reference(x, w, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out64, ref64 = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out64))
    if form.startswith("gemv_f16"):
        tol = gemv_f16_tolerance(x, w, scale, ref)
    else:
        # f16 / f32 products of exact operands, f32 sums: the bf16 output's rounding at most.
        tol = 2.0**-7 * np.abs(ref64) + 2.0**-7 * np.abs(ref64).max() * 1e-3
    excess = np.abs(out64 - ref64) - tol
    assert np.all(excess <= 0), f"{form}: worst excess over the tolerance {excess.max():.3g}"


# fma keeps one accumulator per row: M <= 8; the others serve M <= 16.
@pytest.mark.parametrize("form,m", [(form, m) for form in sorted(NEW_FORMS) for m in range(1, 17)
                                    if form != "fma_bits" or m <= 8])
def test_new_forms_match_reference_at_every_m(form, m):
    x, w, scale = make_case(m, seed=m)
    out = fp8_weight_only_matmul(x, w, scale, interpret=True, **TILES, **NEW_FORMS[form])
    assert_matches(out, x, w, scale, form)


@pytest.mark.parametrize("form", ["gemv_bits", "gemv_f16", "mma_swapped_bits_f16"])
def test_new_forms_with_prefetch_and_one_split(form):
    x, w, scale = make_case(3, seed=40, n=48, k=192)
    out = fp8_weight_only_matmul(x, w, scale, interpret=True, block_n=16, block_k=32, k_splits=1, prefetch=2,
                                 **NEW_FORMS[form])
    assert_matches(out, x, w, scale, form)


def test_gemv_f16_error_stays_within_its_bound_over_a_wide_range_of_x():
    # Activations from 2**-14 to 2**12 (below f16's normal range after the 2**-4 shift, and large
    # enough that unscaled f16 spans of products would overflow); the error stays inside the bound
    # and is not zero (the form really rounds in f16: a bound that always passed would show nothing).
    m, k = 4, 256
    kx, ke = jax.random.split(jax.random.key(5))
    exponents = jax.random.randint(ke, (m, k), -14, 13).astype(jnp.float32)
    x = (jax.random.normal(kx, (m, k)) * 2.0**exponents).astype(jnp.bfloat16)
    _, w, scale = make_case(1, seed=6, n=N, k=k)
    out = fp8_weight_only_matmul(x, w, scale, interpret=True, block_n=16, block_k=64, **NEW_FORMS["gemv_f16"])
    assert_matches(out, x, w, scale, "gemv_f16")
    exact = fp8_weight_only_matmul(x, w, scale, interpret=True, block_n=16, block_k=64, algorithm="gemv")
    assert np.any(np.asarray(out) != np.asarray(exact))


def test_gemv_f16_saturates_x_instead_of_overflowing():
    # x beyond GEMV_F16_X_LIMIT is clipped to it: the output is finite and equals the clipped x's.
    k = 64
    x = jnp.full((1, k), 3.0e5, jnp.bfloat16)
    w = jnp.full((16, k), 448.0, FP8)
    scale = jnp.ones((16,), jnp.float32)
    out = fp8_weight_only_matmul(x, w, scale, interpret=True, block_n=16, block_k=32, **NEW_FORMS["gemv_f16"])
    x_clipped = jnp.full((1, k), GEMV_F16_X_LIMIT, jnp.float32).astype(jnp.bfloat16)
    ref = np.asarray(weight_only_matmul_reference(x_clipped, w, scale), np.float64)
    got = np.asarray(out, np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ref, rtol=2.0**-7)


@pytest.mark.parametrize("options,field", [
    (dict(algorithm="gemv_f16", convert="cvt"), "convert must be 'bits'"),
    (dict(algorithm="mma", convert="bits"), "dot_dtype must be 'float16'"),
    (dict(algorithm="gemv", convert="fast"), "convert must be one of"),
    (dict(algorithm="gemv", convert="bits_ptx"), "bits_ptx' makes f16 weights"),
], ids=["gemv_f16_needs_bits", "mma_bits_needs_f16", "unknown_convert", "ptx_is_f16_only"])
def test_bad_conversion_options_name_the_field(options, field):
    x, w, scale = make_case(2, seed=1)
    with pytest.raises(ValueError, match=field):
        fp8_weight_only_matmul(x, w, scale, interpret=True, **TILES, **options)


def test_bits_need_fp8_weights_and_gemv_f16_bf16_x():
    x, w, scale = make_case(2, seed=2)
    w8, scale8 = quantize_per_channel(w.astype(jnp.float32) * scale[:, None], jnp.int8)
    with pytest.raises(ValueError, match="weights must be float8_e4m3fn"):
        int8_weight_only_matmul(x, w8, scale8, interpret=True, **TILES, algorithm="gemv", convert="bits")
    with pytest.raises(ValueError, match="needs bfloat16 x"):
        fp8_weight_only_matmul(x.astype(jnp.float32), w, scale, interpret=True, **TILES, **NEW_FORMS["gemv_f16"])
    with pytest.raises(ValueError, match="M must be <= 16"):
        fp8_weight_only_matmul(jnp.zeros((17, K), jnp.bfloat16), w, scale, interpret=True, **TILES,
                               **NEW_FORMS["gemv_f16"])


def test_measured_gemv_f16_default_falls_back_for_an_f32_caller(monkeypatch):
    # A table entry measured for bf16 x (gemv_f16) must not refuse an f32 caller: it keeps the
    # tiles and runs the f32 gemv with the hardware conversion, exactly.
    from pallas_kernels.quantized_matmul import tuning_table

    entry = {"m": 2, "n": N, "k": K, "weights": "float8_e4m3fn", "layout": "nk", "ours_us": 1.0, "xla_us": 2.0,
             "sizes": {"algorithm": "gemv_f16", "block_n": 16, "block_k": 16, "k_splits": 2, "num_warps": 4,
                       "num_stages": 1, "prefetch": 1, "convert": "bits"}}
    monkeypatch.setattr(tuning_table, "_load", functools.cache(lambda path=None: (entry,)))
    x, w, scale = make_case(2, seed=3)
    out = fp8_weight_only_matmul(x.astype(jnp.float32), w, scale, interpret=True)
    ref = weight_only_matmul_reference(x.astype(jnp.float32), w, scale)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("options", [
    dict(algorithm="gemv", block_n=16, block_k=1024, num_stages=1, prefetch=1, convert="bits"),
    dict(algorithm="fma", block_n=16, block_k=512, k_splits=2, convert="bits"),
    dict(algorithm="gemv_f16", block_n=16, block_k=1024, num_stages=1, prefetch=1, convert="bits"),
    dict(algorithm="gemv_f16", block_n=32, block_k=512, num_warps=8, k_splits=2, prefetch=2, convert="bits"),
    dict(algorithm="mma", block_n=64, block_k=256, dot_dtype="float16", convert="bits"),
    dict(algorithm="mma_swapped", block_n=128, block_k=256, num_warps=8, num_stages=3, dot_dtype="float16",
         convert="bits"),
    dict(algorithm="gemv_f16", block_n=16, block_k=1024, num_stages=1, prefetch=1, convert="bits_ptx"),
    dict(algorithm="mma", block_n=64, block_k=256, dot_dtype="float16", convert="bits_ptx"),
], ids=["gemv_bits", "fma_bits", "gemv_f16", "gemv_f16_split_pf2", "mma_bits_f16", "mma_swapped_bits_f16",
        "gemv_f16_ptx", "mma_ptx_f16"])
def test_new_forms_lower_through_triton_from_cpu(options):
    # Pallas -> Triton IR for an abstract H200: the bitcasts, shifts, the f16 span reshape and
    # reduction must all have Triton lowerings (interpret mode does not check that).
    from jax._src.mesh import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    max_rows = {"fma": 8}.get(options["algorithm"], 16)
    for m in (1, 3, 8, 16):
        if m > max_rows:
            continue
        x = jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((1024, 4096), FP8)
        scale = jax.ShapeDtypeStruct((1024,), jnp.float32)
        with jax.sharding.use_abstract_mesh(mesh):
            lowered = fp8_weight_only_matmul.trace(x, w, scale, **options).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        assert "triton" in text
        # The PTX form carries its packed conversion into the kernel; the others have no inline PTX.
        assert ("prmt.b32" in text) == (options["convert"] == "bits_ptx")


def run_ptx(ptx: str, inputs: dict[str, int]) -> dict[str, int]:
    """A tiny interpreter for the b32 PTX the packed conversion uses (prmt, shr, and, or), on Python ints."""
    regs = dict(inputs)

    def value(operand):
        operand = operand.strip()
        return int(operand, 0) if operand[0].isdigit() else regs[operand]

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, operands = line.split(None, 1)
        dst, *srcs = [o.strip() for o in operands.split(",")]
        a, *rest = [value(o) for o in srcs]
        if op == "prmt.b32":
            b, selector = rest
            source = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
            assert all(((selector >> 4 * i) & 0x8) == 0 for i in range(4)), "sign-replicating selectors not modelled"
            regs[dst] = sum(source[(selector >> 4 * i) & 0x7] << 8 * i for i in range(4))
        elif op == "shr.b32":
            regs[dst] = a >> rest[0]
        elif op == "and.b32":
            regs[dst] = a & rest[0]
        elif op == "or.b32":
            regs[dst] = a | rest[0]
        else:
            raise AssertionError(f"unmodelled PTX instruction {op!r}")
    return regs


def test_packed_ptx_conversion_computes_the_bit_conversion_of_four_codes():
    # The inline PTX of convert="bits_ptx" (interpreted here: a CPU has no PTX) turns four codes in
    # one register, element 0 in the low byte, into two f16x2 registers, elements 0 and 1 in the
    # first, each element's low half first: the bits e4m3_to_f16_scaled gives each code.
    from pallas_kernels.quantized_matmul.conversion import _E4M3X4_TO_F16X4_PTX

    expected_bits = convert_in_kernel(e4m3_to_f16_scaled, ALL_CODES).view(np.uint16)
    rng = np.random.default_rng(0)
    groups = np.concatenate([ALL_CODES.reshape(-1, 4), rng.integers(0, 256, (2000, 4), dtype=np.uint8)])
    for codes in groups:
        word = int(codes.astype(np.uint32) @ (1 << 8 * np.arange(4, dtype=np.uint32)))
        regs = run_ptx(_E4M3X4_TO_F16X4_PTX, {"$2": word})
        halves = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
        assert halves == [int(expected_bits[c]) for c in codes], [hex(c) for c in codes]

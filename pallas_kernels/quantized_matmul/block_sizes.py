"""Tile sizes of the weight-only quantized matmul, and the default picked from static shapes.

The kernel is read-bound at every M it serves (M <= 64: at most 128 FLOP per weight
byte, under Hopper's ~200 FLOP/byte balance point), so the sizes exist to keep HBM busy:
at least one program per SM (splitting K when there are fewer output tiles than SMs),
each walking enough K steps for ``num_stages`` loads to be in flight. K is split no more
than that: every split adds an XLA step (sum of the float32 partials, cast) after the
kernel, a launch of a few microseconds against ~13 µs for a 4096 x 14336 fp8 read.

Five ways to multiply a tile (``algorithm``):

* ``"mma"``: ``x [BM, BK] @ w_tile^T`` on the tensor cores (mma.sync), x's rows padded
  to ``BM = max(16, next_power_of_2(M))`` with masked loads;
* ``"mma_swapped"``: ``w_tile @ x^T`` instead, so the weight tile is the left operand
  (``block_n`` >= 64 rows lets Triton use Hopper's wgmma with the converted weights in
  registers) and the padded M is the small dimension;
* ``"fma"``: no tensor cores: each of x's rows multiplies the converted tile element-wise
  into a ``[block_n, block_k]`` float32 accumulator per row, reduced once after the K
  loop (a GEMV; M <= 8 only, one accumulator per row);
* ``"gemv"``: no tensor cores, each row's products reduced over the tile every step into
  a ``[block_n]`` accumulator: registers hold weight tiles, not accumulators, so a program
  keeps 16-64 KB of weights in flight (with ``prefetch``, the next tile loads while this one
  is multiplied). M <= 16 (M multiply-adds per weight: the CUDA cores keep up to ~8-16).
* ``"gemv_f16"``: ``"gemv"`` with half-precision products (fp8 weights, ``convert="bits"``
  only): each weight becomes ``w * 2**-8`` in f16 by bit shifts, x's row ``x * 2**-4`` in f16,
  and the products are summed in f16 over spans of ``GEMV_F16_SPAN`` (every other K of 16
  consecutive ones, so two spans sit side by side in ``f16x2`` registers: packed arithmetic,
  two weights an instruction, and no f16 -> f32 conversion per weight),
  each span's sum then added into the row's f32 accumulator (one conversion per span). f32
  FMAs at M rows are M instructions per weight; at 4.5 TB/s an SM must take ~18 weights a
  clock and issues 128 f32 FMA lanes a clock, so M >= 8 rows of f32 math alone saturate it.
  The error bound and the saturation of x are in ``GEMV_F16_*`` below.

``prefetch`` (0-3) is how many weight tiles a program loads ahead of the arithmetic;
``dot_dtype="float16"`` makes the tensor-core forms convert fp8 with one instruction per two
weights. ``convert`` says how fp8 becomes a float: ``"cvt"``, the hardware conversion
(``cvt.f16x2.e4m3x2``, then ``cvt.f32.f16`` for the f32 forms: ~1.5 instructions per weight on
a pipe issuing ~16 a clock per SM, against ~18 weights per SM per clock at the HBM rate: the
hypothesis for the ~65% ceiling the cvt forms measured), or ``"bits"``, shifts and masks on the
integer pipe (``conversion``; the power of two it leaves folds into the epilogue's scale):
for the f32 forms (``gemv``, ``fma``), for ``gemv_f16`` (required) and for the tensor-core
forms with ``dot_dtype="float16"``; ``"bits_ptx"`` is the f16 one written as inline PTX on
packed registers (four weights an instance, ~1.5 instructions a weight), in case the compiler
does not pack the per-element ``"bits"`` ops itself (same values; interpret mode runs ``"bits"``). Weights stored ``[K, N]`` (``layout="kn"``, the dense bf16 weights) get their own
heuristic: tiles 128 columns wide, K split until the programs fill the GPU.

Run 1 on the H200 (docs/KERNELS.md) measured only the first defaults (fma n16 k512 at M <= 2,
mma n32 k256 above): 41-50% of the HBM read rate. The defaults here are the redesign's
heuristics; where ``benchmarks/gemv_decode.py`` measured the shape, its table
(``tuning_table``) decides instead.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from pallas_kernels.quantized_matmul.tuning_table import measured_block_sizes

ALGORITHMS = ("mma", "mma_swapped", "fma", "gemv", "gemv_f16")
DOT_DTYPES = (None, "float16")
# How fp8 weights become floats: the hardware conversion, integer ops on the bits (module doc), or
# those ops as inline PTX on packed registers (f16 only: gemv_f16 and the f16 tensor-core dot).
CONVERSIONS = ("cvt", "bits", "bits_ptx")
# How the weights are stored: "nk" = [out, in] (the quantized payload), "kn" = [in, out] (the
# dense einsum layout of bf16 weights).
LAYOUTS = ("nk", "kn")
MAX_PREFETCH = 3  # weight tiles a program may load ahead (registers: 3 x 16 KB is already a lot)
MAX_FMA_ROWS = 8
MAX_GEMV_ROWS = 16
# gemv_f16: products summed in f16 before the f32 accumulator (K elements 2 apart, so block_k
# must be a multiple of 2 * GEMV_F16_SPAN).
GEMV_F16_SPAN = 8
# gemv_f16 multiplies x * 2**-GEMV_F16_X_SHIFT (weights are w * 2**-8, |w * 2**-8| <= 1.75):
# x's f16 copy keeps full precision for |x| >= 2**-10, and a span's sum stays finite because
# x is saturated to +-GEMV_F16_X_LIMIT first: each product is <= 1.75 * 2**12 = 7168 (exact in
# f16), 8 of them <= 57344, far enough under f16's 65504 that no rounding of a partial sum
# reaches infinity (a limit of 65504 * 16 / (1.75 * 8) itself did: x rounded up in f16).
# Error per output (derived in docs/KERNELS.md, tested in tests/test_quantized_matmul_bits.py):
# |out - exact| <= scale * ((SPAN + 2) * 2**-11 * sum_k |w_k x_k| + 2**-21 * sum_k |w_k| + K * 2**-12),
# plus the rounding of the output to x's dtype.
GEMV_F16_X_SHIFT = 4
GEMV_F16_X_LIMIT = 2.0 ** 16
assert 1.75 * GEMV_F16_X_LIMIT * 2.0 ** -GEMV_F16_X_SHIFT * GEMV_F16_SPAN <= 60000, "a gemv_f16 span could overflow f16"
MAX_ROWS = 64
# Rows up to which the heuristics pick "gemv": M multiply-adds per weight byte (fp8) on the
# CUDA cores stay under what the SM issues while HBM delivers ~17 weights per SM per clock.
_GEMV_DEFAULT_ROWS = 4
# Weight bytes per tile in the heuristics: 16 KB a step, a second 16 KB prefetched, per program,
# with 2+ programs per SM: ~64 KB in flight per SM, above the ~35 KB that Little's law asks
# of 4.5 TB/s at ~1 us loaded latency over 132 SMs.
_TILE_BYTES = 16384

_GPU_NUM_SMS = 132  # H100 / H200 SXM
_TARGET_PROGRAMS = _GPU_NUM_SMS
_MIN_STEPS_PER_SPLIT = 4  # fewer and the software pipeline never fills
_MAX_SPLITS = 16


@dataclasses.dataclass(frozen=True)
class MatmulBlockSizes:
    algorithm: str  # one of ALGORITHMS
    block_n: int  # output channels per program (weight rows)
    block_k: int  # contraction elements per loop step
    k_splits: int  # programs sharing one output tile's K range; partial sums added after
    num_warps: int = 4
    num_stages: int = 4
    # Weight tiles loaded ahead of this step's arithmetic (registers, prefetch + 1 in flight);
    # tables written before it was a count say true/false, which read as 1/0.
    prefetch: int = 0
    # The tensor-core forms' operand dtype: None = x's. "float16" (fp8 / int8 weights, bf16 x):
    # e4m3 and int8 are exact in f16, and fp8 -> f16 is one cvt per two weights on sm_89+, while
    # fp8 -> bf16 takes more steps after it (a hypothesis for run 2's M-independent 27 µs, to be
    # measured); x is saturated to f16's range (|x| <= 65504) and keeps 3 more mantissa bits than bf16.
    dot_dtype: str | None = None
    # fp8 -> float by the hardware's "cvt", by integer ops on the bits, "bits", or by those as
    # inline PTX, "bits_ptx" (module doc; fp8 weights only). Tables written before the field
    # existed mean "cvt".
    convert: str = "cvt"


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def padded_rows(m: int, algorithm: str) -> int:
    """Rows of x a program holds: ``m`` itself for ``fma``, else a power of two >= 16 (Triton's dot)."""
    if algorithm == "fma":
        return m
    return max(16, next_power_of_2(m))


def num_k_splits(n: int, k: int, block_n: int, block_k: int, target_programs: int = _TARGET_PROGRAMS) -> int:
    """Fewest power-of-two K splits giving ``target_programs``, keeping >= 4 K steps per split."""
    programs = max(1, n // block_n)
    splits = 1
    while (programs * splits < target_programs and splits < _MAX_SPLITS
           and k % (2 * splits * block_k) == 0 and k // (2 * splits * block_k) >= _MIN_STEPS_PER_SPLIT):
        splits *= 2
    return splits


def default_block_sizes(m: int, n: int, k: int, weight_dtype=ml_dtypes.float8_e4m3fn,
                        table=None, layout: str = "nk") -> MatmulBlockSizes:
    """Sizes for ``x [m, k] @ w[n, k]^T`` (or ``x @ w[k, n]`` with ``layout="kn"``) when the caller forces none.

    The measured table's entry for this (N, K, weight format, layout) at the nearest measured
    M >= m when there is one (``tuning_table``; ``table`` replaces it in tests), else the
    heuristics below (see the module doc).
    """
    measured = measured_block_sizes(m, n, k, weight_dtype, table=table, layout=layout)
    if measured is not None:
        return MatmulBlockSizes(**measured)
    itemsize = np.dtype(weight_dtype).itemsize
    prefetch = 0
    if layout == "kn":
        # Rows of the tile are contiguous along N: 128 bf16 columns are two 128-byte lines per
        # row, so loads coalesce; N / 128 programs (32 for 4096) are too few for 132 SMs, so K
        # is split (below) until they fill the GPU. The tensor cores' B operand is K-major
        # already, so M > 4 uses the plain dot with x as the (padded) left operand.
        algorithm, block_n, num_warps = ("gemv", 128, 4) if m <= _GEMV_DEFAULT_ROWS else ("mma", 128, 4)
        num_stages, prefetch = (1, 1) if algorithm == "gemv" else (4, 0)
        block_k = _TILE_BYTES // (block_n * itemsize)
    elif m <= _GEMV_DEFAULT_ROWS:
        # Two 32-row tiles per SM where N allows it (gate/up: 448), else 16 rows (down: 256).
        algorithm, num_warps, num_stages, prefetch = "gemv", 4, 1, 1
        block_n = 32 if n // 32 >= 2 * _GPU_NUM_SMS else 16
        block_k = _TILE_BYTES // (block_n * itemsize)
    else:
        # The weight tile as the dot's left operand: stored [N, K] K-contiguous, the layout the
        # tensor cores' A operand wants, so no fp8 transpose through shared memory; x^T, the
        # small operand, is the padded one. 64 rows amortize each step's x tile (M x block_k
        # bf16 from L2) over 64 weight rows instead of run 1's 32.
        algorithm, block_n, num_warps, num_stages = "mma_swapped", 64, 4, 4
        block_k = _TILE_BYTES // (block_n * itemsize)
    block_k = min(block_k, next_power_of_2(k))
    while block_k > 16 and k % block_k:
        block_k //= 2
    while block_n > 16 and n % block_n:
        block_n //= 2
    return MatmulBlockSizes(
        algorithm=algorithm, block_n=block_n, block_k=block_k,
        k_splits=num_k_splits(n, k, block_n, block_k), num_warps=num_warps, num_stages=num_stages,
        prefetch=prefetch,
    )

"""Tile sizes of the weight-only quantized matmul, and the default picked from static shapes.

The kernel is read-bound at every M it serves (M <= 64: at most 128 FLOP per weight
byte, under Hopper's ~200 FLOP/byte balance point), so the sizes exist to keep HBM busy:
at least one program per SM (splitting K when there are fewer output tiles than SMs),
each walking enough K steps for ``num_stages`` loads to be in flight. K is split no more
than that: every split adds an XLA step (sum of the float32 partials, cast) after the
kernel, a launch of a few microseconds against ~13 µs for a 4096 x 14336 fp8 read.

Three ways to multiply a tile (``algorithm``):

* ``"mma"``: ``x [BM, BK] @ w_tile^T`` on the tensor cores (mma.sync), x's rows padded
  to ``BM = max(16, next_power_of_2(M))`` with masked loads;
* ``"mma_swapped"``: ``w_tile @ x^T`` instead, so the weight tile is the left operand
  (``block_n`` >= 64 rows lets Triton use Hopper's wgmma with the converted weights in
  registers) and the padded M is the small dimension;
* ``"fma"``: no tensor cores: each of x's rows multiplies the converted tile element-wise
  into a ``[block_n, block_k]`` float32 accumulator per row, reduced once after the K
  loop (a GEMV; M <= 8 only, one accumulator per row).

Defaults below are first guesses from the arithmetic above; ``benchmarks/fp8_matmul.py``
sweeps them on the H200 and docs/KERNELS.md records the outcome.
"""

from __future__ import annotations

import dataclasses

ALGORITHMS = ("mma", "mma_swapped", "fma")
MAX_FMA_ROWS = 8
MAX_ROWS = 64

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
    prefetch: bool = False  # load the next weight tile before this step's arithmetic (registers, 2 in flight)


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


def default_block_sizes(m: int, n: int, k: int) -> MatmulBlockSizes:
    """Sizes for ``x [m, k] @ w[n, k]^T`` when the caller forces none (a first guess, see module doc)."""
    if m <= 2:
        algorithm, block_n, block_k = "fma", 16, 512 if m == 1 else 256
    else:
        algorithm, block_n, block_k = "mma", 32, 256
        # Narrower tiles rather than a K split where 32-wide ones leave SMs idle (N=4096: 128
        # tiles), while x's rows are few: every output tile re-reads x (from L2), M rows at a time.
        if m <= 8 and n // block_n < _GPU_NUM_SMS:
            block_n = 16
    block_k = min(block_k, next_power_of_2(k))
    while block_k > 16 and k % block_k:
        block_k //= 2
    while block_n > 16 and n % block_n:
        block_n //= 2
    return MatmulBlockSizes(
        algorithm=algorithm, block_n=block_n, block_k=block_k,
        k_splits=num_k_splits(n, k, block_n, block_k), num_warps=4, num_stages=4,
    )

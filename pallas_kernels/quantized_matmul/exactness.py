"""Every e4m3 code through a compiled form of the kernel, to tell whether it reproduces each value exactly.

The ``convert="bits"`` forms turn e4m3 subnormals into f16 subnormals or f32 denormals
(``conversion``). Whether the arithmetic keeps those depends on how the kernel was compiled
(a compiler that flushes denormals, ``.ftz``, reads them as zero; XLA:CPU, which runs the
interpret mode, flushes f32 denormals), so it is checked on the compiled program: a matmul
whose every output is one weight times one, ``out[0, n] == e4m3(code n)`` exactly.
CPU tests run it in interpret mode; ``benchmarks/gemv_decode.py`` runs it on the GPU for each
form it sweeps and keeps a form out of the table when it is not exact.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

NUM_CODES = 256
# e4m3fn's two NaN codes (0x7f, 0xff); quantized payloads never hold them.
NAN_CODES = (0x7F, 0xFF)


def every_code_case(k: int = 64):
    """``(x [1, k] bf16, w [256, k] e4m3, scale [256] f32, expected [256] f64)``: row n of w holds code n at column 0.

    x is one at column 0 and zero elsewhere (and w's other columns are zero), scales are one,
    so an exact kernel returns ``expected[n] = e4m3(code n)`` (every e4m3 value is a bf16);
    NaN codes are replaced by zero.
    """
    codes = np.arange(NUM_CODES, dtype=np.uint8)
    codes[list(NAN_CODES)] = 0
    w = np.zeros((NUM_CODES, k), np.uint8)
    w[:, 0] = codes
    w = w.view(ml_dtypes.float8_e4m3fn)
    x = np.zeros((1, k), ml_dtypes.bfloat16)
    x[0, 0] = 1
    scale = np.ones((NUM_CODES,), np.float32)
    return x, w, scale, w[:, 0].astype(np.float64)


def inexact_codes(out, expected) -> list[int]:
    """The codes whose output (``out [1, 256]``) differs from their e4m3 value."""
    got = np.asarray(out, np.float64).reshape(-1)
    return [int(code) for code in np.flatnonzero(got != expected)]


def is_subnormal_code(code: int) -> bool:
    """Exponent field zero and a nonzero mantissa: the e4m3 subnormals (+-2**-9 .. +-7 * 2**-9)."""
    return (code & 0x78) == 0 and (code & 0x07) != 0

"""fp8 e4m3 weights to f16 / f32 by integer operations on their bits, off the GPU's conversion pipe.

Why: at the HBM read rate of an H200 (~4.5 TB/s) each of the 132 SMs must consume ~18 fp8
weights a clock. The hardware conversions (``cvt.rn.f16x2.e4m3x2``: half an instruction per
weight; then ``cvt.f32.f16``: one per weight for f32 arithmetic) run on a pipe that issues ~16
a clock per SM, so ~1.5 conversions per weight cap the kernel near 65% of the read rate, which
is what the ``cvt`` forms measured (``docs/KERNELS.md``). Shifts, masks and ors run on the
integer pipe, ~4x wider, and a bit pattern reinterpreted as a float costs nothing.

The trick: e4m3 is sign (1 bit), exponent (4 bits, bias 7), mantissa (3 bits), with
subnormals at exponent 0. Moving the exponent and mantissa bits, unchanged, to the top of a
wider float's exponent and mantissa fields gives a float whose exponent field equals the
e4m3 one: the same number scaled by a fixed power of two (the difference of the biases),
*including* the subnormals, because the wider format's subnormals (exponent field 0) have the
same "no implicit leading 1" meaning:

* f16 (5 exponent bits, bias 15): ``(b & 0x80) << 8 | (b & 0x7f) << 7`` is ``e4m3(b) * 2**-8``.
  e4m3 subnormals become f16 subnormals (>= 2**-17, above f16's 2**-24), which tensor cores
  and the f16 FMA units keep.
* f32 (8 exponent bits, bias 127): ``(b & 0x80) << 24 | (b & 0x7f) << 20`` is
  ``e4m3(b) * 2**-120``. e4m3 subnormals become f32 *denormals*: exact where the arithmetic
  keeps denormals (IEEE, the default of LLVM's NVPTX backend and of XLA's ``xla_gpu_ftz=false``),
  lost where a compiler flushes them (``.ftz``): then every weight with |w| < 2**-6 (in e4m3
  units, below 1/28,000 of its channel's largest) reads as zero. ``benchmarks/gemv_decode.py``
  probes each compiled form on every code to tell which holds on the GPU at hand.

The power of two folds exactly into the per-channel scale in the kernel's epilogue. NaN
codes (0x7f, 0xff) map to finite numbers: quantized payloads never hold NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# e4m3(b) == f16_from_bits(b) * 2**E4M3_F16_SHIFT == f32_from_bits(b) * 2**E4M3_F32_SHIFT.
E4M3_F16_SHIFT = 8
E4M3_F32_SHIFT = 120


def e4m3_bits(w):
    """The raw bytes of an e4m3 array (a reinterpretation, no conversion); uint8 passes through."""
    if jnp.dtype(w.dtype) == jnp.uint8:
        return w
    return lax.bitcast_convert_type(w, jnp.uint8)


def _e4m3_moved_bits(w, uint, float_dtype, sign_shift: int, magnitude_shift: int):
    """e4m3's sign to the wider format's sign bit, its 7 exponent and mantissa bits to the top of
    the wider format's exponent and mantissa fields, reinterpreted as ``float_dtype``."""
    b = e4m3_bits(w).astype(uint)
    bits = ((b & 0x80) << sign_shift) | ((b & 0x7F) << magnitude_shift)
    return lax.bitcast_convert_type(bits, float_dtype)


def e4m3_to_f16_scaled(w):
    """``w.astype(f16) * 2**-8``, exactly, by shifting bits: ``w`` float8_e4m3fn (or its uint8 bytes).

    The f16 exponent field gets the e4m3 one (bias 15 vs 7: a factor 2**-8), its top three
    mantissa bits the e4m3 mantissa.
    """
    return _e4m3_moved_bits(w, jnp.uint16, jnp.float16, sign_shift=8, magnitude_shift=7)


def e4m3_to_f32_scaled(w):
    """``w.astype(f32) * 2**-120``, exactly (e4m3 subnormals as f32 denormals), by shifting bits.

    The f32 exponent field gets the e4m3 one (bias 127 vs 7: a factor 2**-120), its top three
    mantissa bits the e4m3 mantissa.
    """
    return _e4m3_moved_bits(w, jnp.uint32, jnp.float32, sign_shift=24, magnitude_shift=20)


# e4m3 x4 (one 32-bit register, element 0 in the low byte) -> f16 x4 * 2**-8 (two f16x2
# registers), 1.5 integer instructions a weight: prmt puts bytes 0 and 1 (then 2 and 3) in
# the high byte of each 16-bit lane; there sign is already the f16 sign bit, and the 7
# magnitude bits shifted right by one land on f16's exponent and mantissa top bits, as
# ``e4m3_to_f16_scaled`` does per element.
_E4M3X4_TO_F16X4_PTX = """{
.reg .b32 lo, hi, mlo, mhi;
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
shr.b32 mlo, lo, 1;
shr.b32 mhi, hi, 1;
and.b32 mlo, mlo, 0x3f803f80;
and.b32 mhi, mhi, 0x3f803f80;
and.b32 lo, lo, 0x80008000;
and.b32 hi, hi, 0x80008000;
or.b32 $0, mlo, lo;
or.b32 $1, mhi, hi;
}"""


def e4m3_to_f16_scaled_ptx(w, *, interpret: bool):
    """``e4m3_to_f16_scaled`` as inline PTX over packed registers (four weights an instance), for the GPU.

    Per element the compiler sees the ``"bits"`` form as byte extractions, shifts and masks on
    16-bit values, which it may or may not pack; this states the packed sequence outright. In
    interpret mode (no PTX) it is ``e4m3_to_f16_scaled``, which computes the same bits.
    """
    if interpret:
        return e4m3_to_f16_scaled(w)
    # Imported here: Pallas's Triton backend is only needed where the kernel runs on a GPU.
    import jax
    from jax.experimental.pallas import triton as plgpu

    (out,) = plgpu.elementwise_inline_asm(
        _E4M3X4_TO_F16X4_PTX, args=[e4m3_bits(w)], constraints="=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float16)])
    return out

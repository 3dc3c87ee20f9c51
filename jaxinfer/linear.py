"""The one weight layer: ``linear(subscripts, x, w)`` for a dense or a quantized weight.

Every projection of the model calls :func:`linear` with einsum subscripts written for the
*dense* layout (``"te,ehd->thd"``: x ``[T, E]``, q ``[E, Hq, D]``). A dense weight runs that
einsum. A :class:`~jaxinfer.quantization.QuantizedWeight` (payload ``[out..., in...]``) runs a
2-D ``dot_general`` ``[M, K] x [N, K] -> [M, N]``, both operands contracting on their minor
dimension, and applies the scales to the ``[M, N]`` output: per output channel for the weight,
per token for FP8 activations. Scaling after the dot is exact (a per-row scale commutes with
the contraction) and is the form XLA's GPU compiler rewrites into cuBLASLt's FP8 GEMM.

The path is chosen per step bucket at trace time (``M``, the token count, is static):

- int8 on XLA:CPU with fewer than :data:`CPU_INT8_KERNEL_MAX_TOKENS` tokens: **weight-only
  through a native kernel** (``jaxinfer.cpu_int8_matmul``, an XLA FFI call; projections of one
  input in one call), because XLA:CPU writes a converted payload out in full before its dot,
  which made int8 slower than float32 there. Larger steps (prefill), and any step when no C++
  compiler is found: the XLA path below.
- int8 elsewhere, and FP8 with fewer than :data:`FP8_W8A8_MIN_TOKENS` tokens: **weight-only**. The payload
  is converted to the activations' dtype inside the dot's fusion and the activations stay in
  bf16/f32: a decode step is bound by reading the weights, which are half of bf16's bytes.
- FP8 with at least :data:`FP8_W8A8_MIN_TOKENS` tokens: **W8A8**. The activations are scaled
  to e4m3, the dot runs FP8 x FP8 with float32 accumulation, M padded to a multiple of 16
  (cuBLASLt's FP8 GEMM wants it), writing bfloat16 for a bfloat16 model (float32 otherwise),
  and both scales multiply the output. The activations' scale is
  either *dynamic*, each token row by its own absmax (a row-max reduction over x, then a second
  pass to quantize), or *static*, the weight's ``input_scale`` (``jaxinfer.activation_scales``):
  ``clip(x / s, -448, 448)`` with no reduction, an elementwise op XLA can fuse into x's producer
  (the RMSNorm, the silu-mul: an MLP block compiles to 9 fusions instead of 15 on XLA:CPU,
  ``benchmarks/w8a8_epilogue.py``), and the output multiply is by ``s * w_scale[n]``.
  Projections that share one input (q/k/v, gate/up) go through :func:`linear_many`, which
  quantizes that input once for all of them (with one static scale: the largest of theirs).
- FP8 weight-only, and dense bf16, on one GPU at few tokens: the Pallas GEMV kernels of
  ``pallas_kernels.quantized_matmul`` where the committed measurement table says they beat
  XLA for that shape and M (``jaxinfer.decode_gemv``); XLA's path everywhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxinfer.activation_scales import ActivationObserver
from jaxinfer.cpu_int8_matmul import int8_matmul_cpu, int8_matmul_many_cpu
from jaxinfer.cpu_int8_matmul import is_available as cpu_int8_kernel_is_available
from jaxinfer.decode_gemv import (dense_gemv_shape, dense_pallas_matmul, use_pallas_gemv, use_wgmma_matmul,
                                  wgmma_fp8_activations, wgmma_sizes)
from jaxinfer.quantization import FP8_MAX, QuantizedWeight
from pallas_kernels.precision import matmul_precision

# At and above this many tokens an FP8 weight runs W8A8, below it weight-only. XLA's GEMMs on an
# H200 (16 x the Llama-3.1-8B MLP, /work/shared/BENCHMARKS.md): weight-only 0.90 ms vs W8A8
# 1.23 ms at M=16; 4.10 vs 2.19 ms at M=512. Linear between those points they cross near
# M = 90, and step buckets are powers of two, so 64-token steps stay weight-only. To be refined
# by `benchmarks/fp8_hlo_check.py`'s sweep.
FP8_W8A8_MIN_TOKENS = 128
# Threads of XLA's intra-op pool the native int8 CPU matmul splits a projection over. They claim
# chunks of rows as they become free, so a helper whose core is busy costs little. On the shared
# 2-core machine (load average ~9), batch-1 int8 steps interleaved: 23.7 ms on 2 threads, 36.9 ms
# on 1 (benchmarks/cpu_step_profile.py --variants float32+int8@1,float32+int8@2); at load ~1.4,
# 8.7 vs 12.5 ms. With fixed halves (before), 2 threads had been slower than 1 under load:
# 61.5 vs 47.6 ms.
CPU_INT8_MAX_THREADS = 2
# At and above this many token rows an int8 projection on XLA:CPU takes XLA's convert + float32
# dot instead of the native kernel: the kernel widens each weight group again for every 4 rows
# of x, while XLA converts the payload once and its dot is blocked for many rows. One
# 1536 x 576 projection (load average ~14): 16 rows 0.86 ms native vs 6.5 XLA; 256 rows 16.0
# vs 11.8.
CPU_INT8_KERNEL_MAX_TOKENS = 128
# cuBLASLt's FP8 GEMM needs the row count to be a multiple of 16.
FP8_GEMM_ROW_MULTIPLE = 16
_CONTRACT_MINOR = (((1,), (1,)), ((), ()))


def uses_fp8_w8a8(num_tokens: int) -> bool:
    """Whether an FP8 weight runs W8A8 in a step of ``num_tokens`` token rows (else weight-only);
    ``jaxinfer.compile_options`` compiles those steps' GPU programs without Triton GEMMs."""
    return num_tokens >= FP8_W8A8_MIN_TOKENS


def linear(subscripts: str, x: jax.Array, w, preferred_element_type=None) -> jax.Array:
    """``x`` times the weight ``w`` as the einsum ``subscripts`` (written for the dense layout).

    ``w`` is an array (run at the precision its dtype calls for) or a ``QuantizedWeight``.
    """
    if isinstance(w, QuantizedWeight):
        return quantized_linear(subscripts, x, w, preferred_element_type)
    # The kernel returns bf16: a caller asking for another output type (the lm_head's f32 logits) keeps XLA's dot.
    shape = dense_gemv_shape(subscripts, x, w) if preferred_element_type in (None, jnp.bfloat16) else None
    through_wgmma = _wgmma_many(subscripts, x, [w], preferred_element_type) if shape is not None else None
    if through_wgmma is not None:
        return through_wgmma[0]
    if shape is not None and use_pallas_gemv(*shape, jnp.bfloat16, "kn"):
        return dense_pallas_matmul(subscripts, x, w)
    precision = matmul_precision(jnp.result_type(x, w))
    return jnp.einsum(subscripts, x, w, precision=precision, preferred_element_type=preferred_element_type)


def linear_many(subscripts: str, x: jax.Array, weights, preferred_element_type=None) -> list[jax.Array]:
    """``x`` times each of ``weights`` as the einsum ``subscripts``: projections that share one
    input (q/k/v, gate/up).

    The same as one :func:`linear` per weight, except that an input which runs FP8 W8A8 is
    quantized once for all of them: quantizing is a pass over ``x`` (absmax reduce, scale,
    convert) that would otherwise repeat per weight (XLA may merge the copies, or not). With
    static scales the FP8 weights must all have one (:func:`shared_input_scale`).
    """
    n_in, _ = split_subscripts(subscripts)
    m = math.prod(x.shape[:x.ndim - n_in])
    if len(weights) > 1 and all(isinstance(w, QuantizedWeight) and w.quantization == "int8" for w in weights) \
            and _use_cpu_int8_kernel(m):
        return int8_linear_many_cpu(subscripts, x, weights, preferred_element_type)
    x2 = x.reshape(m, math.prod(x.shape[x.ndim - n_in:]))  # [M, K]
    weights = [observed(x2, w) for w in weights]
    merged = _wgmma_many(subscripts, x, weights, preferred_element_type)
    if merged is not None:
        return merged
    prequantized = None
    fp8 = [w for w in weights if isinstance(w, QuantizedWeight) and w.quantization == "fp8"]
    if fp8 and uses_fp8_w8a8(m):
        prequantized = quantize_activations_fp8(x2, shared_input_scale(fp8))
    return [quantized_linear(subscripts, x, w, preferred_element_type, prequantized)
            if isinstance(w, QuantizedWeight) else linear(subscripts, x, w, preferred_element_type)
            for w in weights]


def shared_input_scale(weights: list[QuantizedWeight]) -> jax.Array | None:
    """The one static activation scale of FP8 weights that read one input: the largest of theirs
    (loaders and calibration already make them equal: ``jaxinfer.activation_scales``); ``None``
    when they are dynamic. A mix of static and dynamic weights is refused."""
    scales = [w.input_scale for w in weights]
    if all(s is None for s in scales):
        return None
    if any(s is None for s in scales):
        raise ValueError("linear_many: FP8 weights that share one input mix static and dynamic activation scales")
    return functools.reduce(jnp.maximum, [jnp.asarray(s, jnp.float32) for s in scales])


def observed(x2: jax.Array, w):
    """``w`` itself, or, when calibration put an :class:`ActivationObserver` in its input_scale,
    ``w`` dynamic after the observer has seen ``x2`` [M, K]."""
    if isinstance(w, QuantizedWeight) and isinstance(w.input_scale, ActivationObserver):
        w.input_scale.observe(x2)
        return dataclasses.replace(w, input_scale=None)
    return w


def int8_linear_many_cpu(subscripts: str, x: jax.Array, weights, preferred_element_type=None) -> list[jax.Array]:
    """:func:`linear_many` over int8 weights on XLA:CPU: one native kernel call for all of them
    (one hand-off to the thread pool, the output rows of all split over its threads together)."""
    n_in, n_out = split_subscripts(subscripts)
    lead_shape, in_shape = x.shape[:x.ndim - n_in], x.shape[x.ndim - n_in:]
    m, k = math.prod(lead_shape), math.prod(in_shape)
    flat = []
    for w in weights:
        if w.num_out_axes != n_out or tuple(w.payload.shape[w.num_out_axes:]) != tuple(in_shape):
            raise ValueError(f"linear_many({subscripts!r}): x {x.shape} does not fit the payload {w.payload.shape}")
        n = math.prod(w.scale.shape)
        flat.append((w.payload.reshape(n, k), w.scale.reshape(n)))
    ys = int8_matmul_many_cpu(x.reshape(m, k), flat, max_threads=CPU_INT8_MAX_THREADS)
    out_dtype = preferred_element_type or x.dtype
    return [y.astype(out_dtype).reshape(lead_shape + tuple(w.scale.shape)) for y, w in zip(ys, weights)]


def split_subscripts(subscripts: str) -> tuple[int, int]:
    """(number of contracted axes, number of output axes of the weight) of a dense projection
    einsum whose contracted axes are x's trailing ones and whose output is x's leading axes then
    the weight's output axes, as every projection of the model is (``"thd,hde->te"``: 2, 1)."""
    inputs, out = subscripts.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    contracted = [c for c in rhs if c in lhs and c not in out]
    weight_out = [c for c in rhs if c not in contracted]
    n_in = len(contracted)
    # The payload is [out..., in...] in the dense weight's axis order, so x's trailing axes must
    # come in that order too.
    if n_in == 0 or lhs[len(lhs) - n_in:] != "".join(contracted) or out != lhs[:len(lhs) - n_in] + "".join(weight_out):
        raise ValueError(f"linear({subscripts!r}) on a quantized weight: the contracted axes must be "
                         "x's trailing axes and the output x's leading axes then the weight's")
    return n_in, len(weight_out)


def quantized_linear(subscripts: str, x: jax.Array, w: QuantizedWeight, preferred_element_type=None,
                     prequantized: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """``linear`` over a quantized weight; ``prequantized``: ``quantize_activations_fp8`` of x
    as [M, K] (:func:`linear_many`), used when the step runs FP8 W8A8. A static ``input_scale``
    is used by W8A8 only; the weight-only paths (few tokens) keep x as it is."""
    n_in, n_out = split_subscripts(subscripts)
    if w.num_out_axes != n_out:
        raise ValueError(f"linear({subscripts!r}): the weight has {w.num_out_axes} output axes, "
                         f"the subscripts {n_out}")
    lead_shape, in_shape = x.shape[:x.ndim - n_in], x.shape[x.ndim - n_in:]
    out_shape = w.scale.shape
    if tuple(w.payload.shape) != tuple(out_shape) + tuple(in_shape):
        raise ValueError(f"linear({subscripts!r}): x {x.shape} does not fit the payload {w.payload.shape}")
    m, k, n = math.prod(lead_shape), math.prod(in_shape), math.prod(out_shape)
    x2 = x.reshape(m, k)  # [M, K]
    w = observed(x2, w)
    if w.input_scale is not None and w.quantization != "fp8":
        raise ValueError(f"linear({subscripts!r}): a static input_scale needs an FP8 weight, not {w.quantization}")
    payload = w.payload.reshape(n, k)  # [N, K]: contiguous axes merged, no copy
    scale = w.scale.reshape(n)  # [N]
    out_dtype = preferred_element_type or x.dtype
    if w.quantization == "fp8" and uses_fp8_w8a8(m):
        if prequantized is None:
            prequantized = quantize_activations_fp8(x2, w.input_scale)
        y = fp8_w8a8_matmul(x2, payload, scale, prequantized, out_dtype)
    elif w.quantization == "fp8" and use_wgmma_matmul(m, n, k, payload.dtype):
        (y,) = _wgmma_fp8(x2, [payload], [scale], w.input_scale, prequantized, out_dtype)
    elif w.quantization == "int8" and _use_cpu_int8_kernel(m):
        y = int8_matmul_cpu(x2, payload, scale, max_threads=CPU_INT8_MAX_THREADS)
    elif w.quantization == "fp8" and use_pallas_gemv(m, n, k, payload.dtype, "nk"):
        from pallas_kernels.quantized_matmul import fp8_weight_only_matmul

        y = fp8_weight_only_matmul(x2, payload, scale)
    else:
        y = weight_only_matmul(x2, payload, scale)
    return y.astype(out_dtype).reshape(lead_shape + tuple(out_shape))


def weight_only_matmul(x: jax.Array, payload: jax.Array, scale: jax.Array) -> jax.Array:
    """x [M, K] (bf16/f32) times the int8/fp8 payload [N, K] converted to x's dtype -> [M, N] float32."""
    precision = matmul_precision(x.dtype)
    y = jax.lax.dot_general(x, payload.astype(x.dtype), _CONTRACT_MINOR, precision=precision,
                            preferred_element_type=jnp.float32)
    return y * scale[None, :]


def quantize_activations_fp8(x: jax.Array, input_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [M, K] in e4m3 and its scale: (xq [M, K] float8_e4m3fn, scale float32).

    ``input_scale`` ``None``: per-token (row) absmax scaling, scale [M]. A static ``input_scale``
    []: ``clip(x / input_scale, -448, 448)``, saturating values past the calibrated range rather
    than letting them overflow to NaN (e4m3fn has no infinity), scale [].
    """
    x32 = x.astype(jnp.float32)
    if input_scale is not None:
        input_scale = jnp.asarray(input_scale, jnp.float32)
        return jnp.clip(x32 / input_scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), input_scale
    scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1) / FP8_MAX, 1e-12)  # [M]
    return (x32 / scale[:, None]).astype(jnp.float8_e4m3fn), scale


def fp8_w8a8_matmul(x: jax.Array, payload: jax.Array, scale: jax.Array,
                    prequantized: tuple[jax.Array, jax.Array] | None = None, out_dtype=jnp.float32) -> jax.Array:
    """W8A8: x [M, K] quantized to e4m3, times the e4m3 payload [N, K] -> [M, N] float32.

    ``prequantized``: ``quantize_activations_fp8(x, ...)`` already made (shared by several
    weights, or with a static scale); default: x quantized per token here. ``out_dtype``: the
    dtype the caller casts the result to. bfloat16 makes the FP8 dot itself write bfloat16
    (cuBLASLt rounds its float32 accumulator once, before the scales, which are applied in float32
    after): the GEMM's output and every fusion that reads it move half the bytes of a float32
    output. (Not float16: an unscaled sum of e4m3 products, up to 448^2 a term, can pass its
    range.) On an H200, fp8 ``throughput-1k``'s prompt-carrying steps spent 27% of their time in
    such fusions; with bf16 outputs the run took 13,644 against 13,301 output tok/s (session 23,
    ``benchmarks/results/session23_h200.md``). The extra rounding is bf16's 2^-9 relative, where
    the e4m3 operands already carry 2^-4.
    """
    m = x.shape[0]
    xq, x_scale = prequantized if prequantized is not None else quantize_activations_fp8(x)
    padded = -m % FP8_GEMM_ROW_MULTIPLE
    if padded:
        xq = jnp.pad(xq, ((0, padded), (0, 0)))
    dot_dtype = jnp.bfloat16 if jnp.dtype(out_dtype) == jnp.bfloat16 else jnp.float32
    y = jax.lax.dot_general(xq, payload, _CONTRACT_MINOR, preferred_element_type=dot_dtype)[:m]
    y = y.astype(jnp.float32)
    if x_scale.ndim == 0:
        return y * (x_scale * scale)[None, :]  # static: one [N] multiplier, s * w_scale
    return y * x_scale[:, None] * scale[None, :]


def _wgmma_many(subscripts: str, x: jax.Array, weights, preferred_element_type):
    """Projections of one input (one weight, or q/k/v, gate/up) through one launch of the TMA +
    wgmma kernel when it runs them all (all FP8, or all dense bf16 in the einsum's form); else None."""
    n_in, _ = split_subscripts(subscripts)
    lead_shape = x.shape[:x.ndim - n_in]
    m, k = math.prod(lead_shape), math.prod(x.shape[x.ndim - n_in:])
    if all(isinstance(w, QuantizedWeight) and w.quantization == "fp8" for w in weights):
        ns = [math.prod(w.scale.shape) for w in weights]
        if not use_wgmma_matmul(m, sum(ns), k, jnp.float8_e4m3fn) or any(n % 64 for n in ns):
            return None
        ys = _wgmma_fp8(x.reshape(m, k), [w.payload.reshape(n, k) for w, n in zip(weights, ns)],
                        [w.scale.reshape(n) for w, n in zip(weights, ns)], shared_input_scale(weights), None,
                        preferred_element_type or x.dtype)
        return [y.reshape(lead_shape + tuple(w.scale.shape)) for y, w in zip(ys, weights)]
    if preferred_element_type in (None, jnp.bfloat16) and all(
            not isinstance(w, QuantizedWeight) and dense_gemv_shape(subscripts, x, w) is not None for w in weights):
        ns = [math.prod(w.shape[n_in:]) for w in weights]
        if not use_wgmma_matmul(m, sum(ns), k, jnp.bfloat16) or any(n % 64 for n in ns):
            return None
        ys = _wgmma_matmul_many(x.reshape(m, k), tuple(w.reshape(k, n) for w, n in zip(weights, ns)),
                                weight_layout="kn", **wgmma_sizes(m, sum(ns), k, jnp.bfloat16))
        return [y.reshape(lead_shape + w.shape[n_in:]) for y, w in zip(ys, weights)]
    return None


def _wgmma_fp8(x2: jax.Array, payloads, scales, input_scale, prequantized, out_dtype) -> list[jax.Array]:
    """FP8 payloads ``[N_i, K]`` of one input ``x2 [M, K]`` in one launch, W8A8 or weight-only as
    chosen (``prequantized``/``input_scale``: as for :func:`fp8_w8a8_matmul`); ``[M, N_i]`` each."""
    m, k = x2.shape
    activations = wgmma_fp8_activations()
    if activations == "e4m3-fused" and (prequantized is not None or input_scale is not None):
        activations = "e4m3"  # x already rounded, or a checkpoint's static input scale: honoured as given
    if activations in ("f16", "e4m3-fused"):  # x as it is: widened tiles, or x rounded in the kernel
        inputs, options = x2, {"activations": activations}
    else:
        inputs, x_scale = prequantized if prequantized is not None else quantize_activations_fp8(x2, input_scale)
        options = {"x_scale": x_scale}
    sizes = wgmma_sizes(m, sum(p.shape[0] for p in payloads), k, jnp.float8_e4m3fn, activations=activations)
    return _wgmma_matmul_many(inputs, tuple(payloads), tuple(scales), out_dtype=out_dtype, **options, **sizes)


def _wgmma_matmul_many(*args, **options):
    # Imported only when chosen: the kernel's module pulls in Pallas's Mosaic GPU backend.
    from pallas_kernels.quantized_matmul.gpu_wgmma import wgmma_matmul_many

    return wgmma_matmul_many(*args, **options)


def _use_cpu_int8_kernel(num_tokens: int) -> bool:
    return (jax.default_backend() == "cpu" and num_tokens < CPU_INT8_KERNEL_MAX_TOKENS
            and cpu_int8_kernel_is_available())

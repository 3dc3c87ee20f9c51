"""When the weight layer hands a decode-sized matmul to the Pallas GEMV kernels instead of XLA.

A decode step multiplies a few token rows by every weight of the model, so on a GPU it is a
read of the weights, and XLA's dots for such shapes leave a third of the HBM rate unused at
one row (issue 21). ``pallas_kernels.quantized_matmul`` has GEMV kernels for fp8 weights
(the quantized payload, stored ``[out, in]``) and for bf16 weights in the dense einsum layout
(``[in, out]``, so the model keeps one copy of its weights). Which is faster is a
measurement, per (M, N, K, format, layout), on the GPU at hand: ``benchmarks/gemv_decode.py``
writes that table; copied to ``pallas_kernels/quantized_matmul/gpu_gemv_table.json`` it is
what :func:`use_pallas_gemv` reads. Unmeasured shapes, other platforms, and anything sharded
over several devices (a ``pallas_call`` does not partition itself) keep XLA's path.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

# The kernels are measured (and the sweep's tables written) at M <= 16; above it XLA's GEMMs
# are near their own ceiling and the kernels' tiles were not tuned.
PALLAS_GEMV_MAX_TOKENS = 16


def use_pallas_gemv(m: int, n: int, k: int, weight_dtype, layout: str, *, platform: str | None = None,
                    num_devices: int | None = None, table=None) -> bool:
    """Whether ``x [m, k]`` times a weight of ``n`` outputs (``weight_dtype``, stored ``layout``) runs our kernel.

    True only on one GPU, for ``m <= PALLAS_GEMV_MAX_TOKENS``, a shape the kernels tile, and
    where the measured table says ours beats XLA at the Ms around ``m``. ``platform``,
    ``num_devices`` and ``table`` default to this process's backend, device count and the
    committed table (tests pass their own).
    """
    platform = platform or jax.default_backend()
    num_devices = jax.device_count() if num_devices is None else num_devices
    if platform != "gpu" or num_devices != 1 or m > PALLAS_GEMV_MAX_TOKENS:
        return False
    # Imported here: the kernels' package pulls in Pallas's Triton backend, which CPU and TPU
    # processes never need.
    from pallas_kernels.quantized_matmul import prefer_pallas, supports_shape

    return supports_shape(m, n, k) and prefer_pallas(m, n, k, weight_dtype, table=table, layout=layout)


# Opt-in, being measured (issue 18/21): ``JAXINFER_DECODE_MATMUL`` runs small GPU steps'
# projections through the TMA + wgmma kernel (``pallas_kernels.quantized_matmul.gpu_wgmma``), dense
# bf16 weights as stored and FP8 weights as W8A8 (``wgmma``: x rounded to e4m3 per token by XLA
# first, or by the static input scale; ``wgmma-fused``: bf16 x rounded inside the kernel, per token
# and K step, so no XLA op precedes it) or weight-only (``wgmma-f16``: x scaled per token into
# f16, each tile widened to f16 in registers). Read when a step is traced; unset: the paths above.
DECODE_MATMUL_ENV = "JAXINFER_DECODE_MATMUL"
# choice -> the kernel's FP8 activations
DECODE_MATMUL_CHOICES = {"wgmma": "e4m3", "wgmma-fused": "e4m3-fused", "wgmma-f16": "f16"}
WGMMA_MAX_TOKENS = 64


def wgmma_choice(choice: str | None = None) -> str:
    """The decode matmul chosen (``choice``, default the environment variable); "" for none.

    An unknown value raises ``ValueError`` naming the variable and the accepted values.
    """
    choice = os.environ.get(DECODE_MATMUL_ENV, "") if choice is None else choice
    if choice and choice not in DECODE_MATMUL_CHOICES:
        raise ValueError(f"{DECODE_MATMUL_ENV}={choice!r}: expected one of {sorted(DECODE_MATMUL_CHOICES)} or unset")
    return choice


def wgmma_fp8_activations(choice: str | None = None) -> str:
    """How the chosen kernel runs FP8 weights: ``"e4m3"`` or ``"e4m3-fused"`` (W8A8, x rounded before
    the kernel or in it) or ``"f16"`` (weight-only)."""
    return DECODE_MATMUL_CHOICES.get(wgmma_choice(choice), "e4m3")


def use_wgmma_matmul(m: int, n: int, k: int, weight_dtype, *, platform: str | None = None,
                     num_devices: int | None = None, choice: str | None = None) -> bool:
    """Whether ``x [m, k]`` times a weight of ``n`` outputs runs the TMA + wgmma kernel.

    Only when chosen (``choice``, default the ``JAXINFER_DECODE_MATMUL`` environment variable:
    ``"wgmma"``, ``"wgmma-fused"`` or ``"wgmma-f16"``), on one GPU, at ``m <= WGMMA_MAX_TOKENS``, for
    fp8 or bf16 weights whose shape the kernel tiles at its default sizes.
    """
    if not wgmma_choice(choice):
        return False
    platform = platform or jax.default_backend()
    num_devices = jax.device_count() if num_devices is None else num_devices
    if platform != "gpu" or num_devices != 1 or m > WGMMA_MAX_TOKENS:
        return False
    if jnp.dtype(weight_dtype) not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.bfloat16)):
        return False
    from pallas_kernels.quantized_matmul.gpu_wgmma import FUSED_BLOCK_K_MULTIPLE, default_sizes

    activations = wgmma_fp8_activations(choice)
    sizes = default_sizes(m, n, k, weight_dtype, activations=activations)
    if activations == "e4m3-fused" and sizes["block_k"] % FUSED_BLOCK_K_MULTIPLE:
        return False  # K too short a multiple for the fused rounding's tiles: XLA's path
    return n % sizes["block_n"] == 0 and k % (sizes["block_k"] * sizes["k_splits"]) == 0


def wgmma_sizes(m: int, n: int, k: int, weight_dtype, *, activations: str | None = None) -> dict:
    """The kernel's tile sizes for this shape and activation mode: its defaults (no measured table yet)."""
    from pallas_kernels.quantized_matmul.gpu_wgmma import default_sizes

    return default_sizes(m, n, k, weight_dtype, activations=activations)


def dense_contraction(subscripts: str) -> int | None:
    """How many leading axes of a dense weight an einsum contracts, when it has the kernel's form, else None.

    The form: x's trailing axes contract with the weight's leading axes in the same order, and
    the output is x's other axes then the weight's (``"te,ef->tf"``: 1; ``"thd,hde->te"``: 2),
    so both reshape to ``[M, K] @ [K, N]`` without a copy.
    """
    inputs, out = subscripts.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    contracted = [c for c in rhs if c in lhs and c not in out]
    n_in = len(contracted)
    if (n_in == 0 or rhs[:n_in] != "".join(contracted) or lhs[len(lhs) - n_in:] != "".join(contracted)
            or out != lhs[:len(lhs) - n_in] + rhs[n_in:]):
        return None
    return n_in


def dense_gemv_shape(subscripts: str, x: jax.Array, w: jax.Array) -> tuple[int, int, int] | None:
    """``(m, n, k)`` of a dense projection the kernel could run (bf16 x and w, the einsum's form), else None."""
    if jnp.dtype(x.dtype) != jnp.bfloat16 or jnp.dtype(w.dtype) != jnp.bfloat16:
        return None
    n_in = dense_contraction(subscripts)
    if n_in is None:
        return None
    k = math.prod(w.shape[:n_in])
    return math.prod(x.shape[:x.ndim - n_in]), math.prod(w.shape[n_in:]), k


def dense_pallas_matmul(subscripts: str, x: jax.Array, w: jax.Array, *, interpret: bool = False) -> jax.Array:
    """The einsum ``subscripts`` of bf16 ``x`` and a dense bf16 weight through the "kn" GEMV kernel, in bf16."""
    from pallas_kernels.quantized_matmul import bf16_weight_only_matmul

    m, n, k = dense_gemv_shape(subscripts, x, w)
    n_in = dense_contraction(subscripts)
    y = bf16_weight_only_matmul(x.reshape(m, k), w.reshape(k, n), layout="kn", interpret=interpret)  # [M, N]
    return y.reshape(x.shape[:x.ndim - n_in] + w.shape[n_in:])

"""Weight-only matmul for few tokens: fp8 e4m3 or int8 weights with per-channel scales, or plain bf16 weights.

``fp8_weight_only_matmul`` / ``int8_weight_only_matmul`` (GPU, Pallas-Triton) and the
plain-JAX ``weight_only_matmul_reference`` share one contract: ``x [M, K]`` bf16/f32,
``w [N, K]`` stored ``[out, in]``, ``scale [N]`` float32, result ``[M, N]`` in ``x.dtype``.
``bf16_weight_only_matmul(x, w)`` is the same kernel for unquantized bf16 weights (no scale).
The kernels serve ``M <= 64``; larger steps belong to XLA's (FP8) GEMM. ``supports_shape(m, n, k)``
tells a dispatcher, without raising, whether a call fits the kernels at their default tiles;
``prefer_pallas(m, n, k, weight_dtype)`` whether the measured table says the kernel beats XLA there.
"""

from pallas_kernels.quantized_matmul.block_sizes import MatmulBlockSizes, default_block_sizes
from pallas_kernels.quantized_matmul.gpu import (
    bf16_weight_only_matmul,
    fp8_weight_only_matmul,
    int8_weight_only_matmul,
)
from pallas_kernels.quantized_matmul.reference import quantize_per_channel, weight_only_matmul_reference
from pallas_kernels.quantized_matmul.tuning_table import prefer_pallas
from pallas_kernels.quantized_matmul.validation import supports_shape

__all__ = [
    "MatmulBlockSizes",
    "bf16_weight_only_matmul",
    "default_block_sizes",
    "fp8_weight_only_matmul",
    "int8_weight_only_matmul",
    "prefer_pallas",
    "quantize_per_channel",
    "supports_shape",
    "weight_only_matmul_reference",
]

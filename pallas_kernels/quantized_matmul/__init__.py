"""Weight-only quantized matmul (fp8 e4m3 or int8 weights, per-channel scales) for few tokens.

``fp8_weight_only_matmul`` / ``int8_weight_only_matmul`` (GPU, Pallas-Triton) and the
plain-JAX ``weight_only_matmul_reference`` share one contract: ``x [M, K]`` bf16/f32,
``w [N, K]`` stored ``[out, in]``, ``scale [N]`` float32, result ``[M, N]`` in ``x.dtype``.
The kernels serve ``M <= 64``; larger steps belong to XLA's (FP8) GEMM. ``supports_shape(m, n, k)``
tells a dispatcher, without raising, whether a call fits the kernels at their default tiles.
"""

from pallas_kernels.quantized_matmul.block_sizes import MatmulBlockSizes, default_block_sizes
from pallas_kernels.quantized_matmul.gpu import fp8_weight_only_matmul, int8_weight_only_matmul
from pallas_kernels.quantized_matmul.reference import quantize_per_channel, weight_only_matmul_reference
from pallas_kernels.quantized_matmul.validation import supports_shape

__all__ = [
    "MatmulBlockSizes",
    "default_block_sizes",
    "fp8_weight_only_matmul",
    "int8_weight_only_matmul",
    "quantize_per_channel",
    "supports_shape",
    "weight_only_matmul_reference",
]

"""The residual add and the RMSNorm after it, in one launch for steps of few tokens.

``add_rms_norm_gpu(x, delta, weight, eps)`` (Pallas-Triton) returns ``(x + delta, rms_norm(x + delta))``;
``add_rms_norm_reference`` is the same in plain JAX, op for op the model's own form, and the contract.
"""

from pallas_kernels.residual_norm.gpu import MAX_GPU_ROWS, add_rms_norm_gpu
from pallas_kernels.residual_norm.reference import add_rms_norm_reference, rms_norm_reference

__all__ = ["MAX_GPU_ROWS", "add_rms_norm_gpu", "add_rms_norm_reference", "rms_norm_reference"]

"""The precision of every matmul in jaxinfer and its kernels, chosen from the operands' dtype.

JAX's default precision lets a float32 matmul round its operands to TF32 on NVIDIA GPUs and
to bfloat16 passes on TPUs. A float32 model then computes something else on each platform:
on an H200, greedy float32 continuations of a small random Llama matched transformers'
(TF32 off) for 11 of 18 prompts at the default and 18 of 18 at ``HIGHEST``. So a float32 dot
asks for ``HIGHEST`` explicitly, in the program itself rather than through a process-wide
``jax.config`` flag, which would also change other programs of the same process.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def matmul_precision(dtype) -> lax.Precision | None:
    """``HIGHEST`` for float32 operands; ``None`` (JAX's default) for bfloat16 and the rest.

    ``None`` rather than ``DEFAULT`` leaves bfloat16 programs exactly as they were, including
    whatever ``jax.default_matmul_precision`` a caller has set around them.
    """
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None

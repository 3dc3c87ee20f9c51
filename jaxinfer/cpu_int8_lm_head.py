"""An int8 lm_head for int8 models on XLA:CPU.

``quantization="int8"`` quantizes the projections only; the lm_head stays in the serving dtype
(the issue's rule for accelerators, where it is a small share of the bytes). On a CPU it is not:
SmolLM2-135M's tied embedding read as the lm_head is 49152 x 576 float32, 113 MB, as many bytes
as all 30 int8 layers together, and a batch-1 decode step reads it once. So on XLA:CPU, where
the native int8 kernel runs (``jaxinfer.cpu_int8_matmul``), an int8 model gets an int8 copy of
its lm_head (per vocabulary row scales, absmax: ``jaxinfer.quantization.quantize``): 28 MB.
A tied embedding stays as it is for the embedding gather (one row a token), so the copy adds
28 MB of memory and removes 85 MB from every step's reads. The logits move by the rounding of
the lm_head (``benchmarks/results/cpu_default_model.md`` has the accuracy measured with it).

Only a model on one device gets it: a sharded one keeps the declared tree (``jaxinfer.params``),
which the sharding rules lay out.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.cpu_int8_matmul import is_available as cpu_int8_kernel_is_available
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.quantization import QuantizedWeight, quantize


def with_int8_lm_head(model: LoadedModel) -> LoadedModel:
    """``model`` with its lm_head quantized to int8 when it is an int8 model on XLA:CPU with the
    native kernel; otherwise ``model`` itself."""
    weights = model.weights
    if (model.config.quantization != "int8" or isinstance(weights.lm_head, QuantizedWeight)
            or jax.default_backend() != "cpu" or not cpu_int8_kernel_is_available()):
        return model
    if weights.lm_head is None:
        lm_head = _quantize_rows(weights.embed)  # the tied embedding is [vocab, embed]: [out, in] already
    else:
        lm_head = _quantize_columns(weights.lm_head)  # declared [embed, vocab]
    return dataclasses.replace(model, weights=dataclasses.replace(weights, lm_head=lm_head))


@jax.jit
def _quantize_rows(w: jax.Array) -> QuantizedWeight:
    return quantize(w, "int8", 1, "absmax")


@jax.jit
def _quantize_columns(w: jax.Array) -> QuantizedWeight:
    return quantize(jnp.transpose(w), "int8", 1, "absmax")

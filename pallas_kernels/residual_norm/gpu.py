"""Residual add + RMSNorm in one Pallas-Triton launch, for GPU steps of few tokens.

Every layer adds its attention output to the residual stream and normalises the sum for the MLP,
then adds the MLP's output and normalises that for the next layer. XLA compiles each add and each
norm into a kernel of its own (the sum has two users, the norm and the next add, and XLA does not
emit both from one fusion): four launches a layer. At batch 1 each reads and writes a few KB and
takes ~1.7 µs (the H200 trace of session 19: 216 µs of a 4.45 ms Llama-3.1-8B step in 126
launches). This kernel writes the sum and its norm from one launch, two a layer. Larger steps keep
XLA's fusions: their time is bytes, which the extra launches do not change.

Arithmetic is the reference's (``reference.add_rms_norm_reference``) op for op: the sum rounded to
its dtype, the mean square of the rounded sum in float32, the normalised row rounded before the
weight multiply. Only the order of the mean's additions differs (a tree, not XLA's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Steps of more tokens than this keep XLA's fusions (``jaxinfer.model.add_rms_norm``): the launch
# this kernel saves is a fixed ~2 µs, nothing against a prefill's norms.
MAX_GPU_ROWS = 32


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _add_rms_norm_kernel(x_ref, delta_ref, weight_ref, total_ref, normed_ref, *, eps: float):
    row = pl.program_id(0)
    hidden = x_ref.shape[-1]
    # Triton's blocks are powers of 2. The lanes past the row read and write its last element again:
    # every load stays in bounds, and a lane's duplicate store writes the value the real lane writes
    # (no masks on the stores, whose masked-off lanes interpret mode would write back as stale data).
    lane = jnp.arange(_next_power_of_2(hidden), dtype=jnp.int32)
    is_lane = lane < hidden
    lane = jnp.minimum(lane, hidden - 1)
    x = plgpu.load(x_ref.at[row, lane]).astype(jnp.float32)
    delta = plgpu.load(delta_ref.at[row, lane]).astype(jnp.float32)
    weight = plgpu.load(weight_ref.at[lane]).astype(jnp.float32)
    total = (x + delta).astype(total_ref.dtype)
    plgpu.store(total_ref.at[row, lane], total)
    total32 = total.astype(jnp.float32)
    mean_square = jnp.sum(jnp.where(is_lane, total32 * total32, 0.0)) / hidden
    normed = (total32 * jax.lax.rsqrt(mean_square + eps)).astype(total_ref.dtype)
    plgpu.store(normed_ref.at[row, lane], (weight * normed.astype(jnp.float32)).astype(normed_ref.dtype))


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm_gpu(x: jax.Array, delta: jax.Array, weight: jax.Array, *, eps: float,
                     interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``(x + delta, rms_norm(x + delta, weight))`` for x, delta [T, E] and weight [E], one launch.

    Dtypes as the reference's: the sum in ``x + delta``'s, the norm in ``weight * sum``'s.
    """
    if x.ndim != 2 or delta.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm_gpu: x and delta [T, E] and weight [E], got {x.shape}, {delta.shape}, "
                         f"{weight.shape}")
    total_dtype = jnp.result_type(x, delta)
    normed_dtype = jnp.result_type(weight, total_dtype)
    whole = lambda a: pl.BlockSpec(a.shape, lambda r: (0,) * a.ndim)  # noqa: E731
    rows, hidden = x.shape
    return pl.pallas_call(
        functools.partial(_add_rms_norm_kernel, eps=eps),
        grid=(rows,),
        in_specs=[whole(x), whole(delta), whole(weight)],
        out_specs=[pl.BlockSpec((rows, hidden), lambda r: (0, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((rows, hidden), total_dtype),
                   jax.ShapeDtypeStruct((rows, hidden), normed_dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=4 if hidden <= 2048 else 8, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(x, delta, weight)

"""Zero a step output's rows from a dynamic row on, in place, writing only those rows (Pallas-Triton).

cuDNN's packed (THD) attention leaves the rows of a step past its last segment unwritten, so the
segments path (``gpu_fresh_prefill.attend_with_fresh_segments``) zeroes the step's padding rows
(``cu_q_lens[-1]`` on) before Triton writes its own rows into the same buffer. XLA has no cheap way
to write a dynamic number of rows: a scatter of the padding rows walks every row of the step (13.6 us
at 4k rows of 32 x 128 bf16 on the H200, 94 us at 32k, measured in session 18), a select reads and
writes them all. Here a program owns a block of rows and columns and exits at once unless the block
reaches the padding, so the launch writes the padding rows' bytes and nothing else.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_ROWS = 32
BLOCK_COLS = 512  # 32 x 512 bf16 = 32 KB a program: 64 registers a thread at 4 warps


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("x",))
def zero_rows_from(x: jax.Array, first_row: jax.Array, *, interpret: bool = False) -> jax.Array:
    """``x`` [T, ...] with rows ``first_row`` .. T - 1 set to 0, in place (``x`` is donated); ``first_row``
    a scalar int32 (>= T: nothing changes). The trailing dimensions are flattened (a bitcast)."""
    num_rows = x.shape[0]
    width = math.prod(x.shape[1:])
    cols = math.gcd(width, BLOCK_COLS)
    flat = x.reshape(num_rows, width)

    def kernel(first_ref, x_ref, out_ref):
        del x_ref  # the same buffer as out_ref
        # Program ids outside the condition: the interpreter (CPU tests) lowers them only here.
        block_row, block_col = pl.program_id(0), pl.program_id(1)
        first = first_ref[0]

        @pl.when((block_row + 1) * BLOCK_ROWS > first)
        def _():
            row = block_row * BLOCK_ROWS + jnp.arange(BLOCK_ROWS, dtype=jnp.int32)
            col = block_col * cols + jnp.arange(cols, dtype=jnp.int32)
            shape = (BLOCK_ROWS, cols)
            is_padding = jnp.broadcast_to(((row >= first) & (row < num_rows))[:, None], shape)
            # Rows past T (the last block) stay out of range, masked: clamped, in the interpreter they
            # would write row T - 1's old value back over its zero.
            row_2d = jnp.broadcast_to(row[:, None], shape)
            col_2d = jnp.broadcast_to(col[None, :], shape)
            plgpu.store(out_ref.at[row_2d, col_2d], jnp.zeros(shape, out_ref.dtype), mask=is_padding)

    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, BLOCK_ROWS), width // cols),
        in_specs=[whole((1,)), whole(flat.shape)],
        out_specs=whole(flat.shape),
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        input_output_aliases={1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="zero_rows_from",
    )(jnp.reshape(first_row, (1,)).astype(jnp.int32), flat)
    return out.reshape(x.shape)

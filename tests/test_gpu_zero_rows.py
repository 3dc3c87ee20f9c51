"""``gpu_zero_rows.zero_rows_from`` in Pallas's interpreter: the rows from a dynamic row on become 0,
the rest keep their values, for row counts that are and are not multiples of the block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention.gpu_zero_rows import BLOCK_ROWS, zero_rows_from


@pytest.mark.parametrize("num_rows,first_row", [(70, 37), (70, 0), (70, 70), (64, BLOCK_ROWS), (5, 3), (70, 1000)])
def test_rows_from_the_first_become_zero_and_the_rest_stay(num_rows, first_row):
    x = jax.random.normal(jax.random.key(num_rows), (num_rows, 3, 64), jnp.float32).astype(jnp.bfloat16) + 2
    want = np.asarray(x, np.float32).copy()
    want[first_row:] = 0
    out = zero_rows_from(jnp.copy(x), jnp.int32(first_row), interpret=True)
    assert out.shape == x.shape and out.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), want)


def test_lowers_for_an_h200_from_a_cpu():
    from jax._src.mesh import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    x = jax.ShapeDtypeStruct((4096, 32, 128), jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(mesh):
        text = zero_rows_from.trace(x, jax.ShapeDtypeStruct((), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "zero_rows_from" in text and "triton" in text
    assert "scatter" not in text  # no XLA op walks the rows

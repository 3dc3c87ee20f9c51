"""The runner's one packed host-to-device buffer per program (runner.pack_host_arrays / unpack_device_arrays)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.runner import pack_host_arrays, unpack_device_arrays


def test_host_arrays_round_trip_through_one_packed_buffer():
    """Every leaf (int32, float32, uint32, bool, a strided view) comes back from the packed buffer
    bit for bit; an 8-byte array is refused."""
    matrix = np.arange(12, dtype=np.int32).reshape(3, 4)
    tree = {"ids": matrix[:, ::2], "temperature": np.array([0.5, -1.25, np.inf], np.float32),
            "seed": np.array([2**32 - 1, 7], np.uint32), "mask": np.array([[True, False], [False, True]]),
            "empty": np.zeros((0, 3), np.int32)}
    packed, packing = pack_host_arrays(tree)
    assert packed.dtype == np.int32 and packed.shape == (6 + 3 + 2 + 4,)
    back = unpack_device_arrays(jnp.asarray(packed), packing)
    for name, array in tree.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape, name
        np.testing.assert_array_equal(np.asarray(back[name]), array)
    with pytest.raises(TypeError, match="4-byte or bool"):
        pack_host_arrays({"x": np.zeros(2, np.int64)})

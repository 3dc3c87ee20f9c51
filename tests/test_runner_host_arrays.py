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


def test_inputs_read_through_the_stable_input_slot_give_the_same_step():
    """With ``stable_input_address`` (a GPU's default) the forward copies its packed inputs into a
    donated slot and reads them there: a prefill and the decode after it (its input the prefill's
    sample, read on the device) give the same tokens and logprobs as reading the inputs directly,
    whatever the slot held before."""
    from jaxinfer.checkpoint import load_model
    from jaxinfer.runner import ModelRunner

    from .conftest import FIXTURES

    model = load_model(FIXTURES / "tiny-llama3", dtype="float32")
    prompt = [5, 17, 3, 250, 9, 41, 7, 120]
    results = []
    for stable in (False, True):
        runner = ModelRunner(model, num_pages=8, page_size=16, max_model_len=64, max_num_seqs=4,
                             max_num_batched_tokens=16, stable_input_address=stable)
        assert (runner.input_slot is not None) == stable
        if stable:  # garbage left by an earlier, larger step must not matter
            runner.input_slot = jnp.full(runner.input_slot.shape, 77, jnp.int32)
        prefill = runner.empty_inputs(16, 4, 4)
        batch = prefill.batch
        batch.token_ids[:8], batch.positions[:8] = prompt, np.arange(8)
        batch.cu_q_lens[1:], batch.kv_lens[0], batch.page_tables[0, 0], batch.logits_indices[0] = 8, 8, 1, 7
        first = runner.execute(prefill)
        decode = runner.empty_inputs(4, 4, 4)
        batch = decode.batch
        decode.prev_rows[0], batch.positions[0] = 0, 8  # the input is the prefill's sample
        batch.cu_q_lens[1:], batch.kv_lens[0], batch.page_tables[0, 0] = 1, 9, 1
        second = runner.execute(decode)
        results.append([np.asarray(x) for x in (first.token_ids, first.logprobs, second.token_ids, second.logprobs)])
    for plain, staged in zip(*results):
        np.testing.assert_array_equal(plain, staged)

"""TPU (Mosaic) ragged paged attention: vs the reference under TPU interpret mode, and lowering for TPU.

The kernel has not run on TPU hardware; these tests are all that checks it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention import ragged_paged_attention_reference, ragged_paged_attention_tpu
from tests.attention_cases import make_case

F32, BF16 = jnp.float32, jnp.bfloat16

# (seqs as (q_len, kv_len) per slot, Hq, Hkv, head_dim, page_size, dtype, pad_tokens, kernel options)
CASES = {
    "decode_gqa4": ([(1, 37), (1, 16), (0, 0), (1, 64)], 8, 2, 64, 16, F32, 0, dict(block_kv=32)),
    "mixed_chunked_gqa8": ([(1, 50), (0, 0), (24, 80), (9, 9)], 8, 1, 128, 16, BF16, 3, {}),
    "prefill_gqa1_page32": ([(40, 40), (32, 64)], 2, 2, 64, 32, F32, 0, dict(block_kv=32)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tpu_kernel_matches_reference_in_interpret_mode(name):
    seqs, hq, hkv, head_dim, page_size, dtype, pad, options = CASES[name]
    case = make_case(hash(name) % 1000, seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                     page_size=page_size, dtype=dtype, pad_tokens=pad)
    ref_out, ref_k, ref_v = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale)
    args = [jnp.array(a) for a in case.args()]  # the kernel donates the cache
    with pltpu.force_tpu_interpret_mode():
        out, k_pages, v_pages = ragged_paged_attention_tpu(*args, sm_scale=case.sm_scale, **options)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    tol = 1e-4 if dtype == F32 else 3e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(k_pages, np.float32), np.asarray(ref_k, np.float32))
    np.testing.assert_array_equal(np.asarray(v_pages, np.float32), np.asarray(ref_v, np.float32))


def test_tpu_kernel_sliding_window_and_soft_cap():
    case = make_case(11, [(1, 70), (20, 45)], num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16)
    options = dict(sliding_window=24, soft_cap=5.0)
    ref_out = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale, **options)[0]
    out = ragged_paged_attention_tpu(*[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale,
                                     block_kv=16, interpret=True, **options)[0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-4, atol=1e-4)


def _abstract_args(dtype=BF16, num_tokens=4, max_num_seqs=4, pages_per_seq=8, num_pages=64, page_size=16):
    sds = jax.ShapeDtypeStruct
    return (sds((num_tokens, 8, 128), dtype), sds((num_tokens, 2, 128), dtype), sds((num_tokens, 2, 128), dtype),
            sds((2, num_pages, page_size, 128), dtype), sds((2, num_pages, page_size, 128), dtype),
            sds((max_num_seqs, pages_per_seq), jnp.int32), sds((max_num_seqs + 1,), jnp.int32),
            sds((max_num_seqs,), jnp.int32))


def test_tpu_kernel_lowers_for_tpu_from_cpu():
    # Runs the Mosaic lowering (Pallas -> Mosaic MLIR) for the TPU platform; no TPU needed.
    lowered = ragged_paged_attention_tpu.trace(*_abstract_args(), sm_scale=0.1, block_kv=128).lower(
        lowering_platforms=("tpu",))
    text = lowered.as_text()
    assert "tpu_custom_call" in text
    assert "tf.aliasing_output = 1" in text and "tf.aliasing_output = 2" in text

"""The CPU attention path (context-bounded chunks, online softmax) against the reference.

Unused cache rows are NaN (``tests.attention_cases.make_case``), so a chunk read past a token's context
that leaked into the output would show.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention import resolve_impl
from tests.attention_cases import make_case
from pallas_kernels.paged_attention.cpu import ragged_paged_attention_cpu
from pallas_kernels.paged_attention.reference import ragged_paged_attention_reference

# (seqs as (q_len, kv_len) per slot, Hq, Hkv, page_size, pad_tokens, options)
CASES = {
    "decode_gqa4_several_chunks": ([(1, 37), (1, 16), (0, 0), (1, 300)], 8, 2, 16, 0, {}),
    "mixed_chunked_with_padding": ([(1, 50), (0, 0), (24, 280), (9, 9)], 4, 1, 32, 5, {}),
    "window_and_soft_cap": ([(1, 200), (20, 45)], 4, 1, 16, 0, dict(sliding_window=24, soft_cap=5.0)),
    "page_larger_than_chunk": ([(3, 300), (1, 1)], 2, 2, 256, 1, {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_path_matches_reference(name):
    seqs, hq, hkv, page_size, pad, options = CASES[name]
    case = make_case(len(name), seqs, num_q_heads=hq, num_kv_heads=hkv, page_size=page_size, pad_tokens=pad)
    ref_out, ref_k, ref_v = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale, **options)
    out, k_pages, v_pages = ragged_paged_attention_cpu(*case.args(), sm_scale=case.sm_scale, **options)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(k_pages), np.asarray(ref_k))
    np.testing.assert_array_equal(np.asarray(v_pages), np.asarray(ref_v))


def test_cpu_path_in_bfloat16():
    case = make_case(3, [(1, 70), (12, 140)], num_q_heads=4, num_kv_heads=2, page_size=32, dtype=jnp.bfloat16)
    ref_out = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale)[0]
    out = ragged_paged_attention_cpu(*case.args(), sm_scale=case.sm_scale)[0]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=2e-2, atol=2e-2)


def test_auto_picks_the_cpu_path_only_on_a_cpu():
    assert resolve_impl("auto", "cpu") == "cpu"
    assert resolve_impl("auto", "gpu", head_dim=64) == "pallas_gpu_fresh_prefill_cudnn_segments"  # Hopper's default, never the fused one
    assert resolve_impl("pallas_gpu_fused") == "pallas_gpu_fused"  # opt-in by name only
    assert resolve_impl("auto", "tpu") == "pallas_tpu"

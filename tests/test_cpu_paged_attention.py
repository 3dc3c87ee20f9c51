"""The native CPU paged attention (``jaxinfer.cpu_paged_attention``) against the reference, and its
dispatch: float32/bf16 pages take it under ``impl="cpu"``, FP8 pages keep the plain-JAX path.

Unused cache rows are NaN (``tests.attention_cases.make_case``), so a read past a token's context
that leaked into the output would show; padding tokens must write nothing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import cpu_native
from jaxinfer.attention import _attend
from jaxinfer.cpu_paged_attention import ragged_paged_attention_native, supports
from pallas_kernels.paged_attention.reference import ragged_paged_attention_reference
from tests.attention_cases import make_case

pytestmark = pytest.mark.skipif(not cpu_native.is_available(), reason=f"native CPU kernels: {cpu_native.unavailable_reason()}")

# (seqs as (q_len, kv_len) per slot, Hq, Hkv, page_size, pad_tokens, head_dim, options)
CASES = {
    "decode_batch1_smollm_heads": ([(1, 41)], 9, 3, 32, 0, 64, {}),
    "decode_gqa4_empty_slot": ([(1, 37), (1, 16), (0, 0), (1, 300)], 8, 2, 16, 0, 64, {}),
    "mixed_chunked_with_padding": ([(1, 50), (0, 0), (24, 280), (9, 9)], 4, 1, 32, 5, 64, {}),
    "window_and_soft_cap": ([(1, 200), (20, 45)], 4, 1, 16, 0, 64, dict(sliding_window=24, soft_cap=5.0)),
    "odd_head_dim_and_page": ([(3, 30), (1, 1)], 6, 2, 5, 1, 20, {}),
    "long_prefill_split_over_threads": ([(300, 300)], 4, 2, 32, 0, 64, {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_matches_reference(name):
    seqs, hq, hkv, page_size, pad, head_dim, options = CASES[name]
    case = make_case(len(name), seqs, num_q_heads=hq, num_kv_heads=hkv, page_size=page_size, pad_tokens=pad,
                     head_dim=head_dim)
    ref_out, ref_k, ref_v = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale, **options)
    native = jax.jit(lambda *a: ragged_paged_attention_native(*a, sm_scale=case.sm_scale, **options))
    out, k_pages, v_pages = native(*case.args())
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-5)
    # NaN rows compare equal to NaN rows: the unused pages must come back untouched.
    np.testing.assert_array_equal(np.asarray(k_pages), np.asarray(ref_k))
    np.testing.assert_array_equal(np.asarray(v_pages), np.asarray(ref_v))


def test_native_in_bfloat16():
    case = make_case(3, [(1, 70), (12, 140)], num_q_heads=4, num_kv_heads=2, page_size=32, dtype=jnp.bfloat16)
    ref_out, ref_k, _ = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale)
    out, k_pages, _ = ragged_paged_attention_native(*case.args(), sm_scale=case.sm_scale)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(np.asarray(k_pages, np.float32), np.asarray(ref_k, np.float32))


def test_dispatch_native_for_float_pages_plain_jax_for_fp8():
    case = make_case(5, [(1, 20)], num_q_heads=4, num_kv_heads=2, page_size=16)
    kwargs = dict(impl="cpu", sm_scale=case.sm_scale, sliding_window=None)
    jaxpr = str(jax.make_jaxpr(lambda *a: _attend(*a, **kwargs))(*case.args()))
    assert "ffi_call" in jaxpr and "while" not in jaxpr
    q, k_new, v_new, k_pages, v_pages, *rest = case.args()
    fp8 = [a.astype(jnp.float8_e4m3fn) for a in (k_new, v_new, k_pages, v_pages)]
    assert not supports(jnp.float8_e4m3fn) and supports(jnp.float32) and supports(jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda *a: _attend(*a, **kwargs))(q, *fp8, *rest))
    assert "ffi_call" not in jaxpr


def test_refuses_pages_it_cannot_read():
    case = make_case(5, [(1, 20)], num_q_heads=4, num_kv_heads=2, page_size=16)
    q, k_new, v_new, k_pages, v_pages, *rest = case.args()
    with pytest.raises(ValueError, match="bfloat16 pages"):
        ragged_paged_attention_native(q, k_new, v_new, k_pages.astype(jnp.float8_e4m3fn),
                                      v_pages.astype(jnp.float8_e4m3fn), *rest, sm_scale=1.0)
    with pytest.raises(ValueError, match="k_new"):
        ragged_paged_attention_native(q, k_new[:, :1], v_new[:, :1], k_pages, v_pages, *rest, sm_scale=1.0)

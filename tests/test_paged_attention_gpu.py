"""GPU (Pallas-Triton) ragged paged attention vs the plain-JAX reference, in interpret mode on CPU.

Two kernels: the default (``ragged_paged_attention_gpu``: XLA scatter, then attention) runs every
case; the opt-in fused-write kernel (``ragged_paged_attention_gpu_fused``) a subset and its own options.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from pallas_kernels.paged_attention import (
    ragged_paged_attention_gpu,
    ragged_paged_attention_gpu_fused,
    ragged_paged_attention_reference,
)
from tests.attention_cases import make_case
from pallas_kernels.paged_attention.work_tiles import plan_work_tiles

F32, BF16 = jnp.float32, jnp.bfloat16

# (seqs as (q_len, kv_len) per slot, Hq, Hkv, head_dim, page_size, dtype, pad_tokens, kernel options)
CASES = {
    "decode": ([(1, 37), (1, 16), (1, 1), (1, 64)], 8, 2, 64, 16, F32, 0, {}),
    "decode_split_small_tiles": ([(1, 150), (0, 0), (1, 64), (1, 3)], 8, 2, 128, 64, BF16, 2,
                                 dict(num_splits=4, block_kv=16)),
    "prefill": ([(40, 40), (16, 16), (7, 7)], 2, 2, 128, 16, BF16, 0, {}),
    "mixed_chunked_empty_slots": ([(1, 50), (0, 0), (24, 80), (1, 33), (0, 0), (9, 9)], 8, 1, 64, 32, F32, 5, {}),
    "page_boundaries": ([(1, 32), (16, 64), (1, 16), (16, 16)], 4, 1, 64, 16, BF16, 0, {}),
    "gqa3_prefill_like": ([(70, 100), (1, 20)], 6, 2, 64, 16, F32, 1, dict(block_kv=32)),
}


def assert_matches_reference(kernel, case, dtype, **options):
    ref_out, ref_k, ref_v = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale, **{
        k: v for k, v in options.items() if k in ("sliding_window", "soft_cap")})
    args = [jnp.array(a) for a in case.args()]  # the kernel donates the cache
    out, k_pages, v_pages = kernel(*args, sm_scale=case.sm_scale, interpret=True, **options)
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert not np.isnan(np.asarray(out, np.float32)).any()
    tol = 1e-4 if dtype == F32 else 3e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=tol, atol=tol)
    # Cache: new rows written exactly, NaN of unused rows untouched.
    np.testing.assert_array_equal(np.asarray(k_pages, np.float32), np.asarray(ref_k, np.float32))
    np.testing.assert_array_equal(np.asarray(v_pages, np.float32), np.asarray(ref_v, np.float32))


@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_kernel_matches_reference(name):
    seqs, hq, hkv, head_dim, page_size, dtype, pad, options = CASES[name]
    case = make_case(hash(name) % 1000, seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                     page_size=page_size, dtype=dtype, pad_tokens=pad)
    assert_matches_reference(ragged_paged_attention_gpu, case, dtype, **options)


@pytest.mark.parametrize("name", ["decode_split_small_tiles", "mixed_chunked_empty_slots", "gqa3_prefill_like"])
def test_fused_gpu_kernel_matches_reference(name):
    seqs, hq, hkv, head_dim, page_size, dtype, pad, options = CASES[name]
    case = make_case(hash(name) % 1000, seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                     page_size=page_size, dtype=dtype, pad_tokens=pad)
    assert_matches_reference(ragged_paged_attention_gpu_fused, case, dtype, **options)


@pytest.mark.parametrize("kernel,num_splits", [(ragged_paged_attention_gpu, 1), (ragged_paged_attention_gpu, 3),
                                               (ragged_paged_attention_gpu_fused, 3)])
def test_gpu_kernel_sliding_window_and_soft_cap(kernel, num_splits):
    # The KV walk has masked edge blocks (causal end, window start) and unmasked ones between;
    # with splits, a split's range can start or end inside either kind.
    case = make_case(7, [(1, 150), (20, 45), (0, 0), (40, 130)], num_q_heads=4, num_kv_heads=1, head_dim=64,
                     page_size=16)
    assert_matches_reference(kernel, case, F32, sliding_window=24, soft_cap=5.0, block_kv=16,
                             num_splits=num_splits)
    assert_matches_reference(kernel, case, F32, sliding_window=70, block_kv=16,
                             num_splits=num_splits)


@pytest.mark.parametrize("prefetch_pages,plan_in_kernel,merge_kernel",
                         [(False, False, False), (True, False, True), (False, True, False),
                          (False, True, True)])  # the last: fused_kernel_mechanisms' split walks
def test_fused_gpu_kernel_options_match_reference(prefetch_pages, plan_in_kernel, merge_kernel):
    # The defaults (all on) run in every other test; other combinations on a mixed batch with
    # splits: chunked prefill over a cached prefix, decode, an empty slot, padding tokens.
    case = make_case(11, [(1, 50), (0, 0), (24, 80), (1, 33)], num_q_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=16, pad_tokens=2)
    assert_matches_reference(ragged_paged_attention_gpu_fused, case, F32, block_kv=16, num_splits=2,
                             prefetch_pages=prefetch_pages, plan_in_kernel=plan_in_kernel,
                             merge_kernel=merge_kernel)


@pytest.mark.parametrize("kernel,num_splits", [(ragged_paged_attention_gpu_fused, 4), (ragged_paged_attention_gpu, 8)])
@pytest.mark.parametrize("live", [1, 3])
def test_kernels_in_the_engines_batch_one_bucket_match_reference(kernel, num_splits, live):
    # The engine's smallest bucket: 8 slots of which 1 or 3 decode (one right after a page boundary),
    # 8 token rows with the rest padding, bf16, block_kv under the page (split ranges start inside
    # pages), the Pallas merge, no page-id prefetch. The fused kernel with the slots' split count
    # (block_sizes.fused_kernel_mechanisms); the default kernel with more splits than 8 slots want,
    # as the one-live-sequence rule gives it (block_sizes._SPLIT_FOR_ONE_LIVE_MAX_SEQS).
    seqs = [(1, 300), (1, 33), (1, 17)][:live] + [(0, 0)] * (8 - live)
    case = make_case(17 + live, seqs, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                     pad_tokens=8 - live, dtype=BF16)
    assert_matches_reference(kernel, case, BF16, block_kv=8, num_splits=num_splits, prefetch_pages=False,
                             merge_kernel=True)


@pytest.mark.parametrize("prefetch_pages,merge_kernel", [(True, False), (False, True), (True, True)])
def test_gpu_kernel_prefetch_and_merge_options_match_reference(prefetch_pages, merge_kernel):
    # The default kernel's page-id prefetch (its unmasked loop, whose last step prefetches past the
    # table's end: clamped) and its Pallas merge, with block_kv 8 under page 16 (two blocks a page)
    # and splits whose ranges start and end inside unmasked runs: decode, a chunk over a cached
    # prefix, an empty slot, padding tokens.
    case = make_case(13, [(1, 50), (0, 0), (24, 80), (1, 33), (1, 128)], num_q_heads=8, num_kv_heads=2,
                     head_dim=64, page_size=16, pad_tokens=2)
    assert_matches_reference(ragged_paged_attention_gpu, case, F32, block_kv=8, num_splits=3,
                             prefetch_pages=prefetch_pages, merge_kernel=merge_kernel)


@pytest.mark.parametrize("kernel,q_dtype,options", [
    (ragged_paged_attention_gpu, F32, {}), (ragged_paged_attention_gpu, BF16, {}),
    (ragged_paged_attention_gpu, BF16, dict(fp8_widen_to="query")), (ragged_paged_attention_gpu_fused, BF16, {})])
def test_gpu_kernel_fp8_pages_match_reference_on_dequantized_pages(kernel, q_dtype, options):
    # float8_e4m3fn pages (and new K/V, already quantized by the dispatcher): the kernel widens
    # loaded tiles (the default kernel: to f16 for bf16 queries, or to q's dtype with "query").
    # Oracle: the reference over the same values held in float32.
    fp8 = jnp.float8_e4m3fn
    case = make_case(5, [(1, 70), (12, 40), (0, 0), (1, 17)], num_q_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=16, pad_tokens=1)
    k_new, v_new, k_pages, v_pages = (x.astype(fp8) for x in (case.k_new, case.v_new, case.k_pages, case.v_pages))
    q = case.q.astype(q_dtype)
    rest = (case.page_tables, case.cu_q_lens, case.kv_lens)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref_out, ref_k, ref_v = ragged_paged_attention_reference(
        q, up(k_new), up(v_new), up(k_pages), up(v_pages), *rest, sm_scale=case.sm_scale)
    out, k_out, v_out = kernel(q, k_new, v_new, k_pages, v_pages, *rest, sm_scale=case.sm_scale, interpret=True,
                               num_splits=2, **options)
    assert out.dtype == q_dtype and k_out.dtype == fp8
    tol = 1e-4 if q_dtype == F32 else 3e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(up(k_out)), np.asarray(ref_k))
    np.testing.assert_array_equal(np.asarray(up(v_out)), np.asarray(ref_v))


def _kernel_converts_of_fp8(jaxpr) -> set[str]:
    """Target dtypes of every convert_element_type applied to a float8 value, in a jaxpr and all its sub-jaxprs."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and eqn.invars[0].aval.dtype.itemsize == 1 \
                and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating):
            found.add(jnp.dtype(eqn.params["new_dtype"]).name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax_core.ClosedJaxpr):
                    found |= _kernel_converts_of_fp8(sub.jaxpr)
                elif isinstance(sub, jax_core.Jaxpr):
                    found |= _kernel_converts_of_fp8(sub)
    return found


@pytest.mark.parametrize("kernel,q_dtype,options,widened_to", [
    (ragged_paged_attention_gpu, BF16, {}, {"float16"}),
    (ragged_paged_attention_gpu, BF16, dict(fp8_widen_to="query"), {"bfloat16"}),
    (ragged_paged_attention_gpu, F32, {}, {"float32"}), (ragged_paged_attention_gpu_fused, BF16, {}, {"float16"})])
def test_gpu_kernel_widens_fp8_tiles_to_float16_for_bf16_queries(kernel, q_dtype, options, widened_to):
    # On sm_90 Triton widens e4m3 to f16 in one instruction per two values and to bf16 in several;
    # that conversion rate bounded the kernel over fp8 pages. The scatter converts nothing (its
    # K/V are fp8 already), so every float8 conversion in the program is the kernel's tile widening.
    case = make_case(6, [(1, 40), (3, 20)], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    args = list(case.args())
    args[0] = args[0].astype(q_dtype)
    args[1:5] = [x.astype(jnp.float8_e4m3fn) for x in args[1:5]]
    jaxpr = jax.make_jaxpr(lambda *a: kernel(*a, sm_scale=case.sm_scale, interpret=True, **options))(*args)
    assert _kernel_converts_of_fp8(jaxpr.jaxpr) == widened_to


def test_gpu_kernel_fp8_pages_keep_bf16_queries_past_float16_range_finite():
    # A bf16 query beyond f16's range is clipped to +-65504 before the f16 dots; unclipped it
    # would become inf and the scores NaN. Huge queries make the softmax one-hot on the largest
    # score, so the output is still the reference's (the same V row) within fp8 rounding.
    fp8 = jnp.float8_e4m3fn
    case = make_case(7, [(1, 40), (1, 9)], num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16)
    q = (case.q * 1e6).astype(BF16)
    k_new, v_new, k_pages, v_pages = (x.astype(fp8) for x in (case.k_new, case.v_new, case.k_pages, case.v_pages))
    rest = (case.page_tables, case.cu_q_lens, case.kv_lens)
    out = ragged_paged_attention_gpu(q, k_new, v_new, k_pages, v_pages, *rest, sm_scale=case.sm_scale,
                                     interpret=True)[0]
    assert np.isfinite(np.asarray(out, np.float32)).all()


def test_tile_planning_and_token_positions_have_no_loops():
    # searchsorted's default method is a loop, which XLA:GPU runs as host-launched iterations
    # in every step program; these run once a step, so they use the loop-free comparison.
    from pallas_kernels.paged_attention.reference import token_sequence_ids

    cu_q_lens = jnp.array([0, 3, 5, 5, 9], jnp.int32)
    kv_lens = jnp.array([3, 7, 0, 4], jnp.int32)
    texts = [jax.jit(token_sequence_ids, static_argnums=1).lower(cu_q_lens, 12).as_text(),
             jax.jit(plan_work_tiles, static_argnums=(2, 3)).lower(cu_q_lens, kv_lens, 12, 2).as_text()]
    assert all("stablehlo.while" not in text for text in texts)
    np.testing.assert_array_equal(token_sequence_ids(cu_q_lens, 12), [0, 0, 0, 1, 1, 3, 3, 3, 3, 4, 4, 4])


@pytest.mark.parametrize("kernel", [ragged_paged_attention_gpu, ragged_paged_attention_gpu_fused])
def test_gpu_kernel_aliases_the_cache(kernel):
    case = make_case(3, [(1, 20), (3, 9)], num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16)
    text = kernel.lower(*case.args(), sm_scale=case.sm_scale, interpret=True).as_text()
    # Outputs 1 and 2 (k_pages, v_pages) reuse the donated input buffers: no cache-sized copy.
    assert "tf.aliasing_output = 1" in text and "tf.aliasing_output = 2" in text


def test_work_tiles_cover_every_query_once():
    cu_q_lens = jnp.array([0, 1, 1, 11, 12, 12], jnp.int32)  # q_lens 1, 0, 10, 1, 0
    kv_lens = jnp.array([5, 0, 30, 1, 0], jnp.int32)
    tiles = plan_work_tiles(cu_q_lens, kv_lens, num_tokens=14, block_q=4)
    meta = np.asarray(tiles.meta)
    live = meta[meta[:, 2] > 0]
    # (seq, first_pos, tile_q_len, token_start): sequence 2's 10 queries in tiles of 4, 4, 2.
    assert live.tolist() == [[0, 4, 1, 0], [2, 20, 4, 1], [2, 24, 4, 5], [2, 28, 2, 9], [3, 0, 1, 11]]


FUSED_ONLY = dict(plan_in_kernel=False)


@pytest.mark.parametrize("kernel", [ragged_paged_attention_gpu, ragged_paged_attention_gpu_fused])
def test_gpu_kernel_lowers_through_triton_from_cpu(kernel):
    # Lowers Pallas -> Triton IR for an abstract H200, on the split (decode) and the prefill paths:
    # catches primitives the Triton lowering lacks, which interpret mode does not.
    from jax._src.mesh import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    for seqs, options, cache_dtype in (([(1, 300), (0, 0), (1, 16)], dict(num_splits=4), BF16),
                                       ([(90, 90), (1, 20)], {}, BF16),
                                       ([(1, 300), (40, 90)], dict(FUSED_ONLY, num_splits=2), BF16),
                                       ([(1, 300), (40, 90)], dict(prefetch_pages=True, merge_kernel=True,
                                                                   num_splits=2), BF16),
                                       ([(1, 300), (40, 90)], dict(prefetch_pages=False, merge_kernel=False,
                                                                   num_splits=2), BF16),
                                       ([(1, 300), (40, 90)], dict(num_splits=2), jnp.float8_e4m3fn)):
        if kernel is ragged_paged_attention_gpu and options.keys() & FUSED_ONLY.keys():
            continue  # the default kernel has no such options
        case = make_case(1, seqs, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=BF16)
        args = list(case.args())
        args[1:5] = [x.astype(cache_dtype) for x in args[1:5]]
        with jax.sharding.use_abstract_mesh(mesh):
            lowered = kernel.trace(*args, sm_scale=case.sm_scale, **options).lower(
                lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()


def _prototype_decode_case(seed, seqs, **kw):
    """A decode batch in the prototype's form: q [B, Hq, D], slot b's query is q[b] (zeros for empty slots)."""
    case = make_case(seed, seqs, dtype=jnp.bfloat16, nan_fill=False, **kw)
    live = np.flatnonzero([q_len for q_len, _ in seqs])
    q = jnp.zeros((len(seqs), *case.q.shape[1:]), case.q.dtype).at[live].set(case.q)
    return case, q


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mosaic_gpu_prototype_matches_reference(num_splits):
    from benchmarks.mosaic_gpu_prototype import paged_decode_attention_mosaic_gpu
    from pallas_kernels.paged_attention.reference import attend_reference

    # Mid-page ends, one exactly on a page boundary, an empty slot, GQA 4.
    seqs = [(1, 70), (1, 32), (0, 0), (1, 5)]
    case, q = _prototype_decode_case(0, seqs, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    cu_q_lens = jnp.arange(len(seqs) + 1, dtype=jnp.int32)
    want = attend_reference(q, case.k_pages, case.v_pages, case.page_tables, cu_q_lens, case.kv_lens,
                            sm_scale=case.sm_scale)
    got = paged_decode_attention_mosaic_gpu(q, case.k_pages, case.v_pages, case.page_tables, case.kv_lens,
                                            sm_scale=case.sm_scale, num_splits=num_splits, interpret=True)
    assert not jnp.isnan(got).any()
    err = jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32))
    assert err < 1e-2  # bf16 operands, P rounded to bf16


def test_mosaic_gpu_prototype_lowers_for_hopper_from_cpu():
    """Runs Mosaic GPU's lowering and layout inference (sm_90) without a GPU."""
    from benchmarks.mosaic_gpu_prototype import paged_decode_attention_mosaic_gpu

    spec = jax.ShapeDtypeStruct
    pages = spec((8, 64, 32, 128), jnp.bfloat16)
    lowered = paged_decode_attention_mosaic_gpu.trace(
        spec((4, 32, 128), jnp.bfloat16), pages, pages, spec((4, 16), jnp.int32), spec((4,), jnp.int32),
        sm_scale=0.1, num_splits=2,
    ).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()

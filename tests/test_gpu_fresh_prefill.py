"""The opt-in fresh-prefill GPU path (gpu_fresh_prefill.py): which sequence takes it, and its output, on CPU.

The bundled Mosaic GPU kernel cannot run on a CPU, so the window's attention is a plain causal
attention here (and the Mosaic GPU prefill prototype in Pallas's GPU interpreter); the Triton
kernel runs in interpret mode. The bundled kernel's call is checked by lowering it for CUDA.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import gpu_fresh_prefill as fp
from pallas_kernels.paged_attention import ragged_paged_attention_reference
from pallas_kernels.paged_attention import work_tiles as wt
from tests.attention_cases import make_case


def dense_causal(q, k, v, *, sm_scale):  # [1, L, H, D]; the window attention a GPU would run
    group = q.shape[2] // k.shape[2]
    up = lambda x: jnp.repeat(x, group, axis=2).astype(jnp.float32)  # noqa: E731
    return jax.nn.dot_product_attention(q.astype(jnp.float32), up(k), up(v), scale=sm_scale,
                                        is_causal=True).astype(q.dtype)


def picked(seqs, min_fresh_tokens):
    q_lens = np.array([q for q, _ in seqs]); kv_lens = np.array([kv for _, kv in seqs])
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    fresh = fp.pick_fresh_prefill(cu, jnp.asarray(kv_lens, jnp.int32), min_fresh_tokens)
    return bool(fresh.is_taken), int(fresh.seq), int(fresh.token_start), int(fresh.num_tokens)


def test_pick_takes_the_longest_fresh_prefill_only():
    # decode, chunk over a cached prefix (longer, not fresh), two fresh prompts, an empty slot
    seqs = [(1, 40), (300, 700), (150, 150), (200, 200), (0, 0)]
    assert picked(seqs, 64) == (True, 3, 1 + 300 + 150, 200)
    assert picked(seqs, 201)[0] is False  # no fresh prompt that long
    assert picked([(1, 40), (300, 700), (0, 0)], 1)[0] is False  # a cached prefix never qualifies
    assert picked([(0, 0), (0, 0)], 1)[0] is False  # padded slots never qualify


def test_hide_sequence_empties_only_its_tiles():
    cu, kv = jnp.asarray([0, 1, 151, 191], jnp.int32), jnp.asarray([40, 150, 100], jnp.int32)
    tiles = wt.plan_work_tiles(cu, kv, 200, 16)
    fresh = fp.pick_fresh_prefill(cu, kv, 64)
    hidden = fp.hide_sequence(tiles, fresh).meta
    is_seq1 = np.asarray(tiles.meta[:, wt.SEQ] == 1) & np.asarray(tiles.meta[:, wt.TILE_Q_LEN] > 0)
    assert is_seq1.sum() == 10  # 150 queries in tiles of 16
    assert (np.asarray(hidden[is_seq1][:, [wt.FIRST_POS, wt.TILE_Q_LEN]]) == 0).all()
    np.testing.assert_array_equal(np.asarray(hidden[~is_seq1]), np.asarray(tiles.meta[~is_seq1]))


def test_window_lengths_cover_the_step_in_steps_of_at_most_two():
    lengths = fp.fresh_prefill_lengths(8192, 1024)
    assert lengths[0] == 1024 and lengths[-1] == 8192
    assert all(b % fp.WINDOW_MULTIPLE == 0 and a < b <= 2 * a for a, b in zip(lengths, lengths[1:]))
    assert fp.fresh_prefill_lengths(500, 1024) == ()
    assert fp.fresh_prefill_lengths(200, 64) == (128, 256)
    with pytest.raises(ValueError, match="min_fresh_tokens"):
        fp.fresh_prefill_lengths(100, 0)


MIXED = [(1, 40), (150, 150), (40, 100), (0, 0), (30, 30)]  # decode, fresh, cached prefix, empty, short fresh


def run_against_reference(seqs, fresh_attend, min_fresh_tokens=64, scale=1.0, **kw):
    case = make_case(7, seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=5)
    case.v_new = case.v_new * scale
    ref = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale)
    args = [jnp.array(a) for a in case.args()]  # the cache is donated
    kw.setdefault("max_window_waste", 4.0)  # tiny steps: a 150-row prompt in a 256-row window still takes it
    out, k_pages, v_pages = fp.ragged_paged_attention_gpu_fresh_prefill(
        *args, sm_scale=case.sm_scale, min_fresh_tokens=min_fresh_tokens, fresh_attend=fresh_attend,
        interpret=True, **kw)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref[0], np.float32), rtol=3e-2,
                               atol=3e-2 * scale)
    np.testing.assert_array_equal(np.asarray(k_pages, np.float32), np.asarray(ref[1], np.float32))
    np.testing.assert_array_equal(np.asarray(v_pages, np.float32), np.asarray(ref[2], np.float32))
    return case


def test_mixed_step_matches_reference_with_the_fresh_prefill_in_its_own_kernel():
    calls = []

    def recording(q, k, v, *, sm_scale):
        calls.append(q.shape)
        return dense_causal(q, k, v, sm_scale=sm_scale)

    case = run_against_reference(MIXED, recording)
    # Traced once per window length (the lax.switch branches): 226 rows -> windows of 128 and 256.
    assert calls == [(1, 128, 4, 64), (1, 256, 4, 64)]
    assert case.q.shape[0] == 226


def test_fresh_kernel_output_is_used_for_the_taken_sequence_only():
    # A window attention that answers 7 everywhere: only the fresh sequence's 150 rows may show it.
    seven = lambda q, k, v, *, sm_scale: jnp.full(q.shape, 7, q.dtype)  # noqa: E731
    case = make_case(7, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=5)
    out, _, _ = fp.ragged_paged_attention_gpu_fresh_prefill(
        *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, min_fresh_tokens=64, fresh_attend=seven,
        interpret=True, max_window_waste=4.0)
    is_seven = np.all(np.asarray(out, np.float32) == 7, axis=(1, 2))
    np.testing.assert_array_equal(np.flatnonzero(is_seven), np.arange(1, 151))


def test_out_of_float16_range_and_unsupported_options_keep_the_paged_kernel():
    def never(q, k, v, *, sm_scale):
        raise AssertionError("the fresh kernel must not serve this step")

    seven = lambda q, k, v, *, sm_scale: jnp.full(q.shape, 7, q.dtype)  # noqa: E731
    # V past float16's range: the on-device check sends the step down the Triton path (no 7s).
    run_against_reference(MIXED, seven, scale=1e5)
    # A sliding window or soft cap: the path is not even traced.
    case = make_case(7, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16)
    ref = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale, sliding_window=32)[0]
    out, _, _ = fp.ragged_paged_attention_gpu_fresh_prefill(
        *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, sliding_window=32, min_fresh_tokens=64,
        fresh_attend=never, interpret=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=3e-2, atol=3e-2)


@pytest.mark.slow
def test_mixed_step_with_the_mosaic_gpu_prototype_interpreted():
    from benchmarks.mosaic_gpu_prefill_prototype import causal_prefill_attention_mosaic_gpu

    proto = lambda q, k, v, *, sm_scale: causal_prefill_attention_mosaic_gpu(  # noqa: E731
        q, k, v, sm_scale=sm_scale, interpret=True)
    run_against_reference(MIXED, proto)


def test_window_rows_and_merge_touch_only_the_taken_sequence_even_past_the_step_end():
    x = jnp.arange(10, dtype=jnp.float32)[:, None, None] + 1  # [T=10, 1, 1], row t holds t + 1
    fresh = fp.FreshPrefill(is_taken=jnp.bool_(True), seq=jnp.int32(2), token_start=jnp.int32(6),
                            num_tokens=jnp.int32(3))
    window = fp.window_rows(x, fresh, 8)  # rows 6, 7, 8, then zeros (rows 9.. are not the sequence's)
    np.testing.assert_array_equal(np.asarray(window)[:, 0, 0], [7, 8, 9, 0, 0, 0, 0, 0])
    merged = fp.merge_window(x, -window, fresh)  # a window running 4 rows past the step's end
    np.testing.assert_array_equal(np.asarray(merged)[:, 0, 0], [1, 2, 3, 4, 5, 6, -7, -8, -9, 10])


def test_a_window_much_longer_than_its_sequence_stays_on_triton():
    seven = lambda q, k, v, *, sm_scale: jnp.full(q.shape, 7, q.dtype)  # noqa: E731
    for q_len, is_taken in ((150, False), (240, True)):  # windows 128, 256, 384: 256 rows for 150 too long
        seqs = [(1, 40), (q_len, q_len), (40, 100)]
        case = make_case(7, seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                         pad_tokens=296 - 41 - q_len)
        out, _, _ = fp.ragged_paged_attention_gpu_fresh_prefill(
            *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, min_fresh_tokens=64, fresh_attend=seven,
            interpret=True)  # the default MAX_WINDOW_WASTE
        assert fp.fresh_prefill_lengths(296, 64) == (128, 256, 384)
        assert bool(np.all(np.asarray(out[1:1 + q_len], np.float32) == 7)) is is_taken


def test_decode_like_step_never_takes_the_fresh_path():
    def never(q, k, v, *, sm_scale):
        raise AssertionError("a decode-like step must compile without the fresh branch")

    # A fresh prompt long enough, but 150 token rows for 160 sequence slots: decode-like.
    seqs = [(1, 40), (140, 140), (1, 7)] + [(0, 0)] * 157
    case = make_case(7, seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=8)
    assert case.q.shape[0] <= case.kv_lens.shape[0]
    ref = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale)[0]
    out, _, _ = fp.ragged_paged_attention_gpu_fresh_prefill(
        *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, min_fresh_tokens=64, fresh_attend=never,
        interpret=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=3e-2, atol=3e-2)


def lowered_for_hopper(**options) -> str:
    """The fresh-prefill step over the MIXED batch, lowered for an abstract H200 from this CPU."""
    from jax._src.mesh import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    case = make_case(7, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=5)
    with jax.sharding.use_abstract_mesh(mesh):
        return fp.ragged_paged_attention_gpu_fresh_prefill.trace(
            *case.args(), sm_scale=case.sm_scale, min_fresh_tokens=64, **options).lower(
            lowering_platforms=("cuda",)).as_text()


def test_lowered_step_has_one_conditional_and_no_loop():
    # On the GPU every conditional (and every loop iteration) waits for the host: one switch, no while.
    text = lowered_for_hopper(fresh_attend=dense_causal)
    assert "triton" in text
    assert text.count("stablehlo.case") == 1
    assert "stablehlo.while" not in text


def dense_window(q, k, v, num_blocks, *, sm_scale):  # the branchless path's window attention, on a CPU
    return dense_causal(q, k, v, sm_scale=sm_scale)


def test_branchless_path_matches_reference_with_whole_blocks_in_the_window_kernel():
    run_against_reference(MIXED, dense_window, branchless=True)
    # A window kernel that answers 7: it serves the fresh prompt's first 128 rows (whole 64-row
    # blocks), Triton its last 22 and every other sequence.
    seven = lambda q, k, v, num_blocks, *, sm_scale: jnp.full(q.shape, 7, q.dtype)  # noqa: E731
    case = make_case(7, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=5)
    out, _, _ = fp.ragged_paged_attention_gpu_fresh_prefill(
        *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, min_fresh_tokens=64, fresh_attend=seven,
        interpret=True, branchless=True)
    is_seven = np.all(np.asarray(out, np.float32) == 7, axis=(1, 2))
    np.testing.assert_array_equal(np.flatnonzero(is_seven), np.arange(1, 129))


def test_branchless_path_with_nothing_to_serve_is_the_triton_kernel():
    seqs = [(1, 40), (40, 100), (30, 30), (0, 0)]  # a cached prefix and a fresh prompt under the minimum
    case = make_case(7, seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=60)
    blocks = []

    def recording(q, k, v, num_blocks, *, sm_scale):
        blocks.append(num_blocks)
        return jnp.full(q.shape, 7, q.dtype)

    ref = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale)[0]
    out, _, _ = fp.ragged_paged_attention_gpu_fresh_prefill(
        *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, min_fresh_tokens=64, fresh_attend=recording,
        interpret=True, branchless=True)
    assert len(blocks) == 1  # traced: the kernel is in the step whatever the batch holds
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=3e-2, atol=3e-2)


def test_branchless_path_with_the_window_kernel_interpreted():
    from pallas_kernels.paged_attention.gpu_fresh_window import causal_window_attention_mosaic_gpu

    kernel = lambda q, k, v, num_blocks, *, sm_scale: causal_window_attention_mosaic_gpu(  # noqa: E731
        q, k, v, num_blocks, sm_scale=sm_scale, interpret=True)
    run_against_reference(MIXED, kernel, branchless=True)


def test_branchless_path_lowers_for_hopper_with_no_conditional():
    text = lowered_for_hopper(branchless=True)
    assert "triton" in text and "mosaic_gpu" in text
    assert "stablehlo.case" not in text and "stablehlo.while" not in text


def test_bundled_kernel_call_lowers_for_hopper_from_cpu(monkeypatch):
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    # A CPU jaxlib has no CUDA version to check; pretend to one the bundled kernel accepts for causal.
    monkeypatch.setattr(attention_mgpu, "cuda_versions", types.SimpleNamespace(cuda_runtime_get_version=lambda: 12091))
    spec = jax.ShapeDtypeStruct
    q, kv = spec((1, 1024, 32, 128), jnp.bfloat16), spec((1, 1024, 8, 128), jnp.bfloat16)
    attend = jax.jit(lambda q, k, v: fp.causal_attention_mgpu(q, k, v, sm_scale=128**-0.5))
    lowered = attend.trace(q, kv, kv).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_dispatcher_takes_the_fresh_prefill_path_only_by_name_and_only_on_a_gpu():
    from jaxinfer.attention import resolve_impl

    assert resolve_impl("pallas_gpu_fresh_prefill", "gpu", head_dim=128) == "pallas_gpu_fresh_prefill"
    assert resolve_impl("auto", "gpu", head_dim=128) == "pallas_gpu_fresh_prefill"  # Hopper's default
    assert resolve_impl("pallas_gpu", "gpu", head_dim=128) == "pallas_gpu"  # the Triton kernel alone, by name
    assert resolve_impl("pallas_gpu_fresh_prefill", "cpu") == "cpu"
    assert resolve_impl("pallas_gpu_fresh_prefill", "tpu") == "pallas_tpu"
    assert resolve_impl("pallas_gpu_fresh_prefill", "gpu", head_dim=96) == "reference"  # as "auto" would
    assert resolve_impl("pallas_gpu_fresh_prefill") == "cpu"  # this machine: no Hopper GPU
    assert resolve_impl("pallas_gpu_fresh_prefill_branchless", "gpu", head_dim=128) == \
        "pallas_gpu_fresh_prefill_branchless"
    assert resolve_impl("pallas_gpu_fresh_prefill_branchless", "cpu") == "cpu"


def test_the_hopper_default_changes_auto_on_hopper_only(monkeypatch):
    import jaxinfer.attention as attention

    assert attention.HOPPER_AUTO_IMPL == "pallas_gpu_fresh_prefill"
    assert attention.resolve_impl("auto", "gpu", head_dim=128) == "pallas_gpu_fresh_prefill"
    assert attention.resolve_impl("auto", "rocm", head_dim=128) == "pallas_gpu"
    assert attention.resolve_impl("auto", "gpu", head_dim=96) == "reference"
    assert attention.resolve_impl("auto", "tpu") == "pallas_tpu"
    assert attention.resolve_impl("auto") == "cpu"  # this machine
    assert attention.resolve_impl("pallas_gpu", "gpu", head_dim=128) == "pallas_gpu"  # a name is kept
    monkeypatch.setattr(attention, "HOPPER_AUTO_IMPL", "pallas_gpu")  # the one line that turns it off
    assert attention.resolve_impl("auto", "gpu", head_dim=128) == "pallas_gpu"


def test_model_step_with_the_fresh_prefill_impl_runs_on_cpu_as_auto():
    from jaxinfer.attention import paged_attention
    from jaxinfer.batch import StepBatch

    case = make_case(3, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    batch = StepBatch(token_ids=None, positions=None, cu_q_lens=case.cu_q_lens, kv_lens=case.kv_lens,
                      page_tables=case.page_tables, logits_indices=None)
    args = (case.q, case.k_new, case.v_new, case.k_pages, case.v_pages, batch)
    want = paged_attention(*args, sm_scale=case.sm_scale, impl="auto")[0]
    for impl in ("pallas_gpu_fresh_prefill", "pallas_gpu_fresh_prefill_branchless"):
        got = paged_attention(*args, sm_scale=case.sm_scale, impl=impl)[0]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_fp8_pages_keep_the_paged_kernel_under_the_hopper_default():
    # The Hopper default also serves kv_cache_dtype="fp8" engines: their steps never take the
    # window (can_take_fresh_prefill wants 16-bit pages) and stay exact on the Triton kernel.
    case = make_case(11, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=5, nan_fill=False)
    fp8 = jnp.float8_e4m3fn
    case.k_new, case.v_new = case.k_new.astype(fp8), case.v_new.astype(fp8)
    case.k_pages, case.v_pages = case.k_pages.astype(fp8), case.v_pages.astype(fp8)
    ref = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale)
    calls = []

    def recording(q, k, v, *, sm_scale):
        calls.append(q.shape)
        return dense_causal(q, k, v, sm_scale=sm_scale)

    out, k_pages, v_pages = fp.ragged_paged_attention_gpu_fresh_prefill(
        *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, min_fresh_tokens=64, fresh_attend=recording,
        interpret=True, max_window_waste=4.0)
    assert calls == []  # not even traced: the window's branch is not built for fp8 pages
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref[0], np.float32), rtol=3e-2, atol=3e-2)
    np.testing.assert_array_equal(np.asarray(k_pages, np.float32), np.asarray(ref[1], np.float32))
    np.testing.assert_array_equal(np.asarray(v_pages, np.float32), np.asarray(ref[2], np.float32))

"""The opt-in fresh-prefill GPU path (gpu_fresh_prefill.py): which sequence takes it, and its output, on CPU.

The bundled Mosaic GPU kernel cannot run on a CPU, so the window's attention is a plain causal
attention here (and the Mosaic GPU prefill prototype in Pallas's GPU interpreter); the Triton
kernel runs in interpret mode. The bundled kernel's call is checked by lowering it for CUDA.
"""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import fresh_prompts as fpr
from pallas_kernels.paged_attention import gpu_fresh_prefill as fp
from pallas_kernels.paged_attention.v_layout import to_dim_major
from pallas_kernels.paged_attention import ragged_paged_attention_reference
from pallas_kernels.paged_attention import work_tiles as wt
from tests.attention_cases import make_case


def dense_causal(q, k, v, *, sm_scale):  # [1, L, H, D]; the window attention a GPU would run
    group = q.shape[2] // k.shape[2]
    up = lambda x: jnp.repeat(x, group, axis=2).astype(jnp.float32)  # noqa: E731
    return jax.nn.dot_product_attention(q.astype(jnp.float32), up(k), up(v), scale=sm_scale,
                                        is_causal=True).astype(q.dtype)


# The cuDNN variant's window attention (jax.nn.dot_product_attention, the same branches as the
# bundled kernel's); on a CPU the same call with implementation="xla" stands in.
cudnn_on_cpu = functools.partial(fp.causal_attention_cudnn, implementation="xla")
# The cuDNN segments path: the fresh prompts where they lie in the step's rows (cuDNN's packed layout);
# on a CPU the same call with implementation="xla" (a dense segment mask) stands in.
segments_on_cpu = functools.partial(fp.causal_attention_cudnn_segments, implementation="xla")


def step_lens(seqs):
    q_lens = np.array([q for q, _ in seqs]); kv_lens = np.array([kv for _, kv in seqs])
    return jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32), jnp.asarray(kv_lens, jnp.int32)


def chosen(seqs, num_tokens, min_fresh_tokens, max_fresh_prompts=8, max_window_waste=1.5):
    """(branch, {seq: (token_start, rows)}) of the bundled path's choice for a step of these sequences."""
    branches = fpr.window_branches(num_tokens, min_fresh_tokens, max_fresh_prompts, max_window_waste)
    slots = fpr.choose_slots(*step_lens(seqs), branches, min_fresh_tokens=min_fresh_tokens,
                             max_window_waste=max_window_waste)
    taken = {int(s): (int(t), int(n)) for s, t, n in zip(slots.seq, slots.token_start, slots.num_tokens) if n > 0}
    served = {i: int(n) for i, n in enumerate(slots.served) if n > 0}
    assert served == {s: n for s, (_, n) in taken.items()}
    branch = branches[int(slots.branch) - 1] if int(slots.branch) else None
    return branch, taken


def test_choice_takes_fresh_prompts_only_and_follows_the_work():
    # decode, chunk over a cached prefix (longer, not fresh), two fresh prompts, an empty slot
    seqs = [(1, 40), (300, 700), (150, 150), (200, 200), (0, 0)]
    branch, taken = chosen(seqs, 651, 64, max_window_waste=3.0)
    # 150 and 200 both fit a 256-row window within 3x their work: two slots beat one.
    assert branch == fpr.WindowBranch(256, 2) and taken == {2: (301, 150), 3: (451, 200)}
    branch, taken = chosen(seqs, 651, 64, max_fresh_prompts=1, max_window_waste=3.0)
    assert branch == fpr.WindowBranch(256, 1) and taken == {3: (451, 200)}  # the single-prompt path: the longest
    assert chosen(seqs, 651, 201)[1] == {}  # no fresh prompt that long
    assert chosen([(1, 40), (300, 700), (0, 0)], 301, 1)[1] == {}  # a cached prefix never qualifies
    assert chosen([(0, 0), (0, 0)], 8, 1)[1] == {}  # padded slots never qualify


def test_choice_leaves_a_short_prompt_out_of_a_long_window_and_empty_slots_cost_a_window():
    # Windows of 1024 rows: eight 1000-token prompts fill the 8-slot branch.
    eight = [(1000, 1000)] * 8
    branch, taken = chosen(eight, 8192, 512)
    assert branch == fpr.WindowBranch(1024, 8) and len(taken) == 8
    # Five of them: 8 slots would pay three empty windows; the 4-slot branch gains more.
    branch, taken = chosen([(1000, 1000)] * 5 + [(1, 9)] * 3, 8192, 512)
    assert branch == fpr.WindowBranch(1024, 4) and sorted(taken) == [0, 1, 2, 3]
    # A 3000-token prompt and a 600-token one: no window serves both within 1.5x their work.
    branch, taken = chosen([(600, 600), (3000, 3000)], 4096, 512)
    assert branch == fpr.WindowBranch(3200, 1) and list(taken) == [1]


def test_window_branches_are_bounded():
    branches = fpr.window_branches(8192, 1024, 8, 1.5)
    lengths = fp.fresh_prefill_lengths(8192, 1024)
    assert {b.length for b in branches} == set(lengths)
    assert len(branches) <= len(lengths) * (3 + 2)  # log2(8) + 2 counts per length at most
    assert all(b.num_slots * b.length <= 1.5**0.5 * 8192 + b.length for b in branches)  # window rows ~ the step
    assert [b.num_slots for b in branches if b.length == 1024] == [1, 2, 4, 8]
    assert fpr.window_branches(8192, 1024, 1, 1.5) == tuple(fpr.WindowBranch(n, 1) for n in lengths)
    with pytest.raises(ValueError, match="max_fresh_prompts"):
        fpr.window_branches(8192, 1024, 0, 1.5)
    with pytest.raises(ValueError, match="max_window_waste"):
        fpr.window_branches(8192, 1024, 8, 0.5)


def test_hide_served_empties_only_the_served_tiles():
    cu, kv = jnp.asarray([0, 1, 151, 191, 291], jnp.int32), jnp.asarray([40, 150, 100, 100], jnp.int32)
    tiles = wt.plan_work_tiles(cu, kv, 300, 16)
    served = jnp.asarray([0, 150, 0, 100], jnp.int32)  # two fresh prompts served whole
    hidden = fp.fpr.hide_served(tiles, served).meta
    live = np.asarray(tiles.meta[:, wt.TILE_Q_LEN] > 0)
    is_served = np.isin(np.asarray(tiles.meta[:, wt.SEQ]), [1, 3]) & live
    assert is_served.sum() == 10 + 7  # 150 and 100 queries in tiles of 16
    assert (np.asarray(hidden[is_served][:, [wt.FIRST_POS, wt.TILE_Q_LEN]]) == 0).all()
    np.testing.assert_array_equal(np.asarray(hidden[~is_served & live]), np.asarray(tiles.meta[~is_served & live]))
    partly = fp.fpr.hide_served(tiles, jnp.asarray([0, 64, 0, 0], jnp.int32)).meta  # its first 64 rows only
    assert int((np.asarray(partly[:, wt.TILE_Q_LEN]) == 0).sum() - (~live).sum()) == 4


def test_window_lengths_cover_the_step_in_steps_of_at_most_two():
    lengths = fp.fresh_prefill_lengths(8192, 1024)
    assert lengths[0] == 1024 and lengths[-1] == 8192
    assert all(b % fp.WINDOW_MULTIPLE == 0 and a < b <= 2 * a for a, b in zip(lengths, lengths[1:]))
    assert fp.fresh_prefill_lengths(500, 1024) == ()
    assert fp.fresh_prefill_lengths(200, 64) == (128, 256)
    with pytest.raises(ValueError, match="min_fresh_tokens"):
        fp.fresh_prefill_lengths(100, 0)


MIXED = [(1, 40), (150, 150), (40, 100), (0, 0), (30, 30)]  # decode, fresh, cached prefix, empty, short fresh
# Three fresh prompts of mixed lengths among a decode, a cached prefix, an empty slot, a short fresh prompt.
MULTI = [(1, 40), (150, 150), (130, 130), (40, 100), (0, 0), (30, 30), (140, 140), (1, 7)]
MULTI_TOKENS = sum(q for q, _ in MULTI) + 5  # make_case's pad_tokens below


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
    # Traced once per branch of the lax.switch: 226 rows hold at most three prompts of >= 64 rows;
    # windows of 128 rows take prompts of >= 64 (waste 4), so 1-3 slots; of 256, one.
    assert calls == [(1, 128, 4, 64), (2, 128, 4, 64), (3, 128, 4, 64), (1, 256, 4, 64)]
    assert case.q.shape[0] == 226


def test_several_fresh_prompts_go_through_one_batched_window_call():
    calls = []

    def recording(q, k, v, *, sm_scale):
        calls.append(q.shape)
        return dense_causal(q, k, v, sm_scale=sm_scale)

    run_against_reference(MULTI, recording)  # the outputs of all five kinds of sequence match the reference
    # Branch (256 rows, 3 slots): the three fresh prompts, exactly their rows; the 30-row prompt,
    # the cached prefix, the decodes and the padding rows stay with Triton.
    case, rows = rows_from_the_window(MULTI)
    starts = np.asarray(case.cu_q_lens)
    want = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in (1, 2, 6)])
    np.testing.assert_array_equal(rows, want)
    # One prompt per step (the path before session 11): only the longest.
    _, rows = rows_from_the_window(MULTI, max_fresh_prompts=1)
    np.testing.assert_array_equal(rows, np.arange(starts[1], starts[2]))


def rows_from_the_window(seqs, **options):
    """The case of ``seqs`` and the output rows the fresh window served, with a window attention
    that answers 7 everywhere (no other path can produce exact 7s)."""
    seven = lambda q, k, v, *, sm_scale: jnp.full(q.shape, 7, q.dtype)  # noqa: E731
    case = make_case(7, seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=5)
    out, _, _ = fp.ragged_paged_attention_gpu_fresh_prefill(
        *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, min_fresh_tokens=64, fresh_attend=seven,
        interpret=True, max_window_waste=4.0, **options)
    return case, np.flatnonzero(np.all(np.asarray(out, np.float32) == 7, axis=(1, 2)))


def test_nothing_qualifies_nothing_is_taken():
    seqs = [(1, 40), (40, 100), (30, 30), (0, 0), (50, 50)]  # a cached prefix, fresh prompts under 64 rows
    seven = lambda q, k, v, *, sm_scale: jnp.full(q.shape, 7, q.dtype)  # noqa: E731
    case = run_against_reference(seqs, seven)
    assert case.q.shape[0] > 64  # long enough for the branches to be compiled: the device choice said none


def test_fresh_kernel_output_is_used_for_the_taken_sequence_only():
    # Only the fresh sequence's 150 rows may come from the window.
    _, rows = rows_from_the_window(MIXED)
    np.testing.assert_array_equal(rows, np.arange(1, 151))


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


def test_slot_rows_read_and_write_only_the_taken_prompts_even_past_the_step_end():
    slots = fpr.FreshSlots(branch=jnp.int32(1), seq=jnp.asarray([2, 0, 0], jnp.int32),
                           token_start=jnp.asarray([6, 0, 0], jnp.int32), num_tokens=jnp.asarray([3, 0, 0], jnp.int32),
                           served=jnp.zeros(4, jnp.int32))
    source, dest = fpr.slot_rows(slots, 2, 5, 10)  # two slots of 5 rows in a step of 10; the second empty
    np.testing.assert_array_equal(np.asarray(source), [[6, 7, 8, 10, 10], [10] * 5])  # 10: reads 0
    x = jnp.arange(10, dtype=jnp.float32)[:, None, None] + 1  # [T=10, 1, 1], row t holds t + 1
    window = fp._take_rows(x, source)
    np.testing.assert_array_equal(np.asarray(window)[..., 0, 0], [[7, 8, 9, 0, 0], [0] * 5])
    assert len(set(np.asarray(dest).ravel().tolist())) == 10  # distinct: a scatter with unique indices
    merged = fp._merge_rows(x, -window, dest)
    np.testing.assert_array_equal(np.asarray(merged)[:, 0, 0], [1, 2, 3, 4, 5, 6, -7, -8, -9, 10])


def test_packed_prompts_start_on_blocks_and_see_only_their_own_rows():
    # Prompts of 70 and 130 rows (slots shortest first) in a step of 300 rows; three slots.
    slots = fpr.FreshSlots(branch=jnp.int32(1), seq=jnp.asarray([3, 1, 0], jnp.int32),
                           token_start=jnp.asarray([220, 10, 0], jnp.int32),
                           num_tokens=jnp.asarray([70, 130, 0], jnp.int32), served=jnp.zeros(4, jnp.int32))
    length = fpr.packed_window_length(300, 3)
    assert length == 320 + 128
    source, dest, first_block = (np.asarray(a) for a in fpr.pack_prompts(slots, length, 300))
    # Blocks 0-1: the 70-row prompt; 2-4: the 130-row one; the rest dead.
    np.testing.assert_array_equal(first_block, [0, 0, 2, 2, 2, -1, -1])
    np.testing.assert_array_equal(source[:70], np.arange(220, 290))
    assert (source[70:128] == 300).all() and (source[128 + 130:] == 300).all()  # read as 0
    np.testing.assert_array_equal(source[128:258], np.arange(10, 140))
    np.testing.assert_array_equal(dest[source < 300], source[source < 300])
    assert (dest[source == 300] >= 300).all() and len(set(dest.tolist())) == length


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


def lowered_for_hopper(kv_dtype=jnp.bfloat16, **options) -> str:
    """The fresh-prefill step over the MULTI batch, lowered for an abstract H200 from this CPU."""
    from jax._src.mesh import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    case = make_case(7, MULTI, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=5)
    args = list(case.args())
    args[1:5] = [x.astype(kv_dtype) for x in args[1:5]]
    with jax.sharding.use_abstract_mesh(mesh):
        return fp.ragged_paged_attention_gpu_fresh_prefill.trace(
            *args, sm_scale=case.sm_scale, min_fresh_tokens=64, **options).lower(
            lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_lowered_step_has_one_conditional_and_no_loop(kv_dtype):
    # On the GPU every conditional (and every loop iteration) waits for the host: one switch, no
    # while, whatever the number of branches (windows x slot counts) or the page dtype.
    text = lowered_for_hopper(kv_dtype, fresh_attend=dense_causal, max_window_waste=4.0)
    assert "triton" in text
    assert text.count("stablehlo.case") == 1
    assert "stablehlo.while" not in text


def dense_packed(q, k, v, first_block, *, sm_scale):  # the branchless path's window attention, on a CPU
    """Causal attention of packed prompts [1, W, H, D]: row i sees rows j <= i from its block's first block."""
    group = q.shape[2] // k.shape[2]
    up = lambda x: jnp.repeat(x, group, axis=2).astype(jnp.float32)  # noqa: E731
    row = jnp.arange(q.shape[1])
    start = jnp.repeat(first_block[0], 64) * 64  # [W]: first row each row may see (< 0: dead)
    mask = (row[None, :] <= row[:, None]) & (row[None, :] >= start[:, None])  # [W, W]
    return jax.nn.dot_product_attention(q.astype(jnp.float32), up(k), up(v), scale=sm_scale,
                                        mask=mask[None, None]).astype(q.dtype)


def test_branchless_path_matches_reference_with_whole_prompts_in_the_window_kernel():
    run_against_reference(MIXED, dense_packed, branchless=True)
    run_against_reference(MULTI, dense_packed, branchless=True)
    # A window kernel that answers 7: it serves the three fresh prompts whole (their last partial
    # blocks too), Triton every other sequence.
    seven = lambda q, k, v, first_block, *, sm_scale: jnp.full(q.shape, 7, q.dtype)  # noqa: E731
    case = make_case(7, MULTI, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=5)
    out, _, _ = fp.ragged_paged_attention_gpu_fresh_prefill(
        *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, min_fresh_tokens=64, fresh_attend=seven,
        interpret=True, branchless=True)
    is_seven = np.all(np.asarray(out, np.float32) == 7, axis=(1, 2))
    starts = np.asarray(case.cu_q_lens)
    want = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in (1, 2, 6)])
    np.testing.assert_array_equal(np.flatnonzero(is_seven), want)


def test_branchless_path_with_nothing_to_serve_is_the_triton_kernel():
    seqs = [(1, 40), (40, 100), (30, 30), (0, 0)]  # a cached prefix and a fresh prompt under the minimum
    case = make_case(7, seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=60)
    blocks = []

    def recording(q, k, v, first_block, *, sm_scale):
        blocks.append(first_block)
        return jnp.full(q.shape, 7, q.dtype)

    ref = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale)[0]
    out, _, _ = fp.ragged_paged_attention_gpu_fresh_prefill(
        *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, min_fresh_tokens=64, fresh_attend=recording,
        interpret=True, branchless=True)
    assert len(blocks) == 1  # traced: the kernel is in the step whatever the batch holds
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=3e-2, atol=3e-2)


def test_branchless_path_with_the_window_kernel_interpreted():
    from pallas_kernels.paged_attention.gpu_fresh_window import packed_causal_attention_mosaic_gpu

    kernel = lambda q, k, v, first_block, *, sm_scale: packed_causal_attention_mosaic_gpu(  # noqa: E731
        q, k, v, first_block, sm_scale=sm_scale, interpret=True)
    run_against_reference(MULTI, kernel, branchless=True)  # three prompts packed, each on its own blocks


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_branchless_path_lowers_for_hopper_with_no_conditional(kv_dtype):
    text = lowered_for_hopper(kv_dtype, branchless=True)
    assert "triton" in text and "mosaic_gpu" in text
    assert "stablehlo.case" not in text and "stablehlo.while" not in text


@pytest.mark.parametrize("num_slots,kv_dtype", [(1, jnp.bfloat16), (8, jnp.bfloat16), (8, jnp.float8_e4m3fn)])
def test_bundled_kernel_call_lowers_for_hopper_from_cpu(monkeypatch, num_slots, kv_dtype):
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    # A CPU jaxlib has no CUDA version to check; pretend to one the bundled kernel accepts for causal.
    monkeypatch.setattr(attention_mgpu, "cuda_versions", types.SimpleNamespace(cuda_runtime_get_version=lambda: 12091))
    spec = jax.ShapeDtypeStruct  # several slots in one call (throughput-1k's 8 x 1024), e4m3 K/V widened
    q, kv = spec((num_slots, 1024, 32, 128), jnp.bfloat16), spec((num_slots, 1024, 8, 128), kv_dtype)
    attend = jax.jit(lambda q, k, v: fp.causal_attention_mgpu(q, k, v, sm_scale=128**-0.5))
    lowered = attend.trace(q, kv, kv).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_dispatcher_takes_the_fresh_prefill_path_only_by_name_and_only_on_a_gpu():
    from jaxinfer.attention import resolve_impl

    assert resolve_impl("pallas_gpu_fresh_prefill", "gpu", head_dim=128) == "pallas_gpu_fresh_prefill"
    assert resolve_impl("auto", "gpu", head_dim=128) == "pallas_gpu_fresh_prefill_cudnn_segments"  # Hopper's default
    assert resolve_impl("pallas_gpu", "gpu", head_dim=128) == "pallas_gpu"  # the Triton kernel alone, by name
    assert resolve_impl("pallas_gpu_fresh_prefill", "cpu") == "cpu"
    assert resolve_impl("pallas_gpu_fresh_prefill", "tpu") == "pallas_tpu"
    assert resolve_impl("pallas_gpu_fresh_prefill", "gpu", head_dim=96) == "reference"  # as "auto" would
    assert resolve_impl("pallas_gpu_fresh_prefill") == "cpu"  # this machine: no Hopper GPU
    assert resolve_impl("pallas_gpu_fresh_prefill_branchless", "gpu", head_dim=128) == \
        "pallas_gpu_fresh_prefill_branchless"
    assert resolve_impl("pallas_gpu_fresh_prefill_branchless", "cpu") == "cpu"
    assert resolve_impl("pallas_gpu_fresh_prefill_cudnn", "gpu", head_dim=128) == "pallas_gpu_fresh_prefill_cudnn"
    assert resolve_impl("pallas_gpu_fresh_prefill_cudnn", "cpu") == "cpu"
    assert resolve_impl("pallas_gpu_fresh_prefill_cudnn_segments", "gpu", head_dim=128) == \
        "pallas_gpu_fresh_prefill_cudnn_segments"
    assert resolve_impl("pallas_gpu_fresh_prefill_cudnn_segments", "cpu") == "cpu"


def test_the_hopper_default_changes_auto_on_hopper_only(monkeypatch):
    import jaxinfer.attention as attention

    assert attention.HOPPER_AUTO_IMPL == "pallas_gpu_fresh_prefill_cudnn_segments"
    assert attention.resolve_impl("auto", "gpu", head_dim=128) == "pallas_gpu_fresh_prefill_cudnn_segments"
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
    for impl in ("pallas_gpu_fresh_prefill", "pallas_gpu_fresh_prefill_branchless", "pallas_gpu_fresh_prefill_cudnn"):
        got = paged_attention(*args, sm_scale=case.sm_scale, impl=impl)[0]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_every_e4m3_value_widens_to_float16_exactly():
    # The window's e4m3 K/V go to float16 (bundled kernel) or bf16 (window kernel): both must be exact.
    values = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), jnp.float8_e4m3fn)
    values = values[~jnp.isnan(values.astype(jnp.float32))]
    for dtype in (jnp.float16, jnp.bfloat16):
        np.testing.assert_array_equal(np.asarray(values.astype(dtype).astype(jnp.float32)),
                                      np.asarray(values.astype(jnp.float32)))


@pytest.mark.parametrize("path,v_layout", [("bundled", "token_major"), ("branchless", "token_major"),
                                           ("cudnn", "token_major"), ("cudnn_segments", "token_major"),
                                           ("cudnn_segments", "dim_major"), ("bundled", "dim_major")])
def test_fp8_pages_take_the_window_from_the_quantized_new_kv(path, v_layout):
    # e4m3 pages and new K/V (quantized by the dispatcher), bf16 queries: the fresh prompts' windows
    # read this step's e4m3 K/V, as the pages hold them. Oracle: the reference over the same values
    # held in float32 (as the Triton kernel's fp8 tests). Dim-major V pages (v_layout.py): the
    # Triton part reads them transposed, the windows never read pages.
    case = make_case(11, MULTI, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=5)
    fp8 = jnp.float8_e4m3fn
    k_new, v_new, k_pages, v_pages = (x.astype(fp8) for x in (case.k_new, case.v_new, case.k_pages, case.v_pages))
    rest = (case.page_tables, case.cu_q_lens, case.kv_lens)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref_out, ref_k, ref_v = ragged_paged_attention_reference(case.q, up(k_new), up(v_new), up(k_pages), up(v_pages),
                                                             *rest, sm_scale=case.sm_scale)
    seen = []

    window = {"bundled": dense_causal, "branchless": dense_packed, "cudnn": cudnn_on_cpu,
              "cudnn_segments": segments_on_cpu}[path]

    def recording(q, k, v, *extra, sm_scale):
        seen.append((q.shape[0], k.dtype))
        return window(q, k, v, *extra, sm_scale=sm_scale)

    dim_major = v_layout == "dim_major"
    out, k_out, v_out = fp.ragged_paged_attention_gpu_fresh_prefill(
        case.q, k_new, v_new, k_pages, to_dim_major(v_pages) if dim_major else v_pages, *rest, sm_scale=case.sm_scale,
        min_fresh_tokens=64, fresh_attend=recording, interpret=True, max_window_waste=4.0,
        branchless=path == "branchless", cudnn=path == "cudnn", cudnn_segments=path == "cudnn_segments",
        v_layout=v_layout)
    # The branches and the segments hand their attention e4m3 (the bundled kernel widens to float16,
    # cuDNN's wrappers to bf16); the packed window kernel gets bf16.
    assert seen and {dtype for _, dtype in seen} == {jnp.dtype(jnp.bfloat16 if path == "branchless" else fp8)}
    assert out.dtype == jnp.bfloat16 and k_out.dtype == fp8 and not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=3e-2, atol=3e-2)
    np.testing.assert_array_equal(np.asarray(up(k_out)), np.asarray(ref_k))
    np.testing.assert_array_equal(np.asarray(up(v_out)), np.asarray(to_dim_major(ref_v) if dim_major else ref_v))


@pytest.mark.parametrize("impl", ["pallas_gpu_fresh_prefill", "pallas_gpu_fresh_prefill_branchless",
                                  "pallas_gpu_fresh_prefill_cudnn", "pallas_gpu_fresh_prefill_cudnn_segments"])
def test_fp8_scales_through_the_dispatcher_with_the_fresh_path(monkeypatch, impl):
    # The dispatcher quantizes the new K/V with the layer's scales, folds k_scale into q and v_scale
    # into the output; the window must see exactly what the pages hold. Run as on a Hopper GPU, the
    # window attention on CPU; oracle: dequantize every page and the quantized new K/V, attend in f32.
    import pallas_kernels.paged_attention as pa
    from jaxinfer import attention
    from jaxinfer.batch import StepBatch
    from jaxinfer.kv_cache_dtype import quantize_to_fp8

    dense = {"pallas_gpu_fresh_prefill_branchless": dense_packed,
             "pallas_gpu_fresh_prefill_cudnn": cudnn_on_cpu,
             "pallas_gpu_fresh_prefill_cudnn_segments": segments_on_cpu}.get(impl, dense_causal)
    calls = []

    def window(*args, sm_scale):
        calls.append(args[0].shape)
        return dense(*args, sm_scale=sm_scale)

    monkeypatch.setattr(attention, "_is_hopper", lambda platform: True)
    monkeypatch.setattr(fp, "SEGMENTS_MIN_FRESH_TOKENS", 64)  # the segments impl passes its own minimum
    monkeypatch.setattr(pa, "ragged_paged_attention_gpu_fresh_prefill", functools.partial(
        fp.ragged_paged_attention_gpu_fresh_prefill, fresh_attend=window, interpret=True, min_fresh_tokens=64,
        max_window_waste=4.0))
    case = make_case(5, MULTI, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=5, nan_fill=False)
    k_scale, v_scale = jnp.float32(0.05), jnp.float32(3.0)
    k_pages, v_pages = quantize_to_fp8(case.k_pages, k_scale), quantize_to_fp8(case.v_pages, v_scale)
    batch = StepBatch(token_ids=None, positions=None, cu_q_lens=case.cu_q_lens, kv_lens=case.kv_lens,
                      page_tables=case.page_tables, logits_indices=None)
    out, new_k, _ = attention.paged_attention(case.q, case.k_new, case.v_new, jnp.array(k_pages), jnp.array(v_pages),
                                              batch,
                                              sm_scale=case.sm_scale, impl=impl, k_scale=k_scale,
                                              v_scale=v_scale)  # copies: the path donates the pages
    dequantize = lambda x, scale: x.astype(jnp.float32) * scale  # noqa: E731
    oracle, oracle_k, _ = ragged_paged_attention_reference(
        case.q, dequantize(quantize_to_fp8(case.k_new, k_scale), k_scale),
        dequantize(quantize_to_fp8(case.v_new, v_scale), v_scale), dequantize(k_pages, k_scale),
        dequantize(v_pages, v_scale), case.page_tables, case.cu_q_lens, case.kv_lens, sm_scale=case.sm_scale)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(oracle), rtol=3e-2, atol=3e-2 * 3.0)
    np.testing.assert_array_equal(np.asarray(dequantize(new_k, k_scale)), np.asarray(oracle_k))
    assert calls  # the window was in the step


def test_cudnn_variant_matches_reference_and_takes_the_bundled_paths_prompts():
    calls = []

    def recording(q, k, v, *, sm_scale):
        calls.append((q.shape, k.dtype))
        return cudnn_on_cpu(q, k, v, sm_scale=sm_scale)

    run_against_reference(MIXED, recording, cudnn=True)
    run_against_reference(MULTI, recording, cudnn=True)
    assert {dtype for _, dtype in calls} == {jnp.dtype(jnp.bfloat16)}  # bf16 windows: no float16 copies
    seven = lambda q, k, v, *, sm_scale: jnp.full(q.shape, 7, q.dtype)  # noqa: E731
    for options in ({}, {"max_fresh_prompts": 1}):  # the same prompts as the bundled kernel's branches
        case = make_case(7, MULTI, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                         pad_tokens=5)
        out, _, _ = fp.ragged_paged_attention_gpu_fresh_prefill(
            *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, min_fresh_tokens=64, fresh_attend=seven,
            interpret=True, max_window_waste=4.0, cudnn=True, **options)
        rows = np.flatnonzero(np.all(np.asarray(out, np.float32) == 7, axis=(1, 2)))
        np.testing.assert_array_equal(rows, rows_from_the_window(MULTI, **options)[1])


def test_cudnn_variant_has_no_float16_limit():
    # V past float16's range: the bundled path keeps Triton (its float16 check), cuDNN reads bf16.
    seen = []

    def recording(q, k, v, *, sm_scale):
        seen.append(q.shape)
        return cudnn_on_cpu(q, k, v, sm_scale=sm_scale)

    case = make_case(7, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=5)
    case.v_new = case.v_new * 1e5
    seven = lambda q, k, v, *, sm_scale: jnp.full(q.shape, 7, q.dtype)  # noqa: E731
    for cudnn, served in ((False, 0), (True, 150)):
        out, _, _ = fp.ragged_paged_attention_gpu_fresh_prefill(
            *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, min_fresh_tokens=64, fresh_attend=seven,
            interpret=True, max_window_waste=4.0, cudnn=cudnn)
        assert np.all(np.asarray(out, np.float32) == 7, axis=(1, 2)).sum() == served
    run_against_reference(MIXED, recording, cudnn=True, scale=1e5)
    assert seen


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_cudnn_variant_lowers_for_hopper_with_one_conditional(kv_dtype):
    # The step with its Triton kernel, lowered for an abstract H200; the window call stands in
    # (cuDNN's own lowering needs a device: the next test lowers it alone).
    text = lowered_for_hopper(kv_dtype, cudnn=True, fresh_attend=cudnn_on_cpu, max_window_waste=4.0)
    assert "triton" in text
    assert text.count("stablehlo.case") == 1 and "stablehlo.while" not in text


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_cudnn_window_call_lowers_for_cuda_from_cpu(monkeypatch, kv_dtype):
    from jax._src.cudnn import fused_attention_stablehlo

    # A CPU jaxlib has no cuDNN to ask for its version; pretend to one (9.10) with flash attention.
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
    spec = jax.ShapeDtypeStruct  # an 8B step's window: 32 query heads over 8 K/V heads, D = 128
    q, kv = spec((1, 4608, 32, 128), jnp.bfloat16), spec((1, 4608, 8, 128), kv_dtype)
    attend = jax.jit(lambda q, k, v: fp.causal_attention_cudnn(q, k, v, sm_scale=128**-0.5))
    text = attend.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__cudnn$fmhaSoftmax") == 1 and "\\22CAUSAL\\22" in text


@pytest.mark.parametrize("paths", [("cudnn", "branchless"), ("cudnn_segments", "branchless"),
                                   ("cudnn", "cudnn_segments")])
def test_two_fresh_prompt_paths_together_is_an_error(paths):
    case = make_case(7, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="pick one"):
        fp.ragged_paged_attention_gpu_fresh_prefill(*case.args(), sm_scale=case.sm_scale, **dict.fromkeys(paths, True))


def test_segment_attention_sees_only_its_own_segment_causally():
    # Three segments (one of them empty) among rows of no segment: each segment's rows equal a dense
    # causal attention over that segment alone, wherever it starts.
    key = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(key[0], (40, 4, 64), jnp.float32)
    k, v = (jax.random.normal(x, (40, 2, 64), jnp.float32) for x in key[1:])
    starts, lens = jnp.array([25, 3, 0], jnp.int32), jnp.array([11, 9, 0], jnp.int32)
    out = segments_on_cpu(q, k, v, starts, lens, sm_scale=0.125)
    for start, n in ((25, 11), (3, 9)):
        want = dense_causal(q[None, start:start + n], k[None, start:start + n], v[None, start:start + n],
                            sm_scale=0.125)[0]
        np.testing.assert_allclose(np.asarray(out[start:start + n]), np.asarray(want), rtol=1e-5, atol=1e-5)
    # One segment: the call pads a second, empty one (cuDNN's wrapper reads one as "starts at row 0").
    one = segments_on_cpu(q, k, v, starts[:1], lens[:1], sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(one[25:36]), np.asarray(out[25:36]), rtol=1e-6, atol=1e-6)


def test_cudnn_segments_path_matches_reference_and_serves_every_qualifying_prompt_whole():
    calls = []

    def recording(q, k, v, seg_start, seg_len, *, sm_scale):
        calls.append((q.shape, seg_start.shape, k.dtype))
        return segments_on_cpu(q, k, v, seg_start, seg_len, sm_scale=sm_scale)

    run_against_reference(MIXED, recording, cudnn_segments=True)
    run_against_reference(MULTI, recording, cudnn_segments=True)
    # The step's own rows, no window: [T, H, D], and a segment slot per prompt of >= 64 rows the step
    # can hold (497 // 64 = 7).
    assert calls[-1] == ((MULTI_TOKENS, 4, 64), (7,), jnp.dtype(jnp.bfloat16))
    seven = lambda q, k, v, seg_start, seg_len, *, sm_scale: jnp.full(q.shape, 7, q.dtype)  # noqa: E731
    case = make_case(7, MULTI, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=5)
    starts = np.asarray(case.cu_q_lens)
    for max_fresh_prompts, served in ((8, (1, 2, 6)), (1, (1,))):
        out, _, _ = fp.ragged_paged_attention_gpu_fresh_prefill(
            *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, min_fresh_tokens=64, fresh_attend=seven,
            interpret=True, cudnn_segments=True, max_fresh_prompts=max_fresh_prompts)
        rows = np.flatnonzero(np.all(np.asarray(out, np.float32) == 7, axis=(1, 2)))
        # Only the fresh prompts of >= 64 rows, whole (no waste rule: cuDNN's work follows the rows).
        np.testing.assert_array_equal(rows, np.concatenate([np.arange(starts[i], starts[i + 1]) for i in served]))


def test_cudnn_segments_path_with_kv_splits_joins_the_outputs_by_select(monkeypatch):
    # Steps whose tuned sizes split the KV walk cannot write Triton's rows into cuDNN's output (the
    # splits merge outside the kernel): they keep the select, and the same answer.
    one_split = fp.gpu_block_sizes
    monkeypatch.setattr(fp, "gpu_block_sizes", lambda **kw: dataclasses.replace(one_split(**kw), num_splits=2))
    run_against_reference(MIXED, segments_on_cpu, cudnn_segments=True)
    run_against_reference(MULTI, segments_on_cpu, cudnn_segments=True)


def test_triton_writes_its_tiles_rows_into_a_given_output_and_leaves_the_rest():
    # attend_gpu(out_init=...): the rows of live tiles are the kernel's (as without it); rows of
    # emptied tiles and padding rows keep the given buffer's values, so another kernel's rows need
    # no select. With an extra KV split the init is refused.
    from pallas_kernels.paged_attention.block_sizes import BlockSizes
    from pallas_kernels.paged_attention.gpu import attend_gpu

    case = make_case(7, MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     pad_tokens=5)
    ref_out, k_pages, v_pages = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale)
    sizes = BlockSizes(block_q=16, block_kv=16, num_splits=1)
    tiles = wt.plan_work_tiles(case.cu_q_lens, case.kv_lens, case.q.shape[0], sizes.block_q)
    served = jnp.zeros_like(case.kv_lens).at[1].set(150)  # the fresh prompt of 150 rows: "another kernel's"
    init = jnp.full(case.q.shape, 5, case.q.dtype)
    attend = functools.partial(attend_gpu, case.q, k_pages, v_pages, case.page_tables, case.cu_q_lens, case.kv_lens,
                               sm_scale=case.sm_scale, sizes=sizes, interpret=True)
    out = np.asarray(attend(tiles=fpr.hide_served(tiles, served), out_init=init), np.float32)
    starts = np.asarray(case.cu_q_lens)
    kept = np.zeros(case.q.shape[0], bool)
    kept[starts[1]:starts[2]] = True  # the served prompt's rows
    kept[starts[-1]:] = True  # padding rows
    assert kept[starts[-1]:].sum() == 5
    np.testing.assert_array_equal(out[kept], 5)
    np.testing.assert_allclose(out[~kept], np.asarray(ref_out, np.float32)[~kept], rtol=3e-2, atol=3e-2)
    with pytest.raises(ValueError, match="one KV split"):
        attend(sizes=dataclasses.replace(sizes, num_splits=2), out_init=init)
    with pytest.raises(ValueError, match="out_init must be"):
        attend(out_init=init[:-1])


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_cudnn_segments_path_lowers_for_hopper_with_no_conditional(kv_dtype):
    text = lowered_for_hopper(kv_dtype, cudnn_segments=True, fresh_attend=segments_on_cpu)
    assert "triton" in text
    assert "stablehlo.case" not in text and "stablehlo.while" not in text
    # One split (this step's sizes): Triton writes into the segments' output, whose padding rows one
    # small kernel zeroes; the only scatters left are the K and V writes, and no select joins outputs.
    assert "zero_rows_from" in text
    out_type = f"tensor<{MULTI_TOKENS}x4x64x"  # the step's output [T, Hq, D]
    assert not [line for line in text.splitlines() if ("stablehlo.select" in line or "stablehlo.scatter" in line)
                and out_type in line]


@pytest.mark.parametrize("num_segments,kv_dtype", [(1, jnp.bfloat16), (8, jnp.bfloat16), (8, jnp.float8_e4m3fn)])
def test_cudnn_segments_call_lowers_for_cuda_from_cpu(monkeypatch, num_segments, kv_dtype):
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability", lambda capability: True)  # Hopper
    spec = jax.ShapeDtypeStruct  # an 8B step: 8192 rows, 32 query heads over 8 K/V heads, D = 128
    q, kv = spec((8192, 32, 128), jnp.bfloat16), spec((8192, 8, 128), kv_dtype)
    seg = spec((num_segments,), jnp.int32)
    attend = jax.jit(lambda q, k, v, s, n: fp.causal_attention_cudnn_segments(q, k, v, s, n, sm_scale=128**-0.5))
    text = attend.trace(q, kv, kv, seg, seg).lower(lowering_platforms=("cuda",)).as_text()
    call = [line for line in text.splitlines() if "__cudnn$fmhaSoftmax" in line]
    assert len(call) == 1 and "PADDING_CAUSAL" in call[0]
    # Packed: seqlens [1, max(M, 2)] for q and K/V, then offsets [1, max(M, 2) + 1] for each.
    m = max(num_segments, 2)
    assert f"tensor<1x{m}xi32>, tensor<1x{m}xi32>, tensor<1x{m + 1}xi32>, tensor<1x{m + 1}xi32>)" in call[0]


def test_dispatcher_hands_the_segments_path_its_own_minimum_and_eight_prompts(monkeypatch):
    import pallas_kernels.paged_attention as pa
    from jaxinfer import attention

    seen = {}
    monkeypatch.setattr(pa, "ragged_paged_attention_gpu_fresh_prefill", lambda *args, **kw: seen.update(kw))
    attention._attend(*range(8), impl="pallas_gpu_fresh_prefill_cudnn_segments", sm_scale=1.0, sliding_window=None)
    assert seen["cudnn_segments"] and seen["max_fresh_prompts"] == fpr.MAX_FRESH_PROMPTS == 8
    assert seen["min_fresh_tokens"] == fp.SEGMENTS_MIN_FRESH_TOKENS == 1000  # 8 x 1000 measured faster than Triton
    seen.clear()
    attention._attend(*range(8), impl="pallas_gpu_fresh_prefill", sm_scale=1.0, sliding_window=None)
    assert "min_fresh_tokens" not in seen and seen["max_fresh_prompts"] == fpr.ENGINE_MAX_FRESH_PROMPTS


def test_cudnn_segments_call_lowers_per_shard_under_tensor_parallelism():
    # Under a tensor-parallel mesh each shard attends its own heads (sharding.rules.shard_over_heads):
    # the packed cuDNN call must lower inside shard_map, with the shard's heads. Its primitive needs
    # concrete devices to lower, so two CPU devices in a subprocess stand in for two GPUs.
    import os
    import subprocess
    import sys

    from .subprocess_report import read_report

    script = """
import json
import jax, jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn
from jax.sharding import NamedSharding, PartitionSpec as P
from pallas_kernels.paged_attention import gpu_fresh_prefill as fp
cudnn.check_cudnn_version = lambda: 91000
cudnn.check_compute_capability = lambda capability: True
mesh = jax.make_mesh((2,), ("tp",))
heads, whole = NamedSharding(mesh, P(None, "tp")), NamedSharding(mesh, P())
q = jax.ShapeDtypeStruct((2048, 32, 128), jnp.bfloat16, sharding=heads)
kv = jax.ShapeDtypeStruct((2048, 8, 128), jnp.bfloat16, sharding=heads)
seg = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=whole)
attend = jax.shard_map(lambda q, k, v, s, n: fp.causal_attention_cudnn_segments(q, k, v, s, n, sm_scale=0.1),
                       mesh=mesh, in_specs=(P(None, "tp"),) * 3 + (P(), P()), out_specs=P(None, "tp"))
text = jax.jit(attend).trace(q, kv, kv, seg, seg).lower(lowering_platforms=("cuda",)).as_text()
print("REPORT " + json.dumps([line.split(" : (")[-1] for line in text.splitlines() if "fmhaSoftmax" in line]))
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    (call,) = read_report(done.stdout)
    assert call.startswith("tensor<1x2048x16x128xbf16>, tensor<1x2048x4x128xbf16>, tensor<1x2048x4x128xbf16>, "
                           "tensor<1x2xi32>, tensor<1x2xi32>, tensor<1x3xi32>, tensor<1x3xi32>)"), call

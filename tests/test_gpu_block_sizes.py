"""The GPU tile-size lookup.

The fused-write kernel (``fused=True``): measured table entries decide near their shapes, heuristics
elsewhere. The default kernel: the frozen baseline's tiles everywhere (the table was measured on the
fused kernel), with session 19's split counts and Pallas merge.
"""

from pallas_kernels.paged_attention.block_sizes import BlockSizes, gpu_block_sizes

LLAMA = dict(num_kv_heads=8, group=4, head_dim=128, page_size=32, itemsize=2)
TABLE = (
    {"kind": "decode", "batch": 1, "context": 32768, "num_kv_heads": 8, "group": 4, "head_dim": 128,
     "page_size": 32, "itemsize": 2, "sizes": dict(block_q=4, block_kv=128, num_splits=33, num_warps=4,
                                                  num_stages=2, prefetch_pages=True, plan_in_kernel=True)},
    {"kind": "decode", "batch": 32, "context": 4096, "num_kv_heads": 8, "group": 4, "head_dim": 128,
     "page_size": 32, "itemsize": 2, "sizes": dict(block_q=4, block_kv=64, num_splits=2, num_warps=2,
                                                  num_stages=4, prefetch_pages=False, plan_in_kernel=True)},
    {"kind": "prefill", "num_tokens": 4128, "group": 4, "head_dim": 128, "page_size": 32, "itemsize": 2,
     "sizes": dict(block_q=32, block_kv=64, num_splits=1, num_warps=8, num_stages=2, prefetch_pages=True,
                   plan_in_kernel=False)},
)


def sizes(num_tokens, max_num_seqs, max_kv_len, table=TABLE, **shape):
    return gpu_block_sizes(num_tokens=num_tokens, max_num_seqs=max_num_seqs, max_kv_len=max_kv_len, table=table,
                           fused=True, **{**LLAMA, **shape})


# The pre-issue-21 kernel's sizes (block_q, block_kv, num_splits, num_warps, num_stages) per
# (num_tokens, max_num_seqs, max_kv_len, itemsize) for LLAMA's shape: what the default kernel must
# keep choosing (its measured speed is the baseline), and what the fused kernel's heuristic starts
# from. Written down from the frozen copy of that kernel before it was deleted (it had become
# gpu.py itself). Except the split counts of session 19 (rounded down to a power of two, not up:
# block_sizes._num_splits), where the frozen kernel had 64, 64 and 8; and session 20's for buckets of
# <= 8 slots, split as if one sequence were live (B=8 at 16k: 32, from 4).
PRE_ISSUE_21_SIZES = {
    (1, 1, 32768, 2): (4, 64, 32, 4, 4),
    (1, 1, 32768, 4): (4, 64, 32, 4, 2),
    (1, 1, 16384, 2): (4, 64, 32, 4, 4),
    (1, 1, 16384, 4): (4, 64, 32, 4, 2),
    (8, 8, 16384, 2): (4, 64, 32, 4, 4),
    (8, 8, 16384, 4): (4, 64, 32, 4, 2),
    (32, 32, 4096, 2): (4, 128, 1, 4, 3),
    (32, 32, 4096, 4): (4, 64, 1, 4, 2),
    (64, 64, 4096, 2): (4, 64, 1, 2, 3),
    (64, 64, 4096, 4): (4, 64, 1, 4, 2),
    (256, 256, 1024, 2): (4, 64, 1, 2, 3),
    (256, 256, 1024, 4): (4, 64, 1, 4, 2),
    (1, 1, 1024, 2): (4, 64, 4, 4, 4),
    (1, 1, 1024, 4): (4, 64, 4, 4, 2),
    (4128, 34, 2048, 2): (16, 32, 1, 4, 2),
    (4128, 34, 2048, 4): (16, 32, 1, 4, 2),
}
FIELDS = ("block_q", "block_kv", "num_splits", "num_warps", "num_stages")


def test_default_kernel_gets_the_pre_issue_21_sizes_and_ignores_the_table():
    for (num_tokens, max_num_seqs, max_kv_len, itemsize), expected in PRE_ISSUE_21_SIZES.items():
        shape = dict(LLAMA, itemsize=itemsize, num_tokens=num_tokens, max_num_seqs=max_num_seqs,
                     max_kv_len=max_kv_len)
        ours = gpu_block_sizes(**shape, table=TABLE)  # fused=False: the table is not read
        assert tuple(getattr(ours, f) for f in FIELDS) == expected, shape
        # The Pallas merge where the walk is split; page-id prefetch never (measured neutral or slower).
        assert ours.merge_kernel == (ours.num_splits > 1) and not ours.prefetch_pages, shape


def test_small_buckets_split_for_one_live_sequence():
    # Session 20 (small_bucket_decode.py, H200): one sequence at 32k in the engine's 8x8 bucket took
    # 225 us at the 4 splits that 8 live sequences want, 66 at 32. Buckets of 8 slots or fewer now
    # split as one live sequence does; larger ones by their slots, as before.
    def splits(slots, context):
        return gpu_block_sizes(num_tokens=slots, max_num_seqs=slots, max_kv_len=context, **LLAMA).num_splits

    assert splits(8, 32768) == splits(1, 32768) == 32
    assert splits(4, 16384) == splits(1, 16384)
    assert splits(8, 2048) == 8  # a short page table: each split keeps >= 4 blocks of 64
    assert splits(16, 4096) == 2 and splits(16, 32768) == 2  # 128 programs: the slots' count


def test_measured_shape_gets_its_entry():
    assert sizes(1, 1, 32768) == BlockSizes(**TABLE[0]["sizes"])
    assert sizes(32, 32, 4096) == BlockSizes(**TABLE[1]["sizes"])


def test_nearby_shape_keeps_the_entry_total_programs():
    # B=2 at 32k: twice the programs before splitting, so half the splits (33 * 8 / 16 -> 16 or 17).
    got = sizes(2, 2, 32768)
    assert got.block_kv == 128 and got.num_splits in (16, 17)
    # B=64 at 4k (programs x2): one split instead of two; B=32 at 8k: the same two.
    assert sizes(64, 64, 4096).num_splits == 1
    assert sizes(32, 32, 8192).num_splits == 2 and sizes(32, 32, 8192).prefetch_pages is False


def test_far_shapes_and_other_models_use_the_heuristics():
    heuristic = sizes(256, 256, 1024, table=())
    assert sizes(256, 256, 1024) == heuristic  # far from both decode entries
    assert sizes(1, 1, 32768, group=8) == sizes(1, 1, 32768, group=8, table=())  # another GQA ratio
    assert sizes(1, 1, 32768, itemsize=4) == sizes(1, 1, 32768, itemsize=4, table=())  # float32


def test_prefill_entry_by_token_count():
    assert sizes(4128, 34, 2048) == BlockSizes(**TABLE[2]["sizes"])
    assert sizes(300, 4, 2048) == sizes(300, 4, 2048, table=())  # 300 tokens: too far from 4128


def test_heuristics_match_the_frozen_baseline_where_nothing_is_measured():
    # GPU run 1: the current kernel at the heuristic's sizes must not lose to the baseline kernel,
    # so off-table shapes get the baseline's tiles and split count.
    for (num_tokens, max_num_seqs, max_kv_len, itemsize), expected in PRE_ISSUE_21_SIZES.items():
        ours = sizes(num_tokens, max_num_seqs, max_kv_len, table=(), **dict(LLAMA, itemsize=itemsize))
        if (num_tokens, max_num_seqs, max_kv_len) == (8, 8, 16384):  # the fused kernel splits by its slots
            expected = (4, 64, 4) + expected[3:]
        assert tuple(getattr(ours, f) for f in FIELDS[:4]) == expected[:4], (num_tokens, max_kv_len)
        # Session 20 (the fused kernel in the batch-1 step): where the walk is split, two stages, the
        # Pallas merge and no page-id prefetch; unsplit, the baseline's stages or fewer where the fused
        # kernel's tiles would overflow shared memory.
        split = ours.num_splits > 1
        assert ours.num_stages == 2 if split else 2 <= ours.num_stages <= expected[4]
        assert ours.merge_kernel == split and not ours.prefetch_pages


def test_the_fused_kernel_keeps_a_measured_entry_as_measured():
    # The table's entries carry their own mechanisms (prefetch, merge, stages): not replaced.
    assert sizes(1, 1, 32768) == BlockSizes(**TABLE[0]["sizes"])
    assert sizes(1, 1, 32768).prefetch_pages and sizes(1, 1, 32768).merge_kernel is False


def test_the_engines_batch_one_bucket_gets_the_session_20_fused_sizes():
    # Bucket 8x8 at a 2048-token page table (latency_lab.py's step): four splits over eight slots.
    got = sizes(8, 8, 2048, table=())
    assert got == BlockSizes(block_q=4, block_kv=64, num_splits=4, num_warps=4, num_stages=2,
                             prefetch_pages=False, plan_in_kernel=True, merge_kernel=True)


def test_sizes_fit_shared_memory():
    # Run 1 (H200): block_kv 128 at 3 stages asked for 303104 bytes of 232448; 64 at 4 stages ran.
    from pallas_kernels.paged_attention.block_sizes import _GPU_SHARED_MEMORY, _shared_memory_bytes
    assert _shared_memory_bytes(BlockSizes(4, 128, 1, 4, 3), 128, 2) > _GPU_SHARED_MEMORY
    assert _shared_memory_bytes(BlockSizes(4, 64, 1, 4, 4), 128, 2) <= _GPU_SHARED_MEMORY
    b32 = sizes(32, 32, 4096, table=())  # the heuristic's long-step tile for 1-2 programs per SM
    assert (b32.block_kv, b32.num_stages) == (128, 2)
    too_big = ({**TABLE[0], "sizes": {**TABLE[0]["sizes"], "block_kv": 256, "num_stages": 4}},)
    fitted = sizes(1, 1, 32768, table=too_big)
    assert _shared_memory_bytes(fitted, 128, 2) <= _GPU_SHARED_MEMORY and fitted.num_stages == 2
    for itemsize in (1, 2, 4):
        for tokens, seqs, ctx in [(1, 1, 32768), (32, 32, 4096), (256, 256, 1024), (4128, 34, 2048)]:
            got = sizes(tokens, seqs, ctx, table=(), itemsize=itemsize)
            assert _shared_memory_bytes(got, 128, itemsize) <= _GPU_SHARED_MEMORY


FP8_TABLE = ({"kind": "decode", "batch": 256, "context": 4096, "num_kv_heads": 8, "group": 4, "head_dim": 128,
              "page_size": 32, "itemsize": 2, "kv_itemsize": 1,
              "sizes": dict(block_q=4, block_kv=128, num_splits=1, num_warps=2, num_stages=3)},)


def test_default_kernel_over_fp8_pages_reads_the_fp8_table_near_its_shapes_only():
    shape = dict(LLAMA, num_tokens=256, max_num_seqs=256, max_kv_len=4096)
    fp8 = gpu_block_sizes(**shape, kv_itemsize=1, table=FP8_TABLE)
    assert (fp8.block_kv, fp8.num_warps, fp8.num_stages, fp8.num_splits) == (128, 2, 3, 1)
    # bf16 pages keep the baseline's sizes whatever table is passed; so do fp8 pages far from every entry.
    assert tuple(getattr(gpu_block_sizes(**shape, table=FP8_TABLE), f) for f in FIELDS) == (4, 64, 1, 2, 3)
    far = dict(LLAMA, num_tokens=1, max_num_seqs=1, max_kv_len=32768)
    assert tuple(getattr(gpu_block_sizes(**far, kv_itemsize=1, table=FP8_TABLE), f) for f in FIELDS) == \
        PRE_ISSUE_21_SIZES[(1, 1, 32768, 2)]


def test_fp8_table_adoption_keeps_only_entries_faster_than_the_sizes_in_use():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "adopt_frontier_run.py"
    spec = importlib.util.spec_from_file_location("adopt_frontier_run", path)
    adopt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(adopt)
    old = dict(FP8_TABLE[0], us=500.0, default_us=510.0)
    faster = dict(FP8_TABLE[0], us=400.0, default_us=450.0)
    slower = dict(FP8_TABLE[0], context=16384, us=900.0, default_us=880.0)
    entries, notes = adopt.merge_fp8_tables([old], [faster, slower])
    assert entries == [faster] and notes[0].startswith("adopted") and notes[1].startswith("skipped")
    entries, _ = adopt.merge_fp8_tables([old], [dict(old, us=520.0, default_us=500.0)])
    assert entries == [old]


def test_default_kernel_takes_its_fp8_sizes_from_the_pages_dtype(tmp_path, monkeypatch):
    # The wiring: ragged_paged_attention_gpu passes the pages' itemsize, so the fp8 table decides
    # for fp8 pages (here 8 warps, which no heuristic picks) and not for bf16 pages.
    import json

    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import block_sizes, ragged_paged_attention_gpu
    from tests.attention_cases import make_case

    case = make_case(3, [(1, 60), (1, 20)], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                     dtype=jnp.bfloat16)
    max_kv_len = case.page_tables.shape[1] * 16
    entry = {"kind": "decode", "batch": 2, "context": max_kv_len, "num_kv_heads": 2, "group": 4, "head_dim": 64,
             "page_size": 16, "itemsize": 2, "kv_itemsize": 1,
             "sizes": dict(block_q=4, block_kv=32, num_splits=1, num_warps=8, num_stages=2)}
    path = tmp_path / "gpu_fp8_decode_table.json"
    path.write_text(json.dumps({"source": "test", "entries": [entry]}))
    monkeypatch.setattr(block_sizes, "GPU_FP8_TABLE_PATH", path)

    def warps(cache_dtype):
        args = list(case.args())
        args[1:5] = [x.astype(cache_dtype) for x in args[1:5]]
        text = str(jax.make_jaxpr(lambda *a: ragged_paged_attention_gpu(*a, sm_scale=case.sm_scale,
                                                                        interpret=True))(*args))
        return "num_warps=8" in text

    assert warps(jnp.float8_e4m3fn) and not warps(jnp.bfloat16)

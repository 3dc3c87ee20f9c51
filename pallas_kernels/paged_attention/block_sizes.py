"""Tuned tile sizes for the paged-attention kernels, looked up from static shapes.

Kernels call ``gpu_block_sizes`` / ``tpu_block_sizes`` when the caller passes no explicit
sizes; nothing is picked by hand at a call site. Numbers come from the H200 sweeps in
docs/KERNELS.md (measurement notes); TPU sizes are untuned defaults sized for VMEM.

A batch is *decode-like* when it has no more tokens than sequence slots (every sequence
brings at most about one query): its tiles hold one token's query heads and long
contexts are split across programs (flash-decoding). Otherwise it is *prefill-like*:
large query tiles, no split.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

from pallas_kernels.paged_attention.work_tiles import next_power_of_2, num_work_tiles

# Measured table (``benchmarks/kernel_frontier.py`` writes it as gpu_decode_table.json; copied
# here with the run's results in benchmarks/results/). Absent: the heuristics below decide.
# Its entries were timed on the fused-write kernel (``gpu_fused.py``), so only that kernel reads
# it (``fused=True``); the default kernel takes the heuristics, which are the frozen baseline's.
GPU_TABLE_PATH = Path(__file__).with_name("gpu_decode_table.json")
# The default kernel over float8_e4m3fn pages (``kv_itemsize=1``): its own measured table, written by
# ``kernel_frontier.py --only fp8`` as gpu_fp8_decode_table.json and adopted with
# ``adopt_frontier_run.py``. An fp8 tile of block_kv tokens is half a bf16 tile's bytes, so the
# best sizes need not be bf16's. Absent, or no entry near a shape: bf16's heuristics decide.
GPU_FP8_TABLE_PATH = Path(__file__).with_name("gpu_fp8_decode_table.json")
# A measured entry decides for shapes within this distance: |log2| of the ratio of programs
# (tiles x KV heads, before splitting) plus |log2| of the ratio of contexts. 1.5 reaches, e.g.,
# from B=32 ctx 4k to B=64 ctx 4k or B=32 ctx 8k, not to B=256 ctx 1k.
_TABLE_REACH = 1.5

# Hopper: 132 SMs. Sweep (docs/KERNELS.md, v2): about 2 programs per SM was best for B=1 ctx 32k
# (32 splits) and B=8 ctx 16k (4 splits); more splits only added combine work (session 19 again).
_GPU_NUM_SMS = 132
_GPU_PROGRAMS_PER_SM = 2
# Each split walks at least this many KV tiles, or the combine step costs more than the split saves.
_MIN_TILES_PER_SPLIT = 4
_MAX_SPLITS = 64
# Decode buckets of at most this many sequence slots split the default kernel's walk as if one
# sequence were live. The engine's batch-1 steps run bucket 8x8, whose 8 slots (64 programs) made 4
# splits: one sequence at 32k then read its cache with 32 programs. H200, session 20, full call
# (small_bucket_decode.py): 225 us at 4 splits, 66 at 32 (the fused kernel 201 and 122). The cost
# when all 8 slots are live: B=8 at 16k 167 us at 32 splits (16: 163, 64: 171; decode_small_batch.py,
# same run) against 158 at 4 in session 19's run. At 384 tokens of context 4 / 16 / 32 splits timed
# 17.2 / 17.9 / 18.9 us (within the noise of calls that short). The fused kernel keeps the slots'
# count: at 384 tokens it took 14.5 us at 4 splits, 28.1 at 16 and 40.9 at 32.
_SPLIT_FOR_ONE_LIVE_MAX_SEQS = 8


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int  # query tokens per tile (rows = block_q * padded group)
    block_kv: int  # KV tokens per inner-loop step (any multiple or divisor of the page size)
    num_splits: int  # KV splits per tile (flash-decoding); 1 = no combine step
    num_warps: int = 4
    num_stages: int = 2
    # GPU only. Load the next KV block's page ids one step ahead, in the loop's carry (the default
    # kernel: in its unmasked loop, when forced; default_kernel_mechanisms keeps it off).
    prefetch_pages: bool = True
    # GPU only. Each program derives its tile from cu_q_lens itself (no XLA planning kernels).
    plan_in_kernel: bool = True
    # GPU only, with splits. Merge the partial results in one small Pallas kernel (else XLA ops,
    # the baseline's einsum merge). The fused kernel: off unless a measured table entry turns it
    # on. The default kernel: on with splits (default_kernel_mechanisms).
    merge_kernel: bool = False


# The default kernel's Pallas merge (one launch instead of XLA's two fusions: 56 against 86 us a
# step in the batch-1 engine step's trace, bucket 8x8, 8 splits; latency_lab.py, session 19) is on
# wherever the KV walk is split. Its page-id prefetch (the unmasked loop carries the next block's
# page ids) stays off: at the session-19 split counts it changed nothing beyond the noise (H200,
# full call, decode_small_batch.py: B=1 32k 58.1 us with prefetch and merge against 58.6 without
# either, B=8 16k 157.8 / 156.2, B=16 4k 91.3 / 89.5), and unsplit it was slower (B=32 4k 158
# against 146 us: the carried page ids keep Triton's pipeliner from loading blocks more than one
# step ahead, where without them it hoists the page-table load too). It stays an option for sweeps.
def default_kernel_mechanisms(sizes: BlockSizes) -> BlockSizes:
    """``sizes`` with the default kernel's prefetch and merge set for its split count."""
    return dataclasses.replace(sizes, prefetch_pages=False, merge_kernel=sizes.num_splits > 1)


# The fused kernel (opt-in) where no measured table entry reaches: the default kernel's mechanisms,
# and two pipeline stages where the walk is split (an unsplit walk keeps the heuristics' depth). H200,
# session 20, the batch-1 step of latency_lab.py (bucket 8x8, context 384) with the fused kernel for
# attention: 5.128 ms a step at the old heuristics (prefetch on, XLA's merge, 4 stages), 4.544 with
# prefetch off and the Pallas merge, 4.499 with two stages as well, against 4.618 for the default
# kernel and XLA's K/V scatters in the same run. Alone (full call, 64 chained): 27.5 us at the old
# heuristics, 15.6 without prefetch, 14.9 at two stages, the default kernel 14.2. The engine's batch-1
# latency did not follow the lab (4.39 ms per token with the fused kernel for steps of <= 8 slots,
# 4.35 without, one call after the other), so "auto" keeps the default kernel (docs/KERNELS.md).
def fused_kernel_mechanisms(sizes: BlockSizes) -> BlockSizes:
    """``sizes`` with the fused kernel's prefetch, merge and pipeline depth for its split count."""
    sizes = default_kernel_mechanisms(sizes)
    return dataclasses.replace(sizes, num_stages=2) if sizes.num_splits > 1 else sizes


# Hopper's shared memory per block (227 KiB). GPU run 1 (H200): the current kernel asked for 303104
# bytes at block_kv 128, 3 stages, bf16, d 128 (about 3 bytes per KV element per stage: K and V
# tiles plus the fused write's new rows), so that tile no longer fits where the baseline's did.
_GPU_SHARED_MEMORY = 232448
_SHARED_BYTES_PER_KV_ELEMENT = 3
# The default kernel stages only the K and V tiles (its 128 x 3-stage tile ran in runs 1 and 2).
_SHARED_BYTES_PER_KV_ELEMENT_DEFAULT = 2


def _shared_memory_bytes(sizes: BlockSizes, head_dim: int, itemsize: int, fused: bool = True) -> int:
    per_element = _SHARED_BYTES_PER_KV_ELEMENT if fused else _SHARED_BYTES_PER_KV_ELEMENT_DEFAULT
    return sizes.num_stages * sizes.block_kv * head_dim * itemsize * per_element


def _fit_shared_memory(sizes: BlockSizes, head_dim: int, itemsize: int, fused: bool = True) -> BlockSizes:
    """Fewer pipeline stages (down to 2), then shorter KV steps, until the estimate fits shared memory."""
    while _shared_memory_bytes(sizes, head_dim, itemsize, fused) > _GPU_SHARED_MEMORY:
        if sizes.num_stages > 2:
            sizes = dataclasses.replace(sizes, num_stages=sizes.num_stages - 1)
        elif sizes.block_kv > 16:
            sizes = dataclasses.replace(sizes, block_kv=sizes.block_kv // 2)
        else:
            break
    return sizes


def is_decode_like(num_tokens: int, max_num_seqs: int) -> bool:
    return num_tokens <= max_num_seqs


def _num_splits(num_programs: int, max_kv_len: int, block_kv: int, target_programs: int) -> int:
    """Splits bringing ``num_programs`` up to at most ``target_programs`` (a power of two, rounded down).

    Rounded down since session 19: rounding up (8 programs -> 64 splits for a 264 target) gave
    B=1 at 16k-32k twice the splits it wants. H200, full call with prefetch and the Pallas merge
    (decode_small_batch.py, two runs): B=1 32k 32 splits 59.2 / 57.7 us against 64 splits 58.6 /
    70.0; B=1 16k 32 splits 42.3 / 41.2 (16: 40.1 / 38.2) against 64 splits 50.9 / 50.7; B=8 16k
    4 splits 151.8 / 150.5 against 8 splits 149.0 / 169.0; B=16 4k 2 splits 92.6 against 4 splits
    93.1. Against session 18's sizes in one run: B=1 32k 69.0 -> 58.1 us, B=8 16k 180.4 -> 157.8.
    """
    max_useful = max(1, max_kv_len // (block_kv * _MIN_TILES_PER_SPLIT))
    wanted = max(1, target_programs // max(num_programs, 1))
    splits = 1 << (wanted.bit_length() - 1)  # the largest power of two <= wanted
    return max(1, min(splits, max_useful, _MAX_SPLITS))


@functools.cache
def _measured_table(path: Path = GPU_TABLE_PATH) -> tuple[dict, ...]:
    if not path.exists():
        return ()
    return tuple(json.loads(path.read_text())["entries"])


def _from_table(kind: str, *, programs: int, num_tokens: int, max_kv_len: int, num_kv_heads: int, group: int,
                head_dim: int, itemsize: int, table=None) -> BlockSizes | None:
    """The nearest measured entry's sizes, its split count rescaled to keep its total programs; or None."""
    best, best_distance = None, _TABLE_REACH
    for entry in _measured_table() if table is None else table:
        if (entry.get("kind", "decode") != kind or entry["group"] != group or entry["head_dim"] != head_dim
                or entry["itemsize"] != itemsize):
            continue
        if kind == "decode":
            entry_programs = entry["batch"] * entry["num_kv_heads"]
            distance = abs(math.log2(entry_programs / programs)) + abs(math.log2(entry["context"] / max_kv_len))
        else:
            distance = abs(math.log2(entry["num_tokens"] / num_tokens))
        if distance <= best_distance:
            best, best_distance = entry, distance
    if best is None:
        return None
    sizes = BlockSizes(**best["sizes"])
    if kind == "decode":
        splits = round(sizes.num_splits * best["batch"] * best["num_kv_heads"] / programs)
        max_useful = max(1, max_kv_len // (sizes.block_kv * 2))
        sizes = dataclasses.replace(sizes, num_splits=max(1, min(splits, max_useful, _MAX_SPLITS * 2)))
    return sizes


def gpu_block_sizes(
    *, num_tokens: int, max_num_seqs: int, max_kv_len: int, num_kv_heads: int, group: int,
    head_dim: int, page_size: int, itemsize: int, table=None, fused: bool = False, kv_itemsize: int | None = None,
) -> BlockSizes:
    """Tile sizes for the GPU kernels.

    ``itemsize`` is the query's; ``kv_itemsize`` the pages' (None: the same). ``fused=False`` (the
    default kernel, ``ragged_paged_attention_gpu``): over bf16/f32 pages the heuristics, the frozen
    baseline's tiles and splits; over float8 pages (``kv_itemsize=1``) the nearest entry of the fp8
    table (gpu_fp8_decode_table.json), else the same heuristics. ``fused=True``
    (``ragged_paged_attention_gpu_fused``): the nearest entry of gpu_decode_table.json as measured,
    else the heuristics with ``fused_kernel_mechanisms``. ``table`` replaces whichever measured
    table applies (tests); entries are dicts as in those files. Either way the sizes are cut to fit
    that kernel's shared memory (``_fit_shared_memory``, counting the pages' bytes).
    """
    fp8_pages = kv_itemsize == 1
    if not fused:
        table = (table if table is not None else _measured_table(GPU_FP8_TABLE_PATH)) if fp8_pages else ()
    sizes, measured = _gpu_block_sizes(num_tokens=num_tokens, max_num_seqs=max_num_seqs, max_kv_len=max_kv_len,
                                       num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                                       page_size=page_size, itemsize=itemsize, table=table,
                                       split_for_one_live=not fused)
    if not fused:  # the fp8 table's entries never set these: they were timed before the kernel had them
        sizes = default_kernel_mechanisms(sizes)
    elif not measured:
        sizes = fused_kernel_mechanisms(sizes)
    return _fit_shared_memory(sizes, head_dim, kv_itemsize or itemsize, fused)


def _gpu_block_sizes(
    *, num_tokens: int, max_num_seqs: int, max_kv_len: int, num_kv_heads: int, group: int,
    head_dim: int, page_size: int, itemsize: int, table=None, split_for_one_live: bool = True,
) -> tuple[BlockSizes, bool]:
    """(sizes, whether they are a measured table entry's) before any kernel's mechanisms."""
    measured = _from_table("decode" if is_decode_like(num_tokens, max_num_seqs) else "prefill",
                           programs=_programs(num_tokens, max_num_seqs, num_kv_heads, group), num_tokens=num_tokens,
                           max_kv_len=max_kv_len, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                           itemsize=itemsize, table=table)
    if measured is not None:
        return measured, True
    return _heuristic_sizes(num_tokens=num_tokens, max_num_seqs=max_num_seqs, max_kv_len=max_kv_len,
                            num_kv_heads=num_kv_heads, group=group, itemsize=itemsize,
                            split_for_one_live=split_for_one_live), False


def _programs(num_tokens: int, max_num_seqs: int, num_kv_heads: int, group: int) -> int:
    """Programs of the walk before any split, at the query tiles the heuristics take."""
    block_q = max(1, (16 if is_decode_like(num_tokens, max_num_seqs) else 64) // next_power_of_2(group))
    return num_work_tiles(num_tokens, max_num_seqs, block_q) * num_kv_heads


def _heuristic_sizes(
    *, num_tokens: int, max_num_seqs: int, max_kv_len: int, num_kv_heads: int, group: int, itemsize: int,
    split_for_one_live: bool,
) -> BlockSizes:
    group_padded = next_power_of_2(group)
    if is_decode_like(num_tokens, max_num_seqs):
        # Triton's dot wants >= 16 rows; extra rows are masked queries, free in a read-bound loop.
        block_q = max(1, 16 // group_padded)
        num_tiles = num_work_tiles(num_tokens, max_num_seqs, block_q)
        programs = num_tiles * num_kv_heads
        # Split the KV walk (flash-decoding) only when there are fewer programs than SMs.
        splits = 1
        if programs < _GPU_NUM_SMS:
            # A bucket of few slots is mostly empty at batch 1: split for one live sequence
            # (_SPLIT_FOR_ONE_LIVE_MAX_SEQS says why; the fused kernel keeps the slots' count).
            one_live = split_for_one_live and max_num_seqs <= _SPLIT_FOR_ONE_LIVE_MAX_SEQS
            live_programs = num_kv_heads if one_live else programs
            splits = _num_splits(live_programs, max_kv_len, 64, _GPU_NUM_SMS * _GPU_PROGRAMS_PER_SM)
        if itemsize > 2:  # f32 tiles are twice the bytes: two stages of 64 rows fit shared memory
            return BlockSizes(block_q=block_q, block_kv=64, num_splits=splits, num_warps=4, num_stages=2)
        # From the H200 sweep of session 4 (docs/KERNELS.md; bf16, page 32, d 128, 32/8 heads):
        if splits > 1:
            # Few sequences, long contexts: B=8 ctx 16k 145 us (3.69 TB/s), the best of 5 variants.
            return BlockSizes(block_q=block_q, block_kv=64, num_splits=splits, num_warps=4, num_stages=4)
        if programs < _GPU_NUM_SMS * _GPU_PROGRAMS_PER_SM:
            # One or two programs per SM (B=32 ctx 4k: 256): longer steps; 151 us vs 156 for two
            # splits of 64/4/4 and 163 for one (baseline kernel). The current kernel needs two
            # stages at 128 (shared memory, run 1): _fit_shared_memory cuts it.
            return BlockSizes(block_q=block_q, block_kv=128, num_splits=1, num_warps=4, num_stages=3)
        # Many programs: two warps and three stages let two programs share an SM. B=64 ctx 4k
        # 278 us vs 339 for 64/4/4; B=128 ctx 2k 274 vs 291; B=384 ctx 1-2k within 2% of the best.
        return BlockSizes(block_q=block_q, block_kv=64, num_splits=1, num_warps=2, num_stages=3)
    # 64 rows (16 tokens of 4 heads) x 32 KV tokens, 4 warps, 2 stages: the best of 27 variants
    # on a 4k-token prefill (396 us vs 430 for 64 KV tokens, 504 for 128 rows x 128, 8 warps).
    block_q = max(1, 64 // group_padded)
    return BlockSizes(block_q=block_q, block_kv=32, num_splits=1, num_warps=4, num_stages=2)


def tpu_block_sizes(
    *, num_tokens: int, max_num_seqs: int, max_kv_len: int, num_kv_heads: int, group: int,
    head_dim: int, page_size: int, itemsize: int,
) -> BlockSizes:
    group_padded = next_power_of_2(group)
    # Sublane tiling wants >= 8 rows (16 for 16-bit types).
    min_rows = 16 if itemsize <= 2 else 8
    if is_decode_like(num_tokens, max_num_seqs):
        block_q = max(1, min_rows // group_padded)
    else:
        block_q = max(1, 128 // group_padded)
    # One DMA per page; a KV tile is a whole number of pages, about 512 tokens.
    block_kv = max(page_size, min(512, max_kv_len))
    block_kv = max(page_size, block_kv - block_kv % page_size)
    return BlockSizes(block_q=block_q, block_kv=block_kv, num_splits=1)

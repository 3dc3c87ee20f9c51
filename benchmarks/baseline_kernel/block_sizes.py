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

from benchmarks.baseline_kernel.work_tiles import next_power_of_2, num_work_tiles

# Hopper: 132 SMs. Sweep (docs/KERNELS.md, v2): about 2 programs per SM was best for B=1 ctx 32k
# (32 splits) and B=8 ctx 16k (4 splits); more splits only added combine work.
_GPU_NUM_SMS = 132
_GPU_PROGRAMS_PER_SM = 2
# Each split walks at least this many KV tiles, or the combine step costs more than the split saves.
_MIN_TILES_PER_SPLIT = 4
_MAX_SPLITS = 64


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int  # query tokens per tile (rows = block_q * padded group)
    block_kv: int  # KV tokens per inner-loop step (any multiple or divisor of the page size)
    num_splits: int  # KV splits per tile (flash-decoding); 1 = no combine step
    num_warps: int = 4
    num_stages: int = 2


def is_decode_like(num_tokens: int, max_num_seqs: int) -> bool:
    return num_tokens <= max_num_seqs


def _num_splits(num_programs: int, max_kv_len: int, block_kv: int, target_programs: int) -> int:
    max_useful = max(1, max_kv_len // (block_kv * _MIN_TILES_PER_SPLIT))
    splits = next_power_of_2(max(1, -(-target_programs // max(num_programs, 1))))
    return max(1, min(splits, max_useful, _MAX_SPLITS))


def gpu_block_sizes(
    *, num_tokens: int, max_num_seqs: int, max_kv_len: int, num_kv_heads: int, group: int,
    head_dim: int, page_size: int, itemsize: int,
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
            splits = _num_splits(programs, max_kv_len, 64, _GPU_NUM_SMS * _GPU_PROGRAMS_PER_SM)
        if itemsize > 2:  # f32 tiles are twice the bytes: two stages of 64 rows fit shared memory
            return BlockSizes(block_q=block_q, block_kv=64, num_splits=splits, num_warps=4, num_stages=2)
        # From the H200 sweep of session 4 (docs/KERNELS.md; bf16, page 32, d 128, 32/8 heads):
        if splits > 1:
            # Few sequences, long contexts: B=8 ctx 16k 145 us (3.69 TB/s), the best of 5 variants.
            return BlockSizes(block_q=block_q, block_kv=64, num_splits=splits, num_warps=4, num_stages=4)
        if programs < _GPU_NUM_SMS * _GPU_PROGRAMS_PER_SM:
            # One or two programs per SM (B=32 ctx 4k: 256): longer steps; 151 us vs 156 for two
            # splits of 64/4/4 and 163 for one.
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

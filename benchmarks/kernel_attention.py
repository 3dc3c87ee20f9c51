"""Benchmark of paged attention on one GPU: the `kernel-decode` and `kernel-prefill` workloads.

Side by side in one run: our Pallas kernel (``ragged_paged_attention_gpu``), jax's bundled
Pallas-Triton ``paged_attention`` (decode only), cuDNN dense attention on a contiguous cache
of the same shape, and the plain-XLA reference; plus the ceilings measured in the same run
(HBM read: a jitted read-only reduction; bf16 matmul rate). Each implementation is timed as
32 chained calls unrolled in one jitted program (each output is the next query), so
nothing is hoisted and no Python dispatch is timed. Ours is timed as its full call (this
step's K/V written into the cache inside the kernel, then attention; the cache donated into
the chain), the others as attention alone. Implementations run one at a time and
free their arrays; shapes whose cache does not fit are skipped and reported.

    python3 benchmarks/kernel_attention.py --out DIR [--stages check,ceilings,decode,pages,prefill,copies]

``--kv-dtype fp8``: the decode stages read float8_e4m3fn pages (bytes counted at 1 a value; our
kernel and the reference only, the bundled kernel and cuDNN take no FP8 cache).

Writes DIR/kernel_attention.json, .md and (when matplotlib is there) .png.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from common import time_in_loop  # noqa: E402

from pallas_kernels.paged_attention import gpu as gpu_kernel  # noqa: E402
from pallas_kernels.paged_attention.block_sizes import BlockSizes, gpu_block_sizes  # noqa: E402
from pallas_kernels.paged_attention.reference import (  # noqa: E402
    attend_reference,
    ragged_paged_attention_reference,
)
from tests.attention_cases import make_case  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
DTYPE = jnp.bfloat16
CACHE_BUDGET_BYTES = 40e9  # K+V of one implementation at a time; the contiguous copy for cuDNN is extra
LOG = []


def say(*parts):
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LOG.append(line)


def pseudo_random(shape, seed, dtype=DTYPE, scale=1.0):
    """Hash of the element index, in one fused XLA loop: no f32 temporaries the size of a cache."""

    @jax.jit
    def fill():
        index = jnp.zeros(shape, jnp.uint32)
        stride = 1
        for axis in reversed(range(len(shape))):
            index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride & 0xFFFFFFFF)
            stride *= shape[axis]
        x = index * jnp.uint32(2654435761) + jnp.uint32(seed * 97 + 13)
        x = x ^ (x >> 15)
        x = x * jnp.uint32(2246822519)
        x = x ^ (x >> 13)
        unit = (x & jnp.uint32(0xFFFF)).astype(jnp.float32) / 65536.0 - 0.5
        return (unit * (2 * scale)).astype(dtype)

    return fill()


def time_loop(step, x0, *consts, repeats: int = 32):
    """Seconds per call of ``step(x, *consts) -> x``: ``repeats`` chained calls unrolled in one jit.

    Unrolled rather than a ``fori_loop``: on the GPU a while loop syncs its predicate with
    the host every iteration, which inflated calls under ~150 µs in the first H200 runs.
    """
    return time_in_loop(step, x0, *consts, unroll=repeats)


def measure_ceilings():
    x = pseudo_random((4 * 1024**3,), 1)  # 8 GiB of bf16
    t = time_loop(lambda c, x: c + jnp.sum(x + c.astype(x.dtype), dtype=jnp.float32) * 1e-30, jnp.float32(0), x)
    read_tbs = x.size * 2 / t / 1e12
    del x
    n = 8192
    a = pseudo_random((n, n), 2, scale=1.0)
    b = pseudo_random((n, n), 3, scale=1.0 / math.sqrt(n) * 1.7)
    t = time_loop(lambda a, b: (a @ b).astype(DTYPE), a, b)
    mm = 2 * n**3 / t / 1e12
    say(f"ceiling: HBM read {read_tbs:.2f} TB/s (sum over 8 GiB bf16); bf16 matmul {mm:.0f} TFLOP/s (8192^3)")
    return {"hbm_read_tbs": read_tbs, "matmul_tflops": mm}


def decode_inputs(batch, context, page_size, seed=0, kv_dtype=DTYPE):
    # A context that ends mid-page (as the engine's mostly do) gets its last page, partly filled,
    # and its walk ends in a masked block; a multiple of the block size has no masked block.
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    rng = np.random.default_rng(seed)
    # A random permutation: pages of one sequence are scattered, as after long serving.
    page_tables = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq).astype(np.int32))
    shape = (NUM_KV_HEADS, num_pages, page_size, HEAD_DIM)
    k_pages, v_pages = pseudo_random(shape, 4, kv_dtype), pseudo_random(shape, 5, kv_dtype)
    q = pseudo_random((batch, NUM_Q_HEADS, HEAD_DIM), 6, scale=2.0)
    kv_lens = jnp.full((batch,), context, jnp.int32)
    cu_q_lens = jnp.arange(batch + 1, dtype=jnp.int32)
    return q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens


def time_ours(sizes, args):
    """Seconds per full call of our default kernel (XLA scatter of the K/V, then attention); returns (seconds, args).

    The cache rides in the chain's carry and is donated, as in the engine: the kernel writes it in
    place, and a non-donated cache would be copied on every call. The returned args hold the
    same shapes (the donated inputs are gone), for the timings that follow.
    """
    q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens = args
    k_new = pseudo_random((q.shape[0], NUM_KV_HEADS, HEAD_DIM), 20)

    def step(state, k_new, page_tables, cu_q_lens, kv_lens):
        q, k, v = state  # the output becomes the next query, so every call stays live
        return gpu_kernel.attend_and_write_gpu(q, k_new, k_new, k, v, page_tables, cu_q_lens, kv_lens,
                                               sm_scale=HEAD_DIM**-0.5, sizes=sizes)

    chain = jax.jit(lambda state, *c: functools.reduce(lambda s, _: step(s, *c), range(32), state),
                    donate_argnums=(0,))
    state = jax.block_until_ready(chain((q, k_pages, v_pages), k_new, page_tables, cu_q_lens, kv_lens))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        state = jax.block_until_ready(chain(state, k_new, page_tables, cu_q_lens, kv_lens))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / 32, (*state, page_tables, cu_q_lens, kv_lens)


def ours_sizes(num_tokens, max_num_seqs, max_kv_len, page_size, kv_itemsize=2, **overrides):
    tuned = gpu_block_sizes(num_tokens=num_tokens, max_num_seqs=max_num_seqs, max_kv_len=max_kv_len,
                            num_kv_heads=NUM_KV_HEADS, group=NUM_Q_HEADS // NUM_KV_HEADS, head_dim=HEAD_DIM,
                            page_size=page_size, itemsize=2, kv_itemsize=kv_itemsize)
    # None means "the tuned value"; False and 0 are values (e.g. prefetch_pages=False).
    fields = {f: getattr(tuned, f) if overrides.get(f) is None else overrides[f]
              for f in BlockSizes.__dataclass_fields__}
    return BlockSizes(**fields)


def reference_step(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens):
    return attend_reference(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=HEAD_DIM**-0.5)


def bundled_step(k_splits, pages_per_compute_block):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    def step(q, k_pages, v_pages, page_tables, lengths):
        return paged_attention(q, k_pages, v_pages, page_tables, lengths, k_splits=k_splits,
                               pages_per_compute_block=pages_per_compute_block)
    return step


def cudnn_step(q, k, v):  # q [B, 1, Hq, D], k/v [B, S, Hkv, D] contiguous
    out = jax.nn.dot_product_attention(q, k, v, scale=HEAD_DIM**-0.5, implementation="cudnn")
    return out.astype(q.dtype)


def run_decode(ceil, batches, contexts, page_size, impls, results, save=lambda: None, kv_dtype=DTYPE):
    kv_dtype = jnp.dtype(kv_dtype)
    if kv_dtype.itemsize == 1:
        impls = impls & {"ours", "reference"}  # the bundled kernel and cuDNN take no FP8 cache
    for context in contexts:
        save()
        for batch in batches:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * kv_dtype.itemsize
            row = {"workload": "kernel-decode", "batch": batch, "context": context, "page_size": page_size,
                   "kv_bytes": kv_bytes, "kv_dtype": kv_dtype.name}
            if kv_bytes > CACHE_BUDGET_BYTES:
                row["skipped"] = f"K/V {kv_bytes / 1e9:.0f} GB over the {CACHE_BUDGET_BYTES / 1e9:.0f} GB budget"
                say(f"decode B={batch} ctx={context}: skipped ({row['skipped']})")
                results.append(row)
                continue
            args = decode_inputs(batch, context, page_size, kv_dtype=kv_dtype)
            q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens = args
            if "ours" in impls:
                sizes = ours_sizes(batch, batch, context, page_size, kv_itemsize=kv_dtype.itemsize)
                row["ours_s"], args = time_ours(sizes, args)
                q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens = args
                row["ours_sizes"] = sizes.__dict__
            if "reference" in impls and kv_bytes <= 4.5e9:
                row["reference_s"] = time_loop(reference_step, *args)
            if "bundled" in impls:
                best = None
                ppcb = max(1, 128 // page_size)
                for k_splits in (1, 16):
                    if page_tables.shape[1] % (k_splits * ppcb):
                        continue
                    t = time_loop(bundled_step(k_splits, ppcb), q, k_pages, v_pages, page_tables, kv_lens)
                    if best is None or t < best[0]:
                        best = (t, k_splits)
                if best:
                    row["bundled_s"], row["bundled_k_splits"] = best
            del args, k_pages, v_pages
            if "cudnn" in impls:
                shape = (batch, context, NUM_KV_HEADS, HEAD_DIM)
                k, v = pseudo_random(shape, 7), pseudo_random(shape, 8)
                try:
                    row["cudnn_s"] = time_loop(cudnn_step, q.reshape(batch, 1, NUM_Q_HEADS, HEAD_DIM), k, v)
                except Exception as e:  # cuDNN refuses some shapes; say which
                    row["cudnn_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                del k, v
            for impl in ("ours", "bundled", "cudnn", "reference"):
                if f"{impl}_s" in row:
                    row[f"{impl}_tbs"] = kv_bytes / row[f"{impl}_s"] / 1e12
            parts = [f"{i} {row[i + '_s'] * 1e6:8.1f}us {row[i + '_tbs']:.2f}TB/s"
                     for i in ("ours", "bundled", "cudnn", "reference") if f"{i}_s" in row]
            say(f"decode ps={page_size} B={batch:4d} ctx={context:6d}: " + " | ".join(parts))
            results.append(row)


def prefill_inputs(prefill_tokens, num_decode, decode_context, page_size, chunk):
    """Prefill chunks of ``chunk`` tokens (fresh sequences) plus ``num_decode`` decode tokens."""
    seqs = [(chunk, chunk)] * (prefill_tokens // chunk) + [(1, decode_context)] * num_decode
    return ragged_inputs(seqs, page_size)


def ragged_inputs(seqs, page_size, num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM):
    """A ragged batch of ``(q_len, kv_len)`` sequences over scattered pages; returns (args, causal FLOPs).

    args: ``(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)``. FLOPs count 4 * D * Hq per
    visible (query, key) pair, the causal count every prefill benchmark uses.
    """
    q_lens = np.array([s[0] for s in seqs]); kv_lens = np.array([s[1] for s in seqs])
    pages = -(-kv_lens // page_size)
    pages_per_seq = int(pages.max())
    rng = np.random.default_rng(1)
    physical = rng.permutation(int(pages.sum()))
    table = np.zeros((len(seqs), pages_per_seq), np.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = physical[start:start + n]
        start += n
    shape = (num_kv_heads, int(pages.sum()), page_size, head_dim)
    num_tokens = int(q_lens.sum())
    q = pseudo_random((num_tokens, num_q_heads, head_dim), 9, scale=2.0)
    flops = sum(causal_flops(q_len, kv_len, num_q_heads, head_dim) for q_len, kv_len in seqs)
    args = (q, pseudo_random(shape, 10), pseudo_random(shape, 11), jnp.asarray(table),
            jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)), jnp.asarray(kv_lens.astype(np.int32)))
    return args, flops


def causal_flops(q_len, kv_len, num_q_heads=NUM_Q_HEADS, head_dim=HEAD_DIM):
    """4 * D * Hq per visible pair: the chunk's last ``q_len`` positions of ``kv_len``, causal."""
    visible = q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2
    return 4 * head_dim * num_q_heads * visible


def run_prefill(ceil, page_size, results, impls):
    for prefill_tokens in (1024, 2048, 4096, 8192):
        for chunk in sorted({min(prefill_tokens, 2048), prefill_tokens}):
            args, flops = prefill_inputs(prefill_tokens, 32, 2048, page_size, chunk)
            row = {"workload": "kernel-prefill", "prefill_tokens": prefill_tokens, "chunk": chunk,
                   "decode_tokens": 32, "decode_context": 2048, "page_size": page_size, "flops": flops}
            num_tokens, num_seqs = args[0].shape[0], args[5].shape[0]
            sizes = ours_sizes(num_tokens, num_seqs, int(args[3].shape[1]) * page_size, page_size)
            row["ours_sizes"] = sizes.__dict__
            row["ours_s"], args = time_ours(sizes, args)
            if "reference" in impls and prefill_tokens <= 2048:
                row["reference_s"] = time_loop(reference_step, *args)
            if "cudnn" in impls:
                # Peer: cuDNN causal attention of the same prefill chunks, contiguous, without the decode tokens.
                n = prefill_tokens // chunk
                qd = pseudo_random((n, chunk, NUM_Q_HEADS, HEAD_DIM), 12)
                kd = pseudo_random((n, chunk, NUM_KV_HEADS, HEAD_DIM), 13)
                vd = pseudo_random((n, chunk, NUM_KV_HEADS, HEAD_DIM), 14)
                step = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
                    q, k, v, scale=HEAD_DIM**-0.5, is_causal=True, implementation="cudnn").astype(q.dtype)
                try:
                    row["cudnn_s"] = time_loop(step, qd, kd, vd)
                    row["cudnn_flops"] = n * 4 * HEAD_DIM * NUM_Q_HEADS * chunk * (chunk + 1) // 2
                except Exception as e:
                    row["cudnn_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            row["ours_tflops"] = flops / row["ours_s"] / 1e12
            if "reference_s" in row:
                row["reference_tflops"] = flops / row["reference_s"] / 1e12
            if "cudnn_s" in row:
                row["cudnn_tflops"] = row["cudnn_flops"] / row["cudnn_s"] / 1e12
            say(f"prefill {prefill_tokens} tokens in chunks of {chunk} + 32 decode: ours {row['ours_s'] * 1e6:.0f}us "
                f"{row['ours_tflops']:.0f} TFLOP/s ({row['ours_tflops'] / ceil['matmul_tflops']:.0%} of matmul)"
                + (f" | cudnn {row['cudnn_tflops']:.0f}" if "cudnn_tflops" in row else "")
                + (f" | reference {row['reference_tflops']:.1f}" if "reference_tflops" in row else ""))
            results.append(row)


def check_correctness():
    """Kernel vs reference on the GPU (compiled, not interpreted), fresh random data each case."""
    worst = 0.0
    cases = [
        dict(seqs=[(1, 700), (0, 0), (1, 16), (1, 1)] * 4, page_size=16),
        dict(seqs=[(300, 300), (1, 2000), (37, 500), (0, 0), (128, 128)], page_size=32),
        dict(seqs=[(1, 5000)] * 2, page_size=64),
    ]
    for i, kw in enumerate(cases):
        for dtype in (jnp.bfloat16, jnp.float32):
            case = make_case(i, kw["seqs"], num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                             page_size=kw["page_size"], dtype=dtype, pad_tokens=3)
            ref = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale)[0].astype(jnp.float32)
            args = [jnp.array(a) for a in case.args()]
            out = gpu_kernel.ragged_paged_attention_gpu(*args, sm_scale=case.sm_scale)[0].astype(jnp.float32)
            err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            nan = bool(jnp.isnan(out).any())
            say(f"check case {i} {jnp.dtype(dtype).name}: rel err {err:.2e} nan={nan}")
            worst = max(worst, err if not nan else float("inf"))
    return max(worst, check_segments_path())


def check_segments_path():
    """Hopper's prefill default (cuDNN over the fresh prompts as segments, Triton writing the other rows
    into cuDNN's output) against the reference: two fresh prompts of >= 1000 tokens at offsets with rows
    between them, decode rows, a chunk over a cached prefix and padding rows, which must be exactly 0."""
    from pallas_kernels.paged_attention import gpu_fresh_prefill

    seqs = [(1, 700), (1200, 1200), (0, 0), (37, 500), (1500, 1500), (1, 16)]
    case = make_case(7, seqs, num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, page_size=32,
                     dtype=jnp.bfloat16, pad_tokens=3)
    ref = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale)[0].astype(jnp.float32)
    out = gpu_fresh_prefill.ragged_paged_attention_gpu_fresh_prefill(
        *[jnp.array(a) for a in case.args()], sm_scale=case.sm_scale, cudnn_segments=True,
        min_fresh_tokens=gpu_fresh_prefill.SEGMENTS_MIN_FRESH_TOKENS)[0].astype(jnp.float32)
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    nan = bool(jnp.isnan(out).any())
    padding = out[int(case.cu_q_lens[-1]):]
    padding_zero = bool(padding.shape[0] == 3 and (padding == 0).all())
    say(f"check segments path: rel err {err:.2e} nan={nan} padding rows zero={padding_zero}")
    return err if not nan and padding_zero else float("inf")


def check_copies(page_size=16):
    """Compile the full donated call and look for a copy of cache size in the optimized HLO."""
    args = decode_inputs(64, 4096, page_size)
    q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens = args
    k_new = pseudo_random((64, NUM_KV_HEADS, HEAD_DIM), 15)
    compiled = gpu_kernel.ragged_paged_attention_gpu.lower(
        q, k_new, k_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=HEAD_DIM**-0.5).compile()
    text = compiled.as_text()
    cache_dims = ",".join(str(d) for d in k_pages.shape)
    flat_dims = f"{NUM_KV_HEADS},{k_pages.shape[1] * page_size},{HEAD_DIM}"
    copies = [line.strip()[:160] for line in text.splitlines()
              if ("copy(" in line or "copy-start" in line) and (cache_dims in line or flat_dims in line)]
    aliased = "input_output_alias" in text
    say(f"compiled program: input_output_alias={aliased}; cache-sized copies: {len(copies)}")
    for c in copies:
        say("   ", c)

    def step(state, k_new, page_tables, cu_q_lens, kv_lens):
        q, k, v = state  # the output becomes the next query, so every call stays live
        return gpu_kernel.ragged_paged_attention_gpu(
            q, k_new, k_new, k, v, page_tables, cu_q_lens, kv_lens, sm_scale=HEAD_DIM**-0.5)

    seconds = time_loop(step, (q, k_pages, v_pages), k_new, page_tables, cu_q_lens, kv_lens)
    say(f"full call with K/V write, B=64 ctx=4096: {seconds * 1e6:.1f}us")
    return {"input_output_alias": aliased, "cache_sized_copies": copies, "full_call_s": seconds}


SWEEP_DECODE = {  # (batch, context): [(block_kv, num_warps, num_stages, num_splits)]
    # The engine's decode steps (throughput-1k: 384 sequences at 1-2k tokens) and the goal shapes.
    shape: [(32, 2, 3, 1), (32, 4, 3, 1), (32, 4, 4, 1), (64, 2, 3, 1), (64, 4, 2, 1), (64, 4, 3, 1),
            (64, 4, 4, 1), (128, 4, 3, 1), (128, 8, 3, 1), (64, 4, 4, 2)]
    for shape in [(384, 1024), (384, 2048), (128, 2048), (32, 4096), (64, 4096)]
}
SWEEP_DECODE[(1, 32768)] = [(64, 4, 4, 32), (64, 4, 4, 64), (128, 4, 3, 32), (32, 4, 4, 64), (64, 2, 3, 64)]
SWEEP_DECODE[(8, 16384)] = [(64, 4, 4, 4), (64, 4, 4, 8), (128, 4, 3, 4), (32, 4, 4, 8), (64, 2, 3, 8)]
LEAN = [(16, 2, 3), (32, 2, 2), (32, 2, 3), (32, 4, 2), (32, 4, 3), (64, 2, 2), (64, 4, 2), (64, 2, 3), (64, 4, 4)]
SWEEP_SHORT = {  # short contexts: smem-lean tiles let more programs share an SM
    (shape): [(*lean, splits) for lean in LEAN for splits in ((2, 4) if shape[0] <= 8 else (1,))]
    for shape in [(8, 1024), (64, 1024), (256, 1024), (64, 4096), (8, 16384)]
}
SWEEP_PREFILL = [(rows, bkv, warps, stages) for rows in (64, 128) for bkv in (32, 64, 128)
                 for warps in (4, 8) for stages in (2, 3, 4) if not (rows == 64 and warps == 8)]


def run_sweep(page_size, results, decode_table=None, prefill=True):
    """Tile-size variants of our kernel at a few shapes: the data behind block_sizes.py."""
    for (batch, context), variants in (decode_table or SWEEP_DECODE).items():
        args = decode_inputs(batch, context, page_size)
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
        for block_kv, warps, stages, splits in variants:
            sizes = ours_sizes(batch, batch, context, page_size, block_kv=block_kv, num_warps=warps,
                               num_stages=stages, num_splits=splits)
            try:
                t, args = time_ours(sizes, args)
            except Exception as e:
                say(f"sweep decode B={batch} ctx={context} {sizes}: {type(e).__name__} {str(e)[:120]}")
                continue
            say(f"sweep decode B={batch:3d} ctx={context:5d} bkv={block_kv:3d} w={warps} st={stages} "
                f"splits={splits:2d}: {t * 1e6:8.1f}us {kv_bytes / t / 1e12:.2f}TB/s")
            results.append({"workload": "sweep-decode", "batch": batch, "context": context,
                            "sizes": sizes.__dict__, "s": t, "tbs": kv_bytes / t / 1e12})
        del args
    if not prefill:
        return
    args, flops = prefill_inputs(4096, 32, 2048, page_size, 2048)
    for rows, block_kv, warps, stages in SWEEP_PREFILL:
        sizes = BlockSizes(block_q=rows // 4, block_kv=block_kv, num_splits=1, num_warps=warps, num_stages=stages)
        try:
            t, args = time_ours(sizes, args)
        except Exception as e:
            say(f"sweep prefill {sizes}: {type(e).__name__} {str(e)[:120]}")
            continue
        say(f"sweep prefill 4096 rows={rows} bkv={block_kv} w={warps} st={stages}: {t * 1e6:.0f}us "
            f"{flops / t / 1e12:.0f} TFLOP/s")
        results.append({"workload": "sweep-prefill", "sizes": sizes.__dict__, "s": t, "tflops": flops / t / 1e12})


def write_outputs(out_dir, report):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kernel_attention.json"), "w") as f:
        json.dump(report, f, indent=1)
    ceil = report.get("ceilings", {})
    lines = [f"# kernel-decode / kernel-prefill ({report['device']}, jax {report['jax']})", "",
             f"Command: `{report['command']}`", "",
             f"Ceilings in this run: HBM read {ceil.get('hbm_read_tbs', float('nan')):.2f} TB/s, "
             f"bf16 matmul {ceil.get('matmul_tflops', float('nan')):.0f} TFLOP/s.", "",
             "| page | batch | context | ours µs | ours TB/s | / ceiling | / bundled | / cuDNN | bundled TB/s | cuDNN TB/s | XLA ref TB/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    fmt = lambda r, k, f: (f % r[k]) if k in r else "–"  # noqa: E731
    for r in report["results"]:
        if r["workload"] != "kernel-decode":
            continue
        if "skipped" in r:
            lines.append(f"| {r['page_size']} | {r['batch']} | {r['context']} | skipped: {r['skipped']} |" + " |" * 7)
            continue
        ratio = lambda a, b: f"{r[a] / r[b]:.2f}" if a in r and b in r else "–"  # noqa: E731
        # Rows merged from another run carry that run's ceiling.
        row_ceil = r.get("hbm_read_tbs", ceil.get("hbm_read_tbs"))
        ceil_ratio = f"{r['ours_tbs'] / row_ceil:.0%}" if "ours_tbs" in r and row_ceil else "–"
        ours_us = f"{r['ours_s'] * 1e6:.1f}" if "ours_s" in r else "–"
        page = f"{r['page_size']} fp8" if r.get("kv_dtype") == "float8_e4m3fn" else r["page_size"]
        lines.append(f"| {page} | {r['batch']} | {r['context']} | {ours_us} "
                     f"| {fmt(r, 'ours_tbs', '%.2f')} | {ceil_ratio} | {ratio('ours_tbs', 'bundled_tbs')} "
                     f"| {ratio('ours_tbs', 'cudnn_tbs')} | {fmt(r, 'bundled_tbs', '%.2f')} | {fmt(r, 'cudnn_tbs', '%.2f')} "
                     f"| {fmt(r, 'reference_tbs', '%.2f')} |")
    lines += ["", "| prefill tokens | chunk | + decode | ours µs | ours TFLOP/s | / matmul | cuDNN causal TFLOP/s (prefill only) | XLA ref TFLOP/s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        if r["workload"] != "kernel-prefill":
            continue
        lines.append(f"| {r['prefill_tokens']} | {r['chunk']} | {r['decode_tokens']} × {r['decode_context']} "
                     f"| {r['ours_s'] * 1e6:.0f} | {r['ours_tflops']:.0f} | {r['ours_tflops'] / ceil['matmul_tflops']:.0%} "
                     f"| {fmt(r, 'cudnn_tflops', '%.0f')} | {fmt(r, 'reference_tflops', '%.1f')} |")
    if "copies" in report:
        lines += ["", f"Compiled full call (B=64, ctx 4k): input_output_alias present: "
                      f"{report['copies']['input_output_alias']}; cache-sized copies: {len(report['copies']['cache_sized_copies'])}."]
    with open(os.path.join(out_dir, "kernel_attention.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    decode = [r for r in report["results"] if r["workload"] == "kernel-decode" and "skipped" not in r
              and r["page_size"] == report["default_page_size"]]
    contexts = sorted({r["context"] for r in decode})
    if not contexts:
        return
    fig, axes = plt.subplots(1, len(contexts), figsize=(4 * len(contexts), 3.5), sharey=True)
    for ax, context in zip(np.atleast_1d(axes), contexts):
        rows = sorted((r for r in decode if r["context"] == context), key=lambda r: r["batch"])
        for impl in ("ours", "bundled", "cudnn", "reference"):
            pts = [(r["batch"], r[f"{impl}_tbs"]) for r in rows if f"{impl}_tbs" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.axhline(ceil["hbm_read_tbs"], color="k", ls="--", lw=0.8, label="HBM read ceiling")
        ax.set_xscale("log", base=2)
        ax.set_title(f"context {context}")
        ax.set_xlabel("batch")
    np.atleast_1d(axes)[0].set_ylabel("K/V read TB/s")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "kernel_attention.png"), dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--stages", default="check,ceilings,decode,pages,prefill,copies")
    parser.add_argument("--impls", default="ours,bundled,cudnn,reference")
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--contexts", default="1024,4096,16384,32768")
    parser.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16", help="page dtype of the decode stages")
    args = parser.parse_args()
    kv_dtype = {"bf16": DTYPE, "fp8": jnp.float8_e4m3fn}[args.kv_dtype]
    stages, impls = set(args.stages.split(",")), set(args.impls.split(","))
    device = jax.devices()[0]
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "device": device.device_kind,
              "platform": platform.platform(), "jax": jax.__version__, "default_page_size": args.page_size,
              "results": []}
    say(f"command: {report['command']}")
    say(f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; {platform.platform()}")
    try:
        if "check" in stages:
            report["max_rel_err"] = check_correctness()
        report["ceilings"] = measure_ceilings() if "ceilings" in stages else {"hbm_read_tbs": float("nan"), "matmul_tflops": float("nan")}
        if "sweep-short" in stages:
            run_sweep(args.page_size, report["results"], SWEEP_SHORT, prefill=False)
        if "sweep" in stages:
            run_sweep(args.page_size, report["results"])
        # The short stages first, so a run cut short by its time limit loses only decode shapes.
        if "prefill" in stages:
            run_prefill(report["ceilings"], args.page_size, report["results"], impls)
        if "copies" in stages:
            report["copies"] = check_copies(args.page_size)
        write_outputs(args.out, report)
        if "decode" in stages:
            run_decode(report["ceilings"], [int(b) for b in args.batches.split(",")],
                       [int(c) for c in args.contexts.split(",")], args.page_size, impls, report["results"],
                       save=lambda: write_outputs(args.out, report), kv_dtype=kv_dtype)
        if "pages" in stages:
            for page_size in (16, 32, 64, 128):
                if page_size != args.page_size:
                    run_decode(report["ceilings"], [1, 64], [4096, 32768], page_size, {"ours"}, report["results"],
                               kv_dtype=kv_dtype)
    finally:
        report["log"] = LOG
        write_outputs(args.out, report)


if __name__ == "__main__":
    main()

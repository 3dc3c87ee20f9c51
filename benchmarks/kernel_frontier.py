"""Issue 21 on one H200: the decode and prefill attention frontier, swept and decided in one run.

Since GPU run 2 the engine's default GPU kernel is the baseline's code again (``gpu.py``, plus fp8
pages), so the "baseline" columns below time the default path (``gpu.ragged_paged_attention_gpu``,
sizes from ``gpu_block_sizes(fused=False)``, equal to the frozen baseline's), and "current" / "best"
mean the opt-in fused-write kernel (``gpu_fused.py``, sizes from the measured table with
``fused=True``); ``gpu_decode_table.json`` is that kernel's table.

What one call answers, in priority order (a time budget stops the sweeps early, keeping
everything measured so far):

1. Correctness on the GPU, compiled: the current kernel (fused K/V write, page-id prefetch,
   in-kernel tile plan, and each switched off) against the plain-JAX reference on random
   ragged batches with NaN in every unowned cache row: outputs (relative error), the cache
   rows written (exact), float8_e4m3fn pages; and the compiled donated call has
   ``input_output_alias`` and no cache-sized copy.
2. Ceilings of this run: HBM read (sum over 8 GiB) and the bf16 matmul rate.
3. Decode at the goal shapes (B=1 at 32k/16k/4k, B=8 at 16k, B=32 at 4k, B=64 at 4k): the
   baseline kernel (the default ``gpu.py``, the code before this issue, plus fp8 pages) as it ran
   (attend only, as ``kernel_attention.py`` timed it, and the full call with its XLA scatter),
   cuDNN's dense kernel on a contiguous cache of the same shape, and the current kernel's full
   call (write + attend, one launch) at its table sizes, then a coordinate search: the KV split
   count, then tile sizes at the best split count, then each of the two new mechanisms off.
   The best per shape is printed and written as ``gpu_decode_table.json`` in the form
   ``block_sizes.py`` reads (copy it to ``pallas_kernels/paged_attention/`` to adopt it).
4. Prefill (4k tokens as 2 chunks of 2048, 8k in one chunk, each + 32 decode tokens): tile
   sizes of the current kernel, the baseline, cuDNN's causal flash attention on the same
   chunks (contiguous, without the decode tokens), against the matmul rate; and the Mosaic
   GPU prefill prototype (``mosaic_gpu_prefill_prototype.py``) on cuDNN's inputs, checked
   against cuDNN's output in the same run.
5. No-regression shapes (B=256 ctx 1k/4k, B=32 ctx 32k) and the fixed cost of a call (B=1 ctx 1k,
   4 MB of K/V): baseline vs current at the table's sizes.
6. float8_e4m3fn pages (``--only ceilings,fp8``, B in {1, 32, 64, 256} x ctx in {1k, 4k, 16k}): the
   engine's default kernel over bf16 pages and over fp8 pages at its sizes, in the same run (TB/s
   of each dtype's own bytes, tokens/s, the fp8 / bf16 speed-up), the fp8 kernel as it was (tiles
   widened to bf16) at four shapes, then a tile sweep over fp8 pages, goal shapes (B >= 32, ctx >= 4k)
   first. The best per swept shape is written as ``gpu_fp8_decode_table.json``, the form
   ``block_sizes.py`` reads for fp8 pages; ``adopt_frontier_run.py RUN_DIR`` adopts it.

Timing: ``REPEATS`` chained calls unrolled in one jitted program, the cache donated into it so
the in-place write costs what it costs in the engine (no cache copies), median of 3 runs.

    python3 benchmarks/kernel_frontier.py --out DIR [--budget-s 420] [--only decode,prefill,...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernel_attention import decode_inputs, prefill_inputs, pseudo_random  # noqa: E402
from mosaic_gpu_prefill_prototype import causal_prefill_attention_mosaic_gpu  # noqa: E402
# "baseline" columns time the engine's default kernel (gpu.py: the frozen baseline's code, its sizes, plus
# fp8 pages, a no-op for bf16); "current"/"best" columns time and sweep the opt-in fused-write kernel.
from pallas_kernels.paged_attention import gpu as baseline_gpu  # noqa: E402
from pallas_kernels.paged_attention import gpu_fused as gpu_kernel  # noqa: E402
from pallas_kernels.paged_attention import work_tiles as wt  # noqa: E402
from pallas_kernels.paged_attention.block_sizes import GPU_TABLE_PATH, BlockSizes, gpu_block_sizes  # noqa: E402
from pallas_kernels.paged_attention.reference import ragged_paged_attention_reference  # noqa: E402
from pallas_kernels.paged_attention.v_layout import to_dim_major, write_kv_dim_major_v  # noqa: E402
from tests.attention_cases import make_case  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
GROUP = NUM_Q_HEADS // NUM_KV_HEADS
SM_SCALE = HEAD_DIM**-0.5
REPEATS = 32
TIMED_RUNS = 3  # timed runs of a compiled chain after its warm-up (median); --smoke times once
INTERPRET = False  # --smoke: Pallas interpreter on CPU, tiny shapes, to check this script without a GPU
LOG: list[str] = []
T0 = time.time()


def say(*parts):
    line = " ".join(str(p) for p in parts)
    print(f"[{time.time() - T0:6.1f}s] {line}", flush=True)
    LOG.append(line)


class OutOfTime(Exception):
    pass


class Budget:
    def __init__(self, seconds: float):
        self.deadline = T0 + seconds

    def left(self) -> float:
        return self.deadline - time.time()

    def check(self, need: float = 0.0):
        if self.left() < need:
            raise OutOfTime()


def compile_chain(step, carry, *consts, donate: bool):
    """The jitted chain of REPEATS ``carry = step(carry, *consts)`` calls, compiled ahead of time.

    Lowering reads only shapes, so nothing is donated here; compiles of different candidates
    run on a thread pool (XLA and Triton release the GIL), see ``compile_all``.
    """

    def chain(carry, *consts):
        for _ in range(REPEATS):
            carry = step(carry, *consts)
        return carry

    return jax.jit(chain, donate_argnums=(0,) if donate else ()).lower(carry, *consts).compile()


def time_compiled(run, carry, *consts):
    """Seconds per call of a compiled chain (median of ``TIMED_RUNS`` after a warm-up). Returns (seconds, last carry)."""
    carry = jax.block_until_ready(run(carry, *consts))
    times = []
    for _ in range(TIMED_RUNS):
        start = time.perf_counter()
        carry = jax.block_until_ready(run(carry, *consts))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / REPEATS, carry


def time_chain(step, carry, *consts, donate: bool):
    """Seconds per call of ``carry = step(carry, *consts)``, REPEATS calls unrolled in one jit.

    With ``donate`` the carry (which holds the cache) is donated, so a kernel that writes the
    cache in place runs without a copy, as in the engine. Returns (seconds, last carry).
    """
    return time_compiled(compile_chain(step, carry, *consts, donate=donate), carry, *consts)


COMPILE_THREADS = 12  # the GPU machine has 16 cores
# A decode sweep's second stage (neighbours of the best, ablations) runs only with this much budget left.
STAGE2_NEEDS_S = 75


def compile_all(steps: dict, carry, *consts, donate: bool) -> dict:
    """Compile many chains at once on a thread pool: {key: compiled or the exception it raised}."""
    return compile_jobs({key: (step, carry, consts, donate) for key, step in steps.items()})


def compile_jobs(jobs: dict) -> dict:
    """{key: (step, carry, consts, donate)} -> {key: compiled chain or the exception it raised}, in parallel."""
    def one(job):
        step, carry, consts, donate = job
        try:
            return compile_chain(step, carry, *consts, donate=donate)
        except Exception as e:  # e.g. shared memory over the limit: the caller reports it
            return e
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=COMPILE_THREADS)
    try:
        return dict(zip(jobs, pool.map(one, jobs.values())))
    finally:  # on SIGINT (the wall budget) do not wait for compiles in flight: main writes its outputs
        pool.shutdown(wait=False, cancel_futures=True)


def _ok(compiled):
    if isinstance(compiled, Exception):
        raise compiled
    return compiled


def current_full_step(sizes: BlockSizes):
    def step(state, k_new, v_new, page_tables, cu_q_lens, kv_lens):
        q, k_pages, v_pages = state  # the output becomes the next query: every call stays live
        return gpu_kernel.attend_and_write_gpu(q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens,
                                               sm_scale=SM_SCALE, sizes=sizes, interpret=INTERPRET)
    return step


def baseline_full_step(state, k_new, v_new, page_tables, cu_q_lens, kv_lens):
    q, k_pages, v_pages = state
    return baseline_gpu.ragged_paged_attention_gpu(q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens,
                                                   kv_lens, sm_scale=SM_SCALE, interpret=INTERPRET)


def baseline_attend_step(sizes):
    def step(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens):
        return baseline_gpu.attend_gpu(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=SM_SCALE,
                                       sizes=sizes, interpret=INTERPRET)
    return step


def table_sizes(num_tokens, num_seqs, max_kv_len, page_size, **overrides) -> BlockSizes:
    tuned = gpu_block_sizes(num_tokens=num_tokens, max_num_seqs=num_seqs, max_kv_len=max_kv_len,
                            num_kv_heads=NUM_KV_HEADS, group=GROUP, head_dim=HEAD_DIM, page_size=page_size,
                            itemsize=2, fused=True)
    return dataclasses.replace(tuned, **overrides)


def baseline_sizes(num_tokens, num_seqs, max_kv_len, page_size):
    return gpu_block_sizes(num_tokens=num_tokens, max_num_seqs=num_seqs, max_kv_len=max_kv_len,
                           num_kv_heads=NUM_KV_HEADS, group=GROUP, head_dim=HEAD_DIM, page_size=page_size,
                           itemsize=2, fused=False)


def sizes_label(s: BlockSizes) -> str:
    return (f"bq={s.block_q} bkv={s.block_kv} w={s.num_warps} st={s.num_stages} splits={s.num_splits}"
            f" prefetch={int(s.prefetch_pages)} plan_in_kernel={int(s.plan_in_kernel)} merge_kernel={int(s.merge_kernel)}")


# 1. Correctness ------------------------------------------------------------------------------

CHECK_CASES = [  # (seqs, page_size, kernel overrides)
    ([(1, 700), (0, 0), (1, 16), (1, 1)] * 4, 16, {}),
    ([(1, 700), (0, 0), (1, 16), (1, 1)] * 4, 16, dict(num_splits=5, prefetch_pages=False)),
    ([(300, 300), (1, 2000), (37, 500), (0, 0), (128, 128)], 32, {}),
    ([(300, 300), (1, 2000), (37, 500), (0, 0), (128, 128)], 32, dict(plan_in_kernel=False, prefetch_pages=False)),
    ([(1, 5000)] * 2, 64, {}),
    ([(1, 32768)], 32, dict(num_splits=33, merge_kernel=True)),
    ([(1, 32768)], 32, dict(num_splits=33, merge_kernel=False)),
    ([(64, 64)] + [(1, 4096)] * 3, 32, dict(num_splits=3, block_kv=128, num_warps=8)),
    ([(1, 4096)] * 24, 32, dict(block_q=4, num_splits=1, block_kv=128, num_warps=4, num_stages=2)),  # B=17..32 decode tile
]


# --quick-check: what run 1 did not cover or what changed since (the Pallas merge kernel, the
# einsum merge), and one ragged case per dtype; (case index, q dtype, cache dtype or None).
QUICK_CHECKS = [(2, jnp.bfloat16, None), (5, jnp.bfloat16, None), (6, jnp.bfloat16, None),
                (8, jnp.bfloat16, None), (0, jnp.bfloat16, jnp.float8_e4m3fn)]
# Checks run on both kernels: the fused one (gpu_fused.py) and the engine's default (gpu.py),
# the latter only where the overrides name no switch it lacks.
FUSED_ONLY_OPTIONS = {"prefetch_pages", "plan_in_kernel", "merge_kernel"}


def check_correctness(results, quick: bool = False):
    worst = {k: {"bfloat16": 0.0, "float32": 0.0, "float8_e4m3fn": 0.0} for k in ("fused", "default")}
    cache_exact = True
    for i, (seqs, page_size, overrides) in enumerate(CHECK_CASES[:2] if INTERPRET else CHECK_CASES):
        for dtype, cache_dtype in ((jnp.bfloat16, None), (jnp.float32, None), (jnp.bfloat16, jnp.float8_e4m3fn)):
            if quick and not INTERPRET and (i, dtype, cache_dtype) not in QUICK_CHECKS:
                continue
            if (cache_dtype is not None or dtype == jnp.float32) and i % 2:
                continue  # the option variants (odd cases) in bfloat16 only
            if dtype == jnp.float32 and i > 2:
                continue
            for kernel_name, kernel in (("fused", gpu_kernel.ragged_paged_attention_gpu_fused),
                                        ("default", baseline_gpu.ragged_paged_attention_gpu)):
                if kernel_name == "default" and overrides.keys() & FUSED_ONLY_OPTIONS:
                    continue  # the default kernel has no such switches
                case = make_case(100 + i, seqs, num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS,
                                 head_dim=HEAD_DIM, page_size=page_size, dtype=dtype, pad_tokens=3)
                args = list(case.args())
                if cache_dtype is not None:
                    args[1:5] = [x.astype(cache_dtype) for x in args[1:5]]
                ref_args = [x.astype(jnp.float32) if j in (1, 2, 3, 4) and cache_dtype is not None else x
                            for j, x in enumerate(args)]
                ref_out, ref_k, ref_v = ragged_paged_attention_reference(*ref_args, sm_scale=case.sm_scale)
                out, k_out, v_out = kernel(*[jnp.array(a) for a in args], sm_scale=case.sm_scale,
                                           interpret=INTERPRET, **overrides)
                out, ref_out = out.astype(jnp.float32), ref_out.astype(jnp.float32)
                err = float(jnp.linalg.norm(out - ref_out) / jnp.linalg.norm(ref_out))
                nan = bool(jnp.isnan(out).any())
                # Cache: every row bit-identical to the reference's write (NaN where nothing was written).
                same = all(np.array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)),
                                          equal_nan=True) for a, b in ((k_out, ref_k), (v_out, ref_v)))
                name = jnp.dtype(cache_dtype or dtype).name
                say(f"check {kernel_name} case {i} q {jnp.dtype(dtype).name} cache {name} {overrides}: "
                    f"rel err {err:.2e} nan={nan} cache rows exact={same}")
                worst[kernel_name][name] = max(worst[kernel_name][name], err if not nan else float("inf"))
                cache_exact &= same
                results.append({"workload": "check", "kernel": kernel_name, "case": i,
                                "q_dtype": jnp.dtype(dtype).name, "cache_dtype": name, "overrides": overrides,
                                "rel_err": err, "nan": nan, "cache_exact": same})
    say(f"check: worst rel err {worst}; cache rows exact everywhere: {cache_exact}")
    return {"worst_rel_err": worst, "cache_exact": cache_exact}


def check_copies(page_size=32):
    """Compile the full donated call and look for a cache-sized copy in the optimized HLO."""
    batch, context = (2, 256) if INTERPRET else (64, 4096)
    q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens = decode_inputs(batch, context, page_size)
    k_new = pseudo_random((batch, NUM_KV_HEADS, HEAD_DIM), 15)
    text = gpu_kernel.ragged_paged_attention_gpu_fused.lower(
        q, k_new, k_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=SM_SCALE,
        interpret=INTERPRET).compile().as_text()
    dims = [",".join(str(d) for d in k_pages.shape), f"{NUM_KV_HEADS},{k_pages.shape[1] * page_size},{HEAD_DIM}"]
    copies = [line.strip()[:160] for line in text.splitlines()
              if ("copy(" in line or "copy-start" in line) and any(d in line for d in dims)]
    scatters = sum(" scatter(" in line for line in text.splitlines())
    aliased = "input_output_alias" in text
    say(f"compiled full call: input_output_alias={aliased}; cache-sized copies: {len(copies)}; scatters: {scatters}")
    return {"input_output_alias": aliased, "cache_sized_copies": copies, "scatters": scatters}


# 2. Ceilings ---------------------------------------------------------------------------------

def measure_ceilings():
    x = pseudo_random((4 * 1024**3,), 1)  # 8 GiB of bf16
    t, _ = time_chain(lambda c, x: c + jnp.sum(x + c.astype(x.dtype), dtype=jnp.float32) * 1e-30,
                      jnp.float32(0), x, donate=False)
    read = x.size * 2 / t / 1e12
    del x
    n = 8192
    a, b = pseudo_random((n, n), 2), pseudo_random((n, n), 3, scale=1.7 / math.sqrt(n))
    t, _ = time_chain(lambda a, b: (a @ b).astype(jnp.bfloat16), a, b, donate=False)
    mm = 2 * n**3 / t / 1e12
    say(f"ceiling: HBM read {read:.2f} TB/s (sum over 8 GiB bf16); bf16 matmul {mm:.0f} TFLOP/s (8192^3)")
    return {"hbm_read_tbs": read, "matmul_tflops": mm}


# 3. Decode -----------------------------------------------------------------------------------

# The goal shapes, in priority order (B=256 ctx 32k: large batches at >= 95% of the read ceiling).
DECODE_SHAPES = [(1, 32768), (1, 16384), (32, 4096), (8, 16384), (64, 4096), (256, 32768)]


def split_candidates(batch, context, block_kv=64):
    """KV splits to try: about 1, 2, 3, 4 programs per SM (132 SMs), and the old heuristic's power of two."""
    programs = batch * NUM_KV_HEADS
    cands = {max(1, 1 << max(0, math.ceil(math.log2(max(1, 264 / programs)))))}
    if programs >= 66:  # one split is a candidate only with at least half a program per SM
        cands.add(1)
    for per_sm in (1, 2, 3, 4):
        target = 132 * per_sm / programs
        cands |= {max(1, math.floor(target)), max(1, math.ceil(target))} if target < 4 else {round(target)}
    max_useful = max(1, context // (block_kv * 2))
    return sorted({min(c, max_useful) for c in cands})


# (block_kv, warps, stages). 128 at 3 stages overflows shared memory (run 1: 303104 of 232448 bytes).
TILE_VARIANTS = [(64, 4, 4), (128, 4, 2), (64, 2, 3), (32, 4, 4), (128, 8, 2)]


def decode_args(batch, context, page_size):
    q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens = decode_inputs(batch, context, page_size)
    k_new = pseudo_random((batch, NUM_KV_HEADS, HEAD_DIM), 16)
    v_new = pseudo_random((batch, NUM_KV_HEADS, HEAD_DIM), 17)
    return (q, k_pages, v_pages), (k_new, v_new, page_tables, cu_q_lens, kv_lens)


def run_decode_shape(batch, context, page_size, results, budget, table, sweep=True):
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
    row = {"workload": "decode", "batch": batch, "context": context, "page_size": page_size, "kv_bytes": kv_bytes}
    results.append(row)
    tbs = lambda s: kv_bytes / s / 1e12  # noqa: E731
    state, consts = decode_args(batch, context, page_size)
    # Baseline, attend only (as kernel_attention.py timed it) and full call (XLA scatter + attend).
    bsizes = baseline_sizes(batch, batch, context, page_size)
    default = table_sizes(batch, batch, context, page_size)
    row["current_default_sizes"] = dataclasses.asdict(default)
    # The three fixed columns compile together (thread pool), then run one after another.
    start = time.time()
    compiled = compile_jobs({"baseline_attend": (baseline_attend_step(bsizes), state[0], (*state[1:], *consts[2:]), False),
                             "baseline_full": (baseline_full_step, state, consts, True),
                             "current": (current_full_step(default), state, consts, True)})
    say(f"decode B={batch} ctx={context}: compiled baseline and current in {time.time() - start:.1f}s")
    row["baseline_attend_s"], _ = time_compiled(_ok(compiled["baseline_attend"]), *state, *consts[2:])
    row["baseline_full_s"], state = time_compiled(_ok(compiled["baseline_full"]), state, *consts)
    say(f"decode B={batch} ctx={context}: baseline attend {row['baseline_attend_s'] * 1e6:.1f}us "
        f"{tbs(row['baseline_attend_s']):.2f}TB/s, full call {row['baseline_full_s'] * 1e6:.1f}us "
        f"({bsizes.block_kv}/{bsizes.num_warps}/{bsizes.num_stages} splits {bsizes.num_splits})")
    # Current kernel at its table's sizes.
    row["current_default_s"], state = time_compiled(_ok(compiled["current"]), state, *consts)
    del compiled
    say(f"decode B={batch} ctx={context}: current (table) {row['current_default_s'] * 1e6:.1f}us "
        f"{tbs(row['current_default_s']):.2f}TB/s {sizes_label(default)}")
    tried = {}

    def trials(candidates):
        """Time the candidates not yet tried: compiled in parallel, then timed one after another."""
        nonlocal state
        fresh = {}
        for sizes in candidates:
            fresh.setdefault(sizes_label(sizes), sizes)
        fresh = {k: v for k, v in fresh.items() if k not in tried}
        if not fresh:
            return
        budget.check(8)
        start = time.time()
        compiled = compile_all({k: current_full_step(v) for k, v in fresh.items()}, state, *consts, donate=True)
        say(f"  compiled {len(fresh)} candidates in {time.time() - start:.1f}s")
        for key, run in compiled.items():
            budget.check(3)
            if isinstance(run, Exception):
                say(f"  sweep B={batch} ctx={context} {key}: {type(run).__name__} {str(run)[:150]}")
                tried[key] = float("inf")
                continue
            try:
                t, state = time_compiled(run, state, *consts)
            except Exception as e:
                say(f"  sweep B={batch} ctx={context} {key}: {type(e).__name__} {str(e)[:150]}")
                tried[key] = float("inf")
                continue
            tried[key] = t
            say(f"  sweep B={batch} ctx={context} {key}: {t * 1e6:8.1f}us {tbs(t):.2f}TB/s")
            results.append({"workload": "sweep-decode", "batch": batch, "context": context,
                            "sizes": dataclasses.asdict(fresh[key]), "s": t, "tbs": tbs(t)})

    tried[sizes_label(default)] = row["current_default_s"]
    best = default
    if sweep:
        try:
            # Stage 1, one parallel compile: every split count at a mid tile, every tile at the
            # current choice's split count, merge kernel on and off. Stage 2: the best's neighbours
            # and each new mechanism off at the best.
            base = dataclasses.replace(default, block_kv=64, num_warps=4, num_stages=3)
            stage1 = [dataclasses.replace(base, num_splits=splits) for splits in split_candidates(batch, context)]
            stage1 += [dataclasses.replace(default, block_kv=bkv, num_warps=warps, num_stages=stages)
                       for bkv, warps, stages in TILE_VARIANTS]
            if default.num_splits > 1:
                stage1 += [dataclasses.replace(c, merge_kernel=not c.merge_kernel) for c in stage1[:1]]
                stage1 += [dataclasses.replace(default, merge_kernel=not default.merge_kernel)]
            trials(stage1)
            best = _parse(min(tried, key=tried.get))
            if budget.left() < STAGE2_NEEDS_S:  # else the shapes after this one get nothing
                say(f"decode B={batch} ctx={context}: second stage skipped, keeping time for the other shapes")
                raise OutOfTime()
            stage2 = [dataclasses.replace(best, block_kv=bkv, num_warps=warps, num_stages=stages)
                      for bkv, warps, stages in TILE_VARIANTS]
            for factor in (0.5, 2.0):
                splits = max(1, round(best.num_splits * factor))
                if splits * best.block_kv * 2 <= context:
                    stage2.append(dataclasses.replace(best, num_splits=splits))
            ablations = dict(best_prefetch_off_s=dataclasses.replace(best, prefetch_pages=False),
                             best_plan_xla_s=dataclasses.replace(best, plan_in_kernel=False),
                             best_both_off_s=dataclasses.replace(best, prefetch_pages=False, plan_in_kernel=False))
            if best.num_splits > 1:
                other = "best_merge_xla_s" if best.merge_kernel else "best_merge_kernel_s"
                ablations[other] = dataclasses.replace(best, merge_kernel=not best.merge_kernel)
            trials(stage2 + list(ablations.values()))
            for name, sizes in ablations.items():
                row[name] = tried.get(sizes_label(sizes))
            best = _parse(min(tried, key=tried.get))
        except OutOfTime:
            say(f"decode B={batch} ctx={context}: sweep stopped by the time budget")
            best = _parse(min(tried, key=tried.get))
    row["best_s"], row["best_sizes"] = tried[sizes_label(best)], dataclasses.asdict(best)
    if sweep and best.num_splits > 1 and batch <= 8:
        # What merging the splits costs as its own XLA step: the bound on an in-kernel merge's gain.
        try:
            budget.check(5)
            parts = pseudo_random((best.num_splits, batch, NUM_Q_HEADS, HEAD_DIM), 21, dtype=jnp.float32)
            lse = pseudo_random((best.num_splits, batch, NUM_Q_HEADS), 22, dtype=jnp.float32, scale=4.0)
            # The carry is the small lse, so each merge depends on the previous one and nothing else is timed.
            merge = lambda lse, p: lse + 0.0 * wt.combine_splits(p, lse)[None, ..., 0]  # noqa: E731
            row["combine_only_s"], _ = time_chain(merge, lse, parts, donate=False)
            say(f"decode B={batch} ctx={context}: merging {best.num_splits} splits alone "
                f"{row['combine_only_s'] * 1e6:.1f}us")
        except OutOfTime:
            pass
    if sweep:
        table.append({"kind": "decode", "batch": batch, "context": context, "num_kv_heads": NUM_KV_HEADS, "group": GROUP,
                      "head_dim": HEAD_DIM, "page_size": page_size, "itemsize": 2,
                      "sizes": dataclasses.asdict(best), "us": row["best_s"] * 1e6, "tbs": tbs(row["best_s"])})
    del state
    # cuDNN's dense kernel on a contiguous cache of the same shape.
    try:
        budget.check(5)
        shape = (batch, context, NUM_KV_HEADS, HEAD_DIM)
        k, v = pseudo_random(shape, 7), pseudo_random(shape, 8)
        step = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, scale=SM_SCALE, implementation="cudnn").astype(q.dtype)
        q_dense = pseudo_random((batch, 1, NUM_Q_HEADS, HEAD_DIM), 6, scale=2.0)  # q itself went with the cache
        row["cudnn_s"], _ = time_chain(step, q_dense, k, v, donate=False)
        del k, v
    except OutOfTime:
        pass
    except Exception as e:
        row["cudnn_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for key in [k for k in row if k.endswith("_s")]:
        row[key[:-2] + "_tbs"] = tbs(row[key]) if row[key] else None
    say(f"decode B={batch} ctx={context} RESULT: best {row['best_s'] * 1e6:.1f}us {tbs(row['best_s']):.2f}TB/s "
        f"[{sizes_label(best)}] | table {row['current_default_s'] * 1e6:.1f}us | baseline attend "
        f"{row['baseline_attend_s'] * 1e6:.1f}us full {row['baseline_full_s'] * 1e6:.1f}us"
        + (f" | cudnn {row['cudnn_s'] * 1e6:.1f}us {tbs(row['cudnn_s']):.2f}TB/s" if "cudnn_s" in row else ""))


def _parse(label: str) -> BlockSizes:
    fields = dict(part.split("=") for part in label.split())
    return BlockSizes(block_q=int(fields["bq"]), block_kv=int(fields["bkv"]), num_warps=int(fields["w"]),
                      num_stages=int(fields["st"]), num_splits=int(fields["splits"]),
                      prefetch_pages=fields["prefetch"] == "1", plan_in_kernel=fields["plan_in_kernel"] == "1",
                      merge_kernel=fields["merge_kernel"] == "1")


# 6. Float8 pages ------------------------------------------------------------------------------

# Every shape gets the fixed columns (bf16 pages, fp8 pages at the engine's sizes, and at a few
# shapes the fp8 kernel as it was: tiles widened to bf16); the goal shapes (B >= 32, ctx >= 4k)
# are swept first, the rest as the budget allows.
# 256 x 16k is left out: with FP8 pages its cache (4.3e9 elements a layer) hit an illegal address
# on the H200 (jaxinfer.memory.GPU_MAX_KV_ARRAY_ELEMENTS; the engine caps an FP8 pool below it).
# 128 x 16k is the largest of that context under the limit.
FP8_SHAPES = [(b, c) for c in (1024, 4096) for b in (1, 32, 64, 256)] + [(b, 16384) for b in (1, 32, 64, 128)]
FP8_SWEEP_SHAPES = [(32, 4096), (256, 4096), (64, 4096), (32, 16384), (128, 16384), (64, 16384), (1, 16384),
                    (1, 4096), (256, 1024), (32, 1024)]
FP8_WIDEN_QUERY_SHAPES = {(32, 4096), (256, 4096), (32, 16384), (128, 16384)}
# The columns of a shape: bf16 pages and fp8 pages through the engine's kernel at its sizes, fp8 pages
# with V stored dim-major (v_layout.py, the candidate that removes V's byte-wise transposition;
# same sizes), and fp8 tiles widened to bf16 (the kernel before session 8).
FP8_KINDS = ("bf16", "fp8", "fp8_v_dim_major", "fp8_widen_query")
# (block_kv, warps, stages): an fp8 tile of 128 KV tokens holds the bytes of a bf16 tile of 64.
FP8_TILE_VARIANTS = [(128, 2, 3), (128, 4, 3), (256, 4, 2), (64, 4, 3), (256, 8, 2)]
# Over dim-major V pages a block is read a page at a time: blocks of one page (32 tokens at the engine's
# page size) with deeper pipelines too.
DIM_MAJOR_TILE_VARIANTS = [(32, 2, 3), (32, 2, 4), (32, 4, 4)]


def fp8_sizes(batch, context, page_size, kv_itemsize):
    """The default kernel's sizes (the engine's) for these pages: bf16's heuristics, or the fp8 table's entry."""
    return gpu_block_sizes(num_tokens=batch, max_num_seqs=batch, max_kv_len=context, num_kv_heads=NUM_KV_HEADS,
                           group=GROUP, head_dim=HEAD_DIM, page_size=page_size, itemsize=2, kv_itemsize=kv_itemsize)


def default_full_step(sizes: BlockSizes, fp8_widen_to: str = "float16"):
    """One full call of the engine's default kernel (XLA scatter + attention) at the given sizes."""
    def step(state, k_new, v_new, page_tables, cu_q_lens, kv_lens):
        q, k_pages, v_pages = state
        return baseline_gpu.attend_and_write_gpu(q, k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens,
                                                 sm_scale=SM_SCALE, sizes=sizes, interpret=INTERPRET,
                                                 fp8_widen_to=fp8_widen_to)
    return step


def dim_major_v_full_step(sizes: BlockSizes):
    """``default_full_step`` over dim-major V pages: the same XLA scatters (V's into the transposed
    page) and the engine's kernel loading V tiles transposed (``v_layout.py``)."""
    def step(state, k_new, v_new, page_tables, cu_q_lens, kv_lens):
        q, k_pages, v_pages = state
        k_pages, v_pages = write_kv_dim_major_v(k_new, v_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
        out = baseline_gpu.attend_gpu(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, sm_scale=SM_SCALE,
                                      sizes=sizes, interpret=INTERPRET, v_layout="dim_major")
        return out, k_pages, v_pages
    return step


def fp8_abstract_args(batch, context, page_size, kv_dtype, v_dim_major: bool = False):
    """Shapes of the chain's carry and constants (compiling reads nothing else)."""
    pages_per_seq = -(-context // page_size)  # as kernel_attention.decode_inputs: a partly filled last page
    pages = batch * pages_per_seq
    sds = jax.ShapeDtypeStruct
    cache = sds((NUM_KV_HEADS, pages, page_size, HEAD_DIM), kv_dtype)
    v_cache = sds((NUM_KV_HEADS, pages, HEAD_DIM, page_size), kv_dtype) if v_dim_major else cache
    state = (sds((batch, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16), cache, v_cache)
    new = sds((batch, NUM_KV_HEADS, HEAD_DIM), kv_dtype)
    consts = (new, new, sds((batch, pages_per_seq), jnp.int32), sds((batch + 1,), jnp.int32),
              sds((batch,), jnp.int32))
    return state, consts


def fp8_real_args(batch, context, page_size, kv_dtype, v_dim_major: bool = False):
    q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens = decode_inputs(batch, context, page_size, kv_dtype=kv_dtype)
    if v_dim_major:
        v_pages = to_dim_major(v_pages)
    k_new = pseudo_random((batch, NUM_KV_HEADS, HEAD_DIM), 16, kv_dtype)
    v_new = pseudo_random((batch, NUM_KV_HEADS, HEAD_DIM), 17, kv_dtype)
    return (q, k_pages, v_pages), (k_new, v_new, page_tables, cu_q_lens, kv_lens)


def fp8_sweep_candidates(default: BlockSizes, context: int, variants=None) -> list[BlockSizes]:
    """``variants`` (default FP8_TILE_VARIANTS) at the default's split count (capped so that each
    split walks two tiles)."""
    out = []
    for block_kv, warps, stages in variants or FP8_TILE_VARIANTS:
        splits = max(1, min(default.num_splits, context // (block_kv * 2)))
        out.append(dataclasses.replace(default, block_kv=block_kv, num_warps=warps, num_stages=stages,
                                       num_splits=splits))
    return out


def run_fp8_stage(results, table, budget, page_size, shapes=None, sweep_shapes=None):
    """bf16 vs fp8 pages through the engine's default kernel, then an fp8 tile sweep; fills ``table``.

    Pass 1 compiles every shape's fixed columns at once (thread pool, abstract shapes) and times
    them, whatever the budget; pass 2 does the same for the sweep candidates of ``sweep_shapes``,
    in order, until the budget ends. Bytes are counted at one a value for fp8 pages, two for bf16;
    tokens/s is one layer's attention call (B tokens a call).
    """
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    check_fp8_widening(results)
    shapes = shapes or FP8_SHAPES
    sweep_shapes = [s for s in (sweep_shapes if sweep_shapes is not None else FP8_SWEEP_SHAPES) if s in shapes]
    rows = {}
    jobs = {}
    for batch, context in shapes:
        bf16_sizes, fp8_default = fp8_sizes(batch, context, page_size, 2), fp8_sizes(batch, context, page_size, 1)
        rows[batch, context] = {"workload": "decode-fp8", "batch": batch, "context": context, "page_size": page_size,
                                "fp8_bytes": 2 * batch * context * NUM_KV_HEADS * HEAD_DIM,
                                "bf16_sizes": dataclasses.asdict(bf16_sizes), "fp8_sizes": dataclasses.asdict(fp8_default)}
        bf16_args = fp8_abstract_args(batch, context, page_size, jnp.bfloat16)
        fp8_args = fp8_abstract_args(batch, context, page_size, fp8)
        jobs[batch, context, "bf16"] = (default_full_step(bf16_sizes), bf16_args[0], bf16_args[1], True)
        jobs[batch, context, "fp8"] = (default_full_step(fp8_default), fp8_args[0], fp8_args[1], True)
        jobs[batch, context, "fp8_v_dim_major"] = (dim_major_v_full_step(fp8_default),
                                                   *fp8_abstract_args(batch, context, page_size, fp8, True), True)
        if (batch, context) in FP8_WIDEN_QUERY_SHAPES or INTERPRET:
            jobs[batch, context, "fp8_widen_query"] = (default_full_step(fp8_default, "query"), *fp8_args, True)
    start = time.time()
    compiled = compile_jobs(jobs)
    say(f"fp8: compiled {len(jobs)} fixed programs for {len(shapes)} shapes in {time.time() - start:.1f}s")
    tried = {}
    for (batch, context), row in rows.items():
        results.append(row)
        for kind in FP8_KINDS:
            run = compiled.get((batch, context, kind))
            if run is None:
                continue
            if isinstance(run, Exception):
                row[f"{kind}_error"] = f"{type(run).__name__}: {str(run)[:200]}"
                continue
            # No budget check: once compiled, the fixed columns (the A/B the stage is for) are timed, a
            # few seconds a shape; the budget bounds the sweep, the caller's wall clock the whole run
            # (session 26 lost its A/B when the compile alone outlasted a short budget).
            state, consts = fp8_real_args(batch, context, page_size, jnp.bfloat16 if kind == "bf16" else fp8,
                                          v_dim_major=kind == "fp8_v_dim_major")
            row[f"{kind}_s"], state = time_compiled(run, state, *consts)
            del state, consts
        _fp8_row_summary(row)
        tried[batch, context] = {sizes_label(BlockSizes(**row["fp8_sizes"])): row.get("fp8_s", float("inf"))}
    del compiled
    for batch, context in sweep_shapes:
        if budget.left() < 20:
            say(f"fp8 sweep B={batch} ctx={context}: skipped, out of time")
            continue
        row = rows[batch, context]
        default = BlockSizes(**row["fp8_sizes"])
        candidates = {sizes_label(c): c for c in fp8_sweep_candidates(default, context)}
        candidates = {k: v for k, v in candidates.items() if k not in tried[batch, context]}
        if INTERPRET:
            candidates = dict(list(candidates.items())[:1])
        # The same candidates over dim-major V pages, and blocks of one page (their own best sizes; recorded,
        # never adopted: the engine's pages are token-major).
        dm_candidates = {sizes_label(c): c
                         for c in fp8_sweep_candidates(default, context, FP8_TILE_VARIANTS + DIM_MAJOR_TILE_VARIANTS)}
        dm_candidates = {k: v for k, v in dm_candidates.items() if k != sizes_label(default)}
        if INTERPRET:
            dm_candidates = dict(list(dm_candidates.items())[:1])
        jobs = {}
        for label, c in candidates.items():
            jobs[label, "token_major"] = (default_full_step(c), *fp8_abstract_args(batch, context, page_size, fp8),
                                          True)
        for label, c in dm_candidates.items():
            jobs[label, "dim_major"] = (dim_major_v_full_step(c),
                                        *fp8_abstract_args(batch, context, page_size, fp8, True), True)
        start = time.time()
        compiled = compile_jobs(jobs)
        say(f"  fp8 sweep B={batch} ctx={context}: compiled {len(compiled)} candidates in {time.time() - start:.1f}s")
        dim_major_tried = {sizes_label(default): row["fp8_v_dim_major_s"]} if row.get("fp8_v_dim_major_s") else {}
        # Both layouts' chains alive at once, so each candidate's two timings are taken back to back.
        states = {layout: fp8_real_args(batch, context, page_size, fp8, v_dim_major=layout == "dim_major")
                  for layout in ("token_major", "dim_major")}
        try:
            for (key, layout), run in compiled.items():
                budget.check(3)
                if isinstance(run, Exception):
                    say(f"  fp8 sweep B={batch} ctx={context} {key} V {layout}: {type(run).__name__} {str(run)[:150]}")
                    continue
                state, consts = states[layout]
                t, state = time_compiled(run, state, *consts)
                states[layout] = state, consts
                (tried[batch, context] if layout == "token_major" else dim_major_tried)[key] = t
                say(f"  fp8 sweep B={batch} ctx={context} {key} V {layout}: {t * 1e6:8.1f}us "
                    f"{row['fp8_bytes'] / t / 1e12:.2f}TB/s of fp8 bytes")
                sizes = (candidates if layout == "token_major" else dm_candidates)[key]
                results.append({"workload": "sweep-decode-fp8", "batch": batch, "context": context,
                                "sizes": dataclasses.asdict(sizes), "s": t, "v_layout": layout,
                                "tbs": row["fp8_bytes"] / t / 1e12})
        except OutOfTime:
            say(f"fp8 sweep B={batch} ctx={context}: stopped by the time budget")
        del states, compiled
        if dim_major_tried:
            best_dm = min(dim_major_tried, key=dim_major_tried.get)
            row["best_v_dim_major_s"] = dim_major_tried[best_dm]
            row["best_v_dim_major_sizes"] = dataclasses.asdict(_parse(best_dm))
            row["best_v_dim_major_tbs"] = row["fp8_bytes"] / dim_major_tried[best_dm] / 1e12
        best_label = min(tried[batch, context], key=tried[batch, context].get)
        best_s = tried[batch, context][best_label]
        row["best_s"], row["best_sizes"] = best_s, dataclasses.asdict(_parse(best_label))
        row["best_tbs"] = row["fp8_bytes"] / best_s / 1e12
        table.append({"kind": "decode", "batch": batch, "context": context, "num_kv_heads": NUM_KV_HEADS,
                      "group": GROUP, "head_dim": HEAD_DIM, "page_size": page_size, "itemsize": 2, "kv_itemsize": 1,
                      "sizes": row["best_sizes"], "us": best_s * 1e6, "tbs": row["best_tbs"],
                      "default_us": row.get("fp8_s", float("nan")) * 1e6})
        say(f"fp8 B={batch} ctx={context} RESULT: best {best_s * 1e6:.1f}us {row['best_tbs']:.2f}TB/s of fp8 bytes "
            f"[{best_label}] | engine's sizes {row.get('fp8_s', float('nan')) * 1e6:.1f}us | bf16 pages "
            f"{row.get('bf16_s', float('nan')) * 1e6:.1f}us | V dim-major best "
            f"{row.get('best_v_dim_major_s', float('nan')) * 1e6:.1f}us "
            f"{row.get('best_v_dim_major_tbs', float('nan')):.2f}TB/s")


def check_fp8_widening(results):
    """Compiled on this GPU: the default kernel over fp8 pages (bf16 queries, ragged batch, NaN in unowned
    rows) against the reference on the same values in f32, tiles widened to f16 (the default) and to bf16."""
    case = make_case(105, [(1, 700), (0, 0), (1, 16), (37, 500), (1, 1)] * 2, num_q_heads=NUM_Q_HEADS,
                     num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, page_size=32, dtype=jnp.bfloat16, pad_tokens=3)
    args = list(case.args())
    args[1:5] = [x.astype(jnp.float8_e4m3fn) for x in args[1:5]]
    ref_args = [x.astype(jnp.float32) if j in (1, 2, 3, 4) else x for j, x in enumerate(args)]
    ref_out = ragged_paged_attention_reference(*ref_args, sm_scale=case.sm_scale)[0].astype(jnp.float32)
    for widen in ("float16", "query"):
        out = baseline_gpu.ragged_paged_attention_gpu(*[jnp.array(a) for a in args], sm_scale=case.sm_scale,
                                                      interpret=INTERPRET, fp8_widen_to=widen)[0].astype(jnp.float32)
        err = float(jnp.linalg.norm(out - ref_out) / jnp.linalg.norm(ref_out))
        nan = bool(jnp.isnan(out).any())
        say(f"fp8 check (default kernel, fp8 pages, tiles widened to {widen}): rel err {err:.2e} vs reference, nan={nan}")
        results.append({"workload": "check-fp8", "fp8_widen_to": widen, "rel_err": err, "nan": nan})
    # Dim-major V pages: this step's K/V written by v_layout's scatters, then the kernel's transposed V loads.
    q, k_new, v_new, k_pages, v_pages, *rest = [jnp.array(a) for a in args]
    k_pages, v_pages = write_kv_dim_major_v(k_new, v_new, k_pages, to_dim_major(v_pages), *rest)
    sizes = fp8_sizes(len(case.kv_lens), int(case.page_tables.shape[1]) * 32, 32, 1)
    out = baseline_gpu.attend_gpu(q, k_pages, v_pages, *rest, sm_scale=case.sm_scale, sizes=sizes,
                                  interpret=INTERPRET, v_layout="dim_major").astype(jnp.float32)
    err = float(jnp.linalg.norm(out - ref_out) / jnp.linalg.norm(ref_out))
    nan = bool(jnp.isnan(out).any())
    say(f"fp8 check (default kernel, fp8 pages, V dim-major): rel err {err:.2e} vs reference, nan={nan}")
    results.append({"workload": "check-fp8", "fp8_widen_to": "float16", "v_layout": "dim_major", "rel_err": err,
                    "nan": nan})


def _fp8_row_summary(row):
    """TB/s (each page dtype's own bytes), tokens/s and the fp8 / bf16 speed-up; printed."""
    fp8_bytes = row["fp8_bytes"]
    for kind in FP8_KINDS:
        nbytes = 2 * fp8_bytes if kind == "bf16" else fp8_bytes
        if row.get(f"{kind}_s"):
            row[f"{kind}_tbs"] = nbytes / row[f"{kind}_s"] / 1e12
            row[f"{kind}_tok_s"] = row["batch"] / row[f"{kind}_s"]
    if row.get("bf16_s") and row.get("fp8_s"):
        row["fp8_speedup"] = row["bf16_s"] / row["fp8_s"]
    if row.get("fp8_s") and row.get("fp8_v_dim_major_s"):
        row["v_dim_major_speedup"] = row["fp8_s"] / row["fp8_v_dim_major_s"]
    fmt = lambda k: (f"{row[k + '_s'] * 1e6:.1f}us {row[k + '_tbs']:.2f}TB/s {row[k + '_tok_s'] / 1e3:.0f}k tok/s"  # noqa: E731
                     if row.get(k + "_s") else "-")
    say(f"fp8 B={row['batch']} ctx={row['context']}: bf16 pages {fmt('bf16')} | fp8 pages {fmt('fp8')} "
        f"(x{row.get('fp8_speedup', float('nan')):.2f} tok/s) | fp8 pages, V dim-major {fmt('fp8_v_dim_major')} "
        f"(x{row.get('v_dim_major_speedup', float('nan')):.2f}) | fp8 widened to bf16 (before) {fmt('fp8_widen_query')}")


# 4. Prefill ----------------------------------------------------------------------------------

PREFILL_VARIANTS = [  # (rows = block_q x 4 heads, block_kv, warps, stages)
    (64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 2),
    (128, 64, 4, 2)]


MOSAIC_STEPS = (2, 3, 4)  # the Mosaic GPU prototype's pipeline depths timed (--mosaic-steps)


def run_prefill(ceil, page_size, results, budget, table):
    for prefill_tokens, chunk in ((128, 64),) if INTERPRET else ((4096, 2048), (8192, 8192)):
        budget.check(20)
        (q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens), flops = prefill_inputs(
            prefill_tokens, 2 if INTERPRET else 32, 128 if INTERPRET else 2048, page_size, chunk)
        num_tokens = q.shape[0]
        k_new = pseudo_random((num_tokens, NUM_KV_HEADS, HEAD_DIM), 18)
        v_new = pseudo_random((num_tokens, NUM_KV_HEADS, HEAD_DIM), 19)
        consts = (k_new, v_new, page_tables, cu_q_lens, kv_lens)
        state = (q, k_pages, v_pages)
        row = {"workload": "prefill", "prefill_tokens": prefill_tokens, "chunk": chunk, "decode_tokens": 32,
               "flops": flops}
        results.append(row)
        max_kv = int(page_tables.shape[1]) * page_size
        bsizes = baseline_sizes(num_tokens, kv_lens.shape[0], max_kv, page_size)
        default = table_sizes(num_tokens, kv_lens.shape[0], max_kv, page_size)
        # Baseline, current and every tile variant compile together (thread pool), then run in turn.
        variants = [] if not PREFILL_VARIANTS else (PREFILL_VARIANTS[:2] if INTERPRET else PREFILL_VARIANTS)
        variant_sizes = [dataclasses.replace(default, block_q=rows // GROUP, block_kv=bkv, num_warps=warps,
                                             num_stages=stages) for rows, bkv, warps, stages in variants]
        start = time.time()
        compiled = compile_jobs({"baseline": (baseline_full_step, state, consts, True),
                                 "current": (current_full_step(default), state, consts, True),
                                 **{i: (current_full_step(v), state, consts, True) for i, v in enumerate(variant_sizes)}})
        say(f"prefill {prefill_tokens}/{chunk}: compiled {len(compiled)} programs in {time.time() - start:.1f}s")
        row["baseline_full_s"], state = time_compiled(_ok(compiled["baseline"]), state, *consts)
        row["current_default_s"], state = time_compiled(_ok(compiled["current"]), state, *consts)
        say(f"prefill {prefill_tokens} in chunks of {chunk}: baseline {row['baseline_full_s'] * 1e6:.0f}us "
            f"{flops / row['baseline_full_s'] / 1e12:.0f} TFLOP/s ({bsizes}); current (table) "
            f"{row['current_default_s'] * 1e6:.0f}us {flops / row['current_default_s'] / 1e12:.0f} TFLOP/s")
        best = (row["current_default_s"], default)
        # The peers first (cuDNN, the Mosaic GPU prototype): the tile sweep below stops at the budget.
        try:
            budget.check(5)
            n = prefill_tokens // chunk
            qd = pseudo_random((n, chunk, NUM_Q_HEADS, HEAD_DIM), 12)
            kd = pseudo_random((n, chunk, NUM_KV_HEADS, HEAD_DIM), 13)
            vd = pseudo_random((n, chunk, NUM_KV_HEADS, HEAD_DIM), 14)
            step = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
                q, k, v, scale=SM_SCALE, is_causal=True, implementation="cudnn").astype(q.dtype)
            row["cudnn_flops"] = n * 4 * HEAD_DIM * NUM_Q_HEADS * chunk * (chunk + 1) // 2
            row["cudnn_s"], _ = time_chain(step, qd, kd, vd, donate=False)
            row["cudnn_tflops"] = row["cudnn_flops"] / row["cudnn_s"] / 1e12
        except OutOfTime:
            pass
        except Exception as e:
            row["cudnn_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        # The Mosaic GPU prototype (wgmma + TMA, one warpgroup) on the same contiguous chunks as cuDNN.
        if not INTERPRET and "cudnn_flops" in row:
            for steps in MOSAIC_STEPS:
                try:
                    budget.check(5)
                    proto = functools.partial(causal_prefill_attention_mosaic_gpu, sm_scale=SM_SCALE,
                                              max_concurrent_steps=steps)
                    if steps == 2:  # correctness on the GPU, against cuDNN on the same inputs
                        want = jax.nn.dot_product_attention(qd, kd, vd, scale=SM_SCALE, is_causal=True,
                                                            implementation="cudnn").astype(jnp.float32)
                        got = proto(qd, kd, vd).astype(jnp.float32)
                        row["mosaic_rel_err_vs_cudnn"] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
                    t, _ = time_chain(lambda q, k, v: proto(q, k, v), qd, kd, vd, donate=False)
                    row[f"mosaic_steps{steps}_s"] = t
                    row[f"mosaic_steps{steps}_tflops"] = row["cudnn_flops"] / t / 1e12
                    say(f"  mosaic prefill prototype {prefill_tokens}/{chunk} steps={steps}: {t * 1e6:.0f}us "
                        f"{row['cudnn_flops'] / t / 1e12:.0f} TFLOP/s (rel err vs cuDNN "
                        f"{row.get('mosaic_rel_err_vs_cudnn', float('nan')):.1e})")
                except OutOfTime:
                    break
                except Exception as e:
                    row["mosaic_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    say(f"  mosaic prefill prototype: {row['mosaic_error']}")
                    break
        try:
            for i, ((rows, _, _, _), sizes) in enumerate(zip(variants, variant_sizes)):
                budget.check(3)
                try:
                    t, state = time_compiled(_ok(compiled[i]), state, *consts)
                except Exception as e:
                    say(f"  sweep prefill {sizes_label(sizes)}: {type(e).__name__} {str(e)[:150]}")
                    continue
                say(f"  sweep prefill {prefill_tokens}/{chunk} rows={rows} {sizes_label(sizes)}: {t * 1e6:.0f}us "
                    f"{flops / t / 1e12:.0f} TFLOP/s")
                results.append({"workload": "sweep-prefill", "prefill_tokens": prefill_tokens, "chunk": chunk,
                                "sizes": dataclasses.asdict(sizes), "s": t, "tflops": flops / t / 1e12})
                best = min(best, (t, sizes), key=lambda x: x[0])
        except OutOfTime:
            say("prefill sweep stopped by the time budget")
        row["best_s"], row["best_sizes"] = best[0], dataclasses.asdict(best[1])
        table.append({"kind": "prefill", "num_tokens": num_tokens, "prefill_tokens": prefill_tokens, "chunk": chunk,
                      "group": GROUP, "head_dim": HEAD_DIM, "page_size": page_size, "itemsize": 2,
                      "sizes": row["best_sizes"], "us": best[0] * 1e6, "tflops": flops / best[0] / 1e12})
        del state, compiled
        for key in ("baseline_full_s", "current_default_s", "best_s"):
            row[key[:-2] + "_tflops"] = flops / row[key] / 1e12
        say(f"prefill {prefill_tokens}/{chunk} RESULT: best {row['best_tflops']:.0f} TFLOP/s "
            f"({row['best_tflops'] / ceil['matmul_tflops']:.0%} of matmul) [{sizes_label(best[1])}] | baseline "
            f"{row['baseline_full_tflops']:.0f}" + (f" | cudnn {row['cudnn_tflops']:.0f}" if "cudnn_tflops" in row else ""))


# Output --------------------------------------------------------------------------------------

def write_outputs(out_dir, report):
    os.makedirs(out_dir, exist_ok=True)
    report["log"] = LOG
    with open(os.path.join(out_dir, "kernel_frontier.json"), "w") as f:
        json.dump(report, f, indent=1)
    if report.get("fp8_decode_table"):
        with open(os.path.join(out_dir, "gpu_fp8_decode_table.json"), "w") as f:
            json.dump({"source": f"benchmarks/kernel_frontier.py --only fp8 on {report['device']}, {report['date']}: "
                                 "best full-call time per shape of the default kernel over float8_e4m3fn pages",
                       "entries": report["fp8_decode_table"]}, f, indent=1)
    if report.get("decode_table"):
        with open(os.path.join(out_dir, "gpu_decode_table.json"), "w") as f:
            json.dump({"source": f"benchmarks/kernel_frontier.py on {report['device']}, {report['date']}: "
                                 "best full-call time per shape (write + attend)",
                       "entries": report["decode_table"]}, f, indent=1)
    ceil = report.get("ceilings") or {}
    read, mm = ceil.get("hbm_read_tbs", float("nan")), ceil.get("matmul_tflops", float("nan"))
    lines = [f"# Attention frontier (issue 21): {report['device']}, jax {report['jax']}", "",
             f"Command: `{report['command']}`", "",
             f"Ceilings in this run: HBM read {read:.2f} TB/s, bf16 matmul {mm:.0f} TFLOP/s. "
             f"Correctness: {json.dumps(report.get('check', {}))}; compiled call: "
             f"{json.dumps({k: v for k, v in (report.get('copies') or {}).items() if k != 'cache_sized_copies'})}.", "",
             "Decode, bf16, GQA 32/8, d 128, page 32; TB/s of K/V read; full call = K/V write + attention.", "",
             "| B | ctx | baseline attend | baseline full | current (table) full | best full | best / ceiling | "
             "cuDNN dense | best / cuDNN | prefetch off | XLA plan | both off | XLA merge | Pallas merge | XLA merge alone µs | best sizes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    f = lambda r, k: f"{r[k]:.2f}" if r.get(k) else "–"  # noqa: E731
    for r in report["results"]:
        if r["workload"] != "decode" or "best_tbs" not in r:
            continue
        bs = r["best_sizes"]
        lines.append(
            f"| {r['batch']} | {r['context']} | {f(r, 'baseline_attend_tbs')} | {f(r, 'baseline_full_tbs')} "
            f"| {f(r, 'current_default_tbs')} | **{f(r, 'best_tbs')}** | {r['best_tbs'] / read:.0%} "
            f"| {f(r, 'cudnn_tbs')} | {(r['best_tbs'] / r['cudnn_tbs']) if r.get('cudnn_tbs') else float('nan'):.2f} "
            f"| {f(r, 'best_prefetch_off_tbs')} | {f(r, 'best_plan_xla_tbs')} | {f(r, 'best_both_off_tbs')} "
            f"| {f(r, 'best_merge_xla_tbs')} | {f(r, 'best_merge_kernel_tbs')} | {r['combine_only_s'] * 1e6 if r.get('combine_only_s') else float('nan'):.1f} "
            f"| {bs['block_kv']}/{bs['num_warps']}w/{bs['num_stages']}st, {bs['num_splits']} splits"
            f"{', Pallas merge' if bs.get('merge_kernel') and bs['num_splits'] > 1 else ''} |")
    lines += fp8_markdown(report, read)
    lines += ["", "Prefill (+ 32 decode tokens at 2k), TFLOP/s; cuDNN: causal flash attention on the same chunks, "
                  "contiguous, without the decode tokens.", "",
              "| tokens | chunk | baseline full | current (table) | best | best / matmul | cuDNN | best / cuDNN | best sizes "
              "| Mosaic prototype (best of 2/3/4 stages) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        if r["workload"] != "prefill" or "best_tflops" not in r:
            continue
        bs = r["best_sizes"]
        cud = r.get("cudnn_tflops")
        lines.append(f"| {r['prefill_tokens']} | {r['chunk']} | {r['baseline_full_tflops']:.0f} "
                     f"| {r['current_default_tflops']:.0f} | **{r['best_tflops']:.0f}** | {r['best_tflops'] / mm:.0%} "
                     f"| {cud or float('nan'):.0f} | {(r['best_tflops'] / cud) if cud else float('nan'):.2f} "
                     f"| {bs['block_q'] * GROUP} rows/{bs['block_kv']}/{bs['num_warps']}w/{bs['num_stages']}st "
                     f"| {max([r[k] for k in r if k.startswith('mosaic_steps') and k.endswith('_tflops')], default=0):.0f} |")
    with open(os.path.join(out_dir, "kernel_frontier.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    plot(out_dir, report, read, mm)


def fp8_markdown(report, read) -> list[str]:
    """The fp8-pages table: bf16 pages beside fp8 pages, both through the engine's default kernel."""
    rows = [r for r in report["results"] if r["workload"] == "decode-fp8"]
    if not rows:
        return []
    lines = ["", "Decode through the engine's default kernel (full call: XLA scatter + attention), bf16 pages vs "
             "float8_e4m3fn pages; TB/s of each page dtype's own bytes (fp8: one a value), against the read "
             f"ceiling {read:.2f} TB/s; tok/s = B / time of one layer's call. 'V dim-major': fp8 pages with V "
             "stored [Hkv, P, D, page] (v_layout.py), same sizes. 'fp8 before': tiles widened to bf16 (the kernel "
             "before session 8), same sizes. 'best': the fp8 sweep's best (→ gpu_fp8_decode_table.json).",
             "", "| B | ctx | bf16 pages µs | bf16 TB/s | fp8 µs | fp8 TB/s | fp8 / ceiling | fp8 ÷ bf16 tok/s "
             "| V dim-major µs | V dim-major TB/s | V dim-major / ceiling "
             "| fp8 before TB/s | best fp8 µs | best TB/s | best / ceiling | best ÷ bf16 tok/s | best sizes "
             "| best V dim-major TB/s | its / ceiling | its sizes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- | --- | --- |"]
    us = lambda r, k: f"{r[k] * 1e6:.1f}" if r.get(k) else "–"  # noqa: E731
    tb = lambda r, k: f"{r[k]:.2f}" if r.get(k) else "–"  # noqa: E731
    pct = lambda r, k: f"{r[k] / read:.0%}" if r.get(k) and read == read else "–"  # noqa: E731
    for r in rows:
        bs = r.get("best_sizes")
        best_speedup = f"{r['bf16_s'] / r['best_s']:.2f}" if r.get("bf16_s") and r.get("best_s") else "–"
        lines.append(
            f"| {r['batch']} | {r['context']} | {us(r, 'bf16_s')} | {tb(r, 'bf16_tbs')} | {us(r, 'fp8_s')} "
            f"| {tb(r, 'fp8_tbs')} | {pct(r, 'fp8_tbs')} | {tb(r, 'fp8_speedup')} | {us(r, 'fp8_v_dim_major_s')} "
            f"| {tb(r, 'fp8_v_dim_major_tbs')} | {pct(r, 'fp8_v_dim_major_tbs')} | {tb(r, 'fp8_widen_query_tbs')} "
            f"| {us(r, 'best_s')} | **{tb(r, 'best_tbs')}** | {pct(r, 'best_tbs')} | {best_speedup} "
            f"| {_sizes_cell(bs)} | {tb(r, 'best_v_dim_major_tbs')} | {pct(r, 'best_v_dim_major_tbs')} "
            f"| {_sizes_cell(r.get('best_v_dim_major_sizes'))} |")
    return lines


def _sizes_cell(sizes: dict | None) -> str:
    """block_kv/warps/stages and splits of a sizes dict, for a table cell."""
    if not sizes:
        return "–"
    return f"{sizes['block_kv']}/{sizes['num_warps']}w/{sizes['num_stages']}st, {sizes['num_splits']} splits"


def plot(out_dir, report, read_ceiling, matmul_rate):
    """kernel_frontier.png: decode TB/s and prefill TFLOP/s per shape, each implementation a bar, ceilings dashed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    decode = [r for r in report["results"] if r["workload"] == "decode" and "best_tbs" in r]
    prefill = [r for r in report["results"] if r["workload"] == "prefill" and "best_tflops" in r]
    if not decode and not prefill:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [3, 1]})
    for ax, rows, keys, unit, ceiling, label in (
            (axes[0], decode, ("baseline_attend_tbs", "baseline_full_tbs", "best_tbs", "cudnn_tbs"), "TB/s",
             read_ceiling, lambda r: f"B={r['batch']}\n{r['context'] // 1024}k"),
            (axes[1], prefill, ("baseline_full_tflops", "best_tflops", "cudnn_tflops", "mosaic_steps2_tflops"),
             "TFLOP/s", matmul_rate,
             lambda r: f"{r['prefill_tokens'] // 1024}k/{r['chunk'] // 1024}k")):
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            ax.bar([i + j * width for i in range(len(rows))], [r.get(key) or 0 for r in rows], width,
                   label=key.rsplit("_", 1)[0].replace("_", " "))
        if ceiling == ceiling:  # not NaN
            ax.axhline(ceiling, color="k", ls="--", lw=0.8, label="ceiling (this run)")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [label(r) for r in rows], fontsize=8)
        ax.set_ylabel(unit)
        ax.legend(fontsize=7)
    axes[0].set_title("decode: K/V read rate (full call = write + attend)")
    axes[1].set_title("prefill attention")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "kernel_frontier.png"), dpi=110)
    plt.close(fig)


def guarded(what: str, fn, *args, **kwargs):
    """Run one stage; a failure is logged (with its traceback) and the run goes on to the next stage."""
    try:
        return fn(*args, **kwargs)
    except OutOfTime:
        say(f"{what}: out of time")
    except Exception as e:
        say(f"{what}: FAILED {type(e).__name__}: {str(e)[:400]}")
        say(traceback.format_exc()[-1500:])
    return None


def main():
    global INTERPRET, REPEATS, TIMED_RUNS, TILE_VARIANTS, PREFILL_VARIANTS, MOSAIC_STEPS, STAGE2_NEEDS_S
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop sweeping after this many seconds")
    parser.add_argument("--only", default="check,ceilings,decode,prefill,regression,fp8")
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in DECODE_SHAPES),
                        help="decode shapes to sweep, BxCONTEXT")
    parser.add_argument("--no-sweep", action="store_true",
                        help="time the table's sizes only (baseline, current, cuDNN), e.g. after adopting a table")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check of this script: interpreter, tiny shapes, each chain timed once (without it "
                             "the GPU defaults hold)")
    parser.add_argument("--quick-check", action="store_true", help="only the correctness cases in QUICK_CHECKS")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="chained calls per timed program")
    parser.add_argument("--regression", default="256x4096,256x1024,1x1024",
                        help="shapes timed without a sweep (baseline vs current), BxCONTEXT")
    parser.add_argument("--reserve-s", type=float, default=0.0,
                        help="stop the decode sweeps this many seconds before the budget ends (for the regression shapes)")
    parser.add_argument("--stage2-needs-s", type=float, default=STAGE2_NEEDS_S,
                        help="a decode sweep's second stage (neighbours, ablations) only with this much budget left")
    parser.add_argument("--fp8-shapes", default=",".join(f"{b}x{c}" for b, c in FP8_SHAPES),
                        help="shapes of the fp8 stage (bf16 vs fp8 pages; the goal shapes among them swept), BxCONTEXT")
    parser.add_argument("--mosaic-steps", default="2,3,4", help="pipeline depths of the Mosaic GPU prefill prototype")
    args = parser.parse_args()
    REPEATS, STAGE2_NEEDS_S = args.repeats, args.stage2_needs_s
    MOSAIC_STEPS = tuple(int(x) for x in args.mosaic_steps.split(",") if x)
    if args.smoke:
        INTERPRET, REPEATS, TIMED_RUNS, TILE_VARIANTS = True, 2, 1, TILE_VARIANTS[:2]
        args.shapes = "1x512,2x256"
    if args.no_sweep:
        PREFILL_VARIANTS = []
    stages = set(args.only.split(","))
    if args.smoke:
        stages.discard("ceilings")  # 8 GiB arrays: a GPU's job
    sweep = not args.no_sweep
    budget = Budget(args.budget_s)
    device = jax.devices()[0]
    report = {"command": " ".join(["python3"] + sys.argv), "device": device.device_kind,
              "platform": platform.platform(), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC"),
              "table_in_use": str(GPU_TABLE_PATH) if GPU_TABLE_PATH.exists() else None,
              "results": [], "decode_table": [], "fp8_decode_table": []}
    say(f"command: {report['command']}")
    say(f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; {platform.platform()}")
    say(f"measured table in use: {report['table_in_use']}")
    decode = lambda b, c, sweep: guarded(  # noqa: E731
        f"decode B={b} ctx={c}", run_decode_shape, b, c, args.page_size, report["results"], budget,
        report["decode_table"], sweep=sweep)
    try:
        if "ceilings" in stages:
            report["ceilings"] = guarded("ceilings", measure_ceilings)
        if "check" in stages:
            report["check"] = guarded("check", check_correctness, report["results"], quick=args.quick_check)
            if not args.quick_check:  # run 1 showed the alias and no copies; nothing around the cache changed
                report["copies"] = guarded("copies", check_copies, args.page_size)
        write_outputs(args.out, report)
        if "decode" in stages:
            for shape in args.shapes.split(","):
                batch, context = (int(x) for x in shape.split("x"))
                if budget.left() < 20 + args.reserve_s:
                    say(f"decode B={batch} ctx={context}: skipped, out of time")
                    continue
                decode(batch, context, sweep)
                write_outputs(args.out, report)
        if "regression" in stages:
            shapes = ((2, 256),) if INTERPRET else [tuple(int(x) for x in s.split("x")) for s in args.regression.split(",") if s]
            for batch, context in shapes:
                if budget.left() < 15:
                    say(f"regression B={batch} ctx={context}: skipped, out of time")
                    continue
                decode(batch, context, False)
                write_outputs(args.out, report)
        if "prefill" in stages:
            if budget.left() < 30:
                say("prefill: skipped, out of time")
            else:
                guarded("prefill", run_prefill, report.get("ceilings") or {"matmul_tflops": float("nan")},
                        args.page_size, report["results"], budget, report["decode_table"])
                write_outputs(args.out, report)
        if "fp8" in stages:
            fp8_shapes = [(2, 256), (1, 512)] if INTERPRET else [
                tuple(int(x) for x in shape.split("x")) for shape in args.fp8_shapes.split(",")]
            guarded("fp8", run_fp8_stage, report["results"], report["fp8_decode_table"], budget, args.page_size,
                    shapes=fp8_shapes, sweep_shapes=fp8_shapes if INTERPRET else None)
            write_outputs(args.out, report)
    finally:
        say(f"total {time.time() - T0:.0f}s")
        write_outputs(args.out, report)
        print("\n".join(open(os.path.join(args.out, "kernel_frontier.md")).read().splitlines()[-24:]))


if __name__ == "__main__":
    main()

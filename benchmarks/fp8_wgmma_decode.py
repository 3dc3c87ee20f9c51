"""Issue 18's decode-kernel goal: the e4m3-wgmma Mosaic GPU kernel against the engine's kernel over fp8 pages.

One run, on one GPU (Hopper: the new kernel's wgmmas are sm_90a):

1. **Check** (exits 1 on a mismatch, printing the errors): the compiled ``paged_decode_fp8_wgmma``
   (``pallas_kernels/paged_attention/gpu_fp8_wgmma.py``) against the plain-JAX reference on the
   same fp8 pages (scales 0.5 / 3.0), on a ragged decode batch of Llama-3.1-8B heads (lengths 1,
   a partial page, several steps, an empty slot, 4k+): page 16 at 1 and 3 splits (gating), page 64
   (the unpacked path: tells which path broke), within the interpreter tests' tolerance
   (``TOLERANCE_VS_REFERENCE``); the engine's kernel's error on the same batch printed beside it.
2. **Ceiling**: the HBM read rate, measured in the same run (``common.measure_ceilings``).
3. **Timing**, B in {1, 32, 64, 256} x ctx in {1k, 4k, 16k} (caches past 2**31 elements an array
   skipped, as the engine caps an fp8 pool), page 16, Llama-3.1-8B heads (32 q, 8 kv, d 128), bf16
   queries: the engine's kernel over fp8 pages (``gpu.attend_gpu``: attention alone, tiles widened
   to f16, the engine's sizes for fp8 pages) and the new kernel at a few launch variants (splits,
   pages in flight, pages a step; the goal shapes B >= 32, ctx >= 4k get the most). Each is
   ``REPEATS`` chained calls unrolled in one jitted program (each output the next query), median
   of ``TIMED_RUNS`` (3); microseconds, TB/s of fp8 bytes (one byte a K or V value), % of the read
   ceiling.
   Neither writes K/V: both are attention over written pages.

    python3 benchmarks/fp8_wgmma_decode.py --out DIR [--budget-s 240]

Writes DIR/fp8_wgmma_decode.json and .md (after every shape, so a run cut short keeps its rows).
``--smoke``: the Pallas interpreters on CPU, tiny shapes, to check this script without a GPU
(one shape, 2 chained calls a program timed once: the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import Log, header, measure_ceilings, time_in_loop  # noqa: E402
from kernel_attention import pseudo_random  # noqa: E402
from pallas_kernels.paged_attention import gpu as engine_gpu  # noqa: E402
from pallas_kernels.paged_attention.block_sizes import gpu_block_sizes  # noqa: E402
from pallas_kernels.paged_attention.gpu_fp8_wgmma import (  # noqa: E402
    FP8, paged_decode_fp8_wgmma, transpose_v_pages,
)
from pallas_kernels.paged_attention.reference import attend_reference  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16  # Llama-3.1-8B, the engine's pages
SM_SCALE = HEAD_DIM**-0.5
REPEATS = 32
TIMED_RUNS = 3  # timed runs of each program after its warm-up (median)
MAX_ARRAY_ELEMENTS = 2**31  # an fp8 K or V array of more elements is not built (jaxinfer.memory's cap)
# Same bound as the interpreter tests (tests/test_paged_attention_fp8_wgmma.py says why).
TOLERANCE_VS_REFERENCE = 0.06
CHECK_K_SCALE, CHECK_V_SCALE = 0.5, 3.0
SHAPES = [(b, c) for c in (4096, 16384, 1024) for b in (32, 64, 256, 1)]  # goal shapes first
NUM_SMS = 132  # H200; only sizes the split heuristic below
say = Log(elapsed=True)


def engine_sizes(batch, context):
    """What the engine's default kernel runs with over fp8 pages at this shape."""
    return gpu_block_sizes(num_tokens=batch, max_num_seqs=batch, max_kv_len=context, num_kv_heads=NUM_KV_HEADS,
                           group=NUM_Q_HEADS // NUM_KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE_SIZE, itemsize=2,
                           kv_itemsize=1)


def engine_attend(q, k_pages, v_pages, page_tables, lengths, *, interpret=False, sizes=None):
    batch = q.shape[0]
    sizes = sizes or engine_sizes(batch, page_tables.shape[1] * k_pages.shape[2])
    cu_q_lens = jnp.arange(batch + 1, dtype=jnp.int32)
    return engine_gpu.attend_gpu(q, k_pages, v_pages, page_tables, cu_q_lens, lengths, sm_scale=SM_SCALE,
                                 sizes=sizes, interpret=interpret)


def new_variants(batch, context, is_goal, row_sums_ok):
    """Launch variants to time: splits enough to fill the SMs twice (and half, double that at goal
    shapes), 2-4 steps in flight, 4 or 8 pages a step, both row sums (where their check passed)."""
    programs = batch * NUM_KV_HEADS
    steps = context // (4 * PAGE_SIZE)
    splits = 1
    while programs * splits < 2 * NUM_SMS and splits * 2 <= max(1, steps // 4):
        splits *= 2
    variants = [(splits, 2, 4, "registers"), (splits, 2, 4, "mma")]
    if is_goal:
        variants += [(splits, 4, 4, "registers"), (splits, 4, 4, "mma"), (splits, 3, 8, "mma"),
                     (max(1, splits // 2), 4, 4, "mma")]
        if steps >= 16 * splits:
            variants.append((splits * 2, 4, 4, "mma"))
    keys = ("num_splits", "max_concurrent_steps", "pages_per_step", "row_sums")
    return [dict(zip(keys, v)) for v in dict.fromkeys(variants) if row_sums_ok.get(v[3])]


def check_batch(page_size: int, interpret: bool):
    """A ragged decode batch over fp8 pages (lengths 1, a partial page, several steps, empty, 4k+) and its reference."""
    rng = np.random.default_rng(page_size)
    lengths = np.array([1, 7, 150, 0, 64] if interpret else [1, 7, 150, 0, 4100, 1000, 16, 2049], np.int32)
    pages_per_seq = max(1, -(-int(lengths.max()) // page_size))
    num_pages = len(lengths) * pages_per_seq + 1
    page_tables = rng.permutation(num_pages)[:len(lengths) * pages_per_seq].reshape(len(lengths), pages_per_seq)
    shape = (NUM_KV_HEADS, num_pages, page_size, HEAD_DIM)
    k_pages = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(FP8)
    v_pages = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(FP8)
    q = jnp.asarray(rng.standard_normal((len(lengths), NUM_Q_HEADS, HEAD_DIM), np.float32)).astype(jnp.bfloat16)
    args = (q, k_pages, v_pages, jnp.asarray(lengths), jnp.asarray(page_tables.astype(np.int32)))
    want = attend_reference(q.astype(jnp.float32), k_pages.astype(jnp.float32) * CHECK_K_SCALE,
                            v_pages.astype(jnp.float32) * CHECK_V_SCALE, args[4],
                            jnp.arange(len(lengths) + 1, dtype=jnp.int32), args[3], sm_scale=SM_SCALE)
    return args, np.asarray(want, np.float32)


def error_of(got, want, lengths) -> dict:
    got, live = np.asarray(got.astype(jnp.float32)), np.asarray(lengths) > 0
    return {"relative_error": float(np.linalg.norm(got[live] - want[live]) / np.linalg.norm(want[live])),
            "finite": bool(np.isfinite(got).all()), "empty_slots_zero": bool(np.all(got[~live] == 0))}


# (page size, splits, row sums, gates the run): page 16 is the engine's (the packed f = 2 path), page 64 f = 1.
CHECK_CASES = ((16, 1, "registers", True), (16, 3, "registers", True), (16, 1, "mma", False),
               (64, 1, "registers", False))


def check(interpret: bool, cases=CHECK_CASES) -> dict:
    """Compiled kernel vs the reference; ``passed`` is False on any mismatch or failure (main then exits 1).

    Page 16 (the engine's; the packed f = 2 path) at 1 and 3 splits gates the run; the MMA row
    sums are checked too (their variants are timed only if it passes), and page 64 (f = 1), so a
    failure tells which path broke. The engine's kernel's error on the same batch is printed for scale.
    ``cases``: a subset of ``CHECK_CASES`` (a test of the gate itself needs only one).
    """
    results, ok = {}, True
    for page_size, splits, row_sums, gates in cases:
        key = f"new_page{page_size}_splits{splits}_{row_sums}"
        try:
            (q, k_pages, v_pages, lengths, page_tables), want = check_batch(page_size, interpret)
            got = paged_decode_fp8_wgmma(q, k_pages, transpose_v_pages(v_pages), lengths, page_tables,
                                         k_scale=CHECK_K_SCALE, v_scale=CHECK_V_SCALE, sm_scale=SM_SCALE,
                                         num_splits=splits, row_sums=row_sums, interpret=interpret)
            result = error_of(got, want, lengths)
            result["passed"] = (result["relative_error"] < TOLERANCE_VS_REFERENCE and result["finite"]
                                and result["empty_slots_zero"])
        except Exception:  # noqa: BLE001  (recorded, and the run stops after the check)
            result = {"passed": False, "error": traceback.format_exc()[-1500:]}
        results[key] = result
        ok &= result["passed"] or not gates
        say(f"check new kernel, page {page_size}, {splits} split(s), row sums {row_sums}: {result}")
    (q, k_pages, v_pages, lengths, page_tables), want = check_batch(PAGE_SIZE, interpret)
    # The engine's kernel takes the scales outside (the dispatcher folds k_scale into q, v_scale into the output).
    got = engine_attend(q * CHECK_K_SCALE, k_pages, v_pages, page_tables, lengths, interpret=interpret)
    results["engine"] = error_of(got.astype(jnp.float32) * CHECK_V_SCALE, want, lengths)
    say(f"check engine kernel (for scale, not gated): {results['engine']}")
    results["passed"] = bool(ok)
    if not ok:
        say(f"FAILED: the new kernel at page 16 must compile and run, with relative error < "
            f"{TOLERANCE_VS_REFERENCE}, finite, zero for empty slots")
    return results


def decode_arrays(batch, context):
    """bf16 queries, full-length sequences and a page table scattering their pages (the caller builds the pages)."""
    pages_per_seq = context // PAGE_SIZE
    num_pages = batch * pages_per_seq
    rng = np.random.default_rng(0)
    page_tables = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq).astype(np.int32))
    q = pseudo_random((batch, NUM_Q_HEADS, HEAD_DIM), 6, jnp.bfloat16, scale=2.0)
    lengths = jnp.full((batch,), context, jnp.int32)
    return q, page_tables, lengths, num_pages


def time_shape(batch, context, is_goal, interpret, budget_end, row_sums_ok) -> dict:
    q, page_tables, lengths, num_pages = decode_arrays(batch, context)
    fp8_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM
    row = {"batch": batch, "context": context, "page_size": PAGE_SIZE, "fp8_bytes": fp8_bytes, "new": []}
    k_pages = pseudo_random((NUM_KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM), 4, FP8)

    v_pages = pseudo_random((NUM_KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM), 5, FP8)
    sizes = engine_sizes(batch, context)
    row["engine_sizes"] = {f: getattr(sizes, f) for f in sizes.__dataclass_fields__}
    try:
        step = lambda x, k, v, t, n: engine_attend(x, k, v, t, n, interpret=interpret, sizes=sizes)
        row["engine_s"] = time_in_loop(step, q, k_pages, v_pages, page_tables, lengths, unroll=REPEATS,
                                       timed_runs=TIMED_RUNS)
    except Exception as e:  # noqa: BLE001  (a failure is a result; the run goes on)
        row["engine_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    del v_pages

    v_pages_t = pseudo_random((NUM_KV_HEADS, num_pages, HEAD_DIM, PAGE_SIZE), 5, FP8)
    for variant in new_variants(batch, context, is_goal, row_sums_ok):
        if time.time() > budget_end:
            row["new_cut_short"] = True
            break
        try:
            def step(x, k, v, t, n, variant=dict(variant)):
                return paged_decode_fp8_wgmma(x, k, v, n, t, k_scale=1.0, v_scale=1.0, sm_scale=SM_SCALE,
                                              interpret=interpret, **variant)
            variant["seconds"] = time_in_loop(step, q, k_pages, v_pages_t, page_tables, lengths, unroll=REPEATS,
                                              timed_runs=TIMED_RUNS)
        except Exception as e:  # noqa: BLE001
            variant["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["new"].append(variant)
    timed = [v for v in row["new"] if "seconds" in v]
    if timed:
        row["new_best"] = min(timed, key=lambda v: v["seconds"])
        row["new_s"] = row["new_best"]["seconds"]
    return row


def summarize(row, ceiling_tbs):
    for kind in ("engine", "new"):
        seconds = row.get(f"{kind}_s")
        if seconds:
            row[f"{kind}_us"] = seconds * 1e6
            row[f"{kind}_tbs"] = row["fp8_bytes"] / seconds / 1e12
            row[f"{kind}_pct_ceiling"] = 100 * row[f"{kind}_tbs"] / ceiling_tbs
    if row.get("engine_s") and row.get("new_s"):
        row["speedup"] = row["engine_s"] / row["new_s"]
    say(f"B={row['batch']:4d} ctx={row['context']:6d}: engine "
        + (f"{row['engine_us']:8.1f}us {row['engine_tbs']:.2f}TB/s ({row['engine_pct_ceiling']:.0f}%)"
           if "engine_us" in row else row.get("engine_error", "not timed"))
        + " | new " + (f"{row['new_us']:8.1f}us {row['new_tbs']:.2f}TB/s ({row['new_pct_ceiling']:.0f}%) "
                       f"x{row.get('speedup', float('nan')):.2f} best {row['new_best']}"
                       if "new_us" in row else str([v.get('error') for v in row['new']])[:300]))


def write_outputs(out_dir, report):
    os.makedirs(out_dir, exist_ok=True)
    report["log"] = say.lines
    with open(os.path.join(out_dir, "fp8_wgmma_decode.json"), "w") as f:
        json.dump(report, f, indent=1)
    ceiling = report.get("ceilings", {}).get("hbm_read_tbs", float("nan"))
    lines = ["# fp8 pages: e4m3-wgmma Mosaic GPU kernel vs the engine's kernel", "",
             f"`{report['header']['command']}` on {report['header']['device']}, jax {report['header']['jax']}; "
             f"read ceiling {ceiling:.2f} TB/s (same run). TB/s of fp8 bytes (K+V, 1 byte a value).", "",
             f"Check (relative error vs the reference on the same fp8 pages): {json.dumps(report.get('check'))}", "",
             "| B | ctx | engine µs | engine TB/s (% ceiling) | new µs | new TB/s (% ceiling) "
             "| new ÷ engine speed | new variant |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in report["rows"]:
        def cell(kind):
            if f"{kind}_us" not in row:
                return "—", "—"
            return f"{row[f'{kind}_us']:.1f}", f"{row[f'{kind}_tbs']:.2f} ({row[f'{kind}_pct_ceiling']:.0f}%)"
        best = row.get("new_best", {})
        keys = ("num_splits", "max_concurrent_steps", "pages_per_step", "row_sums")
        variant = ", ".join(f"{k}={best[k]}" for k in keys if k in best)
        lines.append(f"| {row['batch']} | {row['context']} | {' | '.join(cell('engine'))} | "
                     f"{' | '.join(cell('new'))} | "
                     f"{row.get('speedup', float('nan')):.2f} | {variant} |")
    if report.get("skipped"):
        lines += ["", f"Skipped: {report['skipped']}"]
    with open(os.path.join(out_dir, "fp8_wgmma_decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    global SHAPES, REPEATS, TIMED_RUNS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for fp8_wgmma_decode.json and .md")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new shapes after this")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: the Pallas interpreters, one tiny shape, 2 chained calls a program timed once "
                             "(the GPU defaults are unchanged without it)")
    args = parser.parse_args()
    interpret = args.smoke
    if interpret:
        SHAPES, REPEATS, TIMED_RUNS = [(2, 64)], 2, 1
    report = {"header": header(say), "rows": [], "skipped": []}
    budget_end = say.start + args.budget_s
    report["check"] = check(interpret)
    write_outputs(args.out, report)
    if not report["check"]["passed"]:
        sys.exit(1)
    check_results = report["check"]
    row_sums_ok = {"registers": True, "mma": check_results["new_page16_splits1_mma"]["passed"]}
    report["ceilings"] = measure_ceilings(say)
    ceiling = report["ceilings"]["hbm_read_tbs"]
    for batch, context in SHAPES:
        if batch * context * NUM_KV_HEADS * HEAD_DIM > MAX_ARRAY_ELEMENTS:
            report["skipped"].append(f"B={batch} ctx={context}: an fp8 K array of more than 2**31 elements")
            continue
        if time.time() > budget_end:
            report["skipped"].append(f"B={batch} ctx={context}: out of time (--budget-s {args.budget_s:.0f})")
            continue
        try:
            row = time_shape(batch, context, batch >= 32 and context >= 4096, interpret, budget_end, row_sums_ok)
        except Exception:  # noqa: BLE001
            say(f"B={batch} ctx={context}: {traceback.format_exc()[-600:]}")
            report["skipped"].append(f"B={batch} ctx={context}: failed (log)")
            continue
        summarize(row, ceiling)
        report["rows"].append(row)
        write_outputs(args.out, report)
    write_outputs(args.out, report)
    say(f"done in {time.time() - say.start:.0f}s; wrote {args.out}/fp8_wgmma_decode.json and .md")


if __name__ == "__main__":
    main()

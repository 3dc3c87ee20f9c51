"""Choose the GPU lowering by measurement: Pallas-Triton (``gpu.py``) vs a Mosaic GPU prototype.

Three decode shapes of Llama-3-8B attention (32 q heads, 8 KV heads, head_dim 128, bf16,
page size 32): B=64 ctx 4k, B=8 ctx 16k, B=1 ctx 32k. In one run on one GPU: the HBM read
ceiling, the Triton kernel at its tuned sizes, the Mosaic GPU prototype
(``mosaic_gpu_prototype.py``) at a few split counts and pipeline depths, a correctness
check of the prototype on the GPU, and (``--sweep``) Triton tile variants at small-batch
and ctx-4k shapes, the data behind ``block_sizes.py``.

Timing: each implementation runs 32 times back to back inside one jitted, unrolled
program (each call's output is the next call's query, so nothing is hoisted), and the
median over several such programs is divided by 32 (``REPEATS``, ``kernel_attention.time_loop``). A
``fori_loop`` would sync its predicate with the host every call, which inflated calls under
~150 µs in the first runs.

    python3 benchmarks/kernel_lowering_choice.py --out DIR [--sweep]

Writes DIR/kernel_lowering_choice.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from kernel_attention import (
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_Q_HEADS,
    decode_inputs,
    pseudo_random,
    time_loop,
)
from mosaic_gpu_prototype import paged_decode_attention_mosaic_gpu

# The Triton side of this historical comparison is the kernel it was run against (before issue 21).
from pallas_kernels.paged_attention import block_sizes as bs
from pallas_kernels.paged_attention import gpu as gpu_kernel
from pallas_kernels.paged_attention.block_sizes import BlockSizes
from pallas_kernels.paged_attention.reference import attend_reference
from tests.attention_cases import make_case

PAGE_SIZE = 32
SHAPES = [(64, 4096), (8, 16384), (1, 32768)]
REPEATS = 32  # chained calls per timed program
SM_SCALE = HEAD_DIM**-0.5
LOG = []


def say(*parts):
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LOG.append(line)


def read_ceiling():
    x = pseudo_random((4 * 1024**3,), 1)  # 8 GiB of bf16
    step = lambda c, x: c + jnp.sum(x + c.astype(x.dtype), dtype=jnp.float32) * 1e-30
    t = time_loop(step, jnp.float32(0), x, repeats=REPEATS)
    del x
    return 8 * 1024**3 / t / 1e12


def triton_step(sizes):
    def step(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens):
        return gpu_kernel.attend_gpu(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens,
                                     sm_scale=SM_SCALE, sizes=sizes)
    return step


def mosaic_step(num_splits, steps):
    def step(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens):
        return paged_decode_attention_mosaic_gpu(q, k_pages, v_pages, page_tables, kv_lens, sm_scale=SM_SCALE,
                                                 num_splits=num_splits, max_concurrent_steps=steps)
    return step


def triton_sizes(batch, context, **overrides):
    tuned = bs.gpu_block_sizes(num_tokens=batch, max_num_seqs=batch, max_kv_len=context,
                               num_kv_heads=NUM_KV_HEADS, group=NUM_Q_HEADS // NUM_KV_HEADS, head_dim=HEAD_DIM,
                               page_size=PAGE_SIZE, itemsize=2)
    return BlockSizes(**{f: overrides.get(f) or getattr(tuned, f) for f in BlockSizes.__dataclass_fields__})


def rel_err(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def check_prototype():
    """Prototype vs the plain-JAX reference on the GPU: ragged lengths, mid-page ends, an empty slot."""
    seqs = [(1, 700), (1, 32), (0, 0), (1, 1), (1, 4096), (1, 65)]
    case = make_case(3, seqs, num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                     page_size=PAGE_SIZE, dtype=jnp.bfloat16, nan_fill=False)
    batch = len(seqs)
    q = jnp.zeros((batch, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16)
    live = np.array([s[0] > 0 for s in seqs])
    q = q.at[np.flatnonzero(live)].set(case.q)
    cu_q_lens = jnp.arange(batch + 1, dtype=jnp.int32)
    ref = attend_reference(q, case.k_pages, case.v_pages, case.page_tables, cu_q_lens, case.kv_lens,
                           sm_scale=case.sm_scale)
    worst = 0.0
    for splits in (1, 4):
        out = paged_decode_attention_mosaic_gpu(q, case.k_pages, case.v_pages, case.page_tables, case.kv_lens,
                                                sm_scale=case.sm_scale, num_splits=splits)
        err = rel_err(out, ref)
        nan = bool(jnp.isnan(out).any())
        say(f"check mosaic prototype vs reference, splits={splits}: rel err {err:.2e} nan={nan}")
        worst = max(worst, float("inf") if nan else err)
    return worst


def compare_shape(batch, context, ceiling, results):
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
    args = decode_inputs(batch, context, PAGE_SIZE)
    row = {"workload": "lowering-choice", "batch": batch, "context": context, "page_size": PAGE_SIZE,
           "kv_bytes": kv_bytes, "variants": []}
    sizes = triton_sizes(batch, context)
    t = time_loop(triton_step(sizes), *args, repeats=REPEATS)
    row["triton"] = {"s": t, "tbs": kv_bytes / t / 1e12, "sizes": sizes.__dict__}
    say(f"B={batch:3d} ctx={context:6d} triton (table {sizes.__dict__}): {t * 1e6:8.1f}us "
        f"{kv_bytes / t / 1e12:.2f}TB/s ({kv_bytes / t / 1e12 / ceiling:.0%})")
    triton_out = triton_step(sizes)(*args)
    base = bs._num_splits(batch * NUM_KV_HEADS, context, PAGE_SIZE, bs._GPU_NUM_SMS * bs._GPU_PROGRAMS_PER_SM)
    for splits in sorted({max(1, base // 2), base, base * 2}):
        for steps in (2, 4, 8):
            variant = {"num_splits": splits, "max_concurrent_steps": steps}
            try:
                out = mosaic_step(splits, steps)(*args)
                variant["rel_err_vs_triton"] = rel_err(out, triton_out)
                t = time_loop(mosaic_step(splits, steps), *args, repeats=REPEATS)
                variant.update(s=t, tbs=kv_bytes / t / 1e12)
                say(f"B={batch:3d} ctx={context:6d} mosaic splits={splits:3d} steps={steps}: {t * 1e6:8.1f}us "
                    f"{kv_bytes / t / 1e12:.2f}TB/s ({kv_bytes / t / 1e12 / ceiling:.0%}) "
                    f"err vs triton {variant['rel_err_vs_triton']:.1e}")
            except Exception as e:  # the evidence, if Mosaic GPU cannot compile or run a variant
                variant["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
                say(f"B={batch} ctx={context} mosaic {variant}: FAILED\n{traceback.format_exc()[-3000:]}")
            row["variants"].append(variant)
    timed = [v for v in row["variants"] if "s" in v]
    if timed:
        best = min(timed, key=lambda v: v["s"])
        row["mosaic_best"] = best
        say(f"B={batch:3d} ctx={context:6d}: mosaic best / triton = {row['triton']['s'] / best['s']:.2f}x speed")
    results.append(row)
    del args


SWEEP = {  # (batch, context): [(block_kv, num_warps, num_stages, num_splits)]
    (1, 16384): [(64, 4, 4, 32), (64, 4, 4, 64), (64, 4, 4, 128), (128, 4, 3, 32), (128, 4, 3, 64),
                 (32, 2, 4, 128), (64, 2, 4, 64)],
    (1, 32768): [(64, 4, 4, 32), (64, 4, 4, 64), (64, 4, 4, 128), (128, 4, 3, 64), (128, 4, 3, 128),
                 (64, 2, 4, 128), (128, 8, 3, 64)],
    (32, 4096): [(64, 4, 4, 1), (64, 4, 4, 2), (64, 4, 4, 4), (64, 2, 4, 2), (128, 4, 3, 2), (32, 2, 4, 4)],
    (64, 4096): [(64, 4, 4, 1), (64, 4, 4, 2), (64, 4, 4, 4), (64, 2, 4, 1), (64, 2, 4, 2), (128, 4, 3, 2),
                 (32, 2, 4, 2), (128, 8, 4, 2)],
}


def run_sweep(ceiling, results, save=lambda: None):
    for (batch, context), variants in SWEEP.items():
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
        args = decode_inputs(batch, context, PAGE_SIZE)
        for block_kv, warps, stages, splits in variants:
            sizes = triton_sizes(batch, context, block_kv=block_kv, num_warps=warps, num_stages=stages,
                                 num_splits=splits)
            try:
                t = time_loop(triton_step(sizes), *args, repeats=REPEATS)
            except Exception as e:
                say(f"sweep B={batch} ctx={context} {sizes}: {type(e).__name__} {str(e)[:200]}")
                continue
            tbs = kv_bytes / t / 1e12
            say(f"sweep triton B={batch:3d} ctx={context:6d} bkv={block_kv:3d} w={warps} st={stages} "
                f"splits={splits:3d}: {t * 1e6:8.1f}us {tbs:.2f}TB/s ({tbs / ceiling:.0%})")
            results.append({"workload": "sweep-triton", "batch": batch, "context": context,
                            "sizes": sizes.__dict__, "s": t, "tbs": tbs})
        del args
        save()


def write_outputs(out_dir, report):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kernel_lowering_choice.json"), "w") as f:
        json.dump(report, f, indent=1)
    ceiling = report.get("hbm_read_tbs") or float("nan")
    lines = [f"# GPU lowering choice: Pallas-Triton vs Mosaic GPU prototype ({report['device']}, jax {report['jax']})",
             "", f"Command: `{report['command']}`", "",
             f"Hardware: {report['hardware']}. HBM read ceiling in this run: {ceiling:.2f} TB/s. "
             f"Decode, bf16, 32 q / 8 KV heads, head_dim 128, page {PAGE_SIZE}; {REPEATS} chained calls "
             "per timed program.", "",
             f"Mosaic GPU prototype vs reference on this GPU: max rel. error {report.get('mosaic_check_rel_err', 'n/a')}",
             "", "| batch | context | Triton µs | Triton TB/s | / ceiling | Mosaic best µs | Mosaic TB/s | / ceiling "
             "| Mosaic config | Mosaic time / Triton time |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        if r["workload"] != "lowering-choice":
            continue
        tr = r["triton"]
        mb = r.get("mosaic_best")
        if mb:
            lines.append(f"| {r['batch']} | {r['context']} | {tr['s'] * 1e6:.1f} | {tr['tbs']:.2f} | "
                         f"{tr['tbs'] / ceiling:.0%} | {mb['s'] * 1e6:.1f} | {mb['tbs']:.2f} | {mb['tbs'] / ceiling:.0%} | "
                         f"splits {mb['num_splits']}, {mb['max_concurrent_steps']} pages in flight | "
                         f"{mb['s'] / tr['s']:.2f} |")
        else:
            lines.append(f"| {r['batch']} | {r['context']} | {tr['s'] * 1e6:.1f} | {tr['tbs']:.2f} | "
                         f"{tr['tbs'] / ceiling:.0%} | failed | | | | |")
    lines += ["", "All Mosaic GPU variants:", "", "| batch | context | splits | pages in flight | µs | TB/s | rel. err vs Triton |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        for v in r.get("variants", []):
            if "s" in v:
                lines.append(f"| {r['batch']} | {r['context']} | {v['num_splits']} | {v['max_concurrent_steps']} | "
                             f"{v['s'] * 1e6:.1f} | {v['tbs']:.2f} | {v['rel_err_vs_triton']:.1e} |")
            else:
                lines.append(f"| {r['batch']} | {r['context']} | {v['num_splits']} | {v['max_concurrent_steps']} | "
                             f"error: {v.get('error', '')[:200]} | | |")
    sweep = [r for r in report["results"] if r["workload"] == "sweep-triton"]
    if sweep:
        lines += ["", "Triton tile sweep (`--sweep`):", "",
                  "| batch | context | block_kv | warps | stages | splits | µs | TB/s | / ceiling |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in sweep:
            s = r["sizes"]
            lines.append(f"| {r['batch']} | {r['context']} | {s['block_kv']} | {s['num_warps']} | {s['num_stages']} | "
                         f"{s['num_splits']} | {r['s'] * 1e6:.1f} | {r['tbs']:.2f} | {r['tbs'] / ceiling:.0%} |")
    with open(os.path.join(out_dir, "kernel_lowering_choice.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def hardware():
    device = jax.devices()[0]
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # no nvidia-smi: the device kind is enough
        smi = ""
    return f"{device.device_kind} ({device.platform}; {smi or 'nvidia-smi n/a'}); {platform.platform()}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--sweep", action="store_true", help="also sweep Triton tile sizes")
    parser.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in SHAPES))
    args = parser.parse_args()
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "device": jax.devices()[0].device_kind,
              "hardware": hardware(), "jax": jax.__version__, "results": []}
    say(f"command: {report['command']}")
    say(f"hardware: {report['hardware']}")
    say(f"jax {jax.__version__}, jaxlib {jax.lib.__version__ if hasattr(jax.lib, '__version__') else '?'}")
    try:
        try:
            report["mosaic_check_rel_err"] = check_prototype()
        except Exception as e:
            report["mosaic_check_error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            say(f"mosaic prototype check FAILED\n{traceback.format_exc()[-3000:]}")
        report["hbm_read_tbs"] = read_ceiling()
        say(f"ceiling: HBM read {report['hbm_read_tbs']:.2f} TB/s (sum over 8 GiB bf16)")
        for shape in args.shapes.split(","):
            batch, context = map(int, shape.split("x"))
            compare_shape(batch, context, report["hbm_read_tbs"], report["results"])
            write_outputs(args.out, report)
        if args.sweep:
            run_sweep(report["hbm_read_tbs"], report["results"], save=lambda: write_outputs(args.out, report))
    finally:
        report["log"] = LOG
        write_outputs(args.out, report)


if __name__ == "__main__":
    main()

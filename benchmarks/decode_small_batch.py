"""The default decode kernel at few sequences: split count, the Pallas merge and page-id prefetch, A/B.

    python3 benchmarks/decode_small_batch.py --out DIR [--shapes 1x32768,fp8:32x4096,...] [--budget-s 300]
    python3 benchmarks/decode_small_batch.py --out DIR --smoke     # CPU, interpreter, one tiny shape

Issue 21's long-context goal is decode at B=1 (16k-32k context) at >= 70% of the HBM read
ceiling; the default kernel (``gpu.py``) read 1.96 TB/s (43%) at B=1 32k in session 18, through
64 KV splits merged by XLA ops. Session 19 changed three things, each a column here:

- the split count (``block_sizes._num_splits``) rounds down to a power of two, not up: B=1 32k
  runs 32 splits, 16k 32, B=8 16k 4 (session 18: 64, 64, 8);
- ``merge_kernel``: the splits' partial outputs merged by one Pallas launch (``gpu_merge.py``)
  instead of XLA's reductions and divide (on wherever the walk is split);
- ``prefetch_pages``: the unmasked loop carries the next block's page ids, so a block's K/V
  addresses do not wait on a global load of the page table (an option, off by default).

For each shape (B sequences at one context, Llama-3.1-8B's 32/8 heads of 128, pages of 32
scattered at random) this times, in one run: the kernel as session 18 ran it, the engine's sizes
now, those with XLA's merge and with prefetch, the engine's at half and twice the splits, and
cuDNN's dense kernel on a contiguous cache (the peer; bf16 only). Each of ours is the full call
(the K/V write, then attention, cache donated), 32 chained calls per timed program
(``kernel_attention.time_ours``), in interleaved rounds. Calls under ~30 µs varied by up to 50%
between identical configurations in one run (session 19): read those rows as noise. Shapes run
in the order given, so a budget cut drops the last. Writes ``decode_small_batch.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kernel_attention as ka  # noqa: E402
from pallas_kernels.paged_attention import block_sizes as bs  # noqa: E402

# Goal shapes first (B=1 long context), then the batch-1 engine's short context, then moderate
# batches (B=32 4k is a goal too) and the no-regression shapes where one split runs.
DEFAULT_SHAPES = ("1x32768,1x16384,1x4096,1x1024,8x16384,32x4096,16x4096,4x8192,64x4096,128x4096,"
                  "fp8:32x4096,fp8:64x4096,fp8:1x32768")


def parse_shape(text: str) -> tuple[str, int, int]:
    dtype, _, rest = text.rpartition(":")
    batch, context = rest.split("x")
    return dtype or "bf16", int(batch), int(context)


def session18_splits(batch: int, context: int) -> int:
    """The split count the default kernel took before session 19 (rounded up to a power of two)."""
    programs = batch * ka.NUM_KV_HEADS  # decode: one work tile per sequence
    if programs >= bs._GPU_NUM_SMS:
        return 1
    wanted = -(-bs._GPU_NUM_SMS * bs._GPU_PROGRAMS_PER_SM // programs)
    return max(1, min(1 << (wanted - 1).bit_length(), context // (64 * bs._MIN_TILES_PER_SPLIT), bs._MAX_SPLITS))


def variants(tuned: bs.BlockSizes, batch: int, context: int) -> list[tuple[str, bs.BlockSizes]]:
    """(label, sizes): the kernel as session 18 ran it (its split count, prefetch and Pallas merge
    off); the engine's sizes now; those with XLA's merge, and with prefetch; at half and twice the splits."""
    out = [("session 18", dataclasses.replace(tuned, num_splits=session18_splits(batch, context),
                                              prefetch_pages=False, merge_kernel=False)),
           ("engine", tuned)]
    if tuned.num_splits > 1:
        out += [("engine, XLA merge", dataclasses.replace(tuned, merge_kernel=False)),
                ("engine + prefetch", dataclasses.replace(tuned, prefetch_pages=True))]
    for splits in (tuned.num_splits // 2, tuned.num_splits * 2):
        if 1 < splits <= 128:
            out.append((f"engine at {splits} splits", bs.default_kernel_mechanisms(
                dataclasses.replace(tuned, num_splits=splits))))
    return out


def run_shape(dtype_name: str, batch: int, context: int, page_size: int, smoke: bool, rounds: int) -> dict:
    kv_dtype = jnp.float8_e4m3fn if dtype_name == "fp8" else jnp.bfloat16
    itemsize = jnp.dtype(kv_dtype).itemsize
    kv_bytes = 2 * batch * context * ka.NUM_KV_HEADS * ka.HEAD_DIM * itemsize
    tuned = bs.gpu_block_sizes(num_tokens=batch, max_num_seqs=batch, max_kv_len=context, num_kv_heads=ka.NUM_KV_HEADS,
                               group=ka.NUM_Q_HEADS // ka.NUM_KV_HEADS, head_dim=ka.HEAD_DIM, page_size=page_size,
                               itemsize=2, kv_itemsize=itemsize)
    row = {"kv_dtype": dtype_name, "batch": batch, "context": context, "kv_bytes": kv_bytes,
           "tuned": dataclasses.asdict(tuned), "us": {}, "sizes": {}}
    args = ka.decode_inputs(batch, context, page_size, kv_dtype=kv_dtype)
    row["rounds_us"] = {}
    # Rounds: every variant once, then again, so drift over the shape's minute hits all alike; a
    # variant's figure is its best round (each round is already the median of 3 timed programs).
    for _ in range(rounds):
        for label, sizes in variants(tuned, batch, context):
            if smoke:  # the interpreter: the kernel's own code paths, no timing worth reading
                sizes = dataclasses.replace(sizes, num_stages=1)
            if label in row.get("errors", {}):
                continue
            try:
                seconds, args = ka.time_ours(sizes, args)
            except Exception as e:  # a variant that fails to compile or run is reported, not fatal
                row.setdefault("errors", {})[label] = f"{type(e).__name__}: {str(e)[:300]}"
                args = ka.decode_inputs(batch, context, page_size, kv_dtype=kv_dtype)
                continue
            row["rounds_us"].setdefault(label, []).append(seconds * 1e6)
            row["us"][label] = min(row["rounds_us"][label])
            row["sizes"][label] = dataclasses.asdict(sizes)
            ka.say(f"{dtype_name} B={batch} ctx={context} {label:>22}: {seconds * 1e6:8.1f} us "
                   f"{kv_bytes / seconds / 1e12:.2f} TB/s ({sizes.num_splits} splits)")
    del args
    if dtype_name == "bf16" and jax.default_backend() == "gpu":
        q = ka.pseudo_random((batch, 1, ka.NUM_Q_HEADS, ka.HEAD_DIM), 6, scale=2.0)
        k = ka.pseudo_random((batch, context, ka.NUM_KV_HEADS, ka.HEAD_DIM), 7)
        v = ka.pseudo_random((batch, context, ka.NUM_KV_HEADS, ka.HEAD_DIM), 8)
        try:
            row["us"]["cuDNN dense"] = ka.time_loop(ka.cudnn_step, q, k, v) * 1e6
        except Exception as e:
            row.setdefault("errors", {})["cuDNN dense"] = f"{type(e).__name__}: {str(e)[:300]}"
        del q, k, v
    return row


def write_report(out_dir: str, report: dict) -> None:
    with open(os.path.join(out_dir, "decode_small_batch.json"), "w") as f:
        json.dump(report, f, indent=1)
    ceiling = report["ceilings"].get("hbm_read_tbs")
    lines = ["# The default decode kernel at few sequences: split count, Pallas merge, page-id prefetch", "",
             f"Command: `{report['command']}`  ",
             f"{report['device']}, jax {report['jax']}; HBM read ceiling {ceiling or float('nan'):.2f} TB/s", "",
             "µs per full call (K/V write + attention), the best of the interleaved rounds; TB/s of K/V read "
             "and % of the ceiling; **bold**: the fastest of ours. `session 18`: the kernel before session 19 "
             "(splits rounded up, XLA's merge); `engine`: the sizes the engine takes now.", "",
             "| pages | B | ctx | engine splits | variant | µs | TB/s | % ceiling | vs session 18 |",
             "| --- " * 9 + "|"]
    for row in report["rows"]:
        ours = {k: v for k, v in row["us"].items() if k != "cuDNN dense"}
        best = min(ours, key=ours.get) if ours else None
        for label, us in row["us"].items():
            tbs = row["kv_bytes"] / us / 1e6
            pct = f"{100 * tbs / ceiling:.0f}%" if ceiling else "-"
            vs = f"{us / row['us']['session 18']:.2f}x" if "session 18" in row["us"] else "-"
            shown = f"**{us:.1f}**" if label == best else f"{us:.1f}"
            lines.append(f"| {row['kv_dtype']} | {row['batch']} | {row['context']} | {row['tuned']['num_splits']} | "
                         f"{label} | {shown} | {tbs:.2f} | {pct} | {vs} |")
        for label, error in row.get("errors", {}).items():
            lines.append(f"| {row['kv_dtype']} | {row['batch']} | {row['context']} | - | {label} | failed: "
                         f"{error[:120]} | | | |")
    with open(os.path.join(out_dir, "decode_small_batch.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="[fp8:]BxCONTEXT,... in priority order")
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--budget-s", type=float, default=300.0, help="no new shape after this many seconds")
    parser.add_argument("--rounds", type=int, default=2, help="times each variant is timed, interleaved (best kept)")
    parser.add_argument("--smoke", action="store_true", help="CPU: interpreter, tiny shapes, no ceilings")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    report = {"command": "python3 " + " ".join(sys.argv), "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "host": platform.node(), "ceilings": {}, "rows": []}
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s]
    if args.smoke:
        shapes = [("bf16", 1, 512)]
        ka.NUM_Q_HEADS, ka.NUM_KV_HEADS, ka.HEAD_DIM = 4, 1, 64
        # kernel_attention.time_ours calls gpu_kernel.attend_and_write_gpu: run it in the interpreter.
        ka.gpu_kernel = types.SimpleNamespace(attend_and_write_gpu=functools.partial(
            ka.gpu_kernel.attend_and_write_gpu, interpret=True))
    else:
        report["ceilings"] = ka.measure_ceilings()
    ka.say(report["command"], "|", report["device"], "| jax", report["jax"])
    for dtype_name, batch, context in shapes:
        if time.perf_counter() - start > args.budget_s:
            ka.say(f"budget: stopped before {dtype_name}:{batch}x{context}")
            break
        report["rows"].append(run_shape(dtype_name, batch, context, args.page_size if not args.smoke else 16,
                                        args.smoke, 1 if args.smoke else args.rounds))
        write_report(args.out, report)
    write_report(args.out, report)


if __name__ == "__main__":
    main()

"""Decode in the engine's smallest GPU bucket: one live sequence among 8 slots, default kernel vs fused.

    python3 benchmarks/small_bucket_decode.py --out DIR [--contexts 384,32768] [--chained 64]
    python3 benchmarks/small_bucket_decode.py --out DIR --smoke      # CPU, interpreter, tiny shapes

At batch 1 the engine runs bucket 8x8 (8 token rows, 8 sequence slots, 7 of them empty), so the
kernels size their split count for 8 slots (``block_sizes._num_splits``: 4 splits), not for the one
sequence that is there: ``decode_small_batch.py``'s B=1 rows (1 slot, 32 splits) are not what the
engine runs. For one live sequence at each context (Llama-3.1-8B's 32/8 heads of 128, bf16 pages of
32 scattered at random, a page table 2048 tokens wide or the context's width) this times the full
call (K/V write + attention, cache donated, ``--chained`` calls in one jit, median of 5) of the
default kernel with XLA's scatters and of the fused-write kernel (its sizes from
``block_sizes.fused_kernel_mechanisms``), each at its tuned split count and at ``--splits``. Each
live output row is compared with the first call's. Calls under ~30 µs vary by up to 50% between
identical configurations (session 19). Writes ``small_bucket_decode.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kernel_frontier as kf  # noqa: E402
from pallas_kernels.paged_attention import gpu, gpu_fused  # noqa: E402
from pallas_kernels.paged_attention.block_sizes import gpu_block_sizes  # noqa: E402

TOKENS, SLOTS = 8, 8
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE, MIN_TABLE_TOKENS, MIN_POOL = 32, 8, 128, 32, 2048, 4096
RUNS = 5
INTERPRET = False


def bucket_inputs(context: int, seed: int = 0):
    """(q, k_new, k_pages, v_pages, page_tables, cu_q_lens, kv_lens): slot 0 decodes at ``context``."""
    width = max(MIN_TABLE_TOKENS // PAGE, -(-context // PAGE))
    pool = max(MIN_POOL, SLOTS * width)
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (TOKENS, Q_HEADS, HEAD_DIM), jnp.bfloat16)
    k_new = jax.random.normal(keys[1], (TOKENS, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    k_pages = jax.random.normal(keys[2], (KV_HEADS, pool, PAGE, HEAD_DIM), jnp.bfloat16)
    v_pages = jax.random.normal(keys[3], (KV_HEADS, pool, PAGE, HEAD_DIM), jnp.bfloat16)
    tables = np.random.default_rng(seed).permutation(pool)[:SLOTS * width].reshape(SLOTS, width)
    cu_q_lens = jnp.asarray([0] + [1] * SLOTS, jnp.int32)  # slot 0's token, then padding rows
    kv_lens = jnp.asarray([context] + [0] * (SLOTS - 1), jnp.int32)
    return q, k_new, k_pages, v_pages, jnp.asarray(tables, jnp.int32), cu_q_lens, kv_lens


def time_call(call, inputs) -> float:
    """µs per full call, chained in one jit (``kernel_frontier.time_chain``: each output is the next
    query, the cache donated)."""
    q, k_new, k_pages, v_pages, *meta = inputs

    def step(state, k_new, *meta):
        return call(state[0], k_new, k_new, state[1], state[2], *meta)

    seconds, _ = kf.time_chain(step, (jnp.copy(q), jnp.copy(k_pages), jnp.copy(v_pages)), k_new, *meta, donate=True)
    return seconds * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="384,32768")
    parser.add_argument("--chained", type=int, default=64, help="calls per timed program (fewer compile faster)")
    parser.add_argument("--splits", default="16,32", help="split counts timed beside each kernel's tuned one")
    parser.add_argument("--smoke", action="store_true", help="CPU check of this script: interpreter, tiny shapes")
    args = parser.parse_args()
    if args.smoke:
        global Q_HEADS, KV_HEADS, HEAD_DIM, PAGE, MIN_TABLE_TOKENS, MIN_POOL, RUNS, INTERPRET
        Q_HEADS, KV_HEADS, HEAD_DIM, PAGE, MIN_TABLE_TOKENS, MIN_POOL, RUNS, INTERPRET = 8, 2, 64, 16, 128, 64, 1, True
        args.contexts, args.chained, args.splits = "40", 1, "2"
    kf.REPEATS, kf.TIMED_RUNS = args.chained, RUNS
    device = jax.devices()[0]
    report = {"command": " ".join(["python3"] + sys.argv), "device": device.device_kind, "jax": jax.__version__,
              "platform": platform.platform(), "chained": args.chained, "results": []}
    print(f"command: {report['command']}\ndevice: {device.device_kind}; jax {jax.__version__}", flush=True)
    sm_scale = HEAD_DIM**-0.5
    splits = [int(n) for n in args.splits.split(",") if n]
    for context in (int(c) for c in args.contexts.split(",")):
        inputs = bucket_inputs(context)
        shape = dict(num_tokens=TOKENS, max_num_seqs=SLOTS, max_kv_len=inputs[4].shape[1] * PAGE,
                     num_kv_heads=KV_HEADS, group=Q_HEADS // KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE, itemsize=2)
        default, fused = gpu_block_sizes(**shape), gpu_block_sizes(**shape, fused=True)
        calls = {f"default kernel, {default.num_splits} splits (tuned)": (gpu.attend_and_write_gpu, default)}
        calls |= {f"default kernel, {n} splits": (gpu.attend_and_write_gpu, dataclasses.replace(default, num_splits=n))
                  for n in splits if n != default.num_splits}
        calls[f"fused kernel, {fused.num_splits} splits (tuned)"] = (gpu_fused.attend_and_write_gpu, fused)
        calls |= {f"fused kernel, {n} splits": (gpu_fused.attend_and_write_gpu, dataclasses.replace(fused, num_splits=n))
                  for n in splits if n != fused.num_splits}
        row = {"context": context, "page_table_tokens": shape["max_kv_len"], "us": {}, "max_abs_diff": {},
               "sizes": {}}
        first = None
        for name, (attend, sizes) in calls.items():
            call = functools.partial(attend, sm_scale=sm_scale, sizes=sizes, interpret=INTERPRET)
            out = jax.jit(call)(inputs[0], inputs[1], inputs[1], jnp.copy(inputs[2]), jnp.copy(inputs[3]),
                                *inputs[4:])[0][:1].astype(jnp.float32)  # slot 0's row: the live one
            first = out if first is None else first
            row["max_abs_diff"][name] = float(jnp.max(jnp.abs(out - first)))
            row["us"][name] = time_call(call, inputs)
            row["sizes"][name] = dataclasses.asdict(sizes)
            print(f"ctx {context}: {name}: {row['us'][name]:.2f} us, |diff| {row['max_abs_diff'][name]:.3g}",
                  flush=True)
        report["results"].append(row)
        write_report(args.out, report)  # after each context: a time limit keeps what was measured
    print(open(os.path.join(args.out, "small_bucket_decode.md")).read())


def write_report(out_dir: str, report: dict) -> None:
    """small_bucket_decode.{json,md} of the contexts measured so far."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "small_bucket_decode.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"# Decode in the 8x8 bucket, one live sequence ({report['device']}, jax {report['jax']})", "",
             f"Command: `{report['command']}`", "",
             f"Full call (K/V write + attention), µs, {report['chained']} chained calls, median of {RUNS} runs; "
             "|diff|: largest difference of the live row from the first column's.", "",
             "| context | call | µs | |diff| |", "| --- | --- | --- | --- |"]
    for r in report["results"]:
        for name, us in r["us"].items():
            lines.append(f"| {r['context']} | {name} | {us:.1f} | {r['max_abs_diff'][name]:.2g} |")
    with open(os.path.join(out_dir, "small_bucket_decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

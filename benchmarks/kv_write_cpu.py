"""One step's K/V write into the paged pool on XLA:CPU, per pool size and page dtype, before/after.

    python3 benchmarks/kv_write_cpu.py --out /tmp/kv_write_cpu            [--smoke: tiny pools]

An FP8 pool on a CPU used to be a ``float8_e4m3fn`` array; XLA:CPU has no float8 scatter or
gather, and its float normalization ran the write (and the CPU attention's page gathers) in
float16, converting the whole pool there and back every step. Now the pool is ``uint8`` holding
the e4m3 bits (``pallas_kernels/paged_attention/page_storage.py``). This script measures, in one
run and on the same shapes (SmolLM2-135M's 3 KV heads of 64, pages of 32 tokens):

- ``write``: one layer's K and V scatter of a decode step (``--tokens`` new rows) through
  ``write_kv_reference``, chained ``--iters`` times in one jitted ``fori_loop`` whose carry is the
  pools (updated in place where XLA can): bfloat16, float32, fp8 as ``float8_e4m3fn`` arrays
  (``fp8-e4m3``: before) and fp8 as ``uint8`` bits (``fp8-bits``: after);
- ``attend``: the CPU attention path's whole call (write, then attention of a decode batch of
  ``--tokens`` sequences at ``--context`` tokens), same dtypes, same loop;
- ``hlo``: in the compiled donated write, how many instructions produce a pool-sized value of a
  dtype other than the pool's (a converted copy of the pool) or copy the pool.

Each row reports ms per step and the ratio to bfloat16 at the same pool size. Runs on any backend
(on a GPU the ``fp8-e4m3`` row says whether XLA:GPU has the same problem; the engine keeps e4m3
arrays there, which its kernels read). Writes ``kv_write_cpu.{json,md,log}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import Log, header, write_results  # noqa: E402

from pallas_kernels.paged_attention.cpu import ragged_paged_attention_cpu  # noqa: E402
from pallas_kernels.paged_attention.page_storage import E4M3, E4M3_BITS  # noqa: E402
from pallas_kernels.paged_attention.reference import write_kv_reference  # noqa: E402

NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, PAGE_SIZE = 3, 9, 64, 32  # SmolLM2-135M
# name -> (array dtype of the pool, dtype of the new K/V handed to the write)
DTYPES = {"bfloat16": (jnp.bfloat16, jnp.bfloat16), "float32": (jnp.float32, jnp.float32),
          "fp8-e4m3": (E4M3, E4M3), "fp8-bits": (E4M3_BITS, E4M3)}
_RESULT = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*([a-z0-9]+)\[([0-9,]*)\]\S*\s+([a-z-]+)\(", re.MULTILINE)


def decode_batch(num_seqs: int, context: int, num_pages: int, rng: np.random.Generator):
    """Page tables, cu_q_lens and kv_lens of ``num_seqs`` decodes at ``context`` tokens, on random pages."""
    pages_per_seq = -(-context // PAGE_SIZE)
    if num_seqs * pages_per_seq >= num_pages:
        raise SystemExit(f"--tokens {num_seqs} x --context {context} needs {num_seqs * pages_per_seq} pages; "
                         f"the smallest pool has {num_pages}")
    tables = rng.permutation(np.arange(1, num_pages))[: num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq)
    cu_q_lens = np.arange(num_seqs + 1, dtype=np.int32)
    kv_lens = np.full(num_seqs, context, np.int32)
    return jnp.asarray(tables, jnp.int32), jnp.asarray(cu_q_lens), jnp.asarray(kv_lens)


def make_pools(num_pages: int, dtype, key):
    """K and V pools of small random values stored as ``dtype`` (e4m3 bits for uint8)."""
    shape = (NUM_KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)

    def make(key):
        values = jax.random.normal(key, shape, jnp.float32)
        if jnp.dtype(dtype) == E4M3_BITS:
            return jax.lax.bitcast_convert_type(values.astype(E4M3), E4M3_BITS)
        return values.astype(dtype)

    return jax.jit(make)(key), jax.jit(make)(jax.random.fold_in(key, 1))


def seconds_per_step(body, pools, *args, iters: int) -> float:
    """Seconds per iteration of ``pools = body(pools, *args)`` over ``iters`` iterations of one jitted loop.

    The pools are donated, so the loop's carry may be updated in place, as the engine's step does.
    """
    run = jax.jit(lambda pools, *args: jax.lax.fori_loop(0, iters, lambda i, p: body(p, *args), pools),
                  donate_argnums=(0,))
    pools = jax.block_until_ready(run(pools, *args))  # compile and warm up
    start = time.perf_counter()
    pools = jax.block_until_ready(run(pools, *args))
    return (time.perf_counter() - start) / iters


def pool_copies(write, pools, *args) -> dict:
    """Pool-sized instructions of another dtype than the pool's, and pool-sized copies, in the compiled write."""
    text = jax.jit(write, donate_argnums=(0,)).lower(pools, *args).compile().as_text()
    size = pools[0].size
    pool_dtype = {"bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "f8e4m3fn", "uint8": "u8"}[pools[0].dtype.name]
    foreign, copies = 0, 0
    for dtype, dims, opcode in _RESULT.findall(text):
        if dims and int(np.prod([int(d) for d in dims.split(",")])) == size:
            foreign += dtype != pool_dtype
            copies += opcode == "copy"
    return {"pool_sized_other_dtype": foreign, "pool_sized_copies": copies,
            "input_output_alias": "input_output_alias" in text.split("\n", 1)[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pool-elements", default="1048576,16777216,134217728",
                        help="elements of one layer's K pool (and of its V pool), comma-separated")
    parser.add_argument("--tokens", type=int, default=16, help="new rows a step writes: a decode batch")
    parser.add_argument("--context", type=int, default=256, help="context of each sequence in the attend rows")
    parser.add_argument("--iters", type=int, default=64, help="steps per timed loop (the slow rows take fewer)")
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per row, interleaved; the median")
    parser.add_argument("--smoke", action="store_true", help="tiny pools and loops: checks the code only")
    args = parser.parse_args()
    if args.smoke:
        args.pool_elements, args.iters, args.repeats, args.context = "393216", 4, 1, 64

    log = Log()
    info = header(log)
    rng = np.random.default_rng(0)
    rows = []
    for elements in [int(x) for x in args.pool_elements.split(",")]:
        num_pages = max(2, round(elements / (NUM_KV_HEADS * PAGE_SIZE * HEAD_DIM)))
        tables, cu_q_lens, kv_lens = decode_batch(args.tokens, args.context, num_pages, rng)
        key = jax.random.key(elements)
        q = jax.random.normal(key, (args.tokens, NUM_Q_HEADS, HEAD_DIM), jnp.float32)
        timings: dict[tuple[str, str], list[float]] = {}
        hlo = {}
        # Interleaved repeats: every dtype is timed once per round, so drift on a shared machine
        # lands on all of them alike.
        for repeat in range(args.repeats):
            for name, (pool_dtype, new_dtype) in DTYPES.items():
                new = jax.random.normal(jax.random.fold_in(key, 2), (args.tokens, NUM_KV_HEADS, HEAD_DIM))
                k_new = v_new = new.astype(new_dtype)
                q_in = q.astype(jnp.bfloat16) if name == "bfloat16" else q
                # The slow rows (a float16 round trip of the pool per step) need few steps to be timed.
                iters = args.iters if name != "fp8-e4m3" else max(2, args.iters // 16)

                def write(pools, k_new, v_new, tables, cu_q_lens, kv_lens):
                    return write_kv_reference(k_new, v_new, *pools, tables, cu_q_lens, kv_lens)

                def attend(carry, q, k_new, v_new, tables, cu_q_lens, kv_lens):
                    pools, total = carry
                    out, k, v = ragged_paged_attention_cpu(q, k_new, v_new, *pools, tables, cu_q_lens, kv_lens,
                                                           sm_scale=HEAD_DIM**-0.5)
                    # The output feeds the carry: a loop that dropped it would time the write alone.
                    return (k, v), total + out.astype(jnp.float32).sum()

                pools = make_pools(num_pages, pool_dtype, key)
                if repeat == 0:
                    hlo[name] = pool_copies(write, pools, k_new, v_new, tables, cu_q_lens, kv_lens)
                timings.setdefault(("write", name), []).append(
                    seconds_per_step(write, pools, k_new, v_new, tables, cu_q_lens, kv_lens, iters=iters))
                pools = make_pools(num_pages, pool_dtype, key)
                timings.setdefault(("attend", name), []).append(
                    seconds_per_step(attend, (pools, jnp.float32(0)), q_in, k_new, v_new, tables, cu_q_lens, kv_lens, iters=iters))
                del pools
        for (op, name), seconds in timings.items():
            ms = float(np.median(seconds)) * 1e3
            bf16 = float(np.median(timings[(op, "bfloat16")])) * 1e3
            row = {"op": op, "dtype": name, "pool_elements": NUM_KV_HEADS * num_pages * PAGE_SIZE * HEAD_DIM,
                   "num_pages": num_pages, "ms_per_step": ms, "vs_bfloat16": ms / bf16, "all_ms": [s * 1e3 for s in seconds],
                   **(hlo[name] if op == "write" else {})}
            rows.append(row)
            log(f"{op:6s} pool {row['pool_elements']:>11,} {name:9s} {ms:10.4f} ms/step  x{ms / bf16:8.2f} of bf16"
                + (f"  pool-sized other-dtype values {row['pool_sized_other_dtype']}, copies {row['pool_sized_copies']}"
                   if op == "write" else ""))

    lines = [f"# K/V write into the paged pool, {info['platform']} ({info['device']})", "",
             f"`{info['command']}`  ", f"jax {info['jax']}, {info['date']}, host {info['host']}", "",
             f"{args.tokens} new rows a step (a decode batch); attend: the CPU path's whole call at context "
             f"{args.context}; {NUM_KV_HEADS} KV heads x {HEAD_DIM}, pages of {PAGE_SIZE}. `fp8-e4m3`: the pool as "
             "float8_e4m3fn arrays (before); `fp8-bits`: as uint8 e4m3 bits (after). Median of "
             f"{args.repeats} interleaved loops.", "",
             "| op | pool elements | dtype | ms / step | x bf16 | pool-sized values of another dtype | pool copies |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['pool_elements']:,} | {r['dtype']} | {r['ms_per_step']:.4f} | "
                     f"{r['vs_bfloat16']:.2f} | {r.get('pool_sized_other_dtype', '')} | {r.get('pool_sized_copies', '')} |")
    write_results(args.out, "kv_write_cpu", {"run": info, "args": {k: str(v) for k, v in vars(args).items()},
                                             "rows": rows}, "\n".join(lines) + "\n", log)


if __name__ == "__main__":
    main()

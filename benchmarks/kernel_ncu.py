"""DRAM bytes our decode kernel really reads, against the bytes we count (run under Nsight Compute).

    ncu --clock-control none --csv --kernel-name regex:ragged_paged_attention \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        python3 benchmarks/kernel_ncu.py --batch 32 --context 4096 > DIR/ncu.csv
    python3 benchmarks/kernel_ncu.py --batch 32 --context 4096 --report DIR/ncu.csv

The first command launches the kernel ``--launches`` times at one ``kernel-decode`` shape
(Llama-3.1-8B heads, bf16, page size 32) while ``ncu`` reads the DRAM counters of each launch;
the second prints the counted K/V bytes, the bytes ``ncu`` saw and their ratio. A ratio near
1.0 says the kernel reads each K/V page once and nothing else of note (queries, page tables
and outputs are < 1% at these shapes); well above 1.0 would mean re-reads (e.g. one read per
query head instead of per KV head), below 1.0 an L2 hit rate the timing would overstate.
The kernel time under ``ncu`` is serialised and cache-flushed: read the bandwidth from
``kernel_attention.py``, not from here.

``--kv-dtype fp8`` launches the kernel over e4m3 pages (bytes counted at one a value). For where a
kernel's time goes rather than its bytes, run the launcher under ``ncu --set full`` (stall
reasons, pipe utilisation, shared-memory traffic) and keep ncu's own report:

    ncu --clock-control none --kernel-name regex:ragged_paged_attention --launch-skip 1 \
        --launch-count 1 --set full python3 benchmarks/kernel_ncu.py --batch 384 --context 1024 \
        --kv-dtype fp8 > DIR/ncu_full_fp8.txt

Where the instructions go, by opcode: keep the report (``-o DIR/fp8``), print its per-instruction
counters, then summarise them (executed warp instructions and stall samples per opcode):

    ncu -i DIR/fp8.ncu-rep --page source --csv --print-source sass > DIR/sass_fp8.csv
    python3 benchmarks/kernel_ncu.py --sass DIR/sass_fp8.csv --json DIR/sass_fp8.json
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


KV_DTYPES = ("bf16", "fp8")


def kv_jnp_dtype(name: str):
    import jax.numpy as jnp

    return {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[name]


def counted_bytes(batch: int, context: int, kv_itemsize: int = 2) -> dict:
    from kernel_attention import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS

    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * kv_itemsize
    q_and_out = 2 * batch * NUM_Q_HEADS * HEAD_DIM * 2
    return {"kv_bytes": kv, "q_and_out_bytes": q_and_out}


def launch(batch: int, context: int, page_size: int, launches: int, kv_dtype: str = "bf16",
           interpret: bool = False, v_layout: str = "token_major"):
    """Run the engine's decode attention kernel (``gpu.attend_gpu`` at its tuned sizes, pages
    already written) ``launches`` times; returns the last output. ``interpret``: Pallas's
    interpreter (CPU tests). ``v_layout="dim_major"``: V pages stored transposed (``v_layout.py``)."""
    import jax

    from kernel_attention import HEAD_DIM, decode_inputs, ours_sizes
    from pallas_kernels.paged_attention.gpu import attend_gpu
    from pallas_kernels.paged_attention.v_layout import to_dim_major

    dtype = kv_jnp_dtype(kv_dtype)
    args = decode_inputs(batch, context, page_size, kv_dtype=dtype)
    sizes = ours_sizes(batch, batch, context, page_size, kv_itemsize=jax.numpy.dtype(dtype).itemsize)
    if v_layout == "dim_major":
        args = (*args[:2], to_dim_major(args[2]), *args[3:])
    step = jax.jit(lambda *a: attend_gpu(*a, sm_scale=HEAD_DIM**-0.5, sizes=sizes, interpret=interpret,
                                         v_layout=v_layout))
    for _ in range(launches):
        out = step(*args)
    out.block_until_ready()
    print(f"launched {launches} times: B={batch} ctx={context} page {page_size} {kv_dtype} pages, {sizes}",
          file=sys.stderr)
    return out


def report(csv_path: Path, batch: int, context: int, kv_itemsize: int = 2) -> dict:
    """Parse ``ncu --csv`` (one row per kernel launch and metric) into per-launch byte counts."""
    text = csv_path.read_text()
    start = text.find('"ID"')
    if start < 0:
        raise SystemExit(f"no ncu table in {csv_path}: did ncu run, and could it read the counters?\n{text[-2000:]}")
    per_launch: dict[str, dict[str, float]] = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "")
        scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9,
                 "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "ns": 1e-9, "us": 1e-6, "ms": 1e-3}.get(unit, 1)
        per_launch.setdefault(row["ID"], {"kernel": row["Kernel Name"]})[row["Metric Name"]] = value * scale
    launches = list(per_launch.values())
    if not launches:
        raise SystemExit("ncu printed no launches of the kernel")
    counted = counted_bytes(batch, context, kv_itemsize)
    read = sorted(launch["dram__bytes_read.sum"] for launch in launches)
    median_read = read[len(read) // 2]
    result = {
        "workload": "kernel-decode", "batch": batch, "context": context,
        "launches": len(launches), "kernel": launches[0]["kernel"], **counted,
        "dram_read_bytes_median": median_read,
        "dram_write_bytes_median": sorted(x.get("dram__bytes_write.sum", 0) for x in launches)[len(launches) // 2],
        "read_over_counted_kv": median_read / counted["kv_bytes"],
    }
    print(json.dumps(result, indent=1))
    print(f"B={batch} ctx={context}: counted K/V {counted['kv_bytes'] / 1e6:.1f} MB, DRAM read "
          f"{median_read / 1e6:.1f} MB (median of {len(launches)} launches): ratio {result['read_over_counted_kv']:.3f}")
    return result


def opcode(sass: str) -> str:
    """The opcode of one SASS line with its modifiers (``@P0 LDS.U8 R1, [R2]`` -> ``LDS.U8``)."""
    words = sass.split()
    if words and words[0].startswith("@"):  # a predicate guard
        words = words[1:]
    return words[0].rstrip(";") if words else "?"


def sass_mix(csv_path: Path, top: int = 25) -> dict:
    """Parse ``ncu --page source --csv --print-source sass`` into totals per opcode.

    Returns the kernel's executed warp instructions, its stall samples, and the ``top`` opcodes
    by instructions executed, each with its share of both (sorted, largest first); printed."""
    lines = csv_path.read_text().splitlines()
    header_at = next((i for i, line in enumerate(lines) if line.startswith('"Address","Source"')), None)
    if header_at is None:
        raise SystemExit(f"no per-instruction table in {csv_path}: was it printed with --page source --csv "
                         "--print-source sass from a report of --set full?")
    executed: dict[str, float] = {}
    stalls: dict[str, float] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[header_at:]))):
        op = opcode(row["Source"])
        number = lambda key: float((row[key] or "0").replace(",", ""))  # noqa: E731
        executed[op] = executed.get(op, 0.0) + number("Instructions Executed")
        stalls[op] = stalls.get(op, 0.0) + number("Warp Stall Sampling (All Samples)")
    total, total_stalls = sum(executed.values()), sum(stalls.values())
    if not total:
        raise SystemExit(f"{csv_path}: the instructions carry no execution counts (source counters not collected)")
    ranked = sorted(executed, key=executed.get, reverse=True)[:top]
    result = {"instructions_executed": total, "stall_samples": total_stalls,
              "opcodes": [{"opcode": op, "instructions": executed[op], "share": executed[op] / total,
                           "stall_share": stalls[op] / total_stalls if total_stalls else 0.0} for op in ranked]}
    print(f"{csv_path.name}: {total / 1e6:.1f}M warp instructions, {total_stalls:.0f} stall samples")
    for entry in result["opcodes"]:
        print(f"  {entry['opcode']:<28} {entry['share']:6.1%} of instructions  {entry['stall_share']:6.1%} of stalls")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16", help="the pages' dtype (fp8: e4m3)")
    parser.add_argument("--v-layout", choices=("token_major", "dim_major"), default="token_major",
                        help="how V pages are stored (dim_major: transposed, v_layout.py)")
    parser.add_argument("--report", type=Path, help="ncu --csv output to summarise (instead of launching)")
    parser.add_argument("--sass", type=Path, help="ncu --page source --csv --print-source sass output to summarise")
    parser.add_argument("--json", type=Path, help="with --report or --sass: also write the summary here")
    args = parser.parse_args()
    if args.sass:
        result = sass_mix(args.sass)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
    elif args.report:
        result = report(args.report, args.batch, args.context, 1 if args.kv_dtype == "fp8" else 2)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
    else:
        launch(args.batch, args.context, args.page_size, args.launches, args.kv_dtype, v_layout=args.v_layout)


if __name__ == "__main__":
    main()

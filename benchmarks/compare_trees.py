"""Before/after on one GPU: `engine_throughput.py` of two source trees, runs interleaved.

    python3 benchmarks/compare_trees.py run --base .baseline --new . --workloads startup,latency,throughput-nano \
        --order base,new,base,new,base,new --raw /tmp/ab
    python3 benchmarks/compare_trees.py summarize --raw /tmp/ab --out DIR

A refactor must not cost speed, and single runs differ by several percent, so each tree runs
the same workloads several times, alternating base and new so that drift of the machine
(clocks, temperature) falls on both. Each run is its tree's own ``benchmarks/engine_throughput.py``
in a fresh process (it imports that tree's ``jaxinfer``), with one persistent compilation cache
per tree: a tree's first run measures a cold start-up, later ones a warm one.

``run`` appends runs under ``--raw`` (numbered per tree, so several device calls can add to one
comparison); ``summarize`` writes the medians side by side as JSON + markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (workload, field, label, better): the numbers each workload contributes to the comparison.
METRICS = (
    ("startup", "compile_seconds", "start-up, cold cache (s)", "lower"),
    ("startup-warm", "compile_seconds", "start-up, warm cache (s)", "lower"),
    ("latency", "tpot_ms", "latency TPOT (ms)", "lower"),
    ("latency", "ttft_ms", "latency TTFT (ms)", "lower"),
    ("batch128", "output_tokens_per_s", "128 x 256/256 (output tok/s)", "higher"),
    ("throughput-1k", "output_tokens_per_s", "throughput-1k (output tok/s)", "higher"),
    ("throughput-nano", "output_tokens_per_s", "throughput-nano (output tok/s)", "higher"),
)


def run(args) -> int:
    trees = {"base": Path(args.base).resolve(), "new": Path(args.new).resolve()}
    failures = 0
    for name in args.order.split(","):
        tree = trees[name]
        tree_dir = args.raw / name
        tree_dir.mkdir(parents=True, exist_ok=True)
        index = len(list(tree_dir.glob("run*"))) + 1
        out = tree_dir / f"run{index}"
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(args.raw / f"jax-cache-{name}"), PYTHONUNBUFFERED="1")
        command = [sys.executable, str(tree / "benchmarks" / "engine_throughput.py"), "--out", str(out),
                   "--workloads", args.workloads, *args.extra]
        print(f"[{time.strftime('%H:%M:%S')}] {name} run {index}: {' '.join(command)}", flush=True)
        start = time.monotonic()
        process = subprocess.Popen(command, cwd=tree, env=env)
        try:
            status = process.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            # SIGINT first: the script writes what it has measured before it exits.
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
            status = "timeout"
        failures += status != 0
        print(f"[{time.strftime('%H:%M:%S')}] {name} run {index}: exit {status} after {time.monotonic() - start:.0f} s",
              flush=True)
    return 1 if failures else 0


def collect(raw: Path) -> dict:
    """{tree: {label: [value per run]}} from every run under ``raw``."""
    values: dict[str, dict[str, list[float]]] = {}
    for tree_dir in sorted(p for p in raw.iterdir() if p.is_dir() and not p.name.startswith("jax-cache")):
        per_label = values.setdefault(tree_dir.name, {})
        for run_dir in sorted(tree_dir.glob("run*"), key=lambda p: int(p.name[3:])):
            results_path = run_dir / "engine_throughput.json"
            if not results_path.exists():
                continue
            workloads = json.loads(results_path.read_text()).get("workloads", {})
            for workload, field, label, _ in METRICS:
                if field in workloads.get(workload, {}):
                    per_label.setdefault(label, []).append(workloads[workload][field])
    return values


def summarize(args) -> int:
    values = collect(args.raw)
    base, new = values.get("base", {}), values.get("new", {})
    rows = []
    for _, _, label, better in METRICS:
        if label not in base and label not in new:
            continue
        b, n = base.get(label, []), new.get(label, [])
        mb = statistics.median(b) if b else None
        mn = statistics.median(n) if n else None
        change = (mn / mb - 1) if mb and mn else None
        rows.append(dict(metric=label, better=better, base_runs=b, new_runs=n, base_median=mb, new_median=mn,
                         change=change))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare_trees.json").write_text(json.dumps(dict(command=" ".join(sys.argv), rows=rows), indent=1))
    lines = ["| metric | base median | new median | change | base runs | new runs |", "| --- | --- | --- | --- | --- | --- |"]

    def fmt(x):
        return "–" if x is None else f"{x:.4g}"

    for r in rows:
        change = "–" if r["change"] is None else f"{r['change']:+.1%} ({r['better']} is better)"
        lines.append(f"| {r['metric']} | {fmt(r['base_median'])} | {fmt(r['new_median'])} | {change} | "
                     f"{', '.join(fmt(x) for x in r['base_runs'])} | {', '.join(fmt(x) for x in r['new_runs'])} |")
    table = "\n".join(lines) + "\n"
    (args.out / "compare_trees.md").write_text(table)
    print(table)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run engine_throughput.py of each tree in the given order")
    r.add_argument("--base", required=True, help="the tree before the change")
    r.add_argument("--new", required=True, help="the tree after the change")
    r.add_argument("--workloads", required=True)
    r.add_argument("--order", default="base,new,base,new,base,new", help="which tree runs when, comma-separated")
    r.add_argument("--raw", type=Path, required=True, help="where the runs accumulate")
    r.add_argument("--timeout-s", type=float, default=600)
    r.add_argument("extra", nargs="*", help="more arguments for engine_throughput.py (after --)")
    s = sub.add_parser("summarize", help="medians side by side")
    s.add_argument("--raw", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    return run(args) if args.command == "run" else summarize(args)


if __name__ == "__main__":
    sys.exit(main())

"""Where the host's time goes in a step, read from `jax.profiler` traces: the device's counterpart.

    python3 benchmarks/profile_host.py DIR [--steps N] [--top K] [--json OUT.json]

DIR holds ``profile_*/plugins/profile/*/*.trace.json.gz`` traces (``tensor_parallel.py
--profile``, ``engine_throughput.py --profile-steps``). For each run: the host events (Python
functions when the Python tracer was on, and XLA/PJRT runtime events such as executable
launches and CUDA-graph updates) with the most total time, per step (divided by ``--steps``),
with how many times each ran. Nested events each count their own full duration, so the
column does not add up to a step; read it as "this much of the step was spent inside X".
A dispatch that should be asynchronous but holds the host for most of a step shows up here,
as ``cond`` did (a conditional copies its predicate to the host) and CUDA-graph updates do.
Runs on any machine: it only reads JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from profile_collectives import load_trace


def summarise_host(trace_path: Path, steps: int, top: int) -> list[dict]:
    events, processes = load_trace(trace_path)
    total, count = collections.Counter(), collections.Counter()
    for event in events:
        if event.get("ph") != "X" or "/host:" not in processes.get(event["pid"], ""):
            continue
        total[event["name"]] += event.get("dur", 0.0)
        count[event["name"]] += 1
    rows = [{"name": name, "ms_per_step": us / 1e3 / steps, "calls_per_step": count[name] / steps}
            for name, us in total.most_common(top)]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--steps", type=int, default=1, help="steps the trace holds")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    report = {}
    for trace in sorted(args.trace_dir.glob("profile_*/plugins/profile/*/*.trace.json.gz")):
        run = trace.parts[-5].removeprefix("profile_")
        rows = summarise_host(trace, args.steps, args.top)
        report[run] = rows
        print(f"{run}: host time per step (nested events each count in full)")
        for row in rows:
            print(f"  {row['ms_per_step']:8.3f} ms  {row['calls_per_step']:7.2f} x  {row['name'][:100]}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

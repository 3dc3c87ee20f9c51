"""How much collective time a step leaves exposed, read from `jax.profiler` traces.

    python3 benchmarks/profile_collectives.py DIR [--steps N] [--json OUT.json]

DIR holds the traces ``tensor_parallel.py --profile`` or ``engine_throughput.py --profile-steps``
writes (``profile_*/plugins/profile/*/*.trace.json.gz``, one per run), or is one ``profile_*``
directory; when it holds none it says what it found instead. For each run and GPU, from the kernels' intervals on the
device's streams: the time NCCL kernels run (collective busy), the time any other kernel runs
(compute busy), and the part of the collective time during which no compute kernel runs
(exposed). Overlap that works shows up as collective busy > exposed. Divided by ``--steps``
(the replays the trace holds) for per-step numbers. With ``--top N`` also where the compute
time goes: time per step by kind (attention kernel, matmuls, collectives, other fusions) and
the N kernels with the most time. Runs on any machine: it only reads JSON.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, current = 0.0, None
    for start, end in sorted(intervals):
        if current is None or start > current[1]:
            if current is not None:
                total += current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    if current is not None:
        total += current[1] - current[0]
    return total


def is_collective(kernel_name: str) -> bool:
    return kernel_name.lower().startswith("nccl")


def kernel_kind(kernel_name: str) -> str:
    name = kernel_name.lower()
    if is_collective(kernel_name):
        return "collective"
    if "paged_attention" in name:
        return "attention"
    if any(tag in name for tag in ("gemm", "nvjet", "cutlass", "cublas", "sm90_xmma", "matmul")):
        return "matmul"
    return "other"


def load_trace(trace_path: Path) -> tuple[list[dict], dict[int, str]]:
    """A trace's events and its process names by pid ("/device:GPU:0", "/host:CPU", ...)."""
    events = json.load(gzip.open(trace_path))["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return events, processes


def gpu_kernels(events: list[dict], processes: dict[int, str]) -> list[dict]:
    """The complete GPU kernel events of a trace (memory copies left out), every GPU together."""
    gpus = {pid for pid, name in processes.items() if "GPU" in name or "gpu" in name}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpus and "dur" in e
            and "memcpy" not in e["name"].lower()]


def summarise(trace_path: Path, steps: int, top: int = 0) -> dict[str, dict]:
    events, processes = load_trace(trace_path)
    out = {}
    for pid, name in sorted(processes.items()):
        if "GPU" not in name:
            continue
        kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") == pid and "memcpy" not in e["name"].lower()]
        if not kernels:
            continue
        collective = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if is_collective(e["name"])]
        compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if not is_collective(e["name"])]
        span = max(end for _, end in collective + compute) - min(start for start, _ in collective + compute)
        busy_compute, busy_collective = busy_time(compute), busy_time(collective)
        exposed = busy_time(collective + compute) - busy_compute
        names = collections.Counter(e["name"].split("(")[0] for e in kernels if is_collective(e["name"]))
        ms = 1e-3 / steps  # trace times are microseconds
        out[name] = {
            "step_span_ms": span * ms, "compute_busy_ms": busy_compute * ms,
            "collective_busy_ms": busy_collective * ms, "collective_exposed_ms": exposed * ms,
            "collective_hidden_ms": (busy_collective - exposed) * ms,
            "idle_ms": (span - busy_time(collective + compute)) * ms,
            "collective_kernels_per_step": {k: v / steps for k, v in names.items()},
        }
        if top:
            by_kind, by_name = collections.Counter(), collections.Counter()
            for e in kernels:
                by_kind[kernel_kind(e["name"])] += e["dur"] * ms
                by_name[e["name"].split("(")[0][:80]] += e["dur"] * ms
            out[name]["kernel_ms_per_step_by_kind"] = dict(by_kind.most_common())
            out[name]["top_kernels_ms_per_step"] = dict(by_name.most_common(top))
            out[name]["kernels_per_step"] = len(kernels) / steps
    return out


def find_traces(trace_dir: Path) -> list[tuple[str, Path]]:
    """(run name, trace) for each ``profile_RUN/plugins/profile/*/*.trace.json.gz`` under
    ``trace_dir``, or for ``trace_dir`` itself when it is one such ``profile_RUN`` directory."""
    found = [(p.relative_to(trace_dir).parts[0].removeprefix("profile_"), p)
             for p in sorted(trace_dir.glob("profile_*/plugins/profile/*/*.trace.json.gz"))]
    found += [(trace_dir.name.removeprefix("profile_"), p)
              for p in sorted(trace_dir.glob("plugins/profile/*/*.trace.json.gz"))]
    return found


def explain_missing(trace_dir: Path) -> str:
    """Why nothing was summarised: what the directory holds instead."""
    if not trace_dir.is_dir():
        return f"{trace_dir} is not a directory"
    xplanes = sorted(str(p.relative_to(trace_dir)) for p in trace_dir.rglob("*.xplane.pb"))
    if xplanes:
        return f"no *.trace.json.gz under {trace_dir}, but {len(xplanes)} xplane file(s): {xplanes[:4]}"
    return (f"no trace under {trace_dir} (expected profile_*/plugins/profile/*/*.trace.json.gz): "
            "did the run start tracing? engine_throughput.py logs 'profile: ...'")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--steps", type=int, default=10, help="step replays in each trace (tensor_parallel --repeats)")
    parser.add_argument("--top", type=int, default=0, help="also list the N kernels with the most time per step")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    traces = find_traces(args.trace_dir)
    if not traces:
        print(explain_missing(args.trace_dir))
    for run, trace in traces:
        summaries = summarise(trace, args.steps, args.top)
        if not summaries:
            _, processes = load_trace(trace)
            print(f"{run}: no GPU kernels in {trace} (processes: {sorted(processes.values())})")
        for device, summary in summaries.items():
            results[f"{run} {device}"] = summary
            print(f"{run:20s} {device:14s} step {summary['step_span_ms']:7.2f} ms: compute {summary['compute_busy_ms']:7.2f}, "
                  f"collectives {summary['collective_busy_ms']:6.2f} (exposed {summary['collective_exposed_ms']:6.2f}, "
                  f"hidden {summary['collective_hidden_ms']:5.2f}), idle {summary['idle_ms']:5.2f}")
            if args.top:
                kinds = ", ".join(f"{k} {v:.2f}" for k, v in summary["kernel_ms_per_step_by_kind"].items())
                print(f"    {summary['kernels_per_step']:.0f} kernels a step; ms a step by kind: {kinds}")
                for kernel, ms in summary["top_kernels_ms_per_step"].items():
                    print(f"    {ms:8.3f} ms  {kernel}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

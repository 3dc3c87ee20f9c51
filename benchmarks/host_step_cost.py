"""The engine's host work per step, split by phase, at batch 1 to 1024: CPU, runs anywhere.

    python benchmarks/host_step_cost.py --trees .,/work/wt-host-base --batches 1,64,256,1024 \
        --steps 100 --rounds 3 --out DIR [--profile 1024]

The host prepares step n+1 while the device runs step n (async scheduling), so the device idles
whenever the host needs longer than the device to prepare a step. What the host does per step
does not depend on the accelerator: here the model is ``common.random_model("tiny")`` in float32
on CPU, whose device work is small, and the host's share of each ``engine.step()`` is its wall
time minus the time it blocked on the device's results (``engine.device_wait_seconds``). The
"device" is this CPU too: before each timed step the benchmark waits (untimed) for the step in
flight, so that schedule, pack and dispatch do not share the cores with it.

For each batch B: B requests (``--prompt-len`` tokens, 8 by default; long outputs, greedy, ``ignore_eos``,
``final_only`` as ``LLM.generate`` submits them) run until all decode, then ``--steps`` steady
decode steps are timed, each phase by a timer around the engine's parts:

- ``schedule``: ``Scheduler.schedule`` (which tokens run; page allocation)
- ``pack``: ``ModelRunner.prepare`` (the step's host arrays)
- ``dispatch``: ``ModelRunner.execute`` (transfer and launch; nothing waits for the device). On
  CPU this includes running the programs, which XLA:CPU does at least partly in the calling
  thread: read ``host_us_per_seq_without_dispatch`` for the engine's own Python work.
- ``postprocess``: ``Scheduler.postprocess`` (computed counts, prefix-cache registration)
- ``process``: ``OutputProcessor.process`` (tokens into sequences, detokenize, stops), with
  ``detokenize`` (``Detokenizer.add_token``) inside it
- ``collect``: ``OutputProcessor.collect`` (``RequestOutput``s of what changed)
- ``other``: the rest of ``Engine.step`` (placeholders, bookkeeping)

and, across the phases, ``gc``: Python's cyclic garbage collector, timed through ``gc.callbacks``
(it runs inside whichever phase allocates when a generation fills up). A step's tail is reported
beside the means: the 99th percentile and the largest host time of one step, and the longest
collector pause with the number of full (generation 2) collections. ``--gc-modes default,freeze``
runs every tree twice, the second time with the start-up heap frozen out of the collector after
the engine is built and warm, as ``jaxinfer serve`` does (``jaxinfer/gc_freeze.py``).

Each tree in ``--trees`` runs in its own process with ``PYTHONPATH`` set to it, the trees
interleaved round by round (the machine may be shared: each round gives every tree the same
weather); the median per step over rounds is kept. ``--profile B`` adds a round whose steps at B run
under ``cProfile`` (the top functions by own time, per tree, go into the results; that round's
times, inflated by the profiler, are not in the medians). The load average is printed
before and after: on a busy machine every number grows.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("schedule", "pack", "dispatch", "postprocess", "process", "detokenize", "collect", "other", "gc")


class PhaseTimers:
    """Seconds spent inside named callables, patched on the instances (or class) that own them."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.gc_pauses: list[tuple[int, float]] = []  # (generation, seconds) of each collection

    def wrap(self, owner, attribute: str, phase: str) -> None:
        original = getattr(owner, attribute)
        seconds = self.seconds
        perf_counter = time.perf_counter

        def timed(*args, **kwargs):
            start = perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[phase] += perf_counter() - start

        setattr(owner, attribute, timed)

    def time_garbage_collection(self) -> None:
        """Add the collector's pauses to ``gc`` (they also count in the phase they interrupt)."""
        started = []
        seconds, pauses = self.seconds, self.gc_pauses

        def callback(phase, info):
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                pause = time.perf_counter() - started.pop()
                seconds["gc"] += pause
                pauses.append((info["generation"], pause))

        gc.callbacks.append(callback)

    def reset(self) -> None:
        for phase in self.seconds:
            self.seconds[phase] = 0.0
        self.gc_pauses.clear()


def fake_device(engine) -> None:
    """Replace the device step by a host function that "samples" token 5 on every row at once:
    no program runs, so a step's time is the engine's own host work (``dispatch`` is then the
    runner's input packing into host buffers and nothing else), and 1000-token prompts take no
    compute to prefill. What the host does per step is unchanged: the same scheduler, packing,
    placeholders, output processing and collection."""
    import numpy as np

    from jaxinfer.runner import _sampler_tree, pack_host_arrays
    from jaxinfer.sampling import SamplerOutput

    try:
        from jaxinfer.runner import _forward_tree
    except ImportError:  # a tree from before it (this benchmark runs no asynchronous verify steps)
        def _forward_tree(inputs):
            return inputs.batch, inputs.prev_rows

    def execute(inputs, token_bitmask=None):
        pack_host_arrays(_forward_tree(inputs))  # the host side of a real dispatch
        pack_host_arrays(_sampler_tree(inputs))
        rows = inputs.batch.logits_indices.shape[0]
        return SamplerOutput(np.full(rows, 5, np.int32), np.zeros(rows, np.float32),
                             np.zeros((rows, 20), np.int32), np.zeros((rows, 20), np.float32))

    engine.runner.execute = execute


def build_engine(max_num_seqs: int, max_model_len: int, warm_up: bool = True):
    import jax.numpy as jnp

    sys.path.insert(0, str(HERE))
    from common import random_model
    from jaxinfer.engine import Engine
    from jaxinfer.engine_config import EngineConfig

    model = random_model("tiny", dtype=jnp.float32)
    page_size = 16
    pages_per_seq = -(-max_model_len // page_size)
    config = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max(2048, max_num_seqs), page_size=page_size,
                          num_pages=max_num_seqs * pages_per_seq + 2, enable_prefix_caching=True,
                          async_scheduling=True, max_wait_s=0.0)
    return Engine(model, config, use_tqdm=False, warm_up=warm_up)


def _settle_steps(batch: int, prompt_len: int) -> int:
    """Steps allowed to reach steady decode: prefill, then the first decodes (async: a step in
    flight). The running sequences' decodes share each step's token budget (``build_engine``'s
    2048 at these batches) with the prefills, so this can take a few times batch * prompt_len / budget."""
    return 16 + 4 * batch * prompt_len // 2048


def measure_batch(engine, timers: PhaseTimers, batch: int, steps: int, tag: str, profile: bool,
                  prompt_len: int) -> dict:
    """Per-step host seconds of ``steps`` steady decode steps at ``batch`` running sequences."""
    import jax
    import numpy as np

    from jaxinfer.sampling_params import SamplingParams

    rng = np.random.default_rng(batch)
    vocab = engine.model_config.vocab_size
    # Random prompts of their own: no request finds another's pages in the prefix cache.
    # Long enough outputs that the first admitted are still running when the last finish their prefill.
    settle_steps = _settle_steps(batch, prompt_len)
    params = SamplingParams(max_tokens=steps + settle_steps + 32, ignore_eos=True, temperature=0.0)
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, rng.integers(3, vocab, prompt_len).tolist(), params, final_only=True)
    for _ in range(settle_steps):
        engine.step()
        if engine.scheduler.num_running == batch and engine.last_step_num_tokens == batch:
            break
    engine.step()
    if engine.scheduler.num_running != batch or engine.last_step_num_tokens != batch:
        raise RuntimeError(f"batch {batch}: {engine.scheduler.num_running} running, "
                           f"{engine.last_step_num_tokens} tokens a step; expected steady decode")
    timers.reset()
    walls, waits = [], []
    profiler = cProfile.Profile() if profile else None
    for _ in range(steps):
        # Untimed: let the step in flight finish first, so that this step's host work does not
        # share the CPU with the device's (here the "device" is the same CPU); the process
        # and collect phases still overlap the step this one launches.
        jax.block_until_ready(engine.runner.last_sampled)
        wait0 = engine.device_wait_seconds
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        engine.step()
        if profiler is not None:
            profiler.disable()
        walls.append(time.perf_counter() - start)
        waits.append(engine.device_wait_seconds - wait0)
        if engine.last_step_num_tokens != batch:
            raise RuntimeError(f"batch {batch}: a step of {engine.last_step_num_tokens} tokens in steady decode")
    phases = {phase: seconds / steps for phase, seconds in timers.seconds.items()}
    host = (sum(walls) - sum(waits)) / steps
    # The median step too: on a shared machine a few steps stall for much longer than the rest.
    host_median = statistics.median(wall - wait for wall, wait in zip(walls, waits))
    phases["other"] = host - sum(v for k, v in phases.items() if k not in ("other", "detokenize", "gc"))
    host_per_step = np.asarray(walls) - np.asarray(waits)
    result = {"batch": batch, "steps": steps, "host_us_per_step": 1e6 * host,
              "host_us_per_seq": 1e6 * host / batch,
              "host_us_per_seq_without_dispatch": 1e6 * (host - phases["dispatch"]) / batch,
              "host_us_per_seq_median_step": 1e6 * host_median / batch, "wall_us_per_step": 1e6 * sum(walls) / steps,
              "device_wait_us_per_step": 1e6 * sum(waits) / steps,
              "host_us_per_step_p99": 1e6 * float(np.percentile(host_per_step, 99)),
              "host_us_per_step_max": 1e6 * float(host_per_step.max()),
              "gc_max_pause_us": 1e6 * max((pause for _, pause in timers.gc_pauses), default=0.0),
              "gc_full_collections": sum(generation == 2 for generation, _ in timers.gc_pauses),
              "phases_us_per_step": {k: 1e6 * v for k, v in phases.items()}}
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        result["profile_tottime"] = text.getvalue()
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return result


def worker(args) -> None:
    """One tree, one process: every batch once, written as JSON to ``args.worker_json``."""
    import jax

    batches = [int(b) for b in args.batches.split(",")]
    start = time.perf_counter()
    engine = build_engine(max(batches), max_model_len=args.prompt_len + args.steps
                          + _settle_steps(max(batches), args.prompt_len) + 64, warm_up=not args.fake_device)
    if args.fake_device:
        fake_device(engine)
    build_seconds = time.perf_counter() - start
    if args.gc_mode == "freeze":
        # What jaxinfer.gc_freeze.freeze_startup_heap does (spelt out: older trees lack the module).
        gc.collect()
        gc.freeze()
    timers = PhaseTimers()
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.scheduler, "postprocess", "postprocess")
    timers.wrap(engine.runner, "prepare", "pack")
    timers.wrap(engine.runner, "execute", "dispatch")
    timers.wrap(engine.output_processor, "process", "process")
    timers.wrap(engine.output_processor, "collect", "collect")
    from jaxinfer.detokenizer import Detokenizer

    timers.wrap(Detokenizer, "add_token", "detokenize")
    timers.time_garbage_collection()
    results = [measure_batch(engine, timers, b, args.steps, f"r{args.round}", b == args.profile, args.prompt_len)
               for b in batches]
    Path(args.worker_json).write_text(json.dumps({"jax": jax.__version__, "build_seconds": build_seconds,
                                                  "gc_frozen_objects": gc.get_freeze_count(),
                                                  "jaxinfer": str(Path(sys.modules["jaxinfer"].__file__).parent),
                                                  "batches": results}))


def tree_label(tree: Path) -> str:
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{tree.name}@{head.stdout.strip() or '?'}"


def markdown(info: dict, per_tree: dict) -> str:
    lines = ["# Host work per engine step (CPU, tiny model)", "",
             f"Command: `{info['command']}`  ", f"Host: {info['host']} ({info['cpu_count']} CPUs), "
             f"python {info['python']}, jax {info['jax']}, {info['date']}  ",
             f"Load average before / after: {info['load_before']} / {info['load_after']}  ",
             f"Median over {info['rounds']} interleaved rounds of {info['steps']} steady decode steps, "
             f"{info['prompt_len']}-token prompts" + (", fake device (host work only)" if info.get("fake_device") else "")
             + ".", "",
             "| tree | B | host µs/step | µs/seq | µs/seq without dispatch | " + " | ".join(PHASES)
             + " | p99 µs/step | max µs/step | longest gc pause µs | full collections |",
             "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in PHASES) + " | ---: | ---: | ---: | ---: |"]
    for label, rows in per_tree.items():
        for row in rows:
            phases = " | ".join(f"{row['phases_us_per_step'][p]:.0f}" for p in PHASES)
            lines.append(f"| {label} | {row['batch']} | {row['host_us_per_step']:.0f} | "
                         f"{row['host_us_per_seq']:.1f} | {row['host_us_per_seq_without_dispatch']:.1f} | {phases} | "
                         f"{row['host_us_per_step_p99']:.0f} | {row['host_us_per_step_max']:.0f} | "
                         f"{row['gc_max_pause_us']:.0f} | {row['gc_full_collections']:.1f} |")
    if len(per_tree) > 1:
        labels = list(per_tree)
        for key, what in (("host_us_per_seq", "all host time"), ("host_us_per_seq_without_dispatch", "without dispatch"),
                          ("host_us_per_seq_median_step", "the median step, all host time")):
            lines += ["", f"Host µs per running sequence per step ({what}), each tree beside the first "
                          "(median; every round in brackets):", "",
                      "| B | " + " | ".join(labels) + " | " + " | ".join(f"{l} ÷ {labels[0]}" for l in labels[1:]) + " |",
                      "| ---: | " + " | ".join("---:" for _ in range(2 * len(labels) - 1)) + " |"]
            for rows in zip(*per_tree.values()):
                base = rows[0][key]
                cells = [f"{r[key]:.1f} ({', '.join(f'{x:.1f}' for x in r[key + '_all'])})" for r in rows]
                lines.append(f"| {rows[0]['batch']} | " + " | ".join(cells) + " | "
                             + " | ".join(f"{r[key] / base:.2f}" for r in rows[1:]) + " |")
    lines += ["", "Phases in µs per step; `detokenize` is inside `process`; `gc` (the collector's pauses) is inside the phases it interrupted. µs/seq = host µs/step ÷ B."]
    return "\n".join(lines) + "\n"


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Per batch, the median of each number over the rounds."""
    out = []
    for rows in zip(*runs):
        row = {"batch": rows[0]["batch"], "steps": rows[0]["steps"], "rounds": len(rows)}
        for key in ("host_us_per_step", "host_us_per_seq", "host_us_per_seq_without_dispatch",
                    "host_us_per_seq_median_step", "wall_us_per_step", "device_wait_us_per_step",
                    "host_us_per_step_p99", "host_us_per_step_max", "gc_max_pause_us", "gc_full_collections"):
            row[key] = statistics.median(r[key] for r in rows)
            row[key + "_all"] = [r[key] for r in rows]
        row["phases_us_per_step"] = {p: statistics.median(r["phases_us_per_step"][p] for r in rows) for p in PHASES}
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", default=".", help="comma-separated source trees, each run with PYTHONPATH=tree")
    parser.add_argument("--batches", default="1,64,256,1024")
    parser.add_argument("--steps", type=int, default=100, help="timed steady decode steps per batch")
    parser.add_argument("--prompt-len", type=int, default=8,
                        help="prompt tokens per request: longer ones mean wider page tables (throughput-1k: 1000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fake-device", action="store_true",
                        help="no device programs: the step 'samples' on the host (see fake_device): the engine's "
                             "host work alone, and long prompts prefilled in no time")
    parser.add_argument("--gc-modes", default="default",
                        help="comma-separated: default (the collector as is), freeze (gc.freeze() after warm-up)")
    parser.add_argument("--profile", type=int, default=0, help="an extra round, cProfiling the steps of this batch")
    parser.add_argument("--out", type=Path, default=Path("host_step_cost_out"))
    parser.add_argument("--worker-json", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--gc-mode", default="default", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_json:
        return worker(args)
    info = {"command": "python3 " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()), "rounds": args.rounds,
            "steps": args.steps, "batches": args.batches, "prompt_len": args.prompt_len, "fake_device": args.fake_device}
    for key in ("command", "host", "cpu_count", "python", "load_before"):
        print(f"{key}: {info[key]}", flush=True)
    modes = args.gc_modes.split(",")
    if not set(modes) <= {"default", "freeze"}:
        raise SystemExit(f"--gc-modes takes default and/or freeze, got {args.gc_modes!r}")
    # A variant is a tree run with one gc mode; each runs in its own processes, interleaved.
    trees = [(Path(t).resolve(), mode) for t in args.trees.split(",") for mode in modes]
    labels = {(tree, mode): tree_label(tree) + (f" gc={mode}" if len(modes) > 1 else "") for tree, mode in trees}
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple, list] = {variant: [] for variant in trees}
    profiles = {}
    # With --profile, one more round under cProfile, whose (slower) times are left out of the medians.
    for round_index in range(args.rounds + bool(args.profile)):
        for variant in trees:
            tree, mode = variant
            path = args.out / f"worker_{round_index}_{tree.name}_{mode}.json"
            profile = args.profile if round_index == args.rounds else 0
            command = ([sys.executable, str(Path(__file__).resolve()), "--worker-json", str(path),
                        "--batches", args.batches, "--steps", str(args.steps), "--prompt-len", str(args.prompt_len),
                        "--profile", str(profile), "--round", str(round_index), "--gc-mode", mode]
                       + (["--fake-device"] if args.fake_device else []))
            env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
            subprocess.run(command, env=env, check=True, cwd=tree)
            run = json.loads(path.read_text())
            info["jax"] = run["jax"]
            if not profile:
                runs[variant].append(run["batches"])
            for row in run["batches"]:
                print(f"round {round_index} {labels[variant]} B={row['batch']}: host {row['host_us_per_step']:.0f} µs/step, "
                      f"{row['host_us_per_seq']:.1f} µs/seq, " + ", ".join(
                          f"{p} {row['phases_us_per_step'][p]:.0f}" for p in PHASES), flush=True)
                if "profile_tottime" in row:
                    profiles[labels[variant]] = row["profile_tottime"]
    info["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load_after: {info['load_after']}")
    per_tree = {labels[v]: median_rows(runs[v]) for v in trees}
    results = {"info": info, "trees": {labels[v]: str(v[0]) for v in trees}, "results": per_tree, "profiles": profiles}
    (args.out / "host_step_cost.json").write_text(json.dumps(results, indent=2))
    text = markdown(info, per_tree)
    if profiles:
        text += "".join(f"\n## cProfile, B={args.profile}, {label} (top by own time)\n\n```\n{p}```\n"
                        for label, p in profiles.items())
    (args.out / "host_step_cost.md").write_text(text)
    print(text)
    print(f"wrote {args.out}/host_step_cost.{{json,md}}")


if __name__ == "__main__":
    main()

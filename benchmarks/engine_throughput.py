"""Engine benchmarks on one GPU: `latency`, `throughput-1k`, `throughput-nano` (`../shared/BENCHMARKS.md`).

    python3 benchmarks/engine_throughput.py --out DIR \
        [--workloads startup,latency,batch128,decode256,throughput-1k,throughput-nano] [--hf DIR/hf_peer.json]

Random bf16 weights with real architectures (Llama-3.1-8B; Qwen3-0.6B for `throughput-nano`),
a synthetic word-level tokenizer, prompts sent as token ids, EOS ignored so every request
makes its full output. The engine is driven the way the server drives it (``add_request``
then ``step`` until done), timed on the host's wall clock.

- ``startup``: seconds to compile every step program (cold, or warm when the persistent
  compilation cache already holds them: run the script twice to see both).
- ``latency``: one request, 128 prompt tokens, 256 output tokens: time per output token
  against the roofline (bytes of weights read per token, without the input embedding
  table, / the HBM read ceiling measured in this run).
- ``batch128``: 128 requests x 256 in / 256 out, the workload HF ``generate_batch`` runs
  in ``hf_peer.py`` (pass its JSON with ``--hf`` for the ratio).
- ``decode256``: 256 requests in steady decode: the host time on the critical path, as the
  step's wall time against the device time of the same step replayed back to back.
- ``throughput-1k``: 1000 requests x 1000 in / 1000 out, all submitted at once (``--profile-steps N``:
  also a ``jax.profiler`` trace of N of its steady decode steps; ``--host-profile-steps N``: a
  ``cProfile`` of the engine loop over N steady decode steps).
- ``throughput-nano``: Qwen3-0.6B, 256 requests, lengths uniform in [100, 1024], seed 0.
- ``throughput-1k-structured`` (``--structured-fraction F``): ``throughput-1k`` with a fraction
  F of the requests (spread evenly) under a JSON schema (``structured_output_host.LONG_OUTPUT_SCHEMA``:
  an object whose one string is at least 4,096 characters long), and its ratio to ``throughput-1k``
  when both run. Random weights have no tokenizer, so the grammar uses ``--structured-tokenizer``'s
  (SmolLM2's 49,152 ids by default; ``structured_output_host.py --export-tokenizer DIR`` writes one
  small enough to carry); the model's other ids are padding the mask always disallows. EOS is
  ignored as in ``throughput-1k``, but a grammar that completes ends its request early with EOS
  (there is no valid token after it), which would make the constrained run do less work: the
  schema cannot complete within 1,000 tokens, so every request still makes its full output (the
  run checks it), and the masks are the costly in-string kind throughout.

Writes DIR/engine_throughput.{json,md,log}, after each workload (a run cut short keeps
what it measured).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import (  # noqa: E402
    Log, calibrated_on_random_tokens, decode_weight_bytes, header, measure_ceilings, random_model, random_prompts, write_results,
)

from jaxinfer.engine import Engine, EngineConfig  # noqa: E402
from jaxinfer.kv_cache_dtype import storage_dtype  # noqa: E402
from jaxinfer.memory import num_pages_for_device, pages_for  # noqa: E402
from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

NAME = "engine_throughput"


def build_engine(model, *, max_model_len, max_num_seqs, max_num_batched_tokens, page_size, memory_utilization, log,
                 num_pages=None, kv_cache_dtype="auto", attention_impl=None, admission=None):
    num_pages = num_pages or num_pages_for_device(
        model.config, page_size=page_size,
        bytes_per_element=storage_dtype(kv_cache_dtype, model.weights.embed.dtype).itemsize,
        memory_utilization=memory_utilization, reserve_bytes=4 << 30,
    )
    if jax.default_backend() == "cpu":
        num_pages = max(num_pages, 4 * pages_for(max_model_len, page_size) + 1)
    config = EngineConfig(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        page_size=page_size, num_pages=num_pages, kv_cache_dtype=kv_cache_dtype, attention_impl=attention_impl,
        scheduling_admission=admission,
    )
    start = time.perf_counter()
    engine = Engine(model, config, warm_up=True, use_tqdm=False)
    seconds = time.perf_counter() - start
    programs, times = engine.runner.num_programs, engine.runner.warmup_compile_times
    log(f"engine: {num_pages} pages x {page_size} tokens (kv_cache_dtype {kv_cache_dtype}), "
        f"max_num_seqs {max_num_seqs}, admission {engine.config.scheduling_admission}, "
        f"token budget {max_num_batched_tokens}; compiled {programs} programs in {seconds:.1f} s "
        f"({engine.runner.warmup_recompiles} compiled again at their first run; "
        f"compile pool {times.pool_seconds:.1f} s, its longest program {times.longest_seconds:.1f} s; summed: "
        f"forward programs {times.forward_seconds:.1f} s, samplers {times.sampler_seconds:.1f} s, shared kernels "
        f"{times.kernel_seconds:.1f} s; lowering {times.lowering_seconds:.1f} s of them, in one thread)")
    for program in times.programs:  # in the order they started: which ones set the pool's end
        log(f"  {program.name}: lowered in {program.lowering_seconds:.2f} s, compiled in {program.compile_seconds:.1f} s")
    return engine, {"num_pages": num_pages, "page_size": page_size, "max_num_seqs": max_num_seqs,
                    "max_num_batched_tokens": max_num_batched_tokens, "max_model_len": max_model_len,
                    "num_programs": programs, "compile_seconds": seconds,
                    "warmup_recompiles": engine.runner.warmup_recompiles, "compile_pool_seconds": times.pool_seconds,
                    "longest_compile_seconds": times.longest_seconds, "forward_compile_seconds": times.forward_seconds,
                    "sampler_compile_seconds": times.sampler_seconds, "lowering_seconds": times.lowering_seconds,
                    "shared_kernel_compile_seconds": times.kernel_seconds,
                    "programs": [list(program) for program in times.programs], "kv_cache_dtype": kv_cache_dtype,
                    "attention_impl": attention_impl or "auto", "admission": engine.config.scheduling_admission,
                    "v_layout": engine.runner.v_layout}


def run_requests(engine, prompts, output_lens, tag, capture=None, structured_fraction=0.0):
    """Submit everything at once and step until done; per-request metrics and a per-step log.

    ``structured_fraction``: that share of the requests, spread evenly, run under
    ``LONG_OUTPUT_SCHEMA`` (a JSON schema that cannot complete within their output).
    """
    constraint = None
    if structured_fraction:  # structured_output_host needs llguidance: only then
        from structured_output_host import LONG_OUTPUT_SCHEMA

        constraint = StructuredOutputsParams(json=LONG_OUTPUT_SCHEMA)
    for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
        is_structured = int((i + 1) * structured_fraction) > int(i * structured_fraction)
        params = SamplingParams(max_tokens=int(n), ignore_eos=True, temperature=0.0,
                                structured_outputs=constraint if is_structured else None)
        engine.add_request(f"{tag}-{i}", prompt, params, final_only=True)  # offline generation, as LLM.generate does
    steps, finished = [], {}
    wait_before = engine.device_wait_seconds
    tokens_before = engine.stats()["generation_tokens_total"]
    start = next_report = time.perf_counter()
    while engine.has_unfinished_requests():
        if time.perf_counter() >= next_report:  # progress, so a run cut short still says how far it got
            elapsed = time.perf_counter() - start
            done = engine.stats()["generation_tokens_total"] - tokens_before
            print(f"  {tag}: {elapsed:.0f} s, {len(finished)} requests done, {done} output tokens "
                  f"({done / max(elapsed, 1e-9):.0f} tok/s), running {engine.scheduler.num_running}, "
                  f"waiting {engine.scheduler.num_waiting}", flush=True)
            next_report += 15.0
        t0 = time.perf_counter()
        wait0, dispatch0, mask0 = engine.device_wait_seconds, engine.dispatch_seconds, engine.grammar_mask_seconds
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps.append({
            "wall": time.perf_counter() - t0, "wait": engine.device_wait_seconds - wait0,
            "dispatch": engine.dispatch_seconds - dispatch0, "mask": engine.grammar_mask_seconds - mask0,
            "num_tokens": engine.last_step_num_tokens, "num_running": engine.scheduler.num_running,
        })
        if capture is not None:
            capture(engine)
    elapsed = time.perf_counter() - start
    outputs = [finished[f"{tag}-{i}"] for i in range(len(prompts))]
    for out, n in zip(outputs, output_lens):
        got = len(out.outputs[0].token_ids)
        if got != n:
            raise AssertionError(f"{out.request_id}: {got} output tokens, expected {n}")
    num_out = sum(int(n) for n in output_lens)
    num_in = sum(len(p) for p in prompts)
    return {
        "num_requests": len(prompts), "seconds": elapsed, "input_tokens": num_in, "output_tokens": num_out,
        "output_tokens_per_s": num_out / elapsed, "total_tokens_per_s": (num_in + num_out) / elapsed,
        "requests_per_s": len(prompts) / elapsed, "num_steps": len(steps),
        "device_wait_seconds": engine.device_wait_seconds - wait_before,
        "preemptions": engine.scheduler.num_preemptions,
        "compilations_after_warmup": engine.runner.num_compilations_after_warmup,
        "grammar_mask_seconds": engine.grammar_mask_seconds,
    }, outputs, steps


def latency(engine, weights_bytes_per_token, ceiling_tbs, log, repeats=3):
    rng = np.random.default_rng(1)
    vocab = engine.model_config.vocab_size
    tpots, ttfts = [], []
    for r in range(repeats + 1):  # the first run also touches every decode program once more
        summary, outputs, _ = run_requests(engine, random_prompts(rng, [128], vocab), [256], f"lat{r}")
        m = outputs[0].metrics
        tpots.append((m.last_token_time - m.first_token_time) / 255)
        ttfts.append(m.first_token_time - m.arrival_time)
    tpot = statistics.median(tpots[1:])
    roofline = weights_bytes_per_token / (ceiling_tbs * 1e12)
    log(f"latency: TPOT {tpot * 1e3:.2f} ms (runs {[round(t * 1e3, 2) for t in tpots[1:]]}), roofline "
        f"{roofline * 1e3:.2f} ms ({weights_bytes_per_token / 1e9:.2f} GB / {ceiling_tbs:.2f} TB/s): "
        f"{tpot / roofline:.2f}x; TTFT {statistics.median(ttfts[1:]) * 1e3:.1f} ms")
    return {"tpot_ms": tpot * 1e3, "all_tpot_ms": [t * 1e3 for t in tpots[1:]], "roofline_ms": roofline * 1e3,
            "ratio_to_roofline": tpot / roofline, "ttft_ms": statistics.median(ttfts[1:]) * 1e3,
            "weight_bytes_per_token": weights_bytes_per_token}


def trace_latency_steps(engine, out_dir: Path, num_steps: int, log) -> dict:
    """One more ``latency`` request, ``num_steps`` of its decode steps traced once 16 have run, and the
    trace's µs a step by kind (``latency_lab.breakdown``). The span between the first and last kernel
    counts the device's idle time between steps (the host's share) as gaps, which the lab's
    on-device step loop does not have."""
    profiler = DecodeProfiler(out_dir, num_steps, min_running=1, settle_steps=16, log=log, label="latency decode")
    rng = np.random.default_rng(3)
    run_requests(engine, random_prompts(rng, [128], engine.model_config.vocab_size), [256], "lat-trace",
                 capture=profiler)
    profiler.stop(engine)
    return profiler.report()


def decode_host_time(engine, num_requests, prompt_len, output_len, log):
    """Steady decode at ``num_requests``: wall time per step vs the same step replayed on the device."""
    rng = np.random.default_rng(2)
    captured = {}
    runner = engine.runner
    original_execute = runner.execute

    def execute(inputs, *args, **kwargs):  # keep one full-batch pure-decode step's inputs for the replay
        n = int(np.count_nonzero(np.diff(inputs.batch.cu_q_lens)))
        if n == num_requests and int(inputs.batch.cu_q_lens[-1]) == num_requests:
            captured["inputs"] = inputs
        return original_execute(inputs, *args, **kwargs)

    runner.execute = execute
    try:
        summary, _, steps = run_requests(
            engine, random_prompts(rng, [prompt_len] * num_requests, engine.model_config.vocab_size),
            [output_len] * num_requests, "dec",
        )
    finally:
        runner.execute = original_execute
    steady = [s for s in steps if s["num_tokens"] == num_requests and s["num_running"] == num_requests]
    steady = steady[len(steady) // 4 :]  # past the ramp
    wall = statistics.median(s["wall"] for s in steady)
    host_busy = statistics.median(s["wall"] - s["wait"] - s["dispatch"] for s in steady)
    dispatch = statistics.median(s["dispatch"] for s in steady)
    inputs = captured["inputs"]
    jax.block_until_ready(runner.execute(inputs).token_ids)
    n = 50
    start = time.perf_counter()
    for _ in range(n):
        out = runner.execute(inputs)
    jax.block_until_ready(out.token_ids)
    device = (time.perf_counter() - start) / n
    idle = max(0.0, 1 - device / wall)
    log(f"decode{num_requests}: step wall {wall * 1e3:.2f} ms, device-only replay {device * 1e3:.2f} ms -> "
        f"device idle {idle:.1%} of each step; host work per step {host_busy * 1e3:.2f} ms, dispatch "
        f"{dispatch * 1e3:.2f} ms ({len(steady)} steady steps); {summary['output_tokens_per_s']:.0f} output tok/s overall")
    return {**summary, "steady_step_wall_ms": wall * 1e3, "device_replay_step_ms": device * 1e3,
            "device_idle_fraction": idle, "host_work_per_step_ms": host_busy * 1e3,
            "dispatch_per_step_ms": dispatch * 1e3, "num_steady_steps": len(steady)}


def compilation_cache_files() -> int:
    """Entries in JAX's persistent compilation cache now (0: the next start-up compiles cold)."""
    from jaxinfer.model_registry import default_cache_dir

    path = Path(jax.config.jax_compilation_cache_dir or default_cache_dir() / "jax-compilation-cache")
    return sum(1 for _ in path.iterdir()) if path.is_dir() else 0


class DecodeProfiler:
    """A ``run_requests`` capture that traces ``num_steps`` steps once the batch is in steady decode.

    A step is decode-only when it scheduled one token per running sequence. Tracing starts after
    ``settle_steps`` decode-only steps in a row with at least ``min_running`` sequences (past
    the admission ramp, so the trace shows the state ``throughput-1k`` spends its time in), and
    stops after ``num_steps`` more steps, once the device has run them. ``profile_collectives.py
    --top`` lists the trace's kernels by time. :meth:`report` says what happened, including why
    tracing never started (the largest decode-only batch seen), so a run without a trace says so.

    ``phase="prefill"`` traces prefill-carrying steps instead (more tokens than running
    sequences: prompt chunks beside the running decodes), the admission ramp's state. ``after``:
    another profiler; this one never starts while that one traces (one trace at a time).
    The report also carries the trace's µs a step by kind (``latency_lab.breakdown``), logged
    under ``label`` (default: the phase).
    """

    def __init__(self, out_dir: Path, num_steps: int, min_running: int, settle_steps: int = 4, log=print,
                 phase: str = "decode", after=None, label: str | None = None):
        self.out_dir, self.num_steps, self.min_running, self.settle_steps = out_dir, num_steps, min_running, settle_steps
        self.log, self.phase, self.after, self.label = log, phase, after, label or phase
        self.num_seen = self.num_traced = self.decode_run = self.max_decode_running = 0
        self.started_at_step = None
        self.active = False

    @property
    def is_done(self) -> bool:
        return self.started_at_step is not None and not self.active

    def __call__(self, engine) -> None:
        self.num_seen += 1
        if self.is_done:
            return
        if self.active:
            self.num_traced += 1
            if self.num_traced == self.num_steps:
                self.stop(engine)
            return
        if self.after is not None and self.after.active:
            return
        running = engine.scheduler.num_running
        if self.phase == "prefill":
            is_wanted = engine.last_step_num_tokens > running
        else:
            is_wanted = running > 0 and engine.last_step_num_tokens == running
        self.decode_run = self.decode_run + 1 if is_wanted else 0
        if is_wanted:
            self.max_decode_running = max(self.max_decode_running, running)
        if self.decode_run >= self.settle_steps and running >= self.min_running:
            jax.block_until_ready(engine.runner.last_sampled)  # the trace starts at a step boundary
            jax.profiler.start_trace(str(self.out_dir))
            self.active, self.started_at_step = True, self.num_seen
            self.log(f"profile: tracing {self.num_steps} {self.phase} steps from step {self.num_seen} "
                     f"({running} running, {engine.scheduler.num_waiting} waiting) into {self.out_dir}")

    def stop(self, engine) -> None:
        """Stop tracing once the device has run the steps launched so far (also when the run ends first)."""
        if not self.active:
            return
        jax.block_until_ready(engine.runner.last_sampled)
        jax.profiler.stop_trace()
        self.active = False

    def report(self) -> dict:
        traces = sorted(str(p.relative_to(self.out_dir)) for p in self.out_dir.glob("plugins/profile/*/*.trace.json.gz"))
        if self.started_at_step is None:
            kind = "decode-only" if self.phase == "decode" else "prefill-carrying"
            self.log(f"profile: never started: no {self.settle_steps} {kind} steps in a row with >= "
                     f"{self.min_running} running (largest {kind} batch {self.max_decode_running})")
        else:
            self.log(f"profile: traced {self.num_traced} steps from step {self.started_at_step}; "
                     f"{len(traces)} trace file(s) {traces}")
        report = {"started_at_step": self.started_at_step, "num_traced_steps": self.num_traced,
                  "min_running": self.min_running, "max_decode_only_running": self.max_decode_running,
                  "trace_files": traces}
        if traces and self.num_traced:
            from latency_lab import breakdown, log_breakdown

            report["breakdown"] = breakdown(self.out_dir / traces[-1], self.num_traced, top=30)
            log_breakdown(self.log, f"{self.label} steps", report["breakdown"])
        return report


class HostProfiler:
    """A ``run_requests`` capture that runs ``cProfile`` over ``num_steps`` steady decode steps.

    It starts after the device trace (if any) is done and ``settle_steps`` decode-only steps in a
    row with at least ``min_running`` sequences, so it profiles the engine loop's Python (and the
    C calls it makes: dispatch, transfers, waits) in the state ``throughput-1k`` spends its time in,
    without the tracer's overhead. Writes ``out_dir/host.pstats`` and the top functions by own
    and by cumulative time to ``out_dir/host_profile.txt``.
    """

    def __init__(self, out_dir: Path, num_steps: int, min_running: int, after=None, settle_steps: int = 4, log=print):
        self.out_dir, self.num_steps, self.min_running, self.settle_steps = out_dir, num_steps, min_running, settle_steps
        self.after, self.log = after, log
        self.profiler, self.decode_run, self.num_profiled, self.done = None, 0, 0, False

    def __call__(self, engine) -> None:
        if self.done or (self.after is not None and not self.after.is_done):
            return
        if self.profiler is not None:
            self.num_profiled += 1
            if self.num_profiled == self.num_steps:
                self.stop()
            return
        running = engine.scheduler.num_running
        is_decode_only = running > 0 and engine.last_step_num_tokens == running
        self.decode_run = self.decode_run + 1 if is_decode_only else 0
        if self.decode_run >= self.settle_steps and running >= self.min_running:
            import cProfile

            self.profiler = cProfile.Profile()
            self.log(f"host profile: cProfile over {self.num_steps} decode steps ({running} running)")
            self.profiler.enable()

    def stop(self) -> None:
        if self.profiler is None or self.done:
            return
        import io
        import pstats

        self.profiler.disable()
        self.done = True
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.profiler.dump_stats(str(self.out_dir / "host.pstats"))
        text = io.StringIO()
        text.write(f"cProfile over {self.num_profiled} steady decode steps (times are totals over them)\n")
        for key in ("tottime", "cumulative"):
            text.write(f"\n## by {key}\n")
            pstats.Stats(self.profiler, stream=text).sort_stats(key).print_stats(45)
        (self.out_dir / "host_profile.txt").write_text(text.getvalue())
        self.log(f"host profile: {self.num_profiled} steps written to {self.out_dir / 'host_profile.txt'}")


def step_phases(steps: list[dict]) -> dict:
    """Wall time by kind of step: steps that computed prompt tokens (prefill chunks, with the
    running sequences' decodes in the same step) and decode-only steps (one token per running
    sequence), and calls that dispatched nothing (collecting the last step's outputs, or waiting).
    Their sum is the run's stepping time; what a faster prefill or a faster decode step would
    save is read off here, not guessed."""
    phases = {}
    for name, chosen in (("with_prefill", [s for s in steps if s["num_tokens"] > s["num_running"]]),
                         ("decode_only", [s for s in steps if 0 < s["num_tokens"] <= s["num_running"]]),
                         ("no_tokens", [s for s in steps if s["num_tokens"] == 0])):
        wall = sum(s["wall"] for s in chosen)
        phases[name] = {"steps": len(chosen), "seconds": wall, "tokens": sum(s["num_tokens"] for s in chosen),
                        "mean_step_ms": 1e3 * wall / max(len(chosen), 1),
                        "mean_running": statistics.mean(s["num_running"] for s in chosen) if chosen else 0.0}
    return phases


def throughput(engine, prompt_lens, output_lens, tag, log, profile: DecodeProfiler | None = None,
               structured_fraction: float = 0.0, host_profile: HostProfiler | None = None,
               prefill_profile: DecodeProfiler | None = None):
    # Its own prompts per run: a second run over the same prompts would find their pages in the
    # prefix cache and skip the prefill (the first structured comparison did: 122% of unconstrained).
    rng = np.random.default_rng(1 if structured_fraction else 0)
    mask_before = engine.grammar_mask_seconds
    captures = [c for c in (prefill_profile, profile, host_profile) if c is not None]

    def capture(engine_):
        for c in captures:
            c(engine_)

    summary, _, steps = run_requests(engine, random_prompts(rng, prompt_lens, engine.model_config.vocab_size),
                                     output_lens, tag, capture=capture if captures else None,
                                     structured_fraction=structured_fraction)
    summary["grammar_mask_seconds"] = engine.grammar_mask_seconds - mask_before
    if structured_fraction:
        summary["structured_fraction"] = structured_fraction
        # Host time filling masks, per step that had constrained rows (it overlaps the forward).
        masked_steps = [s for s in steps if s["mask"] > 0]
        if masked_steps:
            summary["mask_fill_ms_p50"] = 1e3 * float(np.percentile([s["mask"] for s in masked_steps], 50))
            summary["mask_fill_ms_p99"] = 1e3 * float(np.percentile([s["mask"] for s in masked_steps], 99))
    if host_profile is not None:
        host_profile.stop()
    if prefill_profile is not None:
        prefill_profile.stop(engine)
        summary["prefill_profile"] = prefill_profile.report()
    if profile is not None:
        profile.stop(engine)  # when the run ended first
        summary["profile"] = profile.report()
    decode_steps = [s for s in steps if s["num_tokens"] == s["num_running"] and s["num_running"] > 0]
    if decode_steps:
        wall = sum(s["wall"] for s in decode_steps)
        # Dispatch is host time too, but time the host may spend blocked in it (a program that
        # syncs with the host) is not work: report it apart.
        summary["decode_steps_host_work_fraction"] = sum(
            s["wall"] - s["wait"] - s["dispatch"] for s in decode_steps) / wall
        summary["decode_steps_dispatch_fraction"] = sum(s["dispatch"] for s in decode_steps) / wall
        summary["decode_step_ms"] = 1e3 * statistics.median(s["wall"] for s in decode_steps)
    summary["mean_batch"] = statistics.mean(s["num_running"] for s in steps)
    summary["phases"] = step_phases(steps)
    # Every step, compactly: where a run's wall time went, step by step (prefill ramp, steady
    # decode, drain), for plots and for checking the phase split above.
    summary["steps"] = {"wall_ms": [round(1e3 * s["wall"], 3) for s in steps],
                        "num_tokens": [s["num_tokens"] for s in steps],
                        "num_running": [s["num_running"] for s in steps]}
    log(f"{tag}: {summary['output_tokens_per_s']:.0f} output tok/s, {summary['total_tokens_per_s']:.0f} total tok/s, "
        f"{summary['requests_per_s']:.2f} req/s in {summary['seconds']:.1f} s; {summary['num_steps']} steps, mean batch "
        f"{summary['mean_batch']:.0f}, preemptions {summary['preemptions']}, compilations after warm-up "
        f"{summary['compilations_after_warmup']}")
    return summary


def markdown(results: dict) -> str:
    info = results["info"]
    lines = [
        "# Engine benchmarks", "",
        f"Command: `{info['command']}`  ",
        f"Hardware: {info['device']} x{info['num_devices']}, jax {info['jax']}, {info['date']}", "",
    ]
    for key, name in (("xla_flags", "XLA_FLAGS"), ("decode_matmul", "JAXINFER_DECODE_MATMUL")):
        if info.get(key):
            lines += [f"Environment: `{name}={info[key]}`", ""]
    if "ceilings" in results:
        c = results["ceilings"]
        lines += [f"Ceilings in this run: HBM read {c['hbm_read_tbs']:.2f} TB/s, bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s.", ""]
    lines += ["| workload | model | result | vs bound / peer |", "| --- | --- | --- | --- |"]
    w = results.get("workloads", {})
    for key, cache, goal in (("startup", "cold cache", "≤ 60 s"), ("startup-warm", "warm cache", "≤ 15 s"),
                             ("startup-orbax", "cold cache, restored from Orbax", "≤ 60 s"),
                             ("startup-warm-orbax", "warm cache, restored from Orbax", "≤ 15 s")):
        if key in w:
            s = w[key]
            lines.append(f"| startup, {cache} | {s['shape']} | {s['num_programs']} programs compiled in "
                         f"{s['compile_seconds']:.1f} s ({s.get('warmup_recompiles', 0)} twice; longest program "
                         f"{s.get('longest_compile_seconds', float('nan')):.1f} s) | goal {goal} |")
    if "latency" in w:
        s = w["latency"]
        lines.append(f"| latency (128 in / 256 out, batch 1) | {s['shape']} | TPOT {s['tpot_ms']:.2f} ms, TTFT {s['ttft_ms']:.1f} ms | {s['ratio_to_roofline']:.2f}x roofline ({s['roofline_ms']:.2f} ms); HF: {s.get('hf_tpot_ms', float('nan')):.2f} ms |")
    if "batch128" in w:
        s = w["batch128"]
        lines.append(f"| 128 x 256/256 | {s['shape']} | {s['output_tokens_per_s']:.0f} output tok/s | {s.get('ratio_to_hf', float('nan')):.1f}x HF generate_batch ({s.get('hf_output_tokens_per_s', float('nan')):.0f} tok/s) |")
    if "decode256" in w:
        s = w["decode256"]
        lines.append(f"| decode at batch 256 | {s['shape']} | step {s['steady_step_wall_ms']:.2f} ms wall vs {s['device_replay_step_ms']:.2f} ms device | device idle {s['device_idle_fraction']:.1%} of a step (goal ≤ 10%) |")
    for key in ("throughput-1k", "throughput-nano"):
        if key in w:
            s = w[key]
            lines.append(f"| {key} | {s['shape']} | {s['output_tokens_per_s']:.0f} output tok/s, {s['total_tokens_per_s']:.0f} total tok/s, {s['requests_per_s']:.2f} req/s | mean batch {s['mean_batch']:.0f}, {s['preemptions']} preemptions |")
            for phase, p in s.get("phases", {}).items():
                lines.append(f"| {key}: {phase.replace('_', ' ')} steps | {s['shape']} | {p['seconds']:.1f} s in {p['steps']} steps "
                             f"({p['mean_step_ms']:.1f} ms each, {p['tokens']} tokens) | mean running {p['mean_running']:.0f} |")
    if "throughput-1k-structured" in w:
        s = w["throughput-1k-structured"]
        goal = "≥ 90%" if s["structured_fraction"] >= 1.0 else "≥ 97% at 20%"
        lines.append(f"| throughput-1k, {s['structured_fraction']:.0%} under a JSON schema | {s['shape']} | {s['output_tokens_per_s']:.0f} output tok/s; mask fill p50 {s.get('mask_fill_ms_p50', float('nan')):.2f} ms, p99 {s.get('mask_fill_ms_p99', float('nan')):.2f} ms a step | {s.get('ratio_to_unconstrained', float('nan')):.1%} of unconstrained (goal {goal}) |")
    lines += ["", "Engine settings per model:", ""]
    for shape, e in results.get("engines", {}).items():
        lines.append(f"- {shape}: " + ", ".join(f"{k} {v if not isinstance(v, float) else round(v, 1)}"
                                                for k, v in e.items() if k != "programs"))  # each program: the JSON
    return "\n".join(lines) + "\n"


def through_orbax(model, directory: Path, log):
    """``model`` saved as an Orbax checkpoint in ``directory`` and restored from it, as a converted
    model (``jaxinfer convert``) is served: its arrays come back committed to their device. The
    original is dropped first, so the restored one has the device to itself."""
    from jaxinfer.orbax_checkpoint import restore, save

    start = time.perf_counter()
    path = save(model, directory)
    del model
    restored = restore(path)
    jax.block_until_ready(restored.weights)
    log(f"model saved to and restored from Orbax at {directory} in {time.perf_counter() - start:.1f} s")
    return restored


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workloads", default="startup,latency,batch128,decode256,throughput-1k,throughput-nano")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--quantization", choices=["fp8", "int8"], default=None,
                        help="the main shape's projections quantized (docs/QUANTIZATION.md); default bf16")
    parser.add_argument("--activation-scales", choices=["dynamic", "static"], default="dynamic",
                        help="fp8 W8A8 activation scales (jaxinfer.activation_scales); static: calibrated in this run "
                             "on random-token prompts, since random weights come with no checkpoint scales")
    parser.add_argument("--nano-shape", default="qwen3-0.6b")
    parser.add_argument("--hf", type=Path, help="hf_peer.json from benchmarks/hf_peer.py, for the ratios")
    # 384: about as many 2,000-token requests as the H200's page pool holds (~848k tokens), so
    # throughput-1k runs without preempting and recomputing requests it admitted too eagerly.
    parser.add_argument("--max-num-seqs", type=int, default=384)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--memory-utilization", type=float, default=0.95)
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages of every engine the run builds (default: sized from free memory)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="KV page storage of every engine the run builds (fp8: e4m3, twice the pool)")
    parser.add_argument("--admission", choices=["reserve", "greedy"], default=None,
                        help="the engine's scheduling_admission (default: the engine's, reserve)")
    parser.add_argument("--attention-impl", default=None,
                        help="every engine's attention_impl (jaxinfer.attention.IMPLEMENTATIONS; default: auto)")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink request counts and lengths (CPU smoke runs)")
    parser.add_argument("--via-orbax", type=Path, default=None, metavar="DIR",
                        help="serve the random model saved to an Orbax checkpoint in DIR and restored (the start-up "
                             "of a converted model; its row is startup-orbax)")
    parser.add_argument("--resume", action="store_true", help="add to an existing results JSON in --out")
    parser.add_argument("--structured-fraction", type=float, default=0.0,
                        help="run throughput-1k-structured: this fraction of throughput-1k's requests under a JSON schema")
    parser.add_argument("--structured-tokenizer", default="smollm2-135m-instruct",
                        help="the grammar's tokenizer: a model name, GGUF or HF directory (structured_output_host.py --export-tokenizer)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="trace this many steady decode steps of throughput-1k (DIR/profile_throughput-1k_decode)")
    parser.add_argument("--profile-prefill-steps", type=int, default=0,
                        help="trace this many prefill-carrying steps of throughput-1k's admission ramp, before the "
                             "decode trace if any (DIR/profile_throughput-1k_prefill)")
    parser.add_argument("--profile-latency-steps", type=int, default=0,
                        help="trace this many batch-1 decode steps after the latency runs, with µs a step by kind "
                             "(DIR/profile_latency_decode)")
    parser.add_argument("--host-profile-steps", type=int, default=0,
                        help="cProfile this many steady decode steps of throughput-1k, after the trace if any "
                             "(DIR/host_profile_throughput-1k/host_profile.txt)")
    args = parser.parse_args()
    if args.activation_scales == "static" and args.quantization != "fp8":
        parser.error("--activation-scales static needs --quantization fp8")

    log = Log()
    results_path = args.out / f"{NAME}.json"
    results = json.loads(results_path.read_text()) if args.resume and results_path.exists() else {}
    results["info"] = header(log)
    results.setdefault("workloads", {})
    results.setdefault("engines", {})
    workloads = args.workloads.split(",")
    hf = json.loads(args.hf.read_text()) if args.hf and args.hf.exists() else {}

    def save():
        write_results(args.out, NAME, results, markdown(results), log)

    def scaled(n):
        return max(1, int(round(n * args.scale)))

    cached_before = compilation_cache_files()  # before this run adds anything
    results["ceilings"] = measure_ceilings(log)
    main_loads = [w for w in workloads if w != "throughput-nano"]
    if main_loads:
        model = random_model(args.shape, quantization=args.quantization)
        if args.activation_scales == "static":
            model = calibrated_on_random_tokens(model, log)
        if args.via_orbax:
            model = through_orbax(model, args.via_orbax, log)
        if args.structured_fraction:
            from structured_output_host import load_tokenizer

            # Prompts are token ids and nothing is decoded for the results: only grammars use it.
            model.tokenizer = load_tokenizer(args.structured_tokenizer)
        engine, engine_info = build_engine(
            model, max_model_len=2048, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            page_size=args.page_size, memory_utilization=args.memory_utilization, log=log, num_pages=args.num_pages,
            kv_cache_dtype=args.kv_cache_dtype, attention_impl=args.attention_impl, admission=args.admission,
        )
        results["engines"][args.shape] = {**engine_info, "activation_scales": model.config.activation_scales}
        if "startup" in workloads:
            # Cold when the persistent compilation cache was empty, warm when an earlier run filled it.
            key = ("startup-warm" if cached_before else "startup") + ("-orbax" if args.via_orbax else "")
            results["workloads"][key] = {"shape": args.shape, "cache_files_before": cached_before, **engine_info}
        save()
        if "latency" in workloads:
            per_token = decode_weight_bytes(model.weights)  # fp8 payloads at 1 byte: the fp8 roofline
            w = latency(engine, per_token, results["ceilings"]["hbm_read_tbs"], log)
            if args.profile_latency_steps:
                w["trace"] = trace_latency_steps(engine, args.out / "profile_latency_decode",
                                                 args.profile_latency_steps, log)
            if "latency" in hf:
                w["hf_tpot_ms"] = hf["latency"]["tpot_ms"]
            results["workloads"]["latency"] = {"shape": args.shape, **w}
            save()
        if "batch128" in workloads:
            n, length = scaled(128), scaled(256)
            rng = np.random.default_rng(0)
            w, _, _ = run_requests(engine, random_prompts(rng, [length] * n, model.config.vocab_size), [length] * n, "b128")
            hf_batch = hf.get("generate_batch", {})
            if hf_batch.get("output_tokens_per_s"):
                w["hf_output_tokens_per_s"] = hf_batch["output_tokens_per_s"]
                w["ratio_to_hf"] = w["output_tokens_per_s"] / hf_batch["output_tokens_per_s"]
            log(f"batch128: {w['output_tokens_per_s']:.0f} output tok/s; HF generate_batch "
                f"{w.get('hf_output_tokens_per_s', float('nan')):.0f} -> {w.get('ratio_to_hf', float('nan')):.1f}x")
            results["workloads"]["batch128"] = {"shape": args.shape, **w}
            save()
        if "decode256" in workloads:
            n = min(256, args.max_num_seqs, scaled(256))
            w = decode_host_time(engine, n, scaled(256), scaled(256), log)
            results["workloads"]["decode256"] = {"shape": args.shape, **w}
            save()
        if "throughput-1k" in workloads:
            n, length = scaled(1000), scaled(1000)
            prefill_profile = (DecodeProfiler(args.out / "profile_throughput-1k_prefill", args.profile_prefill_steps,
                                              min_running=max(1, min(n, args.max_num_seqs) // 4), log=log,
                                              phase="prefill", settle_steps=1)
                               if args.profile_prefill_steps else None)
            profile = (DecodeProfiler(args.out / "profile_throughput-1k_decode", args.profile_steps,
                                      min_running=max(1, min(n, args.max_num_seqs) // 2), log=log,
                                      after=prefill_profile)
                       if args.profile_steps else None)
            if prefill_profile is not None:
                prefill_profile.after = profile
            host_profile = (HostProfiler(args.out / "host_profile_throughput-1k", args.host_profile_steps,
                                         min_running=max(1, min(n, args.max_num_seqs) // 2), after=profile, log=log)
                            if args.host_profile_steps else None)
            w = throughput(engine, [length] * n, [length] * n, "throughput-1k", log, profile, host_profile=host_profile,
                           prefill_profile=prefill_profile)
            results["workloads"]["throughput-1k"] = {"shape": args.shape, **w}
            save()
        if args.structured_fraction:
            n, length = scaled(1000), scaled(1000)
            w = throughput(engine, [length] * n, [length] * n, "throughput-1k-structured", log,
                           structured_fraction=args.structured_fraction)
            unconstrained = results["workloads"].get("throughput-1k", {}).get("output_tokens_per_s")
            if unconstrained:
                w["ratio_to_unconstrained"] = w["output_tokens_per_s"] / unconstrained
            log(f"throughput-1k-structured ({args.structured_fraction:.0%}): {w['output_tokens_per_s']:.0f} output "
                f"tok/s, {w.get('ratio_to_unconstrained', float('nan')):.1%} of unconstrained; mask fill p50 "
                f"{w.get('mask_fill_ms_p50', float('nan')):.2f} ms, p99 {w.get('mask_fill_ms_p99', float('nan')):.2f} ms")
            results["workloads"]["throughput-1k-structured"] = {"shape": args.shape, **w}
            save()
        del engine, model
        gc.collect()
    if "throughput-nano" in workloads:
        model = random_model(args.nano_shape)
        engine, engine_info = build_engine(
            model, max_model_len=2048, max_num_seqs=min(256, args.max_num_seqs),
            max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
            memory_utilization=args.memory_utilization, log=log, num_pages=args.num_pages,
            kv_cache_dtype=args.kv_cache_dtype, attention_impl=args.attention_impl, admission=args.admission,
        )
        results["engines"][args.nano_shape] = engine_info
        rng = np.random.default_rng(0)
        n = scaled(256)
        prompt_lens = rng.integers(scaled(100), scaled(1024) + 1, size=n)
        output_lens = rng.integers(scaled(100), scaled(1024) + 1, size=n)
        w = throughput(engine, prompt_lens.tolist(), output_lens.tolist(), "throughput-nano", log)
        results["workloads"]["throughput-nano"] = {"shape": args.nano_shape, **w}
        save()
    save()


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    main()

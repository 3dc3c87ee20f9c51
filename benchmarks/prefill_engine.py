"""Issue 21: the fresh-prefill attention path inside the engine, against the default, in one run.

    python3 benchmarks/prefill_engine.py --out DIR [--impls pallas_gpu,pallas_gpu_fresh_prefill_cudnn_segments] \
        [--prompt-lens 4096,16384,32768] [--repeats 3] [--mix-requests 32] [--budget-s 225]
    python3 benchmarks/prefill_engine.py --out /tmp/pe --smoke   # CPU: tiny model, script check only

For each ``attention_impl`` in turn, one engine (Llama-3.1-8B shapes, random bf16 weights, the
same model object) built with it, then freed before the next:

- ``compile``: programs compiled by the engine's warm-up and its seconds, with the number of
  entries in JAX's persistent compilation cache before it (0: cold). The fresh path adds one
  Mosaic GPU kernel per window length to every prefill-heavy bucket's program; the branchless
  one, one kernel.
- ``ttft``: batch 1, a fresh random prompt of each length with ``max_tokens=1`` (the request is
  its prefill), arrival to first token, median of ``--repeats`` (a first, untimed request of
  each length touches its programs once). Also the host seconds spent inside dispatch for it:
  on the GPU a device conditional waits for the host there, so a path with one per layer shows
  it as dispatch time close to the step's device time.
- ``mix``: a prefill-heavy mix like ``throughput-1k``'s admission phase: ``--mix-requests``
  requests, prompt lengths uniform in [1024, 8192] (seed 0), 32 output tokens each, all
  submitted at once; wall seconds, input tokens per second, steps, and dispatch seconds.
- ``agreement``: each request's first token against the first impl's, on the same prompts
  (random weights and bf16 vs the fresh path's float16 window: an argmax may flip now and then).

The default token budget (``--max-num-batched-tokens 32768``) lets a 32k prompt be one fresh
chunk; with the engine's default (8192) a long prompt's later chunks have a cached prefix and
always take the Triton kernel. Results are written after every phase (DIR/prefill_engine.json
and .md); a phase that would start past ``--budget-s`` is skipped and recorded as such.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import Log, header, measure_ceilings, random_model, random_prompts, write_results  # noqa: E402
from engine_throughput import compilation_cache_files, run_requests  # noqa: E402

from jaxinfer.attention import resolve_impl  # noqa: E402
from jaxinfer.engine import Engine, EngineConfig  # noqa: E402
from jaxinfer.memory import num_pages_for_device, pages_for  # noqa: E402

NAME = "prefill_engine"
MIX_PROMPT_RANGE = (1024, 8192)
MIX_OUTPUT_TOKENS = 32


def pages_needed(args, mix_range: tuple[int, int]) -> int:
    """Pages for the whole mix at once plus the longest TTFT prompt (and the scratch page), with 10% spare.

    Sized by the workload, not by free memory: the second engine is built after the first is
    freed, and a pool sized from what is free then would depend on when the allocator gave it back.
    """
    mix = args.mix_requests * pages_for(mix_range[1] + MIX_OUTPUT_TOKENS, args.page_size)
    return int(1.1 * (mix + pages_for(max(args.prompt_lens) + 64, args.page_size))) + 1


def build(model, impl: str, args, mix_range: tuple[int, int], log) -> tuple[Engine, dict]:
    max_model_len = max(args.prompt_lens) + 64
    num_pages = args.num_pages or pages_needed(args, mix_range)
    if jax.default_backend() != "cpu":  # never more than the device holds
        num_pages = min(num_pages, num_pages_for_device(
            model.config, page_size=args.page_size, bytes_per_element=model.weights.embed.dtype.itemsize,
            memory_utilization=args.memory_utilization, reserve_bytes=4 << 30))
    config = EngineConfig(max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
                          num_pages=num_pages, attention_impl=impl)
    cached_before = compilation_cache_files()
    start = time.perf_counter()
    engine = Engine(model, config, warm_up=True, use_tqdm=False)
    seconds = time.perf_counter() - start
    info = {"attention_impl": impl, "resolves_to": resolve_impl(impl, head_dim=model.config.head_dim),
            "num_programs": engine.runner.num_programs, "compile_seconds": seconds,
            "cache_files_before": cached_before, "num_pages": num_pages,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs}
    log(f"{impl} (runs as {info['resolves_to']}): {info['num_programs']} programs compiled in {seconds:.1f} s "
        f"({cached_before} cache entries before: {'warm' if cached_before else 'cold'})")
    return engine, info


def ttft(engine, impl: str, lens: list[int], repeats: int, log) -> tuple[dict, dict]:
    """Median arrival-to-first-token per prompt length at batch 1; first tokens by prompt."""
    vocab = engine.model_config.vocab_size
    result, first_tokens = {}, {}
    for n in lens:
        rng = np.random.default_rng(n)  # the same prompts for every impl, new ones per repeat
        times, dispatch, steps = [], [], []
        for r in range(repeats + 1):  # request 0 touches this length's programs once, untimed
            summary, outputs, step_log = run_requests(engine, random_prompts(rng, [n], vocab), [1], f"ttft{n}-{r}")
            m = outputs[0].metrics
            if r:
                times.append(m.first_token_time - m.arrival_time)
                dispatch.append(sum(s["dispatch"] for s in step_log))
                steps.append(summary["num_steps"])
            first_tokens[f"ttft{n}-{r}"] = outputs[0].outputs[0].token_ids[0]
        result[str(n)] = {"ttft_ms": 1e3 * statistics.median(times), "all_ms": [1e3 * t for t in times],
                          "dispatch_ms": 1e3 * statistics.median(dispatch), "num_steps": steps[0]}
        log(f"{impl} ttft {n} tokens: {result[str(n)]['ttft_ms']:.1f} ms (runs "
            f"{[round(1e3 * t, 1) for t in times]}), {steps[0]} step(s), "
            f"{result[str(n)]['dispatch_ms']:.1f} ms of it in dispatch")
    return result, first_tokens


def mix(engine, impl: str, num_requests: int, prompt_range: tuple[int, int], log) -> tuple[dict, dict]:
    rng = np.random.default_rng(0)
    lens = rng.integers(prompt_range[0], prompt_range[1] + 1, size=num_requests).tolist()
    prompts = random_prompts(rng, lens, engine.model_config.vocab_size)
    summary, outputs, steps = run_requests(engine, prompts, [MIX_OUTPUT_TOKENS] * num_requests, "mix")
    dispatch = sum(s["dispatch"] for s in steps)
    result = {"num_requests": num_requests, "input_tokens": summary["input_tokens"], "seconds": summary["seconds"],
              "input_tokens_per_s": summary["input_tokens"] / summary["seconds"],
              "total_tokens_per_s": summary["total_tokens_per_s"], "num_steps": summary["num_steps"],
              "dispatch_seconds": dispatch, "preemptions": summary["preemptions"],
              "compilations_after_warmup": summary["compilations_after_warmup"]}
    log(f"{impl} mix: {num_requests} requests, {summary['input_tokens']} prompt tokens in {summary['seconds']:.2f} s "
        f"({result['input_tokens_per_s']:.0f} prompt tok/s), {summary['num_steps']} steps, {dispatch:.2f} s in "
        f"dispatch, compilations after warm-up {summary['compilations_after_warmup']}")
    return result, {o.request_id: o.outputs[0].token_ids[0] for o in outputs}


def markdown(results: dict) -> str:
    info = results["info"]
    lines = ["# Prefill attention inside the engine (issue 21)", "",
             f"Command: `{info['command']}`  ", f"Hardware: {info['device']}, jax {info['jax']}, {info['date']}", ""]
    c = results.get("ceilings")
    if c:
        lines += [f"Ceilings in this run: bf16 matmul {c['matmul_tflops']:.0f} TFLOP/s, HBM read "
                  f"{c['hbm_read_tbs']:.2f} TB/s.", ""]
    impls = list(results["impls"])
    lens = sorted({n for r in results["impls"].values() for n in r.get("ttft", {})}, key=int)
    lines += ["| | " + " | ".join(impls) + " |", "|" + " --- |" * (len(impls) + 1)]

    def row(label, cell):
        lines.append(f"| {label} | " + " | ".join(cell(results["impls"][i]) for i in impls) + " |")

    row("programs, compile s", lambda r: f"{r['engine']['num_programs']}, {r['engine']['compile_seconds']:.1f} "
        f"({'warm' if r['engine']['cache_files_before'] else 'cold'})" if "engine" in r else "–")
    for n in lens:
        row(f"TTFT {n} tokens, ms (dispatch ms)", lambda r, n=n: (
            f"{r['ttft'][n]['ttft_ms']:.1f} ({r['ttft'][n]['dispatch_ms']:.1f})" if n in r.get("ttft", {}) else "–"))
    row("mix: prompt tok/s, s (dispatch s)", lambda r: (
        f"{r['mix']['input_tokens_per_s']:.0f}, {r['mix']['seconds']:.2f} ({r['mix']['dispatch_seconds']:.2f})"
        if "mix" in r else "–"))
    row("first tokens equal to the first impl's", lambda r: (
        f"{r['agreement']:.0%}" if "agreement" in r else "–"))
    skipped = [f"- {i}: {', '.join(r['skipped'])}" for i, r in results["impls"].items() if r.get("skipped")]
    if skipped:
        lines += ["", "Skipped (out of time):", *skipped]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    # Triton alone against Hopper's default ("auto" there: jaxinfer.attention.HOPPER_AUTO_IMPL).
    parser.add_argument("--impls", default="pallas_gpu,pallas_gpu_fresh_prefill_cudnn_segments")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--prompt-lens", default="4096,16384,32768")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mix-requests", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=32768)
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--memory-utilization", type=float, default=0.9)
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV pages per engine (default: what the mix and the longest prompt need)")
    parser.add_argument("--budget-s", type=float, default=225.0, help="start no phase after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="CPU check of this script: tiny model and lengths")
    args = parser.parse_args()
    mix_range = MIX_PROMPT_RANGE
    if args.smoke:
        args.shape, args.prompt_lens, args.repeats, args.mix_requests = "tiny", "48,96", 1, 3
        args.max_num_seqs, args.max_num_batched_tokens, mix_range = 4, 128, (16, 64)
        if args.impls == parser.get_default("impls"):
            args.impls = "reference,cpu"
    args.prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    start = time.perf_counter()
    log = Log()
    results = {"info": header(log), "impls": {}}
    save = lambda: write_results(args.out, NAME, results, markdown(results), log)  # noqa: E731
    if not args.smoke:
        results["ceilings"] = measure_ceilings(log)
    model = random_model(args.shape)
    reference_tokens: dict | None = None
    for impl in args.impls.split(","):
        r = results["impls"][impl] = {"skipped": []}
        if time.perf_counter() - start > args.budget_s:
            r["skipped"].append("engine")
            continue
        engine, r["engine"] = build(model, impl, args, mix_range, log)
        save()
        tokens = {}
        if time.perf_counter() - start <= args.budget_s:
            r["ttft"], first = ttft(engine, impl, args.prompt_lens, args.repeats, log)
            tokens.update(first)
            save()
        else:
            r["skipped"].append("ttft")
        if time.perf_counter() - start <= args.budget_s:
            r["mix"], first = mix(engine, impl, args.mix_requests, mix_range, log)
            tokens.update(first)
            save()
        else:
            r["skipped"].append("mix")
        if reference_tokens is None:
            reference_tokens = tokens
        shared = [k for k in tokens if k in reference_tokens]
        if shared:
            r["agreement"] = sum(tokens[k] == reference_tokens[k] for k in shared) / len(shared)
        del engine
        gc.collect()
        save()
    log(f"total {time.perf_counter() - start:.0f} s")
    save()
    print(markdown(results))


if __name__ == "__main__":
    main()

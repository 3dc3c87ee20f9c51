"""How long each step program takes to compile, one at a time (Llama-3.1-8B shapes, random weights).

    python3 benchmarks/compile_time.py --out DIR [--quantization fp8] [--kv-cache-dtype fp8] [--tokens 8,128,2048]
        [--activation-scales static] [--attention-impl pallas_gpu] [--shared-kernels]

Why it exists: the engine compiles its step programs on a thread pool at warm-up, so a slow or
hung program is hidden among the others (session 7's FP8 engine was still compiling after
170 s, with XLA's GEMM autotuner warning that its timings were contended). This builds the same
``ModelRunner`` as the engine and compiles the forward of each token bucket serially, printing
and flushing the seconds of each before the next starts, so a run cut short by a time limit
still says which program it was on. Run it under different ``XLA_FLAGS`` (e.g.
``--xla_gpu_autotune_level=0``) to see what the compiler spends the time on.
Writes DIR/compile_time.json (appended per program).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
from common import Log, calibrated_on_random_tokens, header, random_model  # noqa: E402

from jaxinfer.attention import shared_kernel_programs  # noqa: E402
from jaxinfer.runner import ModelRunner  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--quantization", choices=["fp8", "int8"], default=None)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--tokens", default="8,128,2048", help="token buckets to compile, in this order")
    parser.add_argument("--max-num-seqs", type=int, default=384)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--num-pages", type=int, default=2048)
    parser.add_argument("--activation-scales", choices=["dynamic", "static"], default="dynamic",
                        help="fp8 W8A8 activation scales; static: calibrated on random tokens first (as engine_throughput.py)")
    parser.add_argument("--attention-impl", default="auto",
                        help="the engine's attention path (auto; pallas_gpu: no fresh-prefill branches)")
    parser.add_argument("--shared-kernels", action="store_true",
                        help="first compile the kernels the buckets share (jaxinfer.attention.shared_kernel_programs), "
                             "as warm-up does, each timed")
    parser.add_argument("--tag", default="", help="a name for this run's rows (e.g. the XLA flags tried)")
    args = parser.parse_args()
    if args.activation_scales == "static" and args.quantization != "fp8":
        parser.error("--activation-scales static needs --quantization fp8")

    args.out.mkdir(parents=True, exist_ok=True)
    log = Log()
    results = {"header": header(log), "tag": args.tag, "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
               "activation_scales": args.activation_scales, "attention_impl": args.attention_impl, "programs": []}
    path = args.out / f"compile_time{('.' + args.tag) if args.tag else ''}.json"

    start = time.perf_counter()
    model = random_model(args.shape, quantization=args.quantization)
    jax.block_until_ready(model.weights)
    if args.activation_scales == "static":
        model = calibrated_on_random_tokens(model, log)
    results["model_seconds"] = time.perf_counter() - start
    log(f"model {args.shape} quantization={args.quantization} made in {results['model_seconds']:.1f} s")
    runner = ModelRunner(model, num_pages=args.num_pages, page_size=32, max_model_len=4096,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         kv_cache_dtype=args.kv_cache_dtype, attention_impl=args.attention_impl)
    by_tokens = {t: (t, b, p) for t, b, p in runner.buckets.all()}
    tokens = [int(x) for x in args.tokens.split(",")]
    if args.shared_kernels:
        wanted = [by_tokens[t] for t in tokens if t in by_tokens]
        for name, lower in shared_kernel_programs(args.attention_impl, model.config, [(t, b) for t, b, _ in wanted]):
            begin = time.perf_counter()
            lowered = lower()
            lowering = time.perf_counter() - begin
            begin = time.perf_counter()
            lowered.compile()
            compiled = time.perf_counter() - begin
            results.setdefault("shared_kernels", []).append(
                {"name": name, "lowering_seconds": lowering, "compile_seconds": compiled})
            log(f"{name}: lowered in {lowering:.1f} s, compiled in {compiled:.1f} s")
            path.write_text(json.dumps(results, indent=1))
    for t in tokens:
        if t not in by_tokens:
            log(f"no bucket of {t} tokens (buckets: {sorted(by_tokens)})")
            continue
        inputs = runner.empty_inputs(*by_tokens[t])
        begin = time.perf_counter()
        lowered = runner._lower(inputs)
        lowering = time.perf_counter() - begin
        begin = time.perf_counter()
        lowered.compile()
        compiled = time.perf_counter() - begin
        begin = time.perf_counter()
        jax.block_until_ready(runner.execute(inputs))
        first_run = time.perf_counter() - begin
        options = runner._step.compiler_options(t)  # per token count: jaxinfer.compile_options
        results["programs"].append({"bucket": by_tokens[t], "lowering_seconds": lowering, "compile_seconds": compiled,
                                    "first_run_seconds": first_run, "compiler_options": options})
        log(f"bucket {by_tokens[t]}: lowered in {lowering:.1f} s, compiled in {compiled:.1f} s, first run "
            f"{first_run:.2f} s, options {options}")
        path.write_text(json.dumps(results, indent=1))
    log(f"done in {time.perf_counter() - start:.1f} s -> {path}")


if __name__ == "__main__":
    main()
